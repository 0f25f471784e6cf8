"""The Gefen step in place on CPU tensors, compiled with numba: one kernel call per group.

``gefen_step_`` has the signature of :func:`optim.gefen.torch_ops.gefen_step_` and updates the same
fp32 state the same way (codes and an unquantised m exactly, parameters and v to a few fp32 ulps; see
``_numba_kernels.py`` for the arithmetic). The kernel is fused per scale block. A quantised first
moment is looked up in a table that separates the codebook's entries with one comparison a value
(``CodeTable.ncmp <= 1``, no repeated entries: every codebook ``optimal_codebook`` learns from a
4096-bin histogram with enough occupied bins); a codebook without that property is known only once
it is learned, and ``data_refusal`` (what only the data decide) hands it to
``torch_ops.gefen_step_``, which computes the same step. float64 state (``state.state_dtype``) is
refused: ``Gefen`` runs it on the torch step.

Importing this module does not import numba; the first call does (and compiles the kernels once,
cached on disk).
"""

from typing import NamedTuple

import numpy as np
import torch

from .._cache import BoundedCache
from .._threads import numba_threads
from . import torch_ops
from .checks import check_factors, check_launch, float64_state_refusal, stochastic_codes_refusal
from .._rounding import STOCHASTIC_DTYPES, round_stochastic
from .codebook import code_table
from .reference import factor_ratio, scale_block_length

_JOB_ELEMENTS = 1 << 15  # elements per parallel job (whole scale blocks)
_JOBS = BoundedCache(256)  # job tables per layout
_LUTS = BoundedCache(64)  # kernel arrays per CodeTable object
_NO_RATIO = np.ones((1, 1), dtype=np.float32)


def refuses(param_dtype: torch.dtype, group) -> str | None:
    """Why this step cannot update a parameter of ``param_dtype`` in ``group``, known when it is
    added (``optim.backends.choose_backend``), or None: float64 moments, stochastically rounded codes
    (both the torch step's)."""
    return float64_state_refusal(param_dtype, group) or stochastic_codes_refusal(group)


def data_refusal(*, block: int | None, bits: int, quant: bool, tables=None, scale: int | None = None) -> str | None:
    """Why this step hands a call to the torch step, for what only the data decide, or None: a
    codebook with repeated entries, or entries closer than its finest lookup table separates
    (``CodeTable.ncmp > 1``; the kernel's lookup picks between two values only).
    ``optimal_codebook`` learns neither from a histogram with enough occupied bins."""
    if quant and tables is not None and (tables.ncmp > 1 or tables.has_repeats):
        return "the codebook has repeated or too close entries"
    return None


class Addresses(NamedTuple):
    """The kernel's address table and the fp32 working copies it points into (``_addresses``)."""

    meta: np.ndarray  # int64 (tensors, 9): addresses of p, g, v, scales, codes; numels of p, v, scales, codes
    alive: list  # every tensor ``meta`` points into (the callers' and the fp32 copies), alive while this is
    write_back: list  # (parameter, fp32 copy) pairs copied back after the kernel


class KernelLuts(NamedTuple):
    """The kernel's arrays of one ``CodeTable`` (``_luts``)."""

    codebook: np.ndarray  # fp32, the distinct entries
    bounds: np.ndarray  # fp32 decision boundaries, then +inf
    lut_code: np.ndarray  # int32, the table: the code below each bin's boundary
    lut_bound: np.ndarray  # fp32, the boundary each table bin compares with
    lut_values: np.ndarray  # fp32 (2 * bins,), the two values each bin selects


