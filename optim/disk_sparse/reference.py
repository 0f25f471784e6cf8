"""Pure references of the Disk Sparse Adam row updates: Euclidean lazy Adam and Riemannian Adam.

The functions work on rows gathered from a table: ``w``, ``g``, ``m`` are ``(n, D)``, ``g`` holds
coalesced gradient rows (duplicates already summed, one row per unique index) and ``step`` is the
parameter's step count after incrementing (``t >= 1``). Nothing is modified in place. The fast
paths (``torch_ops``, ``numba_ops``, ``triton_ops``) are tested against these.

``sparse_adam_rows``: ``v`` is ``(n, D)``; the operation order is the one of
``torch.optim.SparseAdam`` (``torch/optim/_functional.py``, ``sparse_adam``), so in float32 it
reproduces that optimizer to the last rounding:

    u_m   = (g - m) * (1 - beta1);            m' = m + u_m
    u_v   = (g*g - v) * (1 - beta2);          v' = v + u_v
    step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)        (in Python float64)
    w'    = w + (-step_size) * ((u_m + m) / (sqrt(u_v + v) + eps))

``maximize`` negates the gradient first. Rows whose gradient is zero are still updated (their
moments decay): like SparseAdam, every row present in the sparse gradient counts as touched.

``riemannian_adam_rows``: the rows lie in the Poincaré ball (``poincare.py``), ``v`` is ``(n, 1)``.
"""

from __future__ import annotations

import math

import torch

from .poincare import component_inner, egrad2rgrad, project, transp_follow_expmap, transp_follow_retraction


def sparse_adam_rows(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, *,
                     lr: float, beta1: float, beta2: float, eps: float, maximize: bool = False):
    """One SparseAdam update of gathered rows; returns new ``(w, m, v)``."""
    if maximize:
        g = -g
    u_m = g.sub(m).mul_(1 - beta1)
    u_v = g.pow(2).sub_(v).mul_(1 - beta2)
    m_new = m + u_m
    v_new = v + u_v
    denom = u_v.add_(v).sqrt_().add_(eps)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr * math.sqrt(bias_correction2) / bias_correction1
    w_new = w + (-step_size * u_m.add_(m).div_(denom))
    return w_new, m_new, v_new


def riemannian_adam_rows(w, g, m, v, step, *, lr, beta1, beta2, eps, c, exact):
    """One Riemannian Adam step (Bécigneul & Ganea 2019) on gathered rows of the ball.

    w, g, m: (n, D); v: (n, 1) (the second moment of a row is one number, λ_x² |rgrad|²);
    g holds coalesced unique rows; step = t >= 1 after incrementing. Returns new (w, m, v)::

        x  = project(w)                      # a point nudged outside cannot become NaN
        r  = g / λ_x²                        # Riemannian gradient
        m  = β1 m + (1 - β1) r
        v  = β2 v + (1 - β2) λ_x² |r|²
        u  = -lr (m / (1 - β1^t)) / (sqrt(v / (1 - β2^t)) + eps)
        w, m = retraction+transport (exact=False) or expmap+transport (exact=True) of x along u

    the order of operations of ``geoopt.optim.SparseRiemannianAdam.step`` with
    ``geoopt.PoincareBall(c)`` (exact=False) or ``geoopt.PoincareBallExact(c)`` (exact=True).
    """
    x = project(w, c=c)
    r = egrad2rgrad(x, g, c=c)
    m = m.mul(beta1).add_(r, alpha=1 - beta1)
    v = v.mul(beta2).add_(component_inner(x, r, c=c), alpha=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = v.div(bias_correction2).sqrt_().add_(eps)
    direction = m.div(bias_correction1) / denom
    move = transp_follow_expmap if exact else transp_follow_retraction
    w, m = move(x, -lr * direction, m, c=c)
    return w, m, v
