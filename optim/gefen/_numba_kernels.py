"""The ``@numba.njit`` bodies of Gefen's CPU step; launched by ``numba_ops.py``.

Layout: one call per step for all tensors of a group (same block length and step). Python
passes a table of raw data addresses (``meta``: p, g, v, scales, codes addresses and sizes per
tensor) and a job table (tensor, first and last scale block); jobs run in parallel
(``prange``, numba threads = ``torch.get_num_threads()``). A job is a run of whole scale blocks,
so every block's v, absmax and codes are computed exactly as in the serial loop (results do not
depend on the thread count); with 4-bit codes and an odd scale-block length, jobs start at even
blocks so that no two jobs write the same code byte.

Every compiled function is top level with one signature: the code width, ``block == 1`` and an
unquantised first moment are run-time flags tested once per scale block, not per element. Top-level functions have one on-disk
cache entry each, so processes compiling at the same time cannot load each other's variants.

Passes: each scale block (S <= 1024 elements, so its buffers stay in L1) goes through short
loops, each written so that LLVM vectorises it or, where it cannot (table lookups are gathers,
which LLVM keeps scalar), so that the scalar loop holds nothing but the lookup. A single loop
doing everything per element compiles to scalar code (a scalar division per element);
``experiments/bench_kernels.py`` times the passes against ``torch.optim.AdamW``:

1. decode ``C[code] * s`` into a block buffer (scalar lookup; 4 bits: nibbles unpacked first);
2. lerp with g in place (vector; an FMA, exactly torch's vectorised CPU ``lerp``);
3. absmax as an integer max over the buffer's bit patterns (vector; exact: for non-negative
   floats the integer order is the float order, and a NaN stays the largest);
4. v: sum of g**2 (block > 1; vector, in 8 interleaved lanes: the order of the sum differs from
   torch's, so v is equal to fp32 rounding) or per element (block == 1);
5. q = m / absmax (vector ``vdivps``, exact) and its lookup-table bin (8 bits), or its code
   counted against the 15 decision boundaries with the value selected alongside (4 bits, vector,
   no table);
6. (8 bits) code = ``lut_code[u] + (q > lut_bound[u])``, value ``lut_values[2u + up]`` (scalar);
7. parameter update (vector) and, at 4 bits, packing two codes a byte.

An unquantised first moment (fp32 m in place of codes and scales) skips 1, 3, 5 and 6: the lerp
runs on the stored m and the update reads it.

Arithmetic: as ``reference.gefen_step`` in fp32, scalars passed as float32. Multiply-adds may be
fused (``fastmath={"contract"}``) only where the reference's value does not depend on it: the
decode ``C[code] * s`` is a pass of its own, compiled without ``contract``, so it is rounded
before the lerp as torch rounds it; ``lerp`` is then exactly torch's vectorised CPU lerp (an
FMA); the v and parameter updates are compiled without ``contract`` (a multiply-add with two
products may be fused either way, differently in the serial and the parallel copy); p and v
can differ from the reference in the last bits (block > 1: the update is ``m^ * (value /
denom)``, one division per block). Codes do not depend on that (the lookup table's margin
absorbs the rounding of the bin index, the final boundary comparison is exact; the 4-bit count
``#{boundaries < q}`` is ``codebook.nearest_code``'s definition).
"""

import functools
from functools import partial

import numpy as np
from numba import carray, njit, prange, types
from numba.extending import intrinsic

_FMA = {"contract"}


# _f32_ptr and _u8_ptr are written out (a deliberate duplicate of shape): an intrinsic built by a
# factory would be a closure, which numba's on-disk cache cannot key reliably.
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


