"""Triton path of the Disk Sparse Adam row updates: launchers of ``_triton_kernels.py``.

Both public functions have the signature every backend shares (``torch_ops``, ``numba_ops``) and
work in place on rows gathered from an embedding table:

- ``w``: (n, D) float32 / bfloat16 weight rows, rows contiguous (last stride 1);
- ``g``: (n, D) coalesced gradient rows, in ``w``'s dtype or float32;
- ``state``: (n, W) float32 records, one contiguous record per row: ``[m (D) | v (D)]`` (W = 2D) for
  Adam, ``[m (D) | v (1)]`` (W = D+1) for the ball, whose second moment is one number per row.

Arithmetic is float32, as on the torch path for float32 state. On CPU tensors the kernels run under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math

import torch
import triton

from .._triton_common import next_pow2
from ._triton_kernels import _adam_rows_kernel, _riemannian_adam_rows_kernel

# Elements per program. A tile of BLOCK_R x BLOCK_D = 2048 fp32 values gives four warps 16 values
# per thread. Fewer, larger programs also matter for the interpreter, which runs one Python
# iteration per program.
_TILE = 2048
# Widest row of the ball's update: it needs whole-row norms and dot products (projection, conformal
# factor, transport), so a program holds whole rows; beyond this width they no longer fit in registers.
MAX_BALL_D = 16384
# Weight dtypes of the kernels (the rounding on store is exact for these; see _triton_common).
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def _check_rows(name, w, g, state, width):
    if w.dim() != 2 or g.shape != w.shape:
        raise ValueError(f"{name}: w and g must be (n, D) of one shape, got {tuple(w.shape)} and {tuple(g.shape)}")
    if w.dtype not in WEIGHT_DTYPES:
        raise TypeError(f"{name}: weights of dtype {w.dtype} are not supported by the Triton path "
                        f"(float32, bfloat16); use backend='torch' for them")
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
    block_d = min(next_pow2(d), 1024)
    block_r = max(1, _TILE // block_d)
    grid = (triton.cdiv(n, block_r), triton.cdiv(d, block_d))
    _adam_rows_kernel[grid](w, g, state, n, d, w.stride(0), g.stride(0), state.stride(0),
                            1 - beta1, 1 - beta2, neg_step_size, eps,
                            MAXIMIZE=bool(maximize), IS_BF16=w.dtype == torch.bfloat16, BLOCK_R=block_r, BLOCK_D=block_d,
                            num_warps=4, enable_fp_fusion=False)


def adam_rows_(w, g, state, step, *, lr, beta1, beta2, eps, maximize=False, bitwise=True) -> None:
    """In-place lazy-Adam update of gathered rows; ``state`` holds records ``[m | v]`` (width 2D).

    Same update as ``reference.sparse_adam_rows`` (and ``torch.optim.SparseAdam``), with correctly
    rounded sqrt and division (``bitwise`` is accepted for the shared signature): on CPU, torch's
    vectorised sqrt is not correctly rounded, so there a few values differ by one ulp. ``step`` is
    the step count after incrementing (>= 1).
    """
    _check_rows("adam_rows_", w, g, state, lambda d: 2 * d)
    if step < 1:
        raise ValueError(f"adam_rows_: step must be >= 1 (the count after incrementing), got {step}")
    if w.numel() == 0:
        return
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
    _adam_rows_launch(w, g, state, float(-step_size), beta1=beta1, beta2=beta2, eps=eps, maximize=maximize)


def _riemannian_adam_rows_launch(w, g, state, *, lr, beta1, beta2, bias_correction1, bias_correction2,
                                 eps, c, exact):
    n, d = w.shape
    block_d = next_pow2(d)
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

    Same update as ``reference.riemannian_adam_rows`` (geoopt's SparseRiemannianAdam with
    ``PoincareBall(c)``, or ``PoincareBallExact(c)`` when ``exact``), in float32.
    """
    _check_rows("riemannian_adam_rows_", w, g, state, lambda d: d + 1)
    if step < 1:
        raise ValueError(f"riemannian_adam_rows_: step must be >= 1 (the count after incrementing), got {step}")
    if not c > 0:
        raise ValueError(f"riemannian_adam_rows_: curvature c must be > 0, got {c}")
    if w.shape[1] > MAX_BALL_D:
        raise ValueError(f"riemannian_adam_rows_: rows wider than {MAX_BALL_D} do not fit one program; "
                         f"use backend='torch' (got D={w.shape[1]})")
    if w.numel() == 0:
        return
    _riemannian_adam_rows_launch(w, g, state, lr=lr, beta1=beta1, beta2=beta2,
                                 bias_correction1=1 - beta1**step, bias_correction2=1 - beta2**step,
                                 eps=eps, c=float(c), exact=exact)
