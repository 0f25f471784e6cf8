"""A journal of finished runs, so that a long experiment stopped part way continues where it was.

    journal = Journal.open(path, run_config, code_paths)   # None where the code cannot be vouched for
    value = journal.get(key)                                # a finished run's value, or None
    journal.add(key, value)                                 # appended as soon as a run finishes
    future = journaled(journal, key, submit)                # either, for a run submitted to a pool

Every run an experiment submits is seeded and deterministic, so a run finished by an earlier process
of the same code and configuration has the value a new one would compute. The journal's first line
fingerprints both: the git tree hashes of ``code_paths`` (the code a run executes) and the run's
configuration. A journal of another fingerprint is set aside (renamed ``.stale``), and none is
kept while any of ``code_paths`` has uncommitted changes. Values are JSON (floats round-trip
exactly). The experiment removes the journal once its results file is written.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

from experiments.harness.common import REPO_ROOT
from experiments.harness.pool import Done


def code_fingerprint(paths, root=REPO_ROOT) -> dict | None:
    """{path: its git tree or blob hash at HEAD} of ``paths`` (relative to the repository ``root``),
    or None where git cannot say or one of them has uncommitted changes."""
    try:
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *paths],
                               cwd=root, capture_output=True, text=True, timeout=10)
        hashes = subprocess.run(["git", "rev-parse", *(f"HEAD:{p}" for p in paths)], cwd=root,
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if dirty.returncode or dirty.stdout.strip() or hashes.returncode:
        return None
    return dict(zip(paths, hashes.stdout.split()))


def host_cpu() -> str:
    """The CPU's name as LLVM knows it ("znver4"): the kernels, and torch's, take paths by it, so runs
    on another CPU may round differently and belong to another journal."""
    import llvmlite.binding

    return llvmlite.binding.get_host_cpu_name()


class Journal:
    """Finished runs by key (a tuple of strings and numbers), appended to a JSON-lines file."""

    def __init__(self, path: Path, fingerprint: dict, entries: dict):
        self.path, self.fingerprint, self._entries = Path(path), fingerprint, entries
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path, config: dict, code_paths) -> "Journal | None":
        """The journal at ``path`` for runs of ``config`` by the code at ``code_paths``: its finished
        runs where its fingerprint is this one; a fresh one otherwise (another journal there is
        renamed ``.stale``); None where the code has uncommitted changes."""
        code = code_fingerprint(code_paths)
        if code is None:
            return None
        path = Path(path)
        fingerprint = json.loads(json.dumps({"code": code, "config": config}, sort_keys=True, default=str))
        entries = {}
        if path.exists():
            lines = path.read_text().splitlines()
            head = json.loads(lines[0]) if lines else None
            if head == {"fingerprint": fingerprint}:
                for line in lines[1:]:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:  # a line cut short by the stop: that run is redone
                        continue
                    entries[tuple(rec["key"])] = rec["value"]
            else:
                path.rename(path.with_name(path.name + ".stale"))
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"fingerprint": fingerprint}) + "\n")
        return cls(path, fingerprint, entries)

    def __len__(self):
        return len(self._entries)

    def get(self, key):
        return self._entries.get(tuple(key))

    def add(self, key, value) -> None:
        """Record a finished run (thread-safe: futures call it from their threads)."""
        line = json.dumps({"key": list(key), "value": value})
        with self._lock:
            self._entries[tuple(key)] = value
            with open(self.path, "a") as f:
                f.write(line + "\n")

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def journaled(journal: Journal | None, key, submit, load=lambda value: value, keep=lambda result: True):
    """The future of run ``key``: ``journal``'s finished run (``load(value)``, already resolved), else
    ``submit()``'s future, whose result goes into the journal once it finishes without an exception
    and ``keep(result)`` (``journal`` None: ``submit()``'s future alone)."""
    done = journal.get(key) if journal is not None else None
    if done is not None:
        return Done(load(done))
    fut = submit()
    if journal is not None:
        fut.add_done_callback(lambda f: f.exception() is None and keep(f.result()) and journal.add(key, f.result()))
    return fut
