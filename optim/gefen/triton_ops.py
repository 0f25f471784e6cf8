"""Gefen's fused in-place step in Triton: launchers for the kernels of ``_triton_kernels.py``.

    gefen_step_(ps, gs, vs, scales, codes, codebook, *, step, lr, beta1, beta2, eps, weight_decay,
                block, bits, tables=None)

takes the signature of :func:`optim.gefen.torch_ops.gefen_step_` and the state layout fixed in
``reference.py``'s docstring (v and scales fp32, codes uint8 or packed 4-bit low nibble first,
scale blocks of ``S = block`` or ``S = CHUNK = 256`` when ``block == 1`` with a partial last chunk,
``codebook=None`` for an unquantised fp32 first moment stored in ``codes``), and updates ``p``,
``v``, ``scales`` and ``codes`` in place. ``p``/``g`` may be fp32, bf16 or fp16; the math is fp32.
Each of ``ps, gs, vs, scales, codes`` is a list (a group of tensors that share ``block``, ``bits``
and the hyperparameters) or one tensor: the whole group is one kernel launch per kind of tensor,
because a model's step is many small tensors whose one launch each would leave the GPU waiting on
the host. The launch tables are cached per set of tensors (``optim._cache.BoundedCache``), so a
repeated call only reads a few attributes of each tensor.

Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests run it).

Agreement with the reference: one step from the same state gives the reference's scales and codes
exactly; p and v only to fp32 rounding, because v's block mean of g**2 is summed in another order
than ``torch.mean``, and torch's CPU ``sqrt`` is not always correctly rounded where ``tl.sqrt_rn``
is. Over a training run those ulps change the next gradients, and once a value m~/s of the two runs
falls on the two sides of a code boundary the runs hold different codes: m^ then differs by one
codebook gap times the scale, and the weights part by more than rounding from then on. The numba
backend, also correct to rounding, parts from the torch one the same way. 4-bit codebooks have
gaps 16 times wider, so such a crossing is rarer there. ``experiments/correctness.py`` measures
both over a training run (``results/README.md``, "Correctness against independent references").
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import triton.language as tl

from .._cache import BoundedCache
from .._triton_common import KernelLaunch, axis_pairs, next_pow2, prev_pow2
from ..backends import triton_interpreted
from ._triton_kernels import (ELEMS_PER_THREAD, MAX_TILE_WIDTH, TILE, _TL_DTYPES,
                              _gefen_step4_kernel, _gefen_step_kernel)
from . import torch_ops
from .checks import check_factors
from .codebook import code_table
from .reference import num_code_bytes, num_scales, scale_block_length


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


class Launch(NamedTuple):
    """One kernel launch of a plan: tensors of one kind (dtypes, alignment, exactness)."""

    kernel: object
    tiles: torch.Tensor  # (n_tiles, 2) int64: (tensor, first tile row) of each program
    ptrs: torch.Tensor  # (n, 5) int64: addresses of p, g, v, scales, codes
    numels: torch.Tensor  # (n,) int64
    grid: tuple
    constexprs: dict
    indices: list  # position of each of its tensors in the call
    factor_ptrs: torch.Tensor  # (n,) int64 addresses of w (``numels`` when not factored: unused)


class _Row(NamedTuple):
    """A validated tensor of the call (flat and contiguous where the kernel reads it)."""

    index: int
    p: torch.Tensor
    g: torch.Tensor
    v: torch.Tensor
    scales: torch.Tensor  # v again when unquantised (the slot is unused)
    codes: torch.Tensor


def _table_of(codebook):
    """``code_table(codebook)``, cached on the codebook object and its version counter (bumped by
    any in-place change)."""
    return _CODE_TABLES.get_or_build((id(codebook), codebook._version), lambda: code_table(codebook),
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


def tile_row_lanes(block: int, bits: int, quant: bool) -> int:
    """Live lanes of one tile row: a scale block's elements, or the bytes of its packed 4-bit
    codes (two scale blocks a row when the block length is odd, so no byte straddles rows)."""
    s_len = scale_block_length(block)
    if not (quant and bits == 4):
        return s_len
    return s_len if s_len % 2 else s_len // 2


def step_plan(*, block, bits, quant, p_dtype, g_dtype, align, exact, factor=False, sr=False, tile=TILE,
              num_warps=None) -> StepPlan:
    """The kernel, constexprs and warps of one launch: the launcher's only choice. A tile is R
    whole tile rows of WIDTH = next_pow2(lanes) lanes, R*WIDTH ~ ``tile`` elements (bytes for
    packed 4-bit codes), ELEMS_PER_THREAD elements a thread."""
    s_len = scale_block_length(block)
    four = quant and bits == 4
    group = 2 if four and s_len % 2 else 1
    lanes = tile_row_lanes(block, bits, quant)
    width = next_pow2(lanes)
    if width > MAX_TILE_WIDTH:
        raise ValueError(f"block={block} is longer than one Triton program holds "
                         f"({MAX_TILE_WIDTH}); use backend='torch' for it")
    # Scalar accesses (misaligned or ragged tensors) hold a 64-bit address per element: half the
    # elements a thread, so they too stay within 64 registers without spilling.
    fast = align and exact
    per_thread = ELEMS_PER_THREAD if fast else ELEMS_PER_THREAD // 2
    tile = tile if fast else tile // 2
    rr = prev_pow2(max(1, (tile // 2 if four else tile) // width))  # tl.arange needs 2**k
    # The factored scalar path holds one more pointer an element: one element a thread, up to 32
    # warps (64 registers each, as ptxas is told), so it too stays within 64 registers.
    most = 32 if factor and not fast else 16
    per_thread = per_thread // 2 if factor and not fast else per_thread
    warps = num_warps or max(1, min(most, rr * width * (2 if four else 1) // (32 * per_thread)))
    const = dict(P_DT=_TL_DTYPES[p_dtype], G_DT=_TL_DTYPES[g_dtype], C_DT=tl.uint8 if quant else tl.float32,
                 S=s_len, BLOCK_V=1 if block == 1 else s_len, R=rr, WIDTH=width, ALIGN=align,
                 EXACT=exact, FACTOR=factor, SR=bool(sr) and p_dtype != torch.float32, num_warps=warps)
    if warps > 16:
        const["maxnreg"] = 64
    const.update({"GROUP": group} if four else {"QUANT": quant})
    return StepPlan(_gefen_step4_kernel if four else _gefen_step_kernel, const, lanes)


def _launch_plan(rows, *, block, bits, quant, tile, num_warps, ws=None, sr=False) -> list:
    """The ``Launch`` es of ``rows`` (``_Row`` s: flat, contiguous, validated): one per kind of
    tensor. Tables are built on the host and copied to the device once per set of tensors (see
    ``gefen_step_``'s plan cache)."""
    s_len = scale_block_length(block)
    four = quant and bits == 4
    # One launch per (dtypes, alignment, exactness): a misaligned tensor or one whose size is not a
    # whole number of tile rows only de-vectorises its own launch.
    by_kind: dict = {}
    for r in rows:
        align = all(t.data_ptr() % 16 == 0 for t in (r.p, r.g, r.v, r.scales, r.codes))
        exact = r.p.numel() % ((2 if four and s_len % 2 else 1) * s_len) == 0
        by_kind.setdefault((r.p.device, r.p.dtype, r.g.dtype, align, exact), []).append(r)
    launches = []
    for (device, pdt, gdt, align, exact), rs in by_kind.items():
        plan = step_plan(block=block, bits=bits, quant=quant, p_dtype=pdt, g_dtype=gdt, align=align,
                         exact=exact, factor=ws is not None, sr=sr, tile=tile, num_warps=num_warps)
        R = plan.constexprs["R"]
        numels = [r.p.numel() for r in rs]
        trows = [-(-(num_code_bytes(n, 4) if four else n) // plan.lanes) for n in numels]
        ntiles = [-(-t // R) for t in trows]
        tid = torch.repeat_interleave(torch.arange(len(ntiles)), torch.tensor(ntiles))
        start = torch.cat([torch.arange(k) * R for k in ntiles])
        tiles = torch.stack([tid, start], dim=1).contiguous().to(device)
        ptrs = torch.tensor([[t.data_ptr() for t in (r.p, r.g, r.v, r.scales, r.codes)] for r in rs],
                            dtype=torch.int64).to(device)
        numel_tab = torch.tensor(numels, dtype=torch.int64).to(device)
        w_tab = numel_tab if ws is None else torch.tensor(
            [ws[r.index].data_ptr() for r in rs], dtype=torch.int64).to(device)
        launches.append(Launch(plan.kernel, tiles, ptrs, numel_tab, (int(tiles.shape[0]),), plan.constexprs,
                               [r.index for r in rs], w_tab))
    return launches


def _kernel_args(tiles, ptrs, numel_tab, tabs, w_tab, *, step, lr, beta1, beta2, eps, weight_decay,
                 seed_tab=None):
    """(args, table constexprs) of one launch; ``tabs``: ``DeviceTables``, None unquantised;
    ``w_tab``: the factor pointer table (any int64 tensor when FACTOR is off: unused);
    ``seed_tab``: int64 stochastic-rounding seed of each tensor (unused, None, when SR is off)."""
    if tabs is None:
        tabs = DeviceTables(*[numel_tab] * 5, ncmp=0, has_dup=False, nlut=1)  # unused pointers
    args = (tiles, ptrs, numel_tab, tabs.codebook, tabs.uniq, tabs.mid, tabs.lut, tabs.first, w_tab,
            numel_tab if seed_tab is None else seed_tab, 1 - beta1, beta2, 1 - beta2, eps, 1 - lr * weight_decay, -lr / (1 - beta1**step),
            math.sqrt(1 - beta2**step))
    return args, dict(NLUT=tabs.nlut, NCMP=tabs.ncmp, HAS_DUP=tabs.has_dup, enable_fp_fusion=False)


class _Plan:
    """Cached launches for one set of (p, v, scales, codes) tensors, and the gradients last seen.

    Gradients are often re-allocated every step (``zero_grad(set_to_none=True)``), so they are not
    part of the cache key: when their addresses change, only the pointer table's g column is
    rewritten (a stream-ordered copy: launches already queued still read the old pointers).
    """

    __slots__ = ("launches", "gptrs", "gnumels", "gdtypes")

    def __init__(self, launches, gs):
        self.launches = launches
        self.gptrs = tuple(map(_DATA_PTR, gs))
        self.gnumels = tuple(map(_NUMEL, gs))
        self.gdtypes = tuple(g.dtype for g in gs)

    def update_grads(self, gs, gptrs) -> bool:
        """Point the launches at new gradients; False if they do not fit this plan."""
        if (tuple(map(_NUMEL, gs)) != self.gnumels or tuple(g.dtype for g in gs) != self.gdtypes
                or not all(map(_IS_CONTIGUOUS, gs))
                or any(gptrs[i] % 16 for ln in self.launches if ln.constexprs["ALIGN"] for i in ln.indices)):
            return False
        for launch in self.launches:
            col = torch.tensor([gptrs[i] for i in launch.indices], dtype=torch.int64)
            launch.ptrs[:, 1].copy_(col, non_blocking=True)  # column 1: g
        self.gptrs = gptrs
        return True


_NO_GUARD = contextlib.nullcontext()
_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel
_IS_CONTIGUOUS = torch.Tensor.is_contiguous


def _state_key(t):
    return (t.data_ptr(), t.numel(), t.dtype, t.device, _IS_CONTIGUOUS(t))


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _validate(ps, gs, vs, ss, cs, *, block, bits, quant):
    """Check every tensor against the reference's layout; return (``_Row`` s to launch, (parameter,
    contiguous copy) pairs to copy back)."""
    rows, copies = [], []
    for i, (pi, gi, vi, si, ci) in enumerate(zip(ps, gs, vs, ss, cs)):
        n = pi.numel()
        if gi.numel() != n:
            raise ValueError(f"g[{i}] has {gi.numel()} elements, p[{i}] has {n}")
        if n == 0:
            continue
        if pi.dtype not in _TL_DTYPES or gi.dtype not in _TL_DTYPES:
            raise TypeError(f"p[{i}]/g[{i}] must be fp32, bf16 or fp16, got {pi.dtype}/{gi.dtype}")
        if n % block:
            raise ValueError(f"block={block} does not divide p[{i}].numel()={n}")
        want = [("v", vi, torch.float32, n // block)]
        if quant:
            want += [("scales", si, torch.float32, num_scales(n, block)),
                     ("codes", ci, torch.uint8, num_code_bytes(n, bits))]
        else:
            want += [("codes", ci, torch.float32, n)]
        for name, t, dt, size in want:
            if t.dtype != dt or t.numel() != size or not t.is_contiguous():
                raise ValueError(f"{name}[{i}] must be a contiguous {dt} tensor of {size} elements "
                                 f"(reference.init_state layout), got {t.dtype} {tuple(t.shape)}")
        for name, t in (("g", gi), ("v", vi), ("codes", ci)) + ((("scales", si),) if quant else ()):
            if t.device != pi.device:
                raise ValueError(f"{name}[{i}] is on {t.device}, p[{i}] on {pi.device}")
        _check_runnable(pi, f"p[{i}]")
        pw = pi if pi.is_contiguous() else pi.contiguous()
        if pw is not pi:
            copies.append((pi, pw))
        rows.append(_Row(i, pw, gi.contiguous(), vi, si if quant else vi, ci))
    return rows, copies


def _plan(ps, gs, vs, ss, cs, *, block, bits, quant, tile, num_warps, ws=None, sr=False):
    """(cached or new ``_Plan``, contiguous copies of parameters to write back); (None, []) when
    every tensor is empty."""
    # state tensors by address, size, dtype and layout: a view at a cached address (another
    # dtype, a shorter slice) is validated again, never launched on a plan made for another
    key = (block, bits, quant, tile, num_warps, sr, tuple(map(_DATA_PTR, ps)), tuple(map(_NUMEL, ps)),
           tuple(p.dtype for p in ps), tuple(map(_state_key, vs)), tuple(map(_state_key, cs)),
           tuple(map(_state_key, ss)) if quant else None,
           tuple(map(_state_key, ws)) if ws is not None else None)
    plan = _PLAN_CACHE.get(key)
    if plan is not None:
        gptrs = tuple(map(_DATA_PTR, gs))
        if all(map(_IS_CONTIGUOUS, ps)) and (gptrs == plan.gptrs or plan.update_grads(gs, gptrs)):
            return plan, []
    rows, copies = _validate(ps, gs, vs, ss, cs, block=block, bits=bits, quant=quant)
    if not rows:
        return None, []
    plan = _Plan(_launch_plan(rows, block=block, bits=bits, quant=quant, tile=tile,
                              num_warps=num_warps, ws=ws, sr=sr), gs)
    if not copies:  # a temporary contiguous copy has a new address each call
        _PLAN_CACHE.put(key, plan)
    return plan, copies


def gefen_step_(ps, gs, vs, scales, codes, codebook, *, step, lr, beta1, beta2, eps, weight_decay,
                block, bits, tables=None, tile=TILE, num_warps=None, ws=None, seeds=None):
    """One Gefen step in place: the rule and state layout of :func:`optim.gefen.reference.gefen_step`.

    ``ps, gs, vs, scales, codes`` are tensors of one parameter, or equal-length lists of them (a
    group sharing ``block``, ``bits`` and every hyperparameter; launched together, split only by
    parameter and gradient dtype). ``p`` (fp32/bf16/fp16, any shape) is updated in place, as are
    ``v`` (fp32), ``scales`` (fp32) and ``codes`` (uint8; the fp32 first moment when
    ``codebook is None``, ``scales`` then unused), which must be contiguous. ``step`` is t, counted
    from 1. ``tables``: ``code_table(codebook)`` (built and cached here when not given). ``tile``
    and ``num_warps`` are tuning knobs for benchmarks. ``ws``: per-offset factors of a factored
    second moment (contiguous fp32, ``block`` floats each), updated in place by a torch pass over
    the gradients before the launch (a reduction over every block of a tensor), then read by the
    kernel (``FACTOR``). ``seeds``: one 32-bit seed per tensor: bf16 and fp16 parameters are then
    written with stochastic rounding (``optim._rounding``; ``SR``), else rounded to nearest.
    Returns None.

    Host cost: the first call with a set of tensors validates them and builds the launch tables;
    later calls with the same p, v, scales, codes (same addresses, sizes, dtypes) go straight to
    the launch after a few attribute reads per tensor; new gradient addresses (re-allocated grads)
    cost one small host-to-device copy of their pointers.
    """
    ps, gs, vs, ss, cs = (_as_list(x) for x in (ps, gs, vs, scales, codes))
    if not len(ps) == len(gs) == len(vs) == len(ss) == len(cs):
        raise ValueError("p, g, v, scales, codes must be lists of the same length")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    quant = codebook is not None
    if quant and tables is None:
        tables = _table_of(codebook)
    if ws is not None:
        ws = _as_list(ws)
        check_factors(ps, ws, block=block, device_type=ps[0].device.type if ps else "cpu")
        torch_ops.factor_update_(ws, gs, block=block, beta2=beta2)
        if block == 1:  # r == 1: only w moves
            ws = None
    plan, copies = _plan(ps, gs, vs, ss, cs, block=block, bits=bits, quant=quant, tile=tile,
                         num_warps=num_warps, ws=ws, sr=seeds is not None)
    if plan is None:
        return
    launches = plan.launches
    if not launches:
        return
    for ln in launches:
        device = ln.tiles.device
        tabs = _device_tables(tables, device, bits) if quant else None
        seed_tab = None
        if ln.constexprs["SR"]:  # the seeds change every step: one small copy a launch
            seed_tab = torch.tensor([seeds[i] for i in ln.indices], dtype=torch.int64).to(device, non_blocking=True)
        args, table_const = _kernel_args(ln.tiles, ln.ptrs, ln.numels, tabs, ln.factor_ptrs, step=step, lr=lr,
                                         beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                         seed_tab=seed_tab)
        with torch.cuda.device(device) if device.type == "cuda" else _NO_GUARD:
            ln.kernel[ln.grid](*args, **table_const, **ln.constexprs)
    for pi, pw in copies:
        pi.copy_(pw.view_as(pi))


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
               factor=[False, True], sr=[False, True])
PLAN_AXES = {
    "8bit": dict(_COMMON, bits=[8], quant=[True], table=_TABLES),
    "4bit": dict(_COMMON, bits=[4], quant=[True], table=_TABLES),
    "fp32_m": dict(_COMMON, bits=[8], quant=[False]),
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
    tile_tabs = torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 5, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    for mode, axes in PLAN_AXES.items():
        for c in cover(axes):
            plan = {k: v for k, v in c.items() if k != "table"}
            chosen = step_plan(**plan)
            tabs = _stand_in_tables(c["bits"], *c["table"]) if c["quant"] else None
            args, table_const = _kernel_args(*tile_tabs, tabs, tile_tabs[2], step=1, lr=1e-3, beta1=0.9, beta2=0.999,
                                             eps=1e-8, weight_decay=0.0)
            name = f"gefen_{mode}/" + ",".join(f"{k}={str(v).replace('torch.', '')}" for k, v in c.items()
                                              if len(axes[k]) > 1)
            out.append(KernelLaunch(name, chosen.kernel, args, dict(chosen.constexprs, **table_const)))
    return out
