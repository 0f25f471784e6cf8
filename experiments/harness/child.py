"""Child processes of the experiments: run a module or code in a fresh interpreter, optionally under a
memory limit and a timeout, and read back the one result it prints.

    run = run_child(module_cmd("experiments.x", "--worker", json.dumps(spec)), timeout=600)
    run.outcome     # "ok", "killed for memory", "timeout" or "exit N"
    run.result      # the JSON value of the child's last result line (None: it printed none)
    run = run_child(cmd, memory=("my-run", 2 * 2**30))   # in a fresh memory cgroup (experiments/harness/memcg.py)
    runs = run_ranks(cmd, 2, timeout=600)                 # the ranks of one torch.distributed job

The child prints its result with ``emit_result(value)``: one line, ``RESULT `` and the value as JSON,
so whatever else it prints (progress, library chatter) cannot be mistaken for it. A fresh process
measures what a training run costs from nothing (imports, compiled kernels, memory), and a memory
limit or a crash ends the child, never the experiment.
"""

from __future__ import annotations

import concurrent.futures as futures
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

from experiments.harness import memcg
from experiments.harness.common import REPO_ROOT

RESULT_PREFIX = "RESULT "


def emit_result(value) -> None:
    """Print ``value`` as the child's result line (the parent reads the last one)."""
    print(RESULT_PREFIX + json.dumps(value), flush=True)


def parse_result(stdout: str):
    """The value of the last result line in ``stdout``; None where there is none."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1][len(RESULT_PREFIX):]) if lines else None


def module_cmd(module: str, *args) -> list[str]:
    """The command that runs ``python -m module args...`` with this interpreter."""
    return [sys.executable, "-m", module, *map(str, args)]


def child_env(env=None, **extra) -> dict:
    """``env`` (default: this process's) with this checkout first on PYTHONPATH, so the child imports
    the same code as the parent, and ``extra`` variables set."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one listens on now (for a process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ChildRun:
    """How a child process ended, and what it printed."""

    returncode: int | None  # None: timed out and killed
    stdout: str
    stderr: str
    peak_bytes: int = 0  # the memory cgroup's peak charge (0 without one)
    oom_killed: bool = False
    limited: bool = False  # ran in a memory cgroup (False where none could be made)

    @property
    def outcome(self) -> str:
        if self.oom_killed:
            return "killed for memory"
        if self.returncode is None:
            return "timeout"
        return "ok" if self.returncode == 0 else f"exit {self.returncode}"

    @property
    def result(self):
        """The child's result line's value, or None (none printed, or the child did not end well)."""
        return parse_result(self.stdout) if self.returncode == 0 else None

    def why(self) -> str:
        """The outcome, with the last line of stderr for a child that exited with an error."""
        err = [ln for ln in self.stderr.strip().splitlines() if ln.strip()]
        return f"{self.outcome}: {err[-1][:300]}" if err and self.outcome.startswith("exit") else self.outcome

    def check(self, what: str) -> ChildRun:
        """This run; an error naming ``what``, its outcome and its stderr's tail where it failed."""
        if self.outcome != "ok":
            raise RuntimeError(f"{what} failed ({self.outcome}):\n{self.stderr[-3000:]}")
        return self


def run_child(cmd, *, timeout=None, env=None, cwd=None, memory=None, join_at_start=True) -> ChildRun:
    """Run ``cmd`` to its end (killed after ``timeout`` seconds), its output captured.

    ``memory=(name, limit_bytes)``: in a fresh memory cgroup of ``limit_bytes`` (None: no limit, the
    peak still measured), removed afterwards; the child runs without one where none can be made
    (``limited`` False). ``join_at_start`` False: the child starts outside and joins the cgroup itself
    (``memcg.join_memory_cgroup(os.environ["MEMCG_PATH"])``), so that what it allocates before
    (imports, warm-up) is not counted. ``MEMCG_PATH`` is set in both cases ("" without a cgroup).
    """
    path = memcg.make_memory_cgroup(*memory) if memory else None
    env = dict(os.environ if env is None else env)
    if memory:
        env["MEMCG_PATH"] = path or ""
    pre = (lambda: memcg.join_memory_cgroup(path)) if (path and join_at_start) else None
    proc = subprocess.Popen(list(map(str, cmd)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd, preexec_fn=pre)
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        code = None
    if not path:
        return ChildRun(code, out, err)
    try:
        return ChildRun(code, out, err, memcg.peak_usage(path), memcg.oom_kills(path) > 0, True)
    finally:
        if not memcg.remove_memory_cgroup(path):
            print(f"[child] could not remove the memory cgroup {path}; remove it with rmdir", file=sys.stderr)


def run_ranks(cmd, world: int, *, env=None, timeout=None, memory=None, join_at_start=True) -> list[ChildRun]:
    """``world`` copies of ``cmd`` at once, the ranks of one torch.distributed job on the local host
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and a free ``MASTER_PORT`` set), each a ``run_child``
    (its own memory cgroup where ``memory`` is given); their runs in rank order."""
    port = free_port()
    base = dict(os.environ if env is None else env, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port))

    def rank(r):
        return run_child(cmd, env=dict(base, RANK=str(r)), timeout=timeout, memory=memory, join_at_start=join_at_start)

    with futures.ThreadPoolExecutor(world) as pool:
        return list(pool.map(rank, range(world)))