@functools.cache
def kernel(bits: int, per_element_v: bool, parallel: bool = True, factored: bool = False, quant: bool = True):
    """The compiled step for 8- or 4-bit codes and block == 1 (per-element v) or block > 1.

    ``parallel=False``: the same jobs run in order on the calling thread, without starting
    numba's OpenMP pool (at one thread its barrier would only add waiting).

    ``factored``: the second moment of element j of a block is ``v_b * r_j`` (block > 1), with
    ``ratio[t, j] = sqrt(r_j)``.

    ``quant=False``: the codes column of ``meta`` is the address of an fp32 first moment (one float
    an element), updated in place; scales, codebook and tables are not read (``bits`` is ignored).

    ``kernel(...)(meta, jobs, ratio, cb, bounds, lut_code, lut_bound, lut_values, lut_scale, block,
    S, w1, beta2, one_minus_beta2, decay, neg_step, bc2_sqrt, eps)``: ``meta`` int64 (tensors, 9) =
    addresses of p, g, v, scales, codes (contiguous fp32, fp32, fp32, fp32, uint8) and their
    element counts; ``jobs`` int64 (jobs, 3) = tensor row, first scale block, end scale block;
    ``bounds`` the fp32 decision boundaries (``CodeTable.boundaries``, levels - 1 and a trailing
    +inf; used at 4 bits); ``ratio`` fp32 (tensors, block), ``factor_kernel``'s output (read only
    when ``factored``).
    """
    return partial(_step_parallel if parallel else _step_serial, quant and bits == 4, per_element_v,
                   factored and not per_element_v, quant)


def factor_kernel(parallel: bool = True):
    """The factored second moment's first pass: ``(meta, jobs, wptrs, block, S, beta2,
    one_minus_beta2, partial, ratio)`` updates each tensor's ``w`` (address ``wptrs[t]``, fp32
    ``block`` floats) with the mean over its blocks of g**2 per offset and writes ``ratio[t] =
    w / mean(w)`` (ones where the mean is 0). Column sums run per job into ``partial`` (jobs,
    block) and are added per tensor in job order, so the result does not depend on the threads.
    ``ratio`` holds sqrt(r), what the step multiplies by."""
    return _factor_parallel if parallel else _factor_serial


# ------------------------------------------------------------------------------ passes
# Each takes block-sized slices (indices from 0, so numba adds no negative-index wrap-around,
# which kept LLVM from vectorising).

@njit(nogil=True, error_model="numpy", cache=True)
def _decode(codes, cb, s, m):
    """m = C[code] * s (rounded as torch rounds it: no ``contract`` here)."""
    for i in range(codes.size):
        m[i] = cb[codes[i]] * s


@njit(nogil=True, error_model="numpy", cache=True)
def _unpack4(codes, start, stop, out):
    """Nibble codes of elements start..stop-1 (two a byte, low nibble first) into ``out``."""
    i, o = start, 0
    if i & 1:
        out[0] = codes[i >> 1] >> 4
        i, o = i + 1, 1
    pairs = (stop - i) >> 1
    src, dst = codes[i >> 1:(i >> 1) + pairs], out[o:o + 2 * pairs]
    for k in range(pairs):
        b = src[k]
        dst[2 * k] = b & 15
        dst[2 * k + 1] = b >> 4
    if (stop - i) & 1:
        out[stop - start - 1] = codes[(stop - 1) >> 1] & 15


@njit(nogil=True, error_model="numpy", cache=True)
def _pack4(src_codes, start, stop, codes):
    """Inverse of ``_unpack4``; the other nibble of a shared end byte is kept."""
    i, o = start, 0
    if i & 1:
        k = i >> 1
        codes[k] = (codes[k] & 15) | (src_codes[0] << 4)
        i, o = i + 1, 1
    pairs = (stop - i) >> 1
    src, dst = src_codes[o:o + 2 * pairs], codes[i >> 1:(i >> 1) + pairs]
    for k in range(pairs):
        dst[k] = src[2 * k] | (src[2 * k + 1] << 4)
    if (stop - i) & 1:
        k = (stop - 1) >> 1
        codes[k] = (codes[k] & 240) | src_codes[stop - start - 1]


@njit(nogil=True, error_model="numpy", fastmath=_FMA, cache=True)
def _lerp(g, w1, m):
    """m = lerp(m, g, w1) in place, torch's formula (an FMA either way)."""
    if abs(w1) < 0.5:
        for i in range(g.size):
            m0 = m[i]
            m[i] = w1 * (g[i] - m0) + m0
    else:
        w1m = w1 - np.float32(1.0)
        for i in range(g.size):
            gi = g[i]
            m[i] = w1m * (gi - m[i]) + gi


