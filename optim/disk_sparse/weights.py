"""Embedding tables whose weights live in a memory-mapped file, for tables larger than RAM.

    emb = mapped_embedding("run/emb.weights", 50_000_000, 128)          # nn.Embedding(sparse=True)
    bag = mapped_embedding("run/bag.weights", 50_000_000, 128, bag=True, mode="sum")
    opt = DiskSparseAdam(emb.parameters(), state_dir="run/state")

The weight is a ``(rows, dim)`` float32/float64 view of a file laid out as the state files are
(``store.py``: one header page, then the rows; header format ``weights``), so it costs no RAM beyond
the page cache. A Disk Sparse optimizer over such a weight treats the file as part of its state:

- before its first weight write after a clean point it marks the file dirty (as its state files);
- ``flush()`` and ``close()`` write the weight rows to disk (``msync``, ``fdatasync``) and mark the
  file clean at the optimizer's step, before doing the same for the state files;
- ``prefetch(indices)`` and cold steps read the weight rows' pages in parallel as the records';
- with ``resume=True`` a weight file whose step differs from its state file's is refused.

So after a kill the weight file and the state directory are both refused (dirty), and a run
restarts from its last clean point: a copy of the weight file and state directory taken after
``flush()`` (or ``torch.save`` of the module's and optimizer's state dicts). Reopening a clean file
continues from its weights; a dirty one raises ``StateFileError``. Writes made without the
optimizer (``with torch.no_grad(): emb.weight[...] = ...``) do not mark the file dirty.
The file stays open (and locked) while the module lives; ``close_mapped(module)`` releases it
earlier, leaving it dirty if the weights changed after the last flush.
"""

from __future__ import annotations

import math
import os
import weakref

import torch
import torch.nn as nn

from .store import RowStateFile, StateFileError, memory_limit_bytes

ATTR = "_dsa_weight_file"  # the Parameter attribute naming its file


class WeightFile(RowStateFile):
    """A :class:`RowStateFile` of weights. ``close()`` without a step leaves a changed file dirty
    (only the optimizer knows the step its weights belong to)."""

    def __init__(self, path, rows, cols, dtype):
        super().__init__(path, rows, cols, cols, dtype, huge_pages=False, state_format="weights")

    # A weakref to the state directory (``state_dirs.StateDir``) of the optimizer that trains this
    # weight, one at a time: another optimizer is refused while that directory is open.
    owner = None

    def _check_open(self):
        if self.closed:
            raise StateFileError(f"weight file {self.path} is closed: its module was garbage-collected or "
                                 "close_mapped() was called. Keep the module alive while its optimizer trains it")
        super()._check_open()

    def check_usable(self):
        """Raise with what happened if the file is closed or belongs to another process."""
        self._check_open()

    def __reduce__(self):
        raise TypeError(f"the weight of a mapped_embedding lives in its file {self.path} and cannot be "
                        "pickled with the module: save module.state_dict() (a copy of the weights), or "
                        "flush the optimizer and keep the file")

    def close(self, step=None):
        if step is None and self._dirty and not self.closed and self.owned():
            self._mm.flush()
            self._release()
            return
        super().close(step)


def mapped_embedding(path, num_embeddings: int, embedding_dim: int, *, bag: bool = False, mode: str = "mean",
                     dtype: torch.dtype = torch.float32, init_std: float = 1.0, seed: int = 0, **kwargs):
    """An ``nn.Embedding`` (or ``nn.EmbeddingBag`` with ``bag=True``) with ``sparse=True`` whose
    weight is the memory-mapped file ``path`` (see the module docstring).

    A new file is filled with N(0, ``init_std``²) values (``nn.Embedding``'s initialisation), drawn
    chunk by chunk from ``seed``, and flushed; an existing one must be clean and of this shape and
    dtype, and its weights are used as they are. ``kwargs`` go to the module (``padding_idx``,
    ``max_norm`` are refused: they write the weight outside the optimizer)."""
    for bad in ("padding_idx", "max_norm", "sparse", "_weight"):
        if kwargs.get(bad) is not None:
            raise ValueError(f"mapped_embedding: {bad}= is not supported (the weight is the file's; "
                             "sparse gradients are always on)")
    for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mapped_embedding: {name} must be a positive int, got {value!r}")
    existed = os.path.exists(path)
    wf = WeightFile(path, num_embeddings, embedding_dim, dtype)
    try:
        if not existed:
            wf.mark_dirty()  # a process killed while filling leaves a file that is refused
            _fill_normal(wf.records, init_std, seed, wf.write_back)
            wf.flush(0)
        cls = nn.EmbeddingBag if bag else nn.Embedding
        extra = dict(mode=mode) if bag else {}
        module = cls(num_embeddings, embedding_dim, sparse=True, _weight=wf.records, dtype=dtype, **extra, **kwargs)
        if module.weight.data_ptr() != wf.records.data_ptr():
            raise RuntimeError("mapped_embedding: the module copied its weight instead of using the file")
        setattr(module.weight, ATTR, wf)
    except BaseException:
        wf.close()
        if not existed:
            os.unlink(path)
        raise
    weakref.finalize(module, wf.close)
    return module


def weight_file(p) -> WeightFile | None:
    """The weight file of parameter ``p`` (None for an ordinary parameter)."""
    return getattr(p, ATTR, None)


def close_mapped(module):
    """Release the weight file of a module made by ``mapped_embedding`` (dirty if changed since the
    last flush); the module's weight is unusable afterwards."""
    wf = weight_file(module.weight)
    if wf is not None:
        wf.close()


FILL_CHUNK_BYTES = 8 << 20  # the float64 draws of one chunk of a new weight file, at most


def _fill_normal(records, std, seed, write_back=None):
    """N(0, std²) into ``records``, a chunk of rows at a time, each chunk's rows passed to
    ``write_back(r0, r1)`` before the next: the float64 draws of a chunk take at most
    ``FILL_CHUNK_BYTES`` and a 16th of the memory limit, and a memory cgroup holds one chunk's dirty
    pages, so a table larger than the limit is made within it. The values are those of one draw of
    the whole table (torch's CPU normal fills blocks of 16 values; every chunk but the last is a
    multiple of 16 values)."""
    if not math.isfinite(std):
        raise ValueError(f"init_std must be finite, got {std}")
    gen = torch.Generator().manual_seed(seed)
    rows = records.shape[0]
    width = records[0].numel() if rows else 1
    budget = min(FILL_CHUNK_BYTES, (memory_limit_bytes() or 16 * FILL_CHUNK_BYTES) // 16)
    chunk_rows = max(16, budget // (8 * width) // 16 * 16)
    for start in range(0, rows, chunk_rows):
        block = records[start:start + chunk_rows]
        block.copy_(torch.randn(block.shape, generator=gen, dtype=torch.float64).mul_(std).to(records.dtype))
        if write_back is not None:
            write_back(start, start + block.shape[0])