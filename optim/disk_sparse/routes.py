"""How a Disk Sparse optimizer steps each parameter on the device its weights are on now.

A :class:`Route` is a stager of ``pipeline.py`` (how the rows' records reach the weights' device)
and the functions of the backend chosen for the parameter (``optim.backends.choose_backend``, through
the optimizer's backend table): the rule's ``rows_fn``, and the fused ``sparse_fn`` where the records
need no staging. :class:`Routes` keeps them current for one optimizer, with the one background
thread their stagers share.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from . import pipeline


class Route(NamedTuple):
    """How one parameter is stepped: its stager, the backend's name and its functions."""

    stager: pipeline.Stager
    backend: str
    rows_fn: Callable  # rows_fn(w, g, state, step, **hyper)
    sparse_fn: Callable | None  # sparse_fn(weight, indices, values, records, step, **hyper), or None


def new_route(rule, backend: str, p, store, weight_file, staging, executor) -> Route:
    """The route of ``p`` (state file ``store``, ``weight_file`` or None) under ``rule`` with
    ``backend``, for the device ``p`` is on now: staged (``pipeline.RowStager``) where ``staging``
    says so (None: for CUDA weights), direct otherwise, which alone takes the fused ``sparse_fn``.
    ``executor`` is the background thread of announcements."""
    rows_fn, sparse_fn = rule.kernels(backend)
    staged = p.is_cuda if staging is None else staging
    stager = (pipeline.RowStager if staged else pipeline.DirectStager)(
        store, p.device, executor, weight_file=weight_file)
    return Route(stager, backend, rows_fn, None if staged else sparse_fn)


class Routes:
    """The routes of one optimizer's tables (``table.Table.route``) under ``rule`` and ``staging``,
    and the background thread of announcements their stagers share (made with the first route; it
    starts at the first announcement)."""

    def __init__(self, rule, staging):
        self.rule, self.staging, self.executor = rule, staging, None

    def of(self, p, table, backend: str) -> Route:
        """``table``'s route for ``p`` with ``backend``: the one it has, or a new one where it has none
        or one for another device or backend (a parameter moved after construction, as transformers'
        Trainer moves the model); the old stager's announcements are dropped."""
        route = table.route
        if route is None or route.stager.device != p.device or route.backend != backend:
            if route is not None:
                route.stager.invalidate()
            if self.executor is None:
                self.executor = pipeline.make_executor()
            route = table.route = new_route(self.rule, backend, p, table.store, table.weight_file, self.staging,
                                            self.executor)
        return route

    @staticmethod
    def stagers(tables) -> list:
        """The stagers of those of ``tables`` that have a route."""
        return [t.route.stager for t in tables if t.route is not None]

    def stop(self, tables) -> None:
        """Wait for every announcement and stop the thread (no background gather may outlive the
        mappings); the tables keep no route."""
        pipeline.stop(self.stagers(tables), self.executor)
        for table in tables:
            table.route = None
