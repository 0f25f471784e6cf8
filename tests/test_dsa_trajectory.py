"""DiskSparseAdam against torch.optim.SparseAdam on fresh random problems.

Both optimizers see the same model copies and the same batches; after 200 steps the weights and both
moments must agree to max |Δ| <= 1e-6. The torch and numba paths in fact agree bitwise (the numba
path sums duplicates in coalesce's order and takes sqrt from torch, see numba_ops); Triton's
correctly rounded sqrt differs from torch's CPU sqrt by an ulp here and there.
"""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam
from optim.disk_sparse.reference import sparse_adam_rows
from tests.utils import assert_close

STEPS = 200



class TwoTables(nn.Module):
    """A KG-style scorer: entity table + relation bag, heavy duplicate indices."""

    def __init__(self, n_ent, n_rel, dim, dtype):
        super().__init__()
        self.ent = nn.Embedding(n_ent, dim, sparse=True, dtype=dtype)
        self.rel = nn.EmbeddingBag(n_rel, dim, mode="mean", sparse=True, dtype=dtype)

    def forward(self, heads, tails, rel_idx, rel_offsets, target):
        h, t = self.ent(heads), self.ent(tails)
        r = self.rel(rel_idx, rel_offsets)
        score = (h * r * t).sum(-1)
        return ((score - target) ** 2).mean() + 1e-2 * (h ** 2).mean()


def _batch(gen, n_ent, n_rel, batch, dtype):
    # Indices from a small hot range plus the whole table: many duplicates, some singletons.
    hot = torch.randint(0, max(n_ent // 20, 2), (batch,), generator=gen)
    cold = torch.randint(0, n_ent, (batch,), generator=gen)
    heads = torch.where(torch.rand(batch, generator=gen) < 0.7, hot, cold)
    tails = torch.randint(0, n_ent, (batch,), generator=gen)
    bag = torch.randint(1, 4, (batch,), generator=gen)
    rel_idx = torch.randint(0, n_rel, (int(bag.sum()),), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), bag.cumsum(0)[:-1]])
    target = torch.randn(batch, generator=gen, dtype=dtype)
    return heads, tails, rel_idx, offsets, target


def _make(kind, model, **kw):
    groups = [{"params": [model.ent.weight]}, {"params": [model.rel.weight], "lr": kw.pop("lr2")}]
    if kind == "ref":
        return torch.optim.SparseAdam(groups, **kw)
    return DiskSparseAdam(groups, **kw)


@pytest.mark.parametrize("backend,dtype,maximize", [
    pytest.param(backend, dtype, maximize, id=f"{backend}-{name}")
    for backend in ("auto", "torch", "numba", "triton")
    for dtype, maximize, name in ((torch.float32, False, "fp32"), (torch.float32, True, "fp32-maximize"),
                                  (torch.float64, False, "fp64"))
    if not (backend == "triton" and dtype == torch.float64)  # Triton takes float32/bfloat16 weights
])
def test_trajectory_matches_sparse_adam(backend, dtype, maximize, tmp_path):
    n_ent, n_rel, dim, batch = 257, 11, 37, 96
    ref_model = TwoTables(n_ent, n_rel, dim, dtype)
    model = copy.deepcopy(ref_model)
    kw = dict(lr=3e-2, lr2=1e-2, betas=(0.8, 0.99), eps=1e-6, maximize=maximize)
    ref_opt = _make("ref", ref_model, **dict(kw))
    opt = _make("dsa", model, **dict(kw), state_dir=tmp_path / "state", backend=backend)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=50, gamma=0.5) for o in (ref_opt, opt)]
    gen = torch.Generator().manual_seed(1234)
    sign = -1.0 if maximize else 1.0
    for _ in range(STEPS):
        b = _batch(gen, n_ent, n_rel, batch, dtype)
        for m, o, s in ((ref_model, ref_opt, scheds[0]), (model, opt, scheds[1])):
            o.zero_grad()
            (sign * m(*b)).backward()
            o.step()
            s.step()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 3e-2 / 16
    sd = opt.state_dict()["state"]
    for k, p_ref, p in ((0, ref_model.ent.weight, model.ent.weight), (1, ref_model.rel.weight, model.rel.weight)):
        assert_close(p, p_ref, atol=1e-6, name=f"weight {k}")
        st = ref_opt.state[p_ref]
        assert_close(sd[k]["exp_avg"], st["exp_avg"], atol=1e-6, name=f"exp_avg {k}")
        assert_close(sd[k]["exp_avg_sq"], st["exp_avg_sq"], atol=1e-6, name=f"exp_avg_sq {k}")
        assert int(sd[k]["step"]) == st["step"] == STEPS
    opt.close()


