"""Disk Sparse Adam's state files across processes and crashes: a forked child never closes the
parent's files, a kill between two tables of a load leaves a directory that is refused, a reopened
sparse file is allocated (or fails at open on a full disk, naming the file), an existing state_dir
needs ``resume``, and a header step beyond int64 is refused naming the file."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from optim import DiskSparseAdam
from optim.disk_sparse.store import StateFileError
from tests.utils import sparse_embedding, step_random_rows

N, DIM = 200, 8


def _read_until(proc, word, timeout=120):
    """Lines the child prints until ``word``; the child is killed if that takes over ``timeout`` s."""
    import threading

    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if lines[-1] == word:
                return lines
    finally:
        timer.cancel()
    raise AssertionError(f"child never printed {word!r}; got {lines}; stderr: {proc.stderr.read()}")


# -- a forked child never closes its parent's state --------------------------------------------------
_FORK_CHILD = """
import fcntl, gc, os, sys
import torch
from optim import DiskSparseAdam
emb = torch.nn.Embedding(200, 8, sparse=True)
state_dir = None if sys.argv[1] == "private" else sys.argv[1]
opt = DiskSparseAdam(emb.parameters(), lr=1e-2, state_dir=state_dir, backend="torch")
emb(torch.tensor([1, 2, 3])).sum().backward()
opt.step()  # the file is now dirty, as in the middle of training
path = os.path.join(opt.state_dir, "param0000.dsa")
for how in ("with", "exit", "gc"):
    pid = os.fork()
    if pid == 0:
        if how == "with":
            with opt:
                pass
            sys.exit(0)
        if how == "exit":
            sys.exit(0)  # interpreter exit: atexit handlers and finalizers run
        del opt
        gc.collect()
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert os.path.exists(path), how  # the private state_dir is still there
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        raise SystemExit(f"lock released by the child ({how})")
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
emb(torch.tensor([4])).sum().backward()
opt.step()  # the parent goes on using its state
print(opt.state_dir, flush=True)
print("ready", flush=True)
import time
time.sleep(300)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["given", "private"])
def test_forked_child_never_closes_the_parents_state(tmp_path, where):
    state_dir = str(tmp_path / "s") if where == "given" else "private"
    proc = subprocess.Popen([sys.executable, "-c", _FORK_CHILD, state_dir], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = _read_until(proc, "ready")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    # Killed mid-training, the parent leaves a dirty file: reopening it is refused, as it would be
    # had the children never existed.
    with pytest.raises(StateFileError, match="dirty"):
        DiskSparseAdam(sparse_embedding(N, DIM, seed=0).parameters(), state_dir=lines[-2], resume=True)
    if where == "private":
        import shutil

        shutil.rmtree(lines[-2])


# -- a load into several tables is all or nothing -----------------------------------------------------
_KILLED_BETWEEN_TABLES = """
import os, signal, sys
import torch
from optim import DiskSparseAdam
from optim.disk_sparse import store

def tables(state_dir, steps):
    embs = [torch.nn.Embedding(50, 4, sparse=True) for _ in range(3)]
    opt = DiskSparseAdam([e.weight for e in embs], state_dir=state_dir, backend="torch")
    for _ in range(steps):
        opt.zero_grad()
        for e in embs:
            e(torch.tensor([1, 7, 7])).sum().backward()
        opt.step()
    return opt

opt = tables(sys.argv[1], 5)
opt.flush()  # a clean point at step 5
sd = tables(None, 10).state_dict()
write_all = store.RowStateFile.write_all

def write_then_die(self, columns, step):
    write_all(self, columns, step)
    os.kill(os.getpid(), signal.SIGKILL)  # killed after the first table's write

store.RowStateFile.write_all = write_then_die
opt.load_state_dict(sd)
"""


@pytest.mark.timeout(120)
def test_kill_between_two_tables_of_a_load_leaves_a_refused_directory(tmp_path):
    out = subprocess.run([sys.executable, "-c", _KILLED_BETWEEN_TABLES, str(tmp_path / "s")],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == -signal.SIGKILL, out.stderr
    embs = [sparse_embedding(50, 4, seed=0) for _ in range(3)]
    with pytest.raises(StateFileError, match="param0001.dsa is dirty"):
        DiskSparseAdam([e.weight for e in embs], state_dir=tmp_path / "s", resume=True)


# -- a reopened sparse file is allocated ----------------------------------------------------------------
def _sparse_copy(state_dir):
    """Rewrite the (clean, all-zero) state file as a sparse file: the header, then a hole."""
    path = os.path.join(state_dir, "param0000.dsa")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header = f.read(4096)
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(size)
    return path


def test_reopened_sparse_file_is_allocated(tmp_path):
    DiskSparseAdam(sparse_embedding(20000, 16, seed=0).parameters(), state_dir=tmp_path).close()
    path = _sparse_copy(tmp_path)
    st = os.stat(path)
    assert st.st_blocks * 512 < st.st_size  # a hole
    with DiskSparseAdam(sparse_embedding(20000, 16, seed=0).parameters(), state_dir=tmp_path, resume=True):
        st = os.stat(path)
        assert st.st_blocks * 512 >= st.st_size


def test_reopened_sparse_file_on_a_full_disk_fails_at_open_naming_the_file(tmp_path, monkeypatch):
    import errno

    DiskSparseAdam(sparse_embedding(20000, 16, seed=0).parameters(), state_dir=tmp_path).close()
    _sparse_copy(tmp_path)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"disk space for state file .*param0000.dsa"):
        DiskSparseAdam(sparse_embedding(20000, 16, seed=0).parameters(), state_dir=tmp_path, resume=True)


# -- reusing a state_dir is the caller's explicit choice ----------------------------------------------
def test_existing_state_dir_needs_resume(tmp_path):
    emb = sparse_embedding(N, DIM, seed=0)
    with DiskSparseAdam(emb.parameters(), lr=1e-2, state_dir=tmp_path, backend="torch") as opt:
        for t in range(4):
            step_random_rows(emb, opt, t)
        expected = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state_dict()["state"][0].items()}
    # A second run of the same script must not continue the first one's moments unasked.
    with pytest.raises(StateFileError, match="already holds state files.*resume=True.*load_state_dict"):
        DiskSparseAdam(sparse_embedding(N, DIM, seed=0).parameters(), state_dir=tmp_path)
    with DiskSparseAdam(emb.parameters(), state_dir=tmp_path, resume=True) as opt:  # with the weights of step 4
        assert opt.state_files()[0].step == 4  # the header says which step the file holds
        got = opt.state_dict()["state"][0]
        assert int(got["step"]) == 4
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[key], expected[key]), key


def test_header_step_beyond_int64_is_refused_naming_the_file(tmp_path):
    import struct

    DiskSparseAdam(sparse_embedding(N, DIM, seed=0).parameters(), state_dir=tmp_path).close()
    path = tmp_path / "param0000.dsa"
    with open(path, "r+b") as f:
        f.seek(8 + 4 + 4 + 8 * 3)  # magic, version, dtype, rows, cols, width: then the step
        f.write(struct.pack("<Q", 2**63))
    with pytest.raises(StateFileError, match="param0000.dsa.*step"):
        DiskSparseAdam(sparse_embedding(N, DIM, seed=0).parameters(), state_dir=tmp_path, resume=True)
