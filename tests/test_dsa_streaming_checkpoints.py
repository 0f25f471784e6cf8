"""Disk Sparse Adam's checkpoints stream: a compact state dict holds its copies in files (page cache
the kernel can write back and drop), not in anonymous memory, and beside weights that fill most of a
memory cgroup's limit an exact state of 1.5 times the limit is restored from a memory-mapped
checkpoint and saved again, and a compact state saved, within the limit."""

import gc
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam
from optim.disk_sparse import compact
from optim.disk_sparse.store import RowStateFile
from tests.utils import index_batches, step_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_in_memory_cgroup(code, limit_bytes, timeout=120):
    """Run ``code`` in a child that joins a new memory cgroup of ``limit_bytes`` (page cache included)
    once it has imported the optimizer and compiled the kernels a step of each format runs (a step of
    many rows runs the parallel kernels: tens of MiB of compilation that would otherwise count), so
    that only what ``code`` allocates counts; the cgroup is removed after. Returns the
    CompletedProcess and the cgroup's peak usage (page cache included)."""
    from experiments.harness.memcg import make_memory_cgroup, peak_usage, remove_memory_cgroup

    cg = make_memory_cgroup("dsa-test", limit_bytes)
    if cg is None:
        pytest.skip("needs root and the cgroup v1 memory controller at /sys/fs/cgroup/memory")
    prelude = f"""
        import os, torch
        from optim import DiskSparseAdam
        for fmt in ("exact", "compact"):
            emb = torch.nn.Embedding(1024, 8, sparse=True)
            with DiskSparseAdam(emb.parameters(), state_format=fmt) as opt:
                for idx in (torch.tensor([1]), torch.arange(1024)):
                    emb(idx).sum().backward()
                    opt.step()
        with open({os.path.join(cg, "cgroup.procs")!r}, "w") as f:
            f.write(str(os.getpid()))
    """
    try:
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(prelude) + textwrap.dedent(code)],
                             capture_output=True, text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=ROOT))
        peak = peak_usage(cg)
    finally:
        assert remove_memory_cgroup(cg), f"memory cgroup {cg} could not be removed"
    return out, peak


def _mapping_of(t: torch.Tensor):
    """The /proc/self/maps line of the mapping that holds ``t``'s first byte (None: none)."""
    ptr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return line.rstrip("\n")
    return None


def test_a_compact_state_dict_holds_its_copies_in_unlinked_files(tmp_path):
    """Each tensor of a compact state dict (a copy: torch.save cannot save one storage as several
    dtypes) lives in a mapping of a deleted file in the state_dir, not in anonymous memory; it
    equals the file's records, no file is left in the state_dir, and the mapping goes with the
    state dict."""
    emb = nn.Embedding(300, 6, sparse=True)
    opt = DiskSparseAdam(emb.parameters(), state_format="compact", state_dir=tmp_path / "s")
    for idx in index_batches(3, 300):
        step_rows(emb, opt, idx)
    sd = opt.state_dict()
    st = sd["state"][0]
    scale, v, codes = compact.views(opt.state_file(emb.weight).records, 6)
    for key, want in (("exp_avg_scale", scale), ("exp_avg_sq", v), ("exp_avg_codes", codes)):
        assert torch.equal(st[key], want), key
        line = _mapping_of(st[key])
        assert line is not None and line.endswith("(deleted)") and str(tmp_path / "s") in line, (key, line)
    assert sorted(os.listdir(tmp_path / "s")) == ["param0000.dsa"]
    lines = [_mapping_of(st[k]) for k in ("exp_avg_scale", "exp_avg_sq", "exp_avg_codes")]
    del sd, st
    gc.collect()
    with open("/proc/self/maps") as f:
        maps = f.read()
    assert not any(line in maps for line in lines)
    opt.close()


def test_states_beside_weights_that_fill_most_of_the_memory_limit_restore_and_save_within_it(tmp_path):
    """In a child whose memory cgroup (128 MiB, page cache included) holds 96 MiB of weights in RAM:
    an exact state of 192 MiB is restored (``load_state_dict(torch.load(ckpt, mmap=True))``), and a
    compact state of 27 MiB (which a state dict once copied into anonymous memory: more than the
    limit leaves free) is trained and saved with ``torch.save(opt.state_dict(), ...)``. The child
    exits 0; the restored state files equal the checkpoint (on 2,000 sampled rows) and the saved
    compact state its files (every row)."""
    try:
        _restore_and_save_beside_weights(tmp_path)
    finally:  # some 450 MiB of checkpoints and state files: not left for pytest's kept temporaries
        shutil.rmtree(tmp_path, ignore_errors=True)


def _restore_and_save_beside_weights(tmp_path):
    limit, rows, dim = 128 << 20, 393_216, 64
    gen = torch.Generator().manual_seed(4)
    groups = DiskSparseAdam([nn.Parameter(torch.zeros(2, dim))]).state_dict()["param_groups"]
    state = {"step": 5, "exp_avg": torch.rand(rows, dim, generator=gen) - 0.5,
             "exp_avg_sq": torch.rand(rows, dim, generator=gen)}
    torch.save({"state": {0: state}, "param_groups": groups}, tmp_path / "exact.pt")
    sample = torch.randint(0, rows, (2000,), generator=gen)
    expected = torch.cat([state["exp_avg"][sample], state["exp_avg_sq"][sample]], 1)
    del state
    out, peak = _run_in_memory_cgroup(f"""
        import torch.nn as nn

        def step_rows(emb, opt, idx):
            opt.zero_grad()
            emb(idx).pow(2).sum().backward()
            opt.step()

        emb = nn.Embedding({rows}, {dim}, sparse=True)
        opt = DiskSparseAdam(emb.parameters(), state_dir={str(tmp_path / "exact")!r})
        opt.load_state_dict(torch.load({str(tmp_path / "exact.pt")!r}, mmap=True))
        print("exact restored at step", opt.step_count(emb.weight), flush=True)
        opt.close()
        opt = DiskSparseAdam(emb.parameters(), state_dir={str(tmp_path / "compact")!r}, state_format="compact")
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            step_rows(emb, opt, torch.randint(0, {rows}, (4096,), generator=gen))
        torch.save(opt.state_dict(), {str(tmp_path / "compact.saved.pt")!r})
        print("compact saved at step", opt.step_count(emb.weight), flush=True)
        opt.close()
    """, limit)
    assert out.returncode == 0, (out.returncode, peak, out.stdout, out.stderr[-2000:])
    assert "exact restored at step 5" in out.stdout and "compact saved at step 2" in out.stdout, out.stdout
    exact = RowStateFile(tmp_path / "exact" / "param0000.dsa", rows, dim, 2 * dim, torch.float32)
    assert exact.step == 5 and torch.equal(exact.records[sample], expected)
    exact.close()
    saved = torch.load(tmp_path / "compact.saved.pt", mmap=True)["state"][0]
    records = RowStateFile(tmp_path / "compact" / "param0000.dsa", rows, dim, compact.record_bytes(dim),
                           torch.uint8, state_format="compact")
    scale, v, codes = compact.views(records.records, dim)
    for key, want in (("exp_avg_scale", scale), ("exp_avg_sq", v), ("exp_avg_codes", codes)):
        assert torch.equal(saved[key], want), key
    records.close()
