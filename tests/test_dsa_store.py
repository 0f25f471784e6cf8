"""The DSA state file: layout, preallocation, lock, dirty flag, files of another shape, huge pages and
the page-cache decision (the optimizer's arguments: ``tests/test_dsa_arguments.py``)."""

import os
import resource
import signal
import struct

import numpy as np
import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam
from optim.disk_sparse.store import HEADER_BYTES, RowStateFile, StateFileError
from tests.utils import sparse_embedding


def test_file_layout_header_and_contiguous_records(tmp_path):
    emb = sparse_embedding(40, 6, dtype=torch.float64)
    opt = DiskSparseAdam(emb.parameters(), state_dir=tmp_path)
    path = tmp_path / "param0000.dsa"
    assert path.stat().st_size == HEADER_BYTES + 40 * 12 * 8  # [m | v] records of 2*D float64
    emb(torch.tensor([5, 7, 7])).sum().backward()
    opt.step()
    opt.flush()
    raw = path.read_bytes()
    magic, version, code, rows, cols, width, step, clean = struct.unpack_from("<8sIIQQQQI", raw)
    assert (magic, rows, cols, width, step, clean) == (b"DSAROWS\0", 40, 6, 12, 1, 1)
    records = np.frombuffer(raw, dtype=np.float64, offset=HEADER_BYTES).reshape(40, 12)
    st = opt.state_dict()["state"][0]
    for r in (0, 5, 7):
        assert np.array_equal(records[r, :6], st["exp_avg"][r].numpy())
        assert np.array_equal(records[r, 6:], st["exp_avg_sq"][r].numpy())
    assert np.abs(records[5]).min() > 0 and not records[0].any()
    # Any write after a clean point makes the header dirty before the records change.
    emb.zero_grad()
    emb(torch.tensor([1])).sum().backward()
    opt.step()
    assert struct.unpack_from("<8sIIQQQQI", path.read_bytes())[7] == 0
    opt.close()
    assert struct.unpack_from("<8sIIQQQQI", path.read_bytes())[6:] == (2, 1)


def test_store_gather_scatter_sorted_rows(tmp_path):
    st = RowStateFile(tmp_path / "s.dsa", 100, 3, 6, torch.float32)
    rows = torch.tensor([2, 17, 99])
    rec = torch.randn(3, 6)
    st.scatter(rows, rec)
    assert torch.equal(st.gather(rows), rec)
    assert torch.equal(st.gather(torch.tensor([0, 1])), torch.zeros(2, 6))
    st.close(step=4)
    st2 = RowStateFile(tmp_path / "s.dsa", 100, 3, 6, torch.float32)
    assert st2.step == 4 and torch.equal(st2.gather(rows), rec)
    st2.read_ahead(rows)
    st2.close()


def test_unusable_state_dir(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="state_dir .*a_file"):
        DiskSparseAdam(sparse_embedding(40, 6).parameters(), state_dir=blocker / "sub")


def test_full_disk_fails_at_creation_naming_the_file(tmp_path):
    """A file-size limit makes posix_fallocate fail like a full disk; no SIGBUS later."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(OSError, match=r"disk space for state file .*param0000.dsa.*needs 6.1 MiB"):
            DiskSparseAdam(sparse_embedding(100000, 8).parameters(), state_dir=tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert not (tmp_path / "param0000.dsa").exists()  # no half-made file left behind


def test_state_file_of_other_shape_or_dtype_is_refused(tmp_path):
    DiskSparseAdam(sparse_embedding(40, 6).parameters(), state_dir=tmp_path).close()
    with pytest.raises(StateFileError, match=r"param0000.dsa.*shape \(40, 6\).*\(41, 6\)"):
        DiskSparseAdam(sparse_embedding(41, 6).parameters(), state_dir=tmp_path, resume=True)
    with pytest.raises(StateFileError, match="param0000.dsa.*float64"):
        DiskSparseAdam(sparse_embedding(40, 6, dtype=torch.float64).parameters(), state_dir=tmp_path, resume=True)
    (tmp_path / "param0000.dsa").write_bytes(b"not a state file" * 10)
    with pytest.raises(StateFileError, match="param0000.dsa.*not a Disk Sparse Adam state file"):
        DiskSparseAdam(sparse_embedding(40, 6).parameters(), state_dir=tmp_path, resume=True)


def test_state_dir_in_use_is_refused(tmp_path):
    opt = DiskSparseAdam(sparse_embedding(40, 6).parameters(), state_dir=tmp_path)
    with pytest.raises(StateFileError, match="param0000.dsa is in use"):
        DiskSparseAdam(sparse_embedding(40, 6).parameters(), state_dir=tmp_path, resume=True)
    opt.close()
    DiskSparseAdam(sparse_embedding(40, 6).parameters(), state_dir=tmp_path, resume=True).close()  # free again after close


def test_dirty_file_is_refused(tmp_path):
    st = RowStateFile(tmp_path / "param0000.dsa", 40, 6, 12, torch.float32)
    st.scatter(torch.tensor([1]), torch.ones(1, 12))
    st._release()  # stop without a clean point, as a killed process does
    with pytest.raises(StateFileError, match="dirty.*load_state_dict"):
        DiskSparseAdam(sparse_embedding(40, 6).parameters(), state_dir=tmp_path, resume=True)


def test_step_after_close_is_refused():
    emb = sparse_embedding(40, 6)
    opt = DiskSparseAdam(emb.parameters())
    opt.close()
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    with pytest.raises(RuntimeError, match="closed"):
        opt.state_dict()


def test_prefetch_announces_rows_without_changing_results(tmp_path):
    a, b = sparse_embedding(500, 8), sparse_embedding(500, 8)
    b.load_state_dict(a.state_dict())
    opt_a = DiskSparseAdam(a.parameters(), lr=1e-2, state_dir=tmp_path / "a")
    opt_b = DiskSparseAdam(b.parameters(), lr=1e-2, state_dir=tmp_path / "b")
    batches = [torch.randint(0, 500, (64,)) for _ in range(6)]
    for k, idx in enumerate(batches):
        if k + 1 < len(batches):
            opt_b.prefetch(batches[k + 1])
        for m, o in ((a, opt_a), (b, opt_b)):
            o.zero_grad()
            m(idx).pow(2).sum().backward()
            o.step()
    assert torch.equal(a.weight, b.weight)
    with pytest.raises(IndexError, match=r"\[0, 500\)"):
        opt_b.prefetch(torch.tensor([500]))
    two = DiskSparseAdam([sparse_embedding(40, 6).weight, sparse_embedding(40, 6).weight], state_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="param="):
        two.prefetch(torch.tensor([1]))
    for o in (opt_a, opt_b, two):
        o.close()


def _file_pmd_mapped_kib(addr):
    """FilePmdMapped of the mapping holding ``addr`` in /proc/self/smaps (None if not reported)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "FilePmdMapped:":
                return int(line.split()[1])
    return None


