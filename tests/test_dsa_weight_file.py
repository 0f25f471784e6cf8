"""Embedding weights in a memory-mapped file (``optim.disk_sparse.weights.mapped_embedding``).

A mapped table trains exactly as the same table in RAM (both with ``torch.optim.SparseAdam``'s
update, bitwise); the weight file is flushed with the state files and carries their step; a process
SIGKILLed while stepping leaves a weight file and state directory that are both refused, and a
restore from the checkpoint it saved continues bitwise like a run never killed. A process killed
after ``flush()`` (idle) leaves both clean at one step, and resuming them continues bitwise.
A kill while a weight file is filled leaves it refused; sharded weight files are flushed with the
state.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam, mapped_embedding
from optim.disk_sparse.store import StateFileError
from optim.disk_sparse.weights import close_mapped
from tests.utils import run_python

ROWS, DIM = 300, 6


def _batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, ROWS, (40,), generator=gen) for _ in range(n)]


def _steps(emb, opt, batches):
    for idx in batches:
        emb.weight.grad = None
        out = emb(idx) if isinstance(emb, nn.Embedding) else emb(idx.view(8, 5))
        out.pow(2).sum().backward()
        opt.step()


@pytest.mark.parametrize("bag", [False, True], ids=["Embedding", "EmbeddingBag"])
def test_mapped_table_trains_like_a_table_in_ram(tmp_path, bag):
    emb = mapped_embedding(tmp_path / "w", ROWS, DIM, bag=bag, mode="sum", seed=3)
    ram = (nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True) if bag else nn.Embedding(ROWS, DIM, sparse=True))
    ram.weight.data.copy_(emb.weight)
    batches = _batches(6)
    with DiskSparseAdam(emb.parameters(), lr=0.01, state_dir=tmp_path / "s") as opt:
        _steps(emb, opt, batches)
    ref = torch.optim.SparseAdam(list(ram.parameters()), lr=0.01)
    _steps(ram, ref, batches)
    assert torch.equal(emb.weight, ram.weight)
    close_mapped(emb)
    again = mapped_embedding(tmp_path / "w", ROWS, DIM, bag=bag)  # the flushed file, reopened
    assert torch.equal(again.weight, ram.weight)
    with pytest.raises(StateFileError, match="in use"):
        mapped_embedding(tmp_path / "w", ROWS, DIM)
    with pytest.raises(ValueError, match="padding_idx"):
        mapped_embedding(tmp_path / "w2", ROWS, DIM, padding_idx=0)
    assert not os.path.exists(tmp_path / "w2")
    close_mapped(again)


_CHILD = textwrap.dedent("""
    import sys, time, torch
    from optim import DiskSparseAdam
    from optim.disk_sparse.weights import mapped_embedding
    from tests.test_dsa_weight_file import ROWS, DIM, _batches, _steps
    d, mode = sys.argv[1], sys.argv[2]
    emb = mapped_embedding(d + "/w", ROWS, DIM, seed=5)
    opt = DiskSparseAdam(emb.parameters(), lr=0.01, state_dir=d + "/s")
    batches = _batches(200)
    _steps(emb, opt, batches[:3])
    torch.save({"model": emb.state_dict(), "opt": opt.state_dict()}, d + "/ckpt.pt")
    opt.flush()
    print("flushed", flush=True)
    if mode == "idle":
        time.sleep(600)
    _steps(emb, opt, batches[3:])   # killed somewhere in here
    time.sleep(600)
