"""Pieces both Triton kernel families use: launch sizes, bf16 rounding, and what their planners
enumerate configurations with (``KernelLaunch`` and the covers of ``PLAN_AXES``)."""

import dataclasses
import itertools

import triton
import triton.language as tl


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (1 for x <= 1): ``tl.arange`` needs power-of-two lengths."""
    return 1 << max(0, int(x) - 1).bit_length()


def prev_pow2(x: int) -> int:
    """Largest power of two <= x (1 for x <= 1)."""
    return 1 << max(0, int(x).bit_length() - 1)


@triton.jit
def round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32; NaN stays NaN.

    Compiled Triton converts fp32 -> bf16 by rounding to nearest, Triton's interpreter by
    truncation. Rounding here first makes the final conversion exact on both, so the CPU tests
    check what the GPU computes, for three integer operations an element.
    """
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return tl.where(x == x, r.to(tl.float32, bitcast=True), x)


@triton.jit
def hash32(x):
    """lowbias32 of uint32 ``x`` (``optim._rounding.hash32``; uint32 arithmetic wraps)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def round_stochastic(x, seed, offs, DT: tl.constexpr):
    """fp32 ``x`` rounded stochastically to ``DT`` (bf16 or fp16; fp32 unchanged), still as fp32 and
    exactly representable in DT: ``optim._rounding.round_stochastic`` with the random word of
    element index ``offs`` under ``seed``, so the same bits as the torch and numba steps."""
    if DT == tl.float32:
        return x
    h = hash32(offs.to(tl.uint32) * 0x9E3779B9 + seed.to(tl.uint32))
    finite = tl.abs(x) < float("inf")
    if DT == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        up = ((b + (h & 0xFFFF)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        return tl.where(finite & (tl.abs(up) < float("inf")), up, round_bf16(x))
    near = x.to(tl.float16)
    back = near.to(tl.float32)
    diff = x - back
    hb = near.to(tl.int16, bitcast=True).to(tl.int32)
    neg = diff < 0
    away = tl.where((hb & 0x7FFF) == 0, tl.where(neg, -32767, 1), tl.where(neg == (hb < 0), hb + 1, hb - 1))
    away_f = away.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    prob = tl.div_rn(tl.abs(diff), tl.abs(away_f - back))
    u = (h >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
    take = (u < prob) & (diff != 0) & finite & (tl.abs(away_f) < float("inf")) & (tl.abs(back) < float("inf"))
    return tl.where(take, away_f, back)


@dataclasses.dataclass
class KernelLaunch:
    """One configuration a launcher can choose: ``kernel[grid](*args, **kwargs)`` without the grid.

    ``name`` identifies the configuration in reports (kernel and the planner's choices); the
    arguments are small CPU stand-ins whose dtypes and alignment are what the compiler sees
    (compiled ahead of time by ``experiments/harness/triton_aot.py``).
    """

    name: str
    kernel: object
    args: tuple
    kwargs: dict

    @property
    def num_warps(self) -> int:
        return int(self.kwargs.get("num_warps", 4))


def spec_widths(max_width: int) -> list:
    """Row widths that reach every tile width up to ``max_width`` under both of Triton's integer
    specialisations: each power of two (a multiple of 16 from 16 up: 128-bit accesses) and, from
    16 up, one less (odd: scalar accesses)."""
    out = []
    w = 1
    while w <= max_width:
        out += [w] + ([w - 1] if w >= 16 else [])
        w *= 2
    return out


def axis_product(axes: dict) -> list:
    """Every combination of one value per axis, as dicts (the full configuration space)."""
    keys = list(axes)
    return [dict(zip(keys, vals)) for vals in itertools.product(*axes.values())]


def axis_pairs(axes: dict) -> list:
    """A small set of combinations in which every pair of values of two different axes occurs
    (a greedy all-pairs covering array; every value of every axis occurs). Deterministic."""
    keys = list(axes)
    sizes = [len(axes[k]) for k in keys]
    uncovered = {(i, a, j, b) for i in range(len(keys)) for j in range(i + 1, len(keys))
                 for a in range(sizes[i]) for b in range(sizes[j])}
    order = sorted(range(len(keys)), key=lambda i: -sizes[i])
    rows = []
    while uncovered or not rows:
        row = {}
        if uncovered:
            i, a, j, b = min(uncovered)
            row = {i: a, j: b}
        for k in order:
            if k not in row:
                row[k] = max(range(sizes[k]), key=lambda v: sum(
                    (min(k, m), v if k < m else row[m], max(k, m), row[m] if k < m else v) in uncovered
                    for m in row))
        uncovered -= {(i, row[i], j, row[j]) for i in row for j in row if i < j}
        rows.append({keys[k]: axes[keys[k]][row[k]] for k in range(len(keys))})
    return rows


def axis_each(axes: dict) -> list:
    """As many combinations as the longest axis has values, axis values taken in turn: every value
    of every axis occurs (the smallest covering set)."""
    n = max(len(v) for v in axes.values())
    return [{k: v[r % len(v)] for k, v in axes.items()} for r in range(n)]
