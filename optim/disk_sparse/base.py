"""The class both Disk Sparse optimizers stand on: per parameter, gather, choose a route, call one
step function; and the checkpoints.

Each optimizer (``optimizer.py``) is a constructor plus a choice of update rule (``rules.py``: the
record a row keeps, the rule's backends and what they refuse). :class:`DiskSparseOptimizer` keeps one
record per parameter (``table.Table``: its state file, weight file, route, step count, position and
layout) and one ``state_dirs.StateDir`` (the directory and the lifecycle of its files). Its groups go
through ``OptimizerBase.add_param_group`` (the checks, then each parameter's backend in the base's
table), and a step checks every gradient and chooses every parameter's route (``routes.Route``: a
stager of ``pipeline.py`` and the backend's functions) before it writes anything, then calls
``update.update_table`` per parameter. Checkpoints are ``checkpoints.py``.
"""

from __future__ import annotations

import os

import torch

from .._base import OptimizerBase
from .._compiling import compile_notice
from ..backends import BACKENDS
from . import checkpoints, pipeline
from .checks import announced_param, announced_rows, check_grad, check_options, check_param
from .params import listed, planned_bytes
from .routes import Routes
from .state import STEP
from .state_dirs import StateDir
from .store import RowStateFile
from .table import Table, meta_message
from .update import update_table

# The options of the state files: one value per optimizer, kept in every group (and state dict).
FILE_OPTIONS = ("state_dir", "state_format", "backend", "staging", "huge_pages")


