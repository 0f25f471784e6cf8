"""DiskSparseAdam checkpoints: resuming a state_dir, the private state_dir's removal, and SIGKILL
crashes. State-dict round trips (into a fresh optimizer, into SparseAdam and back) are in
``tests/test_protocol.py``."""

import os
import random
import signal
import time

import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam
from optim.disk_sparse.store import StateFileError

N, DIM, BATCH = 300, 12, 64



def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Embedding(N, DIM, sparse=True)


def _train_steps(emb, opt, start, stop):
    """Steps start+1..stop; the batch of step t depends only on t, so runs can resume anywhere."""
    for t in range(start + 1, stop + 1):
        gen = torch.Generator().manual_seed(t)
        idx = torch.randint(0, N // 4, (BATCH,), generator=gen)
        target = torch.randn(BATCH, DIM, generator=gen)
        opt.zero_grad()
        ((emb(idx) - target) ** 2).mean().backward()
        opt.step()


def test_reopen_clean_state_dir_resumes(tmp_path):
    emb_a = _model()
    with DiskSparseAdam(emb_a.parameters(), lr=1e-2, state_dir=tmp_path / "a") as opt:
        _train_steps(emb_a, opt, 0, 50)
        expected = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state_dict()["state"][0].items()}
        opt.flush()
        _train_steps(emb_a, opt, 50, 70)
    # Closing made the files clean at step 70; reopening with resume=True continues there.
    emb_b = _model()
    with DiskSparseAdam(emb_b.parameters(), lr=1e-2, state_dir=tmp_path / "b") as opt_b:
        _train_steps(emb_b, opt_b, 0, 50)
        assert torch.equal(opt_b.state_dict()["state"][0]["exp_avg"], expected["exp_avg"])
    emb_b2 = _model()
    emb_b2.load_state_dict(emb_b.state_dict())
    with DiskSparseAdam(emb_b2.parameters(), lr=1e-2, state_dir=tmp_path / "b", resume=True) as opt_b2:
        assert int(opt_b2.state_dict()["state"][0]["step"]) == 50
        _train_steps(emb_b2, opt_b2, 50, 70)
    assert torch.equal(emb_b2.weight, emb_a.weight)


def test_temporary_state_dir_removed_at_close():
    emb = _model()
    opt = DiskSparseAdam(emb.parameters())
    d = opt.state_dir
    assert os.path.isdir(d) and os.listdir(d)
    opt.close()
    opt.close()
    assert not os.path.exists(d)


_EXIT_WITHOUT_CLOSE = """
import sys
import torch
from optim import DiskSparseAdam
emb = torch.nn.Embedding(3000, 16, sparse=True)
opt = DiskSparseAdam(emb.parameters())
emb(torch.tensor([1, 2, 2])).sum().backward()
opt.step()
view = opt.state_dict()["state"][0]["exp_avg"].numpy()  # a live view of the state in a global
print(opt.state_dir)
"""


def test_temporary_state_dir_removed_when_the_process_exits_without_close(tmp_path):
    """A script that never closes its optimizer must not leave the (table-sized) private state
    file behind, even when a view of the state keeps the optimizer alive into interpreter shutdown."""
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_CLOSE], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    state_dir = out.stdout.strip().splitlines()[-1]
    assert state_dir.startswith(str(tmp_path))
    assert not os.path.exists(state_dir)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("disk-sparse-adam-")]


# -- crash safety ---------------------------------------------------------------------------------
TOTAL = 120


