"""Triton fused row updates of Disk Sparse Adam: Euclidean lazy Adam and Riemannian Adam on the ball.

Both work in place on rows gathered from an embedding table (layout agreed in the interfaces):

- ``w``: (n, D) float32 / bfloat16 / float16 weight rows, rows contiguous (last stride 1);
- ``g``: (n, D) coalesced gradient rows, in ``w``'s dtype or float32;
- ``state``: (n, W) float32 records, one contiguous record per row: ``[m (D) | v (D)]`` (W = 2D) for
  Adam, ``[m (D) | v (1)]`` (W = D+1) for the ball, whose second moment is one number per row.

Arithmetic is float32; weights are loaded to float32 and rounded back to their dtype on store, the
same as the torch path (which computes in the state dtype and casts back). Bias corrections and the
step size are computed on the host in float64, as ``torch.optim.SparseAdam`` does.

Layout of each file section: private ``@triton.jit`` kernel, launcher (checks, grid, block sizes),
public function with the keyword signature of the pure references (``reference.sparse_adam_rows``,
``poincare.riemannian_adam_rows``). On CPU tensors the kernels run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Elements per program. A tile of BLOCK_R x BLOCK_D = 2048 fp32 values gives four warps 16 values
# per thread and, at the seed shape (2048 rows x 128), 128 programs (not yet tuned on a GPU). Fewer,
# larger programs matter for the interpreter, which runs one Python iteration per program: one row
# per program took 73 s there for 2000 x 3 rows, tiles of 512 x 4 took 0.2 s.
_TILE = 2048
# The ball's update needs whole-row norms and dot products (projection, conformal factor, transport),
# so a program holds whole rows; beyond this width the rows no longer fit in registers.
_MAX_BALL_D = 16384
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _round_to(x, IS_BF16: tl.constexpr, dtype: tl.constexpr):
    # float32 -> bfloat16 rounded to nearest even with integer ops: the GPU's cvt.rn does this, but
    # the interpreter's cast truncates (measured: bf16 weights drifted 2 ulps in 3 steps); NaN stays NaN.
    if IS_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x != x, x.to(tl.bfloat16), rounded)
    else:
        return x.to(dtype)


# ---------------------------------------------------------------------------------------------------
# Euclidean lazy Adam (torch.optim.SparseAdam's operation order; reference.sparse_adam_rows)
# ---------------------------------------------------------------------------------------------------
@triton.jit
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
    tl.store(w_ptr + w_off, _round_to(w, IS_BF16, w_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + m_off, m, mask=mask)
    tl.store(s_ptr + m_off + D, v, mask=mask)


def _check_rows(name, w, g, state, width):
    if w.dim() != 2 or g.shape != w.shape:
        raise ValueError(f"{name}: w and g must be (n, D) of one shape, got {tuple(w.shape)} and {tuple(g.shape)}")
    if w.dtype not in _WEIGHT_DTYPES:
        raise TypeError(f"{name}: weights of dtype {w.dtype} are not supported by the Triton path "
                        f"(float32, bfloat16, float16); use backend='torch' for them")
    if g.dtype not in (w.dtype, torch.float32):
        raise TypeError(f"{name}: g must be in w's dtype ({w.dtype}) or float32, got {g.dtype}")
    n, d = w.shape
    if state.dtype != torch.float32 or state.shape != (n, width(d)):
        raise ValueError(f"{name}: state must be float32 records of shape {(n, width(d))}, "
                         f"got {state.dtype} {tuple(state.shape)}")
    for t, what in ((w, "w"), (g, "g"), (state, "state")):
        if t.device != w.device:
            raise ValueError(f"{name}: {what} is on {t.device}, w on {w.device}; put them on one device")
        if t.numel() and t.stride(1) != 1:
            raise ValueError(f"{name}: {what} must have contiguous rows (last stride 1); pass .contiguous()")
    if state.numel() and state.stride(0) != width(d):
        raise ValueError(f"{name}: state records must be contiguous; pass state.contiguous()")


def _adam_rows_launch(w, g, state, neg_step_size, *, beta1, beta2, eps, maximize):
    n, d = w.shape
    block_d = min(triton.next_power_of_2(d), 1024)
    block_r = max(1, _TILE // block_d)
    grid = (triton.cdiv(n, block_r), triton.cdiv(d, block_d))
    _adam_rows_kernel[grid](w, g, state, n, d, w.stride(0), g.stride(0), state.stride(0),
                            1 - beta1, 1 - beta2, neg_step_size, eps,
                            MAXIMIZE=bool(maximize), IS_BF16=w.dtype == torch.bfloat16, BLOCK_R=block_r, BLOCK_D=block_d,
                            num_warps=4, enable_fp_fusion=False)


def adam_rows_(w, g, state, step, *, lr, beta1, beta2, eps, maximize=False) -> None:
    """In-place lazy-Adam update of gathered rows; ``state`` holds records ``[m | v]`` (width 2D).

    Same update as ``reference.sparse_adam_rows`` (and ``torch.optim.SparseAdam``), with correctly
    rounded sqrt and division; on CPU, torch's vectorised sqrt is not correctly rounded, so there a
    few values differ by one ulp. ``step`` is the step count after incrementing (>= 1).
    """
    _check_rows("adam_rows_", w, g, state, lambda d: 2 * d)
    if step < 1:
        raise ValueError(f"adam_rows_: step must be >= 1 (the count after incrementing), got {step}")
    if w.numel() == 0:
        return
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr * math.sqrt(bias_correction2) / bias_correction1
    _adam_rows_launch(w, g, state, -step_size, beta1=beta1, beta2=beta2, eps=eps, maximize=maximize)


# ---------------------------------------------------------------------------------------------------
# Riemannian Adam on the Poincaré ball (poincare.riemannian_adam_rows, geoopt's order of operations)
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


@triton.jit
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
    tl.store(w_ptr + w_off, _round_to(y, IS_BF16, w_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + m_off, m, mask=mask)
    tl.store(s_ptr + v_off, v, mask=row_ok)


def _riemannian_adam_rows_launch(w, g, state, *, lr, beta1, beta2, bias_correction1, bias_correction2,
                                 eps, c, exact):
    n, d = w.shape
    block_d = triton.next_power_of_2(d)
    block_r = max(1, _TILE // block_d)
    maxnorm = (1 - 4e-3) / math.sqrt(c)  # geoopt's float32 margin (poincare.max_norm)
    grid = (triton.cdiv(n, block_r),)
    _riemannian_adam_rows_kernel[grid](w, g, state, n, d, w.stride(0), g.stride(0), state.stride(0),
                                       lr, beta1, beta2, bias_correction1, bias_correction2, eps,
                                       c, math.sqrt(c), maxnorm,
                                       EXACT=bool(exact), IS_BF16=w.dtype == torch.bfloat16, BLOCK_R=block_r, BLOCK_D=block_d,
                                       num_warps=4 if block_d <= 2048 else 8)


def riemannian_adam_rows_(w, g, state, step, *, lr, beta1, beta2, eps, c, exact) -> None:
    """In-place Riemannian Adam update of gathered rows of the Poincaré ball of curvature -c;
    ``state`` holds records ``[m | v]`` of width D+1.

    Same update as ``poincare.riemannian_adam_rows`` (geoopt's SparseRiemannianAdam with
    ``PoincareBall(c)``, or ``PoincareBallExact(c)`` when ``exact``), in float32.
    """
    _check_rows("riemannian_adam_rows_", w, g, state, lambda d: d + 1)
    if step < 1:
        raise ValueError(f"riemannian_adam_rows_: step must be >= 1 (the count after incrementing), got {step}")
    if not c > 0:
        raise ValueError(f"riemannian_adam_rows_: curvature c must be > 0, got {c}")
    if w.shape[1] > _MAX_BALL_D:
        raise ValueError(f"riemannian_adam_rows_: rows wider than {_MAX_BALL_D} do not fit one program; "
                         f"use backend='torch' (got D={w.shape[1]})")
    if w.numel() == 0:
        return
    _riemannian_adam_rows_launch(w, g, state, lr=lr, beta1=beta1, beta2=beta2,
                                 bias_correction1=1 - beta1**step, bias_correction2=1 - beta2**step,
                                 eps=eps, c=float(c), exact=exact)
