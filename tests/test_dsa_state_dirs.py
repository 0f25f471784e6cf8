"""Where Disk Sparse Adam's state goes: private directories of killed processes are removed at the
next start (only those whose owner is gone), and a state_dir on a RAM filesystem is refused beyond
the memory available (warned about beyond a quarter of the limit) before any file is made."""

import os
import signal
import tempfile
import warnings

import pytest
import torch.nn as nn

from optim import DiskSparseAdam
from optim.disk_sparse import base, state_dirs
from optim.disk_sparse.store import StateFileError

def _child(tmp_path, kill):
    """A forked child that makes a private state_dir under ``tmp_path`` and reports it; then it is
    killed by SIGKILL (``kill``) or lives until the returned pipe is closed."""
    report_r, report_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, no return
        try:
            os.close(hold_w)
            os.close(report_r)
            tempfile.tempdir = str(tmp_path)
            opt = DiskSparseAdam(nn.Embedding(100, 4, sparse=True).parameters(), backend="torch")
            os.write(report_w, opt.state_dir.encode() + b"\n")
            if kill:
                os.kill(os.getpid(), signal.SIGKILL)
            os.read(hold_r, 1)
            opt.close()
        finally:
            os._exit(0)
    os.close(report_w)
    os.close(hold_r)
    with os.fdopen(report_r) as f:
        return pid, f.readline().strip(), hold_w


def test_a_private_dir_left_by_a_killed_process_is_removed_at_the_next_start(tmp_path, monkeypatch):
    """A child killed by SIGKILL leaves its private state_dir; the next optimizer's start removes it,
    and a directory of this pid with another start time (a recycled pid), but never that of a live
    process, of another pid namespace or without an owner in its name."""
    killed, dead_dir, _ = _child(tmp_path, kill=True)
    assert os.waitpid(killed, 0)[1] == signal.SIGKILL and os.path.isdir(dead_dir)
    live, live_dir, hold = _child(tmp_path, kill=False)
    try:
        assert os.path.isdir(live_dir)
        ns = state_dirs.pid_namespace()
        recycled = tmp_path / f"disk-sparse-adam-{os.getpid()}-1-{ns}-abc"  # this pid, another start time
        elsewhere = tmp_path / f"disk-sparse-adam-{os.getpid()}-1-{ns + 1}-abc"  # another pid namespace
        unnamed = tmp_path / "disk-sparse-adam-xyz"  # no owner recorded
        for d in (recycled, elsewhere, unnamed):
            d.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        opt = DiskSparseAdam(nn.Embedding(10, 4, sparse=True).parameters(), backend="torch")
        assert not os.path.exists(dead_dir) and not recycled.exists()
        assert os.path.isdir(live_dir) and elsewhere.is_dir() and unnamed.is_dir()
        assert os.path.dirname(opt.state_dir) == str(tmp_path)
        opt.close()
        assert not os.path.exists(opt.state_dir)
    finally:
        os.close(hold)
        os.waitpid(live, 0)
    assert not os.path.exists(live_dir)  # its own close


def _on_ram(monkeypatch, available, limit=None):
    monkeypatch.setattr(base, "filesystem_type", lambda path: "tmpfs")
    monkeypatch.setattr(base, "memory_available", lambda: available)
    monkeypatch.setattr(base, "memory_limit_bytes", lambda: limit)


def test_state_larger_than_memory_on_a_ram_filesystem_is_refused_before_any_file_is_made(tmp_path, monkeypatch):
    """Two tables of 1 MiB of state each, 1.5 MiB available: refused naming both sizes, and the
    first table's file (made before the second was refused) is removed with it."""
    _on_ram(monkeypatch, available=int(1.5 * 2**20))
    tables = [nn.Embedding(2**20 // 32, 4, sparse=True) for _ in range(2)]
    with pytest.raises(StateFileError, match=r"tmpfs filesystem.*needs 2\.0 MiB and 1\.5 MiB.*on a disk"):
        DiskSparseAdam([t.weight for t in tables], state_dir=tmp_path / "s")
    assert os.listdir(tmp_path / "s") == []
    with pytest.raises(StateFileError, match="tmpfs"):
        DiskSparseAdam([t.weight for t in tables])
    opt = DiskSparseAdam([tables[0].weight], state_dir=tmp_path / "s")  # one fits
    opt.close()


def test_a_real_ram_filesystem_is_told_apart(tmp_path, monkeypatch):
    if state_dirs.filesystem_type("/dev/shm") != "tmpfs" or not os.access("/dev/shm", os.W_OK):
        pytest.skip("needs a writable tmpfs at /dev/shm")
    monkeypatch.setattr(base, "memory_available", lambda: 2**20)
    d = tempfile.mkdtemp(dir="/dev/shm")
    try:
        with pytest.raises(StateFileError, match="tmpfs filesystem, which keeps files in memory"):
            DiskSparseAdam(nn.Embedding(2**20 // 16, 4, sparse=True).parameters(), state_dir=d)
        assert os.listdir(d) == []
    finally:
        os.rmdir(d)
    assert state_dirs.filesystem_type(tmp_path) != "tmpfs" or pytest.skip("tmp_path is on tmpfs")


def test_state_beyond_a_quarter_of_the_limit_on_a_ram_filesystem_warns_once(tmp_path, monkeypatch):
    _on_ram(monkeypatch, available=2**30, limit=4 * 2**20)
    tables = [nn.Embedding(2**20 // 32, 4, sparse=True) for _ in range(3)]
    with pytest.warns(UserWarning, match="tmpfs filesystem.*live in memory") as record:
        opt = DiskSparseAdam([t.weight for t in tables], state_dir=tmp_path / "s")
    assert len([w for w in record if "tmpfs" in str(w.message)]) == 1
    opt.close()
    monkeypatch.setattr(base, "filesystem_type", lambda path: "ext4")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DiskSparseAdam([t.weight for t in tables], state_dir=tmp_path / "t").close()


def test_filesystem_type_is_that_of_the_longest_mount_point_above_the_path(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\ntmpfs {tmp_path}/ram tmpfs rw 0 0\n"
                      f"tmpfs {tmp_path}/ramdisk\\040x tmpfs rw 0 0\n")
    assert state_dirs.filesystem_type(tmp_path / "ram" / "a", str(mounts)) == "tmpfs"
    assert state_dirs.filesystem_type(tmp_path / "ramx", str(mounts)) == "ext4"
    assert state_dirs.filesystem_type(tmp_path / "ramdisk x" / "s", str(mounts)) == "tmpfs"
    assert state_dirs.filesystem_type(tmp_path, str(tmp_path / "absent")) is None