def test_reference_rows_match_sparse_adam():
    """The pure reference applied to gathered rows reproduces SparseAdam (the fast paths' oracle)."""
    n, dim = 120, 19
    emb = nn.Embedding(n, dim, sparse=True)
    ref_opt = torch.optim.SparseAdam(emb.parameters(), lr=5e-2, betas=(0.7, 0.95), eps=1e-7)
    w = emb.weight.detach().clone()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for t in range(1, 61):
        idx = torch.randint(0, n // 3, (300,))
        ref_opt.zero_grad()
        (emb(idx) * torch.randn(300, dim)).sum().backward()
        g = emb.weight.grad.coalesce()
        rows, vals = g.indices()[0], g.values()
        w[rows], m[rows], v[rows] = sparse_adam_rows(w[rows], vals, m[rows], v[rows], t, lr=5e-2, beta1=0.7,
                                                     beta2=0.95, eps=1e-7)
        ref_opt.step()
    assert_close(w, emb.weight, atol=1e-6, name="weight")
    assert_close(m, ref_opt.state[emb.weight]["exp_avg"], atol=1e-6, name="exp_avg")
    assert_close(v, ref_opt.state[emb.weight]["exp_avg_sq"], atol=1e-6, name="exp_avg_sq")


@pytest.mark.parametrize("backend", ["auto", "torch", "numba", "triton"])
def test_only_gradient_rows_change(backend):
    emb = nn.Embedding(1000, 8, sparse=True)
    before = emb.weight.detach().clone()
    with DiskSparseAdam(emb.parameters(), lr=0.1, backend=backend) as opt:
        idx = torch.tensor([3, 999, 3, 500])
        emb(idx).sum().backward()
        opt.step()
        rec = opt.state_dict()["state"][0]
        touched = torch.zeros(1000, dtype=torch.bool)
        touched[idx] = True
        assert torch.equal(emb.weight[~touched], before[~touched])
        assert (emb.weight[touched] != before[touched]).all()
        assert (rec["exp_avg"][~touched] == 0).all() and (rec["exp_avg_sq"][~touched] == 0).all()
        assert (rec["exp_avg_sq"][touched] > 0).all()


def test_bfloat16_weights_keep_float32_state():
    """Low-precision tables: state is float32 on disk; the update matches fp32 SparseAdam rounded."""
    emb = nn.Embedding(64, 16, sparse=True, dtype=torch.bfloat16)
    ref = nn.Embedding(64, 16, sparse=True)
    ref.weight.data.copy_(emb.weight.data.float())
    opt = DiskSparseAdam(emb.parameters(), lr=1e-2, backend="torch")
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=1e-2)
    idx = torch.randint(0, 64, (40,))
    for m, o in ((emb, opt), (ref, ref_opt)):
        m(idx).float().sum().backward()
        o.step()
    assert opt.state_dict()["state"][0]["exp_avg"].dtype == torch.float32
    assert_close(emb.weight.float(), ref.weight.to(torch.bfloat16).float(), atol=0, name="bf16 weight")
    opt.close()


def _step_each(runs, idx, target):
    """One step of every (embedding, optimizer, torch threads) on the batch ``idx`` with a squared
    error to ``target``; the caller restores torch's thread count."""
    for emb, opt, n_threads in runs:
        torch.set_num_threads(n_threads)
        opt.zero_grad()
        ((emb(idx) - target) ** 2).mean().backward()
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_cpu_path_on_two_threads_matches_sparse_adam(dtype, tmp_path):
    """Enough unique rows per step (>= 256) that the fused kernels split them over two threads:
    the result must not depend on the thread count and must still agree with SparseAdam."""
    emb_ref = nn.Embedding(2000, 24, sparse=True, dtype=dtype)
    emb_two, emb_one = copy.deepcopy(emb_ref), copy.deepcopy(emb_ref)
    kw = dict(lr=2e-2, betas=(0.85, 0.99), eps=1e-7)
    ref = torch.optim.SparseAdam(emb_ref.parameters(), **kw)
    two = DiskSparseAdam(emb_two.parameters(), **kw, state_dir=tmp_path / "two")
    one = DiskSparseAdam(emb_one.parameters(), **kw, state_dir=tmp_path / "one")
    gen = torch.Generator().manual_seed(7)
    threads = torch.get_num_threads()
    try:
        for _ in range(30):
            idx = torch.cat([torch.randint(0, 2000, (600,), generator=gen),
                             torch.randint(0, 40, (300,), generator=gen)])  # duplicates too
            target = torch.randn(idx.numel(), 24, generator=gen, dtype=dtype)
            _step_each(((emb_ref, ref, 2), (emb_two, two, 2), (emb_one, one, 1)), idx, target)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(emb_two.weight, emb_one.weight)
    assert_close(emb_two.weight, emb_ref.weight, atol=1e-6, name="weight, 2 threads")
    st = two.state_dict()["state"][0]
    assert_close(st["exp_avg_sq"], ref.state[emb_ref.weight]["exp_avg_sq"], atol=1e-6, name="exp_avg_sq")
    two.close()
    one.close()


