"""The on-disk row-state file of Disk Sparse Adam: one file per parameter, one record per row.

Layout (little endian)::

    offset 0     header, HEADER_BYTES long (one page, so records start page-aligned):
                 magic b"DSAROWS\\0", format version u32, dtype code u32, rows u64, cols u64,
                 record width u64, step u64, clean flag u32, state format u32; at offset 512 the
                 parameter's name (UTF-8, 256 bytes, zero padded; empty where the optimizer was
                 given no names: then a resume can check shapes only); at offset 768 a 16-byte
                 fingerprint of the table's weights at the last clean point after writes
                 (``weights_fingerprint``; zeros in files without one) and at 784 the number of
                 the scheme that took it (u8), which tell a resume whether it is given the weights
                 the file was flushed with
    HEADER_BYTES rows x width values of the state dtype; row i's record is contiguous

The state format names what a record holds: 0 ``exact`` (float32/float64 moments, the layout of
the optimizer's exact format) or 1 ``compact`` (bytes: 8-bit codes of the first moment, its
scale, one second moment per row; see ``compact.py``). Files written before the field existed
hold 0 there (the header page is zeroed), so they read as ``exact``. A file of another format than
the optimizer's is refused with an error naming both.

Safety:

- The file is allocated with ``posix_fallocate`` at creation and again on reopening (a copy may be
  sparse), so a full disk fails there with an error naming the file instead of a SIGBUS from the
  mapping in the middle of training.
- An exclusive ``flock`` is held while the file is open: a second optimizer (in this or another
  process) on the same file gets an error instead of silently sharing moments.
- The header's clean flag is cleared (and synced) before the first record write after a clean point
  and set again by ``flush()``/``close()``. A process killed between the two leaves a dirty file, which
  is refused on reopening: its records may mix steps, so the last checkpoint must be restored.
- A process that forks keeps ownership: in the child, ``close()`` (and so ``with``, garbage
  collection and interpreter exit) only drops the child's copy of the mapping and descriptor. It never
  writes the header, flushes or unlocks, since the parent's records may be in the middle of a step.
- The mapping is advised ``MADV_RANDOM``: a step reads scattered rows, readahead would only evict.

Cold rows: a step that would fault its rows' pages in one at a time waits on the disk at queue
depth 1. ``read_ahead_if_cold(rows)`` checks a sample of the rows' pages (``mincore``) and, if any is missing,
asks for all of them with ``posix_fadvise(WILLNEED)``, one call per run of pages: each call queues
the reads and returns, so the step's page faults then wait on reads that are all in flight at once
(the disk's parallel rate; ``experiments/dsa_out_of_core.py`` compares it with worker threads
doing ``pread``). ``read_ahead(rows)`` asks without the check (announced rows, on a background thread).
A file this process created and that stays in the page cache (``stays_in_memory``: the optimizer's
``fits_in_page_cache`` rule) is brought into the page cache at creation (``_populate``) and never
read ahead: its pages are zeros until written, and a residency check would otherwise find every
untouched page "missing" and ask for all of a step's pages at every step of the first pass over the
table. ``read_ahead_if_cold`` skips it (``in_memory``).

Page size: with ``huge_pages=True`` the mapping is also advised ``MADV_HUGEPAGE``. Where the kernel
and file system back file mappings with 2 MiB folios (Linux 6.x with large folios, e.g. ext4 from
6.16, XFS), a warm step then takes one TLB entry per 2 MiB instead of per 4 KiB, which makes
warm steps faster (``experiments/dsa_throughput.py``). But each page-cache miss then reads a
2 MiB folio, so it is only for state that stays in the page cache (``fits_in_page_cache``).
Elsewhere the advice is ignored.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import mmap
import os
import shutil
import struct
import tempfile

import numpy as np
import torch

from . import _readahead

MAGIC = b"DSAROWS\0"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
_HEADER = struct.Struct("<8sIIQQQQII")  # magic, version, dtype, rows, cols, width, step, clean, format
MAX_STEP = 2**63 - 1  # the header's field is u64; steps are int64 tensors in state dicts
_DTYPES = {1: torch.float32, 2: torch.float64, 3: torch.uint8}
_CODES = {v: k for k, v in _DTYPES.items()}
_NP_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.uint8: np.uint8}
STATE_FORMATS = ("exact", "compact")
NAME_OFFSET, NAME_BYTES = 512, 256  # the parameter's name, where the optimizer knows it (UTF-8, zero padded)
# a fingerprint of the weights at the last clean point (zeros: none), then the u8 number of its scheme
PRINT_OFFSET, PRINT_BYTES = 768, 16
# How a fingerprint reads a table, by the scheme number the header keeps beside it: (rows sampled,
# evenly spaced; whether tables up to WHOLE_PRINT_BYTES are hashed whole). Scheme 0 is that of files
# whose headers hold no number (a zero byte); new fingerprints take PRINT_SCHEME.
PRINT_SCHEMES = ((16, False), (64, True))
PRINT_SCHEME = len(PRINT_SCHEMES) - 1
# Tables up to this size are hashed whole at each clean point (a few tens of milliseconds at most);
# larger ones (a table memory-mapped from disk may be far larger than memory) by their sampled rows.
WHOLE_PRINT_BYTES = 64 << 20
PRINT_CHUNK_BYTES = 4 << 20  # a whole-table hash reads (and copies to the host) this much at a time
_FILE_FORMATS = STATE_FORMATS + ("weights",)  # the header's format field; "weights": weights.py's files
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+ (older kernels: EINVAL)
WRITE_CHUNK_BYTES = 64 << 20  # write_all writes back at most this much, and 1/8 of the memory limit, at a time
SAMPLE_PAGES = 16  # pages read_ahead_if_cold() checks for residency before reading all of a step's (0: never)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def _own_cgroups(proc_cgroup: str):
    """This process's cgroup paths, ``{"v1": path of the memory controller, "v2": unified path}``."""
    paths = {}
    try:
        with open(proc_cgroup) as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    paths["v2"] = path
                elif "memory" in controllers.split(","):
                    paths["v1"] = path
    except (OSError, ValueError):
        pass
    return paths


