"""Every backend's row update (torch, numba, and Triton under TRITON_INTERPRET=1) against the pure
reference functions.

Each case runs several steps on a small table: gather random unique rows and their state records,
update them, scatter them back, so the records make round trips through the table between steps.
The torch path and the numba kernels apply the reference's operations in its order with torch's
own sqrt, so they must agree bitwise (atol 0). The Triton kernels compute in float32 like the
references. Tolerances:

- Euclidean float32: rtol 1e-6. The kernel's operations are torch.optim.SparseAdam's, but on CPU
  torch's vectorised ``sqrt`` is not correctly rounded (measured: 23 of 4096 values one ulp off
  numpy's) while the kernel's ``sqrt_rn`` is, so a few values differ by an ulp.
- Poincaré float32: max |Δ| <= 2e-6 and relative 1e-5 (same formulas, the kernel's ``tanh`` is a
  series / exp form and reductions are summed in another order).
- bfloat16 weights: relative RMS <= 2e-3 and max |Δ| <= 2 bf16 ulps; a value on a rounding
  boundary may round the other way and the difference is carried to later steps.
"""

import pytest
import torch

from optim.disk_sparse import numba_ops, poincare, torch_ops, triton_ops
from optim.disk_sparse.reference import riemannian_adam_rows, sparse_adam_rows
from optim.disk_sparse.triton_ops import adam_rows_, riemannian_adam_rows_
from tests import geo
from tests.utils import assert_close

ADAM_BACKENDS = {"torch": torch_ops.adam_rows_, "numba": numba_ops.adam_rows_, "triton": triton_ops.adam_rows_}
BALL_BACKENDS = {"torch": torch_ops.riemannian_adam_rows_, "numba": numba_ops.riemannian_adam_rows_,
                 "triton": triton_ops.riemannian_adam_rows_}


