"""Poincaré-ball helpers shared by the tests: geoopt's ball, random points in it, batches of pairs
with a hyperbolic-distance loss, and a run of ``geoopt.optim.SparseRiemannianAdam`` over them (the
independent reference the Riemannian tests compare with)."""

import geoopt
import torch
import torch.nn.functional as F


def ball(c, exact=False):
    """geoopt's Poincaré ball of curvature -c (the exponential map's variant with ``exact``).

    c as a float64 tensor: geoopt stores softplus^-1(c), and a float32 round trip would move c by 1e-7.
    """
    cls = geoopt.PoincareBallExact if exact else geoopt.PoincareBall
    return cls(c=torch.tensor(c, dtype=torch.float64))


def random_points(n, d, c, dtype=torch.float64, gen=None, max_frac=0.9):
    """n rows with uniformly random directions and norms uniform in [0, max_frac / sqrt(c)], drawn in
    float64 and then cast to ``dtype``."""
    x = torch.randn(n, d, dtype=torch.float64, generator=gen)
    x = x / x.norm(dim=-1, keepdim=True)
    r = torch.rand(n, 1, dtype=torch.float64, generator=gen) * max_frac / c**0.5
    return (x * r).to(dtype)


def pair_batches(n_rows, steps, batch, gen):
    """``steps`` batches of (pairs of distinct rows, target distances in [0.2, 2.7]); with batch >> n_rows
    every batch has heavy duplicates."""
    out = []
    for _ in range(steps):
        pairs = torch.randint(0, n_rows, (batch, 2), generator=gen)
        same = pairs[:, 0] == pairs[:, 1]
        pairs[same, 1] = (pairs[same, 1] + 1) % max(n_rows, 2)
        out.append((pairs, torch.rand(batch, dtype=torch.float64, generator=gen) * 2.5 + 0.2))
    return out


def distance_loss(x, target, dist):
    """sum (dist(x_a, x_b) - target)^2 over the pairs of ``x`` (pairs x 2 x D): pulls and pushes pairs
    along geodesics. bfloat16 rows are measured in float64."""
    x = x.double() if x.dtype == torch.bfloat16 else x
    return ((dist(x[:, 0], x[:, 1]) - target.to(x.dtype)) ** 2).sum()


def run_geoopt(w0, batches, *, c, exact, lr, betas, eps):
    """geoopt's SparseRiemannianAdam on a ManifoldParameter started at ``w0`` over ``batches``:
    returns (weights, exp_avg, exp_avg_sq); geoopt keeps the row scalar v broadcast over D columns."""
    M = ball(c, exact)
    w = geoopt.ManifoldParameter(w0.clone(), manifold=M)
    opt = geoopt.optim.SparseRiemannianAdam([w], lr=lr, betas=betas, eps=eps)
    for pairs, target in batches:
        opt.zero_grad()
        distance_loss(F.embedding(pairs, w, sparse=True), target, M.dist).backward()
        opt.step()
    return w.detach().clone(), opt.state[w]["exp_avg"], opt.state[w]["exp_avg_sq"]