def _jobs(numels: tuple, S: int, bits: int) -> np.ndarray:
    """(tensor, first scale block, end scale block) rows: runs of whole blocks of ~32 K elements.

    With 4-bit codes and an odd ``S`` a run starts at an even block (an even element), so two
    runs never share a code byte. Cached per layout.
    """
    def build():
        per = max(1, _JOB_ELEMENTS // S)
        if bits == 4 and S % 2 and per % 2:
            per += 1
        rows = []
        for t, n in enumerate(numels):
            nb = -(-n // S)
            rows.extend((t, j, min(j + per, nb)) for j in range(0, nb, per))
        return np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    return _JOBS.get_or_build((numels, S, bits), build)


def _addresses(ps, gs, vs, scales, codes) -> Addresses:
    """The address table of a call; non-fp32 or non-contiguous parameters and gradients are copied
    to fp32 first (parameters are copied back after the kernel). It holds every tensor it points
    into, so a caller's temporary (a piece sliced from a copy) lives as long as the table."""
    rows, scratch, back = [], [*ps, *gs, *vs, *scales, *codes], []
    for p, g, v, s, c in zip(ps, gs, vs, scales, codes):
        pw, gw = p, g
        if not (p.dtype == torch.float32 and p.is_contiguous()):
            pw = p.detach().float().contiguous()
            back.append((p, pw))
            scratch.append(pw)
        if not (g.dtype == torch.float32 and g.is_contiguous()):
            gw = g.detach().float().contiguous()
            scratch.append(gw)
        rows.append((pw.data_ptr(), gw.data_ptr(), v.data_ptr(), s.data_ptr(), c.data_ptr(),
                     p.numel(), v.numel(), s.numel(), c.numel()))
    return Addresses(np.array(rows, dtype=np.int64).reshape(-1, 9), scratch, back)


class Prepared(NamedTuple):
    """One call's launch, built once for a set of contiguous fp32 tensors (``prepare``): a later
    step writes the gradients' addresses into ``meta`` and calls the kernels."""

    meta: np.ndarray  # ``Addresses.meta``
    owners: np.ndarray  # int64 (tensors,): which gradient of ``run``'s list each tensor reads
    offsets: np.ndarray  # int64 (tensors,): byte offset of each tensor in that gradient
    jobs: np.ndarray
    luts: KernelLuts
    lut_scale: np.float32
    wptrs: np.ndarray | None  # fp32 factor addresses (factored), else None
    half: tuple | None  # the bf16 factors (factored, ``factor_dtype="bfloat16"``), else None
    block: int
    S: int
    bits: int
    quant: bool
    keep: tuple  # the tensors ``meta`` points into, alive while this lives


def prepare(ps, gs, vs, scales, codes, codebook, *, block, bits, tables=None, ws=None, owners=None,
            offsets=None, scale=None) -> Prepared | None:
    """The launch of :func:`gefen_step_` for these tensors, checked once (``check_launch``), or
    None where it cannot be prepared: parameters or gradients that are not contiguous fp32 (the
    step then copies pieces), or a codebook the kernel's table cannot separate
    (``data_refusal``). ``owners``/``offsets``: tensor ``i`` reads gradient
    ``owners[i]`` of ``run``'s list from element ``offsets[i]`` on (a tile of rows of a
    parameter); by default gradient ``i`` from its start. ``scale``: the scale-block length where
    it is not ``scale_block_length(block)``, a multiple of ``block`` (``torch_ops.gefen_step_``'s)."""
    quant = codebook is not None
    if quant and tables is None:
        tables = code_table(codebook)
    if data_refusal(block=block, bits=bits, quant=quant, tables=tables) is not None:
        return None
    check_launch(ps, gs, vs, scales, codes, block=block, bits=bits, quant=quant, scale=scale)
    if not all(t.dtype == torch.float32 and t.is_contiguous() for t in (*ps, *gs)):
        return None
    if ws is not None:
        check_factors(ps, ws, block=block, dtypes=(torch.float32, torch.bfloat16))
    half = ws is not None and ws[0].dtype == torch.bfloat16
    addr = _addresses(ps, gs, vs, scales, codes)
    n = len(ps)
    S = scale or scale_block_length(block)
    luts, lut_scale = (_luts(tables), np.float32(tables.scale)) if quant else (_NO_LUTS, np.float32(1.0))
    return Prepared(addr.meta, np.arange(n, dtype=np.int64) if owners is None else np.asarray(owners, dtype=np.int64),
                    np.zeros(n, dtype=np.int64) if offsets is None else np.asarray(offsets, dtype=np.int64) * 4,
                    _jobs(tuple(addr.meta[:, 5].tolist()), S, bits if quant else 8), luts, lut_scale,
                    None if ws is None or half else np.array([w.data_ptr() for w in ws], dtype=np.int64),
                    tuple(ws) if half else None,
                    block, S, bits, quant, (tuple(ps), tuple(vs), tuple(scales), tuple(codes), ws, tables))


def run(prep: Prepared, gs, *, step, lr, beta1, beta2, eps, weight_decay, factor_seeds=None):
    """One step of a prepared launch on gradients ``gs`` (contiguous fp32, of the sizes and order
    it was prepared with: the caller's plan guarantees it). ``factor_seeds``: one 32-bit seed per
    bf16 factor (``Prepared.half``)."""
    from ._numba_kernels import factor_kernel, kernel

    f32 = np.float32
    gptrs = np.fromiter(map(_DATA_PTR, gs), dtype=np.int64, count=len(gs))
    meta = prep.meta
    meta[:, 1] = gptrs[prep.owners] + prep.offsets
    block, S = prep.block, prep.S
    hyper = _hyper(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    parallel = numba_threads() > 1
    ratio = _NO_RATIO
    factored = prep.wptrs is not None or prep.half is not None
    if factored:
        partial = np.empty((prep.jobs.shape[0], block), dtype=np.float32)
        ratio = np.empty((len(meta), block), dtype=np.float32)
        fresh = None if prep.half is None else torch.stack(prep.half).float().numpy()
        wptrs = prep.wptrs if fresh is None else fresh.ctypes.data + np.arange(len(fresh), dtype=np.int64) * block * 4
        factor_kernel(parallel)(meta, prep.jobs, wptrs, block, S, f32(beta2), f32(1 - beta2), partial, ratio)
        if fresh is not None:
            _store_half(fresh, prep.half, factor_seeds, ratio)
    step_fn = kernel(prep.bits, block == 1, parallel=parallel, factored=factored, quant=prep.quant)
    luts = prep.luts
    step_fn(meta, prep.jobs, ratio, luts.codebook, luts.bounds, luts.lut_code, luts.lut_bound, luts.lut_values,
            prep.lut_scale, block, S, *hyper)


_DATA_PTR = torch.Tensor.data_ptr


def _store_half(fresh: np.ndarray, ws, seeds, ratio: np.ndarray) -> None:
    """Round each row of ``fresh`` (the fp32 updates of bf16 factors ``ws``) into its factor
    stochastically with its seed, and write the ratios the step reads from the stored values."""
    from ._numba_kernels import store_bf16_factors

    out = np.empty(fresh.shape, dtype=np.uint16)
    store_bf16_factors(fresh, np.asarray(seeds, dtype=np.int64), out, ratio)
    torch._foreach_copy_(list(ws), list(torch.from_numpy(out).view(torch.bfloat16).unbind(0)))


def _hyper(*, step, lr, beta1, beta2, eps, weight_decay) -> tuple:
    """The kernel's scalars (w1, beta2, 1 - beta2, decay, -lr / bc1, sqrt(bc2), eps), computed in
    float64 and passed as float32."""
    f32 = np.float32
    return (f32(1 - beta1), f32(beta2), f32(1 - beta2), f32(1 - lr * weight_decay),
            f32(-lr / (1 - beta1**step)), f32((1 - beta2**step) ** 0.5), f32(eps))


@torch.no_grad()
def gefen_step_(ps, gs, vs, scales, codes, codebook, *, step, lr, beta1, beta2, eps,
                weight_decay, block, bits, tables=None, ws=None, seeds=None, code_seeds=None, scale=None,
                factor_seeds=None):
    """:func:`optim.gefen.torch_ops.gefen_step_` compiled for CPU tensors (see module doc).

    One kernel call for the whole list, runs of scale blocks in parallel on
    ``torch.get_num_threads()`` numba threads (the same results at any thread count). A factored
    second moment (``ws``) adds one pass over the gradients before it (``factor_kernel``).
    ``codebook=None``: the first moment is unquantised, fp32 ``m`` in ``codes``; ``scales`` unused.
    Parameters or gradients that are not contiguous fp32 (bf16, fp16) are stepped a piece at a
    time (``torch_ops.pieces``) on fp32 copies of the piece, written back rounded to nearest or,
    with ``seeds`` (one per tensor, ``optim._rounding``), stochastically. ``prepare`` and ``run``
    are this step in two halves, for a caller that steps the same tensors again. ``code_seeds``
    (stochastic rounding of the codes) is not compiled here: such a call is the torch step's.
    """
    quant = codebook is not None
    if quant and tables is None:
        tables = code_table(codebook)
    if (quant and code_seeds is not None) or data_refusal(block=block, bits=bits, quant=quant,
                                                          tables=tables) is not None:
        return torch_ops.gefen_step_(ps, gs, vs, scales, codes, codebook, step=step, lr=lr,
                                     beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                     block=block, bits=bits, tables=tables, ws=ws, seeds=seeds,
                                     code_seeds=code_seeds, scale=scale, factor_seeds=factor_seeds)
    prep = prepare(ps, gs, vs, scales, codes, codebook, block=block, bits=bits, tables=tables, ws=ws, scale=scale)
    if prep is not None:
        return run(prep, gs, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                   factor_seeds=factor_seeds)
    hyper = _hyper(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    return _step_pieces(ps, gs, vs, scales, codes, tables, S=scale or scale_block_length(block), hyper=hyper,
                        block=block, bits=bits, quant=quant, ws=ws, seeds=seeds, beta2=beta2,
                        factor_seeds=factor_seeds)


def _step_pieces(ps, gs, vs, scales, codes, tables, *, S, hyper, block, bits, quant, ws, seeds, beta2,
                 factor_seeds=None):
    """The step of a call with bf16, fp16 or strided parameters or gradients: a piece at a time
    (``torch_ops.pieces``), so the fp32 copies stay a piece long; the factor ``w`` is updated over
    whole gradients first (``torch_ops.factor_update_``)."""
    from ._numba_kernels import kernel, round_bf16_stochastic

    ratio = None
    if ws is not None:
        torch_ops.factor_update_(ws, gs, block=block, beta2=beta2, seeds=factor_seeds)
        if block > 1:
            ratio = np.stack([factor_ratio(w).sqrt().cpu().numpy() for w in ws]).astype(np.float32)
    numels = [p.numel() for p in ps]
    targets, ps = ps, torch_ops.contiguous(ps)  # pieces are views of flat tensors
    parallel = numba_threads() > 1
    step_fn = kernel(bits, block == 1, parallel=parallel, factored=ratio is not None, quant=quant)
    luts, lut_scale = (_luts(tables), np.float32(tables.scale)) if quant else (_NO_LUTS, np.float32(1.0))
    W = S // block
    # the temporaries of a piece are its fp32 copies of p and g (8 bytes an element): pieces of
    # a 32nd of the largest tensor's bytes keep them at a quarter of its bytes
    for piece in torch_ops.pieces(numels, S, bits if quant else 8, min(p.element_size() for p in ps),
                                  temp_bytes=32):
        sel = [(t, rows, numels[t]) for t, rows in piece]
        part_p = [torch_ops.slice_rows(ps[t], r, S, n) for t, r, n in sel]
        addr = _addresses(part_p, [torch_ops.slice_rows(gs[t], r, S, n) for t, r, n in sel],
                          [torch_ops.slice_rows(vs[t], r, W) for t, r, _ in sel],
                          [torch_ops.slice_rows(scales[t], r, 1) if quant else scales[t] for t, r, _ in sel],
                          [torch_ops.code_slice(codes[t], r, S, n, bits if quant else 8) for t, r, n in sel])
        jobs = _jobs(tuple(addr.meta[:, 5].tolist()), S, bits if quant else 8)
        rat = _NO_RATIO if ratio is None else np.ascontiguousarray(ratio[[t for t, _, _ in sel]])
        step_fn(addr.meta, jobs, rat, luts.codebook, luts.bounds, luts.lut_code, luts.lut_bound, luts.lut_values,
                lut_scale, block, S, *hyper)
        for (t, r, _), (p, pw) in zip(sel, _written(part_p, addr)):
            if seeds is not None and p.dtype == torch.bfloat16:
                round_bf16_stochastic(pw.numpy(), p.view(torch.int16).numpy().view(np.uint16), seeds[t], r.start * S)
            elif seeds is not None and p.dtype in STOCHASTIC_DTYPES:
                p.copy_(round_stochastic(pw, p.dtype, seeds[t], r.start * S))
            elif pw is not p:
                p.copy_(pw.view_as(p))
    torch_ops.write_back(targets, ps)


def _written(ps, addr):
    """(parameter, its fp32 working copy after the kernel) of each parameter of a call."""
    copies = dict((id(p), pw) for p, pw in addr.write_back)
    return [(p, copies.get(id(p), p)) for p in ps]


def _luts(tables) -> KernelLuts:
    """The kernel's arrays of one ``CodeTable``, cached on the table object while it lives."""
    def build():
        cb = tables.uniq.cpu().numpy()
        lut = tables.lut.cpu().numpy()
        cb_next = np.append(cb, cb[-1])
        return KernelLuts(cb, tables.boundaries.cpu().numpy(), lut.astype(np.int32), tables.lut_bound.cpu().numpy(),
                          np.stack([cb_next[lut], cb_next[lut + 1]], axis=1).reshape(-1).copy())
    return _LUTS.get_or_build(id(tables), build, owner=tables)


# The arrays of the kernel's signature for an unquantised call, which reads none of them (16
# entries: the 4-bit pass's codebook and boundaries are unpacked into registers unconditionally).
_NO_LUTS = KernelLuts(*[np.zeros(16, dtype=np.float32)] * 2, np.zeros(1, dtype=np.int32),
                      *[np.zeros(16, dtype=np.float32)] * 2)
