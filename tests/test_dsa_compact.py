"""The compact state format of Disk Sparse Adam (``state_format="compact"``, ``compact.py``).

- The pure reference (``reference.compact_adam_rows``) against a float64 brute force written here
  element by element from the rule in its docstring: codes within one step of the brute force's
  (a value on a rounding boundary may go either way), everything else to float32 rounding.
- The fast paths (numba fused from the uncoalesced gradient, torch) against the reference run on
  coalesced gradients, over a trajectory: the same float32 operations in the same order except the
  row mean of g² (summed in float64 in another order) and sqrt (numba's is correctly rounded, torch's
  is MKL's), so the weights agree to 1e-6 relative and codes to one step.
- Files: a reopened compact file resumes exactly; files and state dicts of the other format are
  refused with errors that name the format; a state-dict round trip continues bitwise.
"""

import io
import math

import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam, DiskSparseRiemannianAdam
from optim.disk_sparse import compact, reference
from optim.disk_sparse.store import HEADER_BYTES, StateFileError
from tests.utils import assert_close

HYPER = dict(lr=0.02, beta1=0.9, beta2=0.999, eps=1e-8)


def _brute(w, g, q, s, v, step, lr, beta1, beta2, eps):
    """One compact lazy-Adam step in float64 Python arithmetic, row by row."""
    w2, q2, s2, v2 = [], [], [], []
    for i in range(len(w)):
        d = len(w[i])
        m = [q[i][j] * (s[i] / 127.0) + (g[i][j] - q[i][j] * (s[i] / 127.0)) * (1 - beta1) for j in range(d)]
        vi = v[i] + (sum(x * x for x in g[i]) / d - v[i]) * (1 - beta2)
        step_size = lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
        w2.append([w[i][j] - step_size * m[j] / (math.sqrt(vi) + eps) for j in range(d)])
        amax = max(abs(x) for x in m)
        q2.append([round(x * 127.0 / amax) if amax else 0 for x in m])
        s2.append(amax)
        v2.append(vi)
    return w2, q2, s2, v2


@pytest.mark.parametrize("d", [1, 3, 16])
def test_reference_matches_brute_force(d):
    n = 7
    w, g = torch.randn(n, d), torch.randn(n, d) * 0.1
    g[2] = 0.0  # a touched row with a zero gradient: its moments decay
    m0 = torch.randn(n, d) * 0.05
    q, s = reference.encode_rows(m0)
    s[3], q[3] = 0.0, 0  # a row whose stored m is zero
    v = torch.rand(n, 1) * 0.01
    out = reference.compact_adam_rows(w, g, q, s, v, 3, **HYPER)
    want = _brute(w.tolist(), g.tolist(), q.tolist(), s[:, 0].tolist(), v[:, 0].tolist(), 3, **HYPER)
    assert_close(out[0], torch.tensor(want[0]), rtol=1e-5, atol=1e-7, name="w")
    assert_close(out[1].double(), torch.tensor(want[1], dtype=torch.float64), atol=1.0, name="codes")
    assert_close(out[2][:, 0], torch.tensor(want[2]), rtol=1e-6, name="scale")
    assert_close(out[3][:, 0], torch.tensor(want[3]), rtol=1e-6, name="v")
    dec = reference.decode_rows(*reference.encode_rows(m0))
    assert_close(dec, m0, atol=float(m0.abs().max()) / 254 * 1.001, name="decode(encode(m))")


def _train(opt, emb, batches):
    for idx in batches:
        emb.weight.grad = None
        (emb(idx) * torch.linspace(-1, 1, emb.weight.shape[1])).sum().backward()
        opt.step()


def _batches(rows, n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, rows, (int(torch.randint(10, 60, (1,), generator=gen)),), generator=gen)
            for _ in range(n)]


