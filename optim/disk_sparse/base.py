"""The machinery shared by the Disk Sparse optimizers: state files, the step, checkpoints.

:class:`DiskSparseOptimizer` owns one :class:`~optim.disk_sparse.store.RowStateFile` and one stager
(``pipeline.py``) per parameter, and runs one step path: per parameter, the sparse gradient is
coalesced into sorted unique rows (``torch_ops.coalesce_rows``), the stager brings those rows'
records next to the weight rows, the backend's row update changes both in place, and the stager
writes the records back. Untouched rows are never read. A backend with a fused update straight from
the uncoalesced gradient (numba, for lazy Adam on CPU weights) takes the whole step instead. The
optimizers themselves are in ``optimizer.py``.
"""

from __future__ import annotations

import os
import tempfile
import weakref

import torch

from ..backends import BACKENDS, resolve_backend
from . import checkpoint, pipeline
from .store import STATE_FORMATS, RowStateFile, StateFileError, fits_in_page_cache  # noqa: F401
from .params import (_check_param, _clear_state, _cols, _make_writable_dir, _remove_dir_of,  # noqa: F401
                     _state_files_in)
from .torch_ops import coalesce_rows
from .weights import weight_file

from .checkpoint import EXP_AVG, EXP_AVG_SQ, STEP  # noqa: F401  (re-exported)


