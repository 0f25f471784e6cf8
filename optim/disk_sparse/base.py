"""The machinery both Disk Sparse optimizers share: state files, the step, checkpoints.

Each optimizer (``optimizer.py``) is a constructor plus a choice of update rule (``rules.py``: the
record a row keeps, the rule's backends and what they refuse). :class:`DiskSparseOptimizer` owns one :class:`~optim.disk_sparse.store.RowStateFile` and one stager (``pipeline.py``)
per parameter and runs one step path: per parameter, the sparse gradient is coalesced into sorted
unique rows (``torch_ops.coalesce_rows``), the stager brings those rows' records next to the weight
rows, the backend's row update changes both in place, and the stager writes the records back.
Untouched rows are never read. A backend with a fused update straight from the uncoalesced gradient
(numba, for CPU weights) takes the whole step instead.
"""

from __future__ import annotations

import copy
import os
import tempfile
import weakref
from typing import NamedTuple

import torch

from ..backends import BACKENDS, choose_backend
from . import pipeline
from .checks import check_grad, check_option, check_param, loaded_columns, saved_state_by_param
from .state import STEP
from .store import (RowStateFile, StateFileError, fits_in_page_cache, make_state_dir, remove_dir_of,
                    state_files_in)
from .torch_ops import coalesce_rows
from .weights import weight_file

class Route(NamedTuple):
    """How one parameter is stepped: its stager, the backend's name and its functions."""

    stager: object  # pipeline.DirectStager or pipeline.RowStager
    backend: str
    rows_fn: object  # rows_fn(w, g, state, step, **hyper)
    sparse_fn: object  # sparse_fn(weight, indices, values, records, step, **hyper), or None


def _cols(p):
    """Values per row: a 1-D table is kept as N rows of one value."""
    return p.shape[1] if p.dim() == 2 else 1


