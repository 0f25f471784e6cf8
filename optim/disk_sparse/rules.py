"""The four update rules of the Disk Sparse optimizers as one table: {Adam, ball} x {exact, compact}.

A :class:`Rule` says everything the shared machinery (``optimizer.py``) needs about one of them:
the record a row keeps in the state file (width, dtype, the state-dict views of it), the keyword
arguments of its row update for a parameter group, its backend routes (module and function names,
imported only when used, so Triton loads only for Triton), what each backend refuses, and which
loaded values the record can hold. The math of each rule is in ``reference.py``; the record layout
of the compact format in ``compact.py``.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from . import compact
from .checks import check_flags, check_hyper, scalar
from .store import STATE_FORMATS
from .state import EXP_AVG, EXP_AVG_CODES, EXP_AVG_SCALE, EXP_AVG_SQ

_BACKEND_TITLE = {"torch": "torch", "numba": "numba", "triton": "Triton"}


@dataclass(frozen=True)
class Rule:
    """One update rule with its record layout and backend routes.

    ``routes`` maps a backend to ``(rows_fn, sparse_fn)`` names in this package ("torch_ops.adam_rows_"):
    the row update ``rows_fn(w, g, state, step, **hyper)`` of sorted unique rows, and an optional fused
    update straight from the uncoalesced gradient ``sparse_fn(weight, indices, values, records, step,
    **hyper)`` (None where the backend has none). ``element_sparse`` is True where element-sparse
    gradients (``dense.to_sparse()``) are taken, else why not. ``value_checks`` maps a state key to
    (a predicate on loaded values, what they must hold).
    """

    kind: str  # "adam" or "ball"
    state_format: str  # "exact" or "compact"
    title: str  # names the rule in messages
    table_dims: tuple
    element_sparse: object
    width: Callable[[int], int]  # record width (in record elements) of a row of D values
    record_dtype: Callable[[torch.dtype], torch.dtype]  # the state file's dtype for a weight dtype
    views: Callable[[torch.Tensor, int], dict]  # state-dict tensors of (n, width) records, record order
    hyper: Callable[[dict], dict]  # the row update's keyword arguments for a parameter group
    check_group: Callable[[dict], None]  # raises for a group's bad hyper-parameters
    routes: Mapping[str, tuple]
    weight_dtypes: Callable[[str], tuple | None]  # weight dtypes a backend's kernels take (None: any)
    value_checks: Mapping[str, tuple] = field(default_factory=dict)
    row_limit: Callable[[str], int | None] = lambda backend: None  # widest row a backend takes
    dtype_hint: str = ""  # what to do about a refused weight dtype

    def refuses(self, backend: str, p: torch.Tensor) -> str | None:
        """Why ``backend`` cannot update ``p`` with this rule (None if it can)."""
        if backend not in self.routes:
            return f"{self.title} has no {_BACKEND_TITLE[backend]} path"
        dtypes = self.weight_dtypes(backend)
        if dtypes is not None and p.dtype not in dtypes:
            return (f"{self.title}'s {_BACKEND_TITLE[backend]} path takes "
                    f"{', '.join(str(d) for d in dtypes)} weights{self.dtype_hint}")
        limit = self.row_limit(backend)
        if limit is not None and p.dim() == 2 and p.shape[1] > limit:
            return f"rows wider than {limit} do not fit one {_BACKEND_TITLE[backend]} program"
        return None

    def kernels(self, backend: str):
        """``(rows_fn, sparse_fn)`` of ``backend``, imported now."""
        return tuple(None if name is None else _function(name) for name in self.routes[backend])


def _function(name: str):
    module, fn = name.rsplit(".", 1)
    return getattr(importlib.import_module(f"{__package__}.{module}"), fn)


def _kernel_dtypes(backend: str):
    """The weight dtypes of the exact rules' compiled kernels (each module says its own)."""
    if backend == "torch":
        return None
    return _function(f"{backend}_ops.WEIGHT_DTYPES")


def _float_state(dtype):
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _exact_views(records, cols):
    return {EXP_AVG: records[:, :cols], EXP_AVG_SQ: records[:, cols:]}


def _compact_views(records, cols):
    s, v, q = compact.views(records, cols)
    return {EXP_AVG_SCALE: s, EXP_AVG_SQ: v, EXP_AVG_CODES: q}


def _lr(lr):
    """A tensor lr stays a 0-dim tensor: SparseAdam then computes its step size in lr's dtype."""
    return lr.detach().reshape(()).cpu() if isinstance(lr, torch.Tensor) else float(lr)


