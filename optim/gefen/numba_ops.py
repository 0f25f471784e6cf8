"""The Gefen step in place on CPU tensors, compiled with numba: one kernel call per group.

``gefen_step_`` has the signature of :func:`optim.gefen.torch_ops.gefen_step_` (``plan.Tile``
records, their gradients, a ``plan.Hyper`` record) and updates the same fp32 state the same way
(codes and an unquantised m exactly, parameters and v to a few fp32 ulps; see
``_numba_kernels.py`` for the arithmetic). The kernel is fused per scale block. A quantised first
moment is looked up in a table that separates the codebook's entries with one comparison a value
(``CodeTable.ncmp <= 1``, no repeated entries: every codebook ``optimal_codebook`` learns from a
4096-bin histogram with enough occupied bins); a codebook without that property is known only once
it is learned, and ``data_refusal`` (what only the data decide) hands it to
the torch step (``_torch_step``), which computes the same step. float64 state (``state.state_dtype``) is
refused: ``Gefen`` runs it on the torch step.

Importing this module does not import numba; the first call does (and compiles the kernels once,
cached on disk).
"""

from typing import NamedTuple

import numpy as np
import torch

from .._cache import BoundedCache
from .._threads import numba_threads
from .checks import check_factors, check_launch, float64_state_refusal, stochastic_codes_refusal
from .._rounding import STOCHASTIC_DTYPES, round_stochastic
from .codebook import code_table
from .reference import bound_scale, factor_ratio, scale_block_length
from .tiling import contiguous, factor_update_, factors, piece_of, pieces, write_back

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

    meta: np.ndarray  # int64 (tensors, ADDRESS_COLUMNS): ``_numba_kernels``' named columns (P_ADDR, ...)
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


def _addresses(tiles, gs, quant: bool) -> Addresses:
    """The address table of a call's ``tiles`` and gradients ``gs`` (``_numba_kernels``' named
    columns: codes and scales where ``quant``, else the first moment m); the kernel reads contiguous
    fp32 or bf16 gradients where they are (bf16 widened a block at a time, ``G_BF16``), other
    gradients and non-fp32 or non-contiguous parameters are copied to fp32 first (parameters are
    copied back after the kernel). It holds every tensor it points into, so a caller's temporary (a piece sliced from a
    copy) lives as long as the table."""
    from ._numba_kernels import (ADDRESS_COLUMNS, CODES_ADDR, CODES_NUMEL, G_ADDR, G_BF16, M_ADDR, NUMEL, P_ADDR,
                                 SCALES_ADDR, SCALES_NUMEL, V_ADDR, V_NUMEL)

    meta = np.zeros((len(tiles), ADDRESS_COLUMNS), dtype=np.int64)
    scratch, back = [*tiles, *gs], []
    for row, t, g in zip(meta, tiles, gs):
        p, pw, gw = t.p, t.p, g
        if not (p.dtype == torch.float32 and p.is_contiguous()):
            pw = p.detach().float().contiguous()
            back.append((p, pw))
            scratch.append(pw)
        if not (g.dtype in KERNEL_GRADIENTS and g.is_contiguous()):
            gw = g.detach().float().contiguous()
            scratch.append(gw)
        row[P_ADDR], row[G_ADDR], row[V_ADDR] = pw.data_ptr(), gw.data_ptr(), t.v.data_ptr()
        row[G_BF16] = gw.dtype == torch.bfloat16
        row[NUMEL], row[V_NUMEL] = p.numel(), t.v.numel()
        if quant:
            row[SCALES_ADDR], row[SCALES_NUMEL] = t.scales.data_ptr(), t.scales.numel()
            row[CODES_ADDR], row[CODES_NUMEL] = t.first.data_ptr(), t.first.numel()
        else:
            row[M_ADDR] = t.first.data_ptr()
    return Addresses(meta, scratch, back)


