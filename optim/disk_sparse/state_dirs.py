"""Where the state files go: private temporary directories, and state_dirs that live in RAM.

``state_dir=None`` makes a private directory under ``tempfile.gettempdir()`` (``$TMPDIR``, else
``/tmp``), named after its owner: ``disk-sparse-adam-<pid>-<start>-<ns>-<random>``, where ``<start>``
is the process's start time (``/proc/<pid>/stat``, so a recycled pid is not taken for the owner) and
``<ns>`` its pid namespace (a process of another container sharing ``/tmp`` is never judged).
``close()`` removes it; a process killed before that leaves it behind, so each new private directory
first removes those whose owner is gone (``remove_orphans``). A directory whose owner cannot be told
(another naming, another namespace, no ``/proc``) is left alone, and so is one with a locked state file.

A state_dir on a RAM filesystem (tmpfs, ramfs: ``/dev/shm``, often ``/tmp`` in containers) holds the
"disk" state in memory. ``check_ram_state`` refuses state larger than the memory available there
(the process would be killed for memory inside the constructor) and warns about state larger than
a quarter of the memory limit (the optimizer warns once).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

from .store import StateFileError, locked_state_file, memory_limit_bytes

PREFIX = "disk-sparse-adam-"
_OWNED = re.compile(re.escape(PREFIX) + r"(\d+)-(\d+)-(\d+)-[^-]+$")
RAM_FILESYSTEMS = ("tmpfs", "ramfs")
WARN_FRACTION = 0.25  # of the memory limit: RAM-backed state beyond this gets a warning


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (None: no such process, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count fields after its last ')'
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[19])  # field 22 of the line


def pid_namespace() -> int | None:
    """The inode of this process's pid namespace (None without /proc)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def make_private_dir() -> str:
    """A new private state_dir under ``tempfile.gettempdir()`` named after this process, after
    removing the private directories of processes that are gone."""
    me, start, ns = os.getpid(), process_start(os.getpid()), pid_namespace()
    if start is None or ns is None:  # the owner could never be told: a plain temporary name
        return tempfile.mkdtemp(prefix=PREFIX)
    remove_orphans(tempfile.gettempdir(), ns)
    return tempfile.mkdtemp(prefix=f"{PREFIX}{me}-{start}-{ns}-")


def remove_orphans(parent, ns: int) -> list:
    """Remove the private state_dirs in ``parent`` whose owner (pid and start time, in namespace
    ``ns``) is gone and none of whose state files is locked; return their paths."""
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        m = _OWNED.match(name)
        if m is None or int(m.group(3)) != ns:
            continue
        pid, start = int(m.group(1)), int(m.group(2))
        if process_start(pid) == start:
            continue  # the owner lives
        path = os.path.join(parent, name)
        try:
            if not os.path.isdir(path) or os.path.islink(path) or os.stat(path).st_uid != uid:
                continue
            if locked_state_file(path) is not None:
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def filesystem_type(path, mounts: str = "/proc/mounts") -> str | None:
    """The file system type of the mount holding ``path`` (the longest mount point above it in
    ``mounts``), or None if it cannot be told."""
    real = os.path.realpath(path)
    best, kind = -1, None
    try:
        with open(mounts) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                point = parts[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) > best:
                    best, kind = len(point), parts[2]
    except OSError:
        return None
    return kind


def memory_available(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes that can still be allocated: ``MemAvailable``, at most the memory limit (None if unknown)."""
    values = []
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    values.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    limit = memory_limit_bytes()
    if limit is not None:
        values.append(limit)
    return min(values) if values else None


def check_ram_state(state_dir, nbytes: int, kind: str | None, available: int | None,
                    limit: int | None) -> str | None:
    """For ``nbytes`` of new state in ``state_dir`` on a filesystem of type ``kind``: refuse it on a
    RAM filesystem beyond the memory ``available``; return a warning beyond ``WARN_FRACTION`` of
    the memory ``limit`` (None otherwise, and for other filesystems)."""
    if kind not in RAM_FILESYSTEMS:
        return None
    mib = 2**20
    fix = ("give a state_dir on a disk (for state_dir=None: set TMPDIR, or tempfile.tempdir, to a "
           "directory on a disk)")
    if available is not None and nbytes > available:
        raise StateFileError(
            f"state_dir {state_dir} is on a {kind} filesystem, which keeps files in memory: the state "
            f"needs {nbytes / mib:.1f} MiB and {available / mib:.1f} MiB of memory is available, so the "
            f"process would be killed for memory while the files are made. {fix[0].upper()}{fix[1:]}")
    if limit is not None and nbytes > WARN_FRACTION * limit:
        return (f"state_dir {state_dir} is on a {kind} filesystem: its {nbytes / mib:.1f} MiB of state live "
                f"in memory ({nbytes / limit:.0%} of the {limit / mib:.0f} MiB memory limit), not on a disk. "
                f"To keep it out of memory, {fix}")
    return None
