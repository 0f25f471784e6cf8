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
import warnings
import weakref
from typing import NamedTuple

import torch

from .._base import OptimizerBase
from .._torch_private import copy_optimizer_hooks, sparse_parts
from ..backends import BACKENDS, choose_backend
from . import pipeline
from .checks import check_flags, check_grad, check_option, check_param, loaded_columns, saved_state_by_param
from .state import STEP
from .state_dirs import check_ram_state, filesystem_type, make_private_dir, memory_available
from .store import (HEADER_BYTES, RowStateFile, StateFileError, fits_in_page_cache, locked_state_file,
                    make_state_dir, memory_limit_bytes, remove_dir_of, state_files_in, weights_fingerprint)
from .torch_ops import coalesce_rows
from .weights import weight_file

class Route(NamedTuple):
    """How one parameter is stepped: its stager, the backend's name and its functions."""

    stager: object  # pipeline.DirectStager or pipeline.RowStager
    backend: str
    rows_fn: object  # rows_fn(w, g, state, step, **hyper)
    sparse_fn: object  # sparse_fn(weight, indices, values, records, step, **hyper), or None


# The options of the state files: one value per optimizer, kept in every group (and state dict).
FILE_OPTIONS = ("state_dir", "state_format", "backend", "staging", "huge_pages")


def _meta_message(k):
    return (f"parameter {k} is still on the meta device, so it can never be trained: module.to_empty(device=...) "
            "gives the module new Parameter objects (unless torch.__future__.set_swap_module_params_on_conversion"
            "(True)), and this optimizer holds the old ones. Build the optimizer after module.to_empty(...)")


def _listed(params):
    """``params`` as a list (a generator can be read once), as torch's Optimizer reads it."""
    return params if isinstance(params, torch.Tensor) else list(params)  # a tensor: torch's error


def _tensors_of(params):
    """The tensors of a parameter list, of groups (dicts) or of (name, tensor) pairs."""
    for item in params:
        if isinstance(item, dict):
            yield from _tensors_of(item.get("params", []) if not isinstance(item.get("params"), torch.Tensor)
                                   else [item["params"]])
        elif isinstance(item, tuple) and len(item) == 2:
            yield item[1]
        else:
            yield item


def _cols(p):
    """Values per row: a 1-D table is kept as N rows of one value."""
    return p.shape[1] if p.dim() == 2 else 1


