"""Poincaré-ball math as short pure functions (the Riemannian Adam row update that uses it is
``reference.riemannian_adam_rows``).

The ball of curvature -c (c > 0) is {x : c·|x|² < 1} with the conformal factor
λ_x = 2 / (1 - c·|x|²). Every function works on rows (the last dimension) and returns new tensors.
They restate geoopt's ``geoopt/manifolds/stereographic/math.py`` (geoopt 0.5.1) operation by
operation, written with its sectional curvature k = -c, so that float64 trajectories agree with
``geoopt.optim.SparseRiemannianAdam`` to about 1e-12, not just in exact arithmetic:

- ``retraction`` / ``transp_follow_retraction``: what ``geoopt.PoincareBall`` uses in optimisation
  (first-order retraction x + u, projected; then parallel transport from x to the new point);
- ``expmap`` / ``transp_follow_expmap``: what ``geoopt.PoincareBallExact`` uses (exponential map,
  projected; then parallel transport).

References: Nickel & Kiela, "Poincaré Embeddings for Learning Hierarchical Representations" (2017);
Ganea, Bécigneul & Hofmann, "Hyperbolic Neural Networks" (2018); Bécigneul & Ganea, "Riemannian
Adaptive Optimization Methods" (2019).
"""

from __future__ import annotations

import torch

_MIN = 1e-15  # geoopt's clamp for norms and denominators


def max_norm(c: float, dtype: torch.dtype) -> float:
    """Largest Euclidean norm a point may have: geoopt keeps a margin of 4e-3 (float32) or 1e-5
    (other dtypes) of the radius 1/sqrt(c)."""
    eps = 4e-3 if dtype == torch.float32 else 1e-5
    return (1 - eps) / c**0.5


def project(x, *, c):
    """Pull rows whose norm exceeds ``max_norm`` back onto that sphere (others unchanged)."""
    norm = x.norm(dim=-1, keepdim=True, p=2).clamp_min(_MIN)
    maxnorm = max_norm(c, x.dtype)
    return torch.where(norm > maxnorm, x / norm * maxnorm, x)


def lambda_x(x, *, c, keepdim=True):
    """Conformal factor λ_x = 2 / (1 - c|x|²), one number per row."""
    k = -c
    return 2 / (1 + k * x.pow(2).sum(dim=-1, keepdim=keepdim)).clamp_min(_MIN)


def egrad2rgrad(x, g, *, c):
    """Riemannian gradient: the Euclidean gradient divided by λ_x²."""
    return g / lambda_x(x, c=c) ** 2


def component_inner(x, u, v=None, *, c):
    """Riemannian inner product <u, v>_x = λ_x² (u·v), a (n, 1) row scalar."""
    v = u if v is None else v
    return lambda_x(x, c=c) ** 2 * (u * v).sum(dim=-1, keepdim=True)


def mobius_add(x, y, *, c):
    """Möbius addition x ⊕ y on the ball."""
    k = -c
    x2 = x.pow(2).sum(dim=-1, keepdim=True)
    y2 = y.pow(2).sum(dim=-1, keepdim=True)
    xy = (x * y).sum(dim=-1, keepdim=True)
    num = (1 - 2 * k * xy - k * y2) * x + (1 + k * x2) * y
    denom = 1 - 2 * k * xy + k**2 * x2 * y2
    return num / denom.clamp_min(_MIN)


def gyration(u, v, w, *, c):
    """Gyration gyr[u, v] w, in the closed form geoopt uses."""
    k = -c
    u2 = u.pow(2).sum(dim=-1, keepdim=True)
    v2 = v.pow(2).sum(dim=-1, keepdim=True)
    uv = (u * v).sum(dim=-1, keepdim=True)
    uw = (u * w).sum(dim=-1, keepdim=True)
    vw = (v * w).sum(dim=-1, keepdim=True)
    k2 = k**2
    a = -k2 * uw * v2 - k * vw + 2 * k2 * uv * vw
    b = -k2 * vw * u2 + k * uw
    d = 1 - 2 * k * uv + k2 * u2 * v2
    return w + 2 * (a * u + b * v) / d.clamp_min(_MIN)


def parallel_transport(x, y, v, *, c):
    """Parallel transport of the tangent vector v from x to y."""
    return gyration(y, -x, v, c=c) * lambda_x(x, c=c) / lambda_x(y, c=c)


def retraction(x, u, *, c):
    """First-order retraction of geoopt.PoincareBall: project(x + u)."""
    return project(x + u, c=c)


def transp_follow_retraction(x, u, v, *, c):
    """Move x along u by ``retraction`` and transport v there; returns (y, v at y)."""
    y = retraction(x, u, c=c)
    return y, parallel_transport(x, y, v, c=c)


def _tanh(x):
    return x.clamp(-15, 15).tanh()


def _artanh(x):
    x = x.clamp(-1 + 1e-7, 1 - 1e-7)
    return (torch.log(1 + x).sub(torch.log(1 - x))).mul(0.5)


def expmap(x, u, *, c):
    """Exponential map exp_x(u) = x ⊕ tanh(√c λ_x |u| / 2) u / (√c |u|), projected."""
    sqrt_c = c**0.5
    u_norm = u.norm(dim=-1, p=2, keepdim=True).clamp_min(_MIN)
    lam = lambda_x(x, c=c)
    second = (1 / sqrt_c) * _tanh((lam / 2.0) * u_norm * sqrt_c) * (u / u_norm)
    return project(mobius_add(x, second, c=c), c=c)


def transp_follow_expmap(x, u, v, *, c):
    """Move x along u by ``expmap`` and transport v there; returns (y, v at y)."""
    y = expmap(x, u, c=c)
    return y, parallel_transport(x, y, v, c=c)


def distance(x, y, *, c, keepdim=False):
    """Geodesic distance d(x, y) = (2/√c) artanh(√c |(-x) ⊕ y|)."""
    sqrt_c = c**0.5
    norm = mobius_add(-x, y, c=c).norm(dim=-1, p=2, keepdim=keepdim)
    return 2.0 * ((1 / sqrt_c) * _artanh(norm * sqrt_c))
