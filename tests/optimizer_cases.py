"""The optimizers under test as cases, for the protocol's and the calling idioms' tests.

A case says how to make parameters and the loss whose backward gives their gradients (row-sparse
embedding gradients with duplicate rows for the Disk Sparse optimizers, dense ones for Gefen), how to
construct ours, and the independent optimizer ours must reduce to, if any (``tests/test_protocol.py``
says which and why).
"""

import copy
import io
import zlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import geoopt
import pytest
import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import ReduceLROnPlateau

from optim import DiskSparseAdam, DiskSparseRiemannianAdam, Gefen
from tests.geo import ball, random_points

STEPS = 6


def _skips(k, t):
    """Parameter 1 has no gradient at every fourth step (t = 3, 7, ...)."""
    return t is not None and k == 1 and t % 4 == 3


def _gen(*seed):
    """A generator seeded by ``seed`` (a stable hash: Python's hash of a string varies per process)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))


def _copy(p):
    return torch.nn.Parameter(p.detach().clone())


@dataclass(frozen=True)
class Case:
    """One optimizer under the protocol: its parameters and gradients, ours, the reference (or None)."""

    id: str
    shapes: tuple
    draw: Callable                             # draw(shape, generator): a parameter's or a target's values
    ours: Callable[..., torch.optim.Optimizer]
    reference: Optional[Callable[..., torch.optim.Optimizer]] = None
    twin: Callable = _copy                     # the reference's copy of one of our parameters
    tol: dict = field(default_factory=dict)    # backend: assert_close's tolerances against the reference
                                               # (a backend not named: bitwise)
    hyper: dict = field(default_factory=dict)  # hyper-parameters both sides get
    backends: tuple = ("torch",)               # where the numerical tests run; the first for the others
    sparse: bool = True                        # row-sparse gradients or dense ones (see loss)
    drop_in: bool = False                      # state dicts load into the reference and back
    bad_kwargs: tuple = ()                     # (id, kwargs, regex): invalid arguments of this optimizer only

    def params(self):
        return [torch.nn.Parameter(self.draw(s, _gen("param", k))) for k, s in enumerate(self.shapes)]

    def loss(self, params, t):
        """Step t's loss (t=None: the whole objective), the squared distance to fixed targets: of 8 rows
        looked up with duplicates (``F.embedding(sparse=True)``: row-sparse gradients; t=None: every
        row), or of whole tensors with random positive weights (dense gradients; t=None: weights 1)."""
        total = 0
        for k, (p, shape) in enumerate(zip(params, self.shapes)):
            target = self.draw(shape, _gen("target", k))
            if _skips(k, t):
                continue
            if self.sparse:
                idx = torch.arange(len(p)) if t is None else torch.randint(0, len(p), (8,), generator=_gen(t, k))
                total = total + ((F.embedding(idx, p, sparse=True) - target[idx]) ** 2).sum()
            else:
                w = 1.0 if t is None else torch.rand(p.shape, generator=_gen(t, k)) + 0.5
                total = total + (w * (p - target) ** 2).sum()
        return total

    def make(self, params, backend=None, **kw):
        return self.ours(params, **{**self.hyper, "backend": backend or self.backends[0], **kw})

    def make_reference(self, params, **kw):
        return self.reference(params, **{**self.hyper, **kw})

    def tolerance(self, backend=None):
        return self.tol.get(backend or self.backends[0])

    def sides(self, backend=None):
        """(construct, parameters) for ours (on ``backend``) and, where there is one, the reference."""
        out = [(lambda params, **kw: self.make(params, backend, **kw), self.params())]
        if self.reference is not None:
            out.append((self.make_reference, [self.twin(p) for p in self.params()]))
        return out

    def __repr__(self):
        return self.id


ALL_BACKENDS = ("torch", "numba", "triton")
TOL = dict(atol=1e-6, rtol=1e-6)  # 6 float32 steps; measured at most 3e-8 (max |diff|)
TABLES = ((20, 5), (7, 3))
DENSE = ((5, 6), (5,), (300,))
C = 1.0  # the ball's curvature is -c
WEIGHT_DECAY = (("weight_decay-negative", dict(weight_decay=-1), "Invalid weight_decay value: -1"),)
CASES = [
    Case("dsa", TABLES, lambda s, g: torch.randn(s, generator=g), DiskSparseAdam, torch.optim.SparseAdam,
         # Triton's sqrt is correctly rounded, torch's CPU sqrt not always: an ulp here and there
         tol={"triton": TOL}, hyper=dict(lr=1e-2), backends=ALL_BACKENDS,
         drop_in=True),
    Case("ball", TABLES, lambda s, g: random_points(*s, C, torch.float32, g), DiskSparseRiemannianAdam,
         geoopt.optim.SparseRiemannianAdam, lambda p: geoopt.ManifoldParameter(p.detach().clone(), manifold=ball(C)),
         tol={"torch": TOL, "numba": TOL, "triton": TOL}, hyper=dict(lr=1e-2), backends=("torch", "numba", "triton")),
    Case("gefen-adamw", DENSE, lambda s, g: torch.randn(s, generator=g),
         lambda ps, **kw: Gefen(ps, layout="adamw", **kw),
         lambda ps, **kw: torch.optim.AdamW(ps, foreach=False, **kw),  # foreach takes no tensor lr
         tol={b: TOL for b in ALL_BACKENDS}, hyper=dict(lr=1e-2, weight_decay=0.1), backends=ALL_BACKENDS,
         sparse=False, bad_kwargs=WEIGHT_DECAY),
    Case("gefen", DENSE, lambda s, g: torch.randn(s, generator=g), Gefen, hyper=dict(lr=1e-2, weight_decay=0.1),
         backends=ALL_BACKENDS, sparse=False, bad_kwargs=WEIGHT_DECAY),
]
ON_BACKENDS = [pytest.param(c, b, id=f"{c.id}-{b}") for c in CASES for b in c.backends]
each_case = pytest.mark.parametrize("case", CASES, ids=repr)


# -- helpers ----------------------------------------------------------------------------------------
def run(case, opt, params, steps, start=0, scheduler=None):
    for t in range(start, start + steps):
        opt.zero_grad()
        case.loss(params, t).backward()
        opt.step()
        tick(scheduler)


def tick(scheduler):
    if isinstance(scheduler, ReduceLROnPlateau):
        scheduler.step(1.0)  # a metric that never improves: the lr falls after every step
    elif scheduler is not None:
        scheduler.step()


def counts(params, ts):
    """Each parameter's step count after the steps ``ts`` (parameter 1 skips some)."""
    return [sum(not _skips(k, t) for t in ts) for k in range(len(params))]


def steps_of(opt, params):
    """Each parameter's step count, None where it has no state."""
    return [int(opt.state[p]["step"]) if "step" in opt.state.get(p, {}) else None for p in params]


def params_of(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def saved(obj, weights_only=True):
    """``obj`` through torch.save and torch.load(map_location="cpu")."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=weights_only)


def two_groups(params, lr1):
    """The first parameter at the optimizer's lr, the others in a group at ``lr1``."""
    return [{"params": params[:1]}, {"params": params[1:], "lr": lr1}]


def named(params, yes=True):
    return [(f"name{k}", p) for k, p in enumerate(params)] if yes else params


def without_names(sd):
    sd = copy.deepcopy(sd)
    for g in sd["param_groups"]:
        g.pop("param_names", None)
    return sd
