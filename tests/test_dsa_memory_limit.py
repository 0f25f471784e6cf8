"""Disk Sparse Adam's state larger than the process's memory limit: restored from and saved to a
state dict within the limit (in a memory cgroup), and the compact format saved without a copy.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam
from optim.disk_sparse.weights import close_mapped
from tests.utils import index_batches, step_rows


ROWS, DIM = 300, 6


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_in_memory_cgroup(code, limit_bytes, timeout=120):
    """Run ``code`` in a child that joins a new memory cgroup of ``limit_bytes`` (page cache
    included) once it has imported what an optimizer needs (a throwaway DiskSparseAdam pulls in
    torch's optimizer machinery, some 250 MiB of imports), so that only what ``code`` allocates
    counts; the cgroup is removed after. Returns the CompletedProcess and the cgroup's peak usage."""
    from experiments.harness.memcg import make_memory_cgroup, remove_memory_cgroup

    cg = make_memory_cgroup("dsa-test", limit_bytes)
    if cg is None:
        pytest.skip("needs root and the cgroup v1 memory controller at /sys/fs/cgroup/memory")
    prelude = f"""
        import os, torch
        from optim import DiskSparseAdam
        DiskSparseAdam([torch.nn.Parameter(torch.zeros(2, 2))]).close()
        with open({os.path.join(cg, "cgroup.procs")!r}, "w") as f:
            f.write(str(os.getpid()))
    """
    try:
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(prelude) + textwrap.dedent(code)],
                             capture_output=True, text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=ROOT))
        with open(os.path.join(cg, "memory.max_usage_in_bytes")) as f:
            peak = int(f.read())
    finally:
        assert remove_memory_cgroup(cg), f"memory cgroup {cg} could not be removed"
    return out, peak


def _random_state(state_format: str, rows: int, dim: int, gen) -> dict:
    """A state of ``state_format`` for a ``rows x dim`` table, drawn from ``gen``."""
    if state_format == "exact":
        return {"exp_avg": torch.rand(rows, dim, generator=gen) - 0.5, "exp_avg_sq": torch.rand(rows, dim, generator=gen)}
    return {"exp_avg_codes": torch.randint(-127, 128, (rows, dim), generator=gen, dtype=torch.int8),
            "exp_avg_scale": torch.rand(rows, 1, generator=gen), "exp_avg_sq": torch.rand(rows, 1, generator=gen)}


def test_states_larger_than_the_memory_limit_restore_and_save_within_it(tmp_path):
    """The routes the error messages give for out-of-core tables, in a child whose memory cgroup
    (16 MiB, page cache included) is a fraction of each state (exact 64 MiB, compact 36 MiB): the
    restore ``opt.load_state_dict(torch.load(ckpt, mmap=True))`` checks and writes the rows in
    chunks, and ``torch.save(opt.state_dict(), ...)`` streams mappings of the files; the child
    exits 0 and each saved state equals its checkpoint on 500 random rows. A restore that holds a
    whole state at once (torch.load without mmap; the compact codes' range checked in one mask)
    is killed for memory."""
    from optim import mapped_embedding

    gen, limit = torch.Generator().manual_seed(3), 16 << 20
    tables = {"exact": (131_072, 64), "compact": (524_288, 64)}
    states, lines = {}, []
    for fmt, (rows, dim) in tables.items():
        states[fmt] = _random_state(fmt, rows, dim, gen)
        groups = DiskSparseAdam([nn.Parameter(torch.zeros(2, dim))], state_format=fmt).state_dict()["param_groups"]
        torch.save({"state": {0: {"step": 7, **states[fmt]}}, "param_groups": groups}, tmp_path / f"{fmt}.pt")
        close_mapped(mapped_embedding(tmp_path / f"{fmt}.w", rows, dim))  # the weights, in a file, made here
        lines.append(f"""
            emb = mapped_embedding({str(tmp_path / f"{fmt}.w")!r}, {rows}, {dim})
            opt = DiskSparseAdam(emb.parameters(), state_dir={str(tmp_path / fmt)!r}, state_format={fmt!r})
            opt.load_state_dict(torch.load({str(tmp_path / f"{fmt}.pt")!r}, mmap=True))
            torch.save(opt.state_dict(), {str(tmp_path / f"{fmt}.saved.pt")!r})
            print({fmt!r}, "restored and saved at step", opt.step_count(emb.weight), flush=True)
            opt.close()
        """)
    out, peak = _run_in_memory_cgroup("from optim import DiskSparseAdam, mapped_embedding\n"
                                      + "".join(textwrap.dedent(line) for line in lines), limit)
    assert out.returncode == 0, (out.returncode, peak, out.stdout, out.stderr[-2000:])
    assert peak <= limit
    for fmt, (rows, _) in tables.items():
        assert f"{fmt} restored and saved at step 7" in out.stdout, out.stdout
        saved = torch.load(tmp_path / f"{fmt}.saved.pt", mmap=True)["state"][0]
        sample = torch.randint(0, rows, (500,), generator=gen)
        assert int(saved["step"]) == 7
        for key, value in states[fmt].items():
            assert torch.equal(saved[key][sample], value[sample]), (fmt, key)


