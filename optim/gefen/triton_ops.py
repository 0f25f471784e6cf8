"""Gefen's fused in-place step in Triton: launchers for the kernels of ``_triton_kernels.py``.

    gefen_step_(tiles, gs, codebook, hyper, *, block, bits, tables=None)

takes the signature of :func:`optim.gefen.torch_ops.gefen_step_` (``plan.Tile`` records with fields
p, v, scales, first, w; their gradients; a ``plan.Hyper`` record) and the state layout fixed in
``reference.py``'s docstring (v and scales fp32, codes uint8 or packed 4-bit low nibble first,
scale blocks of ``S = block`` or ``S = CHUNK = 256`` when ``block == 1`` with a partial last chunk,
``codebook=None`` for an unquantised fp32 first moment m in ``first``, ``scales`` None), and updates
``p``, ``v``, ``scales`` and ``first`` in place. ``p``/``g`` may be fp32, bf16 or fp16; the math is
fp32. The tiles are a group of tensors that share ``block``, ``bits`` and the hyperparameters: the
whole group is one kernel launch per kind of tensor,
because a model's step is many small tensors whose one launch each would leave the GPU waiting on
the host. With the tiles' ``w`` (a factored second moment) two launches before the step, again over every
tensor at once, update the per-offset factors w from the gradients (``_factor_stats_kernel``,
``_factor_finalize_kernel``). The launch tables, the pointer tables and the factors' scratch are
built once per set of tensors and cached (``_Plan``, ``optim._cache.BoundedCache``): a repeated
call reads a few attributes of each tensor and issues no torch operation, or two (one small
host-to-device copy) when the gradients moved, and two more for stochastic rounding's seeds.

For ``Gefen(capturable=True)`` the step count, lr and bias corrections live on the device:
``StepScalars`` holds a group's step counters and one row of step scalars per tensor, ``advance_``
(one launch of ``_gefen_hyper_kernel``) advances the counters and writes the rows, and
``gefen_step_(..., rows=rows)`` launches kernels that read them (``HYPER``). No launch then reads a
host value that changes between steps, and none waits for the device: the step can be captured in a
CUDA graph (a gradient moved inside a capture is written into the pointer table by device fills).

Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests run it).

Agreement with the reference: one step from the same state gives the reference's scales and codes
exactly; p and v only to fp32 rounding, because v's block mean of g**2 is summed in another order
than ``torch.mean``, and torch's CPU ``sqrt`` is not always correctly rounded where ``tl.sqrt_rn``
is; w also to fp32 rounding, its column sums of g**2 being added in another order than
``tiling.factor_update_``'s. Over a training run those ulps change the next gradients, and once
a value m~/s of the two runs falls on the two sides of a code boundary the runs hold different
codes: m^ then differs by one codebook gap times the scale, and the weights part by more than
rounding from then on. The numba backend, also correct to rounding, parts from the torch one the
same way. 4-bit codebooks have gaps 16 times wider, so such a crossing is rarer there.
``experiments/correctness.py`` measures both over a training run (``results/README.md``,
"Correctness against independent references").
"""

from __future__ import annotations

import contextlib
import math
import struct
from typing import NamedTuple

import torch
import triton.language as tl

from .._cache import BoundedCache
from .._rounding import hash32_int
from .._torch_private import version_counter
from .._triton_common import KernelLaunch, axis_pairs, next_pow2, prev_pow2
from ..backends import triton_interpreted
from ._triton_kernels import (ELEMS_PER_THREAD, FACTOR_ITERS, FACTOR_ROWS, FACTOR_TILE, FACTOR_WIDTH,
                              FINAL_TILE, FINAL_WIDTH, HYPER_BLOCK, MAX_TILE_WIDTH, ROW_TAB_COLUMNS, PTR_CODES, PTR_COLUMNS, PTR_G,
                              PTR_M, PTR_P, PTR_SCALES, PTR_V, TILE, TL_DTYPES, _factor_finalize_kernel,
                              _factor_stats_kernel, _gefen_hyper_kernel, _gefen_step4_kernel, _gefen_step_kernel)
from .checks import check_factors, float64_state_refusal, stochastic_codes_refusal
from .codebook import code_table
from .reference import num_code_bytes, num_scales, scale_block_length
from .tiling import factors


def _check_runnable(t: torch.Tensor, name: str):
    if t.device.type != "cuda" and not triton_interpreted():
        raise RuntimeError(
            f"{name} is on {t.device}: the Triton Gefen kernels need CUDA tensors, or "
            "TRITON_INTERPRET=1 set before triton is imported to run them on CPU; otherwise use "
            "Gefen(..., backend='torch')")


# Host-side tables kept between steps: code tables per codebook object (and its version), their
# device copies per table object and device, launch plans per set of state tensors.
_CODE_TABLES = BoundedCache(16)
_TABLE_CACHE = BoundedCache(16)
_PLAN_CACHE = BoundedCache(64)


class DeviceTables(NamedTuple):
    """A ``CodeTable`` on the launch's device, in the kernels' dtypes (``_device_tables``)."""

    codebook: torch.Tensor  # (levels,) fp32
    uniq: torch.Tensor  # (u,) fp32, the distinct entries
    mid: torch.Tensor  # (u,) fp32 boundaries between distinct entries, then +inf
    lut: torch.Tensor  # (nlut,) uint8, the lookup table
    first: torch.Tensor  # (2u,) uint8, (first, last) codebook index of each distinct entry
    ncmp: int  # NCMP: boundary comparisons after the table read
    has_dup: bool  # HAS_DUP: repeated entries (then ``first`` picks the reference's copy)
    nlut: int  # NLUT: bins of the table


class StepPlan(NamedTuple):
    """What ``step_plan`` chooses for one launch."""

    kernel: object  # _gefen_step_kernel or _gefen_step4_kernel
    constexprs: dict  # constexprs and launch options (num_warps, maxnreg)
    lanes: int  # live lanes of a tile row: elements, or bytes for packed 4-bit codes


class FactorPlan(NamedTuple):
    """What ``factor_plan`` chooses for the factor's two launches."""

    stats: dict  # constexprs and launch options of _factor_stats_kernel
    final: dict  # constexprs and launch options of _factor_finalize_kernel
    rows_per_item: int  # block rows one statistics program sums
    stats_chunks: int  # column chunks of a block (grid axis 1 of the statistics launch)
    final_chunks: int  # offset chunks of a block (grid axis 1 of the finalize launch)


