"""DiskSparseRiemannianAdam against geoopt's SparseRiemannianAdam, and the Triton path of both Disk
Sparse Adam optimizers against their torch path (Triton under TRITON_INTERPRET=1).

geoopt needs a ManifoldParameter; ours takes the plain ``nn.Embedding(sparse=True)`` weight and keeps
its moments on disk. Both see the same sparse gradients (same hyperbolic-distance loss, same batches
with heavy duplicate indices). Tolerances after 100 steps: float64 max |Δ| <= 1e-9 (measured 1e-15:
the update is geoopt's operation order; duplicates may be summed in another order), float32 2e-5
(measured 8e-7 on weights, 2e-6 on moments: rounding differences are carried along the trajectory).
"""

import os

import pytest
import torch
import torch.nn as nn

import optim
from optim import DiskSparseRiemannianAdam
from tests.geo import ball, distance_loss, pair_batches, random_points, run_geoopt
from tests.utils import assert_close

CS = [pytest.param(1.0, id="c=1"), pytest.param(0.5, id="c=0.5")]


def run_ours(w0, batches, *, c, exact, lr, betas, eps):
    """Train an nn.Embedding started at ``w0``: (weights, exp_avg, exp_avg_sq)."""
    M = ball(c, exact)
    emb = nn.Embedding(*w0.shape, sparse=True, dtype=w0.dtype)
    with torch.no_grad():
        emb.weight.copy_(w0)
    opt = DiskSparseRiemannianAdam(emb.parameters(), lr=lr, betas=betas, eps=eps, c=c, exact=exact, backend="torch")
    for pairs, target in batches:
        opt.zero_grad()
        distance_loss(emb(pairs), target, M.dist).backward()
        opt.step()
    st = opt.state_dict()["state"][0]
    m, v = st["exp_avg"].clone(), st["exp_avg_sq"].clone()
    opt.close()
    return emb.weight.detach().clone(), m, v


@pytest.mark.parametrize("exact", [False, True], ids=["retr", "expmap"])
@pytest.mark.parametrize("c", CS)
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-9), (torch.float32, 2e-5)], ids=["f64", "f32"])
def test_trajectory_matches_geoopt(exact, c, dtype, atol):
    gen = torch.Generator().manual_seed(7 + int(exact) + int(4 * c))
    n, d = 40, 5
    w0 = random_points(n, d, c, dtype, gen)
    batches = pair_batches(n, 100, 64, gen)
    kw = dict(c=c, exact=exact, lr=0.03, betas=(0.9, 0.99), eps=1e-8)
    w_ref, m_ref, v_ref = run_geoopt(w0, batches, **kw)
    w, m, v = run_ours(w0, batches, **kw)
    assert float((w - w0).abs().max()) > 0.05, "the problem must move the points"
    assert_close(w, w_ref, atol=atol, name="weights")
    assert_close(m, m_ref, atol=atol, name="exp_avg")
    assert v.shape == (n, 1), "the ball's second moment is one number per row"
    assert_close(v, v_ref[:, :1], rtol=max(atol, 1e-4 if dtype == torch.float32 else 0), name="exp_avg_sq")
    assert torch.isfinite(w).all() and (w.double().norm(dim=-1) < 1 / c**0.5).all()


def test_point_pushed_outside_the_ball_is_projected():
    """A user may nudge a row outside the ball; the next step projects it first instead of NaN."""
    emb = nn.Embedding(4, 3, sparse=True, dtype=torch.float64)
    with torch.no_grad():
        emb.weight.copy_(torch.tensor([[0.1, 0, 0], [0, 0.99, 0], [0, 0, 1.0], [3.0, 4.0, 0]], dtype=torch.float64))
    opt = DiskSparseRiemannianAdam(emb.parameters(), lr=0.1, c=1.0)
    for _ in range(3):
        opt.zero_grad()
        emb(torch.arange(4)).sum().backward()
        opt.step()
    opt.close()
    w = emb.weight.detach()
    assert torch.isfinite(w).all() and (w.norm(dim=-1) < 1).all()


def test_record_on_disk_is_d_plus_one_values_per_row(tmp_path):
    """The ball's row record is [m (D) | v (1)]: D-1 values per row fewer than the Euclidean [m | v]."""
    n, d = 1000, 16
    sizes = {}
    for name, cls in [("ball", DiskSparseRiemannianAdam), ("adam", optim.DiskSparseAdam)]:
        emb = nn.Embedding(n, d, sparse=True)
        with torch.no_grad():
            emb.weight.mul_(0.01)
        opt = cls(emb.parameters(), state_dir=tmp_path / name)
        emb(torch.tensor([1, 2, 2])).sum().backward()
        opt.step()
        opt.close()
        files = [f for f in os.listdir(tmp_path / name)]
        assert len(files) == 1, files
        sizes[name] = os.path.getsize(tmp_path / name / files[0])
    assert sizes["adam"] - sizes["ball"] == n * (2 * d - (d + 1)) * 4
    from optim.disk_sparse.store import HEADER_BYTES

    assert sizes["ball"] == HEADER_BYTES + n * (d + 1) * 4


# --- Triton path vs torch path, both optimizers (interpreter: few, small cases) -------------------
CASES = [  # (rows in the table, D, lookups per step): widths 1, 3, 37, 127, 300; 1..2000 rows
    pytest.param(1, 1, 3, id="1x1"),
    pytest.param(2000, 3, 1500, id="2000x3"),
    pytest.param(50, 37, 80, id="50x37"),
    pytest.param(40, 127, 30, id="40x127"),
    pytest.param(9, 300, 12, id="9x300"),
]


