"""Poincaré-ball math and the Riemannian Adam row update against geoopt (an independent reference).

The pure functions restate geoopt's operations in the same order, so float64 agreement is at the
rounding level (1e-12); the 100-step trajectories against ``geoopt.optim.SparseRiemannianAdam``
are held to max |Δ| <= 1e-9 (float64; measured 1e-14) and 2e-5 (float32; measured 1e-6: the two
sides compute the distance loss's gradient with different but equivalent code, and those rounding
differences are carried along the trajectory).
"""

import geoopt.manifolds.stereographic.math as gmath
import pytest
import torch
import torch.nn.functional as F

from optim.disk_sparse import poincare as P
from optim.disk_sparse.reference import riemannian_adam_rows
from tests.geo import ball, distance_loss, pair_batches, random_points, run_geoopt
from tests.utils import assert_close

CS = [pytest.param(1.0, id="c=1"), pytest.param(0.5, id="c=0.5")]


@pytest.mark.parametrize("c", CS)
def test_pointwise_functions_match_geoopt(c):
    n, d = 257, 7
    x, y = random_points(n, d, c), random_points(n, d, c)
    u = torch.randn(n, d, dtype=torch.float64) * 0.3
    v = torch.randn(n, d, dtype=torch.float64)
    M, E = ball(c), ball(c, exact=True)
    k = M.k
    tol = dict(atol=1e-12, rtol=1e-12)
    assert_close(P.lambda_x(x, c=c), gmath.lambda_x(x, k=k, keepdim=True), **tol, name="lambda_x")
    assert_close(P.egrad2rgrad(x, u, c=c), M.egrad2rgrad(x, u), **tol, name="egrad2rgrad")
    assert_close(P.component_inner(x, u, c=c), M.component_inner(x, u), **tol, name="component_inner")
    assert_close(P.component_inner(x, u, v, c=c), M.component_inner(x, u, v), **tol, name="inner(u,v)")
    assert_close(P.mobius_add(x, y, c=c), gmath.mobius_add(x, y, k=k), **tol, name="mobius_add")
    assert_close(P.gyration(x, y, v, c=c), gmath.gyration(x, y, v, k=k), **tol, name="gyration")
    assert_close(P.parallel_transport(x, y, v, c=c), M.transp(x, y, v), **tol, name="transport")
    assert_close(P.retraction(x, u, c=c), M.retr(x, u), **tol, name="retraction")
    assert_close(P.expmap(x, u, c=c), E.retr(x, u), **tol, name="expmap")
    for mine, theirs, name in [
        (P.transp_follow_retraction(x, u, v, c=c), M.retr_transp(x, u, v), "retr_transp"),
        (P.transp_follow_expmap(x, u, v, c=c), E.retr_transp(x, u, v), "expmap_transp"),
    ]:
        assert_close(mine[0], theirs[0], **tol, name=name + ".point")
        assert_close(mine[1], theirs[1], **tol, name=name + ".vector")
    assert_close(P.distance(x, y, c=c), M.dist(x, y), **tol, name="distance")
    # an independent closed form: d(0, y) = (2/sqrt c) artanh(sqrt c |y|)
    d0 = 2 / c**0.5 * torch.atanh(c**0.5 * y.norm(dim=-1))
    assert_close(P.distance(torch.zeros_like(y), y, c=c), d0, atol=1e-12, rtol=1e-10, name="d(0,y)")