class DiskSparseOptimizer(OptimizerBase):
    """Shared machinery: per-parameter state files and stagers, the step, checkpoints.

    ``rule`` (``rules.Rule``) is the update rule; ``backend`` ("auto", "torch", "numba", "triton") is
    resolved per parameter when it is added (``backend_of``); ``staging`` chooses the stager (None:
    the staged pipeline for CUDA weights, direct otherwise; True: staged for any weights).
    """

    OPTIMIZER_WIDE = FILE_OPTIONS
    WIDE_REASON = "one optimizer has one state_dir and format"

    def __init__(self, params, defaults, rule, state_dir=None, backend="auto", huge_pages=None,
                 staging=None, resume=False):
        owner = type(self).__name__
        check_option("backend", backend, BACKENDS, f"one of {BACKENDS}")
        check_option("huge_pages", huge_pages, (None, True, False), "None (decide by size), True or False")
        check_option("staging", staging, (None, True, False), "None (staged for CUDA weights), True or False")
        check_flags(resume=resume)
        if resume and state_dir is None:
            raise ValueError(f"{owner}: resume=True continues from the state files in state_dir; give "
                             "state_dir (state_dir=None is a new private directory, with nothing to resume)")
        rule.check_group(defaults)
        defaults = dict(defaults, betas=tuple(defaults["betas"]))
        self.rule = rule
        self.state_format = rule.state_format
        self.backend, self.huge_pages, self.staging = backend, huge_pages, staging
        self._own_dir = state_dir is None
        # Every option lives in the groups, so a framework that re-creates the optimizer from
        # ``param_groups[0]`` (PyKEEN) gets this one back, on the same state_dir.
        defaults = dict(defaults, state_dir=None if state_dir is None else os.fspath(state_dir),
                        state_format=rule.state_format, backend=backend, staging=staging, huge_pages=huge_pages)
        if state_dir is None:
            state_dir = make_private_dir()  # under $TMPDIR; orphans of killed processes removed first
            # Removed by close(), and at interpreter exit if close() never ran (at shutdown __del__
            # may not run, which would leave a table-sized file in /tmp). Holds the path only.
            self._remove_own_dir = weakref.finalize(self, remove_dir_of, os.getpid(), state_dir)
        self.state_dir = os.fspath(state_dir)
        self._owner = os.getpid()  # a forked child only drops its copies (see close)
        self._stores: dict = {}  # parameter -> RowStateFile
        self._positions: dict = {}  # parameter -> its index (file param{k:04d}.dsa), named in errors
        self._weight_files: dict = {}  # parameter -> weights.WeightFile, for weights in a file
        self._routes: dict = {}  # parameter -> Route for the device it was last stepped on (None: not yet)
        self._step_counts: dict = {}  # parameter -> int
        self._layouts: dict = {}  # parameter -> (dtype, shape) its state file was made for
        self._executor = None  # the background gather thread of the staged pipeline
        self._torn = False  # a step or load was interrupted: the files hold no one step
        self._closed = False
        self._created: list = []  # state files this optimizer made: removed if its constructor fails
        self._new_bytes = 0  # their size: on a RAM filesystem, memory (see state_dirs.check_ram_state)
        self._ram_warned = False
        make_state_dir(self.state_dir)
        self._fs_type = filesystem_type(self.state_dir)
        if not self._own_dir:
            busy = locked_state_file(self.state_dir)
            if busy is not None:
                self._closed = True
                raise StateFileError(
                    f"state_dir {self.state_dir}: {busy} is in use by another optimizer (it holds the "
                    "file's lock): two optimizers cannot share one state_dir. Close that optimizer first (to continue "
                    "its state: resume=True), or give this one another state_dir")
        if not resume and not self._own_dir and state_files_in(self.state_dir):
            self._closed = True
            raise StateFileError(
                f"state_dir {self.state_dir} already holds state files ({state_files_in(self.state_dir)[0]}, "
                "...). Pass resume=True to continue from them (at the step their headers hold), or "
                "restore a checkpoint: give a new (or emptied) state_dir and call load_state_dict")
        try:
            params = _listed(params)
            self._opened_bytes = 0
            self._planned_bytes = 0 if isinstance(params, torch.Tensor) else sum(
                self._state_bytes(p) for p in _tensors_of(params)
                if isinstance(p, torch.Tensor) and p.dim() in rule.table_dims)
            super().__init__(params, defaults)
            if resume:
                self._check_resumed_order()
            extra = sorted(set(state_files_in(self.state_dir)) - {os.path.basename(s.path) for s in self._stores.values()})
            if resume and extra:
                raise StateFileError(
                    f"state_dir {self.state_dir} holds state files of more parameters than this optimizer has "
                    f"({', '.join(extra)}): it would resume only some of them. Give every parameter that was "
                    "trained with it, or restore a checkpoint into a new state_dir")
        except BaseException:
            try:
                self.close()
            finally:
                for path in self._created:  # zero state, made by this call: nothing worth keeping
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
            raise

    # -- parameters and their files ----------------------------------------------------------------
    def add_param_group(self, param_group):
        self._check_open()
        # torch's, not the base's: each parameter's backend is chosen with its route (a meta table's
        # at its first step), not in the base's backend table
        torch.optim.Optimizer.add_param_group(self, param_group)
        group = self.param_groups[-1]
        try:
            self._check_optimizer_wide(group, len(self.param_groups) - 1)
            self.rule.check_group(group)
        except BaseException:
            self.param_groups.pop()
            raise
        group["betas"] = tuple(group["betas"])
        names = group.get("param_names") or [""] * len(group["params"])
        for p, name in zip(group["params"], names):
            self._open(p, name)

    def _open(self, p, name=""):
        k = len(self._stores)
        check_param(p, k, type(self).__name__, self.rule.table_dims)
        sdtype = self.rule.record_dtype(p.dtype)
        width = self.rule.width(_cols(p))
        nbytes = self._state_bytes(p)
        # whether the optimizer's state as a whole stays in the page cache: the tables so far, this one
        # and those the constructor was given after it
        self._opened_bytes += nbytes
        fits = fits_in_page_cache(max(self._opened_bytes, self._planned_bytes))
        huge = fits if self.huge_pages is None else self.huge_pages
        path = os.path.join(self.state_dir, f"param{k:04d}.dsa")
        resumed = os.path.exists(path)
        wf = weight_file(p)
        trainer = None if wf is None or wf.optimizer is None else wf.optimizer()
        if trainer is not None and trainer is not self and not trainer.__dict__.get("_closed", True):
            raise StateFileError(f"parameter {k}: the mapped_embedding {wf.path} is already trained by another "
                                 f"optimizer (on state_dir {trainer.state_dir}); close that one first")
        backend = None if p.is_meta else self._choose_backend(p, k)  # a meta table: at its first step
        if not resumed:
            self._check_ram(nbytes)
        store = RowStateFile(path, p.shape[0], _cols(p), width, sdtype, huge_pages=huge,
                             state_format=self.state_format, stays_in_memory=fits, name=name)
        if not resumed:
            self._created.append(path)
        if wf is not None and resumed and wf.step != store.step:
            store.close()
            raise StateFileError(
                f"weight file {wf.path} is at step {wf.step} but state file {store.path} at step "
                f"{store.step}: they were not flushed together; restore both from one checkpoint")
        self._stores[p] = store
        self._positions[p] = k
        if wf is not None:
            self._weight_files[p] = wf
            wf.optimizer = weakref.ref(self)
        if self._executor is None:  # its thread starts at the first prefetch
            self._executor = pipeline.make_executor()
        self._routes[p] = None if backend is None else self._new_route(p, backend)
        self._step_counts[p] = store.step
        self._layouts[p] = (p.dtype, tuple(p.shape))
        if resumed:  # the file's records are this parameter's state (SparseAdam has none before a step)
            self.state[p] = {STEP: store.step}

    def _check_resumed_order(self):
        """Refuse a resume whose tables come in another order than they were saved in: a table
        whose weights differ from those its file was flushed with, but match those another file of
        the same shape and dtype was flushed with, would take over that table's moments and steps."""
        held = {p: s.fingerprint() for p, s in self._stores.items()}
        owner = {fp: p for p, fp in held.items() if fp is not None}
        for p in self._stores:
            if p.is_meta or held[p] is None:
                continue
            mine = weights_fingerprint(p)
            other = owner.get(mine)
            if mine != held[p] and other is not None and other is not p:
                k, j = self._index(p), self._index(other)
                raise StateFileError(
                    f"state_dir {self.state_dir}: the weights of parameter {k} ({tuple(p.shape)}) are those "
                    f"{os.path.basename(self._stores[other].path)} (parameter {j}) was saved with, not those of "
                    f"{os.path.basename(self._stores[p].path)}: were the tables given in another order? Give "
                    "them in the order they were trained in (or by name: named_parameters()), or restore a "
                    "checkpoint into a new state_dir")

    def _fingerprint(self, p, store):
        """Record ``p``'s weights' fingerprint in its state file before a clean point that follows
        writes (a constructor that failed, or an optimizer that never stepped, leaves it as it was)."""
        if p.is_meta or not store.owned() or store.closed or not store.dirty:
            return
        try:
            digest = weights_fingerprint(p)
        except RuntimeError:  # weights that cannot be read now (a lost device): no check at resume
            return
        store.write_fingerprint(digest)

    def _state_bytes(self, p):
        """The size of ``p``'s state file."""
        esize = torch.empty((), dtype=self.rule.record_dtype(p.dtype)).element_size()
        return HEADER_BYTES + p.shape[0] * self.rule.width(_cols(p)) * esize

    def _check_ram(self, nbytes):
        """Before a new state file of ``nbytes`` is made: refuse (or warn once about) state a RAM
        filesystem would hold in memory (``state_dirs.check_ram_state``)."""
        if self._fs_type is None:
            return
        message = check_ram_state(self.state_dir, self._new_bytes + nbytes, self._fs_type, memory_available(),
                                  memory_limit_bytes())
        self._new_bytes += nbytes
        if message and not self._ram_warned:
            self._ram_warned = True
            warnings.warn(message, UserWarning, stacklevel=5)

    def _choose_backend(self, p, k):
        return choose_backend(self.backend, p.device, lambda name: self.rule.refuses(name, p),
                              owner=type(self).__name__,
                              what=f"parameter {k} (shape {tuple(p.shape)}, dtype {p.dtype})")

    def _new_route(self, p, backend):
        """The stager and row functions of ``p`` on the device it is on now."""
        rows_fn, sparse_fn = self.rule.kernels(backend)
        store = self._stores[p]
        if p.is_cuda if self.staging is None else self.staging:
            stager, sparse_fn = pipeline.RowStager(store, p.device, self._executor), None
        else:
            stager = pipeline.DirectStager(store, p.device, self._executor)
        stager.weight_file = self._weight_files.get(p)
        return Route(stager, backend, rows_fn, sparse_fn)

    def _current_route(self, p):
        """``p``'s route for the device it is on now: a parameter moved after construction (as
        transformers' Trainer moves the model) gets its backend and stager anew, as torch's
        optimizers create their state lazily; a weight that left its ``mapped_embedding`` file is
        refused, since its file would no longer see the training."""
        k = self._index(p)
        wf = self._weight_files.get(p)
        if wf is not None:
            wf.check_usable()
        if wf is not None and (not wf.holds(p) or p.dtype != wf.dtype):
            raise RuntimeError(
                f"parameter {k}: the weight of the mapped_embedding {wf.path} no longer lives in its file "
                f"(it is now a {p.dtype} tensor on {p.device}: share_memory(), .to() or a dtype cast "
                "copied it), so its training would be lost. Keep a mapped weight where it is, or use "
                "an ordinary nn.Embedding(sparse=True)")
        self._check_layout(p, k)
        route = self._routes[p]
        if route is None or route.stager.device != p.device:
            if p.is_meta:
                raise RuntimeError(_meta_message(k))
            if route is not None:
                route.stager.invalidate()
            route = self._routes[p] = self._new_route(p, self._choose_backend(p, k))
        return route

    def _check_layout(self, p, k):
        """Refuse a parameter whose dtype or shape changed after its state file was made (a cast such
        as ``module.double()`` or ``.float()``, or ``p.data = ...``): its records were made for the
        old one, and no kernel may run over buffers of mismatched dtypes or shapes."""
        dtype, shape = self._layouts[p]
        if p.dtype != dtype:
            raise RuntimeError(
                f"parameter {k}: its dtype changed from {dtype} to {p.dtype} after {type(self).__name__} was "
                f"built (a cast such as module.double() or .float()); its state file holds "
                f"{self._stores[p].dtype} records made for {dtype} weights. Cast the table before building "
                "the optimizer, or carry the state over: sd = opt.state_dict(); opt.close(); build a new "
                "optimizer on the cast table and call load_state_dict(sd) (the moments are converted)")
        if tuple(p.shape) != shape:
            raise RuntimeError(
                f"parameter {k}: its shape changed from {shape} to {tuple(p.shape)} after "
                f"{type(self).__name__} was built (p.data was replaced); its state file holds records for "
                f"{shape[0]} rows. Build a new optimizer for the new table")

    def _views(self, p, records):
        """The rule's state-dict views of ``p``'s ``records``, of ``p``'s shape (a 1-D table is kept
        as N x 1 records)."""
        views = self.rule.views(records, _cols(p))
        return views if p.dim() == 2 else {k: v.squeeze(1) for k, v in views.items()}

    def backend_of(self, p) -> str:
        """Which path updates ``p``: "torch", "numba" or "triton", for the device ``p`` is on now."""
        self._known(p, "backend_of")
        return self._current_route(p).backend

    def step_count(self, p) -> int:
        """Steps with a gradient for ``p`` (the t of its bias corrections), also before its first step."""
        self._known(p, "step_count")
        return self._step_counts[p]

    def state_file(self, p) -> RowStateFile:
        """The state file of parameter ``p``."""
        self._known(p, "state_file")
        return self._stores[p]

    def state_files(self) -> list:
        """The state files of all parameters, in parameter order."""
        return list(self._stores.values())

    def stager(self, p):
        """The stager of parameter ``p`` (``pipeline.DirectStager`` or ``pipeline.RowStager``)."""
        self._known(p, "stager")
        return self._current_route(p).stager

    def _known(self, p, caller):
        if p not in self._stores:
            raise ValueError(f"{caller}: p is not one of this optimizer's parameters")

    # -- the step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []  # every gradient and route is checked before any file is written
        for group in self.param_groups:
            hyper = self.rule.hyper(group)
            for p in group["params"]:
                if p.is_meta:  # never gets a gradient: the module trains a new Parameter now
                    raise RuntimeError(_meta_message(self._index(p)))
                if p.grad is not None:
                    g = check_grad(p, self._index(p), type(self).__name__, self.rule)
                    work.append((p, g, self._current_route(p), hyper))
        try:
            for p, g, route, hyper in work:
                if p in self._weight_files:
                    self._weight_files[p].mark_dirty()
                self._step_counts[p] += 1  # like SparseAdam, a present gradient counts even when empty
                self.state[p][STEP] = step = self._step_counts[p]  # the step only: the moments stay in the file
                if sparse_parts(g)[1].shape[0] == 0:  # an empty gradient
                    continue
                if g.sparse_dim() == 2:
                    self._step_elements(p, g, route, step, hyper)
                else:
                    self._step_rows(p, g, route, step, hyper)
        except BaseException:
            self._torn = True  # the files hold no one step: never mark them clean (see close)
            raise
        return loss

    def _step_rows(self, p, g, route, step, hyper):
        indices, values = sparse_parts(g)  # uncoalesced: duplicates are summed below
        vals = values.reshape(values.shape[0], _cols(p))  # a 1-D table is updated as N x 1
        w_all = p if p.dim() == 2 else p.unsqueeze(1)
        if route.sparse_fn is not None:
            route.stager.fetch(indices[0].cpu())  # under no lock: it holds no buffer
            route.sparse_fn(w_all, indices[0], vals.to(p.dtype), self._stores[p].writable(), step, **hyper)
            torch.autograd.graph.increment_version(p)  # written by compiled code: autograd must know
            return
        rows = indices[0]
        if not g.is_coalesced():
            rows, vals = coalesce_rows(rows, vals)
        self._update_rows(route, w_all, rows, vals, step, hyper)

    def _step_elements(self, p, g, route, step, hyper):
        """An element-sparse gradient (``dense.to_sparse()``): its rows are updated whole, then
        only the elements it holds keep the new weight and moments, as SparseAdam updates them."""
        g = g.coalesce()
        (r, c), vals = sparse_parts(g)
        rows, inv = torch.unique(r, return_inverse=True)
        dense = torch.zeros(rows.numel(), p.shape[1], dtype=self._compute_dtype(self._stores[p]), device=vals.device)
        dense[inv, c] = vals.to(dense.dtype)
        mask = torch.zeros(dense.shape, dtype=torch.bool, device=vals.device)
        mask[inv, c] = True
        self._update_rows(route, p, rows, dense, step, hyper, mask=mask)

    def _update_rows(self, route, w_all, rows, vals, step, hyper, mask=None):
        """Stage the records of sorted unique ``rows``, update them and their weight rows with the
        backend's row rule, write both back; with ``mask``, only its elements keep the update."""
        stager, rows_fn = route.stager, route.rows_fn
        rows_cpu = rows.cpu()
        with stager.lock:  # a prefetch from another thread waits until the records are back
            host = stager.acquire(rows_cpu)
            rec = stager.to_device(host)
            w = stager.weight_rows(w_all, rows)
            if mask is not None:
                w_old, rec_old = w.clone(), rec.clone()
            rows_fn(w, vals.to(self._compute_dtype(stager.store)).contiguous(), rec, step, **hyper)
            if mask is not None:
                w = torch.where(mask, w, w_old)
                rec_mask = mask.to(rec.device).repeat(1, rec.shape[1] // mask.shape[1])
                rec.copy_(torch.where(rec_mask, rec, rec_old))
            w_all.index_copy_(0, rows, w)
            stager.commit(rows_cpu, rec, host)

    @staticmethod
    def _compute_dtype(store):
        """The dtype of the row update: the state's, float32 for byte records."""
        dtype = store.dtype
        return dtype if dtype.is_floating_point else torch.float32

    def device_staging_bytes(self):
        """Device memory held by the optimizer: its staging buffers (O(largest batch's unique rows)).

        The moments live in the state files; per step, transient device tensors (the coalesced
        gradient and its sort) come and go through the caching allocator and are not counted.
        """
        return sum(r.stager.device_bytes() for r in self._routes.values() if r is not None)

    def staging_stats(self):
        """Totals over parameters: staging bytes (device, pinned host) and announcement use.

        ``hits``: steps that used announced records; ``misses``: steps that gathered from the file;
        ``patched_rows``: announced rows refreshed because a step in between wrote them.
        """
        stagers = [r.stager for r in self._routes.values() if r is not None]
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
        self._known(param, "prefetch")
        indices = torch.as_tensor(indices)
        if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex():
            raise TypeError(f"prefetch: indices must be integers (row numbers), got {indices.dtype}")
        stager = self._current_route(param).stager
        rows = torch.unique(indices.detach().reshape(-1).to("cpu", torch.int64))
        if not rows.numel():
            return
        if rows[0] < 0 or rows[-1] >= param.shape[0]:
            raise IndexError(f"prefetch: indices must lie in [0, {param.shape[0]}) for parameter "
                             f"{self._index(param)}")
        stager.prefetch(rows)

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self):
        """Step and moments of every parameter that has state (a step, a load or a resumed file:
        as SparseAdam, none before); the moments are built now, as copy-on-write views of the files
        (copies where the rule views one record's bytes as several dtypes, as the compact format
        does: ``torch.save`` cannot save one storage as several dtypes).

        ``torch.save`` streams them from the files without a copy in RAM. Until a later step
        writes a row, the tensors show the file as it is (save before stepping again); what another
        optimizer that loads them (``torch.optim.SparseAdam``) writes stays in its private pages and
        never reaches the files (``RowStateFile.private_records``).
        """
        return self._state_dict(every_param=False)

    def full_state_dict(self):
        """:meth:`state_dict` with an entry for every parameter (step 0 and zero moments where there
        is no state yet): the target ``torch.distributed.checkpoint`` loads into."""
        return self._state_dict(every_param=True)

    def _state_dict(self, every_param):
        self._check_open()
        live = {p: self.state[p] for p in self._stores if p in self.state}
        try:  # torch packs (and its state-dict hooks see) these entries, built now from the files
            for p, store in self._stores.items():
                if p not in live and not every_param:
                    continue
                records = store.private_records()
                views = self._views(p, records)
                if any(v.dtype != records.dtype for v in views.values()):
                    # torch.save cannot save one storage as several dtypes: copies where they fit in
                    # memory, else one mapping of the file per key (no copy; each saves the file)
                    views = ({k: v.clone() for k, v in views.items()} if store.in_memory or
                             fits_in_page_cache(records.numel()) else
                             {k: self._views(p, store.private_records())[k] for k in views})
                self.state[p] = {STEP: self._step_counts[p], **views}
            return super().state_dict()
        finally:
            for p in self._stores:
                if p in live:
                    self.state[p] = live[p]
                else:
                    self.state.pop(p, None)

    def load_state_dict(self, state_dict):
        """Write a state dict's steps and moments into this optimizer's files (then mark them clean).

        Accepts state dicts of this class or of ``torch.optim.SparseAdam`` (same keys). Parameters
        absent from ``state_dict['state']`` get fresh (zero) state. The whole state dict is checked
        (groups, parameters, keys, shapes, dtypes, steps) before anything is written, so a bad one
        leaves every file as it was, and every table is marked dirty before any is written, so a
        load cut short leaves a directory that is refused on reopening, never one at mixed steps.
        The rows are written in chunks, so ``load_state_dict(torch.load(path, mmap=True))`` restores
        a state larger than memory (as ``torch.save(opt.state_dict(), path)`` saves one).
        """
        self._check_open()
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict takes a state dict (a dict from state_dict()), got "
                            f"{type(state_dict).__name__}")
        super().load_state_dict(state_dict)  # the hooks around _unpack_state

    def _unpack_state(self, state_dict):
        missing = [k for k in ("state", "param_groups") if k not in state_dict]
        if missing:
            raise ValueError(f"load_state_dict: the state dict lacks {' and '.join(map(repr, missing))}; give "
                             "what state_dict() returned (torch.load of a saved one)")
        saved = saved_state_by_param(self.param_groups, state_dict)
        loaded = {p: loaded_columns(self._views(p, store.records), saved.get(p),
                                    f"state_dict's state of parameter {k}", self.rule)
                  for k, (p, store) in enumerate(self._stores.items())}
        groups = []
        for sg, g in zip(state_dict["param_groups"], self.param_groups):
            # a dict saved before ``maximize`` existed was minimizing (SparseAdam reads a missing key as
            # False); options SparseAdam does not have (``bitwise``, ...) and this optimizer's files
            # (state_dir, state_format, ...) keep this optimizer's values
            groups.append(dict(g, **{k: v for k, v in sg.items() if k != "params" and k not in FILE_OPTIONS}))
            if "maximize" in g and "maximize" not in sg:
                groups[-1]["maximize"] = False
            self.rule.check_group(groups[-1])
        for route in self._routes.values():  # announced records are about to be replaced
            if route is not None:
                route.stager.invalidate()
        for g, new in zip(self.param_groups, groups):
            g.update(new)
        self._torn = True  # until every table is written: a load cut short leaves them all dirty
        for store in self._stores.values():
            store.mark_dirty()
        for p, store in self._stores.items():
            columns, step = loaded[p]
            store.write_all(columns, step)
            self._step_counts[p] = step
            if columns is None:
                self.state.pop(p, None)
            else:
                self.state[p] = {STEP: step}
        self._torn = False

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
        twin = memo[id(self)] = type(self)(groups, **copy.deepcopy(self.defaults, memo))
        twin.load_state_dict(self.state_dict())
        copy_optimizer_hooks(self, twin)
        return twin

    def __getstate__(self):
        raise TypeError(f"{type(self).__name__} cannot be pickled: its state lives in files; "
                        "save opt.state_dict() instead")

    # -- lifecycle ---------------------------------------------------------------------------------
    def flush(self):
        """Write every state file (and weight file, ``weights.py``) to disk and mark it clean at the
        current step. Refused after an interrupted step or load: the files then hold no one step."""
        self._check_open()
        if self._torn:
            raise StateFileError(
                f"{type(self).__name__} on state_dir {self.state_dir}: a step or load_state_dict was "
                "interrupted, so the state files hold no one step and cannot be marked clean. "
                "Restore the last checkpoint (load_state_dict), then flush")
        for p, store in self._stores.items():
            if p in self._weight_files:  # the weights first: a clean state file implies clean weights
                self._weight_files[p].flush(self._step_counts[p])
            self._fingerprint(p, store)
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
                if route is not None:
                    route.stager.invalidate()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._routes.clear()
            errors = []
            for p, store in self._stores.items():  # every file is released, whatever one raises
                clean = not self._torn
                wf = self._weight_files.get(p)
                if wf is not None and not wf.closed and clean:  # flushed, left open: the module owns it
                    try:
                        wf.flush(self._step_counts[p])
                    except StateFileError as exc:  # clean state implies clean weights: not this time
                        errors.append(exc)
                        clean = False
                try:
                    if clean:
                        self._fingerprint(p, store)
                    store.close(self._step_counts[p], clean=clean)
                except StateFileError as exc:
                    errors.append(exc)
            self._weight_files.clear()
            if errors:
                raise errors[0]
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
        return self._positions.get(p, "?")
