"""The class both Disk Sparse optimizers stand on: per parameter, gather, choose a route, call one
step function; and the checkpoints.

Each optimizer (``optimizer.py``) is a constructor plus a choice of update rule (``rules.py``: the
record a row keeps, the rule's backends and what they refuse). :class:`DiskSparseOptimizer` keeps one
record per parameter (``table.Table``: its state file, weight file, route, step count, position and
layout) and one ``state_dirs.StateDir`` (the directory and the lifecycle of its files). A step checks
every gradient and chooses every parameter's route (``table.Route``: a stager of ``pipeline.py`` and
the backend's functions) before it writes anything, then calls ``update.update_table`` per parameter.
"""

from __future__ import annotations

import copy
import os

import torch

from .._base import OptimizerBase
from .._checks import check_distinct
from .._torch_private import copy_optimizer_hooks
from ..backends import BACKENDS, choose_backend
from . import pipeline
from .checks import (announced_rows, check_grad, check_options, check_param, loaded_columns, loaded_groups,
                     saved_state_by_param)
from .state import STEP
from .state_dirs import StateDir
from .store import RowStateFile
from .table import Route, Table, meta_message, saved_views, state_bytes, views
from .update import update_table

# The options of the state files: one value per optimizer, kept in every group (and state dict).
FILE_OPTIONS = ("state_dir", "state_format", "backend", "staging", "huge_pages")


def _listed(params):
    """``params`` as a list, and each group's ``"params"`` as a list too (a generator can be read once:
    read here to size the state, it must not reach torch's Optimizer empty). A tensor or a set is left
    for torch's error."""
    if isinstance(params, torch.Tensor):
        return params
    return [dict(item, params=_listed(item["params"])) if isinstance(item, dict) and "params" in item
            and not isinstance(item["params"], (torch.Tensor, set)) else item for item in params]


def _planned_bytes(params, rule) -> int:
    """The size of the state files of the tables in ``params`` (as ``_listed`` gives it)."""
    if isinstance(params, torch.Tensor):
        return 0
    return sum(state_bytes(rule, p) for p in _tensors_of(params)
               if isinstance(p, torch.Tensor) and p.dim() in rule.table_dims)


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