""")


def _uninterrupted(tmp_path, n):
    emb = nn.Embedding(ROWS, DIM, sparse=True)
    init = mapped_embedding(tmp_path / "init", ROWS, DIM, seed=5)
    emb.weight.data.copy_(init.weight)
    close_mapped(init)
    with DiskSparseAdam(emb.parameters(), lr=0.01) as opt:
        _steps(emb, opt, _batches(200)[:n])
    return emb.weight.detach().clone()


def _run_child(d, mode):
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(d), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "flushed", proc.stderr.read() if proc.poll() is not None else line
        if mode == "stepping":
            import time
            time.sleep(0.3)  # in the middle of the 197 further steps
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def test_sigkill_while_stepping_refuses_both_files_and_the_checkpoint_restores(tmp_path):
    _run_child(tmp_path, "stepping")
    with pytest.raises(StateFileError, match="dirty"):
        mapped_embedding(tmp_path / "w", ROWS, DIM)
    probe = nn.Embedding(ROWS, DIM, sparse=True)
    with pytest.raises(StateFileError, match="dirty"):
        DiskSparseAdam(probe.parameters(), state_dir=tmp_path / "s", resume=True)
    ckpt = torch.load(tmp_path / "ckpt.pt")
    emb = mapped_embedding(tmp_path / "w-restored", ROWS, DIM)
    emb.load_state_dict(ckpt["model"])
    with DiskSparseAdam(emb.parameters(), lr=0.01, state_dir=tmp_path / "s-restored") as opt:
        opt.load_state_dict(ckpt["opt"])
        _steps(emb, opt, _batches(200)[3:5])
    assert torch.equal(emb.weight, _uninterrupted(tmp_path, 5))
    close_mapped(emb)


def test_sigkill_after_flush_resumes_both_files(tmp_path):
    _run_child(tmp_path, "idle")
    emb = mapped_embedding(tmp_path / "w", ROWS, DIM)
    with DiskSparseAdam(emb.parameters(), lr=0.01, state_dir=tmp_path / "s", resume=True) as opt:
        _steps(emb, opt, _batches(200)[3:5])
    assert torch.equal(emb.weight, _uninterrupted(tmp_path, 5))
    close_mapped(emb)
    # a weight file at another step than its state directory is refused
    emb = mapped_embedding(tmp_path / "w-other", ROWS, DIM)
    with pytest.raises(StateFileError, match="step 0 but state file"):
        DiskSparseAdam(emb.parameters(), lr=0.01, state_dir=tmp_path / "s", resume=True)
    close_mapped(emb)


@pytest.mark.parametrize("staging", [False, True], ids=["direct", "staged"])
def test_mapped_table_with_announcements_equals_sparse_adam(tmp_path, staging):
    emb = mapped_embedding(tmp_path / "w", ROWS, DIM, seed=7)
    ram = nn.Embedding(ROWS, DIM, sparse=True)
    ram.weight.data.copy_(emb.weight)
    batches = _batches(8, seed=4)
    with DiskSparseAdam(emb.parameters(), lr=0.01, state_dir=tmp_path / "s", staging=staging) as opt:
        for k, idx in enumerate(batches):
            if k + 1 < len(batches):
                opt.prefetch(batches[k + 1])
            opt.state_files()[0].drop_cache()
            _steps(emb, opt, [idx])
    ref = torch.optim.SparseAdam(list(ram.parameters()), lr=0.01)
    _steps(ram, ref, batches)
    assert torch.equal(emb.weight, ram.weight)
    close_mapped(emb)


def test_a_kill_while_a_weight_file_is_filled_leaves_it_refused(tmp_path):
    path = tmp_path / "w.dsa"
    out = run_python(f"""
        import os, signal
        from optim.disk_sparse import weights
        real = weights._fill_normal
        def killed_half_way(records, std, seed, chunk_rows=1 << 16):
            real(records[: records.shape[0] // 2], std, seed)
            os.kill(os.getpid(), signal.SIGKILL)
        weights._fill_normal = killed_half_way
        weights.mapped_embedding({str(path)!r}, 4000, 8)
    """)
    assert out.returncode == -signal.SIGKILL, out.stderr
    with pytest.raises(StateFileError, match="dirty"):
        mapped_embedding(path, 4000, 8)


def test_sharded_weight_files_are_flushed_with_the_state(tmp_path):
    """A ShardedEmbedding's weight shard is a weight file like mapped_embedding's: flush() writes it
    clean at the optimizer's step; a process killed after more steps leaves it dirty (refused)."""
    from optim.disk_sparse.weights import WeightFile

    out = run_python(f"""
        import os, signal, torch, torch.distributed as dist
        from optim.disk_sparse.sharded import ShardedEmbedding, open_optimizer
        from optim.disk_sparse.weights import weight_file
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdv", rank=0, world_size=1)
        emb = ShardedEmbedding(100, 4, weight_dir={str(tmp_path / "w")!r})
        opt = open_optimizer(emb, {str(tmp_path / "s")!r}, lr=0.1)
        def step():
            opt.zero_grad()
            emb(torch.tensor([1, 2, 3])).sum().backward()
            opt.step()
        for _ in range(3):
            step()
        opt.flush()
        print("clean at", weight_file(emb.weight).step, flush=True)
        step()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert "clean at 3" in out.stdout, out.stdout + out.stderr
    with pytest.raises(StateFileError, match="dirty"):
        WeightFile(str(tmp_path / "w" / "rank0-of-1.float32.weight"), 100, 4, torch.float32)