class DiskSparseOptimizer(torch.optim.Optimizer):
    """Shared machinery: per-parameter state files and stagers, the step, checkpoints.

    ``backend`` ("auto", "torch", "numba", "triton") is resolved per parameter when it is added, into
    the subclass's functions of that backend (``_kernels``); ``staging`` chooses the stager (None:
    the staged pipeline for CUDA weights, direct otherwise; True: staged for any weights).
    """

    _table_dims = (2,)  # the parameter dims a subclass takes
    _element_sparse = False  # whether it takes element-sparse gradients of 2-D tables

    # -- the hooks every subclass implements -------------------------------------------------------
    def _state_width(self, cols: int) -> int:
        """Record width of a row of ``cols`` values."""
        raise NotImplementedError

    def _state_views(self, records: torch.Tensor, cols: int) -> dict:
        """The state-dict tensors (views side by side, in record order) of a record table."""
        raise NotImplementedError

    def _hyper(self, group: dict) -> dict:
        """Keyword arguments of the row update for a parameter group."""
        raise NotImplementedError

    def _unsupported(self, backend: str, p: torch.Tensor) -> str | None:
        """Why ``backend`` cannot update ``p`` (None if it can); "auto" then takes torch."""
        raise NotImplementedError

    def _kernels(self, backend: str):
        """``(rows_fn, sparse_fn)`` of ``backend``: the row update ``rows_fn(w, g, state, step,
        **hyper)`` and a fused update from the uncoalesced gradient ``sparse_fn(weight, indices,
        values, records, step, **hyper)``, or None where the backend has none."""
        raise NotImplementedError

    def __init__(self, params, defaults, state_dir=None, backend="auto", huge_pages=None, staging=None,
                 resume=False, state_format="exact"):
        if state_format not in STATE_FORMATS:
            raise ValueError(f"{type(self).__name__}: state_format must be one of {STATE_FORMATS}, "
                             f"got {state_format!r}")
        self.state_format = state_format
        if backend not in BACKENDS:
            raise ValueError(f"{type(self).__name__}: backend must be one of {BACKENDS}, got {backend!r}")
        if huge_pages not in (None, True, False):
            raise ValueError(f"huge_pages must be None (decide by size), True or False, got {huge_pages!r}")
        if staging not in (None, True, False):
            raise ValueError(f"staging must be None (staged for CUDA weights), True or False, got {staging!r}")
        self.backend, self.huge_pages, self.staging = backend, huge_pages, staging
        self._own_dir = state_dir is None
        if state_dir is None:
            state_dir = tempfile.mkdtemp(prefix="disk-sparse-adam-")
            # Removed by close(), and at interpreter exit if close() never ran (at shutdown __del__
            # may not run, which would leave a table-sized file in /tmp). Holds the path only.
            self._remove_own_dir = weakref.finalize(self, _remove_dir_of, os.getpid(), state_dir)
        self.state_dir = os.fspath(state_dir)
        self._owner = os.getpid()  # a forked child only drops its copies (see close)
        self._stores: dict = {}  # parameter -> RowStateFile
        self._weight_files: dict = {}  # parameter -> weights.WeightFile, for weights in a file
        self._routes: dict = {}  # parameter -> (stager, rows_fn, sparse_fn)
        self._steps: dict = {}
        self._executor = None  # the background gather thread of the staged pipeline
        self._closed = False
        _make_writable_dir(self.state_dir)
        if not resume and not self._own_dir and _state_files_in(self.state_dir):
            self._closed = True
            raise StateFileError(
                f"state_dir {self.state_dir} already holds state files ({_state_files_in(self.state_dir)[0]}, "
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
        k = len(self._stores)
        _check_param(p, k, type(self).__name__, self._table_dims)
        sdtype = p.dtype if p.dtype in (torch.float32, torch.float64) else torch.float32
        if self.state_format == "compact":
            sdtype = torch.uint8  # byte records (compact.py)
        width = self._state_width(_cols(p))
        huge = self.huge_pages
        nbytes = p.shape[0] * width * torch.empty((), dtype=sdtype).element_size()
        if huge is None:
            huge = fits_in_page_cache(nbytes)
        rows_fn, sparse_fn = self._kernels(self._backend_for(p, k))
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
        self._routes[p] = (stager, rows_fn, sparse_fn)
        self._steps[p] = store.step
        self.state[p] = self._state_entry(p)

    def _backend_for(self, p, k):
        owner = type(self).__name__
        name = resolve_backend(self.backend, p.device, owner=owner)
        why = self._unsupported(name, p)
        if why is not None and self.backend == "auto":
            name, why = "torch", self._unsupported("torch", p)
        if why is not None:
            raise ValueError(f"{owner}: backend={name!r} cannot update parameter {k} (shape "
                             f"{tuple(p.shape)}, dtype {p.dtype}): {why}; use backend='torch'")
        return name

    def _state_entry(self, p):
        entry = {STEP: self._steps[p]}  # a Python int, as SparseAdam keeps it (its bias correction in float64)
        entry.update(self._views(p, self._stores[p].records))
        return entry

    def _views(self, p, records):
        """The state-dict tensors of ``p`` (of ``p``'s shape: a 1-D table is kept as N x 1 records)."""
        views = self._state_views(records, _cols(p))
        return views if p.dim() == 2 else {k: v.squeeze(1) for k, v in views.items()}

    def state_file(self, p) -> RowStateFile:
        """The state file of parameter ``p``."""
        if p not in self._stores:
            raise ValueError("state_file: p is not one of this optimizer's parameters")
        return self._stores[p]

    def state_files(self) -> list:
        """The state files of all parameters, in parameter order."""
        return list(self._stores.values())

    def stager(self, p):
        """The stager of parameter ``p`` (``pipeline.DirectStager`` or ``pipeline.RowStager``)."""
        if p not in self._routes:
            raise ValueError("stager: p is not one of this optimizer's parameters")
        return self._routes[p][0]

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
            hyper = self._hyper(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = self._checked_grad(p)
                if p in self._weight_files:
                    self._weight_files[p].mark_dirty()
                self._steps[p] += 1  # like SparseAdam, a present gradient counts even when empty
                self.state[p][STEP] = self._steps[p]
                if not g._nnz():
                    continue
                if g.sparse_dim() == 2:
                    self._step_elements(p, g, self._steps[p], hyper)
                else:
                    self._step_param(p, g, self._steps[p], hyper)
        return loss

    def _step_param(self, p, g, step, hyper):
        stager, _, sparse_fn = self._routes[p]
        vals = g._values().reshape(g._nnz(), _cols(p))  # a 1-D table is updated as N x 1
        w_all = p if p.dim() == 2 else p.unsqueeze(1)
        if sparse_fn is not None:
            stager.fetch(g._indices()[0].cpu())
            sparse_fn(w_all, g._indices()[0], vals.to(p.dtype), self._stores[p].writable(), step, **hyper)
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
        stager, rows_fn, _ = self._routes[p]
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
        """The dtype of the row update: the state's, float32 for compact (byte) records."""
        dtype = self._stores[p].dtype
        return dtype if dtype.is_floating_point else torch.float32

    def _checked_grad(self, p):
        g = p.grad
        if not g.is_sparse:
            raise RuntimeError(
                f"parameter {self._index(p)} (shape {tuple(p.shape)}) got a dense gradient; "
                f"{type(self).__name__} needs sparse gradients: build the table with "
                "nn.Embedding(..., sparse=True) or nn.EmbeddingBag(..., sparse=True), or use "
                "torch.optim.Adam for dense parameters")
        if g.sparse_dim() == 2 and self.state_format == "compact":
            raise RuntimeError(f"parameter {self._index(p)}: state_format='compact' takes row-sparse gradients "
                               "(nn.Embedding(sparse=True)); an element-sparse gradient would change part of a "
                               "row's coded first moment. Use state_format='exact'")
        if not (g.sparse_dim() == 1 or (g.sparse_dim() == 2 == p.dim() and self._element_sparse)):
            raise RuntimeError(f"parameter {self._index(p)}: {type(self).__name__} takes row-sparse gradients "
                               "(sparse_dim 1, as nn.Embedding(sparse=True) produces)"
                               f"{' or element-sparse ones (dense.to_sparse())' if self._element_sparse else ''}, "
                               f"got sparse_dim {g.sparse_dim()}")
        return g

    def device_staging_bytes(self):
        """Device memory held by the optimizer: its staging buffers (O(largest batch's unique rows)).

        The moments live in the state files; per step, transient device tensors (the coalesced
        gradient and its sort) come and go through the caching allocator and are not counted.
        """
        return sum(st.device_bytes() for st, _, _ in self._routes.values())

    def staging_stats(self):
        """Totals over parameters: staging bytes (device, pinned host) and announcement use.

        ``hits``: steps that used announced records; ``misses``: steps that gathered from the file;
        ``patched_rows``: announced rows refreshed because a step in between wrote them.
        """
        stagers = [st for st, _, _ in self._routes.values()]
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
        (CUDA, or ``staging=True``) the rows' records are gathered into a pinned buffer on a background thread, and the step whose unique
        rows equal them uses it (steps in between keep it up to date, ``load_state_dict`` drops it;
        see ``pipeline.py``). Writing the state tensors by hand between ``prefetch`` and ``step`` is
        not supported for staged weights: the announced copy would not see it.
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
        if not rows.numel():
            return
        if rows.numel() and (rows[0] < 0 or rows[-1] >= param.shape[0]):
            raise IndexError(f"prefetch: indices must lie in [0, {param.shape[0]}) for parameter "
                             f"{self._index(param)}")
        self._routes[param][0].prefetch(rows)

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self):
        """Step and moments of every parameter; the moments are copy-on-write views of the files
        (in the compact format, copies: its codes, scales and v share each record's bytes).

        ``torch.save`` streams them from the files without a copy in RAM. Until a later step
        writes a row, the tensors show the file as it is (save before stepping again); what another
        optimizer that loads them (``torch.optim.SparseAdam``) writes stays in its private pages and
        never reaches the files (``RowStateFile.private_records``).
        """
        self._check_open()
        live = {p: self.state[p] for p in self._stores}
        try:  # torch packs (and its state-dict hooks see) these copy-on-write entries, not the live ones
            for p, store in self._stores.items():
                views = self._views(p, store.private_records())
                if self.state_format == "compact":  # torch.save cannot save one storage as several dtypes
                    views = {k: v.clone() for k, v in views.items()}
                self.state[p] = dict(live[p], **views)
            return super().state_dict()
        finally:
            self.state.update(live)

    def load_state_dict(self, state_dict):
        """Write a state dict's steps and moments into this optimizer's files (then mark them clean).

        Accepts state dicts of this class or of ``torch.optim.SparseAdam`` (same keys). Parameters
        absent from ``state_dict['state']`` get fresh (zero) state. The whole state dict is checked
        before anything is written (``checkpoint.py``).
        """
        self._check_open()
        state_dict = state_dict.copy()  # shallow, as torch's: a pre-hook may replace entries
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            hook_result = pre_hook(self, state_dict)
            state_dict = state_dict if hook_result is None else hook_result
        checkpoint.load_state_dict(self, state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # -- lifecycle ---------------------------------------------------------------------------------
    def flush(self):
        """Write every state file (and weight file, ``weights.py``) to disk and mark it clean at the
        current step."""
        self._check_open()
        for p, store in self._stores.items():
            if p in self._weight_files:  # the weights first: a clean state file implies clean weights
                self._weight_files[p].flush(self._steps[p])
            store.flush(self._steps[p])

    def close(self):
        """Flush and release the state files (and remove the private state_dir). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._owner:  # a forked child: the files, lock and directory are the parent's
            for store in self._stores.values():
                store.close()
            _clear_state(self)
            return
        try:
            for stager, _, _ in self._routes.values():  # no background gather may outlive the mappings
                stager.invalidate()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._routes.clear()
            for p, store in self._stores.items():
                wf = self._weight_files.get(p)
                if wf is not None and not wf.closed:  # flushed, left open: the module owns it
                    wf.flush(self._steps[p])
                store.close(self._steps[p])
            self._weight_files.clear()
        finally:
            _clear_state(self)
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
        if os.getpid() != self._owner:
            raise RuntimeError(f"{type(self).__name__} on state_dir {self.state_dir} belongs to process "
                               f"{self._owner}; a forked child cannot use it: create one in the child")

    def _index(self, p):
        for k, q in enumerate(self._stores):
            if q is p:
                return k
        return "?"

    def __deepcopy__(self, memo):
        """An independent optimizer over deep copies of the parameters, in a new private state_dir
        holding a copy of this one's state (``checkpoint.deep_copy``)."""
        return checkpoint.deep_copy(self, memo)

    def __getstate__(self):
        raise TypeError(f"{type(self).__name__} cannot be pickled: its state lives in files; "
                        "save opt.state_dict() instead")
