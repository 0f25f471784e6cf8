"""Parallel reads of cold rows (``RowStateFile.read_ahead_if_cold`` / ``read_ahead``) and ``prefetch``
with CPU weights.

Announcing rows only asks the kernel to read their pages; the step still reads the file, so a run
with announcements (of the next batch, of batches two ahead, of rows never stepped) and with the
page cache dropped between steps must equal a run without any, and both must equal
``torch.optim.SparseAdam`` bitwise (atol 0), as the trajectory tests require of the direct path.
"""

import os
import time

import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam
from tests.utils import assert_close, sparse_embedding, step_random_rows

ROWS, DIM = 400, 33


def _table(seed=0):
    gen = torch.Generator().manual_seed(seed)
    emb = nn.Embedding(ROWS, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.rand(ROWS, DIM, generator=gen) - 0.5)
    return emb


def _batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, ROWS, (int(torch.randint(20, 80, (1,), generator=gen)),), generator=gen)
            for _ in range(n)]


def _run(opt_fn, batches, announce=None, drop=False):
    emb = _table()
    opt = opt_fn(emb.parameters())
    for k, idx in enumerate(batches):
        if announce is not None:
            for rows in announce(k):
                opt.prefetch(rows)
        if drop:
            for st in opt.state_files():
                st.drop_cache()
        emb.weight.grad = None
        emb(idx).pow(2).sum().mul(0.5).backward()
        opt.step()
    st = opt.state_dict()["state"][0]
    out = (emb.weight.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone())
    if hasattr(opt, "close"):
        opt.close()
    return out


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_prefetch_cpu_weights_equals_no_prefetch_and_sparse_adam(backend, tmp_path):
    batches = _batches(12)
    extra = torch.randint(0, ROWS, (50,))

    def announce(k):  # the next batch, the one after it, and rows that are never stepped
        return [b for b in batches[k + 1:k + 3]] + [extra]

    want = _run(lambda ps: torch.optim.SparseAdam(list(ps), lr=0.05), batches)
    dsa = lambda ps: DiskSparseAdam(ps, lr=0.05, backend=backend)  # noqa: E731
    plain = _run(dsa, batches)
    announced = _run(dsa, batches, announce=announce, drop=True)
    for got, what in ((plain, "no prefetch"), (announced, "prefetch + dropped cache")):
        for x, y, name in zip(got, want, ("weights", "exp_avg", "exp_avg_sq")):
            assert_close(x, y, atol=0.0, name=f"{backend} {what}: {name}")


def test_fetch_reads_missing_pages(tmp_path):
    emb = nn.Embedding(20_000, 64, sparse=True)
    with DiskSparseAdam(emb.parameters(), state_dir=tmp_path, huge_pages=False) as opt:
        st = opt.state_files()[0]
        st.write_all(None, 0)  # real blocks on disk, as after a first pass over the table
        rows = torch.randperm(20_000)[:64]
        st.drop_cache()
        if st.missing_pages(rows) == 0:
            pytest.skip("this file system keeps the file's pages after DONTNEED (e.g. tmpfs)")
        assert st.missing_pages(rows) == 16  # the sample: the first 16 rows' pages
        st.read_ahead_if_cold(rows)
        deadline = time.monotonic() + 5.0
        while st.missing_pages(rows, sample=64) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert st.missing_pages(rows, sample=64) == 0
        assert st.missing_pages(torch.tensor([], dtype=torch.int64)) == 0


def test_prefetch_checks_indices():
    emb = nn.Embedding(10, 4, sparse=True)
    with DiskSparseAdam(emb.parameters()) as opt:
        with pytest.raises(IndexError):
            opt.prefetch(torch.tensor([3, 10]))
        opt.prefetch(torch.tensor([], dtype=torch.int64))  # nothing to read


def test_memory_limit_reads_the_process_own_cgroup(tmp_path):
    from optim.disk_sparse.store import memory_limit_bytes

    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    (tmp_path / "memory" / "a" / "b").mkdir(parents=True)
    (tmp_path / "memory" / "a" / "memory.limit_in_bytes").write_text(f"{phys // 2}\n")
    (tmp_path / "memory" / "a" / "b" / "memory.limit_in_bytes").write_text(f"{phys // 4}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu,memory:/a/b\n0::/x\n")
    assert memory_limit_bytes(str(tmp_path), str(proc)) == phys // 4
    proc.write_text("5:memory:/a\n")
    assert memory_limit_bytes(str(tmp_path), str(proc)) == phys // 2  # the child's limit does not apply
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "memory.max").write_text(f"{phys // 3}\n")
    proc.write_text("0::/x\n")
    assert memory_limit_bytes(str(tmp_path), str(proc)) == phys // 3
    assert memory_limit_bytes(str(tmp_path), str(tmp_path / "missing")) == phys


def test_a_new_file_in_the_page_cache_is_never_read_ahead(tmp_path, monkeypatch):
    """A file the optimizer created, which stays in the page cache, holds zeros until written: no
    step of the first pass asks the disk for its pages (a residency check would find every untouched
    page missing). Once its pages were dropped, or for a resumed file, fetch reads ahead again."""
    from optim.disk_sparse.store import RowStateFile

    asked = []
    real = RowStateFile.read_ahead
    monkeypatch.setattr(RowStateFile, "read_ahead", lambda self, rows: asked.append(rows.numel()) or real(self, rows))
    emb = nn.Embedding(20_000, 64, sparse=True)

    def steps(opt, n):
        for _ in range(n):
            opt.zero_grad()
            emb(torch.randint(0, 20_000, (256,))).sum().backward()
            opt.step()

    opt = DiskSparseAdam(emb.parameters(), state_dir=tmp_path, huge_pages=False, staging=False)
    assert opt.state_files()[0].in_memory
    steps(opt, 5)
    assert asked == []
    opt.state_files()[0].drop_cache()
    steps(opt, 1)
    dropped = len(asked)
    opt.close()
    resumed = DiskSparseAdam(emb.parameters(), state_dir=tmp_path, huge_pages=False, staging=False, resume=True)
    assert not resumed.state_files()[0].in_memory
    resumed.close()
    if dropped == 0:
        pytest.skip("this file system keeps the file's pages after DONTNEED (e.g. tmpfs)")
    assert dropped > 0


def test_prefetch_takes_any_integer_indices_and_refuses_others(tmp_path):
    emb = nn.Embedding(ROWS, DIM, sparse=True)
    opt = DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "s")
    import numpy as np

    for idx in ([1, 2, 3], np.array([4, 5]), 7, torch.tensor([8], dtype=torch.int32)):
        opt.prefetch(idx)
    for bad in (torch.tensor([1.0]), torch.tensor([True]), torch.tensor([1 + 1j])):
        with pytest.raises(TypeError, match="integers"):
            opt.prefetch(bad)
    opt.close()


# -- odd arguments -------------------------------------------------------------------------------------
def test_prefetch_of_an_empty_batch_does_nothing(tmp_path):
    emb = sparse_embedding(200, 8, seed=0)
    with DiskSparseAdam(emb.parameters(), state_dir=tmp_path, backend="torch") as opt:
        opt.prefetch(torch.tensor([], dtype=torch.int64))
        step_random_rows(emb, opt, 0)