def _reference_run(emb, batches, rows, d):
    """The reference on coalesced gradients, the state kept in the test."""
    w = emb.weight.detach().clone()
    q, s, v = torch.zeros(rows, d, dtype=torch.int8), torch.zeros(rows, 1), torch.zeros(rows, 1)
    lin = torch.linspace(-1, 1, d)
    for t, idx in enumerate(batches, 1):
        r, counts = torch.unique(idx, return_counts=True)
        g = counts[:, None].float() * lin
        w[r], q[r], s[r], v[r] = reference.compact_adam_rows(w[r], g, q[r], s[r], v[r], t, **HYPER)
    return w, q, s, v


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("d", [3, 64])
def test_fast_paths_follow_reference(backend, d):
    rows = 50
    torch.manual_seed(0)
    emb = nn.Embedding(rows, d, sparse=True)
    start = emb.weight.detach().clone()
    batches = _batches(rows, 15)
    with DiskSparseAdam(emb.parameters(), lr=HYPER["lr"], backend=backend, state_format="compact") as opt:
        _train(opt, emb, batches)
        st = opt.state_dict()["state"][0]
        got = [t.clone() for t in (emb.weight.detach(), st["exp_avg_codes"], st["exp_avg_scale"], st["exp_avg_sq"])]
        emb.weight.data.copy_(start)
        want = _reference_run(emb, batches, rows, d)
    assert_close(got[0], want[0], rtol=1e-6, atol=1e-7, name=f"{backend} weights")
    assert_close(got[1].double(), want[1].double(), atol=1.0, name=f"{backend} codes")
    assert (got[1] != want[1]).float().mean() < 0.01
    assert_close(got[2], want[2], rtol=1e-5, name=f"{backend} scale")
    assert_close(got[3], want[3], rtol=1e-6, name=f"{backend} v")


def test_record_size_and_file_size(tmp_path):
    for d in (1, 3, 64, 128, 129):
        assert d + 8 <= compact.record_bytes(d) <= d + 16
    emb = nn.Embedding(1000, 128, sparse=True)
    with DiskSparseAdam(emb.parameters(), state_dir=tmp_path, state_format="compact") as opt:
        assert opt.state_files()[0].nbytes == HEADER_BYTES + 1000 * 136


def test_reopened_compact_file_resumes_exactly(tmp_path):
    rows, d = 80, 12
    batches = _batches(rows, 10, seed=3)
    torch.manual_seed(5)
    emb_a = nn.Embedding(rows, d, sparse=True)
    emb_b = nn.Embedding(rows, d, sparse=True)
    emb_b.load_state_dict(emb_a.state_dict())
    with DiskSparseAdam(emb_a.parameters(), lr=0.01, state_dir=tmp_path / "a", state_format="compact") as opt:
        _train(opt, emb_a, batches)
        want = opt.state_dict()["state"][0]
        want = {k: v.clone() if torch.is_tensor(v) else v for k, v in want.items()}
    with DiskSparseAdam(emb_b.parameters(), lr=0.01, state_dir=tmp_path / "b", state_format="compact") as opt:
        _train(opt, emb_b, batches[:4])
    with pytest.raises(StateFileError, match="state_format='compact'"):
        DiskSparseAdam(emb_b.parameters(), lr=0.01, state_dir=tmp_path / "b", resume=True)
    with DiskSparseAdam(emb_b.parameters(), lr=0.01, state_dir=tmp_path / "b", state_format="compact",
                        resume=True) as opt:
        _train(opt, emb_b, batches[4:])
        got = opt.state_dict()["state"][0]
        assert got["step"] == want["step"] == 10
        for k in ("exp_avg_codes", "exp_avg_scale", "exp_avg_sq"):
            assert torch.equal(got[k], want[k]), k
    assert torch.equal(emb_a.weight, emb_b.weight)


def test_exact_file_refused_by_compact(tmp_path):
    emb = nn.Embedding(30, 4, sparse=True)
    DiskSparseAdam(emb.parameters(), state_dir=tmp_path).close()
    with pytest.raises(StateFileError, match="holds state_format='exact'.*uses state_format='compact'"):
        DiskSparseAdam(emb.parameters(), state_dir=tmp_path, resume=True, state_format="compact")
    with pytest.raises(ValueError, match="state_format"):
        DiskSparseAdam(emb.parameters(), state_format="int8")


