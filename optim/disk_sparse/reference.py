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

``compact_adam_rows``, ``compact_riemannian_adam_rows``: the same rules on the compact state
(``compact.py``): m as linear int8 codes ``q`` with one scale ``s`` per row (``encode_rows``,
``decode_rows``), v one number per row.
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


# -- the compact state format (``compact.py``): m as 8-bit codes with one scale per row, one v per row
CODE_MAX = 127  # symmetric int8 codes in [-127, 127]


def decode_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """First moments of codes ``q`` (int8, (n, D)) with row scales ``s`` ((n, 1)): q * (s / 127)."""
    return q.to(s.dtype) * (s / CODE_MAX)


def encode_rows(m: torch.Tensor):
    """Linear 8-bit codes of ``m`` ((n, D)): ``(q, s)`` with s = max |m| of the row and
    q = round(m * (127 / s)) (half to even), 0 for a row of zeros. Where 127 / s overflows (s below
    about 3.7e-37) q = round(m / s * 127) instead. A row that holds NaN or inf stores s = NaN (any
    NaN) or inf, and codes 0: every backend stores the same, and the state dict stays loadable."""
    s = m.abs().amax(1, keepdim=True)
    inv = torch.where(s > 0, CODE_MAX / s, torch.zeros_like(s))
    q = torch.round(m * inv)
    tiny = torch.isinf(inv) & torch.isfinite(s)
    if bool(tiny.any()):
        q = torch.where(tiny, torch.round(m / s * CODE_MAX), q)
    q = torch.where(torch.isfinite(m).all(1, keepdim=True), q, torch.zeros_like(q))
    return q.clamp_(-CODE_MAX, CODE_MAX).to(torch.int8), s


def compact_adam_rows(w, g, q, s, v, step, *, lr, beta1, beta2, eps, maximize=False):
    """Lazy Adam with a compact state, on gathered rows; returns new ``(w, q, s, v)``.

    w, g: (n, D) float32; q: (n, D) int8 codes of m with row scales s: (n, 1); v: (n, 1), one second
    moment per row (the mean of g² over the row, as FBGEMM's row-wise Adam keeps it)::

        m   = decode(q, s);    m' = m + (g - m)(1 - beta1)
        v'  = v + (mean_j g_j² - v)(1 - beta2)              (the mean summed in float64)
        w'  = w + (m' / (sqrt(v') + eps)) * (-lr sqrt(1 - beta2^t) / (1 - beta1^t))
        q', s' = encode(m')

    The weights move with the unquantized m'; only what is stored is coded.
    """
    if maximize:
        g = -g
    m = decode_rows(q, s)
    m = m + (g - m) * (1 - beta1)
    g2 = g.double().pow(2).mean(1, keepdim=True).to(v.dtype)
    v = v + (g2 - v) * (1 - beta2)
    step_size = lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
    w = w + (m / (v.sqrt() + eps)) * (-step_size)
    q, s = encode_rows(m)
    return w, q, s, v


def compact_riemannian_adam_rows(w, g, q, s, v, step, *, lr, beta1, beta2, eps, c, exact):
    """``riemannian_adam_rows`` with m kept as codes: decode m, step, encode the transported m.
    v is (n, 1) as in the exact format (the ball's second moment is already one per row)."""
    w, m, v = riemannian_adam_rows(w, g, decode_rows(q, s), v, step, lr=lr, beta1=beta1, beta2=beta2,
                                   eps=eps, c=c, exact=exact)
    q, s = encode_rows(m)
    return w, q, s, v