def test_sorted_rows_radix_and_coalesce_order():
    """The radix path sorts like Tensor.sort (stable among equal rows); with a row three times it
    falls back to Tensor.sort's own permutation, the order coalesce sums in."""
    from optim.disk_sparse import _numba_kernels as K
    from optim.disk_sparse.numba_ops import _scratch, _sorted_rows

    gen = torch.Generator().manual_seed(3)
    for n_table, idx in (
        (10_000, torch.randperm(10_000, generator=gen)[:900]),                       # unique rows
        (10_000, torch.randperm(10_000, generator=gen)[:500].repeat(2)),             # each row twice
        (3_000_000, torch.randint(0, 3_000_000, (1500,), generator=gen)),           # three radix passes
        (50, torch.randint(0, 50, (700,), generator=gen)),                          # rows many times
    ):
        starts, _, _, _, bufs, counts = _scratch(idx.numel(), 4, torch.float32)
        keys, perm, n_rows = _sorted_rows(K, idx, n_table, bufs, counts, starts)
        s, p = idx.sort()
        assert np.array_equal(keys, s.numpy()) and n_rows == torch.unique(idx).numel()
        assert np.array_equal(idx.numpy()[perm], s.numpy())
        if torch.unique(idx, return_counts=True)[1].max() >= 3:
            assert np.array_equal(perm, p.numpy())  # coalesce's order
        else:
            assert np.array_equal(perm, np.argsort(idx.numpy(), kind="stable"))
    with pytest.raises(IndexError, match=r"\[0, 50\)"):
        starts, _, _, _, bufs, counts = _scratch(3, 4, torch.float32)
        _sorted_rows(K, torch.tensor([3, 50, 1]), 50, bufs, counts, starts)


def test_rows_at_most_twice_agree_bitwise_with_sparse_adam(tmp_path):
    """The radix path (no row three times) on the seed's shape of problem: bitwise SparseAdam."""
    emb_ref = nn.Embedding(20_000, 32, sparse=True)
    emb = copy.deepcopy(emb_ref)
    ref = torch.optim.SparseAdam(emb_ref.parameters(), lr=1e-2)
    opt = DiskSparseAdam(emb.parameters(), lr=1e-2, state_dir=tmp_path)
    gen = torch.Generator().manual_seed(11)
    for _ in range(40):
        rows = torch.randperm(20_000, generator=gen)[:700]
        idx = torch.cat([rows, rows[:300]])[torch.randperm(1000, generator=gen)]
        target = torch.randn(1000, 32, generator=gen)
        _step_each(((emb_ref, ref, 1), (emb, opt, 1)), idx, target)
    assert torch.equal(emb.weight, emb_ref.weight)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg_sq"], ref.state[emb_ref.weight]["exp_avg_sq"])
    opt.close()


def test_fused_pass_without_bitwise_stays_within_tolerance_of_sparse_adam(tmp_path):
    """bitwise=False: one fused pass with a correctly rounded sqrt; within 1e-6 of
    SparseAdam after 200 steps (with duplicates), and the same bits at one and two threads."""
    emb_ref = nn.Embedding(3000, 24, sparse=True)
    emb_one, emb_two = copy.deepcopy(emb_ref), copy.deepcopy(emb_ref)
    kw = dict(lr=1e-2, betas=(0.8, 0.99))
    ref = torch.optim.SparseAdam(emb_ref.parameters(), **kw)
    one = DiskSparseAdam(emb_one.parameters(), **kw, state_dir=tmp_path / "one", bitwise=False)
    two = DiskSparseAdam(emb_two.parameters(), **kw, state_dir=tmp_path / "two", bitwise=False)
    gen = torch.Generator().manual_seed(5)
    saved = torch.get_num_threads()
    try:
        for _ in range(STEPS):
            idx = torch.cat([torch.randint(0, 3000, (400,), generator=gen), torch.randint(0, 30, (200,), generator=gen)])
            target = torch.randn(600, 24, generator=gen)
            _step_each(((emb_ref, ref, 1), (emb_one, one, 1), (emb_two, two, 2)), idx, target)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(emb_one.weight, emb_two.weight)
    assert_close(emb_one.weight, emb_ref.weight, atol=1e-6, name="weight")
    assert_close(one.state_dict()["state"][0]["exp_avg_sq"], ref.state[emb_ref.weight]["exp_avg_sq"], atol=1e-6,
                 name="exp_avg_sq")
    assert one.param_groups[0]["bitwise"] is False
    one.close()
    two.close()
