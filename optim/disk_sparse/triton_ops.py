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

from .._triton_common import KernelLaunch
from .._triton_common import axis_pairs, next_pow2, spec_widths
from ._triton_kernels import _adam_rows_kernel, _riemannian_adam_rows_kernel

# Elements per program: 16 warps x 32 lanes x 4 values, one 128-bit access per lane and array.
# Compiled for sm_90 (experiments/kernel_resources.py), 4 values a thread keep the Adam kernel under
# 64 registers (>= 50% occupancy, to hide HBM latency in this gather-bound update); 16 a thread
# needed over 100 and 32 spilled. Large programs also keep the interpreter's tests fast (one Python
# iteration a program). Rows wider than MAX_BLOCK_D are split over a second grid axis.
_TILE = 2048
_WARPS = 16
MAX_BLOCK_D = 128
# Widest row of the ball's update: it needs whole-row norms and dot products (projection, conformal
# factor, transport), so a program holds whole rows, with up to _BALL_MAX_WARPS warps; at 16384 a
# row's 16 values a thread spilled registers.
MAX_BALL_D = 8192
_BALL_TILE, _BALL_MIN_WARPS, _BALL_MAX_WARPS = 512, 4, 32  # its update keeps more values live than Adam's
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


def adam_rows_plan(d: int, w_dtype, *, maximize: bool) -> dict:
    """Constexprs and warps of the Adam kernel for rows of width ``d`` (the launcher's only choice)."""
    block_d = min(next_pow2(d), MAX_BLOCK_D)
    return dict(MAXIMIZE=bool(maximize), IS_BF16=w_dtype == torch.bfloat16,
                BLOCK_R=max(1, _TILE // block_d), BLOCK_D=block_d, num_warps=_WARPS)


def _adam_rows_args(w, g, state, neg_step_size, *, beta1, beta2, eps, maximize):
    """(grid, args, kwargs) of one Adam launch."""
    n, d = w.shape
    plan = adam_rows_plan(d, w.dtype, maximize=maximize)
    grid = (triton.cdiv(n, plan["BLOCK_R"]), triton.cdiv(d, plan["BLOCK_D"]))
    args = (w, g, state, n, d, w.stride(0), g.stride(0), state.stride(0), 1 - beta1, 1 - beta2,
            neg_step_size, eps)
    return grid, args, dict(plan, enable_fp_fusion=False)


def adam_rows_(w, g, state, step, *, lr, beta1, beta2, eps, maximize=False, bitwise=True) -> None:
    """In-place lazy-Adam update of gathered rows; ``state`` holds records ``[m | v]`` (width 2D).

    Same update as ``reference.sparse_adam_rows`` (and ``torch.optim.SparseAdam``), with correctly
    rounded sqrt and division: on CPU, torch's vectorised sqrt is not correctly rounded, so there a
    few values differ by one ulp. ``step`` is the step count after incrementing (>= 1). ``bitwise`` is
    ignored: the exact Adam rule passes one set of keywords to every backend (``rules.Rule.hyper``)
    and only numba's reads it.
    """
    _check_rows("adam_rows_", w, g, state, lambda d: 2 * d)
    if step < 1:
        raise ValueError(f"adam_rows_: step must be >= 1 (the count after incrementing), got {step}")
    if w.numel() == 0:
        return
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
    grid, args, kwargs = _adam_rows_args(w, g, state, float(-step_size), beta1=beta1, beta2=beta2, eps=eps,
                                         maximize=maximize)
    _adam_rows_kernel[grid](*args, **kwargs)


def riemannian_adam_rows_plan(d: int, w_dtype, *, exact: bool) -> dict:
    """Constexprs and warps of the ball's kernel for rows of width ``d``: whole rows per program,
    _BALL_TILE values or one row, 4 values a thread (up to _BALL_MAX_WARPS warps, then more)."""
    block_d = next_pow2(d)
    block_r = max(1, _BALL_TILE // block_d)
    warps = min(_BALL_MAX_WARPS, max(_BALL_MIN_WARPS, block_r * block_d // (32 * 4)))
    plan = dict(EXACT=bool(exact), IS_BF16=w_dtype == torch.bfloat16, BLOCK_R=block_r,
                BLOCK_D=block_d, num_warps=warps)
    if warps == 32:  # 1024 threads: allow the 64 registers each the SM holds (ptxas chose 32 and spilled)
        plan["maxnreg"] = 64
    return plan


def _riemannian_adam_rows_args(w, g, state, *, lr, beta1, beta2, bias_correction1, bias_correction2,
                               eps, c, exact):
    """(grid, args, kwargs) of one Riemannian Adam launch."""
    n, d = w.shape
    plan = riemannian_adam_rows_plan(d, w.dtype, exact=exact)
    maxnorm = (1 - 4e-3) / math.sqrt(c)  # geoopt's float32 margin (poincare.max_norm)
    grid = (triton.cdiv(n, plan["BLOCK_R"]),)
    args = (w, g, state, n, d, w.stride(0), g.stride(0), state.stride(0), lr, beta1, beta2,
            bias_correction1, bias_correction2, eps, c, math.sqrt(c), maxnorm)
    return grid, args, plan


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
    grid, args, kwargs = _riemannian_adam_rows_args(
        w, g, state, lr=lr, beta1=beta1, beta2=beta2, bias_correction1=1 - beta1**step,
        bias_correction2=1 - beta2**step, eps=eps, c=float(c), exact=exact)
    _riemannian_adam_rows_kernel[grid](*args, **kwargs)


# Every configuration the planners above can choose, one list of values per axis; one value of each
# is one compiled kernel. A new constexpr of a kernel is one more line here (and its keyword in the
# plan). Widths: every tile shape, under Triton's both integer specialisations (spec_widths).
_ROW_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
PLAN_AXES = {
    "adam_rows": dict(d=spec_widths(MAX_BLOCK_D), dtypes=_ROW_DTYPES, maximize=[False, True]),
    "riemannian_adam_rows": dict(d=spec_widths(MAX_BALL_D), dtypes=_ROW_DTYPES, exact=[False, True]),
}


def _stand_ins(d, w_dtype, g_dtype, width):
    """Two rows of weights, gradients and records on the CPU: what the compiler sees of a launch."""
    return torch.zeros(2, d, dtype=w_dtype), torch.zeros(2, d, dtype=g_dtype), torch.zeros(2, width)


def _config_name(kernel, c):
    return kernel + "/" + ",".join(
        f"{k}={'+'.join(str(x).replace('torch.', '') for x in v) if isinstance(v, tuple) else v}"
        for k, v in c.items())


def launch_configs(cover=axis_pairs) -> list:
    """``KernelLaunch`` of the configurations in ``cover(PLAN_AXES[kernel])`` (``axis_pairs``: every
    pair of axis values; ``_triton_common.axis_product``: all), built by the launchers' own code."""
    out = []
    for c in cover(PLAN_AXES["adam_rows"]):
        w, g, s = _stand_ins(c["d"], *c["dtypes"], 2 * c["d"])
        _, args, kw = _adam_rows_args(w, g, s, -1e-3, beta1=0.9, beta2=0.999, eps=1e-8, maximize=c["maximize"])
        out.append(KernelLaunch(_config_name("adam_rows", c), _adam_rows_kernel, args, kw))
    for c in cover(PLAN_AXES["riemannian_adam_rows"]):
        w, g, s = _stand_ins(c["d"], *c["dtypes"], c["d"] + 1)
        _, args, kw = _riemannian_adam_rows_args(w, g, s, lr=1e-3, beta1=0.9, beta2=0.999,
                                                 bias_correction1=0.1, bias_correction2=1e-3, eps=1e-8,
                                                 c=1.0, exact=c["exact"])
        out.append(KernelLaunch(_config_name("riemannian_adam_rows", c), _riemannian_adam_rows_kernel,
                                args, kw))
    return out
