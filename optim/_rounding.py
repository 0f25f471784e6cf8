"""Stochastic rounding of fp32 values to bf16 or fp16, from counter-based random bits.

A bf16 or fp16 weight whose update is under half a unit in the last place never moves under
round-to-nearest. Rounding up with probability equal to the fraction of the gap covered
(``round_stochastic``) moves it by the update in expectation: the rounding is exact in
expectation, its error zero-mean (Gupta et al., 2015, "Deep learning with limited numerical
precision").

The random bits of element ``i`` are ``hash32(i * GOLDEN + seed)`` (mod 2**32), ``hash32`` Chris
Wellons' "lowbias32" integer hash, so every backend draws the same bits for the same element and
seed without a random state of its own: torch here (in int64 arithmetic, masked to 32 bits), the
Triton kernels in uint32 (``_triton_common``). ``step_seed`` mixes an optimizer's base seed, a
parameter's index and its step into the seed of one update.

bf16: add the random low 16 bits to the fp32 bit pattern and truncate them (rounds the magnitude up
with probability equal to the truncated fraction). fp16: round to nearest, then move to the
neighbour on the other side of the value with probability ``|x - nearest| / gap``, compared with a
24-bit uniform. NaN, infinities and values that round to an infinity keep round-to-nearest's result.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
STOCHASTIC_DTYPES = (torch.bfloat16, torch.float16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 tensors holding values below 2**32, without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 values below 2**32 (returned the same way)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def hash32_int(x: int) -> int:
    """``hash32`` of one Python int (mod 2**32)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    return x ^ (x >> 16)


def step_seed(base: int, index: int, step: int) -> int:
    """The 32-bit seed of one update: optimizer seed ``base``, parameter ``index``, step ``step``."""
    return hash32_int(hash32_int(hash32_int(base) ^ index) + step * GOLDEN)


def random_bits(seed: int, offset: int, n: int, device) -> torch.Tensor:
    """int64 tensor of the 32-bit random words of elements ``offset .. offset + n - 1``."""
    i = torch.arange(offset, offset + n, dtype=torch.int64, device=device) & MASK32
    return hash32((_mul32(i, GOLDEN) + (seed & MASK32)) & MASK32)


def round_stochastic(x: torch.Tensor, dtype: torch.dtype, seed: int, offset: int = 0) -> torch.Tensor:
    """fp32 ``x`` (any shape) rounded stochastically to ``dtype`` (bf16 or fp16; others: plain cast).

    Element ``k`` of the flattened ``x`` uses the random word of index ``offset + k``.
    """
    if dtype not in STOCHASTIC_DTYPES:
        return x.to(dtype)
    x = x.float()
    r = random_bits(seed, offset, x.numel(), x.device).view(x.shape)
    nearest = x.to(dtype)
    if dtype == torch.bfloat16:
        bits = x.view(torch.int32).to(torch.int64) & MASK32
        up = (((bits + (r & 0xFFFF)) >> 16) & 0xFFFF).to(torch.int32)
        up = torch.where(up >= 0x8000, up - 0x10000, up).to(torch.int16).view(torch.bfloat16)
        keep = ~torch.isfinite(x) | ~torch.isfinite(up)
        return torch.where(keep, nearest, up)
    back = nearest.float()
    diff = x - back
    hb = nearest.view(torch.int16).to(torch.int32)
    # the neighbour of ``nearest`` on the side of x: one step in the bit pattern, away from zero
    # when x's remainder has the sign of ``nearest`` (or ``nearest`` is a zero), towards it otherwise
    neg_diff = diff < 0
    zero = (hb & 0x7FFF) == 0
    away = torch.where(zero, torch.where(neg_diff, 0x8001, 0x0001),
                       torch.where(neg_diff == (hb < 0), hb + 1, hb - 1))
    away = torch.where(away >= 0x8000, away - 0x10000, away).to(torch.int16).view(torch.float16)
    gap = (away.float() - back).abs()
    prob = diff.abs() / gap
    u = (r >> 8).float() * 2.0**-24
    take = (u < prob) & (diff != 0) & torch.isfinite(x) & torch.isfinite(away) & torch.isfinite(nearest)
    return torch.where(take, away, nearest)
