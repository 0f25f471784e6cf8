"""Triton kernels for Gefen: the fused in-place step and the codebook histogram.

Layered as the conventions ask: private ``@triton.jit`` kernels, launchers that handle shapes,
contiguity, grids and tile sizes, and the public functions

    gefen_step_(p, g, v, scales, codes, codebook, *, step, lr, beta1, beta2, eps, weight_decay,
                block, bits)
    histogram_(counts, g, *, block, bins=4096)

``gefen_step_`` takes the keyword signature of :func:`optim.gefen.reference.gefen_step` and the
state layout fixed in that module's docstring (v and scales fp32, codes uint8 or packed 4-bit low
nibble first, scale blocks of ``S = block`` or ``S = CHUNK = 256`` when ``block == 1`` with a partial
last chunk, ``codebook=None`` for an unquantised fp32 first moment stored in ``codes``), but updates
``p``, ``v``, ``scales`` and ``codes`` in place. ``p``/``g`` may be fp32, bf16 or fp16; the math is
fp32. Each of ``p, g, v, scales, codes`` may also be a list (a group of tensors that share
``block``, ``bits`` and the hyperparameters): the whole group is then one kernel launch (per
parameter dtype), because a GPT-2-small parameter set has ~150 tensors whose whole step moves only
~1.75 GB (~0.4 ms at H200 bandwidth), so per-tensor launches (tens of us of host time each, an
estimate) would leave the GPU idle. The launch tables are cached per set of tensors: a repeated
call costs ~8 tensor attribute reads per tensor (measured on this project's 2-core CI-class CPU:
3.6 ms for 580 tensors, against 46 ms when every call re-validated and re-viewed them).

Both run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests run them).

The kernels themselves, and why they look the way they do, are in ``_triton_kernels.py``.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton.language as tl

from optim.gefen._triton_kernels import (  # noqa: F401  (constants re-exported for users and tests)
    ELEMS_PER_THREAD, HIST_BINS, HIST_TILE, LUT_BINS, LUT_MARGIN, MAX_TILE_WIDTH, TILE, _TL_DTYPES,
    _gefen_step4_kernel, _gefen_step_kernel, _histogram_kernel)
from optim.gefen.reference import num_code_bytes, num_scales, scale_block_length

# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------
def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _prev_pow2(x: int) -> int:
    return 1 << max(0, int(x).bit_length() - 1)


def _check_runnable(t: torch.Tensor, name: str):
    if t.device.type == "cuda":
        return
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"{name} is on {t.device}: the Triton Gefen kernels need CUDA tensors, or "
            "TRITON_INTERPRET=1 set before triton is imported to run them on CPU; otherwise use "
            "Gefen(..., backend='torch')")


_TABLE_CACHE: dict = {}


def _codebook_tables(codebook: torch.Tensor, device, bits: int):
    """Device tables for the nearest-entry search, built once per codebook (cached).

    Returns (cb, uniq, mid, lut, first, ncmp, has_dup, nlut). ``cb`` is the codebook (fp32) for
    dequantising; ``uniq`` its distinct values; ``mid`` the fp32 midpoints between consecutive
    distinct values padded with +inf; ``lut`` (uint8, ``nlut``) the number of midpoints left of each
    uniform bin of [-1, 1]; ``first`` the codes of each distinct value (first copy, last copy);
    ``ncmp`` the most midpoints one bin can hold (the comparisons after the table read). ``nlut``
    starts at LUT_BINS and grows 4x (to 65536 at most) while ncmp > 4, i.e. for distinct entries
    closer than a bin: the test suite's 'dense' codebook needs 6 compares at 4096 bins, 2 at 16384.
    """
    # Keyed on the codebook object itself (held, so its address cannot be reused by another
    # tensor while cached) and its version counter (bumped by any in-place change).
    key = (id(codebook), codebook._version, str(device))
    hit = _TABLE_CACHE.get(key)
    if hit is not None and hit[0] is codebook:
        return hit[1]
    if codebook.dim() != 1 or not 2 <= codebook.numel() <= 2**bits:
        raise ValueError(f"codebook must be 1-D with 2..{2**bits} entries for bits={bits}, "
                         f"got shape {tuple(codebook.shape)}")
    c32 = codebook.detach().to("cpu", torch.float32)
    if not torch.isfinite(c32).all() or (c32[1:] < c32[:-1]).any():
        raise ValueError("codebook must be finite and sorted ascending (optimal_codebook returns it so)")
    uniq = torch.unique_consecutive(c32)
    # Codes of each distinct value for x <= value (its first copy) and x > value (its last copy):
    # the reference's searchsorted-then-compare-neighbours rule, so codes match it bit for bit.
    first = torch.stack([torch.searchsorted(c32, uniq, side="left"),
                         torch.searchsorted(c32, uniq, side="right") - 1], dim=1).reshape(-1)
    mid64 = (uniq[:-1].double() + uniq[1:].double()) / 2
    mid = torch.cat([mid64.float(), torch.tensor([math.inf])])
    nlut = LUT_BINS
    while True:
        edges = torch.linspace(-1.0, 1.0, nlut + 1, dtype=torch.float64)
        lo = torch.searchsorted(mid64, edges[:-1] - LUT_MARGIN, side="left")
        hi = torch.searchsorted(mid64, edges[1:] + LUT_MARGIN, side="left")
        ncmp = int((hi - lo).max()) if mid64.numel() else 0
        if ncmp <= 4 or nlut >= 65536:
            break
        nlut *= 4
    out = (
        c32.to(device), uniq.to(device), mid.to(device), lo.to(torch.uint8).to(device),
        first.to(torch.uint8).to(device), ncmp, uniq.numel() < c32.numel(), nlut,
    )
    if len(_TABLE_CACHE) > 16:
        _TABLE_CACHE.clear()
    _TABLE_CACHE[key] = (codebook, out)
    return out


_PLAN_CACHE: dict = {}


def _launch_plan(rows, *, block, bits, quant, tile, num_warps):
    """Launches for `rows` = [(index, p, g, v, scales, codes)] (flat, contiguous, validated).

    One launch per kind of tensor (below): [kernel, tile table [n_tiles, 2] int64 of (tensor, first
    tile row), pointer table [n, 5] int64 (p, g, v, scales, codes), numel table, grid,
    constexprs, indices of its tensors in the call]. Tables are built on the host and copied to
    the device once per set of tensors (see `gefen_step_`'s plan cache).
    """
    s_len = scale_block_length(block)
    four = quant and bits == 4
    group = 2 if four and s_len % 2 else 1
    lanes = group * s_len // 2 if four else s_len  # live lanes of a tile row: bytes or elements
    width = _next_pow2(lanes)
    if width > MAX_TILE_WIDTH:
        raise ValueError(f"block={block} is longer than one Triton program holds "
                         f"({MAX_TILE_WIDTH}); use backend='torch' for it")
    # One launch per (dtypes, alignment, exactness): a misaligned tensor or one whose size is not a
    # whole number of tile rows only de-vectorises its own launch.
    by_kind: dict = {}
    for r in rows:
        align = all(t.data_ptr() % 16 == 0 for t in r[1:])
        exact = r[1].numel() % (group * s_len) == 0
        by_kind.setdefault((r[1].device, r[1].dtype, r[2].dtype, align, exact), []).append(r)
    launches = []
    for (device, pdt, gdt, align, exact), rs in by_kind.items():
        numels = [r[1].numel() for r in rs]
        trows = [-(-(num_code_bytes(n, 4) if four else n) // lanes) for n in numels]
        per_tile = tile // 2 if four else tile
        rr = min(_prev_pow2(per_tile // width), _next_pow2(max(trows)))  # tl.arange needs 2**k
        ntiles = [-(-t // rr) for t in trows]
        tid = torch.repeat_interleave(torch.arange(len(ntiles)), torch.tensor(ntiles))
        start = torch.cat([torch.arange(k) * rr for k in ntiles])
        tiles = torch.stack([tid, start], dim=1).contiguous().to(device)
        ptrs = torch.tensor([[t.data_ptr() for t in r[1:]] for r in rs], dtype=torch.int64).to(device)
        numel_tab = torch.tensor(numels, dtype=torch.int64).to(device)
        warps = num_warps or max(1, min(16, rr * width * (2 if four else 1) // (32 * ELEMS_PER_THREAD)))
        const = dict(P_DT=_TL_DTYPES[pdt], G_DT=_TL_DTYPES[gdt], C_DT=tl.uint8 if quant else tl.float32,
                     S=s_len, BLOCK_V=1 if block == 1 else s_len, R=rr, WIDTH=width, ALIGN=align,
                     EXACT=exact, num_warps=warps)
        const.update({"GROUP": group} if four else {"QUANT": quant})
        kernel = _gefen_step4_kernel if four else _gefen_step_kernel
        launches.append([kernel, tiles, ptrs, numel_tab, (int(tiles.shape[0]),), const,
                         [r[0] for r in rs]])
    return launches


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
                or any(gptrs[i] % 16 for ln in self.launches if ln[5]["ALIGN"] for i in ln[6])):
            return False
        for launch in self.launches:
            col = torch.tensor([gptrs[i] for i in launch[6]], dtype=torch.int64)
            launch[2][:, 1].copy_(col, non_blocking=True)
        self.gptrs = gptrs
        return True


_NO_GUARD = contextlib.nullcontext()
_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel
_IS_CONTIGUOUS = torch.Tensor.is_contiguous


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _validate(ps, gs, vs, ss, cs, *, block, bits, quant):
    """Check every tensor against the reference's layout; return (rows to launch, copies back)."""
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
        rows.append((i, pw, gi.contiguous(), vi, si if quant else vi, ci))  # unquantised: slot unused
    return rows, copies


def gefen_step_(p, g, v, scales, codes, codebook, *, step, lr, beta1, beta2, eps, weight_decay,
                block, bits, tile=TILE, num_warps=None):
    """One Gefen step in place: the rule and state layout of :func:`optim.gefen.reference.gefen_step`.

    ``p, g, v, scales, codes`` are tensors of one parameter, or equal-length lists of them (a
    group sharing ``block``, ``bits`` and every hyperparameter; launched together, split only by
    parameter and gradient dtype). ``p`` (fp32/bf16/fp16, any shape) is updated in place, as are
    ``v`` (fp32), ``scales`` (fp32) and ``codes`` (uint8; the fp32 first moment when
    ``codebook is None``, ``scales`` then unused), which must be contiguous. ``step`` is t, counted
    from 1. ``tile`` and ``num_warps`` are tuning knobs for benchmarks. Returns None.

    Host cost: the first call with a set of tensors validates them and builds the launch tables;
    later calls with the same p, v, scales, codes (same addresses, sizes, dtypes) go straight to
    the launch after ~8 attribute reads per tensor; new gradient addresses (re-allocated grads)
    cost one small host-to-device copy of their pointers.
    """
    ps, gs, vs, ss, cs = (_as_list(x) for x in (p, g, v, scales, codes))
    if not len(ps) == len(gs) == len(vs) == len(ss) == len(cs):
        raise ValueError("p, g, v, scales, codes must be lists of the same length")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    quant = codebook is not None
    key = (block, bits, quant, tile, num_warps, tuple(map(_DATA_PTR, ps)), tuple(map(_NUMEL, ps)),
           tuple(p.dtype for p in ps), tuple(map(_DATA_PTR, vs)), tuple(map(_DATA_PTR, cs)),
           tuple(map(_DATA_PTR, ss)) if quant else None)
    plan = _PLAN_CACHE.get(key)
    if plan is not None:
        gptrs = tuple(map(_DATA_PTR, gs))
        if not all(map(_IS_CONTIGUOUS, ps)) or (gptrs != plan.gptrs and not plan.update_grads(gs, gptrs)):
            plan = None
    copies = []
    if plan is None:
        rows, copies = _validate(ps, gs, vs, ss, cs, block=block, bits=bits, quant=quant)
        if not rows:
            return
        plan = _Plan(_launch_plan(rows, block=block, bits=bits, quant=quant, tile=tile,
                                  num_warps=num_warps), gs)
        if not copies:  # a temporary contiguous copy has a new address each call
            if len(_PLAN_CACHE) > 64:
                _PLAN_CACHE.clear()
            _PLAN_CACHE[key] = plan
    launches = plan.launches
    if not launches:
        return
    bc1 = 1 - beta1**step
    bc2 = 1 - beta2**step
    for kernel, tiles, ptrs, numel_tab, grid, const, _ in launches:
        device = tiles.device
        if quant:
            cb, uniq, mid, lut, first, ncmp, has_dup, nlut = _codebook_tables(codebook, device, bits)
        else:
            cb = uniq = mid = lut = first = numel_tab  # unused pointers
            ncmp, has_dup, nlut = 0, False, LUT_BINS
        with torch.cuda.device(device) if device.type == "cuda" else _NO_GUARD:
            kernel[grid](tiles, ptrs, numel_tab, cb, uniq, mid, lut, first,
                         1 - beta1, beta2, 1 - beta2, eps, 1 - lr * weight_decay, -lr / bc1,
                         math.sqrt(bc2), NLUT=nlut, NCMP=ncmp, HAS_DUP=has_dup,
                         enable_fp_fusion=False, **const)
    for pi, pw in copies:
        pi.copy_(pw.view_as(pi))


def histogram_(counts, g, *, block, bins=HIST_BINS):
    """Add to ``counts`` the histogram of g divided by its scale block's absmax (0 where that is 0).

    Same counts as ``optim.gefen.cpu.histogram(gs, block=block, bins=bins)``: ``g`` is a tensor or
    a list of tensors of one v-block length ``block`` (P); each is flattened and cut into scale
    blocks of ``S = reference.scale_block_length(P)`` elements (a partial last one allowed); x =
    g / absmax falls into bin ``clamp(floor((x + 1) * bins / 2), 0, bins - 1)`` of ``bins`` uniform
    bins on [-1, 1]. ``counts``: 1-D, ``bins`` entries, int32, int64 or fp32, on g's device; every
    program adds its local counts with one atomic add per bin. Returns ``counts``.
    """
    if bins & (bins - 1) or not 1 <= bins <= 16384:
        raise ValueError(f"bins must be a power of two <= 16384, got {bins}")
    if counts.dim() != 1 or counts.numel() != bins or not counts.is_contiguous():
        raise ValueError(f"counts must be a contiguous 1-D tensor of {bins} entries, got {tuple(counts.shape)}")
    if counts.dtype not in (torch.int32, torch.int64, torch.float32):
        raise TypeError(f"counts must be int32, int64 or float32, got {counts.dtype}")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    s_len = scale_block_length(block)
    width = _next_pow2(s_len)
    if width > MAX_TILE_WIDTH:
        raise ValueError(f"block={block} is longer than one Triton program holds ({MAX_TILE_WIDTH})")
    for i, gi in enumerate(_as_list(g)):
        if gi.dtype not in _TL_DTYPES:
            raise TypeError(f"g[{i}] must be fp32, bf16 or fp16, got {gi.dtype}")
        if counts.device != gi.device:
            raise ValueError(f"counts is on {counts.device}, g[{i}] on {gi.device}")
        n = gi.numel()
        if n == 0:
            continue
        if n % block:
            raise ValueError(f"block={block} does not divide g[{i}].numel()={n}")
        _check_runnable(gi, f"g[{i}]")
        nrows = -(-n // s_len)
        r = min(_prev_pow2(TILE // width), _next_pow2(nrows))
        iters = max(1, min(HIST_TILE // (r * width), -(-nrows // r)))
        grid = (-(-nrows // (r * iters)),)
        with torch.cuda.device(gi.device) if gi.device.type == "cuda" else _NO_GUARD:
            _histogram_kernel[grid](gi.contiguous().view(-1), counts, n, S=s_len, R=r, WIDTH=width,
                                    ITERS=iters, BINS=bins, enable_fp_fusion=False,
                                    num_warps=max(1, min(16, r * width // (32 * ELEMS_PER_THREAD))))
    return counts
