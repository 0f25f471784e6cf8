"""Memory cgroups (v1): run a process, or the rest of this one, under a memory budget.

    path = make_memory_cgroup("my-run", 2 * 2**30)    # None where no cgroup can be made
    run = run_limited([sys.executable, "-c", code], 2 * 2**30, name="my-run", timeout=600)
    run.outcome        # "ok", "killed for memory", "timeout" or "exit N"

A cgroup's limit counts the process's anonymous memory and the page cache it brings in. Making one
needs root and the v1 memory controller at ``CGROUP_ROOT``; every helper here returns None (or
runs without a limit) where that is missing, and every cgroup made here is removed after use.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from dataclasses import dataclass

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
    path = os.path.join(CGROUP_ROOT, f"{name}-{os.getpid()}-{next(_SERIAL)}")
    os.makedirs(path)
    if limit_bytes is not None:
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(int(limit_bytes)))
    return path


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


@dataclass
class Limited:
    """How a process run under a memory limit ended."""

    returncode: int | None  # None: timed out
    stdout: str
    stderr: str
    peak_bytes: int  # the cgroup's peak charge (0 without a cgroup)
    oom_killed: bool
    limited: bool  # False where no cgroup could be made (the process ran without a limit)

    @property
    def outcome(self) -> str:
        if self.oom_killed:
            return "killed for memory"
        if self.returncode is None:
            return "timeout"
        return "ok" if self.returncode == 0 else f"exit {self.returncode}"


def run_limited(cmd, limit_bytes, *, name, timeout=None, env=None, join_at_start=True) -> Limited:
    """Run ``cmd`` in a fresh memory cgroup of ``limit_bytes`` and remove the cgroup after.

    ``join_at_start``: the process starts inside the cgroup. Otherwise it starts outside and joins
    it itself (``join_memory_cgroup(os.environ["MEMCG_PATH"])``), so that what it allocates before
    (imports, warm-up) is not counted. ``MEMCG_PATH`` is set in both cases ("" without a cgroup).
    """
    path = make_memory_cgroup(name, limit_bytes)
    env = dict(os.environ if env is None else env, MEMCG_PATH=path or "")
    pre = (lambda: join_memory_cgroup(path)) if (path and join_at_start) else None
    proc = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, preexec_fn=pre)
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        code = None
    try:
        killed = bool(path) and oom_kills(path) > 0
        return Limited(code, out, err, peak_usage(path) if path else 0, killed, path is not None)
    finally:
        if not remove_memory_cgroup(path):
            print(f"[memcg] could not remove {path}; remove it with rmdir", file=sys.stderr)
