"""Fused CPU fast path of the Disk Sparse Adam row update (Numba), used when weights are on CPU.

Per unique row: sum the row's duplicate gradient rows, update its ``[m | v]`` record in place
straight in the memory-mapped state file, then update the weight row in place; the update is that of
``reference.sparse_adam_rows``. The compiled kernels are in ``_cpu_numba.py`` (cached on disk); they
run on ``torch.get_num_threads()`` threads.

The vectorised torch path makes about twelve passes over ``(n, D)`` temporaries plus a gather, a
scatter and a coalesce. On the seed configuration (1M x 128, batch 2048, one thread) the step is
bound by memory traffic on the 2048 scattered rows (a 1 KiB record and a 512 B weight row each):
the moments pass costs ~0.3 ms when the same rows are contiguous and ~0.45-1.0 ms scattered.
Prefetching the weight rows during the moments pass cut the weights pass from ~0.7 to ~0.15 ms;
splitting each row's update into simple loops and the numpy error model let them vectorise; reused
scratch buffers avoid ~1000 page faults per step.

Bitwise agreement with ``torch.optim.SparseAdam`` (float32 and float64): the operations and their
order are those of the reference, scalars are rounded to the state dtype as torch rounds a Python
scalar, duplicates are summed in the order of ``indices.sort()``'s permutation (the order
``Tensor.coalesce`` uses; torch's CPU sort is not stable, so a faster stable radix sort is used
only where no row occurs three times or more, and the order of a sum of two does not matter), and
Numba is run without fastmath, so no FMA contraction or reassociation. The square root must be
torch's: torch's CPU sqrt (MKL's vector sqrt) is not always correctly rounded, so ``np.sqrt`` gives
other bits for 1e-5 to 17% of inputs depending on the CPU. Where ``vml_sqrt`` finds that function in
torch's library (and checks that it reproduces ``torch.sqrt``), the whole update is one pass over
tiles of rows that calls it per tile (``tiled``); otherwise it is two passes around ``Tensor.sqrt_``
on the ``(n, D)`` new v (``moments``, ``weights``), 5-10% slower on the seed configuration.
``bitwise=False`` uses a correctly rounded sqrt in one pass (``fused``) and never ``Tensor.sort``.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from .._threads import numba_threads
from . import vml_sqrt

try:
    import numba

    AVAILABLE = True
except ImportError:  # numba is optional: the torch path computes the same update
    numba = None
    AVAILABLE = False

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


def _sorted_rows(K, indices: torch.Tensor, n_table_rows: int, sort_bufs, counts, starts, coalesce_order=True):
    """(sorted indices, permutation, number of unique rows) as numpy, duplicates in coalesce's order.

    A stable radix sort in numba when no row occurs three times or more (the order of a sum of two
    is immaterial) or ``coalesce_order`` is False; otherwise ``Tensor.sort``, whose order
    ``Tensor.coalesce`` (and so SparseAdam) uses: on the KG configuration, 6144 Zipf indices, it
    costs ~0.2 ms a step, against ~0.05 ms for the radix sort. Raises ``IndexError`` for rows
    outside the table.
    """
    n = indices.shape[0]
    keys, perm = sort_bufs[0, :n], sort_bufs[1, :n]
    if not K.radix_sort(indices.numpy(), n_table_rows, keys, perm, sort_bufs[2, :n], sort_bufs[3, :n], counts):
        raise IndexError(f"sparse gradient rows must lie in [0, {n_table_rows}), got "
                         f"{int(indices.min())}..{int(indices.max())}")
    n_rows, longest = K.segments(keys, n_table_rows, starts)
    if coalesce_order and longest >= 3:
        # The sorted keys and their runs stay; only the order of equal keys differs. Into the radix
        # scratch rows (free again): fresh output tensors cost ~20 page faults a call.
        perm = sort_bufs[3, :n]
        torch.sort(indices, out=(torch.from_numpy(sort_bufs[2, :n]), torch.from_numpy(perm)))
    return keys, perm, n_rows


def adam_rows_cpu_(weight: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, records, step: int, *,
                   lr: float, beta1: float, beta2: float, eps: float, maximize: bool = False,
                   bitwise: bool = True) -> None:
    """Update ``weight`` (N, D) and ``records`` (numpy (N, 2D) view of the state file) in place.

    ``indices`` (int64, may repeat) and ``values`` (nnz, D) are the uncoalesced sparse gradient.
    ``weight``, ``values`` and ``records`` share one dtype (float32 or float64), all on CPU.
    ``bitwise=False`` runs the update as one fused pass with a correctly rounded sqrt and sums
    duplicate rows in the order of the stable radix sort (the result differs from SparseAdam's by
    the rounding of sqrt where torch's is not correctly rounded, and by the rounding of sums of
    three or more duplicates).
    """
    from . import _cpu_numba as K

    starts, rows, mbuf, vbuf, sort_bufs, counts = _scratch(indices.shape[0], values.shape[1], weight.dtype)
    s_np, perm, n_rows = _sorted_rows(K, indices.contiguous(), weight.shape[0], sort_bufs, counts, starts,
                                      coalesce_order=bitwise)
    threads = numba_threads() if n_rows >= _PARALLEL_MIN_ROWS else 1
    ty = records.dtype.type
    w = weight.detach().numpy()
    step_size = lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
    if not bitwise:
        fused = K.fused_parallel if threads > 1 else K.fused
        fused(s_np, perm, starts, n_rows, values.contiguous().numpy(), records, w, ty(1 - beta1), ty(1 - beta2),
              ty(eps), ty(-step_size), bool(maximize), threads)
        return
    sqrt_fn = vml_sqrt.address(weight.dtype)
    if sqrt_fn is not None:
        tiled = K.tiled_parallel if threads > 1 else K.tiled
        tiled(s_np, perm, starts, n_rows, values.contiguous().numpy(), records, w, ty(1 - beta1), ty(1 - beta2),
              ty(eps), ty(-step_size), bool(maximize), threads, max(1, _TILE_ELEMENTS // values.shape[1]), sqrt_fn,
              vml_sqrt.MODE, vml_sqrt.threads_local_address())
        return
    moments, weights = (K.moments_parallel, K.weights_parallel) if threads > 1 else (K.moments, K.weights)
    moments(s_np, perm, starts, n_rows, values.contiguous().numpy(), records, w, rows, mbuf,
            vbuf.numpy(), ty(1 - beta1), ty(1 - beta2), bool(maximize), threads)
    sqrt_v = vbuf[:n_rows].sqrt_()  # torch's sqrt: see the module docstring
    weights(rows, n_rows, mbuf, sqrt_v.numpy(), ty(eps), w, ty(-step_size), threads)