def test_a_compact_state_larger_than_memory_saves_each_key_in_a_storage_of_its_own(tmp_path, monkeypatch):
    """Where the compact state does not fit in memory, state_dict() gives each key a storage of its
    own (torch.save cannot save one storage as several dtypes), in files rather than in anonymous
    memory (tests/test_dsa_streaming_checkpoints.py); the saved checkpoint loads into a new
    optimizer with the same state."""
    from optim.disk_sparse import state_dirs

    monkeypatch.setattr(state_dirs, "fits_in_page_cache", lambda nbytes: False)  # opening the files
    emb = nn.Embedding(ROWS, DIM, sparse=True)
    opt = DiskSparseAdam(emb.parameters(), state_format="compact", state_dir=tmp_path / "a")
    for idx in index_batches(3, ROWS):
        step_rows(emb, opt, idx)
    sd = opt.state_dict()
    st = sd["state"][0]
    ptrs = {st[k].untyped_storage().data_ptr() for k in ("exp_avg_scale", "exp_avg_sq", "exp_avg_codes")}
    assert len(ptrs) == 3  # one mapping each, no shared storage of several dtypes
    torch.save(sd, tmp_path / "ckpt.pt")
    twin = DiskSparseAdam(nn.Embedding(ROWS, DIM, sparse=True).parameters(), state_format="compact",
                          state_dir=tmp_path / "b")
    twin.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    back = twin.state_dict()["state"][0]
    for key in ("step", "exp_avg_scale", "exp_avg_sq", "exp_avg_codes"):
        assert torch.equal(torch.as_tensor(back[key]), torch.as_tensor(st[key])), key
    opt.close()
    twin.close()


def test_a_fresh_mapped_table_larger_than_the_memory_limit_is_made_within_it(tmp_path):
    """``mapped_embedding`` fills a new weight file with N(0, 1) draws: a 128 MiB table made in a
    child whose memory cgroup (16 MiB, page cache included) is an eighth of it exits 0, its rows
    those of one draw of the whole table (checked on sampled rows here, in a process without the
    limit)."""
    rows, dim = 262_144, 128
    path = tmp_path / "w.bin"
    out, peak = _run_in_memory_cgroup(f"""
        from optim import mapped_embedding
        from optim.disk_sparse.weights import close_mapped
        close_mapped(mapped_embedding({str(path)!r}, {rows}, {dim}, seed=5))
        print("made", flush=True)
    """, 16 << 20)
    assert out.returncode == 0 and "made" in out.stdout, (out.returncode, peak, out.stderr[-2000:])
    from optim import mapped_embedding
    from optim.disk_sparse.weights import close_mapped

    emb = mapped_embedding(path, rows, dim, seed=5)
    whole = torch.randn(rows, dim, generator=torch.Generator().manual_seed(5), dtype=torch.float64).float()
    sample = torch.randint(0, rows, (500,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(emb.weight.detach()[sample], whole[sample])
    close_mapped(emb)