class DiskSparseOptimizer(OptimizerBase):
    """Per-parameter tables (``table.Table``) in one state directory (``state_dirs.StateDir``), the
    step, checkpoints.

    ``rule`` (``rules.Rule``) is the update rule; ``backend`` ("auto", "torch", "numba", "triton") is
    resolved per parameter when it is added (``backend_of``); ``staging`` chooses the stager (None:
    the staged pipeline for CUDA weights, direct otherwise; True: staged for any weights).
    """

    OPTIMIZER_WIDE = FILE_OPTIONS
    WIDE_REASON = "one optimizer has one state_dir and format"

    def __init__(self, params, defaults, rule, state_dir=None, backend="auto", huge_pages=None,
                 staging=None, resume=False):
        check_options(type(self).__name__, state_dir, backend, huge_pages, staging, resume, BACKENDS)
        rule.check_group(defaults)
        self.rule, self.state_format = rule, rule.state_format
        self.backend, self.huge_pages, self.staging = backend, huge_pages, staging
        # Every option lives in the groups, so a framework that re-creates the optimizer from
        # ``param_groups[0]`` (PyKEEN) gets this one back, on the same state_dir.
        defaults = dict(defaults, betas=tuple(defaults["betas"]),
                        state_dir=None if state_dir is None else os.fspath(state_dir),
                        state_format=rule.state_format, backend=backend, staging=staging, huge_pages=huge_pages)
        self._tables: dict = {}  # parameter -> Table
        self._executor = None  # the background thread of announcements, shared by the stagers
        self._dir = StateDir(state_dir, resume, self, huge_pages, rule.state_format)
        self.state_dir = self._dir.path
        try:
            params = _listed(params)
            self._dir.planned_bytes = _planned_bytes(params, rule)
            super().__init__(params, defaults)
            if resume:
                self._dir.check_resumed(self._tables)
        except BaseException:
            try:
                self.close()
            finally:
                self._dir.remove_made()
            raise

    # -- parameters and their routes ---------------------------------------------------------------
    def add_param_group(self, param_group):
        self._dir.check_open()
        # torch's, not the base's: each parameter's backend is chosen with its route (a meta table's
        # at its first step), not in the base's backend table
        torch.optim.Optimizer.add_param_group(self, param_group)
        group = self.param_groups[-1]
        try:
            check_distinct(group["params"], len(self.param_groups) - 1, type(self).__name__)
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
        k = len(self._tables)
        check_param(p, k, type(self).__name__, self.rule.table_dims)
        backend = None if p.is_meta else self._choose_backend(p, k)  # a meta table: at its first step
        store, wf, resumed = self._dir.open_files(k, p, self.rule, name)
        table = self._tables[p] = Table(k, store, (p.dtype, tuple(p.shape)), wf, store.step)
        if backend is not None:
            table.route = self._new_route(p, table, backend)
        if resumed:  # the file's records are this parameter's state (SparseAdam has none before a step)
            self.state[p] = {STEP: store.step}

    def _choose_backend(self, p, k):
        return choose_backend(self.backend, p.device, lambda name: self.rule.refuses(name, p),
                              owner=type(self).__name__,
                              what=f"parameter {k} (shape {tuple(p.shape)}, dtype {p.dtype})")

    def _new_route(self, p, table, backend):
        """The stager and row functions of ``p`` on the device it is on now."""
        rows_fn, sparse_fn = self.rule.kernels(backend)
        staged = p.is_cuda if self.staging is None else self.staging
        if self._executor is None:  # its thread starts at the first announcement
            self._executor = pipeline.make_executor()
        stager = (pipeline.RowStager if staged else pipeline.DirectStager)(
            table.store, p.device, self._executor, weight_file=table.weight_file)
        return Route(stager, backend, rows_fn, None if staged else sparse_fn)

    def _route(self, p, caller=None):
        """``p``'s route for the device it is on now: a parameter moved after construction (as
        transformers' Trainer moves the model) gets its backend and stager anew, as torch's
        optimizers create their state lazily; one that no longer fits its files is refused.
        ``caller``: the public method asking, which refuses a tensor that is no parameter here."""
        table = self._tables[p] if caller is None else self._table(p, caller)
        table.check_usable(p, type(self).__name__)
        route = table.route
        if route is None or route.stager.device != p.device:
            if p.is_meta:
                raise RuntimeError(meta_message(table.index))
            if route is not None:
                route.stager.invalidate()
            route = table.route = self._new_route(p, table, self._choose_backend(p, table.index))
        return route

    def _table(self, p, caller) -> Table:
        table = self._tables.get(p)
        if table is None:
            raise ValueError(f"{caller}: p is not one of this optimizer's parameters")
        return table

    def _stagers(self) -> list:
        return [t.route.stager for t in self._tables.values() if t.route is not None]

    def backend_of(self, p) -> str:
        """Which path updates ``p``: "torch", "numba" or "triton", for the device ``p`` is on now."""
        return self._route(p, "backend_of").backend

    def step_count(self, p) -> int:
        """Steps with a gradient for ``p`` (the t of its bias corrections), also before its first step."""
        return self._table(p, "step_count").step

    def state_file(self, p) -> RowStateFile:
        """The state file of parameter ``p``."""
        return self._table(p, "state_file").store

    def state_files(self) -> list:
        """The state files of all parameters, in parameter order."""
        return [t.store for t in self._tables.values()]

    def stager(self, p) -> pipeline.Stager:
        """The stager of parameter ``p`` (``pipeline.DirectStager`` or ``pipeline.RowStager``)."""
        return self._route(p, "stager").stager

    # -- the step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        self._dir.check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []  # every gradient and route is checked before any file is written
        for group in self.param_groups:
            hyper = self.rule.hyper(group)
            for p in group["params"]:
                if p.is_meta:  # never gets a gradient: the module trains a new Parameter now
                    raise RuntimeError(meta_message(self._tables[p].index))
                if p.grad is not None:
                    g = check_grad(p, self._tables[p].index, type(self).__name__, self.rule)
                    work.append((p, g, self._route(p), hyper))
        try:
            for p, g, route, hyper in work:
                table = self._tables[p]
                self.state[p][STEP] = step = table.count_step()  # the step only: the moments stay in the file
                update_table(p, g, route, table.store, step, hyper)
        except BaseException:
            self._dir.interrupted = True  # the files hold no one step: never mark them clean (see close)
            raise
        return loss

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
        copy would not see it. (The stager's ``announce`` does the reading.)
        """
        self._dir.check_open()
        if param is None:
            if len(self._tables) != 1:
                raise ValueError(f"prefetch: this optimizer has {len(self._tables)} parameters; say which "
                                 "one the indices belong to with param=")
            param = next(iter(self._tables))
        rows = announced_rows(indices, param, self._table(param, "prefetch").index)
        stager = self._route(param).stager
        if rows.numel():
            stager.announce(rows)

    def device_staging_bytes(self):
        """Device memory held by the optimizer: its staging buffers (O(largest batch's unique rows)).

        The moments live in the state files; per step, transient device tensors (the coalesced
        gradient and its sort) come and go through the caching allocator and are not counted.
        """
        return self.staging_stats()["device_bytes"]

    def staging_stats(self):
        """Totals over parameters: staging bytes (device, pinned host) and announcement use.

        ``hits``: steps that used announced records; ``misses``: steps that gathered from the file;
        ``patched_rows``: announced rows refreshed because a step in between wrote them.
        """
        return pipeline.staging_totals(self._stagers())

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self):
        """Step and moments of every parameter that has state (a step, a load or a resumed file:
        as SparseAdam, none before); the moments are built now, as copy-on-write views of the files,
        or where the rule views one record's bytes as several dtypes, as the compact format does
        (``torch.save`` cannot save one storage as several dtypes), as copies in unlinked files in
        the state_dir (``store.spilled_copy``), which go with the state dict.

        ``torch.save`` streams them from the files without a copy in anonymous memory, so a state
        larger than the memory limit saves within it. Until a later step writes a row, the views
        show the file as it is (save before stepping again); what another optimizer that loads them
        (``torch.optim.SparseAdam``) writes stays in its private pages and never reaches the files
        (``RowStateFile.private_records``).
        """
        return self._state_dict(every_param=False)

    def full_state_dict(self):
        """:meth:`state_dict` with an entry for every parameter (step 0 and zero moments where there
        is no state yet): the target ``torch.distributed.checkpoint`` loads into."""
        return self._state_dict(every_param=True)

    def _state_dict(self, every_param):
        self._dir.check_open()
        live = {p: self.state[p] for p in self._tables if p in self.state}
        try:  # torch packs (and its state-dict hooks see) these entries, built now from the files
            for p, table in self._tables.items():
                if p in live or every_param:
                    self.state[p] = {STEP: table.step, **saved_views(self.rule, p, table.store)}
            return super().state_dict()
        finally:  # back to the steps alone (and no entry where there was none)
            for p in self._tables:
                self.state.pop(p, None)
            self.state.update(live)

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
        self._dir.check_open()
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict takes a state dict (a dict from state_dict()), got "
                            f"{type(state_dict).__name__}")
        super().load_state_dict(state_dict)  # the hooks around _unpack_state

    def _unpack_state(self, state_dict):
        saved = saved_state_by_param(self.param_groups, state_dict)
        loaded = {p: loaded_columns(views(self.rule, p, t.store.records), saved.get(p),
                                    f"state_dict's state of parameter {t.index}", self.rule)
                  for p, t in self._tables.items()}
        groups = loaded_groups(state_dict, self.param_groups, self.rule, kept=FILE_OPTIONS)
        for stager in self._stagers():  # announced records are about to be replaced
            stager.invalidate()
        for g, new in zip(self.param_groups, groups):
            g.update(new)
        self._dir.restore(self._tables, loaded)
        for p, (columns, step) in loaded.items():
            if columns is None:
                self.state.pop(p, None)
            else:
                self.state[p] = {STEP: step}

    def __deepcopy__(self, memo):
        """An independent optimizer over deep copies of the parameters, in a new private state_dir
        holding a copy of this one's state, with its step and state-dict hooks (as deepcopy gives
        SparseAdam's). Refused for a fixed state_dir, which two optimizers cannot share."""
        self._dir.check_open()
        if not self._dir.private:
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

    # -- clean points ------------------------------------------------------------------------------
    def flush(self):
        """Write every state file (and weight file, ``weights.py``) to disk and mark it clean at the
        current step. Refused after an interrupted step or load: the files then hold no one step."""
        self._dir.check_open()
        self._dir.flush(self._tables)

    def close(self):
        """Flush and release the state files (and remove the private state_dir). Safe to call twice."""
        if self._dir.closed:
            return
        try:
            if self._dir.owned_here():  # a forked child leaves the stagers and their thread alone
                pipeline.stop(self._stagers(), self._executor)
                for table in self._tables.values():
                    table.route = None
            self._dir.close(self._tables)
        finally:
            state = self.__dict__.get("state")  # absent when Optimizer.__init__ refused the params
            if state is not None:
                state.clear()

    @property
    def _closed(self) -> bool:
        return self._dir.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        # Only this object's own attributes: a wrapper that delegates attribute reads to the
        # optimizer it wraps (Lightning's LightningOptimizer) must never close that optimizer.
        try:
            state_dir = self.__dict__.get("_dir")
            if state_dir is not None and not state_dir.closed:
                self.close()
        except Exception:
            pass
