"""Compiled (numba) kernels of the fused CPU Disk Sparse Adam step; see ``numba_ops.py``.

Kept in its own module so that ``import optim.disk_sparse.numba_ops`` loads no kernel. The
kernels are compiled once and cached on disk (``cache=True``), serial and parallel variants of each:
the parallel one splits the unique rows into ``n_chunks`` contiguous runs, one per thread, and every
row is computed exactly as in the serial loop, so results do not depend on the thread count.

Arithmetic is that of ``torch.optim.SparseAdam`` operation for operation: no ``fastmath`` (no FMA
contraction, no reassociation), duplicates summed in the order of ``indices.sort()``'s permutation.
The numpy error model lets the divisions vectorise (no zero-division branch; denominators are
``sqrt(v) + eps > 0``). Each row's update is written as four simple loops: one loop over five
arrays did not vectorise. ``tiled`` calls C functions (MKL's sqrt, MKL's per-thread thread count)
through addresses passed as arguments (``_call_sqrt``, ``_call_int``), which keeps it cacheable.
"""

import types as pytypes

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

CACHE_AHEAD = 4  # rows; the distance made no measurable difference between 1 and 16


@intrinsic
def _prefetch_addr(typingctx, addr):
    """LLVM's ``llvm.prefetch`` of the cache line at ``addr``: a hint to the CPU, never a fault."""
    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = builder.module.globals.get("llvm.prefetch.p0i8") or ir.Function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0i8")
        # rw=1 (the row is written), locality=3 (keep in all levels), data cache
        builder.call(fn, [builder.inttoptr(args[0], i8p), i32(1), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(types.intp), codegen


@intrinsic
def _call_sqrt(typingctx, fn, n, src, dst, mode):
    """Call the C function at address ``fn``, ``void f(int32 n, const T *src, T *dst, int64 mode)``
    (MKL's vector sqrt, see ``vml_sqrt.py``). The address is an argument, not a constant, so the
    compiled kernel stays cacheable across processes."""
    def codegen(context, builder, signature, args):
        i8p, i32, i64 = ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(64)
        fnty = ir.FunctionType(ir.VoidType(), [i32, i8p, i8p, i64])
        f = builder.inttoptr(args[0], fnty.as_pointer())
        builder.call(f, [builder.trunc(args[1], i32), builder.inttoptr(args[2], i8p),
                         builder.inttoptr(args[3], i8p), args[4]])
        return context.get_dummy_value()

    return types.void(types.intp, types.intp, types.intp, types.intp, types.intp), codegen


@intrinsic
def _call_int(typingctx, fn, x):
    """``int32 f(int32 x)`` at address ``fn`` (MKL_Set_Num_Threads_Local); returns its result."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        f = builder.inttoptr(args[0], ir.FunctionType(i32, [i32]).as_pointer())
        return builder.sext(builder.call(f, [builder.trunc(args[1], i32)]), ir.IntType(64))

    return types.int64(types.intp, types.intp), codegen


@njit(inline="always", cache=True)
def _cache_row(arr, r):
    """Ask the CPU to bring row ``r`` of ``arr`` into its caches, one cache line at a time."""
    base = arr.ctypes.data + r * arr.strides[0]
    for off in range(0, arr.shape[1] * arr.itemsize, 64):
        _prefetch_addr(base + off)


@njit(nogil=True, cache=True)
def radix_sort(idx, n_table_rows, keys, perm, keys_tmp, perm_tmp, counts):
    """Stable LSD radix sort (11-bit digits) of ``idx`` into ``keys`` and ``perm`` (the permutation).

    Returns False if an index lies outside ``[0, n_table_rows)`` (the compiled kernels have no
    bounds checks). ``keys_tmp``, ``perm_tmp`` (as long as ``idx``) and ``counts`` (2048) are
    scratch. A few times faster than ``Tensor.sort`` for a batch of indices; but that sort is not
    stable, so where a row occurs three or more times (the order of its sum matters) the caller
    uses ``Tensor.sort`` instead, whose order ``Tensor.coalesce`` shares.
    """
    n = idx.shape[0]
    hi = 0
    for j in range(n):
        k = idx[j]
        if k < 0 or k >= n_table_rows:
            return False
        hi = max(hi, k)
        keys[j] = k
        perm[j] = j
    shift = 0
    while (hi >> shift) > 0:
        counts[:] = 0
        for j in range(n):
            counts[(keys[j] >> shift) & 2047] += 1
        total = 0
        for b in range(2048):
            c = counts[b]
            counts[b] = total
            total += c
        for j in range(n):
            b = (keys[j] >> shift) & 2047
            d = counts[b]
            counts[b] = d + 1
            keys_tmp[d] = keys[j]
            perm_tmp[d] = perm[j]
        keys[:n] = keys_tmp[:n]
        perm[:n] = perm_tmp[:n]
        shift += 11
    return True


@njit(nogil=True, cache=True)
def segments(sorted_idx, n_table_rows, starts):
    """Starts of the runs of equal values in ``sorted_idx`` (then ``n``). Returns (number of runs,
    longest run), or (-1, 0) if an index lies outside ``[0, n_table_rows)``."""
    n = sorted_idx.shape[0]
    if n and (sorted_idx[0] < 0 or sorted_idx[n - 1] >= n_table_rows):
        return -1, 0
    u = 0
    longest = 0
    for j in range(n):
        if j == 0 or sorted_idx[j] != sorted_idx[j - 1]:
            if u:
                longest = max(longest, j - starts[u - 1])
            starts[u] = j
            u += 1
    if u:
        longest = max(longest, n - starts[u - 1])
    starts[u] = n
    return u, longest


@njit(inline="always", cache=True)
def _sum_rows(values, perm, j0, j1, negate, gsum):
    """gsum = the sum of values[perm[j0:j1]] in that order (coalesce's), negated if ``negate``."""
    d = gsum.shape[0]
    src = values[perm[j0]]
    for k in range(d):
        gsum[k] = src[k]
    for jj in range(j0 + 1, j1):
        src = values[perm[jj]]
        for k in range(d):
            gsum[k] += src[k]
    if negate:
        for k in range(d):
            gsum[k] = -gsum[k]


@njit(inline="always", cache=True)
def _cache_rows_ahead(u, u1, sorted_idx, starts, records, weight):
    """Bring the record and weight rows of unique row ``u + CACHE_AHEAD`` (if below ``u1``) into
    the CPU caches while row ``u`` is computed.

    The kernels write their row prelude out (this, ``_sum_rows``, the row's index): one inline
    helper doing all three and returning the row compiled markedly slower in ``tiled`` and
    ``fused`` on the seed configuration of ``experiments/dsa_throughput.py``. The m and v loops of
    ``moments``, ``fused`` and ``tiled`` are written out for the same reason: an inline helper
    shared by them compiled slower at widths 64 and 128."""
    if u + CACHE_AHEAD < u1:
        ahead = sorted_idx[starts[u + CACHE_AHEAD]]
        _cache_row(records, ahead)
        _cache_row(weight, ahead)


def _moments(sorted_idx, perm, starts, n_rows, values, records, weight, rows, mbuf, vbuf, c1, c2,
             maximize, n_chunks):
    """Per unique row u: sum its gradient rows, update its record ``[m | v]`` in place, copy the new
    m and v to ``mbuf[u]``, ``vbuf[u]``; the weight rows are brought into the caches for the weights pass."""
    d = values.shape[1]
    for c in prange(n_chunks):
        u0 = c * n_rows // n_chunks
        u1 = (c + 1) * n_rows // n_chunks
        gsum = np.empty(d, dtype=records.dtype)
        for u in range(u0, u1):
            _cache_rows_ahead(u, u1, sorted_idx, starts, records, weight)
            _sum_rows(values, perm, starts[u], starts[u + 1], maximize, gsum)
            r = sorted_idx[starts[u]]
            rows[u] = r
            rec, mu, vu = records[r], mbuf[u], vbuf[u]
            for k in range(d):
                m = rec[k]
                mu[k] = m + (gsum[k] - m) * c1
            for k in range(d):
                g = gsum[k]
                v = rec[d + k]
                vu[k] = v + (g * g - v) * c2
            for k in range(d):
                rec[k] = mu[k]
            for k in range(d):
                rec[d + k] = vu[k]


def _weights(rows, n_rows, mbuf, sqrt_v, eps, weight, neg_step_size, n_chunks):
    """w += (m / (sqrt(v) + eps)) * (-step_size) for the updated rows (compact buffers, row views);
    ``sqrt_v`` is torch's (see ``numba_ops.py``), the sum with eps is IEEE as torch's ``add_``."""
    for c in prange(n_chunks):
        u0 = c * n_rows // n_chunks
        u1 = (c + 1) * n_rows // n_chunks
        for u in range(u0, u1):
            if u + CACHE_AHEAD < u1:
                _cache_row(weight, rows[u + CACHE_AHEAD])
            wr, mr, sr = weight[rows[u]], mbuf[u], sqrt_v[u]
            for k in range(wr.shape[0]):
                wr[k] = wr[k] + (mr[k] / (sr[k] + eps)) * neg_step_size


def _fused(sorted_idx, perm, starts, n_rows, values, records, weight, c1, c2, eps, neg_step_size,
           maximize, n_chunks):
    """The whole row update in one pass (``bitwise=False``): m, v in place, then the weight row,
    with numba's correctly rounded sqrt instead of torch's (see ``numba_ops.py``). The row prelude
    and moment loops repeat ``_moments``' on purpose: shared inline helpers compile slower (see
    ``_cache_rows_ahead``)."""
    d = values.shape[1]
    for c in prange(n_chunks):
        u0 = c * n_rows // n_chunks
        u1 = (c + 1) * n_rows // n_chunks
        gsum = np.empty(d, dtype=records.dtype)
        for u in range(u0, u1):
            _cache_rows_ahead(u, u1, sorted_idx, starts, records, weight)
            _sum_rows(values, perm, starts[u], starts[u + 1], maximize, gsum)
            r = sorted_idx[starts[u]]
            rec, wr = records[r], weight[r]
            for k in range(d):
                m = rec[k]
                rec[k] = m + (gsum[k] - m) * c1
            for k in range(d):
                g = gsum[k]
                v = rec[d + k]
                rec[d + k] = v + (g * g - v) * c2
            for k in range(d):
                wr[k] = wr[k] + (rec[k] / (np.sqrt(rec[d + k]) + eps)) * neg_step_size


def _tiled(sorted_idx, perm, starts, n_rows, values, records, weight, c1, c2, eps, neg_step_size,
           maximize, n_chunks, tile_rows, sqrt_fn, sqrt_mode, threads_fn):
    """The bitwise update in one pass over tiles of ``tile_rows`` unique rows: m and v of each row in
    place (v also copied to a small tile buffer), one call of torch's own sqrt function
    (``sqrt_fn``, see ``vml_sqrt.py``) on the tile, then the tile's weight rows, whose records are
    still in cache. Same operations and order as ``_moments`` + torch sqrt + ``_weights``.
    ``threads_fn`` (if not 0) sets MKL's thread count of the calling thread: one while it runs."""
    d = values.shape[1]
    for c in prange(n_chunks):
        u0 = c * n_rows // n_chunks
        u1 = (c + 1) * n_rows // n_chunks
        mkl_threads = _call_int(threads_fn, 1) if threads_fn else 0
        gsum = np.empty(d, dtype=records.dtype)
        v_tile = np.empty((tile_rows, d), dtype=records.dtype)
        sqrt_tile = np.empty((tile_rows, d), dtype=records.dtype)
        tile = np.empty(tile_rows, dtype=np.int64)
        for t0 in range(u0, u1, tile_rows):
            t1 = min(t0 + tile_rows, u1)
            for u in range(t0, t1):
                _cache_rows_ahead(u, u1, sorted_idx, starts, records, weight)
                _sum_rows(values, perm, starts[u], starts[u + 1], maximize, gsum)
                r = sorted_idx[starts[u]]
                tile[u - t0] = r
                rec, vu = records[r], v_tile[u - t0]
                for k in range(d):
                    m = rec[k]
                    rec[k] = m + (gsum[k] - m) * c1
                for k in range(d):
                    g = gsum[k]
                    v = rec[d + k]
                    vu[k] = v + (g * g - v) * c2
                for k in range(d):
                    rec[d + k] = vu[k]
            _call_sqrt(sqrt_fn, (t1 - t0) * d, v_tile.ctypes.data, sqrt_tile.ctypes.data, sqrt_mode)
            for i in range(t1 - t0):
                rec, wr, sr = records[tile[i]], weight[tile[i]], sqrt_tile[i]
                for k in range(d):
                    wr[k] = wr[k] + (rec[k] / (sr[k] + eps)) * neg_step_size
        if threads_fn:
            _call_int(threads_fn, mkl_threads)


@njit(nogil=True, fastmath={"nnan", "ninf", "nsz"}, cache=True)
def _absmax(a):
    """max |a| (0 for zeros); a reduction that vectorises only without NaN semantics (max is exact
    in any order, so the value is that of a sequential loop for finite input)."""
    amax = np.float32(0.0)
    for k in range(a.shape[0]):
        amax = max(amax, abs(a[k]))
    return amax


@njit(inline="always", cache=True)
def _encode_row(m, q):
    """``reference.encode_rows`` of one row: int8 codes of ``m`` (float32) into ``q``; returns the
    scale max |m|. A row with NaN or inf gets codes 0 and the scale NaN (any NaN) or inf; where
    127 / s overflows, the codes are m / s * 127."""
    d = m.shape[0]
    bad = _non_finite(m)
    if bad:
        for k in range(d):
            q[k] = np.int8(0)
        return np.float32(np.nan) if bad == 2 else np.float32(np.inf)
    amax = _absmax(m)
    inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
    if np.isinf(inv):
        for k in range(d):
            q[k] = np.int8(np.rint(m[k] / amax * np.float32(127.0)))
    else:
        for k in range(d):
            q[k] = np.int8(np.rint(m[k] * inv))
    return amax


@njit(inline="always", cache=True)
def _non_finite(a):
    """0 if every value of ``a`` is finite, 2 if one is NaN, else 1 (an inf)."""
    out = 0
    for k in range(a.shape[0]):
        if not np.isfinite(a[k]):
            if np.isnan(a[k]):
                return 2
            out = 1
    return out


@njit(inline="always", cache=True)
def _sum_squares(g):
    """sum of g² in float64 over four interleaved partial sums (a sequential sum does not vectorise)."""
    d = g.shape[0]
    s0 = s1 = s2 = s3 = 0.0
    k = 0
    while k + 4 <= d:
        s0 += np.float64(g[k]) * np.float64(g[k])
        s1 += np.float64(g[k + 1]) * np.float64(g[k + 1])
        s2 += np.float64(g[k + 2]) * np.float64(g[k + 2])
        s3 += np.float64(g[k + 3]) * np.float64(g[k + 3])
        k += 4
    while k < d:
        s0 += np.float64(g[k]) * np.float64(g[k])
        k += 1
    return (s0 + s1) + (s2 + s3)


def _compact(sorted_idx, perm, starts, n_rows, values, codes, floats, weight, c1, c2, eps, neg_step_size,
             maximize, n_chunks):
    """``reference.compact_adam_rows`` per unique row, in place on compact records (``compact.py``):
    ``codes`` and ``floats`` are int8 and float32 views of the same records (s = floats[r, 0],
    v = floats[r, 1], q = codes[r, 8:8 + D]). Same float32 operations and order as the reference
    except the row sum of g² (float64, in another order: its float32 rounding almost never differs)
    and sqrt (correctly rounded here). Codes need no clamp: |m| <= s, so |m * (127 / s)| rounds to
    at most 127."""
    d = values.shape[1]
    q0 = 8
    for c in prange(n_chunks):
        u0 = c * n_rows // n_chunks
        u1 = (c + 1) * n_rows // n_chunks
        gsum = np.empty(d, dtype=np.float32)
        for u in range(u0, u1):
            _cache_rows_ahead(u, u1, sorted_idx, starts, codes, weight)
            _sum_rows(values, perm, starts[u], starts[u + 1], maximize, gsum)
            r = sorted_idx[starts[u]]
            g2 = np.float32(_sum_squares(gsum) / d)
            v = floats[r, 1]
            v = v + (g2 - v) * c2
            floats[r, 1] = v
            denom = np.sqrt(v) + eps
            dec = floats[r, 0] / np.float32(127.0)
            wr, qr = weight[r], codes[r, q0:q0 + d]
            for k in range(d):
                m = np.float32(qr[k]) * dec
                gsum[k] = m + (gsum[k] - m) * c1
            for k in range(d):
                wr[k] = wr[k] + (gsum[k] / denom) * neg_step_size
            floats[r, 0] = _encode_row(gsum, qr)


def _ball(sorted_idx, perm, starts, n_rows, values, records, weight, lr, beta1, beta2, bc1, bc2, eps, c,
          maxnorm, exact, maximize, n_chunks):
    """``reference.riemannian_adam_rows`` per unique row, in place on records ``[m (D) | v (1)]`` and
    weight rows (the Poincaré ball of curvature -c; ``exact``: exponential map, else retraction),
    the row math in ``_ball_row``. ``maximize`` is unused (the ball minimizes) and kept for the shared
    launch."""
    d = values.shape[1]
    for ch in prange(n_chunks):
        u0 = ch * n_rows // n_chunks
        u1 = (ch + 1) * n_rows // n_chunks
        g = np.empty(d, dtype=np.float64)
        m = np.empty(d, dtype=np.float64)
        x = np.empty(d, dtype=np.float64)
        y = np.empty(d, dtype=np.float64)
        for u in range(u0, u1):
            _cache_rows_ahead(u, u1, sorted_idx, starts, records, weight)
            _sum_rows(values, perm, starts[u], starts[u + 1], False, g)
            r = sorted_idx[starts[u]]
            rec, wr = records[r], weight[r]
            for j in range(d):
                x[j] = wr[j]
                m[j] = rec[j]
            rec[d] = _ball_row(x, g, m, y, rec[d], lr, beta1, beta2, bc1, bc2, eps, c, maxnorm, exact)
            for j in range(d):
                rec[j] = m[j]
                wr[j] = y[j]


def _ball_compact(sorted_idx, perm, starts, n_rows, values, codes, floats, weight, lr, beta1, beta2, bc1, bc2,
                  eps, c, maxnorm, exact, maximize, n_chunks):
    """``reference.compact_riemannian_adam_rows`` per unique row, in place on compact records
    (``compact.py``; ``codes`` and ``floats`` are int8 and float32 views of them: s = floats[r, 0],
    v = floats[r, 1], q = codes[r, 8:8 + D]): decode m in float32, ``_ball_row``, encode m as
    ``_compact`` does (``_encode_row``). The row prelude repeats ``_compact``'s on purpose (see
    ``_cache_rows_ahead``)."""
    d = values.shape[1]
    q0 = 8
    for ch in prange(n_chunks):
        u0 = ch * n_rows // n_chunks
        u1 = (ch + 1) * n_rows // n_chunks
        g = np.empty(d, dtype=np.float64)
        m = np.empty(d, dtype=np.float64)
        x = np.empty(d, dtype=np.float64)
        y = np.empty(d, dtype=np.float64)
        m32 = np.empty(d, dtype=np.float32)
        for u in range(u0, u1):
            _cache_rows_ahead(u, u1, sorted_idx, starts, codes, weight)
            _sum_rows(values, perm, starts[u], starts[u + 1], False, g)
            r = sorted_idx[starts[u]]
            wr, qr = weight[r], codes[r, q0:q0 + d]
            dec = floats[r, 0] / np.float32(127.0)
            for j in range(d):
                x[j] = wr[j]
                m[j] = np.float32(qr[j]) * dec
            floats[r, 1] = _ball_row(x, g, m, y, floats[r, 1], lr, beta1, beta2, bc1, bc2, eps, c, maxnorm, exact)
            for j in range(d):
                m32[j] = m[j]
                wr[j] = y[j]
            floats[r, 0] = _encode_row(m32, qr)


@njit(nogil=True, error_model="numpy", cache=True)
def _ball_row(x, g, m, y, v, lr, beta1, beta2, bc1, bc2, eps, c, maxnorm, exact):
    """One row of Riemannian Adam in float64: ``x`` the weight row (projected in place), ``g`` its
    summed gradient, ``m`` its first moment (updated and transported in place), ``y`` the new weight
    row (out); returns the new v. The operations are the Triton kernel's (``_triton_kernels.py``),
    fused into four passes: equal to the reference to rounding, not bitwise."""
    d = x.shape[0]
    k = -c
    k2 = k * k
    x2 = 0.0
    for j in range(d):
        x2 += x[j] * x[j]
    x2 = _project_row(x, x2, maxnorm)  # a point nudged outside cannot become NaN
    lam = 2.0 / max(1.0 + k * x2, 1e-15)
    inv_lam2 = 1.0 / (lam * lam)
    rr = 0.0
    for j in range(d):
        gj = g[j] * inv_lam2  # the Riemannian gradient
        rr += gj * gj
        m[j] = m[j] * beta1 + (1.0 - beta1) * gj
    v = v * beta2 + (1.0 - beta2) * (lam * lam * rr)
    coef = -lr / bc1 / (np.sqrt(v / bc2) + eps)  # u = coef * m
    if exact:  # expmap: x (+) tanh(sqrt(c) lam |u| / 2) u / (sqrt(c) |u|)
        sqrt_c = np.sqrt(c)
        uu = 0.0
        for j in range(d):
            uu += (coef * m[j]) * (coef * m[j])
        u_norm = max(np.sqrt(uu), 1e-15)
        t = np.tanh(min(lam / 2.0 * u_norm * sqrt_c, 15.0)) / sqrt_c / u_norm * coef
        s2 = 0.0
        xs = 0.0
        for j in range(d):
            sj = t * m[j]
            s2 += sj * sj
            xs += x[j] * sj
        a0 = 1.0 - 2.0 * k * xs - k * s2
        a1 = (1.0 + k * x2) * t
        den = max(1.0 - 2.0 * k * xs + k2 * x2 * s2, 1e-15)
        for j in range(d):
            y[j] = (a0 * x[j] + a1 * m[j]) / den
    else:  # retraction: x + u
        for j in range(d):
            y[j] = x[j] + coef * m[j]
    y2 = 0.0
    for j in range(d):
        y2 += y[j] * y[j]
    y2 = _project_row(y, y2, maxnorm)
    # parallel transport of m from x to y: gyr[y, -x] m * lam_x / lam_y
    uv = 0.0
    uw = 0.0
    vw = 0.0
    for j in range(d):
        uv -= y[j] * x[j]
        uw += y[j] * m[j]
        vw -= x[j] * m[j]
    a = -k2 * uw * x2 - k * vw + 2.0 * k2 * uv * vw
    b = -k2 * vw * y2 + k * uw
    dd = max(1.0 - 2.0 * k * uv + k2 * y2 * x2, 1e-15)
    scale = lam / (2.0 / max(1.0 + k * y2, 1e-15))
    ca, cb = 2.0 * a / dd, 2.0 * b / dd
    for j in range(d):
        m[j] = (m[j] + ca * y[j] - cb * x[j]) * scale
    return v


@njit(nogil=True, error_model="numpy", cache=True)
def _project_row(x, x2, maxnorm):
    """Pull ``x`` (squared norm ``x2``) back onto the sphere of radius ``maxnorm`` if it is outside;
    returns its squared norm."""
    norm = max(np.sqrt(x2), 1e-15)
    if norm <= maxnorm:
        return x2
    x2 = 0.0
    for j in range(x.shape[0]):
        x[j] = x[j] / norm * maxnorm
        x2 += x[j] * x[j]
    return x2


def _named(fn, name):
    """A copy of ``fn`` under another name: numba's disk cache keys kernels by name, so the serial and
    parallel compilations of one body need two."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return pytypes.FunctionType(code, fn.__globals__, name)


_opts = dict(nogil=True, fastmath=False, error_model="numpy", cache=True)
# Every body is compiled twice: serial (fewer than ``numba_ops._PARALLEL_MIN_ROWS`` unique rows, where
# a parallel launch costs more than it saves) and parallel. The case each pair serves
# (``numba_ops._launch*`` chooses):
# bitwise=True where ``vml_sqrt`` finds no sqrt in torch's library that reproduces ``torch.sqrt``
# (torch builds without MKL: ARM, macOS; or MKL's fails the check): two passes around ``Tensor.sqrt_``,
# the torch backend's bits at a few times its speed:
moments = njit(**_opts)(_named(_moments, "moments"))
weights = njit(**_opts)(_named(_weights, "weights"))
moments_parallel = njit(parallel=True, **_opts)(_named(_moments, "moments_parallel"))
weights_parallel = njit(parallel=True, **_opts)(_named(_weights, "weights_parallel"))
# bitwise=False (any torch build): one pass, a correctly rounded sqrt:
fused = njit(**_opts)(_named(_fused, "fused"))
fused_parallel = njit(parallel=True, **_opts)(_named(_fused, "fused_parallel"))
# bitwise=True where ``vml_sqrt`` finds torch's own sqrt (builds with MKL): one pass calling it per tile:
tiled = njit(**_opts)(_named(_tiled, "tiled"))
tiled_parallel = njit(parallel=True, **_opts)(_named(_tiled, "tiled_parallel"))
# Adam with state_format="compact":
compact = njit(**_opts)(_named(_compact, "compact"))
compact_parallel = njit(parallel=True, **_opts)(_named(_compact, "compact_parallel"))
# the Riemannian update (DiskSparseRiemannianAdam), state_format="exact":
ball = njit(**_opts)(_named(_ball, "ball"))
ball_parallel = njit(parallel=True, **_opts)(_named(_ball, "ball_parallel"))
# the Riemannian update, state_format="compact":
ball_compact = njit(**_opts)(_named(_ball_compact, "ball_compact"))
ball_compact_parallel = njit(parallel=True, **_opts)(_named(_ball_compact, "ball_compact_parallel"))