@pytest.mark.parametrize("c", CS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_project_matches_geoopt_and_margin(c, dtype):
    x = torch.randn(300, 5, dtype=dtype) * 2 / c**0.5  # many rows far outside the ball
    x[:3] = 0  # zero rows stay zero
    got = P.project(x, c=c)
    assert_close(got, ball(c).projx(x), atol=1e-6 if dtype == torch.float32 else 1e-14, name="project")
    margin = 4e-3 if dtype == torch.float32 else 1e-5
    assert (got.double().norm(dim=-1) <= (1 - margin) / c**0.5 * (1 + 1e-6)).all()
    inside = x.norm(dim=-1) < (1 - margin) / c**0.5
    assert torch.equal(got[inside], x[inside])


def run_rows(w0, batches, *, c, exact, lr, betas, eps):
    """A minimal lazy driver of riemannian_adam_rows: coalesce, gather, update, scatter."""
    w = w0.clone().requires_grad_(True)
    m = torch.zeros_like(w0)
    v = torch.zeros(w0.shape[0], 1, dtype=w0.dtype)
    for t, (pairs, target) in enumerate(batches, start=1):
        w.grad = None
        distance_loss(F.embedding(pairs, w, sparse=True), target, lambda a, b: P.distance(a, b, c=c)).backward()
        g = w.grad.coalesce()
        rows, gv = g.indices()[0], g.values()
        with torch.no_grad():
            nw, nm, nv = riemannian_adam_rows(w[rows], gv, m[rows], v[rows], t, lr=lr,
                                                beta1=betas[0], beta2=betas[1], eps=eps, c=c, exact=exact)
            w[rows], m[rows], v[rows] = nw, nm, nv
    return w.detach(), m, v


@pytest.mark.parametrize("exact", [False, True], ids=["retr", "expmap"])
@pytest.mark.parametrize("c", CS)
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-9), (torch.float32, 2e-5)], ids=["f64", "f32"])
def test_trajectory_matches_geoopt_sparse_riemannian_adam(exact, c, dtype, atol):
    gen = torch.Generator().manual_seed(1234 + int(exact) + int(10 * c))
    w0, batches = random_points(40, 5, c, dtype, gen), pair_batches(40, 100, 64, gen)
    kw = dict(c=c, exact=exact, lr=0.03, betas=(0.9, 0.99), eps=1e-8)
    w_ref, m_ref, v_ref = run_geoopt(w0, batches, **kw)
    w, m, v = run_rows(w0, batches, **kw)
    assert (w - w0).abs().max() > 0.05, "the problem must move the points"
    assert_close(w, w_ref, atol=atol, name="weights")
    assert_close(m, m_ref, atol=atol, name="exp_avg")
    # geoopt keeps the row scalar broadcast over D columns; they are equal up to one rounding
    # (its vectorised add differs from the scalar tail loop by an FMA)
    assert_close(v_ref, v_ref[:, :1].expand_as(v_ref), rtol=1e-6 if dtype == torch.float32 else 1e-14,
                 name="geoopt exp_avg_sq columns")
    assert_close(v, v_ref[:, :1], rtol=max(atol, 1e-4 if dtype == torch.float32 else 0), name="exp_avg_sq")
    radius = 1 / c**0.5
    assert torch.isfinite(w).all() and (w.double().norm(dim=-1) < radius).all()


@pytest.mark.parametrize("exact", [False, True], ids=["retr", "expmap"])
def test_points_outside_the_ball_are_projected_not_nan(exact):
    c = 1.0
    w = torch.randn(6, 4, dtype=torch.float64)
    w = w / w.norm(dim=-1, keepdim=True) * torch.tensor([[0.5], [0.99], [1.0], [1.5], [10.0], [1e6]], dtype=torch.float64)
    g = torch.randn(6, 4, dtype=torch.float64)
    m = torch.zeros(6, 4, dtype=torch.float64)
    v = torch.zeros(6, 1, dtype=torch.float64)
    for t in range(1, 6):
        w, m, v = riemannian_adam_rows(w, g, m, v, t, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, c=c, exact=exact)
        assert torch.isfinite(w).all() and torch.isfinite(m).all() and torch.isfinite(v).all()
        assert (w.norm(dim=-1) <= P.max_norm(c, w.dtype) * (1 + 1e-12)).all()


def test_step_near_the_boundary_is_shorter_in_euclidean_terms():
    """The conformal factor matters: one step from |x| = 0.99 moves x less (Euclidean) than from 0.1,
    by about the ratio of conformal factors (the failure of Euclidean Adam plus clipping)."""
    d = 3
    dirn = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    g = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    moves = []
    for r in (0.1, 0.99):
        w = dirn * r
        nw, _, _ = riemannian_adam_rows(w, g, torch.zeros(1, d, dtype=torch.float64),
                                          torch.zeros(1, 1, dtype=torch.float64), 1,
                                          lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, c=1.0, exact=True)
        moves.append(float((nw - w).norm()))
    lam = lambda r: 2 / (1 - r * r)  # noqa: E731
    assert moves[1] / moves[0] == pytest.approx(lam(0.1) / lam(0.99), rel=1e-2)
