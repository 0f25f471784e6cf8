"""Where Disk Sparse Adam's state goes: private directories of killed processes are removed at the
next start (only those of this host whose owner is gone), a state_dir on a RAM filesystem is
refused beyond the memory available (warned about beyond a quarter of the limit) before any file
is made, a state file deleted or replaced under an open optimizer is refused, and a resume knows
its tables by name and refuses another number of ranks, extra files, or unnamed tables in another
order."""

import os
import signal
import subprocess
import tempfile
import warnings

import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam
from optim.disk_sparse import state_dirs
from optim.disk_sparse.store import StateFileError
from tests.utils import index_batches, run_python, step_rows

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
        ns, host = state_dirs.pid_namespace(), state_dirs.host_identity()
        recycled = tmp_path / f"disk-sparse-adam-{os.getpid()}-1-{ns}-{host}-abc"  # this pid, another start time
        elsewhere = tmp_path / f"disk-sparse-adam-{os.getpid()}-1-{ns + 1}-{host}-abc"  # another pid namespace
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


def test_a_private_dir_of_another_host_is_left_alone(tmp_path, monkeypatch):
    """On a $TMPDIR that hosts share (a cluster's scratch), the pid namespace's number is the same on
    every host, so only the host tells whose a directory is: one named after another host (another
    boot id) whose pid is dead here is left alone, and so is one named without a host (it cannot be
    told); one of this host whose owner is gone is removed."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid runs no process here now
    ns, host = state_dirs.pid_namespace(), state_dirs.host_identity()
    other = "0" * 12 if host != "0" * 12 else "1" * 12
    here = tmp_path / f"disk-sparse-adam-{gone.pid}-1-{ns}-{host}-abc"
    other_host = tmp_path / f"disk-sparse-adam-{gone.pid}-1-{ns}-{other}-abc"
    no_host = tmp_path / f"disk-sparse-adam-{gone.pid}-1-{ns}-abc"
    for d in (here, other_host, no_host):
        d.mkdir()
        (d / "param0000.dsa").write_bytes(b"")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    DiskSparseAdam(nn.Embedding(10, 4, sparse=True).parameters(), backend="torch").close()
    assert not here.exists()
    assert other_host.is_dir() and no_host.is_dir()


def test_the_host_identity_is_a_short_hash_of_the_boot_id(tmp_path):
    """Two boot ids give two identities, one boot id always the same; no boot id, none."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("ac256736-bdcf-4b26-bb05-5857eccd9a5d\n")
    b.write_text("0f1e2d3c-bdcf-4b26-bb05-5857eccd9a5d\n")
    ha, hb = state_dirs.host_identity(str(a)), state_dirs.host_identity(str(b))
    assert len(ha) == len(hb) == 12 and ha != hb and ha == state_dirs.host_identity(str(a))
    assert state_dirs.host_identity(str(tmp_path / "missing")) is None


def _on_ram(monkeypatch, available, limit=None):
    monkeypatch.setattr(state_dirs, "filesystem_type", lambda path: "tmpfs")
    monkeypatch.setattr(state_dirs, "memory_available", lambda: available)
    monkeypatch.setattr(state_dirs, "memory_limit_bytes", lambda: limit)


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
    monkeypatch.setattr(state_dirs, "memory_available", lambda: 2**20)
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
    monkeypatch.setattr(state_dirs, "filesystem_type", lambda path: "ext4")
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


ROWS, DIM = 300, 6


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_state_file_deleted_or_replaced_under_the_optimizer_is_refused(tmp_path, how):
    emb = nn.Embedding(ROWS, DIM, sparse=True)
    opt = DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "s")
    step_rows(emb, opt, index_batches(1, ROWS)[0])
    path = opt.state_file(emb.weight).path
    os.unlink(path)
    if how == "replaced":
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    with pytest.raises(StateFileError, match=how):
        opt.flush()
    with pytest.raises(StateFileError, match=how):
        opt.close()
    assert opt._closed  # released all the same: nothing is locked or mapped any more


def test_resume_on_another_number_of_ranks_is_refused(tmp_path):
    (tmp_path / "state" / "rank0-of-2").mkdir(parents=True)
    out = run_python(f"""
        import torch.distributed as dist
        from optim.disk_sparse.sharded import ShardedEmbedding, open_optimizer
        from optim.disk_sparse.store import StateFileError
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdv", rank=0, world_size=1)
        emb = ShardedEmbedding(10, 4)
        try:
            open_optimizer(emb, {str(tmp_path / "state")!r}, resume=True)
        except StateFileError as exc:
            print("refused:", exc)
        dist.destroy_process_group()
    """)
    assert "refused:" in out.stdout and "another number of ranks" in out.stdout and "DCP" in out.stdout, \
        out.stdout + out.stderr


def test_resume_knows_tables_by_name_and_refuses_extra_files(tmp_path):
    """Two same-shape tables given by name: resumed in the other order they are refused (by
    position they would swap moments silently); a resume that leaves state files out is refused."""
    a, b = nn.Embedding(ROWS, DIM, sparse=True), nn.Embedding(ROWS, DIM, sparse=True)
    opt = DiskSparseAdam([("a.weight", a.weight), ("b.weight", b.weight)], state_dir=tmp_path / "s")
    opt.zero_grad()
    (a(torch.tensor([1])).sum() + b(torch.tensor([2])).sum()).backward()
    opt.step()
    opt.close()
    with pytest.raises(StateFileError, match="holds the state of parameter 'a.weight'.*'b.weight'.*another order"):
        DiskSparseAdam([("b.weight", b.weight), ("a.weight", a.weight)], state_dir=tmp_path / "s", resume=True)
    with pytest.raises(StateFileError, match="more parameters than this optimizer has.*param0001.dsa"):
        DiskSparseAdam([("a.weight", a.weight)], state_dir=tmp_path / "s", resume=True)
    again = DiskSparseAdam([("a.weight", a.weight), ("b.weight", b.weight)], state_dir=tmp_path / "s", resume=True)
    assert again.step_count(a.weight) == again.step_count(b.weight) == 1
    again.close()


def test_a_resume_of_unnamed_tables_in_another_order_is_refused(tmp_path):
    """Two same-shape tables given without names: resumed in the other order they would swap
    moments and steps silently; the weights' fingerprints recorded at close tell, and the resume
    is refused naming both files. In the trained order it resumes."""
    a, b = nn.Embedding(ROWS, DIM, sparse=True), nn.Embedding(ROWS, DIM, sparse=True)
    opt = DiskSparseAdam([a.weight, b.weight], state_dir=tmp_path / "s")
    for _ in range(2):
        opt.zero_grad()
        (a(torch.tensor([1, 5])).sum() + b(torch.tensor([2])).sum()).backward()
        opt.step()
    opt.zero_grad()
    a(torch.tensor([3])).sum().backward()
    opt.step()
    opt.close()
    with pytest.raises(StateFileError, match=r"parameter 0.*param0001\.dsa \(parameter 1\).*another order"):
        DiskSparseAdam([b.weight, a.weight], state_dir=tmp_path / "s", resume=True)
    again = DiskSparseAdam([a.weight, b.weight], state_dir=tmp_path / "s", resume=True)
    assert (again.step_count(a.weight), again.step_count(b.weight)) == (3, 2)
    again.close()
