"""The machinery shared by the Disk Sparse optimizers: state files, sparse gradients, checkpoints.

:class:`DiskSparseOptimizer` owns one :class:`~optim.disk_sparse.store.RowStateFile` per parameter
and runs the step: per parameter, the sparse gradient is coalesced into sorted unique rows
(duplicates summed in the order ``torch.Tensor.coalesce`` sums them), those rows' records are
gathered, updated together with the weight rows (on the weights' device) by the subclass's update,
and scattered back. Untouched rows are never read. The optimizers themselves are in
``optimizer.py``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import weakref

import torch

from .pipeline import RowStager, make_executor
from .store import RowStateFile, StateFileError  # noqa: F401  (re-exported for users' except clauses)

# State-dict keys (the same as torch.optim.SparseAdam's, so its checkpoints load here and back).
STEP, EXP_AVG, EXP_AVG_SQ = "step", "exp_avg", "exp_avg_sq"
_BACKENDS = ("auto", "torch", "triton")


def memory_limit_bytes(cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """The memory this process may use: physical RAM, or a smaller cgroup v2 / v1 limit (the page
    cache counts against it in a container). ``None`` if it cannot be told."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        pass
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            with open(os.path.join(cgroup_root, name)) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return min(limits) if limits else None


def fits_in_page_cache(nbytes: int, fraction: float = 0.25) -> bool:
    """The ``huge_pages=None`` rule: a state file at most ``fraction`` of the memory limit (physical
    RAM or the container's cgroup limit) is expected to stay in the page cache, so it is mapped with
    huge pages (``store.py``); larger ones are not, since every page-cache miss would read 2 MiB."""
    limit = memory_limit_bytes()
    return limit is not None and nbytes <= fraction * limit


def coalesce_rows(indices: torch.Tensor, values: torch.Tensor):
    """Sorted unique rows of a row-sparse gradient and their summed values.

    Duplicates are summed in the order ``torch.Tensor.coalesce`` sums them on CPU (the order of
    ``indices.sort()``'s permutation), so the result is bitwise that of ``grad.coalesce()``; it avoids
    building a sparse tensor and costs one sort plus one ``index_add_``.
    """
    s, perm = indices.sort()
    n = s.numel()
    new = torch.ones(n, dtype=torch.bool, device=s.device)
    if n > 1:
        torch.ne(s[1:], s[:-1], out=new[1:])
    rows = s[new]
    vals = values.index_select(0, perm)
    if rows.numel() == n:
        return rows, vals
    inv = new.cumsum(0).sub_(1)
    return rows, vals.new_zeros((rows.numel(),) + tuple(values.shape[1:])).index_add_(0, inv, vals)