def run_table(n_rows, d, width, steps, dtype, update, seed, *, ball_c=None, g_fp32=False):
    """Drive ``update(w_rows, g_rows, state_rows, step)`` on a table; returns (W, S) after ``steps``."""
    gen = torch.Generator().manual_seed(seed)
    if ball_c is None:
        W = torch.randn(n_rows, d, generator=gen) * 0.5
    else:
        W = poincare.project(torch.randn(n_rows, d, generator=gen), c=1.0)
        W = W / W.norm(dim=-1, keepdim=True).clamp_min(1e-12) * torch.rand(n_rows, 1, generator=gen) * 0.9 / ball_c**0.5
    W = W.to(dtype)
    S = torch.zeros(n_rows, width, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    for step in range(1, steps + 1):
        k = max(1, (n_rows * 3) // 4)
        rows = torch.randperm(n_rows, generator=gen)[:k].sort().values
        g = torch.randn(k, d, generator=gen) * torch.rand(k, 1, generator=gen) * 3
        g = g if g_fp32 else g.to(dtype)
        w_rows, s_rows = W[rows].contiguous(), S[rows].contiguous()
        update(w_rows, g, s_rows, step)
        W[rows], S[rows] = w_rows, s_rows
    return W, S


def ref_adam(kw):
    def update(w, g, s, step):
        d = w.shape[1]
        nw, nm, nv = sparse_adam_rows(w.float(), g.float(), s[:, :d], s[:, d:], step, **kw)
        w.copy_(nw.to(w.dtype))
        s[:, :d], s[:, d:] = nm, nv
    return update


def ref_ball(kw):
    def update(w, g, s, step):
        d = w.shape[1]
        nw, nm, nv = riemannian_adam_rows(w.to(s.dtype), g.to(s.dtype), s[:, :d], s[:, d:], step, **kw)
        w.copy_(nw.to(w.dtype))
        s[:, :d], s[:, d:] = nm, nv
    return update


def geoopt_ball(kw):
    """The row update as ``geoopt.optim.SparseRiemannianAdam.step`` writes it, on geoopt's own ball
    (``PoincareBall`` or, with ``exact``, ``PoincareBallExact``), in the state's dtype: independent
    code for the same operations. The point is projected first, as the optimizers do."""
    manifold = geo.ball(kw["c"], kw["exact"])
    beta1, beta2, eps, lr = kw["beta1"], kw["beta2"], kw["eps"], kw["lr"]

    def update(w, g, s, step):
        d = w.shape[1]
        x = manifold.projx(w.to(s.dtype))
        r = manifold.egrad2rgrad(x, g.to(s.dtype))
        m = s[:, :d] * beta1 + (1 - beta1) * r
        v = s[:, d:] * beta2 + (1 - beta2) * manifold.component_inner(x, r)
        direction = (m / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt() + eps)
        x, m = manifold.retr_transp(x, -lr * direction, m)
        w.copy_(x.to(w.dtype))
        s[:, :d], s[:, d:] = m, v
    return update


def kernel(fn, kw, backend="triton"):
    """The row update of ``backend``; torch and numba take gradients in the state dtype (float32), as
    the optimizers hand them over, Triton also in the weights' dtype."""
    if backend == "triton":
        return lambda w, g, s, step: fn(w, g, s, step, **kw)
    return lambda w, g, s, step: fn(w, g.to(s.dtype), s, step, **kw)


SHAPES = [  # (rows in the table, D): widths 1, 3, 37, 127, 300; up to 2000 rows
    pytest.param(2, 1, id="2x1"),
    pytest.param(2000, 3, id="2000x3"),
    pytest.param(61, 37, id="61x37"),
    pytest.param(150, 127, id="150x127"),
    pytest.param(24, 300, id="24x300"),
]


def check(W, S, W_ref, S_ref, dtype, d, *, atol, rtol, state_rtol=None):
    if dtype == torch.float32:
        assert_close(W, W_ref, atol=atol, rtol=rtol, name="weights")
    else:
        ulp = W_ref.float().abs() * 2.0**-7
        assert_close(W.float(), W_ref.float(), atol=1e-6, rtol=2 * 2.0**-8, rel_rms_tol=2e-3, name="bf16 weights")
        assert float(((W.float() - W_ref.float()).abs() - 2 * ulp).max()) <= 1e-6
    state_rtol = max(rtol, 1e-5 if dtype != torch.float32 else 0) if state_rtol is None else state_rtol
    assert_close(S, S_ref, atol=atol, rtol=state_rtol, rel_rms_tol=1e-4,
                 name="state records")


ADAM_CASES = [  # numba takes float32/float64 weights only (the optimizers refuse it for others)
    pytest.param(b, dt, id=f"{b}-{name}") for b in ADAM_BACKENDS
    for dt, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")) if not (b == "numba" and name == "bf16")]


@pytest.mark.parametrize("n_rows,d", SHAPES)
@pytest.mark.parametrize("backend,dtype", ADAM_CASES)
def test_adam_rows_matches_reference(n_rows, d, backend, dtype):
    kw = dict(lr=3e-2, beta1=0.9, beta2=0.999, eps=1e-8, maximize=(d == 37))
    args = (n_rows, d, 2 * d, 3, dtype)
    g_fp32 = dtype == torch.bfloat16 and d == 127  # the fp32-gradient-with-bf16-weights path
    W, S = run_table(*args, kernel(ADAM_BACKENDS[backend], kw, backend), seed=d, g_fp32=g_fp32)
    W_ref, S_ref = run_table(*args, ref_adam(kw), seed=d, g_fp32=g_fp32)
    assert (S[:, :d] != 0).any()
    if backend == "triton":
        check(W, S, W_ref, S_ref, dtype, d, atol=1e-7, rtol=1e-6)
    else:
        assert_close(W, W_ref, atol=0.0, name=f"{backend} weights")
        assert_close(S, S_ref, atol=0.0, name=f"{backend} state records")


@pytest.mark.parametrize("n_rows,d", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("exact", [False, True], ids=["retr", "expmap"])
@pytest.mark.parametrize("backend", list(BALL_BACKENDS))
def test_riemannian_adam_rows_matches_reference(n_rows, d, dtype, exact, backend):
    if backend == "numba" and dtype == torch.bfloat16:
        pytest.skip("numba takes float32 and float64 weights (the optimizers refuse it for others)")
    c = 1.0 if d % 2 else 0.5
    # a large lr on the narrow tables takes the tanh of expmap through both of its branches
    kw = dict(lr=0.3 if d <= 3 else 3e-2, beta1=0.9, beta2=0.99, eps=1e-8, c=c, exact=exact)
    args = (n_rows, d, d + 1, 3, dtype)
    W, S = run_table(*args, kernel(BALL_BACKENDS[backend], kw, backend), seed=d, ball_c=c)
    W_ref, S_ref = run_table(*args, ref_ball(kw), seed=d, ball_c=c)
    if backend == "numba":  # float64 row sums in another order than the reference's
        check(W, S, W_ref, S_ref, dtype, d, atol=2e-6, rtol=1e-5)
    elif backend == "triton":
        # The ball's moment is transported along the new point: where a compiled fp32 rounding
        # (an FMA on the GPU) moves a bf16 weight by one ulp, that row's moment follows it to
        # within a bf16 ulp of relative error (seen on an H200, not under the interpreter).
        check(W, S, W_ref, S_ref, dtype, d, atol=2e-6, rtol=1e-5,
              state_rtol=2.0**-8 if dtype == torch.bfloat16 else None)
    else:  # the torch path is the reference in place: it is held against geoopt's ball instead
        W_geo, S_geo = run_table(*args, geoopt_ball(kw), seed=d, ball_c=c)
        check(W, S, W_geo, S_geo, dtype, d, atol=2e-6, rtol=1e-5)
    norms = W.double().norm(dim=-1)
    assert torch.isfinite(W.float()).all() and (norms < 1 / c**0.5).all()


@pytest.mark.parametrize("exact", [False, True], ids=["retr", "expmap"])
def test_the_balls_numba_kernel_in_float64_is_the_reference_to_rounding(exact):
    """In float64 the numba kernel agrees with the reference (and so with geoopt) to 1e-12, over
    steps that take the expmap's tanh through both of its branches."""
    kw = dict(lr=0.3, beta1=0.9, beta2=0.99, eps=1e-8, c=0.5, exact=exact)
    args = (300, 5, 6, 4, torch.float64)
    W, S = run_table(*args, kernel(numba_ops.riemannian_adam_rows_, kw, "numba"), seed=5, ball_c=0.5)
    W_ref, S_ref = run_table(*args, ref_ball(kw), seed=5, ball_c=0.5)
    assert_close(W, W_ref, atol=1e-12, rtol=1e-10, name="weights")
    assert_close(S, S_ref, atol=1e-12, rtol=1e-10, name="state records")


def test_kernels_write_only_the_given_rows():
    """Rows 1..2 of a table are updated through views; rows 0 and 3 and their records stay as they were.
    The ball's record is D+1 wide: v is one number per row, the same as the reference's (n, 1)."""
    d = 5
    W = torch.randn(4, d) * 0.1
    S = torch.rand(4, d + 1)
    W0, S0 = W.clone(), S.clone()
    g = torch.randn(2, d)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, c=1.0, exact=False)
    riemannian_adam_rows_(W[1:3], g, S[1:3], 1, **kw)
    w_ref, m_ref, v_ref = riemannian_adam_rows(W0[1:3], g, S0[1:3, :d], S0[1:3, d:], 1, **kw)
    assert torch.equal(W[[0, 3]], W0[[0, 3]]) and torch.equal(S[[0, 3]], S0[[0, 3]])
    assert_close(W[1:3], w_ref, atol=1e-7, rtol=1e-5, name="w")
    assert_close(S[1:3, :d], m_ref, atol=1e-7, rtol=1e-5, name="m")
    assert_close(S[1:3, d:], v_ref, rtol=1e-5, name="v")
    S2 = torch.rand(4, 2 * d)
    S20 = S2.clone()
    adam_rows_(W[2:3], g[:1], S2[2:3], 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    assert torch.equal(S2[[0, 1, 3]], S20[[0, 1, 3]]) and not torch.equal(S2[2], S20[2])
    empty = torch.empty(0, d)
    adam_rows_(empty, empty, torch.empty(0, 2 * d), 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)


@pytest.mark.parametrize("exact", [False, True], ids=["retr", "expmap"])
def test_riemannian_kernel_projects_points_outside_the_ball(exact):
    d = 4
    w = torch.randn(5, d)
    w = w / w.norm(dim=-1, keepdim=True) * torch.tensor([[0.5], [1.0], [1.5], [1e3], [1e15]])
    state = torch.zeros(5, d + 1)
    riemannian_adam_rows_(w, torch.randn(5, d), state, 1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, c=1.0, exact=exact)
    assert torch.isfinite(w).all() and torch.isfinite(state).all()
    assert (w.double().norm(dim=-1) < 1).all()


def test_bad_inputs_are_named():
    w, g = torch.zeros(3, 4), torch.zeros(3, 4)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)
    with pytest.raises(ValueError, match="state must be float32 records of shape"):
        adam_rows_(w, g, torch.zeros(3, 5), 1, **kw)
    with pytest.raises(ValueError, match=r"shape \(3, 5\)"):
        riemannian_adam_rows_(w, g, torch.zeros(3, 8), 1, **kw, c=1.0, exact=False)
    with pytest.raises(TypeError, match="backend='torch'"):
        adam_rows_(w.double(), g.double(), torch.zeros(3, 8), 1, **kw)
    with pytest.raises(ValueError, match="contiguous"):
        adam_rows_(torch.zeros(4, 3).t(), g, torch.zeros(3, 8), 1, **kw)
    with pytest.raises(ValueError, match="step must be >= 1"):
        adam_rows_(w, g, torch.zeros(3, 8), 0, **kw)
    with pytest.raises(ValueError, match="curvature c must be > 0"):
        riemannian_adam_rows_(w, g, torch.zeros(3, 5), 1, **kw, c=0.0, exact=False)


def test_the_numba_kernels_refuse_buffers_of_mismatched_dtype_or_shape():
    """The kernels index without bounds checks and call torch's sqrt on raw pointers: a mismatch at
    their boundary is a TypeError or ValueError, never a run over the buffers."""
    pytest.importorskip("numba")
    from optim.disk_sparse import numba_ops

    w = torch.randn(50, 8, dtype=torch.float64)
    idx, vals = torch.tensor([1, 2, 2]), torch.randn(3, 8, dtype=torch.float64)
    hyper = dict(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8)
    with pytest.raises(TypeError, match="one dtype"):
        numba_ops.adam_sparse_(w, idx, vals, torch.zeros(50, 16), 1, **hyper)
    with pytest.raises(ValueError, match=r"records \(50, 16\)"):
        numba_ops.adam_sparse_(w, idx, vals, torch.zeros(50, 8, dtype=torch.float64), 1, **hyper)
    with pytest.raises(ValueError, match=r"records \(50, 16\)"):
        numba_ops.adam_sparse_(w, idx, vals, torch.zeros(10, 16, dtype=torch.float64), 1, **hyper)
    with pytest.raises(ValueError, match="int64"):
        numba_ops.adam_sparse_(w, idx.int(), vals, torch.zeros(50, 16, dtype=torch.float64), 1, **hyper)
    with pytest.raises(TypeError, match="one dtype"):
        numba_ops.adam_rows_(w[:3], vals.float(), torch.zeros(3, 16, dtype=torch.float64), 1, **hyper)
    with pytest.raises(TypeError, match="one dtype"):
        numba_ops.riemannian_adam_rows_(w[:3] * 0.01, vals.float(), torch.zeros(3, 9, dtype=torch.float64), 1,
                                        c=1.0, exact=False, **hyper)