def memory_limit_bytes(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """The memory this process may use: physical RAM, or a smaller cgroup v2 / v1 limit (the page
    cache counts against it) of the root or of this process's own cgroup and its ancestors (as
    ``/proc/self/cgroup`` names them). ``None`` if it cannot be told."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        pass
    own = _own_cgroups(proc_cgroup)
    candidates = []
    for version, root, name in (("v2", cgroup_root, "memory.max"),
                                ("v1", os.path.join(cgroup_root, "memory"), "memory.limit_in_bytes")):
        parts = [q for q in own.get(version, "").split("/") if q]
        candidates += [os.path.join(root, *parts[:k], name) for k in range(len(parts) + 1)]
    for path in candidates:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return min(limits) if limits else None


def fits_in_page_cache(nbytes: int, fraction: float = 0.25) -> bool:
    """The ``huge_pages=None`` rule: a state file at most ``fraction`` of the memory limit (physical
    RAM or the container's cgroup limit) is expected to stay in the page cache, so it is mapped with
    huge pages; larger ones are not, since every page-cache miss would read 2 MiB."""
    limit = memory_limit_bytes()
    return limit is not None and nbytes <= fraction * limit


def state_files_in(path) -> list:
    """The state files (``*.dsa``) in directory ``path``, sorted."""
    return sorted(f for f in os.listdir(path) if f.endswith(".dsa"))


def locked_state_file(path) -> str | None:
    """A state file in directory ``path`` whose lock another open optimizer holds (None if none)."""
    for name in state_files_in(path):
        try:
            fd = os.open(os.path.join(path, name), os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            return name
        finally:
            os.close(fd)
    return None


def make_state_dir(path):
    """Create ``path`` if needed and check that it is a writable directory."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create state_dir {path}: {exc.strerror}; "
                                 "give a writable directory") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"state_dir {path} is not writable; give a writable directory")


def remove_dir_of(owner: int, path):
    """Remove a private state_dir, in the process that made it only (not in a forked child)."""
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