class DiskSparseOptimizer(torch.optim.Optimizer):
    """Shared machinery: per-parameter state files and stagers, the step, checkpoints.

    ``rule`` (``rules.Rule``) is the update rule; ``backend`` ("auto", "torch", "numba", "triton") is
    resolved per parameter when it is added (``backend_of``); ``staging`` chooses the stager (None:
    the staged pipeline for CUDA weights, direct otherwise; True: staged for any weights).
    """

    def __init__(self, params, defaults, rule, state_dir=None, backend="auto", huge_pages=None,
                 staging=None, resume=False):
        check_option("backend", backend, BACKENDS, f"one of {BACKENDS}")
        check_option("huge_pages", huge_pages, (None, True, False), "None (decide by size), True or False")
        check_option("staging", staging, (None, True, False), "None (staged for CUDA weights), True or False")
        self.rule = rule
        self.state_format = rule.state_format
        self.backend, self.huge_pages, self.staging = backend, huge_pages, staging
        self._own_dir = state_dir is None
        if state_dir is None:
            state_dir = tempfile.mkdtemp(prefix="disk-sparse-adam-")
            # Removed by close(), and at interpreter exit if close() never ran (at shutdown __del__
            # may not run, which would leave a table-sized file in /tmp). Holds the path only.
            self._remove_own_dir = weakref.finalize(self, remove_dir_of, os.getpid(), state_dir)
        self.state_dir = os.fspath(state_dir)
        self._owner = os.getpid()  # a forked child only drops its copies (see close)
        self._stores: dict = {}  # parameter -> RowStateFile
        self._weight_files: dict = {}  # parameter -> weights.WeightFile, for weights in a file
        self._routes: dict = {}  # parameter -> Route
        self._step_counts: dict = {}  # parameter -> int
        self._executor = None  # the background gather thread of the staged pipeline
        self._closed = False
        make_state_dir(self.state_dir)
        if not resume and not self._own_dir and state_files_in(self.state_dir):
            self._closed = True
            raise StateFileError(
                f"state_dir {self.state_dir} already holds state files ({state_files_in(self.state_dir)[0]}, "
                "...). Pass resume=True to continue from them (at the step their headers hold), or "
                "restore a checkpoint: give a new (or emptied) state_dir and call load_state_dict")
        try:
            super().__init__(params, defaults)
        except BaseException:
            self.close()
            raise

    # -- parameters and their files ----------------------------------------------------------------
    def add_param_group(self, param_group):
        self._check_open()
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            self._open(p)

    def _open(self, p):
        k, owner = len(self._stores), type(self).__name__
        check_param(p, k, owner, self.rule.table_dims)
        sdtype = self.rule.record_dtype(p.dtype)
        width = self.rule.width(_cols(p))
        huge = self.huge_pages
        if huge is None:
            huge = fits_in_page_cache(p.shape[0] * width * torch.empty((), dtype=sdtype).element_size())
        backend = choose_backend(self.backend, p.device, lambda name: self.rule.refuses(name, p), owner=owner,
                                 what=f"parameter {k} (shape {tuple(p.shape)}, dtype {p.dtype})")
        rows_fn, sparse_fn = self.rule.kernels(backend)
        path = os.path.join(self.state_dir, f"param{k:04d}.dsa")
        resume_step = 0 if os.path.exists(path) else None  # an existing state file is resumed
        store = RowStateFile(path, p.shape[0], _cols(p), width, sdtype, huge_pages=huge,
                             state_format=self.state_format)
        wf = weight_file(p)
        if wf is not None and resume_step is not None and wf.step != store.step:
            store.close()
            raise StateFileError(
                f"weight file {wf.path} is at step {wf.step} but state file {store.path} at step "
                f"{store.step}: they were not flushed together; restore both from one checkpoint")
        self._stores[p] = store
        if wf is not None:
            self._weight_files[p] = wf
        if self._executor is None:  # its thread starts at the first prefetch
            self._executor = pipeline.make_executor()
        if p.is_cuda if self.staging is None else self.staging:
            stager, sparse_fn = pipeline.RowStager(store, p.device, self._executor), None
        else:
            stager = pipeline.DirectStager(store, p.device, self._executor)
        stager.weight_file = wf
        self._routes[p] = Route(stager, backend, rows_fn, sparse_fn)
        self._step_counts[p] = store.step
        self.state[p] = self._state_entry(p, store.records)

    def _state_entry(self, p, records):
        """``p``'s state: its step (a Python int, as SparseAdam keeps it; its bias correction is in
        float64) and the views of ``records``."""
        return {STEP: self._step_counts[p], **self._views(p, records)}

    def _views(self, p, records):
        """The rule's state-dict views of ``p``'s ``records``, of ``p``'s shape (a 1-D table is kept
        as N x 1 records)."""
        views = self.rule.views(records, _cols(p))
        return views if p.dim() == 2 else {k: v.squeeze(1) for k, v in views.items()}

    def backend_of(self, p) -> str:
        """Which path updates ``p``: "torch", "numba" or "triton" (resolved when ``p`` was added)."""
        return self._route(p, "backend_of").backend

    def state_file(self, p) -> RowStateFile:
        """The state file of parameter ``p``."""
        self._route(p, "state_file")
        return self._stores[p]

    def state_files(self) -> list:
        """The state files of all parameters, in parameter order."""
        return list(self._stores.values())

    def stager(self, p):
        """The stager of parameter ``p`` (``pipeline.DirectStager`` or ``pipeline.RowStager``)."""
        return self._route(p, "stager").stager

    def _route(self, p, caller):
        if p not in self._routes:
            raise ValueError(f"{caller}: p is not one of this optimizer's parameters")
        return self._routes[p]

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
            hyper = self.rule.hyper(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = check_grad(p, self._index(p), type(self).__name__, self.rule)
                if p in self._weight_files:
                    self._weight_files[p].mark_dirty()
                self._step_counts[p] += 1  # like SparseAdam, a present gradient counts even when empty
                self.state[p][STEP] = step = self._step_counts[p]
                if not g._nnz():
                    continue
                if g.sparse_dim() == 2:
                    self._step_elements(p, g, step, hyper)
                else:
                    self._step_rows(p, g, step, hyper)
        return loss

    def _step_rows(self, p, g, step, hyper):
        route = self._routes[p]
        vals = g._values().reshape(g._nnz(), _cols(p))  # a 1-D table is updated as N x 1
        w_all = p if p.dim() == 2 else p.unsqueeze(1)
        if route.sparse_fn is not None:
            route.stager.fetch(g._indices()[0].cpu())
            route.sparse_fn(w_all, g._indices()[0], vals.to(p.dtype), self._stores[p].writable(), step, **hyper)
            return
        rows = g._indices()[0]
        if not g.is_coalesced():
            rows, vals = coalesce_rows(rows, vals)
        self._update_rows(p, w_all, rows, vals, step, hyper)

    def _step_elements(self, p, g, step, hyper):
        """An element-sparse gradient (``dense.to_sparse()``): its rows are updated whole, then
        only the elements it holds keep the new weight and moments, as SparseAdam updates them."""
        g = g.coalesce()
        (r, c), vals = g._indices(), g._values()
        rows, inv = torch.unique(r, return_inverse=True)
        dense = torch.zeros(rows.numel(), p.shape[1], dtype=self._compute_dtype(p), device=vals.device)
        dense[inv, c] = vals.to(dense.dtype)
        mask = torch.zeros(dense.shape, dtype=torch.bool, device=vals.device)
        mask[inv, c] = True
        self._update_rows(p, p, rows, dense, step, hyper, mask=mask)

    def _update_rows(self, p, w_all, rows, vals, step, hyper, mask=None):
        """Stage the records of sorted unique ``rows``, update them and their weight rows with the
        backend's row rule, write both back; with ``mask``, only its elements keep the update."""
        stager, rows_fn = self._routes[p].stager, self._routes[p].rows_fn
        rows_cpu = rows.cpu()
        host = stager.acquire(rows_cpu)
        rec = stager.to_device(host)
        w = stager.weight_rows(w_all, rows)
        if mask is not None:
            w_old, rec_old = w.clone(), rec.clone()
        rows_fn(w, vals.to(self._compute_dtype(p)).contiguous(), rec, step, **hyper)
        if mask is not None:
            w = torch.where(mask, w, w_old)
            rec_mask = mask.to(rec.device).repeat(1, rec.shape[1] // mask.shape[1])
            rec.copy_(torch.where(rec_mask, rec, rec_old))
        w_all.index_copy_(0, rows, w)
        stager.commit(rows_cpu, rec, host)

    def _compute_dtype(self, p):
        """The dtype of the row update: the state's, float32 for byte records."""
        dtype = self._stores[p].dtype
        return dtype if dtype.is_floating_point else torch.float32

    def device_staging_bytes(self):
        """Device memory held by the optimizer: its staging buffers (O(largest batch's unique rows)).

        The moments live in the state files; per step, transient device tensors (the coalesced
        gradient and its sort) come and go through the caching allocator and are not counted.
        """
        return sum(r.stager.device_bytes() for r in self._routes.values())

    def staging_stats(self):
        """Totals over parameters: staging bytes (device, pinned host) and announcement use.

        ``hits``: steps that used announced records; ``misses``: steps that gathered from the file;
        ``patched_rows``: announced rows refreshed because a step in between wrote them.
        """
        stagers = [r.stager for r in self._routes.values()]
        return dict(device_bytes=self.device_staging_bytes(), pinned_bytes=sum(s.host_bytes() for s in stagers),
                    hits=sum(s.hits for s in stagers), misses=sum(s.misses for s in stagers),
                    patched_rows=sum(s.patched_rows for s in stagers))

    def prefetch(self, indices, param=None):
        """Announce rows the next step will touch, so their state pages are read meanwhile.

        ``indices``: any integer tensor of row indices (e.g. the next batch) of ``param`` (needed only
        when the optimizer has several parameters). For CPU weights a background thread queues
        reads of the rows' record pages (and of their weight rows for a ``mapped_embedding``), all
        in flight together (``posix_fadvise(WILLNEED)``); the step itself reads the file, so results
        do not depend on announcements. On a warm page cache it gains nothing. For staged weights
        (CUDA, or ``staging=True``) the rows' records are gathered into a pinned buffer on a
        background thread, and the step whose unique rows equal them uses it (steps in between keep
        it up to date, ``load_state_dict`` drops it; see ``pipeline.py``). Writing the state tensors
        by hand between ``prefetch`` and ``step`` is not supported for staged weights: the announced
        copy would not see it.
        """
        self._check_open()
        if param is None:
            if len(self._stores) != 1:
                raise ValueError(f"prefetch: this optimizer has {len(self._stores)} parameters; say which "
                                 "one the indices belong to with param=")
            param = next(iter(self._stores))
        stager = self._route(param, "prefetch").stager
        rows = torch.unique(indices.detach().reshape(-1).to("cpu", torch.int64))
        if not rows.numel():
            return
        if rows[0] < 0 or rows[-1] >= param.shape[0]:
            raise IndexError(f"prefetch: indices must lie in [0, {param.shape[0]}) for parameter "
                             f"{self._index(param)}")
        stager.prefetch(rows)

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self):
        """Step and moments of every parameter; the moments are copy-on-write views of the files
        (copies where the rule views one record's bytes as several dtypes, as the compact format
        does: ``torch.save`` cannot save one storage as several dtypes).

        ``torch.save`` streams them from the files without a copy in RAM. Until a later step
        writes a row, the tensors show the file as it is (save before stepping again); what another
        optimizer that loads them (``torch.optim.SparseAdam``) writes stays in its private pages and
        never reaches the files (``RowStateFile.private_records``).
        """
        self._check_open()
        live = {p: self.state[p] for p in self._stores}
        try:  # torch packs (and its state-dict hooks see) these copy-on-write entries, not the live ones
            for p, store in self._stores.items():
                records = store.private_records()
                entry = self._state_entry(p, records)
                if any(torch.is_tensor(v) and v.dtype != records.dtype for v in entry.values()):
                    entry = {k: v.clone() if torch.is_tensor(v) else v for k, v in entry.items()}
                self.state[p] = entry
            return super().state_dict()
        finally:
            self.state.update(live)

    def load_state_dict(self, state_dict):
        """Write a state dict's steps and moments into this optimizer's files (then mark them clean).

        Accepts state dicts of this class or of ``torch.optim.SparseAdam`` (same keys). Parameters
        absent from ``state_dict['state']`` get fresh (zero) state. The whole state dict is checked
        (groups, parameters, keys, shapes, dtypes, steps) before anything is written, so a bad one
        leaves every file as it was, and every table is marked dirty before any is written, so a
        load cut short leaves a directory that is refused on reopening, never one at mixed steps.
        """
        self._check_open()
        state_dict = state_dict.copy()  # shallow, as torch's: a pre-hook may replace entries
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            hook_result = pre_hook(self, state_dict)
            state_dict = state_dict if hook_result is None else hook_result
        saved = saved_state_by_param(self.param_groups, state_dict)
        loaded = {p: loaded_columns(self._views(p, store.records), saved.get(p),
                                    f"state_dict's state of parameter {k}", self.rule)
                  for k, (p, store) in enumerate(self._stores.items())}
        for route in self._routes.values():  # announced records are about to be replaced
            route.stager.invalidate()
        for sg, g in zip(state_dict["param_groups"], self.param_groups):
            # a dict saved before ``maximize`` existed was minimizing (SparseAdam reads a missing key as
            # False); options SparseAdam does not have (``bitwise``, ...) keep this optimizer's value
            g.update({k: v for k, v in sg.items() if k != "params"})
            if "maximize" in g and "maximize" not in sg:
                g["maximize"] = False
        for store in self._stores.values():  # a kill during the writes below leaves every table dirty
            store.mark_dirty()
        for p, store in self._stores.items():
            columns, step = loaded[p]
            store.write_all(columns, step)
            self._step_counts[p] = step
            self.state[p] = self._state_entry(p, store.records)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __deepcopy__(self, memo):
        """An independent optimizer over deep copies of the parameters, in a new private state_dir
        holding a copy of this one's state, with its step and state-dict hooks (as deepcopy gives
        SparseAdam's). Refused for a fixed state_dir, which two optimizers cannot share."""
        self._check_open()
        if not self._own_dir:
            raise RuntimeError(f"cannot deepcopy {type(self).__name__} on the fixed state_dir {self.state_dir}: "
                               "two optimizers cannot share it. Create one on another state_dir and "
                               "load_state_dict(opt.state_dict()) into it")
        groups = [{k: copy.deepcopy(v, memo) for k, v in g.items()} for g in self.param_groups]
        twin = memo[id(self)] = type(self)(groups, **copy.deepcopy(self.defaults, memo), **self._options())
        twin.load_state_dict(self.state_dict())
        for name, hooks in vars(self).items():
            if name.startswith("_optimizer_") and name.endswith("_hooks"):
                setattr(twin, name, copy.copy(hooks))
        return twin

    def _options(self) -> dict:
        """The constructor's options that are not hyper-parameters, for a private state_dir."""
        return dict(backend=self.backend, huge_pages=self.huge_pages, staging=self.staging,
                    state_format=self.state_format)

    def __getstate__(self):
        raise TypeError(f"{type(self).__name__} cannot be pickled: its state lives in files; "
                        "save opt.state_dict() instead")

    # -- lifecycle ---------------------------------------------------------------------------------
    def flush(self):
        """Write every state file (and weight file, ``weights.py``) to disk and mark it clean at the
        current step."""
        self._check_open()
        for p, store in self._stores.items():
            if p in self._weight_files:  # the weights first: a clean state file implies clean weights
                self._weight_files[p].flush(self._step_counts[p])
            store.flush(self._step_counts[p])

    def close(self):
        """Flush and release the state files (and remove the private state_dir). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._owner:  # a forked child: the files, lock and directory are the parent's
            for store in self._stores.values():
                store.close()
            self._clear_state()
            return
        try:
            for route in self._routes.values():  # no background gather may outlive the mappings
                route.stager.invalidate()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._routes.clear()
            for p, store in self._stores.items():
                wf = self._weight_files.get(p)
                if wf is not None and not wf.closed:  # flushed, left open: the module owns it
                    wf.flush(self._step_counts[p])
                store.close(self._step_counts[p])
            self._weight_files.clear()
        finally:
            self._clear_state()
            if self._own_dir:
                self._remove_own_dir()

    def _clear_state(self):
        state = self.__dict__.get("state")  # absent when Optimizer.__init__ refused the params
        if state is not None:
            state.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        # Only this object's own attributes: a wrapper that delegates attribute reads to the
        # optimizer it wraps (Lightning's LightningOptimizer) must never close that optimizer.
        try:
            if self.__dict__.get("_closed", True) is False:
                self.close()
        except Exception:
            pass

    def _check_open(self):
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} on state_dir {self.state_dir} is closed; "
                               "create a new optimizer (it can reopen the same state_dir)")
        if os.getpid() != self._owner:
            raise RuntimeError(f"{type(self).__name__} on state_dir {self.state_dir} belongs to process "
                               f"{self._owner}; a forked child cannot use it: create one in the child")

    def _index(self, p):
        for k, q in enumerate(self._stores):
            if q is p:
                return k
        return "?"
