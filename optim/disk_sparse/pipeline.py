"""Staging of Disk Sparse Adam state records between the state file and the weights' device.

Two stagers with one interface (:class:`Stager`) serve a Disk Sparse optimizer's step (``update.py``):
``DirectStager`` (the records are gathered from the file for each step; weights on CPU) and
``RowStager`` (the staged pipeline; weights on CUDA, or any weights with ``staging=True``). Per step
of one parameter::

    host = acquire(rows); rec = to_device(host); w = weight_rows(p, rows)
    <row update of w, rec in place>; p[rows] = w; commit(rows, rec, host)

For weights on CUDA, ``RowStager`` moves the records::

    file (mmap) --gather--> pinned host buffer --H2D, side stream--> device records
        --row update in place with the weight rows (index_select / index_copy_ on the device)-->
    device records --D2H, side stream--> the same pinned buffer --event, then scatter--> file

All buffers are persistent per parameter and grown geometrically to the largest batch of unique rows
seen, so a training loop allocates no pinned or device staging memory after its first steps, and
the optimizer's device memory is bounded by the staging buffers (O(batch rows)); the moments
themselves never live on the device.

``announce(rows)`` (called by the optimizer's ``prefetch``) starts gathering announced rows' records
into another pinned buffer on a background thread. A later step whose unique rows equal an
announcement uses that buffer instead of reading the file again; other steps gather as usual.
Announcements stay valid across steps: after a step writes its rows back, every pending announcement
is waited for and the rows it shares with the step are overwritten with the step's new records, so an
announced buffer is never used stale (a step
of random rows from a large table usually shares a few rows with the next batch; dropping the whole
announcement then would waste it). Anything else that writes the file (``load_state_dict``,
``close``) calls ``invalidate()``. At most ``depth`` announcements are kept; older ones are dropped.

The same code runs with CPU "device" tensors (plain host buffers, no streams), which is how the tests
check it against the direct path (``staging=True``).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch


def _grown(cap: int, n: int) -> int:
    """Capacity for ``n`` rows: at least double the old one, in multiples of 256 rows."""
    return -(-max(n, 2 * cap) // 256) * 256


class _Buffer:
    """A persistent ``(capacity, width)`` tensor grown geometrically; ``view(n)`` is its first n rows."""

    __slots__ = ("tensor", "dtype", "device", "pin")

    def __init__(self, dtype, device, pin=False):
        self.tensor, self.dtype, self.device, self.pin = None, dtype, torch.device(device), pin

    def view(self, n: int, width: int) -> torch.Tensor:
        t = self.tensor
        if t is None or t.shape[0] < n or t.shape[1] != width:
            cap = _grown(0 if t is None or t.shape[1] != width else t.shape[0], n)
            self.tensor = t = torch.empty((cap, width), dtype=self.dtype, device=self.device,
                                          pin_memory=self.pin)
        return t[:n]

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel() * self.tensor.element_size()


class _Announced:
    __slots__ = ("rows", "buf", "future")

    def __init__(self, rows, buf, future):
        self.rows, self.buf, self.future = rows, buf, future


class Stager(Protocol):
    """What the optimizer's step asks of a stager; rows are CPU int64 tensors.

    Both stagers hold their parameter's state file (``store``) and, for weights in a file
    (``weights.py``), its ``weight_file``, read ahead with the records. ``lock`` is held from
    ``acquire`` to ``commit``, so an announcement from another thread never takes the buffer of the
    step in progress. ``hits``, ``misses`` and ``patched_rows`` count the use of announcements.
    """

    device: torch.device
    lock: threading.RLock
    hits: int
    misses: int
    patched_rows: int

    def read_ahead_if_cold(self, rows: torch.Tensor) -> None:
        """Before a fused step reads the file itself: queue reads of ``rows``' pages if any is not cached."""

    def announce(self, rows: torch.Tensor) -> None:
        """``rows`` (sorted unique) will be stepped soon: read their records (and weights) ahead now."""

    def acquire(self, rows: torch.Tensor) -> torch.Tensor:
        """The host records of ``rows`` (sorted unique)."""

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Those records on the weights' device."""

    def weight_rows(self, p: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The rows of ``p`` to update."""

    def commit(self, rows: torch.Tensor, dev: torch.Tensor, host: torch.Tensor) -> None:
        """Write the updated records ``dev`` of ``rows`` back to the file (``host``: what ``acquire`` gave)."""

    def invalidate(self) -> None:
        """Drop every announcement, after its reads finished: before anything else writes the file."""

    def buffers(self) -> list:
        """The persistent staging tensors."""

    def device_bytes(self) -> int:
        """Bytes of the persistent device buffers."""

    def host_bytes(self) -> int:
        """Bytes of the persistent (pinned) host buffers."""


class DirectStager:
    """The unstaged path: each step gathers its rows' records from the file (and copies them to the
    weights' device if that is not the CPU) and scatters them back. Before a step reads the file,
    ``read_ahead_if_cold`` queues reads of its rows' pages if they are not cached
    (``RowStateFile.read_ahead_if_cold``); ``announce`` queues them for announced rows on
    ``executor``'s background thread (``RowStateFile.read_ahead``). Announcements carry no data (the
    step reads the file itself), so they can never be stale. Holds no buffers. ``weight_file``: the
    weights' file (``weights.py``), read ahead with the records, or None."""

    hits = misses = patched_rows = 0

    def __init__(self, store, device, executor=None, weight_file=None):
        self.store, self.device, self.executor = store, torch.device(device), executor
        self.weight_file = weight_file
        self.pending: deque = deque()
        self.lock = threading.RLock()  # an announcement may come from a loader thread

    def _files(self):
        return (self.store,) if self.weight_file is None else (self.store, self.weight_file)

    def read_ahead_if_cold(self, rows: torch.Tensor):
        """Make the pages of ``rows`` (CPU int64, any order) arrive together before a step reads them.

        Does not wait for announced read-aheads: they may be batches ahead of this step, and pages
        whose reads are in flight count as present (``mincore``), so none is asked for twice."""
        with self.lock:
            while self.pending and self.pending[0].done():
                self.pending.popleft()
        for f in self._files():
            f.read_ahead_if_cold(rows)

    def acquire(self, rows: torch.Tensor) -> torch.Tensor:
        self.read_ahead_if_cold(rows)
        return self.store.gather(rows)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        if host.device == self.device:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def weight_rows(self, p: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return p.index_select(0, rows)

    def commit(self, rows: torch.Tensor, dev: torch.Tensor, host: torch.Tensor):
        self.store.scatter(rows, dev.cpu())

    def announce(self, rows: torch.Tensor):
        with self.lock:
            for f in self._files():
                if self.executor is None:
                    f.read_ahead(rows)
                else:
                    self.pending.append(self.executor.submit(f.read_ahead, rows))

    def invalidate(self):
        """Wait for the queued read-aheads (their failures do not matter: the step reads the file)."""
        with self.lock:
            while self.pending:
                try:
                    self.pending.popleft().result()
                except Exception:
                    pass

    def buffers(self) -> list:
        return []  # the records and weight rows of each step are fresh tensors

    def device_bytes(self) -> int:
        return 0

    def host_bytes(self) -> int:
        return 0


class RowStager:
    """Pinned and device staging buffers of one parameter, and its pending announcements.

    ``store``: the parameter's :class:`~optim.disk_sparse.store.RowStateFile`; ``device``: the
    weights' device; ``executor``: a one-thread executor for the background gathers; ``depth``: how
    many announcements are kept (two cover a loop that announces batch k+1 before stepping batch k,
    three one that looks two batches ahead); when one more arrives, the oldest is dropped.
    ``weight_file``: CPU weights in a file (``weights.py``), read ahead with announced records, or None.
    """

    def __init__(self, store, device, executor, depth: int = 3, weight_file=None):
        self.store, self.device, self.executor, self.depth = store, torch.device(device), executor, depth
        self.weight_file = weight_file
        self.cuda = self.device.type == "cuda"
        pin = self.cuda
        # depth + 1 host buffers: each pending announcement holds one, the running step one more.
        self.host = [_Buffer(store.dtype, "cpu", pin) for _ in range(depth + 1)]
        self.dev_records = _Buffer(store.dtype, self.device)
        self.dev_weights = None  # created on first use, in the weights' dtype
        self.pending: deque = deque()
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.event = torch.cuda.Event() if self.cuda else None
        self.hits = self.misses = self.patched_rows = 0
        # an announcement may come from a loader thread; the optimizer holds the lock from acquire to
        # commit, so an announcement never takes the buffer of the step in progress
        self.lock = threading.RLock()

    # -- host side -----------------------------------------------------------------------------
    def _free_buffer(self) -> _Buffer:
        busy = {id(a.buf) for a in self.pending}
        return next(b for b in self.host if id(b) not in busy)

    def announce(self, rows: torch.Tensor):
        """Start gathering the records of ``rows`` (CPU int64, sorted unique) in the background."""
        with self.lock:
            while len(self.pending) >= self.depth:
                self._drop(self.pending.popleft())
            buf = self._free_buffer()
            out = buf.view(rows.numel(), self.store.width)
            fut = self.executor.submit(self._gather, rows, out, True)
            self.pending.append(_Announced(rows, buf, fut))

    def _gather(self, rows, out, read_ahead=False):
        """Gather the records of ``rows`` into ``out``, their pages read in parallel first where
        missing (``read_ahead``: all of them asked for, as for an announcement)."""
        if read_ahead:
            if self.weight_file is not None:
                self.weight_file.read_ahead(rows)
            self.store.read_ahead(rows)
        else:
            self.store.read_ahead_if_cold(rows)
        return torch.index_select(self.store.records, 0, rows, out=out)

    def read_ahead_if_cold(self, rows: torch.Tensor):
        """Queue reads of ``rows``' record and weight pages if any is not cached (``acquire`` does it
        for the records it gathers)."""
        for f in (self.store,) if self.weight_file is None else (self.store, self.weight_file):
            f.read_ahead_if_cold(rows)

    def acquire(self, rows: torch.Tensor) -> torch.Tensor:
        """Host records of ``rows`` (CPU int64, sorted unique): an announced buffer or a fresh gather.

        The result is a view of a persistent buffer, valid until the next ``acquire``.
        """
        n = rows.numel()
        for k, a in enumerate(self.pending):
            if a.rows.numel() == n and torch.equal(a.rows, rows):
                for _ in range(k):  # announced before this batch and never stepped: stale
                    self._drop(self.pending.popleft())
                self.pending.popleft()
                a.future.result()
                self.hits += 1
                return a.buf.view(n, self.store.width)
        self.misses += 1
        out = self._free_buffer().view(n, self.store.width)
        return self._gather(rows, out)

    def written(self, rows: torch.Tensor, records: torch.Tensor):
        """After ``records`` of ``rows`` were scattered to the file: refresh pending announcements."""
        for a in self.pending:
            a.future.result()  # its gather may have read a row before (or while) it was written
            m = a.rows.numel()
            if m == 0 or rows.numel() == 0:
                continue
            pos = torch.searchsorted(a.rows, rows).clamp_(max=m - 1)
            hit = a.rows[pos] == rows
            if bool(hit.any()):
                a.buf.view(m, self.store.width)[pos[hit]] = records[hit]
                self.patched_rows += int(hit.sum())

    def invalidate(self):
        """Forget every announcement (after its gather finished); call before other file writes."""
        with self.lock:
            while self.pending:
                self._drop(self.pending.popleft())

    @staticmethod
    def _drop(a):
        try:
            a.future.result()
        except Exception:  # a dropped gather's failure does not matter: its rows are read again
            pass

    # -- device side ---------------------------------------------------------------------------
    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Copy host records to the persistent device buffer (side stream on CUDA); returns the view."""
        dev = self.dev_records.view(host.shape[0], host.shape[1])
        if not self.cuda:
            return dev.copy_(host)
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)  # the buffer's previous readers on the main stream are done
        with torch.cuda.stream(self.stream):
            dev.copy_(host, non_blocking=True)
        main.wait_stream(self.stream)
        return dev

    def weight_rows(self, p: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Rows of ``p`` gathered into the persistent device weight buffer."""
        if self.dev_weights is None or self.dev_weights.dtype != p.dtype:
            self.dev_weights = _Buffer(p.dtype, p.device)
        out = self.dev_weights.view(rows.numel(), p.shape[1])
        return torch.index_select(p, 0, rows, out=out)

    def to_host(self, dev: torch.Tensor, host: torch.Tensor):
        """Copy updated device records back into ``host`` and wait until they are there."""
        if not self.cuda:
            host.copy_(dev)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # after the row update
        with torch.cuda.stream(self.stream):
            host.copy_(dev, non_blocking=True)
            self.event.record(self.stream)
        self.event.synchronize()

    def commit(self, rows: torch.Tensor, dev: torch.Tensor, host: torch.Tensor):
        """Write the step's updated device records ``dev`` of ``rows`` back to the file through ``host``
        (the buffer ``acquire`` returned) and refresh pending announcements."""
        self.to_host(dev, host)
        self.store.scatter(rows, host)
        self.written(rows, host)

    def buffers(self) -> list:
        """The persistent staging tensors: host buffers, device records, device weight rows (None where
        not allocated yet)."""
        weights = None if self.dev_weights is None else self.dev_weights.tensor
        return [b.tensor for b in self.host] + [self.dev_records.tensor, weights]

    def device_bytes(self) -> int:
        return self.dev_records.nbytes + (0 if self.dev_weights is None else self.dev_weights.nbytes)

    def host_bytes(self) -> int:
        return sum(b.nbytes for b in self.host)


def staging_totals(stagers) -> dict:
    """Totals over ``stagers``: staging bytes (device, pinned host) and the use of announcements."""
    stagers = list(stagers)
    return dict(device_bytes=sum(s.device_bytes() for s in stagers), pinned_bytes=sum(s.host_bytes() for s in stagers),
                hits=sum(s.hits for s in stagers), misses=sum(s.misses for s in stagers),
                patched_rows=sum(s.patched_rows for s in stagers))


def stop(stagers, executor):
    """Wait for every announcement of ``stagers`` and stop their background thread (``executor``, or
    None): no background gather may outlive the mappings."""
    for stager in stagers:
        stager.invalidate()
    if executor is not None:
        executor.shutdown(wait=True)


def make_executor() -> ThreadPoolExecutor:
    """The one background thread that gathers (or reads ahead) announced rows, shared by an
    optimizer's parameters."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsa-prefetch")
