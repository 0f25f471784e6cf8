"""Triton kernels of the Disk Sparse Adam row updates; the launchers are in ``triton_ops.py``.

Each program updates a tile of ``BLOCK_R`` rows in place: weights (loaded to float32, rounded back
to their dtype on store), records of float32 state. Bias corrections and the step size come from the
host in float64, as ``torch.optim.SparseAdam`` computes them.
"""

import triton
import triton.language as tl

from .._triton_common import round_bf16


# ---------------------------------------------------------------------------------------------------
# Euclidean lazy Adam (torch.optim.SparseAdam's operation order; reference.sparse_adam_rows)
# ---------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["n_rows"])  # one compiled kernel for any number of rows
def _adam_rows_kernel(w_ptr, g_ptr, s_ptr, n_rows, D, stride_w, stride_g, stride_s,
                      one_minus_beta1, one_minus_beta2, neg_step_size, eps,
                      MAXIMIZE: tl.constexpr, IS_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    w_off = rows[:, None] * stride_w + cols[None, :]
    m_off = rows[:, None] * stride_s + cols[None, :]
    w = tl.load(w_ptr + w_off, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    m = tl.load(s_ptr + m_off, mask=mask, other=0.0)
    v = tl.load(s_ptr + m_off + D, mask=mask, other=0.0)
    if MAXIMIZE:
        g = -g
    # old += (1 - b) * (new - old), rounded as SparseAdam does; IEEE sqrt/div (tl.sqrt and `/` are
    # approximate on GPUs) and no FMA contraction (the launcher disables it) so that it rounds like
    # torch on CUDA (experiments/bench_dsa_gpu.py measures it).
    u_m = (g - m) * one_minus_beta1
    u_v = (g * g - v) * one_minus_beta2
    m = m + u_m
    v = v + u_v
    w = w + neg_step_size * tl.div_rn(m, tl.sqrt_rn(v) + eps)
    if IS_BF16:
        w = round_bf16(w)  # then the cast is exact, compiled or interpreted
    tl.store(w_ptr + w_off, w.to(w_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + m_off, m, mask=mask)
    tl.store(s_ptr + m_off + D, v, mask=mask)


# ---------------------------------------------------------------------------------------------------
# Riemannian Adam on the Poincaré ball (reference.riemannian_adam_rows, geoopt's order of operations)
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _rowsum(x):
    return tl.sum(x, axis=1)[:, None]


@triton.jit
def _project(x, maxnorm):
    norm = tl.maximum(tl.sqrt_rn(_rowsum(x * x)), 1e-15)
    return tl.where(norm > maxnorm, x / norm * maxnorm, x)


@triton.jit
def _lambda(x2, k):
    return 2.0 / tl.maximum(1 + k * x2, 1e-15)


@triton.jit
def _tanh_nonneg(a):
    # tanh of a >= 0 with geoopt's clamp at 15. No tanh in tl (libdevice's is not in the
    # interpreter); the series keeps full relative precision for small steps, where 1 - e^{-2a}
    # would cancel (truncation < 1e-12 relative below 0.1).
    a = tl.minimum(a, 15.0)
    a2 = a * a
    series = a * (1 + a2 * (-1.0 / 3 + a2 * (2.0 / 15 + a2 * (-17.0 / 315 + a2 * (62.0 / 2835)))))
    e = tl.exp(-2.0 * a)
    return tl.where(a < 0.1, series, (1 - e) / (1 + e))


@triton.jit(do_not_specialize=["n_rows"])
def _riemannian_adam_rows_kernel(w_ptr, g_ptr, s_ptr, n_rows, D, stride_w, stride_g, stride_s,
                                 lr, beta1, beta2, bias_correction1, bias_correction2, eps,
                                 c, sqrt_c, maxnorm,
                                 EXACT: tl.constexpr, IS_BF16: tl.constexpr, BLOCK_R: tl.constexpr,
                                 BLOCK_D: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows[:, None] < n_rows
    mask = row_ok & (cols[None, :] < D)
    w_off = rows[:, None] * stride_w + cols[None, :]
    m_off = rows[:, None] * stride_s + cols[None, :]
    v_off = rows[:, None] * stride_s + D
    k = -c
    x = tl.load(w_ptr + w_off, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    m = tl.load(s_ptr + m_off, mask=mask, other=0.0)
    v = tl.load(s_ptr + v_off, mask=row_ok, other=0.0)

    x = _project(x, maxnorm)                       # a point nudged outside cannot become NaN
    x2 = _rowsum(x * x)
    lam_x = _lambda(x2, k)
    r = g / (lam_x * lam_x)                # Riemannian gradient
    m = m * beta1 + (1 - beta1) * r
    v = v * beta2 + (1 - beta2) * (lam_x * lam_x * _rowsum(r * r))
    denom = tl.sqrt_rn(v / bias_correction2) + eps
    u = -lr * (m / bias_correction1 / denom)
    if EXACT:                                      # expmap: x ⊕ tanh(√c λ|u|/2) u / (√c|u|)
        u_norm = tl.maximum(tl.sqrt_rn(_rowsum(u * u)), 1e-15)
        s = _tanh_nonneg(lam_x / 2.0 * u_norm * sqrt_c) / sqrt_c * (u / u_norm)
        s2 = _rowsum(s * s)
        xs = _rowsum(x * s)
        num = (1 - 2 * k * xs - k * s2) * x + (1 + k * x2) * s
        y = num / tl.maximum(1 - 2 * k * xs + k * k * x2 * s2, 1e-15)
    else:                                          # retraction: x + u
        y = x + u
    y = _project(y, maxnorm)
    y2 = _rowsum(y * y)
    # parallel transport of m from x to y: gyr[y, -x] m * λ_x / λ_y
    uv = -_rowsum(y * x)
    uw = _rowsum(y * m)
    vw = -_rowsum(x * m)
    k2 = k * k
    a = -k2 * uw * x2 - k * vw + 2 * k2 * uv * vw
    b = -k2 * vw * y2 + k * uw
    d = 1 - 2 * k * uv + k2 * y2 * x2
    m = m + 2 * (a * y - b * x) / tl.maximum(d, 1e-15)
    m = m * lam_x / _lambda(y2, k)
    if IS_BF16:
        y = round_bf16(y)
    tl.store(w_ptr + w_off, y.to(w_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + m_off, m, mask=mask)
    tl.store(s_ptr + v_off, v, mask=row_ok)