def train_both_ways(cls, w0, batches, loss_fn, kw, backend):
    """4 steps on ``backend`` (state-dict round trips on each backend: tests/test_protocol.py)."""
    emb = nn.Embedding(*w0.shape, sparse=True, dtype=w0.dtype)
    with torch.no_grad():
        emb.weight.copy_(w0)
    opt = cls(emb.parameters(), **kw, backend=backend)
    for idx in batches:
        opt.zero_grad()
        loss_fn(emb(idx).float()).backward()
        opt.step()
    st = opt.state_dict()["state"][0]
    state = torch.cat([st["exp_avg"], st["exp_avg_sq"]], dim=1).clone()
    opt.close()
    return emb.weight.detach().float(), state


@pytest.mark.parametrize("n,d,batch", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("which", ["adam", "ball"])
def test_triton_backend_matches_torch_backend(n, d, batch, dtype, which, monkeypatch):
    from optim.disk_sparse import triton_ops

    calls = []
    for name in ("adam_rows_", "riemannian_adam_rows_"):  # count launches: no silent torch fallback
        fn = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name, lambda *a, _fn=fn, _n=name, **k: (calls.append(_n), _fn(*a, **k))[1])
    gen = torch.Generator().manual_seed(n * 1000 + d)
    if which == "adam":
        cls, kw = optim.DiskSparseAdam, dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
        w0 = (torch.randn(n, d, generator=gen) * 0.3).to(dtype)
        coef = torch.randn(d, generator=gen)
        loss_fn = lambda x: ((x - coef) ** 2 * coef.abs()).sum()  # noqa: E731
    else:
        c = 0.5 if d % 2 == 0 else 1.0
        exact = (d in (3, 127)) != (dtype == torch.bfloat16)  # both modes over the shapes and dtypes
        cls, kw = DiskSparseRiemannianAdam, dict(lr=3e-2, betas=(0.9, 0.99), eps=1e-8, c=c, exact=exact)
        w0 = random_points(n, d, c, torch.float32, gen).to(dtype)
        anchor = random_points(1, d, c, torch.float64, gen)
        M = ball(c)
        loss_fn = lambda x: ((M.dist(x.double(), anchor) - 1.0) ** 2).sum()  # noqa: E731
    batches = [torch.randint(0, n, (batch,), generator=gen) for _ in range(4)]
    w_t, s_t = train_both_ways(cls, w0, batches, loss_fn, kw, "torch")
    assert not calls
    w_k, s_k = train_both_ways(cls, w0, batches, loss_fn, kw, "triton")
    assert calls == ["adam_rows_" if which == "adam" else "riemannian_adam_rows_"] * len(batches)
    assert s_t.shape == (n, 2 * d if which == "adam" else d + 1)
    if dtype == torch.float32:
        assert_close(w_k, w_t, atol=2e-6, rtol=1e-5, name="weights")
    else:
        assert_close(w_k, w_t, atol=1e-6, rtol=2 * 2.0**-8, rel_rms_tol=2e-3, name="bf16 weights")
    assert_close(s_k, s_t, atol=2e-6, rtol=1e-5 if dtype == torch.float32 else 2e-2, rel_rms_tol=2e-3,
                 name="state records")
    if which != "adam":
        assert (w_k.double().norm(dim=-1) < 1 / kw["c"] ** 0.5).all()


@pytest.mark.parametrize("c", [1e38, 1e300, 1e-300, 1e16])
def test_a_curvature_outside_the_finite_range_is_refused(tmp_path, c):
    """c = 1e38 or 1e300 was accepted, then gave non-finite rows or an OverflowError: refused at
    construction, in a new group, in a loaded state dict and when a group is edited in place."""
    emb = nn.Embedding(10, 4, sparse=True)
    with pytest.raises(ValueError, match=r"c \(the ball's curvature.*\[1e-15, 1e\+15\]"):
        DiskSparseRiemannianAdam(emb.parameters(), c=c)
    opt = DiskSparseRiemannianAdam([emb.weight], c=1.0)
    with pytest.raises(ValueError, match="must be a number in"):
        opt.add_param_group({"params": [nn.Embedding(10, 4, sparse=True).weight], "c": c})
    sd = opt.state_dict()
    sd["param_groups"][0]["c"] = c
    with pytest.raises(ValueError, match="must be a number in"):
        opt.load_state_dict(sd)
    opt.param_groups[0]["c"] = c
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(ValueError, match="must be a number in"):
        opt.step()
    opt.close()


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("c", [1e-15, 1e15])
def test_curvatures_at_the_ends_of_the_range_train_finite_float32_rows(backend, c):
    """The float32 update stays finite and inside the ball at both ends of ``CURVATURE_RANGE``."""
    if backend == "numba":
        pytest.importorskip("numba")
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(40, 8, generator=gen)
    w0 *= torch.rand(40, 1, generator=gen) * 0.99 / c**0.5 / w0.norm(dim=1, keepdim=True)
    emb = nn.Embedding(40, 8, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(w0)
    opt = DiskSparseRiemannianAdam(emb.parameters(), lr=0.01 / c**0.5, c=c, backend=backend)
    for _ in range(3):
        opt.zero_grad()
        (emb(torch.randint(0, 40, (64,), generator=gen)) * torch.randn(64, 8, generator=gen)).sum().backward()
        opt.step()
    st = opt.state_dict()["state"][0]
    assert torch.isfinite(emb.weight).all() and (emb.weight.double().norm(dim=1) < 1 / c**0.5).all()
    assert torch.isfinite(st["exp_avg"]).all() and torch.isfinite(st["exp_avg_sq"]).all()
    assert not torch.equal(emb.weight, w0)
    opt.close()