def _worker(state_dir, ckpt, total, out, hold_at=None):
    """Train to ``total`` steps, resuming from ``ckpt`` if it exists; checkpoint every 5 steps.

    With ``hold_at``, stop stepping there and wait, live and dirty, to be killed (so a fast worker
    cannot finish before the test's kill lands).
    """
    emb = _model()
    opt = DiskSparseAdam(emb.parameters(), lr=1e-2, state_dir=state_dir)
    start = 0
    if os.path.exists(ckpt):
        c = torch.load(ckpt)
        emb.load_state_dict(c["model"])
        opt.load_state_dict(c["opt"])
        start = c["step"]
    for t in range(start, total):
        while hold_at is not None and t >= hold_at:
            time.sleep(1)
        _train_steps(emb, opt, t, t + 1)
        if (t + 1) % 5 == 0:
            torch.save({"model": emb.state_dict(), "opt": opt.state_dict(), "step": t + 1}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
            os.write(out, f"{t + 1}\n".encode())
    torch.save({"weight": emb.weight.detach().clone(), "state": opt.state_dict()["state"][0]}, ckpt + ".final")
    opt.close()


def _spawn(state_dir, ckpt, hold_at=None):
    """Fork a training process (a fresh interpreter would spend most of the test importing torch)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: train, then leave without running pytest's teardown
        code = 1
        try:
            os.close(r)
            _worker(str(state_dir), ckpt, TOTAL, w, hold_at)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    return pid, os.fdopen(r)


def _wait(pid, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise TimeoutError("training process did not finish in time")


@pytest.mark.timeout(180)
def test_sigkill_restart_from_checkpoint_is_identical(tmp_path):
    rng = random.Random(os.getpid())
    ckpt = str(tmp_path / "ckpt.pt")
    reached = 0
    for crash in range(3):
        # Kill at a random moment after a random checkpoint past the previous crash; the worker
        # waits a few steps past it (live, dirty) in case this process is slow to kill.
        target = reached + 5 * rng.randint(1, 4)
        pid, progress = _spawn(tmp_path / f"run{crash}", ckpt, hold_at=target + 5 * rng.randint(1, 3))
        try:
            for line in progress:
                if int(line) >= target:
                    break
            time.sleep(rng.uniform(0.0, 0.05))
            os.kill(pid, signal.SIGKILL)
            status = _wait(pid, 30)
        finally:
            progress.close()
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"worker ended: {status}"
        reached = torch.load(ckpt)["step"]
        assert reached >= target
        # The killed process's live state is dirty: reopening it must be refused, not used.
        with pytest.raises(StateFileError, match="dirty.*Restore the last checkpoint"):
            DiskSparseAdam(_model().parameters(), state_dir=tmp_path / f"run{crash}", resume=True)
    pid, progress = _spawn(tmp_path / "final", ckpt)
    progress.read()
    progress.close()
    status = _wait(pid, 120)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    resumed = torch.load(ckpt + ".final")

    emb = _model()
    with DiskSparseAdam(emb.parameters(), lr=1e-2, state_dir=tmp_path / "uninterrupted") as opt:
        _train_steps(emb, opt, 0, TOTAL)
        assert torch.equal(resumed["weight"], emb.weight)
        st = opt.state_dict()["state"][0]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(resumed["state"][key], st[key]), key
        assert int(resumed["state"]["step"]) == int(st["step"]) == TOTAL


def test_a_dirty_state_file_names_a_restore_that_streams_a_checkpoint_larger_than_memory(tmp_path):
    """The dirty-file error's recipe is torch.load(checkpoint, mmap=True): without mmap the whole
    checkpoint is read into memory before load_state_dict writes it back in chunks."""
    from optim.disk_sparse.store import RowStateFile, StateFileError

    f = RowStateFile(tmp_path / "p.dsa", 10, 4, 8, torch.float32)
    f.mark_dirty()
    f._release()  # as a process killed in the middle of a step leaves it
    with pytest.raises(StateFileError, match=r"dirty.*torch\.load\(checkpoint, mmap=True\)"):
        RowStateFile(tmp_path / "p.dsa", 10, 4, 8, torch.float32)


def test_a_restore_writes_back_at_most_an_eighth_of_the_memory_limit_at_a_time(tmp_path, monkeypatch):
    """write_all (load_state_dict's writer) writes the records back in pieces of at most an eighth
    of the memory limit (under 64 MiB), each before the next is dirtied: a memory cgroup cannot
    reclaim dirty pages before they are written, so a 64 MiB piece in a small cgroup was killed
    for memory. The records then hold the loaded columns exactly."""
    from optim.disk_sparse import store

    limit = 8 << 20
    monkeypatch.setattr(store, "memory_limit_bytes", lambda: limit)
    rows, cols = 40_000, 16  # 5 MiB of [m | v] records
    f = store.RowStateFile(tmp_path / "s.dsa", rows, cols, 2 * cols, torch.float32)
    mapping, flushed = f._mm, []

    class Recording:  # the mapping, recording the byte ranges written back
        def flush(self, *span):
            flushed.append(span)
            return mapping.flush(*span)

        def __getattr__(self, name):
            return getattr(mapping, name)

    f._mm = Recording()
    m, v = torch.randn(rows, cols), torch.rand(rows, cols)
    f.write_all([m, v], step=5)
    f._mm = mapping
    pieces = [span[1] for span in flushed if span]
    assert len(pieces) >= 5 and max(pieces) <= limit // 8 + 4096, pieces
    assert torch.equal(f.records[:, :cols], m) and torch.equal(f.records[:, cols:], v) and f.step == 5
    f.close()
