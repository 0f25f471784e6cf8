"""Pieces both Triton kernel families use: launch sizes and bf16 rounding."""

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
