"""Memory cgroups (v1): put a process, or the rest of this one, under a memory budget.

    path = make_memory_cgroup("my-run", 2 * 2**30)    # None where no cgroup can be made
    path = enter_memory_cgroup("my-run", 2 * 2**30)   # this process from now on
    largest, smallest_failure = largest_that_fits(fits, start=64, lo=1, hi=4096)   # the size a budget allows
    # a child process in one: experiments/harness/child.py, run_child(cmd, memory=("my-run", 2 * 2**30))

A cgroup's limit counts the process's anonymous memory and the page cache it brings in. Making one
needs root and the v1 memory controller at ``CGROUP_ROOT``; every helper here returns None (or
runs without a limit) where that is missing, and every cgroup made here is removed after use; one
left by a process killed before it could remove its own (``<name>-<pid>-<n>``, that pid gone and the
cgroup empty) is removed when the next cgroup of that name is made.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import time

CGROUP_ROOT = "/sys/fs/cgroup/memory"
_SERIAL = itertools.count()


def cgroups_usable() -> bool:
    """Whether this process can make memory cgroups (root, v1 controller present)."""
    return os.geteuid() == 0 and os.path.isfile(os.path.join(CGROUP_ROOT, "cgroup.procs"))


def make_memory_cgroup(name, limit_bytes):
    """A new memory cgroup of ``limit_bytes`` (None: no limit), page cache included; its path, or
    None where this process cannot make one (not root, no v1 controller)."""
    if not cgroups_usable():
        return None
    remove_orphans(name)
    path = os.path.join(CGROUP_ROOT, f"{name}-{os.getpid()}-{next(_SERIAL)}")
    os.makedirs(path)
    if limit_bytes is not None:
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(int(limit_bytes)))
    return path


def remove_orphans(name) -> list:
    """Remove the empty cgroups ``<name>-<pid>-<n>`` whose making process is gone (killed before it
    removed them); the paths removed. A cgroup that still holds a process is kept."""
    removed = []
    prefix = f"{name}-"
    for entry in os.listdir(CGROUP_ROOT):
        pid, _, serial = entry[len(prefix):].partition("-")
        if not (entry.startswith(prefix) and pid.isdigit() and serial.isdigit()) or _alive(int(pid)):
            continue
        path = os.path.join(CGROUP_ROOT, entry)
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                if f.read().strip():
                    continue
        except OSError:
            continue
        if remove_memory_cgroup(path, tries=1):
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def join_memory_cgroup(path, pid=None):
    """Move process ``pid`` (default: this one) into the cgroup at ``path``. Memory it already
    holds stays charged where it was; what it allocates from now on counts against the limit."""
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(pid or os.getpid()))


def enter_memory_cgroup(name, limit_bytes):
    """Move this process into a new memory cgroup of ``limit_bytes``; its path, or None."""
    path = make_memory_cgroup(name, limit_bytes)
    if path is not None:
        join_memory_cgroup(path)
    return path


def remove_memory_cgroup(path, tries=50) -> bool:
    """Remove an emptied cgroup (its processes ended or moved out), its page cache charges going back
    to the parent; retried while the kernel still accounts a process's exit. False if it stayed."""
    if path is None:
        return True
    for _ in range(tries):
        try:
            with open(os.path.join(path, "memory.force_empty"), "w") as f:
                f.write("0")
        except OSError:
            pass
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.1)
    return False


def leave_memory_cgroup(path):
    """Move this process back to the root cgroup and remove ``path`` (after this process ends, if
    the kernel still holds its last charges there)."""
    if path is None:
        return
    join_memory_cgroup(CGROUP_ROOT)
    if not remove_memory_cgroup(path, tries=20):
        subprocess.Popen(["sh", "-c", f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 0.2; done; rmdir {path}"],
                         start_new_session=True)


def peak_usage(path) -> int:
    """The cgroup's peak charged bytes so far (0 where unknown)."""
    try:
        with open(os.path.join(path, "memory.max_usage_in_bytes")) as f:
            return int(f.read())
    except (OSError, ValueError, TypeError):
        return 0


def oom_kills(path) -> int:
    """How many processes the cgroup's OOM killer has killed (0 where unknown)."""
    try:
        with open(os.path.join(path, "memory.oom_control")) as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError, TypeError):
        pass
    return 0


def largest_that_fits(fits, start, lo, hi, grow=2.0, tol=1.1, max_trials=8):
    """The largest integer x in [lo, hi] with fits(x) (a size that runs in a memory budget): a
    geometric ladder from ``start``, then bisection until the smallest failure is within ``tol`` of
    the largest success; a trial that neither fits nor is killed for memory (fits returns None) ends
    the search. (largest or 0, smallest failure or None). Each trial is a run, so few are made."""
    ok, bad, x = 0, None, max(lo, min(hi, int(start)))
    for _ in range(max_trials):
        fit = fits(x)
        if fit is None:
            break
        if fit:
            ok = x
        else:
            bad = x
        if bad is not None and (bad <= lo or (ok and (bad <= ok * tol or bad - ok <= 1))):
            break
        if ok >= hi:
            break
        if bad is None:
            nxt = min(hi, max(x + 1, int(x * grow)))
        elif not ok:
            nxt = max(lo, min(x - 1, int(x / grow)))
        else:
            nxt = min(bad - 1, max(ok + 1, int(round(math.sqrt(ok * bad)))))
        x = nxt
    return ok, bad