# gradient dtypes the kernel reads where they are (``_numba_kernels.G_BF16``)
KERNEL_GRADIENTS = (torch.float32, torch.bfloat16)


class Prepared(NamedTuple):
    """One call's launch, built once for contiguous fp32 parameters and contiguous fp32 or bf16
    gradients (``prepare``): a later step writes the gradients' addresses into ``meta``'s ``G_ADDR``
    column and calls the kernels."""

    meta: np.ndarray  # ``Addresses.meta``
    owners: np.ndarray  # int64 (tensors,): which gradient of ``run``'s list each tensor reads
    offsets: np.ndarray  # int64 (tensors,): byte offset of each tensor in that gradient
    jobs: np.ndarray
    luts: KernelLuts
    lut_scale: np.float32
    wptrs: np.ndarray | None  # the factors' addresses (factored), else None
    half: bool  # the factors are bf16 (``factor_dtype="bfloat16"``), else fp32
    block: int
    S: int
    bits: int
    quant: bool
    keep: tuple  # the tensors ``meta`` points into, alive while this lives


def prepare(tiles, gs, codebook, *, block, bits, tables=None, owners=None, offsets=None,
            scale=None) -> Prepared | None:
    """The launch of :func:`gefen_step_` for these ``tiles`` (``plan.Tile`` records; ``gs`` their
    gradients, for the checks), checked once (``check_launch``), or
    None where it cannot be prepared: parameters that are not contiguous fp32, gradients that are
    not contiguous fp32 or bf16 (the step then copies pieces), or a codebook the kernel's table cannot separate
    (``data_refusal``). ``owners``/``offsets``: tensor ``i`` reads gradient
    ``owners[i]`` of ``run``'s list from element ``offsets[i]`` on (a tile of rows of a
    parameter: ``Tile.owner``, ``Tile.start``); by default gradient ``i`` from its start.
    ``scale``: the scale-block length where it is not ``scale_block_length(block)``, a multiple of
    ``block`` (``torch_ops.gefen_step_``'s)."""
    from ._numba_kernels import NUMEL

    quant = codebook is not None
    if quant and tables is None:
        tables = code_table(codebook)
    if data_refusal(block=block, bits=bits, quant=quant, tables=tables) is not None:
        return None
    ps = [t.p for t in tiles]
    check_launch(ps, gs, [t.v for t in tiles], [t.scales for t in tiles], [t.first for t in tiles], block=block,
                 bits=bits, quant=quant, scale=scale)
    if not (all(p.dtype == torch.float32 and p.is_contiguous() for p in ps)
            and all(g.dtype in KERNEL_GRADIENTS and g.is_contiguous() for g in gs)):
        return None
    ws = factors(tiles)
    if ws is not None:
        check_factors(ps, ws, block=block, dtypes=(torch.float32, torch.bfloat16))
    half = ws is not None and ws[0].dtype == torch.bfloat16
    addr = _addresses(tiles, gs, quant)
    n = len(tiles)
    S = scale or scale_block_length(block)
    luts, lut_scale = (_luts(tables), np.float32(tables.scale)) if quant else (_NO_LUTS, np.float32(1.0))
    return Prepared(addr.meta, np.arange(n, dtype=np.int64) if owners is None else np.asarray(owners, dtype=np.int64),
                    np.zeros(n, dtype=np.int64) if offsets is None
                    else np.asarray(offsets, dtype=np.int64) * np.array([g.element_size() for g in gs], dtype=np.int64),
                    _jobs(tuple(addr.meta[:, NUMEL].tolist()), S, bits if quant else 8), luts, lut_scale,
                    None if ws is None else np.array([w.data_ptr() for w in ws], dtype=np.int64),
                    half, block, S, bits, quant, (tuple(tiles), tables))