class Launch(NamedTuple):
    """One step-kernel launch of a plan: tensors of one kind (dtypes, alignment, exactness)."""

    kernel: object
    tiles: torch.Tensor  # (n_tiles, 2) int64: (tensor in the plan's tables, first tile row) a program
    grid: tuple
    constexprs: dict
    indices: list  # position of each of its tensors in the call


class FactorPass(NamedTuple):
    """The launches that update every w of a plan before its step (``factor_plan``)."""

    stats: list  # (items: (k, 4) int64 (tensor, row0, row1, slot), grid, constexprs) a gradient dtype
    fin_tab: torch.Tensor  # (T, 2) int64: (first scratch row, scratch rows) of each tensor
    fin_grid: tuple
    final: dict  # constexprs of the finalize launch
    part: torch.Tensor  # (scratch rows * block,) fp32 partial column sums, rewritten every step


class _Row(NamedTuple):
    """A validated tile of the call (contiguous where the kernel reads it) and its gradient."""

    index: int  # its position among the call's tiles
    p: torch.Tensor
    g: torch.Tensor
    v: torch.Tensor
    scales: torch.Tensor | None  # None unquantised
    first: torch.Tensor  # uint8 codes, or the fp32 first moment m unquantised
    quant: bool

    def pointers(self) -> list:
        """Its row of the pointer table (``_triton_kernels``' named columns ``PTR_P`` ...)."""
        row = [0] * PTR_COLUMNS.value
        row[PTR_P.value], row[PTR_G.value], row[PTR_V.value] = self.p.data_ptr(), self.g.data_ptr(), self.v.data_ptr()
        if self.quant:
            row[PTR_SCALES.value], row[PTR_CODES.value] = self.scales.data_ptr(), self.first.data_ptr()
        else:
            row[PTR_M.value] = self.first.data_ptr()
        return row


def _table_of(codebook):
    """``code_table(codebook)``, cached on the codebook object and its version counter (bumped by
    any in-place change)."""
    return _CODE_TABLES.get_or_build((id(codebook), version_counter(codebook)), lambda: code_table(codebook),
                                     owner=codebook)


def _device_tables(tables, device, bits: int) -> DeviceTables:
    """``tables`` (a ``CodeTable``) on ``device`` in the kernels' dtypes, cached per table object;
    the kernel writes the reference's choice among equal entries."""
    if tables.codebook.numel() > 2**bits:
        raise ValueError(f"codebook must have at most {2**bits} entries for bits={bits}, "
                         f"got {tables.codebook.numel()}")

    def build():
        first = torch.stack([tables.first, tables.last], dim=1).reshape(-1)
        return DeviceTables(tables.codebook.to(device), tables.uniq.to(device), tables.boundaries.to(device),
                            tables.lut.to(device, torch.uint8), first.to(device, torch.uint8), tables.ncmp,
                            tables.has_repeats, tables.lut.numel())
    return _TABLE_CACHE.get_or_build((id(tables), str(device)), build, owner=tables)


def tile_row_lanes(block: int, bits: int, quant: bool, scale: int | None = None) -> int:
    """Live lanes of one tile row: a scale block's elements (``scale``: its length where it is not
    ``scale_block_length(block)``), or the bytes of its packed 4-bit codes (two scale blocks a row
    when the block length is odd, so no byte straddles rows)."""
    s_len = scale or scale_block_length(block)
    if not (quant and bits == 4):
        return s_len
    return s_len if s_len % 2 else s_len // 2


def sub_blocks(block: int, scale: int | None) -> int:
    """v blocks a scale block holds: 1, or with row-group scales (``scale`` a multiple of ``block``
    longer than it, ``state.SCALE_BLOCK``) ``scale / block``, each in lanes of its own."""
    return scale // block if scale and block > 1 and scale != block else 1