def test_state_dict_round_trip_and_checks(tmp_path):
    rows, d = 60, 5
    batches = _batches(rows, 8, seed=4)
    torch.manual_seed(2)
    emb_a = nn.Embedding(rows, d, sparse=True)
    emb_b = nn.Embedding(rows, d, sparse=True)
    opt_a = DiskSparseAdam(emb_a.parameters(), lr=0.01, state_format="compact")
    _train(opt_a, emb_a, batches[:5])
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    emb_b.load_state_dict(emb_a.state_dict())
    opt_b = DiskSparseAdam(emb_b.parameters(), lr=0.01, state_format="compact")
    opt_b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), map_location="cpu"))
    _train(opt_a, emb_a, batches[5:])
    _train(opt_b, emb_b, batches[5:])
    assert torch.equal(emb_a.weight, emb_b.weight)
    sa, sb = opt_a.state_dict()["state"][0], opt_b.state_dict()["state"][0]
    for k in ("exp_avg_codes", "exp_avg_scale", "exp_avg_sq"):
        assert torch.equal(sa[k], sb[k]), k
    good = opt_a.state_dict()
    sparse_adam = torch.optim.SparseAdam(list(emb_b.parameters()))
    with pytest.raises(KeyError, match="state_format='compact'"):
        opt_b.load_state_dict(sparse_adam.state_dict() | {"state": {0: {"step": 1, "exp_avg": torch.zeros(rows, d),
                                                                         "exp_avg_sq": torch.zeros(rows, d)}}})
    bad = {k: v for k, v in good["state"][0].items()}
    for key, val, err in (("exp_avg_codes", bad["exp_avg_codes"].float(), TypeError),
                          ("exp_avg_codes", torch.full((rows, d), -128, dtype=torch.int8), ValueError),
                          ("exp_avg_scale", -bad["exp_avg_scale"] - 1, ValueError),
                          ("exp_avg_sq", torch.zeros(rows, d), ValueError)):
        before = opt_b.state_dict()["state"][0]["exp_avg_codes"].clone()
        with pytest.raises(err):
            opt_b.load_state_dict(dict(good, state={0: dict(bad, **{key: val})}))
        assert torch.equal(opt_b.state_dict()["state"][0]["exp_avg_codes"], before)  # nothing written
    opt_a.close()
    opt_b.close()


def test_refusals():
    emb = nn.Embedding(20, 4, sparse=True)
    with pytest.raises(ValueError, match="float64"):
        DiskSparseAdam(nn.Embedding(20, 4, sparse=True, dtype=torch.float64).parameters(), state_format="compact")
    with pytest.raises(ValueError, match="Triton"):
        DiskSparseAdam(emb.parameters(), backend="triton", state_format="compact")
    with DiskSparseAdam(emb.parameters(), state_format="compact") as opt:
        emb.weight.grad = torch.randn(20, 4).to_sparse()
        with pytest.raises(RuntimeError, match="row-sparse"):
            opt.step()


def test_riemannian_compact_follows_reference():
    rows, d = 40, 5
    torch.manual_seed(1)
    emb = nn.Embedding(rows, d, sparse=True)
    with torch.no_grad():
        emb.weight.mul_(0.05)
    start = emb.weight.detach().clone()
    batches = _batches(rows, 10, seed=6)
    hyper = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, c=1.0, exact=False)
    with DiskSparseRiemannianAdam(emb.parameters(), lr=0.01, state_format="compact") as opt:
        _train(opt, emb, batches)
        st = opt.state_dict()["state"][0]
        assert st["exp_avg_codes"].shape == (rows, d) and st["exp_avg_sq"].shape == (rows, 1)
    w, q, s, v = start.clone(), torch.zeros(rows, d, dtype=torch.int8), torch.zeros(rows, 1), torch.zeros(rows, 1)
    lin = torch.linspace(-1, 1, d)
    for t, idx in enumerate(batches, 1):
        r, counts = torch.unique(idx, return_counts=True)
        w[r], q[r], s[r], v[r] = reference.compact_riemannian_adam_rows(
            w[r], counts[:, None].float() * lin, q[r], s[r], v[r], t, **hyper)
    assert_close(emb.weight, w, rtol=1e-6, atol=1e-7, name="ball weights")
    assert_close(st["exp_avg_codes"].double(), q.double(), atol=1.0, name="ball codes")
    assert_close(st["exp_avg_sq"], v, rtol=1e-6, name="ball v")


def _compact_after(backend, grads, tmp_path):
    """A compact DiskSparseAdam (float32 table 8 x 6) stepped with the given (rows, values) sparse
    gradients; returns its state dict (copies) and the optimizer, open."""
    emb = torch.nn.Embedding(8, 6, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.linspace(-1, 1, 48).view(8, 6))
    opt = DiskSparseAdam(emb.parameters(), lr=1e-2, state_format="compact", backend=backend,
                         state_dir=tmp_path / backend)
    for rows, vals in grads:
        emb.weight.grad = torch.sparse_coo_tensor(torch.tensor([rows]), vals, (8, 6))
        opt.step()
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state_dict()["state"][0].items()}, opt


