"""Pure reference of the lazy-Adam row update of Disk Sparse Adam.

The function works on rows gathered from a table: ``w``, ``g``, ``m``, ``v`` are ``(n, D)``, ``g``
holds coalesced gradient rows (duplicates already summed, one row per unique index) and ``step`` is
the parameter's step count after incrementing (``t >= 1``). Nothing is modified in place.

The operation order is the one of ``torch.optim.SparseAdam`` (``torch/optim/_functional.py``,
``sparse_adam``), so in float32 it reproduces that optimizer to the last rounding:

    u_m   = (g - m) * (1 - beta1);            m' = m + u_m
    u_v   = (g*g - v) * (1 - beta2);          v' = v + u_v
    step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)        (in Python float64)
    w'    = w + (-step_size) * ((u_m + m) / (sqrt(u_v + v) + eps))

``maximize`` negates the gradient first. Rows whose gradient is zero are still updated (their
moments decay): like SparseAdam, every row present in the sparse gradient counts as touched.
"""

from __future__ import annotations

import math

import torch


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
