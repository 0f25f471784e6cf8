"""The staging pipeline of Disk Sparse Adam (pipeline.py), run on CPU tensors.

On CUDA every step goes through persistent pinned/device buffers and ``prefetch`` gathers announced
rows on a background thread. ``staging=True`` runs the same code on CPU weights (no streams: the
"device" buffers are separate CPU tensors), so here it is compared with the direct path
(``staging=False``) and with ``torch.optim.SparseAdam`` on identical tables and batches. Both paths apply
the same operations to the same gathered values, so they must agree bitwise (atol 0); a prefetched
buffer used stale would show up as a difference of the size of an update. Batches are drawn from
small tables so that consecutive batches share many rows (the case where staleness could bite).
"""

import io

import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam, DiskSparseRiemannianAdam
from optim.disk_sparse import pipeline
from tests.utils import assert_close

ROWS, DIM, BATCH = 300, 9, 48


def table(rows=ROWS, dim=DIM, dtype=torch.float32, scale=0.3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    emb = nn.Embedding(rows, dim, sparse=True, dtype=dtype)
    with torch.no_grad():
        emb.weight.copy_(((torch.rand(rows, dim, generator=gen, dtype=torch.float64) * 2 - 1) * scale)
                         .to(dtype))
    return emb


def batches(n, rows=ROWS, batch=BATCH, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, rows, (int(torch.randint(batch // 2, batch + 1, (1,), generator=gen)),),
                          generator=gen) for _ in range(n)]


def grad_step(emb, idx, opt):
    emb.weight.grad = None
    emb(idx).pow(2).sum().mul(0.5).backward()
    opt.step()


def snapshot(emb, opt):
    st = opt.state_dict()["state"][0]
    return emb.weight.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()


def assert_same(a, b, what):
    for x, y, name in zip(a, b, ("weights", "exp_avg", "exp_avg_sq")):
        assert_close(x, y, atol=0.0, name=f"{what}: {name}")


class LazyExecutor:
    """Runs a background gather only when its result is asked for: the latest order it can run in."""

    class Future:
        def __init__(self, fn, args, kwargs):
            self.call, self.done = (fn, args, kwargs), False

        def result(self):
            if not self.done:
                fn, args, kwargs = self.call
                fn(*args, **kwargs)
                self.done = True

    def submit(self, fn, *args, **kwargs):
        return self.Future(fn, args, kwargs)

    def shutdown(self, wait=True):
        pass


def run(idx, *, staged, announce, cls=DiskSparseAdam, backend="torch", dtype=torch.float32, tmp=None,
        scale=0.3, lazy=False, monkeypatch=None, **kw):
    """Train on ``idx``; ``announce(k)`` gives the rows to prefetch before batch k's forward (or None).
    ``lazy`` (with ``monkeypatch``) runs the background gathers through ``LazyExecutor``."""
    emb = table(dtype=dtype, scale=scale)
    if lazy:
        monkeypatch.setattr(pipeline, "make_executor", LazyExecutor)
    opt = cls([emb.weight], lr=3e-2, backend=backend, state_dir=tmp, staging=staged, **kw)
    for k, b in enumerate(idx):
        rows = announce(k) if announce else None
        if rows is not None:
            opt.prefetch(rows)
        grad_step(emb, b, opt)
    out = snapshot(emb, opt)
    stats = opt.staging_stats()
    stats = (stats["hits"], stats["misses"], stats["patched_rows"]) if staged else None
    opt.close()
    return out, stats


def sparse_adam_reference(idx):
    emb = table()
    ref = torch.optim.SparseAdam([emb.weight], lr=3e-2)
    for b in idx:
        grad_step(emb, b, ref)
    st = ref.state[emb.weight]
    return emb.weight.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()


@pytest.mark.parametrize("order", ["next_before_step", "next_after_step", "two_ahead"])
def test_staged_with_prefetch_equals_direct_and_sparse_adam(order):
    idx = batches(40)
    n = len(idx)
    announce = {  # the rows announced before batch k's forward pass
        "next_before_step": lambda k: idx[k + 1] if k + 1 < n else None,  # the benchmark's loop
        "next_after_step": lambda k: idx[k] if k == 0 else (idx[k + 1] if k + 1 < n else None),
        "two_ahead": lambda k: idx[k + 2] if k + 2 < n else None,  # with idx[0], idx[1] never announced
    }[order]
    direct, _ = run(idx, staged=False, announce=None)
    staged, (hits, misses, patched) = run(idx, staged=True, announce=announce)
    assert_same(staged, direct, f"staged ({order}) vs direct")
    assert_same(staged, sparse_adam_reference(idx), f"staged ({order}) vs torch.optim.SparseAdam")
    # The announcements were used (not silently re-gathered), and kept fresh across steps.
    assert hits == {"next_before_step": n - 1, "next_after_step": n - 1, "two_ahead": n - 2}[order]
    assert misses == n - hits
    assert patched > 0


def test_prefetch_of_wrong_rows_falls_back():
    idx = batches(30)
    other = batches(30, seed=5)
    direct, _ = run(idx, staged=False, announce=None)
    staged, (hits, misses, patched) = run(idx, staged=True, announce=lambda k: other[k])
    assert_same(staged, direct, "staged with wrong announcements vs direct")
    assert hits == 0 and misses == len(idx)
    assert patched > 0  # the wrong announcements shared rows with the steps and were refreshed


@pytest.mark.parametrize("lazy", [False, True], ids=["thread", "gather_after_write"])
def test_overlapping_announcement_sees_the_step_in_between(lazy, monkeypatch):
    # Batch k+1 is announced before step k and contains all of batch k's rows plus others, so
    # every row step k writes must reach the announced buffer before step k+1 uses it, whether the
    # background gather ran before step k wrote its rows (the usual case) or after.
    gen = torch.Generator().manual_seed(3)
    base = [torch.randint(0, ROWS, (20,), generator=gen) for _ in range(12)]
    idx = [base[0]] + [torch.cat([base[k - 1], base[k]]) for k in range(1, 12)]
    direct, _ = run(idx, staged=False, announce=None)
    staged, (hits, _, patched) = run(idx, staged=True, announce=lambda k: idx[k + 1] if k + 1 < 12 else None,
                                     lazy=lazy, monkeypatch=monkeypatch)
    assert_same(staged, direct, "overlapping announcements")
    assert hits == 11 and patched >= 11 * 15


def test_two_parameters_announced_separately():
    idx_a, idx_b = batches(15, seed=11), batches(15, rows=200, seed=12)
    out = {}
    for staged in (False, True):
        ea, eb = table(seed=1), table(rows=200, seed=2)
        opt = DiskSparseAdam([ea.weight, eb.weight], lr=3e-2, backend="torch", staging=staged)
        for k in range(15):
            if k + 1 < 15:
                opt.prefetch(idx_a[k + 1], param=ea.weight)
                opt.prefetch(idx_b[k + 1], param=eb.weight)
            ea.weight.grad = eb.weight.grad = None
            (ea(idx_a[k]).pow(2).sum() + eb(idx_b[k]).sin().sum()).backward()
            opt.step()
        sd = opt.state_dict()["state"]
        out[staged] = [ea.weight.detach().clone(), eb.weight.detach().clone()] + \
            [sd[i][key].clone() for i in (0, 1) for key in ("exp_avg", "exp_avg_sq")]
        if staged:
            assert [opt.stager(p).hits for p in (ea.weight, eb.weight)] == [14, 14]
        opt.close()
    for k, (x, y) in enumerate(zip(out[True], out[False])):
        assert_close(x, y, atol=0.0, name=f"two parameters, tensor {k}")


def test_staging_buffers_are_reused_and_bounded():
    idx = batches(60)
    emb = table()
    opt = DiskSparseAdam([emb.weight], lr=3e-2, backend="triton", staging=True)
    big = torch.arange(BATCH)  # the largest batch of unique rows first: later ones fit
    grad_step(emb, big, opt)
    for k in range(3):
        opt.prefetch(idx[k + 1])
        grad_step(emb, idx[k], opt)
    tensors = opt.stager(emb.weight).buffers()
    assert tensors[-2] is not None and tensors[-1] is not None  # device records and weight rows
    nbytes = (opt.device_staging_bytes(), opt.staging_stats()["pinned_bytes"])
    for k in range(3, 40):
        opt.prefetch(idx[k + 1])
        grad_step(emb, idx[k], opt)
    after = opt.stager(emb.weight).buffers()
    assert all(a is b for a, b in zip(tensors, after) if a is not None), "a staging buffer was reallocated"
    assert (opt.device_staging_bytes(), opt.staging_stats()["pinned_bytes"]) == nbytes
    # Bounded by the batch: records (2D) and weight rows (D) of at most max(2 x rows, 256) rows.
    cap = max(2 * BATCH, 256)
    assert 0 < opt.device_staging_bytes() <= cap * 3 * DIM * 4
    assert opt.staging_stats()["pinned_bytes"] <= 4 * cap * 2 * DIM * 4  # depth + 1 host buffers
    opt.close()


def train_announcing(emb, opt, idx, start):
    """Steps ``start``.. of ``idx``, announcing each next batch before the step."""
    for k in range(start, len(idx)):
        if k + 1 < len(idx):
            opt.prefetch(idx[k + 1])
        grad_step(emb, idx[k], opt)


def test_state_dict_round_trip_mid_run(tmp_path):
    idx = batches(30)
    direct, _ = run(idx, staged=False, announce=None)
    # A staged run checkpointed after 12 steps, with batch 12 already announced, resumed in a new
    # optimizer; and the original one rewound to an older checkpoint while an announcement is pending.
    emb = table()
    opt = DiskSparseAdam([emb.weight], lr=3e-2, backend="torch", state_dir=tmp_path / "a", staging=True)
    ckpts = {}
    for k in range(12):
        opt.prefetch(idx[k + 1])
        grad_step(emb, idx[k], opt)
        if k in (7, 11):
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)
            ckpts[k + 1] = (buf.getvalue(), emb.weight.detach().clone())
    # Resume from step 12 in a fresh optimizer (its own files), announcing as before.
    emb2 = table()
    with torch.no_grad():
        emb2.weight.copy_(ckpts[12][1])
    opt2 = DiskSparseAdam([emb2.weight], lr=3e-2, backend="torch", state_dir=tmp_path / "b", staging=True)
    opt2.load_state_dict(torch.load(io.BytesIO(ckpts[12][0])))
    train_announcing(emb2, opt2, idx, start=12)
    assert_same(snapshot(emb2, opt2), direct, "resumed in a new optimizer")
    opt2.close()
    # Rewind the first optimizer to step 8 while batch 8 is announced with records gathered at step
    # 12: the announcement must not survive load_state_dict (the replayed step 8 would use it).
    opt.prefetch(idx[8])
    with torch.no_grad():
        emb.weight.copy_(ckpts[8][1])
    opt.load_state_dict(torch.load(io.BytesIO(ckpts[8][0])))
    train_announcing(emb, opt, idx, start=8)
    assert_same(snapshot(emb, opt), direct, "rewound with a pending announcement")
    opt.close()


def test_close_with_pending_announcement(tmp_path, monkeypatch):
    executors = []
    monkeypatch.setattr(pipeline, "make_executor", lambda: executors.append(pipeline.ThreadPoolExecutor(1)) or
                        executors[-1])
    emb = table()
    opt = DiskSparseAdam([emb.weight], lr=3e-2, backend="torch", state_dir=tmp_path, staging=True)
    grad_step(emb, torch.tensor([1, 2, 3]), opt)
    opt.prefetch(torch.arange(ROWS))
    opt.close()  # waits for the background gather before unmapping
    assert len(executors) == 1
    with pytest.raises(RuntimeError, match="shutdown"):  # the background thread was shut down
        executors[0].submit(int)
    with pytest.raises(RuntimeError, match="closed"):
        opt.prefetch(torch.tensor([1]))


@pytest.mark.parametrize("cls,kw,dtype", [
    (DiskSparseAdam, {}, torch.float32),
    (DiskSparseAdam, {}, torch.bfloat16),
    (DiskSparseRiemannianAdam, dict(c=1.0, exact=False), torch.float32),
    (DiskSparseRiemannianAdam, dict(c=0.5, exact=True), torch.bfloat16),
])
def test_staged_triton_kernels_equal_direct_triton(cls, kw, dtype):
    # The Triton row kernels (interpreted on CPU) through the staged path, with announcements.
    idx = batches(6)
    announce = lambda k: idx[k + 1] if k + 1 < len(idx) else None  # noqa: E731
    scale = 0.3 if cls is DiskSparseAdam else 0.25
    direct, _ = run(idx, staged=False, announce=None, cls=cls, backend="triton", dtype=dtype, scale=scale, **kw)
    staged, (hits, _, _) = run(idx, staged=True, announce=announce, cls=cls, backend="triton", dtype=dtype,
                               scale=scale, **kw)
    assert_same(staged, direct, f"{cls.__name__} {dtype} staged vs direct Triton")
    assert hits == len(idx) - 1
    if dtype == torch.float32:  # and the torch path (the kernels' own tolerance: tests/test_dsa_kernels.py)
        torch_path, _ = run(idx, staged=True, announce=announce, cls=cls, backend="torch", dtype=dtype,
                            scale=scale, **kw)
        for x, y, name in zip(staged, torch_path, ("weights", "exp_avg", "exp_avg_sq")):
            assert_close(x, y, atol=2e-6, rtol=1e-5, name=f"{cls.__name__} staged Triton vs torch: {name}")


@pytest.mark.parametrize("bitwise", [True, False], ids=["bitwise", "fused"])
def test_staged_numba_equals_direct_numba(bitwise):
    # The numba row kernels through the staged path (gathered rows) against the fused update straight
    # from the uncoalesced gradient (direct path): the same operations on the same values; bitwise
    # SparseAdam too where ``bitwise``.
    idx = batches(20)
    announce = lambda k: idx[k + 1] if k + 1 < len(idx) else None  # noqa: E731
    direct, _ = run(idx, staged=False, announce=None, backend="numba", bitwise=bitwise)
    staged, (hits, _, _) = run(idx, staged=True, announce=announce, backend="numba", bitwise=bitwise)
    assert_same(staged, direct, "staged vs direct numba")
    assert hits == len(idx) - 1
    if bitwise:
        assert_same(staged, sparse_adam_reference(idx[:20]), "staged numba vs torch.optim.SparseAdam")