def test_non_finite_and_tiny_rows_are_stored_alike_on_every_backend_and_load(tmp_path):
    """A row whose first moment holds NaN or inf stores codes 0 and a scale of NaN or inf, the same on
    every backend, and the optimizer's own state dict loads back; a row whose max |m| is so small that
    127 / s overflows gets the reference's codes (m / s * 127), not zeros or +-127 everywhere."""
    g = torch.randn(4, 6)
    bad = g.clone()
    bad[1, 2], bad[2, 0] = float("nan"), float("inf")
    tiny = torch.tensor([[3e-39, -1e-39, 2e-39, 0.0, 1e-39, -3e-39]])
    grads = [([0, 1, 2, 3], g), ([0, 1, 2, 3], bad), ([6], tiny)]
    states = {}
    for backend in ("torch", "numba"):
        states[backend], opt = _compact_after(backend, grads, tmp_path)
        st = states[backend]
        assert bool(st["exp_avg_scale"][1].isnan()) and bool(st["exp_avg_scale"][2].isinf())
        assert not st["exp_avg_codes"][1:3].any()
        twin = DiskSparseAdam(torch.nn.Embedding(8, 6, sparse=True).parameters(), state_format="compact",
                              backend=backend, state_dir=tmp_path / f"{backend}-twin")
        twin.load_state_dict(opt.state_dict())  # the optimizer's own state dict always loads
        twin.close()
        opt.close()
    for key in ("exp_avg_scale", "exp_avg_sq", "exp_avg_codes"):
        a, b = states["torch"][key], states["numba"][key]
        assert torch.equal(a.isnan(), b.isnan()), key
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), key
    m6 = (1 - 0.9) * tiny.float()  # row 6's first moment after its first step
    q_ref, s_ref = reference.encode_rows(m6)
    assert torch.equal(states["numba"]["exp_avg_codes"][6:7], q_ref) and q_ref.abs().max() == 127
    assert torch.equal(states["numba"]["exp_avg_scale"][6:7], s_ref)


@pytest.mark.parametrize("exact", [False, True], ids=["retr", "expmap"])
@pytest.mark.parametrize("n_rows,d", [(3, 1), (200, 7), (64, 128)], ids=["3x1", "200x7", "64x128"])
def test_compact_ball_on_numba_is_the_reference_to_rounding(n_rows, d, exact):
    """numba's compact ball kernel against ``reference.compact_riemannian_adam_rows`` over 4 steps:
    weights to 2e-6, scales and v to 1e-5 relative, codes within one step (a value on a rounding
    boundary may land on either side after float64 row math)."""
    from optim.disk_sparse import numba_ops

    gen = torch.Generator().manual_seed(d)
    w = torch.randn(n_rows, d, generator=gen) * 0.05
    st = torch.zeros(n_rows, compact.record_bytes(d), dtype=torch.uint8)
    w_ref = w.clone()
    q_ref = torch.zeros(n_rows, d, dtype=torch.int8)
    s_ref, v_ref = torch.zeros(n_rows, 1), torch.zeros(n_rows, 1)
    kw = dict(lr=0.2, beta1=0.9, beta2=0.99, eps=1e-8, c=0.7, exact=exact)
    for step in range(1, 5):
        g = torch.randn(n_rows, d, generator=gen)
        numba_ops.compact_riemannian_adam_rows_(w, g, st, step, **kw)
        w_ref, q_ref, s_ref, v_ref = reference.compact_riemannian_adam_rows(w_ref, g, q_ref, s_ref, v_ref, step, **kw)
        s, v, q = compact.views(st, d)
        assert_close(w, w_ref, atol=2e-6, rtol=1e-5, name="weights")
        assert_close(s, s_ref, atol=0.0, rtol=1e-5, name="scales")
        assert_close(v, v_ref, atol=0.0, rtol=1e-5, name="v")
        assert int((q.int() - q_ref.int()).abs().max()) <= 1
        w_ref, q_ref, s_ref, v_ref = w.clone(), q.clone(), s.clone(), v.clone()  # from the same state on


def test_the_compact_ball_takes_numba_on_cpu_and_follows_torch(tmp_path):
    torch.manual_seed(0)
    runs = {}
    for backend in ("torch", "auto"):
        emb = nn.Embedding(300, 16, sparse=True)
        with torch.no_grad():
            emb.weight.copy_(torch.randn(300, 16, generator=torch.Generator().manual_seed(1)) * 0.05)
        opt = DiskSparseRiemannianAdam(emb.parameters(), lr=0.05, state_format="compact", backend=backend,
                                       state_dir=tmp_path / backend)
        gen = torch.Generator().manual_seed(2)
        for _ in range(10):
            opt.zero_grad()
            emb(torch.randint(0, 300, (64,), generator=gen)).pow(2).sum().backward()
            opt.step()
        runs[backend] = (emb.weight.detach().clone(), opt.backend_of(emb.weight))
        opt.close()
    assert runs["auto"][1] == "numba" and runs["torch"][1] == "torch"
    assert_close(runs["auto"][0], runs["torch"][0], atol=1e-5, rtol=1e-4, name="weights after 10 steps")