@njit(nogil=True, error_model="numpy", cache=True)
def _absmax_bits(bits, n):
    """max |x| over the first n floats, as an int32 bit pattern (vectorised integer max)."""
    a = np.int32(0)
    for i in range(n):
        a = max(a, bits[i] & np.int32(0x7FFFFFFF))
    return a


@njit(nogil=True, error_model="numpy", cache=True)
def _sum_sq(g, acc):
    """sum(g**2) in 8 interleaved lanes (``acc``: 8 floats of scratch), then a fixed tree.

    Vectorised without ``reassoc``: LLVM may order a ``reassoc`` sum differently in each
    compiled copy (serial and parallel kernels), which would break the bitwise equality of one
    and two threads.
    """
    for k in range(8):
        acc[k] = np.float32(0.0)
    n8 = g.size - g.size % 8
    for i in range(0, n8, 8):
        for k in range(8):
            acc[k] += g[i + k] * g[i + k]
    for i in range(n8, g.size):
        acc[0] += g[i] * g[i]
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))


@njit(nogil=True, error_model="numpy", cache=True)  # no contract: see _step_serial
def _v_per_element(v, g, beta2, one_minus_beta2):
    for i in range(g.size):
        v[i] = beta2 * v[i] + one_minus_beta2 * (g[i] * g[i])


@njit(nogil=True, error_model="numpy", fastmath=_FMA, cache=True)
def _bins(m, n, amax, lut_scale, top, u):
    """q = m / amax in place (exact division; m == 0 where amax == 0) and q's table bin."""
    div = amax if amax > np.float32(0.0) else np.float32(1.0)
    for i in range(n):
        q = m[i] / div
        m[i] = q
        x = q * lut_scale + lut_scale  # >= 0 for |q| <= 1; only q == 1 overflows the table
        u[i] = min(np.uint32(x), top) if x >= np.float32(0.0) else top  # NaN (an inf gradient): the last bin


@njit(nogil=True, error_model="numpy", cache=True)
def _lookup8(codes, q, u, lut_code, lut_bound, lut_values):
    """Code of q (``codebook.nearest_code``'s table) into ``codes``, its value into q."""
    for i in range(codes.size):
        b = u[i]
        up = np.uint32(q[i] > lut_bound[b])
        q[i] = lut_values[np.uint32(2) * b + up]  # indexed, not selected: no branch
        codes[i] = np.uint8(lut_code[b] + up)


@njit(nogil=True, error_model="numpy", fastmath=_FMA, cache=True)
def _quantize4(m, n, amax, bounds, cb, codes):
    """4 bits: code = #{boundaries < m / amax} and its value C[code] (into m), vectorised.

    ``bounds`` (15 + 1 values) and ``cb`` (16) are tuples, unpacked into registers: over arrays
    the loop compiles to scalar code (their loads could alias the stores), over tuples to
    compares and blends.
    """
    div = amax if amax > np.float32(0.0) else np.float32(1.0)
    b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12, b13, b14, _ = bounds
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = cb
    one = np.int32(1)
    for i in range(n):
        q = m[i] / div
        c = np.int32(0)
        v = c0
        if q > b0:
            c, v = c + one, c1
        if q > b1:
            c, v = c + one, c2
        if q > b2:
            c, v = c + one, c3
        if q > b3:
            c, v = c + one, c4
        if q > b4:
            c, v = c + one, c5
        if q > b5:
            c, v = c + one, c6
        if q > b6:
            c, v = c + one, c7
        if q > b7:
            c, v = c + one, c8
        if q > b8:
            c, v = c + one, c9
        if q > b9:
            c, v = c + one, c10
        if q > b10:
            c, v = c + one, c11
        if q > b11:
            c, v = c + one, c12
        if q > b12:
            c, v = c + one, c13
        if q > b13:
            c, v = c + one, c14
        if q > b14:
            c, v = c + one, c15
        codes[i] = np.uint8(c)
        m[i] = v