def run(prep: Prepared, gs, hyper, *, factor_seeds=None):
    """One step of a prepared launch on gradients ``gs`` (contiguous, of the sizes, dtypes and order
    it was prepared with: the caller's plan guarantees it) with the hyper-parameters of ``hyper``
    (a ``plan.Hyper``). ``factor_seeds``: one 32-bit seed per bf16 factor (``Prepared.half``)."""
    from ._numba_kernels import G_ADDR, factor_kernel, kernel

    f32 = np.float32
    gptrs = np.fromiter(map(_DATA_PTR, gs), dtype=np.int64, count=len(gs))
    meta = prep.meta
    meta[:, G_ADDR] = gptrs[prep.owners] + prep.offsets
    block, S = prep.block, prep.S
    beta2 = hyper.beta2
    parallel = numba_threads() > 1
    ratio = _NO_RATIO
    factored = prep.wptrs is not None
    if factored:
        partial = np.empty((prep.jobs.shape[0], block), dtype=np.float32)
        ratio = np.empty((len(meta), block + 1), dtype=np.float32)
        seeds = np.asarray(factor_seeds, dtype=np.int64) if prep.half else _NO_SEEDS
        if prep.half and seeds.shape != (len(meta),):
            raise ValueError(f"Gefen kernel: bf16 factors need one seed a tensor ({len(meta)}), got {seeds.shape}")
        factor_kernel(parallel)(meta, prep.jobs, prep.wptrs, seeds, block, S, f32(beta2), f32(1 - beta2), partial,
                                ratio)
    step_fn = kernel(prep.bits, block == 1, parallel=parallel, factored=factored, quant=prep.quant)
    luts = prep.luts
    step_fn(meta, prep.jobs, ratio, luts.codebook, luts.bounds, luts.lut_code, luts.lut_bound, luts.lut_values,
            prep.lut_scale, block, S, *_scalars(hyper))


_DATA_PTR = torch.Tensor.data_ptr
_NO_SEEDS = np.zeros(0, dtype=np.int64)  # fp32 factors: no rounding


def _scalars(h) -> tuple:
    """The kernel's scalars of ``plan.Hyper`` ``h`` (w1, beta2, 1 - beta2, decay, -lr / bc1,
    sqrt(bc2), eps, and the clip's ``bound * sqrt(bc2)`` in fp32, inf for none), computed in float64
    and passed as float32."""
    f32 = np.float32
    bc2_sqrt = f32((1 - h.beta2**h.step) ** 0.5)
    return (f32(1 - h.beta1), f32(h.beta2), f32(1 - h.beta2), f32(1 - h.lr * h.weight_decay),
            f32(-h.lr / (1 - h.beta1**h.step)), bc2_sqrt, f32(h.eps), f32(bound_scale(h.bound, bc2_sqrt)))


def _torch_step(tiles, gs, codebook, hyper, **options):
    """``torch_ops.gefen_step_``: the step of what this module does not compile (stochastically
    rounded codes, a codebook its lookup cannot separate)."""
    from . import torch_ops

    return torch_ops.gefen_step_(tiles, gs, codebook, hyper, **options)