def step_plan(*, block, bits, quant, p_dtype, g_dtype, align, exact, factor=False, sr=False, hyper=False,
              tile=TILE, num_warps=None, scale=None, w16=False) -> StepPlan:
    """The kernel, constexprs and warps of one launch: the launcher's only choice. A tile is R
    whole tile rows of WIDTH = next_pow2(lanes) lanes, R*WIDTH ~ ``tile`` elements (bytes for
    packed 4-bit codes), ELEMS_PER_THREAD elements a thread. With row-group scales (``scale``, SUB
    v blocks a scale block) a row's WIDTH is next_pow2(SUB) x next_pow2(P) element lanes (half as
    many byte lanes at 4 bits), each v block in lanes of its own. ``w16``: the factors are bf16."""
    s_len = scale or scale_block_length(block)
    four = quant and bits == 4
    group = 2 if four and s_len % 2 else 1
    lanes = tile_row_lanes(block, bits, quant, scale)
    sub = sub_blocks(block, scale)
    why = _scale_refusal(block, bits, quant, scale)
    if why:
        raise ValueError(f"scale={scale}: {why}; use backend='torch' for it")
    width = next_pow2(lanes) if sub == 1 else next_pow2(sub) * next_pow2(block) // (2 if four else 1)
    if width > MAX_TILE_WIDTH:
        raise ValueError(f"block={block} is longer than one Triton program holds "
                         f"({MAX_TILE_WIDTH}); use backend='torch' for it")
    # Scalar accesses (misaligned or ragged tensors) hold a 64-bit address per element: half the
    # elements a thread, so they too stay within 64 registers without spilling.
    fast = align and exact
    per_thread = ELEMS_PER_THREAD if fast else ELEMS_PER_THREAD // 2
    tile = tile if fast else tile // 2
    rr = prev_pow2(max(1, (tile // 2 if four else tile) // width))  # tl.arange needs 2**k
    # The factored scalar path holds one more pointer an element, the row-group one the lanes' block
    # indices: one element a thread, up to 32 warps (64 registers each, as ptxas is told), so they
    # too stay within 64 registers.
    lean = (factor or sub > 1) and not fast
    most = 32 if lean else 16
    per_thread = per_thread // 2 if lean else per_thread
    warps = num_warps or max(1, min(most, rr * width * (2 if four else 1) // (32 * per_thread)))
    const = dict(P_DT=TL_DTYPES[p_dtype], G_DT=TL_DTYPES[g_dtype], C_DT=tl.uint8 if quant else tl.float32,
                 S=s_len, BLOCK_V=1 if block == 1 else s_len, R=rr, WIDTH=width, ALIGN=align,
                 EXACT=exact, FACTOR=factor, SR=bool(sr) and p_dtype != torch.float32, HYPER=hyper,
                 num_warps=warps)
    if sub > 1:
        const.update(SUB=sub, WP=next_pow2(block))
    if factor and w16:
        const["W16"] = True
    if warps > 16:
        const["maxnreg"] = 64
    const.update({"GROUP": group} if four else {"QUANT": quant})
    return StepPlan(_gefen_step4_kernel if four else _gefen_step_kernel, const, lanes)


def factor_plan(*, block, g_dtype, w16=False, seed_at=False) -> FactorPlan:
    """The constexprs and warps of the factor's two launches: the launcher's only choice for them.
    A statistics program sums R block rows x BW offsets an iteration (R*BW = ``FACTOR_TILE``;
    blocks longer than ``FACTOR_WIDTH`` in column chunks) and at least ``FACTOR_ROWS`` rows in
    all; a finalize program adds IB scratch rows x FW offsets an iteration (``w16``: into bf16
    factors, rounded stochastically; ``seed_at``: with seeds read at the addresses its table holds)."""
    bw = min(next_pow2(block), FACTOR_WIDTH)
    rr = max(1, FACTOR_TILE // bw)
    fw = min(next_pow2(block), FINAL_WIDTH)
    ib = max(1, FINAL_TILE // fw)
    stats = dict(G_DT=TL_DTYPES[g_dtype], S=block, R=rr, BW=bw, enable_fp_fusion=False,
                 num_warps=max(1, min(16, rr * bw // (32 * ELEMS_PER_THREAD))))
    final = dict(S=block, IB=ib, FW=fw, enable_fp_fusion=False,
                 num_warps=max(1, min(8, ib * fw // (32 * ELEMS_PER_THREAD))))
    if w16:
        final["W16"] = True
        if seed_at:
            final["SEED_AT"] = True
    rows_per_item = rr * max(FACTOR_ITERS, -(-FACTOR_ROWS // rr))
    return FactorPlan(stats, final, rows_per_item, -(-block // bw), -(-block // fw))


def refuses(param_dtype: torch.dtype, group) -> str | None:
    """Why these kernels cannot update a parameter of ``param_dtype`` in ``group``, known when it is
    added (``optim.backends.choose_backend``), or None."""
    if param_dtype not in TL_DTYPES:
        return f"the Triton kernels take fp32, bf16 or fp16 parameters, got {param_dtype}"
    return float64_state_refusal(param_dtype, group) or stochastic_codes_refusal(group)


def _scale_refusal(block: int, bits: int, quant: bool, scale: int | None) -> str | None:
    """Why row-group scales of length ``scale`` cannot be stepped here, or None."""
    if not scale or scale == scale_block_length(block):
        return None
    if block == 1 or scale % block:
        return f"a scale block of {scale} elements holds no whole number of v blocks of {block}"
    if block < 3:  # lanes of 2: the per-block sums' layout spills registers
        return f"row-group scales need v blocks of 3 elements or more, got {block}"
    if quant and bits == 4 and block % 2:
        return f"row-group scales at 4 bits need an even block, got {block} (a code byte would span two v blocks)"
    if next_pow2(scale // block) * next_pow2(block) > MAX_TILE_WIDTH:
        return f"a scale block of {scale} elements is longer than one Triton program holds"
    return None


def data_refusal(*, block: int | None, bits: int, quant: bool, tables=None, scale: int | None = None) -> str | None:
    """Why these kernels hand a call to the torch step, for what only the data decide, or None: a
    block longer than one program holds (``tile_row_lanes`` over ``MAX_TILE_WIDTH``), row-group
    scales it does not take (``_scale_refusal``). Block lengths are fixed at a parameter's first
    gradient (``partition.py`` caps them well below) or come from a loaded state dict."""
    if block is not None and tile_row_lanes(block, bits, quant, scale) > MAX_TILE_WIDTH:
        return f"block {block} is longer than one Triton program holds"
    return None if block is None else _scale_refusal(block, bits, quant, scale)


def _step_launches(rows, *, block, bits, quant, tile, num_warps, factor, sr, hyper, scale=None, w16=False) -> list:
    """The step's ``Launch`` es of ``rows`` (``_Row`` s: flat, contiguous, validated, on one device):
    one per kind of tensor, each program naming its tensor by position in ``rows`` (the plan's
    tables)."""
    s_len = scale or scale_block_length(block)
    four = quant and bits == 4
    device = rows[0].p.device
    # One launch per (dtypes, alignment, exactness): a misaligned tensor or one whose size is not a
    # whole number of tile rows only de-vectorises its own launch.
    by_kind: dict = {}
    for k, r in enumerate(rows):
        align = all(t.data_ptr() % 16 == 0 for t in (r.p, r.g, r.v, r.scales, r.first) if t is not None)
        exact = r.p.numel() % ((2 if four and s_len % 2 else 1) * s_len) == 0
        by_kind.setdefault((r.p.dtype, r.g.dtype, align, exact), []).append(k)
    launches = []
    for (pdt, gdt, align, exact), ks in by_kind.items():
        plan = step_plan(block=block, bits=bits, quant=quant, p_dtype=pdt, g_dtype=gdt, align=align,
                         exact=exact, factor=factor, sr=sr, hyper=hyper, tile=tile, num_warps=num_warps,
                         scale=scale, w16=w16)
        R = plan.constexprs["R"]
        numels = [rows[k].p.numel() for k in ks]
        trows = [-(-(num_code_bytes(n, 4) if four else n) // plan.lanes) for n in numels]
        ntiles = [-(-t // R) for t in trows]
        tid = torch.repeat_interleave(torch.tensor(ks, dtype=torch.int64), torch.tensor(ntiles))
        start = torch.cat([torch.arange(k) * R for k in ntiles])
        tiles = torch.stack([tid, start], dim=1).contiguous().to(device)
        launches.append(Launch(plan.kernel, tiles, (int(tiles.shape[0]),), plan.constexprs,
                               [rows[k].index for k in ks]))
    return launches


def _factor_pass(rows, *, block, w16=False, seed_at=False) -> FactorPass:
    """The factor's launches over ``rows``: one statistics launch a gradient dtype (one for a model
    of one dtype), each tensor cut into programs of ``rows_per_item`` block rows, and one finalize
    launch over every tensor (``seed_at``: it reads the bf16 factors' seeds at addresses)."""
    device = rows[0].p.device
    first = factor_plan(block=block, g_dtype=rows[0].g.dtype, w16=w16, seed_at=seed_at)  # all but G_DT is the same for every dtype
    per = first.rows_per_item
    by_dtype: dict = {}
    fin, slot = [], 0
    for k, r in enumerate(rows):
        nrows = r.p.numel() // block
        starts = range(0, nrows, per)
        by_dtype.setdefault(r.g.dtype, []).extend((k, a, min(a + per, nrows), slot + i) for i, a in enumerate(starts))
        fin.append((slot, len(starts)))
        slot += len(starts)
    stats = []
    for gdt, items in by_dtype.items():
        fp = factor_plan(block=block, g_dtype=gdt)
        stats.append((torch.tensor(items, dtype=torch.int64).to(device), (len(items), fp.stats_chunks), fp.stats))
    return FactorPass(stats, torch.tensor(fin, dtype=torch.int64).to(device), (len(rows), first.final_chunks),
                      first.final, torch.empty(slot * block, dtype=torch.float32, device=device))


def _kernel_args(tiles, ptrs, numel_tab, tabs, w_tab, *, step, lr, beta1, beta2, eps, weight_decay,
                 seed_tab=None, hyper_tab=None, bound=math.inf):
    """(args, table constexprs) of one launch; ``tabs``: ``DeviceTables``, None unquantised;
    ``w_tab``: the factor pointer table (any int64 tensor when FACTOR is off: unused);
    ``seed_tab``: int64 stochastic-rounding seed of each tensor (unused, None, when SR is off);
    ``hyper_tab``: each tensor's row address of step scalars on the device (HYPER; None: the
    step-dependent scalars are computed here from ``step`` and ``lr``, in float64, and passed as
    fp32 arguments, as ``_gefen_hyper_kernel`` computes them on the device); ``bound``: the clip of
    m^ (``plan.Hyper.bound``, inf for none: passed as -1), which the kernel multiplies by sqrt(bc2) in
    fp32."""
    if tabs is None:
        tabs = DeviceTables(*[numel_tab] * 5, ncmp=0, has_dup=False, nlut=1)  # unused pointers
    if hyper_tab is None:
        scalars = 1 - lr * weight_decay, -lr / (1 - beta1**step), math.sqrt(1 - beta2**step)
    else:
        scalars = 0.0, 0.0, 0.0  # read from the rows
    args = (tiles, ptrs, numel_tab, tabs.codebook, tabs.uniq, tabs.mid, tabs.lut, tabs.first, w_tab,
            numel_tab if seed_tab is None else seed_tab, numel_tab if hyper_tab is None else hyper_tab,
            1 - beta1, beta2, 1 - beta2, eps, *scalars, float(bound) if math.isfinite(bound) else -1.0)
    return args, dict(NLUT=tabs.nlut, NCMP=tabs.ncmp, HAS_DUP=tabs.has_dup, enable_fp_fusion=False)


def _stats_args(items, ptrs, part):
    """Arguments of a statistics launch: its items, the plan's pointer table, the scratch."""
    return items, ptrs, part


def _final_args(fin_tab, numel_tab, w_tab, part, seed_tab, *, beta2):
    """Arguments of the finalize launch: the tensors' scratch rows, sizes and factor pointers, the
    scratch, the bf16 factors' seeds (any int64 tensor for fp32 factors: unused), beta2 and
    1 - beta2."""
    return fin_tab, numel_tab, w_tab, part, seed_tab, float(beta2), 1 - float(beta2)


class _Plan:
    """What a step derives from one set of tiles (p, v, scales, first, w), built once: the step's
    launches, the tables they share (pointers, sizes, factor pointers, seeds), the factor's
    launches and scratch, and the gradients last seen.

    Tables are indexed by a tensor's position in ``order`` (the call positions of the non-empty
    tensors). Gradients are often re-allocated every step (``zero_grad(set_to_none=True)``), so
    they are not part of the cache key: when their addresses change, only the pointer table's g
    column is rewritten (one stream-ordered copy: launches already queued still read the old
    pointers).
    """

    __slots__ = ("launches", "factor", "ptrs", "gcol", "numels", "wtab", "seed_tab", "factor_seed_tab", "hyper_tab",
                 "order", "aligned", "device", "gptrs", "gnumels", "gdtypes", "temporaries")

    def __init__(self, rows, gs, ws, *, block, bits, quant, tile, num_warps, sr, scalar_rows=None, scale=None,
                 factor_rows=None):
        device = rows[0].p.device
        for r in rows:
            for name, t in (("p", r.p),) + ((("w", ws[r.index]),) if ws is not None else ()):
                if t.device != device:
                    raise ValueError(f"{name}[{r.index}] is on {t.device}, p[{rows[0].index}] on {device}: "
                                     "the tensors of one call must be on one device")
        for r in rows:
            if scalar_rows is not None and scalar_rows[r.index].device != device:
                raise ValueError(f"rows[{r.index}] is on {scalar_rows[r.index].device}, p[{r.index}] on {device}")
        w16 = ws is not None and ws[0].dtype == torch.bfloat16
        if w16 and scalar_rows is not None:
            check_factor_rows(factor_rows, len(gs), device)
        self.launches = _step_launches(rows, block=block, bits=bits, quant=quant, tile=tile, num_warps=num_warps,
                                       factor=ws is not None and block > 1, sr=sr, hyper=scalar_rows is not None,
                                       scale=scale, w16=w16)
        self.factor = None if ws is None else _factor_pass(rows, block=block, w16=w16,
                                                           seed_at=w16 and scalar_rows is not None)
        self.ptrs = torch.tensor([r.pointers() for r in rows], dtype=torch.int64).to(device)
        self.gcol = self.ptrs[:, PTR_G.value]
        self.numels = torch.tensor([r.p.numel() for r in rows], dtype=torch.int64).to(device)
        self.wtab = self.numels if ws is None else torch.tensor(
            [ws[r.index].data_ptr() for r in rows], dtype=torch.int64).to(device)
        uses_seeds = scalar_rows is None and any(ln.constexprs["SR"] for ln in self.launches)
        self.seed_tab = torch.zeros(len(rows), dtype=torch.int64, device=device) if uses_seeds else None
        # bf16 factors' seeds: uploaded each step, or (capturable) the addresses of the device's
        self.factor_seed_tab = None if not w16 else (
            torch.zeros(len(rows), dtype=torch.int64, device=device) if scalar_rows is None
            else torch.tensor([factor_rows[r.index].data_ptr() for r in rows], dtype=torch.int64).to(device))
        self.hyper_tab = None if scalar_rows is None else torch.tensor(
            [scalar_rows[r.index].data_ptr() for r in rows], dtype=torch.int64).to(device)
        self.order = [r.index for r in rows]
        self.aligned = [i for ln in self.launches if ln.constexprs["ALIGN"] for i in ln.indices]
        self.device = device
        self.gptrs = tuple(map(_DATA_PTR, gs))
        self.gnumels = tuple(map(_NUMEL, gs))
        self.gdtypes = tuple(g.dtype for g in gs)
        # contiguous copies of strided gradients, which the pointer table names: alive as long as the
        # plan (such a plan is used once, never cached)
        self.temporaries = [r.g for r in rows if r.g is not gs[r.index]]

    def update_grads(self, gs, gptrs) -> bool:
        """Point the launches at the gradients ``gs`` (addresses ``gptrs``) where they moved; False if
        they do not fit this plan. A gradient at the address of the last one may still be another
        tensor (a freed gradient's memory reused), so sizes, dtypes and layout are checked always."""
        if (not all(map(_IS_CONTIGUOUS, gs)) or tuple(map(_NUMEL, gs)) != self.gnumels
                or tuple(g.dtype for g in gs) != self.gdtypes):
            return False
        if gptrs == self.gptrs:
            return True
        if any(gptrs[i] % 16 for i in self.aligned) or any(gs[i].device != self.device for i in self.order):
            return False
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # a copy from host memory cannot be captured in a CUDA graph: a fill a moved gradient
            # (gradients made by a backward inside the capture)
            for k, i in enumerate(self.order):
                if gptrs[i] != self.gptrs[i]:
                    self.gcol[k].fill_(gptrs[i])
        else:
            self.gcol.copy_(torch.tensor([gptrs[i] for i in self.order], dtype=torch.int64), non_blocking=True)
        self.gptrs = gptrs
        return True

    def upload_seeds(self, seeds, table=None):
        """This step's stochastic-rounding seeds into the seed table (``table``: another, such as the
        bf16 factors'; one small copy)."""
        table = self.seed_tab if table is None else table
        table.copy_(torch.tensor([seeds[i] for i in self.order], dtype=torch.int64), non_blocking=True)


_NO_GUARD = contextlib.nullcontext()
_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel
_IS_CONTIGUOUS = torch.Tensor.is_contiguous


def _state_key(t):
    return (t.data_ptr(), t.numel(), t.dtype, t.device, _IS_CONTIGUOUS(t))


def _validate(tiles, gs, *, block, bits, quant, scale=None):
    """Check every tile against the reference's layout; return (``_Row`` s to launch, (parameter,
    contiguous copy) pairs to copy back)."""
    rows, copies = [], []
    for i, (t, gi) in enumerate(zip(tiles, gs)):
        pi, vi, si, ci = t.p, t.v, t.scales, t.first
        n = pi.numel()
        if gi.numel() != n:
            raise ValueError(f"g[{i}] has {gi.numel()} elements, p[{i}] has {n}")
        if n == 0:
            continue
        if pi.dtype not in TL_DTYPES or gi.dtype not in TL_DTYPES:
            raise TypeError(f"p[{i}]/g[{i}] must be fp32, bf16 or fp16, got {pi.dtype}/{gi.dtype}")
        if n % block:
            raise ValueError(f"block={block} does not divide p[{i}].numel()={n}")
        want = [("v", vi, torch.float32, n // block)]
        if quant:
            if scale and n % scale:
                raise ValueError(f"scale={scale} does not divide p[{i}].numel()={n}")
            if si is None:
                raise ValueError(f"tile {i} has no scales: a quantised first moment (a codebook) needs them")
            want += [("scales", si, torch.float32, num_scales(n, scale or block)),
                     ("codes", ci, torch.uint8, num_code_bytes(n, bits))]
        else:
            want += [("m", ci, torch.float32, n)]
        for name, x, dt, size in want:
            if x.dtype != dt or x.numel() != size or not x.is_contiguous():
                raise ValueError(f"{name}[{i}] must be a contiguous {dt} tensor of {size} elements "
                                 f"(reference.init_state layout), got {x.dtype} {tuple(x.shape)}")
        for name, x, _, _ in [("g", gi, None, None)] + want:
            if x.device != pi.device:
                raise ValueError(f"{name}[{i}] is on {x.device}, p[{i}] on {pi.device}")
        _check_runnable(pi, f"p[{i}]")
        pw = pi if pi.is_contiguous() else pi.contiguous()
        if pw is not pi:
            copies.append((pi, pw))
        rows.append(_Row(i, pw, gi.contiguous(), vi, si if quant else None, ci, quant))
    return rows, copies


def _plan(tiles, gs, *, block, bits, quant, tile, num_warps, sr=False, scalar_rows=None, scale=None,
          factor_rows=None):
    """(cached or new ``_Plan``, contiguous copies of parameters to write back); (None, []) when
    every tensor is empty."""
    ps = [t.p for t in tiles]
    ws = factors(tiles)
    # state tensors by address, size, dtype and layout: a view at a cached address (another
    # dtype, a shorter slice) is validated again, never launched on a plan made for another
    key = (block, scale, bits, quant, tile, num_warps, sr, tuple(map(_DATA_PTR, ps)), tuple(map(_NUMEL, ps)),
           tuple(p.dtype for p in ps), tuple(_state_key(t.v) for t in tiles),
           tuple(_state_key(t.first) for t in tiles),
           tuple(_state_key(t.scales) for t in tiles) if quant else None,
           tuple(map(_state_key, ws)) if ws is not None else None,
           tuple(map(_state_key, scalar_rows)) if scalar_rows is not None else None,
           tuple(map(_state_key, factor_rows)) if factor_rows is not None else None)
    plan = _PLAN_CACHE.get(key)
    if plan is not None:
        gptrs = tuple(map(_DATA_PTR, gs))
        if all(map(_IS_CONTIGUOUS, ps)) and plan.update_grads(gs, gptrs):
            return plan, []
    if ws is not None:
        check_factors(ps, ws, block=block, device_type=ps[0].device.type if ps else "cpu",
                      dtypes=(torch.float32, torch.bfloat16))
    if scalar_rows is not None:
        check_rows(scalar_rows, len(ps))
    rows, copies = _validate(tiles, gs, block=block, bits=bits, quant=quant, scale=scale)
    if not rows:
        return None, []
    plan = _Plan(rows, gs, ws, block=block, bits=bits, quant=quant, tile=tile, num_warps=num_warps, sr=sr,
                 scalar_rows=scalar_rows, scale=scale, factor_rows=factor_rows)
    if not copies and all(map(_IS_CONTIGUOUS, gs)):  # a temporary contiguous copy has a new address each call
        _PLAN_CACHE.put(key, plan)
    return plan, copies


def _launch(kernel, grid, args, kwargs, device):
    """``kernel[grid](*args, **kwargs)`` on ``device``: the one place this module launches a kernel."""
    with torch.cuda.device(device) if device.type == "cuda" else _NO_GUARD:
        kernel[grid](*args, **kwargs)


def _torch_step(tiles, gs, codebook, hyper, **options):
    """``torch_ops.gefen_step_``: the step of what these kernels do not compile (stochastically
    rounded codes)."""
    from . import torch_ops

    return torch_ops.gefen_step_(tiles, gs, codebook, hyper, **options)


def gefen_step_(tiles, gs, codebook, hyper, *, block, bits, tables=None, tile=TILE, num_warps=None, seeds=None,
                rows=None, code_seeds=None, scale=None, factor_seeds=None, factor_rows=None):
    """One Gefen step in place: the rule and state layout of :func:`optim.gefen.reference.gefen_step`.

    ``tiles``: ``plan.Tile`` records (fields p, v, scales, first, w) of a group sharing ``block``,
    ``bits`` and every hyperparameter (launched together, split only by parameter and gradient
    dtype); ``gs`` their gradients; ``hyper`` a ``plan.Hyper`` (step t counted from 1, lr, betas,
    eps, weight decay). ``p`` (fp32/bf16/fp16, any shape) is updated in place, as are ``v``
    (fp32), ``scales`` (fp32) and ``first`` (uint8 codes; the fp32 first moment m when
    ``codebook is None``, ``scales`` then None), which must be contiguous. ``tables``:
    ``code_table(codebook)`` (built and cached here when not given). ``tile`` and ``num_warps`` are
    tuning knobs for benchmarks. ``w`` (every tile's or none): per-offset factors of a factored
    second moment (contiguous, fp32 or all bf16, ``block`` elements each), updated in place before
    the step by the factor's kernels (column means of g**2 over a tensor's blocks), then read by
    the step kernel (``FACTOR``; with ``block == 1`` only w moves). ``seeds``: one 32-bit seed per
    tile: bf16 and fp16 parameters are then written with stochastic rounding (``optim._rounding``;
    ``SR``), else rounded to nearest. ``rows``: each tile's row of step scalars on the device
    (``StepScalars.rows``, written by :func:`advance_` before this call): the kernels read
    ``1 - lr*wd``, the bias corrections and the seed there (``HYPER``) and ``hyper.step`` and
    ``hyper.lr`` are not read, so a captured launch stays valid at every replay; ``seeds`` is then
    True (any value but None) to round stochastically with the rows' seeds. ``code_seeds``
    (stochastic rounding of the codes, one 32-bit seed per tile) has no kernel here: such a call
    is the torch step's (``_torch_step``). ``scale``: the length S of the first moment's scale
    blocks where it is not ``scale_block_length(block)`` (row-group scales, a multiple of
    ``block``; ``sub_blocks``). ``factor_seeds``: one 32-bit seed per tile for bf16 factors, stored
    rounded stochastically (``reference.factor_update``); under ``rows``, ``factor_rows`` instead:
    each tile's one-element int64 seed on the device (``StepScalars.factor_rows``). Returns None.

    Host cost: the first call with a set of tensors validates them and builds the plan (launch
    and pointer tables, the factor's scratch); later calls with the same p, v, scales, first and w
    (same addresses, sizes, dtypes) go straight to the launches after a few attribute reads per
    tensor, with no torch operation; new gradient addresses (re-allocated grads) cost one small
    host-to-device copy of their pointers, and ``seeds`` one more. Launches: with w, one
    statistics launch per gradient dtype and one finalize launch, then one step launch per kind
    of tensor (dtypes, alignment, exactness): three for a model of one dtype.
    """
    if code_seeds is not None and codebook is not None:
        if rows is not None:
            raise ValueError("Gefen kernel: stochastic rounding of the codes has no capturable step")
        return _torch_step(tiles, gs, codebook, hyper, block=block, bits=bits, tables=tables, seeds=seeds,
                           code_seeds=code_seeds, scale=scale, factor_seeds=factor_seeds)
    if len(tiles) != len(gs):
        raise ValueError(f"Gefen kernel: {len(gs)} gradients for {len(tiles)} tiles; pass one a tile")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    quant = codebook is not None
    scale = None if not quant or scale == scale_block_length(block) else scale
    why = _scale_refusal(block, bits, quant, scale)
    if why:
        raise ValueError(f"scale={scale!r}: {why}")
    if quant and tables is None:
        tables = _table_of(codebook)
    plan, copies = _plan(tiles, gs, block=block, bits=bits, quant=quant, tile=tile, num_warps=num_warps,
                         sr=seeds is not None, scalar_rows=rows, scale=scale, factor_rows=factor_rows)
    if plan is None:
        return
    device = plan.device
    if plan.seed_tab is not None:  # the seeds change every step
        plan.upload_seeds(seeds)
    if plan.factor_seed_tab is not None and rows is None:
        if factor_seeds is None:
            raise ValueError("Gefen kernel: bf16 factors w need factor_seeds, one 32-bit seed a tensor")
        plan.upload_seeds(factor_seeds, plan.factor_seed_tab)
    if plan.factor is not None:  # w first: every block's step reads its tensor's whole w
        fp = plan.factor
        for items, grid, const in fp.stats:
            _launch(_factor_stats_kernel, grid, _stats_args(items, plan.ptrs, fp.part), const, device)
        _launch(_factor_finalize_kernel, fp.fin_grid,
                _final_args(fp.fin_tab, plan.numels, plan.wtab, fp.part,
                            plan.numels if plan.factor_seed_tab is None else plan.factor_seed_tab, beta2=hyper.beta2),
                fp.final, device)
    tabs = _device_tables(tables, device, bits) if quant else None
    for ln in plan.launches:
        args, table_const = _kernel_args(ln.tiles, plan.ptrs, plan.numels, tabs, plan.wtab, step=hyper.step,
                                         lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, eps=hyper.eps,
                                         weight_decay=hyper.weight_decay, seed_tab=plan.seed_tab,
                                         hyper_tab=plan.hyper_tab, bound=hyper.bound)
        _launch(ln.kernel, ln.grid, args, dict(table_const, **ln.constexprs), device)
    for pi, pw in copies:
        pi.copy_(pw.view_as(pi))



# ------------------------------------------------------------------------------ step scalars
def check_factor_rows(rows, n: int, device):
    """Raise ``ValueError`` unless ``rows`` holds one one-element int64 tensor on ``device`` per tensor
    (the bf16 factors' step seeds of a capturable step, ``StepScalars.factor_rows``)."""
    if rows is None or len(rows) != n:
        raise ValueError(f"Gefen kernel: bf16 factors w under step scalars on the device need factor_rows, one "
                         f"int64 seed a tensor ({n}), got {None if rows is None else len(rows)}")
    for i, r in enumerate(rows):
        if r.dtype != torch.int64 or r.numel() != 1 or r.device != device:
            raise ValueError(f"Gefen kernel: factor_rows[{i}] must be a one-element int64 tensor on {device}, got "
                             f"{r.dtype} {tuple(r.shape)} on {r.device}")


def check_rows(rows, n: int):
    """Raise ``ValueError`` unless ``rows`` holds one contiguous fp32 row of 4 step scalars per tensor."""
    if len(rows) != n:
        raise ValueError(f"Gefen kernel: {len(rows)} rows of step scalars for {n} parameters")
    for i, r in enumerate(rows):
        if r.dtype != torch.float32 or r.numel() != 4 or not r.is_contiguous():
            raise ValueError(f"Gefen kernel: rows[{i}] must be a contiguous float32 tensor of 4 elements, "
                             f"got {r.dtype} {tuple(r.shape)}")


class StepScalars:
    """A parameter group's step counters and rows of step scalars on one device, for steps whose
    every launch reads its step-dependent numbers on the device (a CUDA graph replays launches with
    the arguments they were captured with).

    ``steps``: each tile's fp32 step counter (its parameter's one-element ``state["step"]``, shared
    by the tiles of a parameter); ``seeds``: each tile's stochastic-rounding seed (``state.SEED``)
    or None; ``tiles``: each tile's index among its parameter's tiles, None for a whole tensor;
    ``factor_seeds``: where a tile's factor is bf16, the seed its rounding's step seeds derive from
    as ``seeds``' do (the parameter's seed mixed with ``plan.FACTOR_STREAM``), else None (all None
    when omitted).
    ``rows`` (one (4,) fp32 view a tile: ``1 - lr*wd``, ``-lr / (1 - beta1**t)``,
    ``sqrt(1 - beta2**t)``, the seed's bits) go to :func:`gefen_step_` as ``rows``, and
    ``factor_rows`` (one (1,) int64 view a tile: the factor's step seed) as ``factor_rows``; built once.
    """

    __slots__ = ("buf", "bits", "rows", "tab", "device", "sr", "factor_buf", "factor_rows", "factor_sr")

    def __init__(self, steps, seeds, tiles, device, factor_seeds=None):
        device = torch.device(device)
        factor_seeds = [None] * len(steps) if factor_seeds is None else factor_seeds
        first, table = set(), []
        for i, (st, seed, k, fseed) in enumerate(zip(steps, seeds, tiles, factor_seeds)):
            if st.dtype != torch.float32 or st.numel() != 1 or st.device != device:
                raise ValueError(f"step[{i}] must be a one-element float32 tensor on {device}, got "
                                 f"{st.dtype} {tuple(st.shape)} on {st.device}")
            writes = st.data_ptr() not in first  # one row advances each counter
            first.add(st.data_ptr())
            c = 0 if seed is None else hash32_int(hash32_int(seed))  # step_seed(seed, 0, t)'s constant
            cf = 0 if fseed is None else hash32_int(hash32_int(fseed))
            table.append((st.data_ptr(), int(writes), c, -1 if k is None else k, cf))
        self.buf = torch.zeros(len(table), 4, dtype=torch.float32, device=device)
        self.bits = self.buf.view(torch.int32)  # the seeds' words
        self.rows = list(self.buf.unbind(0))
        self.factor_buf = torch.zeros(len(table), dtype=torch.int64, device=device)
        self.factor_rows = list(self.factor_buf.split(1))
        self.tab = torch.tensor(table, dtype=torch.int64).reshape(-1, ROW_TAB_COLUMNS.value).to(device)
        self.device = device
        self.sr = any(seed is not None for seed in seeds)
        self.factor_sr = any(fseed is not None for fseed in factor_seeds)


def _bits(x) -> int:
    """The IEEE float64 bits of ``x`` as a signed int: how a host float reaches a kernel exactly."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _hyper_args(sc: StepScalars, *, lr, beta1, beta2, weight_decay):
    """(args, constexprs) of ``_gefen_hyper_kernel`` for ``sc``: a tensor lr on the rows' device is
    read there (LR_ON_DEVICE), any other lr on the host (a Python float: a captured launch keeps it)."""
    on_device = torch.is_tensor(lr) and lr.device == sc.device
    if on_device and lr.numel() != 1:
        raise ValueError(f"a tensor lr must have one element, got shape {tuple(lr.shape)}")
    args = (sc.tab, sc.buf, sc.bits, sc.factor_buf, lr if on_device else sc.buf, len(sc.rows),
            0 if on_device else _bits(lr), _bits(beta1), _bits(beta2), _bits(weight_decay))
    return args, dict(LR_ON_DEVICE=on_device, SR=sc.sr, FACTOR_SR=sc.factor_sr, BLOCK=HYPER_BLOCK, num_warps=4,
                      enable_fp_fusion=False)


def advance_(sc: StepScalars, *, lr, beta1, beta2, weight_decay):
    """One launch: add 1 to every step counter of ``sc`` and write each row's scalars for the new
    step t, computed in float64 from the hyper-parameters' bits and rounded to fp32 once, as
    :func:`gefen_step_` computes them on the host without rows; ``beta**t`` by binary powering
    instead of the C library's ``pow`` (within a few float64 ulps: the fp32 scalars are the host's
    except where one lies within that of a rounding boundary). No host synchronisation, so a CUDA
    graph can capture it: betas, weight decay and a float lr are then fixed at capture, a tensor
    lr on the device is read at every replay. Step counters are fp32 (exact up to 2**24)."""
    if not sc.rows:
        return
    args, const = _hyper_args(sc, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    _launch(_gefen_hyper_kernel, (1,), args, const, sc.device)

# Every configuration step_plan can choose, one list of values per axis; one value of each is one
# compiled kernel. A new constexpr is one more line here (and its keyword in step_plan). Blocks: every
# tile width from 2 to MAX_BLOCK lanes, as a power of two (aligned, no masked lanes) and as an odd
# length (scalar accesses, masked lanes; 4-bit: two blocks a tile row), and block 1 (per-element v,
# chunks of CHUNK). Tables: codebook tables as code_table builds them (comparisons a bin, repeated
# entries, bins).
_BLOCKS = [1] + [b for k in range(1, 11) for b in ((1 << k), (1 << k) - 1) if b > 1]
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_TABLES = [(1, False, 4096), (1, True, 1024), (2, True, 65536), (3, False, 65536)]  # (ncmp, has_dup, nlut)
_COMMON = dict(block=_BLOCKS, p_dtype=_DTYPES, g_dtype=_DTYPES, align=[True, False], exact=[True, False],
               factor=[False, True], sr=[False, True], hyper=[False, True], w16=[False, True])
# The factor's kernels (factor_plan): blocks as the step's, and beyond FACTOR_WIDTH (column chunks,
# aligned or masked) up to the longest a 4-bit tile row holds. The step scalars' kernel (advance_): lr
# a host float or a tensor on the device (fp32, or fp64), stochastic rounding's seeds or none, and the
# bf16 factors' seeds or none (which the factor's finalize reads at addresses, ``seed_at``).
# Row-group scales (``sub_blocks``): (P, S) as factored matrices of common widths take them (S the
# longest multiple of P up to 2,048 elements dividing the matrix): next_pow2(P) from 4 and next_pow2(S / P)
# from 2, each to 1024, P a power of two, even, odd; at 4 bits even P only (``_scale_refusal``), and the
# groups of up to 512 elements that 4-bit codes take (``_GROUPS_512``; the compact 4-bit layout's).
_GROUPS = [(4, 2048), (3, 2046), (20, 2040), (48, 2016), (128, 2048), (768, 1536), (1000, 2000), (1024, 2048)]
_GROUPS_512 = [(64, 512), (128, 512), (256, 512), (96, 384)]
_NO_BLOCK = {k: v for k, v in _COMMON.items() if k != "block"}
PLAN_AXES = {
    "8bit": dict(_COMMON, bits=[8], quant=[True], table=_TABLES),
    "4bit": dict(_COMMON, bits=[4], quant=[True], table=_TABLES),
    "8bit_groups": dict(_NO_BLOCK, group=_GROUPS, bits=[8], quant=[True], table=_TABLES),
    "4bit_groups": dict(_NO_BLOCK, group=[g for g in _GROUPS if g[0] % 2 == 0] + _GROUPS_512, bits=[4],
                        quant=[True], table=_TABLES),
    "fp32_m": dict(_COMMON, bits=[8], quant=[False]),
    "factor": dict(block=_BLOCKS + [2047, 2048, 3000, 2 * MAX_TILE_WIDTH], g_dtype=_DTYPES, w16=[False, True],
                   seed_at=[False, True]),
    "scalars": dict(lr=["float", torch.float32, torch.float64], sr=[False, True], factor_sr=[False, True]),
}


def _stand_in_tables(bits, ncmp, has_dup, nlut) -> DeviceTables:
    """``DeviceTables`` on the CPU: what the compiler sees of a codebook table."""
    n = 2**bits
    return DeviceTables(torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(nlut, dtype=torch.uint8),
                        torch.zeros(2 * n, dtype=torch.uint8), ncmp, has_dup, nlut)


def launch_configs(cover=axis_pairs) -> list:
    """``KernelLaunch`` of the configurations in ``cover(PLAN_AXES[mode])`` (``axis_pairs``: every
    pair of axis values; ``_triton_common.axis_product``: all), built by the launcher's own code."""
    out = []
    tile_tabs = (torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, PTR_COLUMNS.value, dtype=torch.int64),
                 torch.ones(1, dtype=torch.int64))
    for mode, axes in PLAN_AXES.items():
        if mode == "factor":
            out += _factor_launch_configs(cover(axes), axes)
            continue
        if mode == "scalars":
            out += _scalars_launch_configs(cover(axes), axes)
            continue
        for c in cover(axes):
            plan = {k: v for k, v in c.items() if k not in ("table", "group")}
            if "group" in c:
                plan["block"], plan["scale"] = c["group"]
            chosen = step_plan(**plan)
            tabs = _stand_in_tables(c["bits"], *c["table"]) if c["quant"] else None
            args, table_const = _kernel_args(*tile_tabs, tabs, tile_tabs[2], step=1, lr=1e-3, beta1=0.9, beta2=0.999,
                                             eps=1e-8, weight_decay=0.0, hyper_tab=tile_tabs[2] if c["hyper"] else None)
            name = f"gefen_{mode}/" + ",".join(f"{k}={str(v).replace('torch.', '')}" for k, v in c.items()
                                              if len(axes[k]) > 1)
            out.append(KernelLaunch(name, chosen.kernel, args, dict(chosen.constexprs, **table_const)))
    return out


def _factor_launch_configs(configs, axes) -> list:
    """``KernelLaunch`` of the factor's two kernels at each configuration of ``configs`` (each
    kernel's in a run of their own, so that every k-th launch of the list holds both)."""
    i64, part = torch.zeros(1, 5, dtype=torch.int64), torch.zeros(1)
    stats, final = [], []
    for c in configs:
        fp = factor_plan(**c)
        name = ",".join(f"{k}={str(v).replace('torch.', '')}" for k, v in c.items() if len(axes[k]) > 1)
        stats.append(KernelLaunch("gefen_factor_stats/" + name, _factor_stats_kernel, _stats_args(i64, i64, part),
                                  fp.stats))
        final.append(KernelLaunch("gefen_factor_finalize/" + name, _factor_finalize_kernel,
                                  _final_args(i64, i64, i64, part, i64, beta2=0.999), fp.final))
    return stats + final


def _scalars_launch_configs(configs, axes) -> list:
    """``KernelLaunch`` of ``_gefen_hyper_kernel`` at each configuration of ``configs``."""
    out = []
    for c in configs:
        sc = StepScalars([torch.zeros(1, dtype=torch.float32)], [1 if c["sr"] else None], [None], "cpu",
                         [1 if c["factor_sr"] else None])
        lr = 1e-3 if c["lr"] == "float" else torch.zeros(1, dtype=c["lr"])
        args, const = _hyper_args(sc, lr=lr, beta1=0.9, beta2=0.999, weight_decay=0.0)
        name = ",".join(f"{k}={str(v).replace('torch.', '')}" for k, v in c.items() if len(axes[k]) > 1)
        out.append(KernelLaunch("gefen_scalars/" + name, _gefen_hyper_kernel, args, const))
    return out