class DiskSparseOptimizer(OptimizerBase):
    """Per-parameter tables (``table.Table``) in one state directory (``state_dirs.StateDir``), the
    step, checkpoints. ``rule`` (``rules.Rule``) is the update rule; ``backend`` is chosen per
    parameter when it is added (a table on the meta device: at its first step); ``staging`` chooses
    the stager (None: staged for CUDA weights, direct otherwise). Every option is described in the
    optimizers' docstrings (``optimizer.py``) and docs/USAGE.md."""

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
        self._routes = Routes(rule, staging)
        self._dir = StateDir(state_dir, resume, self, huge_pages, rule.state_format)
        self.state_dir = self._dir.path
        try:
            params = listed(params)
            self._dir.planned_bytes = planned_bytes(params, rule)
            super().__init__(params, defaults)
            if resume:
                self._dir.check_resumed(self._tables)
        except BaseException:
            try:
                self.close()
            finally:
                self._dir.remove_made()
            raise

    # -- groups: the base's add_param_group calls these ----------------------------------------------
    def _check_new_group(self, group, gi):
        self._dir.check_open()  # a closed optimizer takes no group
        self.rule.check_group(group)
        for pi, p in enumerate(group["params"]):
            check_param(p, len(self._tables) + pi, type(self).__name__, self.rule.table_dims)

    def _resolve(self, p, group, gi, pi):
        # a table on the meta device has no device to run on yet: its backend is chosen at its first step
        return None if p.is_meta else super()._resolve(p, group, gi, pi)

    def _refusal(self, backend, p, group):
        return self.rule.refuses(backend, p)

    def _group_added(self, group):
        """Open each parameter's files (``StateDir.open_files``) and, where its backend is chosen, its route."""
        group["betas"] = tuple(group["betas"])
        for p, name in zip(group["params"], group.get("param_names") or [""] * len(group["params"])):
            k = len(self._tables)
            store, wf, resumed = self._dir.open_files(k, p, self.rule, name)
            table = self._tables[p] = Table(k, store, (p.dtype, tuple(p.shape)), wf, store.step)
            if p in self._backends:
                self._routes.of(p, table, self._backends[p].backend)
            if resumed:  # the file's records are this parameter's state (SparseAdam has none before a step)
                self.state[p] = {STEP: store.step}

    # -- parameters and their routes ---------------------------------------------------------------
    def _route(self, p, caller="step", where=None):
        """``p``'s route (``routes.Routes.of``) with the base's backend for the device it is on now
        (chosen again for a parameter moved since); one that no longer fits its files is refused.
        ``caller``: the public method asking, which refuses a tensor that is no parameter here;
        ``where``: ``p``'s (group, gi, pi), where the caller knows it."""
        table = self._table(p, caller)
        table.check_usable(p, type(self).__name__)
        if p.is_meta:
            raise RuntimeError(meta_message(table.index))
        return self._routes.of(p, table, self._backend(p, *(where or self._position(p, caller))))

    def _table(self, p, caller) -> Table:
        table = self._tables.get(p)
        if table is None:
            raise ValueError(f"{caller}: p is not one of this optimizer's parameters")
        return table

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
        for gi, group in enumerate(self.param_groups):
            hyper = self.rule.hyper(group)
            for pi, p in enumerate(group["params"]):
                if p.is_meta:  # never gets a gradient: the module trains a new Parameter now
                    raise RuntimeError(meta_message(self._tables[p].index))
                if p.grad is not None:
                    g = check_grad(p, self._tables[p].index, type(self).__name__, self.rule)
                    work.append((p, g, self._route(p, where=(group, gi, pi)), hyper))
        try:
            with compile_notice(type(self).__name__, lambda: any(w[2].backend == "numba" for w in work)):
                for p, g, route, hyper in work:
                    table = self._tables[p]
                    self.state[p][STEP] = step = table.count_step()  # the step only: the moments stay in the file
                    update_table(p, g, route, table.store, step, hyper)
        except BaseException:
            self._dir.interrupted = True  # the files hold no one step: never mark them clean (see close)
            raise
        return loss

    def prefetch(self, indices, param=None):
        """Announce rows the next step will touch, so their state is read meanwhile. ``indices``: any
        integer tensor of row indices of ``param`` (needed only when the optimizer has several
        parameters). For CPU weights a background thread reads their record pages ahead (and the
        weight rows of a ``mapped_embedding``); the step reads the file itself, so results do not
        depend on announcements. For staged weights (CUDA, or ``staging=True``) it gathers their
        records into a pinned buffer, used by the step whose unique rows equal them and kept up to date
        by steps in between (``pipeline.py``); state written by hand in between is then not seen."""
        self._dir.check_open()
        param = announced_param(self._tables, param)
        rows = announced_rows(indices, param, self._table(param, "prefetch").index)
        stager = self._route(param, "prefetch").stager
        if rows.numel():
            stager.announce(rows)

    def device_staging_bytes(self):
        """Device memory held by the optimizer: its staging buffers (O(largest batch's unique rows)).
        The moments live in the state files; a step's transient tensors are not counted."""
        return self.staging_stats()["device_bytes"]

    def staging_stats(self):
        """Totals over parameters: staging bytes (device, pinned host) and announcement use: ``hits``
        (steps that used announced records), ``misses`` (steps that gathered from the file) and
        ``patched_rows`` (announced rows refreshed because a step in between wrote them)."""
        return pipeline.staging_totals(self._routes.stagers(self._tables.values()))

    # -- checkpoints (checkpoints.py) --------------------------------------------------------------
    def state_dict(self):
        """Step and moments of every parameter that has state, the moments views of the files (or
        spilled copies) built now: save before stepping again (``checkpoints.py``)."""
        return self._state_dict(every_param=False)

    def full_state_dict(self):
        """:meth:`state_dict` with an entry for every parameter (step 0 and zero moments where there
        is no state yet): the target ``torch.distributed.checkpoint`` loads into."""
        return self._state_dict(every_param=True)

    def _state_dict(self, every_param):
        self._dir.check_open()
        with checkpoints.moments_in_state(self.rule, self._tables, self.state, every_param):
            return super().state_dict()  # torch's layout and hooks, with these entries

    def load_state_dict(self, state_dict):
        """Write a state dict of this class or of ``torch.optim.SparseAdam`` into the files (then mark
        them clean), all of it checked first; parameters absent from its state get fresh (zero) state;
        ``torch.load(path, mmap=True)`` restores a state larger than memory (``checkpoints.py``)."""
        self._dir.check_open()
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict takes a state dict (a dict from state_dict()), got "
                            f"{type(state_dict).__name__}")
        super().load_state_dict(state_dict)  # the hooks around _unpack_state

    def _unpack_state(self, state_dict):
        loaded, groups = checkpoints.checked_load(self.rule, self._tables, self.param_groups, state_dict,
                                                  kept=FILE_OPTIONS)
        for stager in self._routes.stagers(self._tables.values()):  # announced records are about to be replaced
            stager.invalidate()
        for g, new in zip(self.param_groups, groups):
            g.update(new)
        self._dir.restore(self._tables, loaded)
        for p, (columns, step) in loaded.items():  # an entry only where there is state, as SparseAdam
            self.state.pop(p, None)
            if columns is not None:
                self.state[p] = {STEP: step}

    def __deepcopy__(self, memo):
        """An independent optimizer in a new private state_dir (``checkpoints.twin``); refused for a
        fixed state_dir, which two optimizers cannot share."""
        self._dir.check_open()
        return checkpoints.twin(self, memo, private=self._dir.private)

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
                self._routes.stop(self._tables.values())
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