@torch.no_grad()
def gefen_step_(tiles, gs, codebook, hyper, *, block, bits, tables=None, seeds=None, code_seeds=None, scale=None,
                factor_seeds=None):
    """:func:`optim.gefen.torch_ops.gefen_step_` compiled for CPU tensors (see module doc).

    One kernel call for the whole list of ``tiles`` (``plan.Tile`` records), runs of scale blocks
    in parallel on ``torch.get_num_threads()`` numba threads (the same results at any thread
    count). A factored second moment (the tiles' ``w``) adds one pass over the gradients before it
    (``factor_kernel``). ``codebook=None``: the first moment is unquantised, fp32 m in ``first``,
    ``scales`` None. Contiguous bf16 gradients are read where they are. Parameters that are not
    contiguous fp32 (bf16, fp16), and gradients neither contiguous fp32 nor bf16, are stepped
    a piece at a time (``tiling.pieces``) on fp32 copies of the piece, written back rounded to
    nearest or, with ``seeds`` (one per tile, ``optim._rounding``), stochastically. ``prepare`` and
    ``run`` are this step in two halves, for a caller that steps the same tensors again.
    ``code_seeds`` (stochastic rounding of the codes) is not compiled here: such a call is the
    torch step's (``_torch_step``).
    """
    quant = codebook is not None
    if quant and tables is None:
        tables = code_table(codebook)
    if (quant and code_seeds is not None) or data_refusal(block=block, bits=bits, quant=quant,
                                                          tables=tables) is not None:
        return _torch_step(tiles, gs, codebook, hyper, block=block, bits=bits, tables=tables, seeds=seeds,
                           code_seeds=code_seeds, scale=scale, factor_seeds=factor_seeds)
    prep = prepare(tiles, gs, codebook, block=block, bits=bits, tables=tables, scale=scale)
    if prep is not None:
        return run(prep, gs, hyper, factor_seeds=factor_seeds)
    return _step_pieces(tiles, gs, tables, hyper, S=scale or scale_block_length(block), block=block, bits=bits,
                        quant=quant, seeds=seeds, factor_seeds=factor_seeds)


def _step_pieces(tiles, gs, tables, hyper, *, S, block, bits, quant, seeds, factor_seeds=None):
    """The step of a call with bf16, fp16 or strided parameters or gradients: a piece at a time
    (``tiling.pieces``), so the fp32 copies stay a piece long; the factor ``w`` is updated over
    whole gradients first (``tiling.factor_update_``)."""
    from ._numba_kernels import NUMEL, kernel, round_bf16_stochastic

    ratio = None
    ws = factors(tiles)
    if ws is not None:
        factor_update_(ws, gs, block=block, beta2=hyper.beta2, seeds=factor_seeds)
    numels = [t.p.numel() for t in tiles]
    if ws is not None and block > 1:  # sqrt(r_j), then sqrt(n_b mean(w)) (factor_kernel's row)
        ratio = np.stack([torch.cat([factor_ratio(w).sqrt(), (w.float().mean() * (n // block)).sqrt().view(1)])
                          .cpu().numpy() for w, n in zip(ws, numels)]).astype(np.float32)
    work = contiguous(tiles)  # pieces are views of flat tensors
    parallel = numba_threads() > 1
    step_fn = kernel(bits, block == 1, parallel=parallel, factored=ratio is not None, quant=quant)
    luts, lut_scale = (_luts(tables), np.float32(tables.scale)) if quant else (_NO_LUTS, np.float32(1.0))
    width = bits if quant else 8
    scalars = _scalars(hyper)
    # the temporaries of a piece are its fp32 copies of p and g (8 bytes an element): pieces of
    # a 32nd of the largest tensor's bytes keep them at a quarter of its bytes
    for piece in pieces(numels, S, width, min(t.p.element_size() for t in work), temp_bytes=32):
        part, part_g = piece_of(work, gs, piece, S=S, W=S // block, bits=width)
        addr = _addresses(part, part_g, quant)
        jobs = _jobs(tuple(addr.meta[:, NUMEL].tolist()), S, width)
        rat = _NO_RATIO if ratio is None else np.ascontiguousarray(ratio[[t for t, _ in piece]])
        step_fn(addr.meta, jobs, rat, luts.codebook, luts.bounds, luts.lut_code, luts.lut_bound, luts.lut_values,
                lut_scale, block, S, *scalars)
        for (t, r), (p, pw) in zip(piece, _written([x.p for x in part], addr)):
            if seeds is not None and p.dtype == torch.bfloat16:
                round_bf16_stochastic(pw.numpy(), p.view(torch.int16).numpy().view(np.uint16), seeds[t], r.start * S)
            elif seeds is not None and p.dtype in STOCHASTIC_DTYPES:
                p.copy_(round_stochastic(pw, p.dtype, seeds[t], r.start * S))
            elif pw is not p:
                p.copy_(pw.view_as(p))
    write_back(tiles, work)


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