def weights_fingerprint(weight: torch.Tensor, scheme: int | None = None) -> bytes:
    """``PRINT_BYTES`` that identify a table's weights, taken by ``PRINT_SCHEMES[scheme]`` (default
    ``PRINT_SCHEME``): a hash of the shape, the dtype and evenly spaced rows, and of every row where
    the scheme says so and the table has at most ``WHOLE_PRINT_BYTES`` (so same-shape tables that
    differ only in rows the sample misses, zero-initialised tables trained on a few rows, differ).
    Cheap for any table size and device: a larger table costs its sampled rows."""
    scheme = PRINT_SCHEME if scheme is None else scheme
    rows, whole = PRINT_SCHEMES[scheme]
    w = weight.detach()
    n = w.shape[0]
    idx = torch.linspace(0, max(n - 1, 0), min(rows, n)).round().long().to(w.device)
    h = hashlib.blake2b(digest_size=PRINT_BYTES)
    h.update(repr((tuple(w.shape), str(w.dtype))).encode())
    h.update(_bytes_of(w.index_select(0, idx)))
    if whole and w.numel() * w.element_size() <= WHOLE_PRINT_BYTES:
        step = max(1, PRINT_CHUNK_BYTES // max(1, w[0].numel() * w.element_size()))
        for r0 in range(0, n, step):
            h.update(_bytes_of(w[r0:r0 + step]))
    digest = h.digest()
    return digest if digest != bytes(PRINT_BYTES) else b"\1" + digest[1:]


def _bytes_of(t: torch.Tensor):
    """The bytes of ``t``'s values in row-major order (a host copy where ``t`` is elsewhere)."""
    t = t.to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


def write_chunk_bytes() -> int:
    """Bytes a writer of more than memory writes (and writes back) at a time: ``WRITE_CHUNK_BYTES``,
    at most an eighth of the memory limit. A memory cgroup cannot reclaim dirty pages before they
    are written, so such a writer holds one chunk of them."""
    return min(WRITE_CHUNK_BYTES, (memory_limit_bytes() or WRITE_CHUNK_BYTES * 8) // 8)


def reserve(fd: int, nbytes: int, what: str, advice: str):
    """Reserve every block of the first ``nbytes`` of the open file ``fd`` (a no-op where it has
    them), so a full disk fails here, named: "not enough disk space ``what``" and ``advice``."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise OSError(exc.errno, f"not enough disk space {what}: it needs {nbytes / 2**20:.1f} MiB "
                                     f"({os.strerror(exc.errno)}); {advice}") from None
        raise


def spilled_copy(t: torch.Tensor, directory) -> torch.Tensor:
    """A copy of ``t`` (a CPU tensor) in a file of ``directory`` that is unlinked once mapped: its
    memory is page cache, which the kernel can write back and drop (an anonymous copy of a state
    larger than what a memory cgroup leaves free gets the process killed), and the file's blocks go
    when the last tensor viewing it is gone (also if the process is killed). The rows are copied in
    chunks of ``write_chunk_bytes()``, each written back before the next where there are several."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t.clone()
    fd, path = tempfile.mkstemp(prefix=".state-dict-", suffix=".tmp", dir=directory)
    try:
        os.unlink(path)
        reserve(fd, nbytes, f"in {directory} for a state dict's copy", "free space there")
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    out = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8)).view(t.dtype).view(t.shape)
    if t.dim() == 0:
        return out.copy_(t)
    row_bytes = max(1, nbytes // max(1, t.shape[0]))
    chunk = max(1, write_chunk_bytes() // row_bytes)
    for r0 in range(0, t.shape[0], chunk):
        r1 = min(t.shape[0], r0 + chunk)
        out[r0:r1].copy_(t[r0:r1])
        if chunk < t.shape[0]:
            first = r0 * row_bytes // mmap.PAGESIZE * mmap.PAGESIZE
            mm.flush(first, r1 * row_bytes - first)
    return out


class StateFileError(RuntimeError):
    """A state file cannot be used: locked, dirty, or of another shape/dtype/format."""


class RowStateFile:
    """Memory-mapped ``(rows, width)`` table of per-row optimizer state records in one file.

    ``RowStateFile(path, rows, cols, width, dtype, huge_pages=False)`` opens ``path`` if it exists (it
    must be clean and match ``rows``/``cols``/``width``/``dtype``) and creates it (zero records, step
    0) otherwise; ``huge_pages`` advises 2 MiB pages for the mapping (see the module docstring).
    ``records`` is a torch tensor view of the mapping; ``gather``/``scatter`` move whole records of
    sorted unique rows.
    """

    def __init__(self, path, rows: int, cols: int, width: int, dtype: torch.dtype, huge_pages: bool = False,
                 state_format: str = "exact", stays_in_memory: bool = False, name: str = ""):
        if dtype not in _CODES:
            raise TypeError(f"state file {path}: state dtype must be float32, float64 or uint8, got {dtype}")
        if state_format not in _FILE_FORMATS:
            raise ValueError(f"state file {path}: state_format must be one of {STATE_FORMATS}, got {state_format!r}")
        self.state_format = state_format
        self.name = name
        self.held_name = ""  # the name the file holds (read on opening, written on creation)
        self.path = os.fspath(path)
        self.rows, self.cols, self.width, self.dtype = int(rows), int(cols), int(width), dtype
        self.nbytes = HEADER_BYTES + self.rows * self.width * torch.empty((), dtype=dtype).element_size()
        self.huge_pages = bool(huge_pages) and hasattr(mmap, "MADV_HUGEPAGE")
        self._fd = None
        self._mm = None
        self.records = None
        self.closed = False
        self._owner = os.getpid()  # a forked child must not close the parent's file (see close)
        created = False
        try:
            try:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                created = True
            except FileExistsError:
                self._fd = os.open(self.path, os.O_RDWR)
            self._lock()
            if created:
                self._create()
            else:
                self._check_existing()
            self._map()
            # A new file that stays in the page cache is brought in at once, and has nothing on
            # disk worth reading ahead later: ``read_ahead_if_cold`` skips it.
            self.in_memory = bool(created and stays_in_memory)
            if self.in_memory:
                self._populate()
        except BaseException:
            self._release()
            if created:
                try:
                    os.unlink(self.path)
                except OSError:
                    pass
            raise
        self._dirty = False

    # -- opening ------------------------------------------------------------------------------
    def _lock(self):
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StateFileError(
                f"state file {self.path} is in use by another optimizer (it holds the file's lock); "
                "close that optimizer first or give this one another state_dir") from None

    def _create(self):
        self._allocate()
        os.pwrite(self._fd, self.name.encode()[:NAME_BYTES], NAME_OFFSET)
        self.held_name = self.name.encode()[:NAME_BYTES].decode(errors="replace")
        self._write_header(step=0, clean=True)

    def _populate(self):
        """Bring every page of a new file into the page cache in one sequential pass over a second,
        read-only mapping with readahead on (``MADV_POPULATE_READ``, or a read of each page on
        kernels without it), in the folio size the records' mapping asks for. The records' mapping
        (``MADV_RANDOM``, no readahead) would otherwise fault the zeros in at the first steps, one
        fault per page or large folio, scattered: far slower than this pass. The pages stay clean."""
        mm = mmap.mmap(self._fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        try:
            mm.madvise(mmap.MADV_SEQUENTIAL)
            if self.huge_pages:
                mm.madvise(mmap.MADV_HUGEPAGE)
            try:
                mm.madvise(MADV_POPULATE_READ)
            except (OSError, ValueError):
                int(np.frombuffer(mm, dtype=np.uint8)[::mmap.PAGESIZE].sum())
        finally:
            mm.close()

    def _allocate(self):
        """Reserve every block of the file (a no-op where it has them), so a full disk fails here."""
        reserve(self._fd, self.nbytes, f"for state file {self.path}", "free space or choose another state_dir")

    def _check_existing(self):
        raw = os.pread(self._fd, _HEADER.size, 0)
        if len(raw) < _HEADER.size or raw[:8] != MAGIC:
            raise StateFileError(f"{self.path} is not a Disk Sparse Adam state file (bad magic); "
                                 "remove it or choose another state_dir")
        magic, version, code, rows, cols, width, step, clean, fmt = _HEADER.unpack(raw)
        if version != FORMAT_VERSION:
            raise StateFileError(f"state file {self.path} has format version {version}, this code reads "
                                 f"{FORMAT_VERSION}; restore a checkpoint into a fresh state_dir")
        if fmt >= len(_FILE_FORMATS) or _FILE_FORMATS[fmt] != self.state_format:
            have = _FILE_FORMATS[fmt] if fmt < len(_FILE_FORMATS) else f"unknown format {fmt}"
            raise StateFileError(
                f"state file {self.path} holds state_format={have!r} state, but the optimizer uses "
                f"state_format={self.state_format!r}; create the optimizer with state_format={have!r} "
                "to resume it, or use another state_dir")
        got = (rows, cols, width, _DTYPES.get(code, f"code {code}"))
        want = (self.rows, self.cols, self.width, self.dtype)
        if got != want:
            raise StateFileError(
                f"state file {self.path} holds state of shape ({rows}, {cols}), record width {width}, "
                f"dtype {got[3]}, but the parameter needs shape ({self.rows}, {self.cols}), record width "
                f"{self.width}, dtype {self.dtype}; use another state_dir for this model")
        if not clean:
            raise StateFileError(
                f"state file {self.path} is dirty: the process using it stopped in the middle of "
                "training, so its records may mix steps. Restore the last checkpoint instead: create "
                "the optimizer with a new (or emptied) state_dir and call "
                "load_state_dict(torch.load(checkpoint, mmap=True)) (mmap=True streams a checkpoint larger "
                "than memory; save one with torch.save(opt.state_dict(), path), which reads the files "
                "without a copy in RAM).")
        if os.fstat(self._fd).st_size < self.nbytes:
            raise StateFileError(f"state file {self.path} is truncated ({os.fstat(self._fd).st_size} < "
                                 f"{self.nbytes} bytes); restore the last checkpoint into a new state_dir")
        if step > MAX_STEP:
            raise StateFileError(f"state file {self.path} has step {step}, more than {MAX_STEP}: the "
                                 "header is damaged; restore the last checkpoint into a new state_dir")
        self._allocate()  # a sparse copy (cp --sparse, truncate) would otherwise SIGBUS on a full disk
        self._step = step
        held = self.held_name = os.pread(self._fd, NAME_BYTES, NAME_OFFSET).rstrip(b"\0").decode(errors="replace")
        if held and self.name and held != self.name[:NAME_BYTES]:
            raise StateFileError(
                f"state file {self.path} holds the state of parameter {held!r}, but it would be opened for "
                f"{self.name!r}: were the parameters given in another order? Give them in the order they "
                "were saved in, or restore a checkpoint into a new state_dir")

    def _map(self):
        self._mm = mmap.mmap(self._fd, self.nbytes, flags=mmap.MAP_SHARED,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._mm.madvise(mmap.MADV_RANDOM)
        if self.huge_pages:
            try:
                self._mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # kernels without transparent huge pages: 4 KiB pages, as without the advice
                self.huge_pages = False
        arr = np.frombuffer(self._mm, dtype=_NP_DTYPES[self.dtype], count=self.rows * self.width, offset=HEADER_BYTES)
        self.records = torch.from_numpy(arr.reshape(self.rows, self.width))
        self._address = arr.ctypes.data

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` starts at this file's first record in its mapping (not a copy of it: a
        ``share_memory_()`` moves a tensor's storage, and every view of it, elsewhere)."""
        return t.device.type == "cpu" and not self.closed and t.data_ptr() == self._address

    def private_records(self) -> torch.Tensor:
        """The records as a copy-on-write (``MAP_PRIVATE``) mapping of the file: it reads the page
        cache without copying, and what a holder writes into it stays in private pages, never in
        the file. The mapping lives as long as the tensor, also after ``close()``."""
        self._check_open()
        mm = mmap.mmap(self._fd, self.nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        arr = np.frombuffer(mm, dtype=_NP_DTYPES[self.dtype], count=self.rows * self.width, offset=HEADER_BYTES)
        return torch.from_numpy(arr.reshape(self.rows, self.width))

    def _write_header(self, step, clean):
        os.pwrite(self._fd, _HEADER.pack(MAGIC, FORMAT_VERSION, _CODES[self.dtype], self.rows, self.cols,
                                         self.width, int(step), 1 if clean else 0,
                                         _FILE_FORMATS.index(self.state_format)), 0)
        os.fdatasync(self._fd)
        self._step = int(step)

    # -- use ----------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The step count of the last clean point (creation, ``flush`` or open)."""
        return self._step

    def mark_dirty(self):
        """Clear the clean flag on disk; called before the first record write after a clean point."""
        self._check_open()
        if not self._dirty:
            self._dirty = True  # first: an interruption inside the write below must not read as clean
            self._write_header(self._step, clean=False)

    def writable(self) -> torch.Tensor:
        """``records``, for a caller that writes them in place (a fused kernel): marks the file dirty."""
        self.mark_dirty()
        return self.records

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Records of ``rows`` (int64, CPU, sorted unique) as a new ``(n, width)`` tensor."""
        self._check_open()
        return self.records.index_select(0, rows)

    def scatter(self, rows: torch.Tensor, records: torch.Tensor):
        """Write ``records`` (``(n, width)``) to ``rows`` (int64, CPU, sorted unique)."""
        self.mark_dirty()
        self.records.index_copy_(0, rows, records)

    def write_all(self, columns, step: int):
        """Replace every record and make the file clean at ``step`` (loading a checkpoint).

        ``columns``: tensors of ``rows`` rows whose widths add up to the record width, written side
        by side (``[m | v]``), or None for zero records. Columns of the state dtype are written as
        values (other floating dtypes are converted to it); columns of another dtype in a byte
        record (a compact record's codes, scale, v) are written as their bytes. A tensor that already
        is that memory (a state dict of this very file) is left as it is. The rows are written in
        chunks of ``WRITE_CHUNK_BYTES`` or an eighth of the memory limit, whichever is smaller, each
        written back to the disk before the next, so a state larger than the memory limit loads (the
        page cache holds one chunk's dirty pages, which a memory cgroup cannot reclaim before they
        are written, and a memory-mapped checkpoint's pages are read once and can be dropped).
        """
        self.mark_dirty()
        row_bytes = self.width * self.records.element_size()
        chunk = max(1, write_chunk_bytes() // row_bytes)
        for r0 in range(0, self.rows, chunk):
            r1 = min(self.rows, r0 + chunk)
            if columns is None:
                self.records[r0:r1].zero_()
            else:
                start = 0
                for col in columns:
                    part = col[r0:r1]
                    if self.dtype == torch.uint8 and part.dtype != torch.uint8:
                        part = part.contiguous().view(torch.uint8).reshape(r1 - r0, -1)
                    view = self.records[r0:r1, start:start + part.shape[1]]
                    if part.data_ptr() != view.data_ptr():
                        view.copy_(part)
                    start += part.shape[1]
            self.write_back(r0, r1)
        self.flush(step)

    def write_back(self, r0: int, r1: int):
        """Write the pages of rows ``[r0, r1)`` to the disk now: a memory cgroup cannot reclaim dirty
        pages before they are written, so a writer larger than the limit writes back as it goes."""
        row_bytes = self.width * self.records.element_size()
        first = (HEADER_BYTES + r0 * row_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
        self._mm.flush(first, HEADER_BYTES + r1 * row_bytes - first)

    def check_path(self):
        """Raise unless ``path`` still names the file this object has open: another program that
        deleted or replaced it would otherwise see its records lost, or a stale file resumed."""
        have = os.fstat(self._fd)
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            raise StateFileError(f"state file {self.path} was deleted while open: its records live on only in "
                                 "this process. Save a checkpoint (state_dict) now and restore it") from None
        if (now.st_dev, now.st_ino) != (have.st_dev, have.st_ino):
            raise StateFileError(f"state file {self.path} was replaced by another file while open: this "
                                 "optimizer's records are not in it. Save a checkpoint (state_dict) now and restore it")

    @property
    def dirty(self) -> bool:
        """Whether records were written since the last clean point."""
        return self._dirty

    def record_fingerprint(self, weight: torch.Tensor):
        """Record the fingerprint of ``weight`` (``weights_fingerprint`` by ``PRINT_SCHEME``, the
        weights at this clean point) and its scheme in the header, so a resume can tell whose
        weights it is given."""
        self._check_open()
        scheme = PRINT_SCHEME
        os.pwrite(self._fd, weights_fingerprint(weight, scheme) + bytes([scheme]), PRINT_OFFSET)

    def fingerprint(self) -> tuple | None:
        """``(digest, scheme)`` of the weights' fingerprint recorded at the last clean point (None:
        never recorded)."""
        self._check_open()
        raw = os.pread(self._fd, PRINT_BYTES + 1, PRINT_OFFSET)
        if raw[:PRINT_BYTES] == bytes(PRINT_BYTES):
            return None
        if raw[PRINT_BYTES] >= len(PRINT_SCHEMES):
            raise StateFileError(f"state file {self.path}: its weights' fingerprint is of scheme {raw[PRINT_BYTES]}, "
                                 "which this code does not know (a newer version wrote it); restore a checkpoint "
                                 "into a new state_dir")
        return raw[:PRINT_BYTES], raw[PRINT_BYTES]

    def flush(self, step: int | None = None):
        """Write the records to disk and mark the file clean at ``step`` (a consistent point)."""
        self._check_open()
        self.check_path()
        self._mm.flush()
        self._write_header(self._step if step is None else step, clean=True)
        self._dirty = False

    def drop_cache(self):
        """Evict this file's pages from the page cache (cold-cache benchmarks); ``read_ahead_if_cold``
        reads them ahead from then on."""
        self._check_open()
        self.in_memory = False
        self._mm.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _page_runs(self, rows: np.ndarray):
        """(first page, page count) of each run of consecutive pages holding the records of ``rows``."""
        rec = self.records.element_size() * self.width
        rows = rows.astype(np.int64, copy=False)
        starts = (HEADER_BYTES + rows * rec) // mmap.PAGESIZE
        ends = (HEADER_BYTES + (rows + 1) * rec - 1) // mmap.PAGESIZE
        pages = np.unique(np.concatenate([starts, ends]))
        if pages.size == 0:
            return pages, pages
        breaks = np.flatnonzero(np.diff(pages) != 1) + 1
        first = np.concatenate([pages[:1], pages[breaks]])
        counts = np.diff(np.concatenate([[0], breaks, [pages.size]]))
        return first, counts

    def read_ahead(self, rows: torch.Tensor):
        """Ask the kernel to read the pages of ``rows`` (any int64 CPU row indices, in the table)
        with ``posix_fadvise(WILLNEED)``: the reads are queued together and run in the background;
        cached pages cost a lookup. The calls run without the GIL (``_readahead.py``), so a
        background thread issues them while the training loop runs Python."""
        self._check_open()
        first, counts = self._page_runs(rows.numpy())
        _readahead.advise(self._fd, first, counts, mmap.PAGESIZE)

    def missing_pages(self, rows: torch.Tensor, sample: int | None = None) -> int:
        """How many of ``sample`` of ``rows``' record pages (evenly strided over ``rows``, which may
        be sorted) are not in the page cache (``mincore`` on the mapping)."""
        self._check_open()
        rec = self.records.element_size() * self.width
        page = mmap.PAGESIZE
        base = self.records.data_ptr() - HEADER_BYTES  # the mapping's start, page-aligned
        vec = ctypes.c_ubyte()
        missing = 0
        sample = SAMPLE_PAGES if sample is None else sample
        if sample <= 0:
            return 0
        for r in rows[::max(1, rows.numel() // sample)][:sample].tolist():
            off = (HEADER_BYTES + r * rec) // page * page
            if _libc.mincore(base + off, page, ctypes.byref(vec)) != 0:
                return 0  # cannot tell (not expected for a live mapping): let the faults read
            missing += not (vec.value & 1)
        return missing

    def read_ahead_if_cold(self, rows: torch.Tensor, sample: int | None = None):
        """Before a step on ``rows`` (int64 CPU indices in the table, any order, duplicates allowed):
        if any of a sample of their pages is not cached, queue reads of all of them (``read_ahead``),
        so the step's page faults wait on parallel reads instead of reading one page at a time."""
        if rows.numel() and not self.in_memory and self.missing_pages(rows, sample):
            self.read_ahead(rows)

    def close(self, step: int | None = None, clean: bool = True):
        """Flush, mark clean (unless ``clean=False``: the records are written but a dirty file stays
        dirty), unlock and unmap. Safe to call twice. In a forked child: unmap only."""
        if self.closed:
            return
        if not self.owned():
            self._release(unlock=False)
            return
        try:
            if self._mm is not None and (self._dirty or step is not None):
                self.check_path()
            if self._mm is not None and not clean:  # never marked clean, whatever it holds
                self._mm.flush()
            elif self._mm is not None and self._dirty:
                self.flush(step)
            elif step is not None and step != self._step and self._mm is not None:
                self._write_header(step, clean=True)
        finally:
            self._release()

    def owned(self) -> bool:
        """Whether this process opened the file (not a child forked after the opening)."""
        return os.getpid() == self._owner

    def _release(self, unlock=True):
        self.closed = True
        self.records = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # tensors from state_dict() still view the mapping; it unmaps when they die
            self._mm = None
        if self._fd is not None:
            try:
                if unlock:  # the lock belongs to the open file, which a forked child shares
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    def _check_open(self):
        if self.closed:
            raise StateFileError(f"state file {self.path} is closed; the optimizer was closed")
        if not self.owned():
            raise StateFileError(f"state file {self.path} belongs to process {self._owner}; a forked "
                                 "child cannot use its parent's optimizer: create one in the child")

    def __repr__(self):
        return (f"RowStateFile({self.path!r}, rows={self.rows}, width={self.width}, dtype={self.dtype}, "
                f"huge_pages={self.huge_pages}, state_format={self.state_format!r}, "
                f"step={self._step})")