def test_huge_pages_change_nothing_but_the_mapping(tmp_path):
    """Same trajectory with and without huge pages; where the kernel maps file folios with PMDs the
    huge-page mapping actually uses them (checked only where smaps reports it)."""
    emb_a = sparse_embedding(40_000, 16)
    emb_b = nn.Embedding(40_000, 16, sparse=True)
    emb_b.weight.data.copy_(emb_a.weight.data)
    opt_a = DiskSparseAdam(emb_a.parameters(), lr=1e-2, state_dir=tmp_path / "a", huge_pages=True)
    opt_b = DiskSparseAdam(emb_b.parameters(), lr=1e-2, state_dir=tmp_path / "b", huge_pages=False)
    sa, sb = opt_a.state_file(emb_a.weight), opt_b.state_file(emb_b.weight)
    assert sa.huge_pages == hasattr(__import__("mmap"), "MADV_HUGEPAGE") and not sb.huge_pages
    for _ in range(5):
        idx = torch.randint(0, 40_000, (3000,))
        for emb, opt in ((emb_a, opt_a), (emb_b, opt_b)):
            opt.zero_grad()
            (emb(idx) ** 2).mean().backward()
            opt.step()
    assert torch.equal(emb_a.weight, emb_b.weight)
    assert torch.equal(opt_a.state_dict()["state"][0]["exp_avg_sq"], opt_b.state_dict()["state"][0]["exp_avg_sq"])
    assert _file_pmd_mapped_kib(sb.records.data_ptr()) in (0, None)
    opt_a.close()
    opt_b.close()


def test_memory_limit_is_the_smaller_of_ram_and_the_cgroup_limit(tmp_path):
    from optim.disk_sparse.store import memory_limit_bytes

    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert memory_limit_bytes(str(tmp_path)) == phys  # no cgroup files: physical RAM
    (tmp_path / "memory.max").write_text("max\n")  # cgroup v2 without a limit
    assert memory_limit_bytes(str(tmp_path)) == phys
    (tmp_path / "memory.max").write_text(f"{phys // 8}\n")
    assert memory_limit_bytes(str(tmp_path)) == phys // 8
    (tmp_path / "memory.max").unlink()
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{phys * 4}\n")  # v1, above RAM
    assert memory_limit_bytes(str(tmp_path)) == phys


def test_huge_pages_default_follows_the_size_rule(tmp_path, monkeypatch):
    from optim.disk_sparse import state_dirs, store

    limit = store.memory_limit_bytes()
    assert store.fits_in_page_cache(int(0.2 * limit)) and not store.fits_in_page_cache(int(0.3 * limit))
    monkeypatch.setattr(state_dirs, "fits_in_page_cache", lambda nbytes: nbytes < 10_000)  # where the optimizer calls it
    small, big = sparse_embedding(10, 6), sparse_embedding(1000, 6)  # state files of 480 and 48,000 bytes after the header
    alone = DiskSparseAdam([small.weight], state_dir=tmp_path / "alone")
    assert alone.state_file(small.weight).huge_pages == hasattr(__import__("mmap"), "MADV_HUGEPAGE")
    alone.close()
    opt = DiskSparseAdam([small.weight, big.weight], state_dir=tmp_path / "both")  # decided over the total
    assert not opt.state_file(small.weight).huge_pages and not opt.state_file(big.weight).huge_pages
    assert opt.state_files() == [opt.state_file(small.weight), opt.state_file(big.weight)]
    opt.close()
    with pytest.raises(ValueError, match="huge_pages"):
        DiskSparseAdam(small.parameters(), huge_pages="yes")


def test_staying_in_the_page_cache_is_decided_over_the_optimizers_total(tmp_path, monkeypatch):
    """Four tables of 22% of the memory limit each do not all stay in the page cache (88%): none is
    populated or huge-paged; one alone (22%) is."""
    from optim.disk_sparse import store as store_mod

    tables = [nn.Embedding(1000, 8, sparse=True) for _ in range(4)]
    file_bytes = store_mod.HEADER_BYTES + 1000 * 16 * 4
    monkeypatch.setattr(store_mod, "memory_limit_bytes", lambda *a, **k: int(file_bytes / 0.22))
    four = DiskSparseAdam([t.weight for t in tables], state_dir=tmp_path / "four")
    assert not any(s.in_memory or s.huge_pages for s in four.state_files())
    four.close()
    one = DiskSparseAdam([tables[0].weight], state_dir=tmp_path / "one")
    assert one.state_file(tables[0].weight).in_memory
    one.close()
