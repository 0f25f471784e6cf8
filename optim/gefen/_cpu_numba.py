"""Compiled (numba) CPU Gefen step: one pass per tensor, two short passes per scale block.

Kept in its own module so that ``import optim.gefen.cpu`` does not import numba; ``cpu.py``'s
vectorised torch path computes the same step and is used when numba is missing or disabled.

Layout: one call per step for all tensors of a bucket (same block length and step). Python
passes a table of raw data addresses (``meta``: p, g, v, scales, codes addresses and sizes per
tensor) and a job table (tensor, first and last scale block); jobs run in parallel
(``prange``, numba threads = ``torch.get_num_threads()``). A job is a run of whole scale blocks,
so every block's v, absmax and codes are computed exactly as in the serial loop (results do not
depend on the thread count); with 4-bit codes and an odd scale-block length, jobs start at even
blocks so that no two jobs write the same code byte.

Why numba: on this project's 2-core CPU one elementwise torch pass over 3.4 M fp32 elements
costs ~7 ms, and the vectorised step needs ~25 of them plus gathers (~300-500 ms a step, 40x
fused AdamW); ``torch.compile`` of the whole bucket function fused it to ~110 ms (8x AdamW) after
a 23 s compile. Here each scale block is read once (g, old code -> v, m~, absmax into a
block-sized buffer) and written once (code, p), as fused AdamW reads and writes each element once.

One kernel per (bits, block == 1), with both as compile-time constants: a run-time ``bits`` and
``block`` tested inside the element loops made the kernel 2.5x slower (measured: 9.5x fused
AdamW's single-thread time against 3.7x for the sum of the specialised passes).

Arithmetic: as ``reference.gefen_step`` in fp32, scalars passed as float32. Multiply-adds may be
fused (``fastmath={"contract"}``): ``lerp`` is then exactly torch's vectorised CPU lerp (an FMA),
while p and v can differ from the reference in the last bits (also because for block > 1 the
update is ``m^ * (value / denom)``, one division per block); codes do not depend on that (the
lookup table's slack absorbs the rounding of the bin index, the final boundary comparison is
exact). The nearest code is ``codebook.nearest_code``'s: bin u of q, ``lut_code[u]`` plus one if
q exceeds the next boundary ``lut_bound[u]``; ``lut_values[2u]``, ``lut_values[2u + 1]`` hold the
two candidate values, read by index rather than selected (a select compiled to a branch that
mispredicts on random data: pass 2 took 3.8x fused AdamW's time, 2.9x indexed).
"""

import numpy as np
from numba import carray, njit, prange, types
from numba.extending import intrinsic

_KERNELS = {}


@intrinsic
def _f32_ptr(typingctx, addr):
    sig = types.CPointer(types.float32)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
    return sig, codegen


@intrinsic
def _u8_ptr(typingctx, addr):
    sig = types.CPointer(types.uint8)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
    return sig, codegen


def kernel(bits: int, per_element_v: bool):
    """The compiled step for 8- or 4-bit codes and block == 1 (per-element v) or block > 1.

    ``kernel(...)(meta, jobs, cb, lut_code, lut_bound, lut_values, lut_scale, block, S, w1,
    beta2, one_minus_beta2, decay, neg_step, bc2_sqrt, eps)``: ``meta`` int64 (tensors, 9) =
    addresses of p, g, v, scales, codes (contiguous fp32, fp32, fp32, fp32, uint8) and their
    element counts; ``jobs`` int64 (jobs, 3) = tensor row, first scale block, end scale block.
    """
    key = (bits, per_element_v)
    if key not in _KERNELS:
        _KERNELS[key] = _make(bits, per_element_v)
    return _KERNELS[key]


def _make(BITS, PER_ELEMENT):
    @njit(nogil=True, error_model="numpy", fastmath={"contract"}, cache=True)
    def blocks(p, g, v, scales, codes, j0, j1, cb, lut_code, lut_bound, lut_values, lut_scale, block, S, w1,
               beta2, one_minus_beta2, decay, neg_step, bc2_sqrt, eps, mbuf):
        n = p.size
        top = lut_code.size - 1
        zero = np.float32(0.0)
        small_w = abs(w1) < 0.5
        w1m = w1 - np.float32(1.0)
        denom = zero
        step_over_denom = zero
        for j in range(j0, j1):
            start = j * S
            stop = min(start + S, n)
            s_old = scales[j]
            # pass 1: g**2 (v), m~ = lerp(C[code] * s, g, 1 - beta1) into mbuf, its absmax
            acc = zero
            amax = zero
            for i in range(start, stop):
                gi = g[i]
                if PER_ELEMENT:
                    v[i] = beta2 * v[i] + one_minus_beta2 * (gi * gi)
                else:
                    acc += gi * gi
                if BITS == 8:
                    c = np.int64(codes[i])
                else:
                    c = (np.int64(codes[i >> 1]) >> (4 * (i & 1))) & 15
                m0 = cb[c] * s_old
                d = gi - m0
                m = w1 * d + m0 if small_w else w1m * d + gi  # torch's lerp
                mbuf[i - start] = m
                amax = max(amax, abs(m))
            if not PER_ELEMENT:  # S == block: one v per scale block
                vj = beta2 * v[j] + one_minus_beta2 * (acc / np.float32(block))
                v[j] = vj
                denom = np.float32(np.sqrt(vj) / bc2_sqrt) + eps
                step_over_denom = neg_step / denom
            scales[j] = amax
            nonzero = amax > zero
            # pass 2: requantise, parameter update
            for i in range(start, stop):
                q = mbuf[i - start] / amax if nonzero else zero
                u = min(np.int64(q * lut_scale + lut_scale), top)  # |q| <= 1: only q == 1 overflows
                up = np.int64(q > lut_bound[u])
                m_hat = lut_values[2 * u + up] * amax  # indexed, not selected: no branch
                c = np.int64(lut_code[u]) + up
                if BITS == 8:
                    codes[i] = np.uint8(c)
                else:
                    k = i >> 1
                    old = np.int64(codes[k])
                    codes[k] = np.uint8(((old & 15) | (c << 4)) if (i & 1) else ((old & 240) | c))
                if PER_ELEMENT:
                    denom = np.float32(np.sqrt(v[i]) / bc2_sqrt) + eps
                    p[i] = p[i] * decay + (neg_step * m_hat) / denom
                else:  # one division per block, not per element (~10% of the step)
                    p[i] = p[i] * decay + m_hat * step_over_denom

    @njit(nogil=True, error_model="numpy", parallel=True, cache=True)
    def step(meta, jobs, cb, lut_code, lut_bound, lut_values, lut_scale, block, S, w1, beta2,
             one_minus_beta2, decay, neg_step, bc2_sqrt, eps):
        for k in prange(jobs.shape[0]):
            t = jobs[k, 0]
            p = carray(_f32_ptr(meta[t, 0]), (meta[t, 5],))
            g = carray(_f32_ptr(meta[t, 1]), (meta[t, 5],))
            v = carray(_f32_ptr(meta[t, 2]), (meta[t, 6],))
            scales = carray(_f32_ptr(meta[t, 3]), (meta[t, 7],))
            codes = carray(_u8_ptr(meta[t, 4]), (meta[t, 8],))
            mbuf = np.empty(S, dtype=np.float32)
            blocks(p, g, v, scales, codes, jobs[k, 1], jobs[k, 2], cb, lut_code, lut_bound, lut_values,
                   lut_scale, block, S, w1, beta2, one_minus_beta2, decay, neg_step, bc2_sqrt, eps, mbuf)

    return step