@njit(nogil=True, error_model="numpy", cache=True)  # no contract: see _step_serial
def _update_shared(p, value, amax, decay, step_over_denom):
    for i in range(p.size):
        m_hat = value[i] * amax
        p[i] = p[i] * decay + m_hat * step_over_denom


@njit(nogil=True, error_model="numpy", cache=True)  # no contract: see _step_serial
def _update_per_element(p, value, amax, v, decay, neg_step, bc2_sqrt, eps):
    for i in range(p.size):
        m_hat = value[i] * amax
        denom = np.float32(np.sqrt(v[i]) / bc2_sqrt) + eps
        p[i] = p[i] * decay + (neg_step * m_hat) / denom


@njit(nogil=True, error_model="numpy", cache=True)  # no contract: see _step_serial
def _update_factored(p, value, amax, sv, sr, decay, neg_step, eps):
    """Block > 1, factored: denominator sqrt(v_b / bc2) * sqrt(r_j) + eps, with sqrt(r_j) from
    ``factor_kernel`` (one multiply a element where the reference takes a square root of v_b r_j:
    equal to fp32 rounding)."""
    for i in range(p.size):
        m_hat = value[i] * amax
        p[i] = p[i] * decay + (neg_step * m_hat) / (sv * sr[i] + eps)


