"""Compiled (numba) CPU Gefen step: one pass per tensor, two short passes per scale block.

Kept in its own module so that ``import optim.gefen.cpu`` does not import numba; ``cpu.py``'s
vectorised torch path computes the same step and is used when numba is missing or disabled.

Why numba: on this project's 2-core CPU one elementwise torch pass over 3.4 M fp32 elements
costs ~7 ms, and the vectorised step needs ~25 of them plus gathers (~300-500 ms a step, 40x
fused AdamW); ``torch.compile`` of the whole bucket function fused it to ~110 ms (8x AdamW) after
a 23 s compile. Here each scale block is read once (g, old code -> v, m~, absmax into a
block-sized buffer) and written once (code, p), which is what fused AdamW does.

The arithmetic mirrors ``reference.gefen_step`` in fp32 (all scalars arrive as float32):
``lerp`` as torch's vectorised CPU kernel computes it (one fused multiply-add, emulated exactly
enough in float64), ``addcdiv`` as ``p + (value * m^) / denom``, the nearest code as
``codebook.nearest_code`` (lookup table + one boundary comparison). The block mean of g**2 is
summed in float64, so v may differ from torch's fp32 sum in the last bit.
"""

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, error_model="numpy")
def _lerp(m, g, w):
    # torch CPU: weight < 0.5 -> fma(w, g - m, m); else fma(w - 1, g - m, g)
    d = np.float64(g - m)
    if abs(w) < 0.5:
        return np.float32(np.float64(w) * d + np.float64(m))
    return np.float32(np.float64(w - np.float32(1.0)) * d + np.float64(g))


@njit(cache=True, nogil=True, error_model="numpy")
def _get_code(codes, i, bits):
    if bits == 8:
        return np.int64(codes[i])
    b = np.int64(codes[i >> 1])
    return (b >> 4) if (i & 1) else (b & 15)


@njit(cache=True, nogil=True, error_model="numpy")
def _set_code(codes, i, c, bits):
    if bits == 8:
        codes[i] = np.uint8(c)
    else:
        k = i >> 1
        old = np.int64(codes[k])
        codes[k] = np.uint8(((old & 15) | (c << 4)) if (i & 1) else ((old & 240) | c))


@njit(cache=True, nogil=True, error_model="numpy")
def gefen_step_quantized(p, g, v, scales, codes, cb, lut_code, lut_bound, lut_lo, lut_hi,
                         lut_scale, block, S, bits, w1, beta2, one_minus_beta2, decay, neg_step,
                         bc2_sqrt, eps, mbuf):
    """In place on flat fp32 ``p``, ``g``, ``v``, ``scales``, uint8 ``codes`` (see reference).

    Nearest code of q in [-1, 1] as ``codebook.nearest_code``: bin u of q, code ``lut_code[u]``
    plus one if ``q > lut_bound[u]`` (the next decision boundary); ``lut_lo[u]``/``lut_hi[u]``
    are the two codebook values, so no load depends on another (measured: 5.5x -> 4.7x fused
    AdamW's single-thread time against a code -> boundary -> value chain of loads).
    """
    n = p.size
    top = lut_code.size - 1
    zero = np.float32(0.0)
    denom = zero
    for j in range(scales.size):
        start = j * S
        stop = min(start + S, n)
        s_old = scales[j]
        # pass 1: g**2 of the block, v (per element when block == 1), m~ into mbuf, its absmax
        acc = 0.0
        amax = zero
        for i in range(start, stop):
            gi = g[i]
            if block == 1:
                v[i] = beta2 * v[i] + one_minus_beta2 * (gi * gi)
            else:
                acc += np.float64(gi * gi)
            m = _lerp(cb[_get_code(codes, i, bits)] * s_old, gi, w1)
            mbuf[i - start] = m
            amax = max(amax, abs(m))
        if block > 1:  # S == block: one v per scale block
            vj = beta2 * v[j] + one_minus_beta2 * np.float32(acc / block)
            v[j] = vj
            denom = np.float32(np.sqrt(vj) / bc2_sqrt) + eps
        scales[j] = amax
        nonzero = amax > zero
        # pass 2: requantise, parameter update
        for i in range(start, stop):
            q = mbuf[i - start] / amax if nonzero else zero
            u = min(np.int64(q * lut_scale + lut_scale), top)  # |q| <= 1; only q == 1 overflows
            up = q > lut_bound[u]
            m_hat = (lut_hi[u] if up else lut_lo[u]) * amax
            _set_code(codes, i, np.int64(lut_code[u]) + np.int64(up), bits)
            if block == 1:
                denom = np.float32(np.sqrt(v[i]) / bc2_sqrt) + eps
            p[i] = p[i] * decay + (neg_step * m_hat) / denom
