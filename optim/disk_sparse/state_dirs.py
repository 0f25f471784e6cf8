"""The state directory of a Disk Sparse optimizer: where it is, who owns it, and its files' lifecycle.

:class:`StateDir` is one optimizer's directory and the lifecycle of the files in it, from the lock
check at construction to the flush and close of every file (below). The functions before it say
where a private directory goes and whether a directory lives in RAM.

``state_dir=None`` makes a private directory under ``tempfile.gettempdir()`` (``$TMPDIR``, else
``/tmp``), named after its owner: ``disk-sparse-adam-<pid>-<start>-<ns>-<host>-<random>``, where
``<start>`` is the process's start time (``/proc/<pid>/stat``, so a recycled pid is not taken for the
owner), ``<ns>`` its pid namespace (a process of another container sharing ``/tmp`` is never judged)
and ``<host>`` a hash of the kernel's boot id (``host_identity``: it differs between hosts and
boots, so on a ``$TMPDIR`` that hosts share, such as a cluster's scratch, where the initial pid
namespace has the same number on every host, another host's directory is never judged).
``close()`` removes it; a process killed before that leaves it behind, so each new private directory
first removes those whose owner is gone (``remove_orphans``). A directory whose owner cannot be told
(another naming, such as a name without a host; another host or namespace; no ``/proc``) is left
alone, and so is one with a locked state file.

A state_dir on a RAM filesystem (tmpfs, ramfs: ``/dev/shm``, often ``/tmp`` in containers) holds the
"disk" state in memory. ``check_ram_state`` refuses state larger than the memory available there
(the process would be killed for memory inside the constructor) and warns about state larger than
a quarter of the memory limit (the optimizer warns once).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import warnings
import weakref

from .store import (RowStateFile, StateFileError, fits_in_page_cache, locked_state_file, make_state_dir,
                    memory_limit_bytes, remove_dir_of, state_files_in, weights_fingerprint)
from .table import cols, state_bytes
from .weights import weight_file

PREFIX = "disk-sparse-adam-"
_OWNED = re.compile(re.escape(PREFIX) + r"(\d+)-(\d+)-(\d+)-([0-9a-f]{12})-[^-]+$")  # pid, start, ns, host
BOOT_ID = "/proc/sys/kernel/random/boot_id"
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


def host_identity(path: str = BOOT_ID) -> str | None:
    """12 hex digits of a hash of this kernel's boot id (``path``): the same for every process of
    this host and boot, whatever its container, and another on any other host or boot (None where
    it cannot be read)."""
    try:
        with open(path) as f:
            boot = f.read().strip()
    except OSError:
        return None
    return hashlib.blake2b(boot.encode(), digest_size=6).hexdigest() if boot else None


def make_private_dir() -> str:
    """A new private state_dir under ``tempfile.gettempdir()`` named after this process, after
    removing the private directories of processes of this host that are gone."""
    me, start, ns, host = os.getpid(), process_start(os.getpid()), pid_namespace(), host_identity()
    if start is None or ns is None or host is None:  # the owner could never be told: a plain temporary name
        return tempfile.mkdtemp(prefix=PREFIX)
    remove_orphans(tempfile.gettempdir(), ns, host)
    return tempfile.mkdtemp(prefix=f"{PREFIX}{me}-{start}-{ns}-{host}-")


def remove_orphans(parent, ns: int, host: str) -> list:
    """Remove the private state_dirs in ``parent`` whose owner (pid and start time, in namespace
    ``ns`` of host ``host``) is gone and none of whose state files is locked; return their paths."""
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        m = _OWNED.match(name)
        if m is None or int(m.group(3)) != ns or m.group(4) != host:
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


class StateDir:
    """One optimizer's state directory and the lifecycle of the files in it.

    ``StateDir(state_dir, resume, optimizer)`` makes a private directory for ``state_dir=None``
    (removed by ``close``, or at interpreter exit once ``optimizer`` is gone, since ``__del__`` may not
    run then) and refuses a given one where another optimizer holds a state file's lock, or, without
    ``resume``, one that already holds state files. It then makes or reopens the tables' files
    (``open_files``: a new one is accounted against a RAM filesystem's memory and removed again by
    ``remove_made`` when the constructor fails), checks a resumed directory against the tables
    (``check_resumed``), and flushes and closes every file (a weight file before its state file, so
    a clean state file implies clean weights). ``interrupted``: a step or load was cut short, so the
    files hold no one step and none is marked clean. Only the process that made it uses it
    (``check_open``); a forked child's ``close`` only drops its copies of the mappings.
    """

    def __init__(self, state_dir, resume: bool, optimizer, huge_pages=None, state_format="exact"):
        self.name = type(optimizer).__name__  # names the optimizer in messages
        self.private = state_dir is None
        self.huge_pages, self.state_format = huge_pages, state_format
        self.pid = os.getpid()  # a forked child only drops its copies (see close)
        self.closed = False
        self.interrupted = False
        self.planned_bytes = 0  # of the tables the constructor was given: all decide the page-cache rule
        self._opened_bytes = 0  # of the tables opened so far
        self._made: list = []  # state files made here: removed if the optimizer's constructor fails
        self._new_bytes = 0  # their size: on a RAM filesystem, memory (see check_ram_state)
        self._ram_warned = False
        if self.private:
            state_dir = make_private_dir()  # under $TMPDIR; orphans of killed processes removed first
            self._remove_private = weakref.finalize(optimizer, remove_dir_of, os.getpid(), state_dir)
        self.path = os.fspath(state_dir)
        make_state_dir(self.path)
        self._fs_type = filesystem_type(self.path)
        if not self.private:
            busy = locked_state_file(self.path)
            if busy is not None:
                self.closed = True
                raise StateFileError(
                    f"state_dir {self.path}: {busy} is in use by another optimizer (it holds the file's lock): "
                    "two optimizers cannot share one state_dir. Close that optimizer first (to continue its "
                    "state: resume=True), or give this one another state_dir")
        if not resume and not self.private and state_files_in(self.path):
            self.closed = True
            raise StateFileError(
                f"state_dir {self.path} already holds state files ({state_files_in(self.path)[0]}, "
                "...). Pass resume=True to continue from them (at the step their headers hold), or "
                "restore a checkpoint: give a new (or emptied) state_dir and call load_state_dict")

    def check_open(self):
        """Refuse use after ``close`` or from a forked child."""
        if self.closed:
            raise RuntimeError(f"{self.name} on state_dir {self.path} is closed; "
                               "create a new optimizer (it can reopen the same state_dir)")
        if not self.owned_here():
            raise RuntimeError(f"{self.name} on state_dir {self.path} belongs to process "
                               f"{self.pid}; a forked child cannot use it: create one in the child")

    def owned_here(self) -> bool:
        """Whether this process made the directory (not a forked child)."""
        return os.getpid() == self.pid

    # -- opening -----------------------------------------------------------------------------------
    def open_files(self, k: int, p, rule, name: str = ""):
        """``(state file, weight file or None, resumed)`` of parameter ``k`` (``p``) under ``rule``:
        its file ``param{k:04d}.dsa`` reopened if it exists (``resumed``), else made. The weight file of
        a ``mapped_embedding`` is refused while another open optimizer trains it, and a resumed one
        whose step differs from its state file's; it then belongs to this directory."""
        wf = weight_file(p)
        owner = None if wf is None or wf.owner is None else wf.owner()
        if owner is not None and owner is not self and not owner.closed:
            raise StateFileError(f"parameter {k}: the mapped_embedding {wf.path} is already trained by another "
                                 f"optimizer (on state_dir {owner.path}); close that one first")
        nbytes = state_bytes(rule, p)
        # whether the optimizer's state as a whole stays in the page cache: the tables so far, this one
        # and those the constructor was given after it
        self._opened_bytes += nbytes
        fits = fits_in_page_cache(max(self._opened_bytes, self.planned_bytes))
        path = os.path.join(self.path, f"param{k:04d}.dsa")
        resumed = os.path.exists(path)
        if not resumed:
            self._check_ram(nbytes)
        store = RowStateFile(path, p.shape[0], cols(p), rule.width(cols(p)), rule.record_dtype(p.dtype),
                             huge_pages=fits if self.huge_pages is None else self.huge_pages,
                             state_format=self.state_format, stays_in_memory=fits, name=name)
        if not resumed:
            self._made.append(path)
        if wf is not None and resumed and wf.step != store.step:
            store.close()
            raise StateFileError(
                f"weight file {wf.path} is at step {wf.step} but state file {store.path} at step "
                f"{store.step}: they were not flushed together; restore both from one checkpoint")
        if wf is not None:
            wf.owner = weakref.ref(self)
        return store, wf, resumed

    def _check_ram(self, nbytes):
        """Before a new state file of ``nbytes`` is made: refuse (or warn once about) state a RAM
        filesystem would hold in memory (``check_ram_state``)."""
        if self._fs_type is None:
            return
        message = check_ram_state(self.path, self._new_bytes + nbytes, self._fs_type, memory_available(),
                                  memory_limit_bytes())
        self._new_bytes += nbytes
        if message and not self._ram_warned:
            self._ram_warned = True
            warnings.warn(message, UserWarning, stacklevel=6)

    def check_resumed(self, tables: dict):
        """Refuse a resume whose tables (``{param: table.Table}``) are not those the files were
        flushed with, or that would continue only some of the files. Each file's recorded
        fingerprint (``store.weights_fingerprint``) must be that of its table's weights: other
        weights (another step's, or another table's: same-shape tables in another order) would
        continue moments and steps that are not theirs. Tables whose recorded fingerprints agree
        can only be told apart by the names their files hold (``named_parameters()``)."""
        held = {p: t.store.fingerprint() for p, t in tables.items()}
        for p, t in tables.items():
            if not p.is_meta and held[p] is not None and weights_fingerprint(p, held[p][1]) != held[p][0]:
                raise StateFileError(self._not_its_weights(p, tables, held))
        self._check_told_apart(tables, held)
        extra = sorted(set(state_files_in(self.path)) - {os.path.basename(t.store.path) for t in tables.values()})
        if extra:
            raise StateFileError(
                f"state_dir {self.path} holds state files of more parameters than this optimizer has "
                f"({', '.join(extra)}): it would resume only some of them. Give every parameter that was "
                "trained with it, or restore a checkpoint into a new state_dir")

    def _not_its_weights(self, p, tables: dict, held: dict) -> str:
        """Why the weights of ``p`` cannot continue its state file: another file's weights (tables in
        another order), or weights the file was not flushed with, and what to do."""
        t = tables[p]
        mine = os.path.basename(t.store.path)
        for q, other in tables.items():
            if q is not p and held[q] is not None and weights_fingerprint(p, held[q][1]) == held[q][0]:
                return (f"state_dir {self.path}: the weights of parameter {t.index} ({tuple(p.shape)}) are those "
                        f"{os.path.basename(other.store.path)} (parameter {other.index}) was saved with, not those "
                        f"of {mine}: were the tables given in another order? Give them in the order they were "
                        "trained in (or by name: named_parameters()), or restore a checkpoint into a new state_dir")
        return (f"state_dir {self.path}: the weights of parameter {t.index} (shape {tuple(p.shape)}) are not those "
                f"its state file {mine} was flushed with at step {t.store.step} (weights of another step, such as an "
                "older checkpoint's, or changed since): its moments would continue with weights they do not "
                f"belong to. Either restore the weights saved with this state (those of step {t.store.step}), or "
                "restore a checkpoint (its weights, and load_state_dict of its optimizer state) into a new "
                "state_dir. Weights changed on purpose carry the state over through a state dict: "
                "load_state_dict(torch.load(checkpoint, mmap=True)) into an optimizer on a new state_dir")

    def _check_told_apart(self, tables: dict, held: dict):
        """Refuse tables whose files recorded one fingerprint unless the names the files hold tell
        them apart (named now and in the files): in another order they would pass as each other."""
        by_print = {}
        for p, t in tables.items():
            if held[p] is not None:
                by_print.setdefault(held[p], []).append(t)
        for same in by_print.values():
            unnamed = [t for t in same if not (t.store.name and t.store.held_name)]
            if len(same) < 2 or not unnamed:
                continue
            a, b = sorted(same, key=lambda t: t.index)[:2]
            files = f"{os.path.basename(a.store.path)}, {os.path.basename(b.store.path)}"
            if all(t.store.held_name for t in unnamed):
                fix = ("Give the parameters by name, as they were trained: "
                       "DiskSparseAdam(model.named_parameters(), ...)")
            else:
                fix = ("Their files hold no names: restore a checkpoint (its weights, and load_state_dict of its "
                       "optimizer state) into a new state_dir, and give the optimizer named parameters "
                       "(model.named_parameters()), so that its files record the names")
            raise StateFileError(
                f"state_dir {self.path}: parameters {a.index} and {b.index} (shape {a.layout[1]}) had the same "
                f"weights' fingerprint when their files ({files}) were flushed (identical weights, or tables "
                "larger than the fingerprint reads whole that differ only in rows it does not sample), and no "
                "names tell them apart: they cannot be told apart, and in another order they would take each "
                f"other's moments and steps. {fix}")

    def remove_made(self):
        """Remove the state files made here (zero state: nothing worth keeping), after a failed constructor."""
        for path in self._made:
            try:
                os.unlink(path)
            except OSError:
                pass

    # -- clean points ------------------------------------------------------------------------------
    def flush(self, tables: dict):
        """Write every file of ``tables`` ({param: table.Table}) to disk, marked clean at its table's step:
        a weight file first, so a clean state file implies clean weights. Refused after an interruption."""
        if self.interrupted:
            raise StateFileError(
                f"{self.name} on state_dir {self.path}: a step or load_state_dict was "
                "interrupted, so the state files hold no one step and cannot be marked clean. "
                "Restore the last checkpoint (load_state_dict), then flush")
        for p, t in tables.items():
            if t.weight_file is not None:
                t.weight_file.flush(t.step)
            _record_fingerprint(p, t.store)
            t.store.flush(t.step)

    def restore(self, tables: dict, loaded: dict):
        """Write each table's ``loaded`` ``(columns, step)`` ({param: ...}, checked: see
        ``checks.loaded_columns``; None columns: fresh state) into its state file. Every file is marked
        dirty before any is written, so a restore cut short leaves them all dirty (and ``interrupted``
        set), never some at another step."""
        self.interrupted = True
        for t in tables.values():
            t.store.mark_dirty()
        for p, t in tables.items():
            columns, step = loaded[p]
            t.store.write_all(columns, step)
            t.step = step
        self.interrupted = False

    def close(self, tables: dict):
        """Flush (unless interrupted) and release every file of ``tables``, whatever one raises, then
        remove a private directory; a weight file is left open (its module owns it). In a forked child:
        drop this process's mappings only (the files, lock and directory are the parent's)."""
        self.closed = True
        if not self.owned_here():
            for t in tables.values():
                t.store.close()
            return
        try:
            errors = []
            for p, t in tables.items():
                clean = not self.interrupted
                wf = t.weight_file
                if wf is not None and not wf.closed and clean:
                    try:
                        wf.flush(t.step)
                    except StateFileError as exc:  # clean state implies clean weights: not this time
                        errors.append(exc)
                        clean = False
                try:
                    if clean:
                        _record_fingerprint(p, t.store)
                    t.store.close(t.step, clean=clean)
                except StateFileError as exc:
                    errors.append(exc)
            for t in tables.values():
                t.weight_file = None
            if errors:
                raise errors[0]
        finally:
            if self.private:
                self._remove_private()


def _record_fingerprint(p, store):
    """Record ``p``'s weights' fingerprint in its state file before a clean point that follows
    writes (a constructor that failed, or an optimizer that never stepped, leaves it as it was)."""
    if p.is_meta or not store.owned() or store.closed or not store.dirty:
        return
    try:
        store.record_fingerprint(p)
    except StateFileError:
        raise
    except RuntimeError:  # weights that cannot be read now (a lost device): no check at resume
        pass