def _adam_hyper(group):
    beta1, beta2 = group["betas"]
    return dict(lr=_lr(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                maximize=group["maximize"], bitwise=group.get("bitwise", True))


def _compact_adam_hyper(group):
    """``_adam_hyper`` without ``bitwise``: the compact update has one rounding on every backend."""
    return {k: v for k, v in _adam_hyper(group).items() if k != "bitwise"}


def _ball_hyper(group):
    beta1, beta2 = group["betas"]
    return dict(lr=scalar(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"], c=check_curvature(group["c"]),
                exact=group["exact"])


def _check_adam(group):
    check_hyper(group["lr"], group["betas"], group["eps"])
    check_flags(maximize=group["maximize"], bitwise=group.get("bitwise", True))


def _check_ball(group):
    check_hyper(group["lr"], group["betas"], group["eps"])
    check_flags(exact=group["exact"])
    check_curvature(group["c"])


# The curvatures the update is finite for: the ball's radius 1/sqrt(c) enters the float32 update
# squared and squared again (|x|^2, lambda_x^2 |r|^2), and float32 spans about 1e-38..3e38, so past
# c = 1e20 (or below the smallest normal float32 on the numba path) rows and moments become non-finite;
# the range leaves five orders of magnitude to spare on each side, for every dtype and backend.
CURVATURE_RANGE = (1e-15, 1e15)


def check_curvature(c):
    """``c`` as a number in ``CURVATURE_RANGE``, or a ValueError naming the range and why."""
    lo, hi = CURVATURE_RANGE
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not (math.isfinite(c) and lo <= c <= hi):
        raise ValueError(f"c (the ball's curvature is -c, its radius 1/sqrt(c)) must be a number in [{lo:g}, "
                         f"{hi:g}], got {c!r}: outside it the float32 update underflows or overflows (non-finite "
                         "rows). Rescale the embedding instead (a ball of curvature -c is the unit ball scaled "
                         "by 1/sqrt(c))")
    return c


_COMPACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # updated in float32
_NON_NEGATIVE = "values >= 0 (inf or NaN where the optimizer met a gradient that was not finite)"
_COMPACT_CHECKS = {
    EXP_AVG_CODES: (lambda q: q >= -127, "codes in [-127, 127]"),
    EXP_AVG_SCALE: (lambda s: ~(s < 0), _NON_NEGATIVE),
    EXP_AVG_SQ: (lambda v: ~(v < 0), _NON_NEGATIVE),
}
_COMPACT_HINT = (" (the compact format updates in float32: its scales and v are float32); use "
                 "state_format='exact' for float64 tables")
_ROW_SPARSE_ONLY = ("takes row-sparse gradients (sparse_dim 1, as nn.Embedding(sparse=True) produces): "
                    "its update is per row")


def _ball_row_limit(backend):
    return _function("triton_ops.MAX_BALL_D") if backend == "triton" else None


# What both compact rules share: the record of ``compact.py``, updated in float32 (numba: float32 weights).
_COMPACT_RECORD = dict(
    width=compact.record_bytes, record_dtype=lambda dtype: torch.uint8, views=_compact_views,
    weight_dtypes=lambda backend: (torch.float32,) if backend == "numba" else _COMPACT_DTYPES,
    value_checks=_COMPACT_CHECKS, dtype_hint=_COMPACT_HINT)

ADAM = Rule(
    kind="adam", state_format="exact", title="Adam", table_dims=(1, 2), element_sparse=True,
    width=lambda cols: 2 * cols, record_dtype=_float_state, views=_exact_views, hyper=_adam_hyper,
    check_group=_check_adam, routes={"torch": ("torch_ops.adam_rows_", None),
            "numba": ("numba_ops.adam_rows_", "numba_ops.adam_sparse_"),
            "triton": ("triton_ops.adam_rows_", None)},
    weight_dtypes=_kernel_dtypes)

ADAM_COMPACT = Rule(
    kind="adam", state_format="compact", title="the compact format", table_dims=(1, 2),
    element_sparse=("with state_format='compact' takes row-sparse gradients (nn.Embedding(sparse=True)); "
                    "an element-sparse gradient would change part of a row's coded first moment. "
                    "Use state_format='exact'"),
    hyper=_compact_adam_hyper, check_group=_check_adam,
    routes={"torch": ("torch_ops.compact_adam_rows_", None),
            "numba": ("numba_ops.compact_adam_rows_", "numba_ops.compact_adam_sparse_")}, **_COMPACT_RECORD)

BALL = Rule(
    kind="ball", state_format="exact", title="the Riemannian update", table_dims=(2,),
    element_sparse=_ROW_SPARSE_ONLY,
    width=lambda cols: cols + 1, record_dtype=_float_state, views=_exact_views, hyper=_ball_hyper,
    check_group=_check_ball,
    routes={"torch": ("torch_ops.riemannian_adam_rows_", None),
            "numba": ("numba_ops.riemannian_adam_rows_", "numba_ops.riemannian_adam_sparse_"),
            "triton": ("triton_ops.riemannian_adam_rows_", None)},
    weight_dtypes=_kernel_dtypes, row_limit=_ball_row_limit)

BALL_COMPACT = Rule(
    kind="ball", state_format="compact", title="the compact Riemannian update", table_dims=(2,),
    element_sparse=_ROW_SPARSE_ONLY,
    hyper=_ball_hyper, check_group=_check_ball,
    routes={"torch": ("torch_ops.compact_riemannian_adam_rows_", None),
            "numba": ("numba_ops.compact_riemannian_adam_rows_", "numba_ops.compact_riemannian_adam_sparse_")},
    **_COMPACT_RECORD)

RULES = {(r.kind, r.state_format): r for r in (ADAM, ADAM_COMPACT, BALL, BALL_COMPACT)}


def rule(kind: str, state_format: str, owner: str) -> Rule:
    """The rule of optimizer ``owner`` (``kind`` "adam" or "ball") for ``state_format``."""
    if state_format not in STATE_FORMATS:
        raise ValueError(f"{owner}: state_format must be one of {STATE_FORMATS}, got {state_format!r}")
    return RULES[(kind, state_format)]
