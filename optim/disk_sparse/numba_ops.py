"""Numba CPU path of the Disk Sparse Adam row updates (lazy Adam; the ball: ``riemannian_adam_*``; their
compact formats: ``compact_*``).

``adam_sparse_`` is the fused table update for CPU weights: per unique row of the uncoalesced sparse
gradient, sum the row's duplicate gradient rows, update its ``[m | v]`` record in place straight in
the memory-mapped state file, then update the weight row in place, with no coalesce, gather or
scatter. ``adam_rows_`` runs the same kernels on gathered unique rows, with the signature every
backend shares (``torch_ops``, ``triton_ops``). The update is that of
``reference.sparse_adam_rows``. The compiled kernels are in ``_numba_kernels.py`` (cached on disk);
they run on ``torch.get_num_threads()`` threads (``optim/_threads.py``). The torch path makes about
twelve passes over ``(n, D)`` temporaries; these kernels make one or two, bring the scattered
rows into the CPU caches a few rows ahead and reuse scratch buffers across steps (fresh ones cost a
page fault per 4 KiB); ``experiments/dsa_throughput.py`` times them against ``torch.optim.SparseAdam``.

Bitwise agreement with ``torch.optim.SparseAdam`` (float32 and float64): the operations and their
order are those of the reference, scalars are rounded to the state dtype as torch rounds a Python
scalar, duplicates are summed in the order of ``indices.sort()``'s permutation (the order
``Tensor.coalesce`` uses; torch's CPU sort is not stable, so a faster stable radix sort is used
only where no row occurs three times or more, and the order of a sum of two does not matter), and
Numba is run without fastmath, so no FMA contraction or reassociation. The square root must be
torch's: torch's CPU sqrt (MKL's vector sqrt) is not always correctly rounded, so ``np.sqrt`` gives
other bits for some inputs, how many depending on the CPU. Where ``vml_sqrt`` finds that function in
torch's library (and checks that it reproduces ``torch.sqrt``), the whole update is one pass over
tiles of rows that calls it per tile (``tiled``); otherwise it is two passes around ``Tensor.sqrt_``
on the ``(n, D)`` new v (``moments``, ``weights``), still a few times faster than the torch path.
``bitwise=False`` uses a correctly rounded sqrt in one pass (``fused``) and never ``Tensor.sort``.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from .._threads import numba_threads
from . import vml_sqrt

# Weight (and state) dtypes of the kernels.
WEIGHT_DTYPES = (torch.float32, torch.float64)
_PARALLEL_MIN_ROWS = 256  # below this a parallel launch costs more than it saves
_TILE_ELEMENTS = 2048  # v values per sqrt call in the tiled kernel (8 KiB of float32: stays in L1)
_local = threading.local()  # scratch buffers per thread: optimizers may step in several threads


def _scratch(n, d, dtype):
    """Reused per-(D, dtype) buffers: fresh 1 MiB arrays cost a page fault per 4 KiB every step."""
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    bufs = buffers.get((d, dtype))
    if bufs is None or bufs[0].shape[0] < n + 1:
        n = max(n + 1, 2 * bufs[0].shape[0]) if bufs is not None else n + 1
        bufs = (np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64),
                torch.empty((n, d), dtype=dtype).numpy(), torch.empty((n, d), dtype=dtype),
                np.empty((4, n), dtype=np.int64), np.empty(2048, dtype=np.int64))
        buffers[(d, dtype)] = bufs
    return bufs


def _sorted_rows(kernels, indices: torch.Tensor, n_table_rows: int, sort_bufs, counts, starts, coalesce_order=True):
    """(sorted indices, permutation, number of unique rows) as numpy, duplicates in coalesce's order.

    A stable radix sort in numba when no row occurs three times or more (the order of a sum of two
    is immaterial) or ``coalesce_order`` is False; otherwise ``Tensor.sort``, whose order
    ``Tensor.coalesce`` (and so SparseAdam) uses, at a few times the radix sort's cost. Raises
    ``IndexError`` for rows outside the table.
    """
    n = indices.shape[0]
    keys, perm = sort_bufs[0, :n], sort_bufs[1, :n]
    if not kernels.radix_sort(indices.numpy(), n_table_rows, keys, perm, sort_bufs[2, :n], sort_bufs[3, :n], counts):
        raise IndexError(f"sparse gradient rows must lie in [0, {n_table_rows}), got "
                         f"{int(indices.min())}..{int(indices.max())}")
    n_rows, longest = kernels.segments(keys, n_table_rows, starts)
    if coalesce_order and longest >= 3:
        # The sorted keys and their runs stay; only the order of equal keys differs. Into the radix
        # scratch rows (free again): fresh output tensors cost page faults every call.
        perm = sort_bufs[3, :n]
        torch.sort(indices, out=(torch.from_numpy(sort_bufs[2, :n]), torch.from_numpy(perm)))
    return keys, perm, n_rows


def _uncoalesced(kernels, indices, values, n_table_rows, dtype, coalesce_order=False):
    """(the sorted unique rows the kernels take, the scratch buffers) of an uncoalesced gradient."""
    if indices.device.type != "cpu" or indices.dim() != 1 or indices.dtype != torch.int64 \
            or indices.shape[0] != values.shape[0]:
        raise ValueError(f"numba kernels take int64 CPU row indices of shape ({values.shape[0]},), one per "
                         f"gradient row; got {indices.dtype} {tuple(indices.shape)} on {indices.device}")
    bufs = _scratch(indices.shape[0], values.shape[1], dtype)
    starts, sort_bufs, counts = bufs[0], bufs[4], bufs[5]
    keys, perm, n_rows = _sorted_rows(kernels, indices.contiguous(), n_table_rows, sort_bufs, counts, starts,
                                      coalesce_order=coalesce_order)
    return (keys, perm, starts, n_rows), bufs


def _unique(n):
    """The sorted unique rows of ``n`` gathered rows: row u is unique row u (no sort, no duplicates)."""
    ident = np.arange(n + 1, dtype=np.int64)
    return ident[:n], ident[:n], ident, n


def adam_sparse_(weight: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, records: torch.Tensor,
                 step: int, *, lr: float, beta1: float, beta2: float, eps: float, maximize: bool = False,
                 bitwise: bool = True) -> None:
    """Update ``weight`` (N, D) and ``records`` (N, 2D) in place from an uncoalesced sparse gradient.

    ``indices`` (int64, may repeat) and ``values`` (nnz, D) are the gradient's; ``weight``,
    ``values`` and ``records`` share one dtype (float32 or float64), all on CPU. ``bitwise=False``
    runs the update as one fused pass with a correctly rounded sqrt and sums duplicate rows in the
    order of the stable radix sort (the result differs from SparseAdam's by the rounding of sqrt
    where torch's is not correctly rounded, and by the rounding of sums of three or more duplicates).
    """
    from . import _numba_kernels as kernels

    check_adam_buffers(weight, values, records, values.shape[0])
    rows, bufs = _uncoalesced(kernels, indices, values, weight.shape[0], weight.dtype, coalesce_order=bitwise)
    _launch(kernels, rows, values, records, weight, bufs, step,
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, maximize=maximize, bitwise=bitwise)


def adam_rows_(w, g, state, step, *, lr, beta1, beta2, eps, maximize=False, bitwise=True) -> None:
    """In-place lazy-Adam update of gathered unique rows (``torch_ops.adam_rows_``'s signature):
    ``w`` (n, D), ``g`` (n, D) and records ``state = [m | v]`` (n, 2D), all of one dtype on CPU."""
    from . import _numba_kernels as kernels

    _launch(kernels, _unique(w.shape[0]), g, state, w, _scratch(w.shape[0], w.shape[1], w.dtype), step,
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, maximize=maximize, bitwise=bitwise)


def check_adam_buffers(weight, values, records, n_values):
    """Refuse buffers the Adam kernels cannot take: the kernels index without bounds checks and call
    torch's sqrt on raw pointers of the weights' dtype, so ``weight`` (N, D), ``values``
    (``n_values``, D) and ``records`` (N, 2D, contiguous) must be CPU tensors of one dtype in
    ``WEIGHT_DTYPES``."""
    tensors = dict(weight=weight, values=values, records=records)
    if any(t.device.type != "cpu" for t in tensors.values()):
        raise ValueError("numba Adam kernels take CPU tensors, got "
                         + ", ".join(f"{k} on {t.device}" for k, t in tensors.items()))
    if weight.dtype not in WEIGHT_DTYPES or values.dtype != weight.dtype or records.dtype != weight.dtype:
        raise TypeError(f"numba Adam kernels take weights, gradient values and records of one dtype, float32 "
                        f"or float64; got {weight.dtype}, {values.dtype} and {records.dtype}")
    if weight.dim() != 2 or values.dim() != 2 or records.dim() != 2:
        raise ValueError("numba Adam kernels take 2-D weight, values and records, got "
                         f"{weight.dim()}-D, {values.dim()}-D and {records.dim()}-D")
    n, d = weight.shape
    if values.shape != (n_values, d) or records.shape != (n, 2 * d):
        raise ValueError(f"numba Adam kernels: weight {tuple(weight.shape)} needs values ({n_values}, {d}) and "
                         f"records ({n}, {2 * d}), got {tuple(values.shape)} and {tuple(records.shape)}")
    if not records.is_contiguous():
        raise ValueError("numba Adam kernels need contiguous records")


def _launch(kernels, sorted_rows, values, records, weight, bufs, step, *, lr, beta1, beta2, eps, maximize, bitwise):
    """Run the kernel ``bitwise`` and the machine call for: ``tiled`` (torch's sqrt found),
    ``moments`` + ``Tensor.sqrt_`` + ``weights`` (not found), or ``fused`` (``bitwise=False``)."""
    keys, perm, starts, n_rows = sorted_rows
    values = values.contiguous()
    check_adam_buffers(weight, values, records, perm.shape[0])
    threads = numba_threads() if n_rows >= _PARALLEL_MIN_ROWS else 1
    rec, w = records.detach().numpy(), weight.detach().numpy()
    ty = rec.dtype.type
    vals = values.numpy()
    neg_step = ty(float(-(lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step))))  # a tensor lr: its dtype
    c1, c2, eps, maximize = ty(1 - beta1), ty(1 - beta2), ty(eps), bool(maximize)
    parallel = threads > 1
    if not bitwise:
        fused = kernels.fused_parallel if parallel else kernels.fused
        fused(keys, perm, starts, n_rows, vals, rec, w, c1, c2, eps, neg_step, maximize, threads)
        return
    sqrt_fn = vml_sqrt.address(weight.dtype)
    if sqrt_fn is not None:
        tiled = kernels.tiled_parallel if parallel else kernels.tiled
        tiled(keys, perm, starts, n_rows, vals, rec, w, c1, c2, eps, neg_step, maximize, threads,
              max(1, _TILE_ELEMENTS // vals.shape[1]), sqrt_fn, vml_sqrt.MODE, vml_sqrt.threads_local_address())
        return
    rows, mbuf, vbuf = bufs[1], bufs[2], bufs[3]
    moments, weights = ((kernels.moments_parallel, kernels.weights_parallel) if parallel
                        else (kernels.moments, kernels.weights))
    moments(keys, perm, starts, n_rows, vals, rec, w, rows, mbuf, vbuf.numpy(), c1, c2, maximize, threads)
    sqrt_v = vbuf[:n_rows].sqrt_()  # torch's sqrt: see the module docstring
    weights(rows, n_rows, mbuf, sqrt_v.numpy(), eps, w, neg_step, threads)


# -- the compact state format (``compact.py``): float32 weights, one fused pass per row
def compact_adam_sparse_(weight, indices, values, records, step, *, lr, beta1, beta2, eps, maximize=False) -> None:
    """``adam_sparse_`` for compact records (uint8 ``(N, compact.record_bytes(D))``): the update of
    ``reference.compact_adam_rows`` per unique row of the uncoalesced gradient, in place; duplicates
    summed in the stable radix sort's order."""
    from . import _numba_kernels as kernels

    rows, _ = _uncoalesced(kernels, indices, values, weight.shape[0], torch.float32)
    _launch_compact(kernels, rows, values, records, weight, step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                    maximize=maximize)


def compact_adam_rows_(w, g, state, step, *, lr, beta1, beta2, eps, maximize=False) -> None:
    """``torch_ops.compact_adam_rows_`` (gathered unique rows, float32 ``w`` and ``g``) in numba."""
    from . import _numba_kernels as kernels

    _launch_compact(kernels, _unique(w.shape[0]), g, state, w, step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                    maximize=maximize)


def _launch_compact(kernels, sorted_rows, values, records, weight, step, *, lr, beta1, beta2, eps, maximize):
    from . import compact

    keys, perm, starts, n_rows = sorted_rows
    d = values.shape[1]
    if weight.dtype != torch.float32 or records.dtype != torch.uint8 or records.shape[1] != compact.record_bytes(d):
        raise TypeError(f"compact numba kernels take float32 weights and uint8 records of width "
                        f"{compact.record_bytes(d)}, got {weight.dtype} and {records.dtype} {tuple(records.shape)}")
    if not records.is_contiguous():
        raise ValueError("compact numba kernels need contiguous records")
    if records.shape[0] != weight.shape[0] or weight.shape[1] != d or values.shape[0] != perm.shape[0]:
        raise ValueError(f"compact numba kernels: weight {tuple(weight.shape)}, records {tuple(records.shape)} "
                         f"and {perm.shape[0]} gradient rows of {tuple(values.shape)} do not match")
    threads = numba_threads() if n_rows >= _PARALLEL_MIN_ROWS else 1
    raw = records.detach().numpy()
    codes, floats = raw.view(np.int8), raw.view(np.float32)
    ty = np.float32
    neg_step = ty(float(-(lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step))))
    kernel = kernels.compact_parallel if threads > 1 else kernels.compact
    kernel(keys, perm, starts, n_rows, values.contiguous().to(torch.float32).numpy(), codes, floats,
           weight.detach().numpy(), ty(1 - beta1), ty(1 - beta2), ty(eps), neg_step, bool(maximize), threads)


# -- the Poincaré ball: Riemannian Adam, one fused pass per unique row
def riemannian_adam_sparse_(weight, indices, values, records, step, *, lr, beta1, beta2, eps, c, exact) -> None:
    """Riemannian Adam (``reference.riemannian_adam_rows``) in place on ``weight`` (N, D) and records
    ``[m | v]`` (N, D + 1) from an uncoalesced sparse gradient (``indices``, ``values`` (nnz, D));
    duplicates summed in the stable radix sort's order, in float64."""
    from . import _numba_kernels as kernels

    rows, _ = _uncoalesced(kernels, indices, values, weight.shape[0], weight.dtype)
    _launch_ball(kernels, rows, values, records, weight, step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, c=c,
                 exact=exact)


def riemannian_adam_rows_(w, g, state, step, *, lr, beta1, beta2, eps, c, exact) -> None:
    """``torch_ops.riemannian_adam_rows_`` (gathered unique rows, records of width D + 1) in numba."""
    from . import _numba_kernels as kernels

    _launch_ball(kernels, _unique(w.shape[0]), g, state, w, step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, c=c,
                 exact=exact)


def _launch_ball(kernels, sorted_rows, values, records, weight, step, *, lr, beta1, beta2, eps, c, exact):
    from .poincare import max_norm

    keys, perm, starts, n_rows = sorted_rows
    d = values.shape[1]
    if weight.dtype not in WEIGHT_DTYPES or records.dtype != weight.dtype or values.dtype != weight.dtype:
        raise TypeError(f"the ball's numba kernel takes float32 or float64 weights, gradient values and records "
                        f"of one dtype, got {weight.dtype}, {values.dtype} and {records.dtype}")
    if records.dim() != 2 or records.shape != (weight.shape[0], d + 1) or weight.shape[1] != d \
            or values.shape[0] != perm.shape[0] or not records.is_contiguous():
        raise ValueError(f"the ball's numba kernel: weight {tuple(weight.shape)}, records {tuple(records.shape)} "
                         f"(contiguous, width D + 1) and {perm.shape[0]} gradient rows of {tuple(values.shape)} "
                         "do not match")
    if step < 1 or not c > 0:
        raise ValueError(f"the ball's numba kernel: step must be >= 1 and c > 0, got {step} and {c}")
    if n_rows == 0:
        return
    threads = numba_threads() if n_rows >= _PARALLEL_MIN_ROWS else 1
    kernel = kernels.ball_parallel if threads > 1 else kernels.ball
    kernel(keys, perm, starts, n_rows, values.contiguous().numpy(), records.detach().numpy(),
           weight.detach().numpy(), float(lr), float(beta1), float(beta2), 1 - beta1**step, 1 - beta2**step,
           float(eps), float(c), max_norm(c, weight.dtype), bool(exact), False, threads)


def compact_riemannian_adam_sparse_(weight, indices, values, records, step, *, lr, beta1, beta2, eps, c,
                                    exact) -> None:
    """``riemannian_adam_sparse_`` for compact records (uint8 ``(N, compact.record_bytes(D))``, float32
    weights): the update of ``reference.compact_riemannian_adam_rows`` per unique row, in place."""
    from . import _numba_kernels as kernels

    rows, _ = _uncoalesced(kernels, indices, values, weight.shape[0], torch.float32)
    _launch_ball_compact(kernels, rows, values, records, weight, step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, c=c,
                         exact=exact)


def compact_riemannian_adam_rows_(w, g, state, step, *, lr, beta1, beta2, eps, c, exact) -> None:
    """``torch_ops.compact_riemannian_adam_rows_`` (gathered unique rows, float32 ``w`` and ``g``) in numba."""
    from . import _numba_kernels as kernels

    _launch_ball_compact(kernels, _unique(w.shape[0]), g, state, w, step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                         c=c, exact=exact)


def _launch_ball_compact(kernels, sorted_rows, values, records, weight, step, *, lr, beta1, beta2, eps, c, exact):
    from . import compact
    from .poincare import max_norm

    keys, perm, starts, n_rows = sorted_rows
    d = values.shape[1]
    if weight.dtype != torch.float32 or records.dtype != torch.uint8 or records.shape[1] != compact.record_bytes(d):
        raise TypeError(f"the compact ball's numba kernel takes float32 weights and uint8 records of width "
                        f"{compact.record_bytes(d)}, got {weight.dtype} and {records.dtype} {tuple(records.shape)}")
    if not records.is_contiguous() or records.shape[0] != weight.shape[0] or weight.shape[1] != d \
            or values.shape[0] != perm.shape[0]:
        raise ValueError(f"the compact ball's numba kernel: weight {tuple(weight.shape)}, records "
                         f"{tuple(records.shape)} (contiguous) and {perm.shape[0]} gradient rows of "
                         f"{tuple(values.shape)} do not match")
    if step < 1 or not c > 0:
        raise ValueError(f"the compact ball's numba kernel: step must be >= 1 and c > 0, got {step} and {c}")
    if n_rows == 0:
        return
    threads = numba_threads() if n_rows >= _PARALLEL_MIN_ROWS else 1
    raw = records.detach().numpy()
    kernel = kernels.ball_compact_parallel if threads > 1 else kernels.ball_compact
    kernel(keys, perm, starts, n_rows, values.contiguous().to(torch.float32).numpy(), raw.view(np.int8),
           raw.view(np.float32), weight.detach().numpy(), float(lr), float(beta1), float(beta2), 1 - beta1**step,
           1 - beta2**step, float(eps), float(c), max_norm(c, torch.float32), bool(exact), False, threads)