@njit(nogil=True, error_model="numpy", cache=True)
def _colsum_sq(g, block, acc):
    """acc[j] = sum over the blocks of g (a whole number of them) of g[b, j]**2."""
    for j in range(block):
        acc[j] = np.float32(0.0)
    for b in range(g.size // block):
        gb = g[b * block:(b + 1) * block]
        for j in range(block):
            acc[j] += gb[j] * gb[j]


@njit(nogil=True, error_model="numpy", cache=True)
def _factor_reduce(meta, jobs, wptrs, block, beta2, one_minus_beta2, partial, ratio):
    total = np.zeros((meta.shape[0], block), dtype=np.float32)
    for k in range(jobs.shape[0]):
        t = jobs[k, 0]
        for j in range(block):
            total[t, j] += partial[k, j]
    for t in range(meta.shape[0]):
        w = carray(_f32_ptr(wptrs[t]), (block,))
        nb = np.float32(meta[t, 5] // block)
        s = np.float32(0.0)
        for j in range(block):
            new = beta2 * w[j] + one_minus_beta2 * (total[t, j] / nb)
            if np.isfinite(new):  # a non-finite offset keeps its value (reference.factor_update)
                w[j] = new
            s += w[j]
        mean = s / np.float32(block)
        for j in range(block):
            ratio[t, j] = np.sqrt(w[j] / mean) if mean > np.float32(0.0) else np.float32(1.0)


@njit(nogil=True, error_model="numpy", cache=True)
def _factor_job(meta, jobs, k, block, S, partial):
    t = jobs[k, 0]
    n = meta[t, 5]
    g = carray(_f32_ptr(meta[t, 1]), (n,))
    gk = g[jobs[k, 1] * S:min(jobs[k, 2] * S, n)]
    if block == 1:  # one column: the 8-lane sum (a single accumulator would be latency-bound)
        partial[k, 0] = _sum_sq(gk, np.empty(8, dtype=np.float32))
    else:
        _colsum_sq(gk, block, partial[k])


@njit(nogil=True, error_model="numpy", parallel=True, cache=True)
def _factor_parallel(meta, jobs, wptrs, block, S, beta2, one_minus_beta2, partial, ratio):
    for k in prange(jobs.shape[0]):
        _factor_job(meta, jobs, k, block, S, partial)
    _factor_reduce(meta, jobs, wptrs, block, beta2, one_minus_beta2, partial, ratio)


@njit(nogil=True, error_model="numpy", cache=True)
def _factor_serial(meta, jobs, wptrs, block, S, beta2, one_minus_beta2, partial, ratio):
    for k in range(jobs.shape[0]):
        _factor_job(meta, jobs, k, block, S, partial)
    _factor_reduce(meta, jobs, wptrs, block, beta2, one_minus_beta2, partial, ratio)


@njit(nogil=True, error_model="numpy", cache=True)
def _blocks(bits4, per_element, factored, quant, p, g, v, scales, codes, m_fp32, r, j0, j1, cb, bounds, lut_code,
            lut_bound, lut_values, lut_scale, block, S, w1, beta2, one_minus_beta2, decay, neg_step,
            bc2_sqrt, eps):
    """Scale blocks j0..j1-1 of one tensor, pass by pass (see the module docstring). ``m_fp32``: the
    unquantised first moment (``quant`` False; codes and scales are then empty)."""
    n = p.size
    m = np.empty(S, dtype=np.float32)
    bits = m.view(np.int32)
    u = np.empty(S, dtype=np.uint32)
    c = np.empty(S, dtype=np.uint8)
    acc8 = np.empty(8, dtype=np.float32)
    amax_bits = np.empty(1, dtype=np.int32)
    amax_f = amax_bits.view(np.float32)
    top = np.uint32(lut_code.size - 1)
    # tuples: registers in _quantize4 (used at 4 bits; prange cannot pass tuples in)
    bounds16 = (bounds[0], bounds[1], bounds[2], bounds[3], bounds[4], bounds[5], bounds[6],
                bounds[7], bounds[8], bounds[9], bounds[10], bounds[11], bounds[12], bounds[13],
                bounds[14], bounds[15])
    cb16 = (cb[0], cb[1], cb[2], cb[3], cb[4], cb[5], cb[6], cb[7], cb[8], cb[9], cb[10], cb[11],
            cb[12], cb[13], cb[14], cb[15])
    for j in range(j0, j1):
        start = j * S
        stop = min(start + S, n)
        L = stop - start
        gj = g[start:stop]
        if not quant:  # m^ is the stored m after the lerp (times 1: exact)
            mj = m_fp32[start:stop]
            _lerp(gj, w1, mj)
            amax = np.float32(1.0)
        else:
            mj = m[:L]
            if bits4:
                _unpack4(codes, start, stop, c)
                _decode(c[:L], cb, scales[j], mj)
            else:
                _decode(codes[start:stop], cb, scales[j], mj)
            _lerp(gj, w1, mj)
            amax_bits[0] = _absmax_bits(bits, L)
            amax = amax_f[0]
            scales[j] = amax
            if bits4:
                _quantize4(m, L, amax, bounds16, cb16, c)
                _pack4(c, start, stop, codes)
            else:
                _bins(m, L, amax, lut_scale, top, u)
                _lookup8(codes[start:stop], mj, u, lut_code, lut_bound, lut_values)
        if per_element:
            vj = v[start:stop]
            _v_per_element(vj, gj, beta2, one_minus_beta2)
            _update_per_element(p[start:stop], mj, amax, vj, decay, neg_step, bc2_sqrt, eps)
        else:  # S == block: one v per scale block, one division per block
            vb = beta2 * v[j] + one_minus_beta2 * (_sum_sq(gj, acc8) / np.float32(block))
            v[j] = vb
            if factored:
                sv = np.float32(np.sqrt(vb) / bc2_sqrt)
                _update_factored(p[start:stop], mj, amax, sv, r, decay, neg_step, eps)
            else:
                denom = np.float32(np.sqrt(vb) / bc2_sqrt) + eps
                _update_shared(p[start:stop], mj, amax, decay, neg_step / denom)


@njit(nogil=True, error_model="numpy", cache=True)
def _job(bits4, per_element, factored, quant, meta, jobs, k, ratio, cb, bounds, lut_code, lut_bound, lut_values,
         lut_scale, block, S, w1, beta2, one_minus_beta2, decay, neg_step, bc2_sqrt, eps):
    t = jobs[k, 0]
    p = carray(_f32_ptr(meta[t, 0]), (meta[t, 5],))
    g = carray(_f32_ptr(meta[t, 1]), (meta[t, 5],))
    v = carray(_f32_ptr(meta[t, 2]), (meta[t, 6],))
    scales = carray(_f32_ptr(meta[t, 3]), (meta[t, 7] if quant else 0,))
    codes = carray(_u8_ptr(meta[t, 4]), (meta[t, 8] if quant else 0,))
    m_fp32 = carray(_f32_ptr(meta[t, 4]), (0 if quant else meta[t, 8],))
    _blocks(bits4, per_element, factored, quant, p, g, v, scales, codes, m_fp32, ratio[t if factored else 0],
            jobs[k, 1], jobs[k, 2], cb, bounds,
            lut_code, lut_bound, lut_values, lut_scale, block, S, w1, beta2, one_minus_beta2,
            decay, neg_step, bc2_sqrt, eps)


@njit(nogil=True, error_model="numpy", parallel=True, cache=True)
def _step_parallel(bits4, per_element, factored, quant, meta, jobs, ratio, cb, bounds, lut_code, lut_bound,
                   lut_values, lut_scale, block, S, w1, beta2, one_minus_beta2, decay, neg_step, bc2_sqrt, eps):
    for k in prange(jobs.shape[0]):
        _job(bits4, per_element, factored, quant, meta, jobs, k, ratio, cb, bounds, lut_code, lut_bound, lut_values,
             lut_scale, block, S, w1, beta2, one_minus_beta2, decay, neg_step, bc2_sqrt, eps)


@njit(nogil=True, error_model="numpy", cache=True)
def _step_serial(bits4, per_element, factored, quant, meta, jobs, ratio, cb, bounds, lut_code, lut_bound,
                 lut_values, lut_scale, block, S, w1, beta2, one_minus_beta2, decay, neg_step, bc2_sqrt, eps):
    # the same passes compiled again: every pass is written so that its rounding cannot depend on
    # the copy (no multiply-add with two products to choose from, no reassoc)
    for k in range(jobs.shape[0]):
        _job(bits4, per_element, factored, quant, meta, jobs, k, ratio, cb, bounds, lut_code, lut_bound, lut_values,
             lut_scale, block, S, w1, beta2, one_minus_beta2, decay, neg_step, bc2_sqrt, eps)


# ------------------------------------------------------------------------- stochastic rounding
_MASK32 = np.uint64(0xFFFFFFFF)


@njit(nogil=True, error_model="numpy", cache=True)
def _hash32(x):
    """``optim._rounding.hash32`` on a uint64 holding 32 bits (numba widens uint32 products)."""
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & _MASK32
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & _MASK32
    return x ^ (x >> np.uint64(16))


@njit(nogil=True, error_model="numpy", cache=True)
def round_bf16_stochastic(x, out, seed, offset):
    """fp32 ``x`` rounded stochastically into ``out`` (uint16 bf16 bit patterns): the random word of
    element i is ``hash32(((offset + i) * GOLDEN + seed) mod 2**32)`` and its low 16 bits are added
    to x's pattern before truncation; non-finite x, or a result that would round to an infinity,
    round to nearest (``optim._rounding.round_stochastic``, bit for bit)."""
    bits = x.view(np.uint32)
    s = np.uint64(seed) & _MASK32
    for i in range(x.size):
        k = np.uint64(offset + i) & _MASK32
        h = _hash32((((k * np.uint64(0x9E3779B9)) & _MASK32) + s) & _MASK32)
        b = np.uint64(bits[i])
        exp_all_ones = (b & np.uint64(0x7F800000)) == np.uint64(0x7F800000)
        up = ((b + (h & np.uint64(0xFFFF))) & _MASK32) >> np.uint64(16)
        if exp_all_ones or (up & np.uint64(0x7F80)) == np.uint64(0x7F80):
            # round to nearest, ties to even (NaN stays NaN: its pattern keeps a set mantissa bit)
            if exp_all_ones and (b & np.uint64(0x7FFFFF)) != np.uint64(0):
                up = (b >> np.uint64(16)) | np.uint64(0x40)
            else:
                up = ((b + np.uint64(0x7FFF) + ((b >> np.uint64(16)) & np.uint64(1))) & _MASK32) >> np.uint64(16)
        out[i] = np.uint16(up)