class DiskSparseOptimizer(torch.optim.Optimizer):
    """Shared machinery: per-parameter state files, sparse-gradient handling, checkpoints.

    Subclasses set ``_state_width(cols)``, ``_state_views(records, cols)`` (the state-dict tensors of
    a record table) and ``_update_torch(p, rows, g, rec, step, group)`` (which updates ``rec`` in place
    and writes the new weight rows), plus ``_kernel_name`` (the function in ``kernels.py``).
    """

    _kernel_name = ""

    def __init__(self, params, defaults, state_dir=None, backend="auto", huge_pages=None):
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if huge_pages not in (None, True, False):
            raise ValueError(f"huge_pages must be None (decide by size), True or False, got {huge_pages!r}")
        self.backend = backend
        self.huge_pages = huge_pages
        self._own_dir = state_dir is None
        if state_dir is None:
            state_dir = tempfile.mkdtemp(prefix="disk-sparse-adam-")
            # Removed by close(), and at interpreter exit if close() never ran: at shutdown __del__
            # may not run (e.g. a numpy view of the state in a global), which left the whole
            # table-sized state file in /tmp. The finalizer holds the path only, not the optimizer.
            self._remove_own_dir = weakref.finalize(self, shutil.rmtree, state_dir, ignore_errors=True)
        self.state_dir = os.fspath(state_dir)
        self._stores: dict = {}
        self._steps: dict = {}
        self._closed = False
        self._kernels = None
        self._stagers: dict = {}  # parameter -> RowStager (weights on CUDA; see pipeline.py)
        self._executor = None
        # None: stage the weights on CUDA (pipeline.py); True/False: always/never (tests, benchmarks).
        self._staging = None
        try:
            os.makedirs(self.state_dir, exist_ok=True)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot create state_dir {self.state_dir}: {exc.strerror}; "
                                     "give a writable directory") from None
        if not os.access(self.state_dir, os.W_OK | os.X_OK):
            raise PermissionError(f"state_dir {self.state_dir} is not writable; give a writable directory")
        try:
            super().__init__(params, defaults)
        except BaseException:
            self.close()
            raise

    # -- parameters and their files ----------------------------------------------------------------
    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            self._open_store(p)

    def _open_store(self, p):
        k = len(self._stores)
        where = f"parameter {k} (shape {tuple(p.shape)}, dtype {p.dtype})"
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(f"{where}: the parameter must be a dense tensor (its gradient is sparse)")
        if not p.is_floating_point():
            raise ValueError(f"{where}: {type(self).__name__} needs a floating-point parameter")
        if p.dim() != 2:
            raise ValueError(f"{where}: {type(self).__name__} needs a 2-D (rows, dim) embedding table "
                             "such as nn.Embedding(..., sparse=True).weight")
        sdtype = p.dtype if p.dtype in (torch.float32, torch.float64) else torch.float32
        path = os.path.join(self.state_dir, f"param{k:04d}.dsa")
        width = self._state_width(p.shape[1])
        huge = self.huge_pages
        if huge is None:
            huge = fits_in_page_cache(p.shape[0] * width * torch.empty((), dtype=sdtype).element_size())
        store = RowStateFile(path, p.shape[0], p.shape[1], width, sdtype, huge_pages=huge)
        self._stores[p] = store
        self._steps[p] = store.step
        self.state[p] = self._state_entry(p)

    def _state_entry(self, p):
        store = self._stores[p]
        entry = {STEP: torch.tensor(self._steps[p], dtype=torch.int64)}
        entry.update(self._state_views(store.records, p.shape[1]))
        return entry

    # -- the step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if not g.is_sparse:
                    raise RuntimeError(
                        f"parameter {self._index(p)} (shape {tuple(p.shape)}) got a dense gradient; "
                        f"{type(self).__name__} needs sparse gradients: build the table with "
                        "nn.Embedding(..., sparse=True) or nn.EmbeddingBag(..., sparse=True), or use "
                        "torch.optim.Adam for dense parameters")
                if g.sparse_dim() != 1:
                    raise RuntimeError(f"parameter {self._index(p)}: the gradient must be row-sparse "
                                       "(sparse_dim 1, as nn.Embedding(sparse=True) produces), got "
                                       f"sparse_dim {g.sparse_dim()}")
                self._steps[p] += 1  # like SparseAdam, a present gradient counts even when empty
                if g._nnz() == 0:
                    continue
                staged = self._staged(p)
                if not staged and self._fused_cpu(p, g, group, self._steps[p]):
                    continue
                if g.is_coalesced():
                    rows, vals = g._indices()[0], g._values()
                else:
                    rows, vals = coalesce_rows(g._indices()[0], g._values())
                step_rows = self._step_rows_staged if staged else self._step_rows
                step_rows(p, rows, vals, group, self._steps[p])
        return loss

    def _step_rows(self, p, rows, vals, group, step):
        store = self._stores[p]
        rows_cpu = rows.cpu()
        rec = store.gather(rows_cpu)
        if p.device != rec.device:
            rec = rec.pin_memory().to(p.device, non_blocking=True)
        g = vals.to(rec.dtype)
        if self._use_triton(p):
            w = p.index_select(0, rows)
            getattr(self._kernel_module(), self._kernel_name)(w, g.contiguous(), rec, step,
                                                             **self._hyper(group))
            p.index_copy_(0, rows, w)
        else:
            self._update_torch(p, rows, g, rec, step, group)
        store.scatter(rows_cpu, rec.cpu())

    def _staged(self, p):
        return p.is_cuda if self._staging is None else bool(self._staging)

    def _stager(self, p):
        st = self._stagers.get(p)
        if st is None:
            if self._executor is None:
                self._executor = make_executor()
            st = self._stagers[p] = RowStager(self._stores[p], p.device, self._executor)
        return st

    def _step_rows_staged(self, p, rows, vals, group, step):
        """``_step_rows`` through persistent pinned/device buffers and announced rows (pipeline.py)."""
        st = self._stager(p)
        rows_cpu = rows.cpu()
        host = st.acquire(rows_cpu)
        rec = st.to_device(host)
        g = vals.to(rec.dtype)
        if self._use_triton(p):
            w = st.weight_rows(p, rows)
            getattr(self._kernel_module(), self._kernel_name)(w, g.contiguous(), rec, step,
                                                             **self._hyper(group))
            p.index_copy_(0, rows, w)
        else:
            self._update_torch(p, rows, g, rec, step, group)
        st.to_host(rec, host)
        self._stores[p].scatter(rows_cpu, host)
        st.written(rows_cpu, host)

    def device_staging_bytes(self):
        """Device memory held by the optimizer: its staging buffers (O(largest batch's unique rows)).

        The moments live in the state files; per step, transient device tensors (the coalesced
        gradient and its sort) come and go through the caching allocator and are not counted.
        """
        return sum(st.device_bytes() for st in self._stagers.values())

    def staging_stats(self):
        """Totals over parameters: staging bytes (device, pinned host) and announcement use.

        ``hits``: steps that used announced records; ``misses``: steps that gathered from the file;
        ``patched_rows``: announced rows refreshed because a step in between wrote them.
        """
        out = dict(device_bytes=self.device_staging_bytes(), hits=0, misses=0, patched_rows=0,
                   pinned_bytes=sum(st.host_bytes() for st in self._stagers.values()))
        for st in self._stagers.values():
            out.update(hits=out["hits"] + st.hits, misses=out["misses"] + st.misses,
                       patched_rows=out["patched_rows"] + st.patched_rows)
        return out

    def _fused_cpu(self, p, g, group, step):
        """Subclass hook: update with a fused CPU kernel straight from the uncoalesced gradient."""
        return False

    def _use_triton(self, p):
        if self.backend == "torch":
            return False
        ok = p.dtype in (torch.float32, torch.bfloat16)
        if self.backend == "triton":
            if not ok:
                raise ValueError(f"parameter {self._index(p)}: backend='triton' handles float32 and "
                                 f"bfloat16 weights, got {p.dtype}; use backend='torch'")
            return True
        return p.is_cuda and ok

    def _kernel_module(self):
        if self._kernels is None:
            from . import kernels  # Triton is imported only when a kernel is used

            self._kernels = kernels
        return self._kernels

    def prefetch(self, indices, param=None):
        """Announce rows the next step will touch, so their state pages are read meanwhile.

        ``indices``: any integer tensor of row indices (e.g. the next batch) of ``param`` (needed only
        when the optimizer has several parameters). For CPU weights the pages are requested with
        ``madvise(MADV_WILLNEED)``, which returns at once and reads in the background; on a warm page
        cache it costs a few microseconds per row and gains nothing. For CUDA weights the rows'
        records are gathered into a pinned buffer on a background thread, and the step whose unique
        rows equal them uses it (steps in between keep it up to date, ``load_state_dict`` drops it;
        see ``pipeline.py``). Writing the state tensors by hand between ``prefetch`` and ``step`` is
        not supported for CUDA weights: the announced copy would not see it.
        """
        self._check_open()
        if param is None:
            if len(self._stores) != 1:
                raise ValueError(f"prefetch: this optimizer has {len(self._stores)} parameters; say which "
                                 "one the indices belong to with param=")
            param = next(iter(self._stores))
        if param not in self._stores:
            raise ValueError("prefetch: param is not one of this optimizer's parameters")
        rows = torch.unique(indices.detach().reshape(-1).to("cpu", torch.int64))
        if rows.numel() and (rows[0] < 0 or rows[-1] >= param.shape[0]):
            raise IndexError(f"prefetch: indices must lie in [0, {param.shape[0]}) for parameter "
                             f"{self._index(param)}")
        if self._staged(param):
            self._stager(param).prefetch(rows)
        else:
            self._stores[param].prefetch(rows)

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self):
        """Step and moments of every parameter; the moments are tensors viewing the state files.

        ``torch.save`` streams them from the files. Like other optimizers' state dicts, the tensors
        are live: later steps change them, so save before stepping again.
        """
        self._check_open()
        for p in self._stores:
            self.state[p][STEP] = torch.tensor(self._steps[p], dtype=torch.int64)
        return super().state_dict()

    def load_state_dict(self, state_dict):
        """Write a state dict's steps and moments into this optimizer's files (then mark them clean).

        Accepts state dicts of this class or of ``torch.optim.SparseAdam`` (same keys). Parameters
        absent from ``state_dict['state']`` get fresh (zero) state.
        """
        self._check_open()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(saved_groups)} parameter groups, this optimizer has "
                             f"{len(self.param_groups)}")
        for i, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(f"state_dict's parameter group {i} has {len(sg['params'])} parameters, "
                                 f"this optimizer's has {len(g['params'])}")
        id_map = dict(zip(itertools.chain.from_iterable(g["params"] for g in saved_groups),
                          itertools.chain.from_iterable(g["params"] for g in self.param_groups)))
        saved_state = {id_map[k]: v for k, v in state_dict["state"].items()}
        loaded = {}
        for p, store in self._stores.items():  # check everything before writing anything
            entry = saved_state.get(p)
            views = self._state_views(store.records, p.shape[1])
            if entry:
                vals = {}
                for key, view in views.items():
                    if key not in entry:
                        raise KeyError(f"state_dict's state of parameter {self._index(p)} lacks {key!r}")
                    vals[key] = torch.as_tensor(entry[key])
                    if vals[key].shape != view.shape:
                        raise ValueError(f"state_dict's {key!r} of parameter {self._index(p)} has shape "
                                         f"{tuple(vals[key].shape)}, expected {tuple(view.shape)}")
                loaded[p] = (vals, int(entry[STEP]))
        for st in self._stagers.values():  # announced records are about to be replaced
            st.invalidate()
        for sg, g in zip(saved_groups, self.param_groups):
            g.update({k: v for k, v in sg.items() if k != "params"})
        for p, store in self._stores.items():
            views = self._state_views(store.records, p.shape[1])
            store.mark_dirty()
            vals, step = loaded.get(p, (None, 0))
            if vals is None:
                store.records.zero_()
            else:
                for key, view in views.items():
                    if vals[key].data_ptr() != view.data_ptr():
                        view.copy_(vals[key])
            store.flush(step)
            self._steps[p] = step
            self.state[p] = self._state_entry(p)

    # -- lifecycle ---------------------------------------------------------------------------------
    def flush(self):
        """Write every state file to disk and mark it clean at the current step."""
        self._check_open()
        for p, store in self._stores.items():
            store.flush(self._steps[p])

    def close(self):
        """Flush and release the state files (and remove the private state_dir). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            for st in self._stagers.values():  # no background gather may outlive the mappings
                st.invalidate()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._stagers.clear()
            for p, store in self._stores.items():
                store.close(self._steps[p])
        finally:
            self.state.clear()
            if self._own_dir:
                self._remove_own_dir()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass

    def _check_open(self):
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} on state_dir {self.state_dir} is closed; "
                               "create a new optimizer (it can reopen the same state_dir)")

    def _index(self, p):
        for k, q in enumerate(self._stores):
            if q is p:
                return k
        return "?"

    def __getstate__(self):
        raise TypeError(f"{type(self).__name__} cannot be pickled: its state lives in files; "
                        "save opt.state_dict() instead")
