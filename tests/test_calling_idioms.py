"""Every way torch.optim takes parameters, for every optimizer here, against an independent reference.

Parameters reach an optimizer as a list, a generator (which can be read once), a tuple, a single
tensor or (name, tensor) pairs; each of those as the ``"params"`` of dict groups, and through
``add_param_group``. For each idiom, each optimizer and each CPU backend, one run that does what
training code does: groups at their own lr under a ``StepLR`` that edits the groups in place,
``zero_grad(set_to_none=False)``, ``step(closure)``, and mid-run ``state_dict()`` through
``torch.save`` / ``torch.load`` into a fresh optimizer built with another idiom. Triton (under its
interpreter, slow) takes each form as dict groups only: how a group was given is settled before a
backend is chosen. The reference is built from plain lists in dict groups and runs the same schedule:

- ``dsa``: ``torch.optim.SparseAdam`` (bit for bit on torch and numba, Triton to an ulp);
- ``ball``: ``geoopt.optim.SparseRiemannianAdam`` (to 1e-6);
- ``gefen-adamw`` (sharing and quantization off): ``torch.optim.AdamW`` (to 1e-6);
- each quantised Gefen layout: the same layout on the torch backend from plain lists. Nothing else
  computes these layouts; the torch backend's step is held to ``optim/gefen/reference.py`` in
  ``tests/test_gefen_optimizer.py`` and ``tests/test_gefen_layout_options.py``, and the question here
  is whether an idiom reaches the same groups, lrs and state.

Every given tensor must move, and every group must hold what it was given.
"""

import pytest
import torch
from torch.optim.lr_scheduler import StepLR

from optim import DiskSparseAdam, Gefen
from tests.optimizer_cases import CASES, DENSE, TOL, Case, saved
from tests.utils import assert_match

STEPS, SAVE_AT = 4, 2
LRS = (1e-2, 3e-3, 5e-3)  # the lr of group k


LAYOUTS = {f"{name}-{bits}": dict(bits=bits, layout=name)  # Gefen's named layouts
           for name in ("published", "factored", "compact") for bits in (8, 4)}


def _gefen_case(name, layout):
    def make(params, **kw):
        return Gefen(params, **{**layout, **kw})

    return Case(f"gefen-{name}", DENSE, lambda s, g: torch.randn(s, generator=g), make,
                reference=lambda params, **kw: make(params, **{**kw, "backend": "torch"}),
                tol={b: TOL for b in ("torch", "numba", "triton")}, hyper=dict(lr=1e-2, weight_decay=0.1),
                backends=("torch", "numba", "triton"), sparse=False)


MATRIX_CASES = [c for c in CASES if c.reference is not None] + [_gefen_case(n, kw) for n, kw in LAYOUTS.items()]


# -- the idioms ---------------------------------------------------------------------------------------
def _names(params, offset=0):
    return [f"p{offset + k}" for k in range(len(params))]


FORMS = {  # how one group's parameters are given (``k``: the index of its first parameter)
    "list": lambda ps, k: list(ps),
    "generator": lambda ps, k: (p for p in ps),
    "tuple": lambda ps, k: tuple(ps),
    "tensor": lambda ps, k: ps[0],
    "named": lambda ps, k: list(zip(_names(ps, k), ps)),
}
NEXT = {"list": "generator", "generator": "tuple", "tuple": "named", "named": "list", "tensor": "list"}
STRUCTURES = ("params", "groups", "add_param_group")


def _grouping(params, form):
    """The groups' parameters: each tensor in its own group where a group is one tensor, else the
    first parameter in one group and the others in a second."""
    return [[p] for p in params] if form == "tensor" else [params[:1], params[1:]]


def _starts(groups):
    return [sum(len(g) for g in groups[:k]) for k in range(len(groups))]


def build(make, structure, form, groups):
    """An optimizer over ``groups`` (lists of parameters), given in ``form`` by ``structure``:
    "params" (one group, default lr), "groups" (dict groups at ``LRS``) or "add_param_group" (the first
    group given as ``params``, the others added)."""
    given = [FORMS[form](g, k) for g, k in zip(groups, _starts(groups))]
    if structure == "params":
        return make(given[0])
    if structure == "groups":
        return make([{"params": g, "lr": lr} for g, lr in zip(given, LRS)], lr=LRS[0])
    opt = make(FORMS["list" if form == "tensor" else form](groups[0], 0), lr=LRS[0])
    for g, lr in zip(given[1:], LRS[1:]):
        opt.add_param_group({"params": g, "lr": lr})
    return opt


def reference_of(make_ref, structure, groups):
    """The reference over the same groups at the same lrs, from plain lists in dict groups."""
    lrs = (None,) if structure == "params" else LRS
    return make_ref([{"params": list(g), **({} if lr is None else {"lr": lr})} for g, lr in zip(groups, lrs)])


def train(case, opt, params, steps, start, scheduler):
    """Steps with ``zero_grad(set_to_none=False)`` and a closure; the scheduler after each."""
    for t in range(start, start + steps):
        def closure(t=t):
            opt.zero_grad(set_to_none=False)
            loss = case.loss(params, t)
            loss.backward()
            return loss

        opt.step(closure)
        scheduler.step()


def run_idiom(case, make, structure, form, params, track):
    """``SAVE_AT`` steps, the state dict through torch.save into a fresh optimizer built with the next
    idiom, the remaining steps; returns the optimizers (before and after the reload)."""
    groups = _grouping(params, form) if structure != "params" else [params[:1] if form == "tensor" else params]
    opt = track(build(make, structure, form, groups))
    scheduler = StepLR(opt, step_size=2, gamma=0.5)
    train(case, opt, params, SAVE_AT, 0, scheduler)
    state, sched_state = saved(opt.state_dict()), scheduler.state_dict()
    fresh = track(build(make, structure, NEXT[form], groups))
    fresh.load_state_dict(state)
    scheduler = StepLR(fresh, step_size=2, gamma=0.5)
    scheduler.load_state_dict(sched_state)
    train(case, fresh, params, STEPS - SAVE_AT, SAVE_AT, scheduler)
    return opt, fresh, groups


def _matrix():
    out = []
    for case in MATRIX_CASES:
        for backend in case.backends:
            for structure in STRUCTURES if backend != "triton" else ("groups",):
                for form in FORMS:
                    out.append(pytest.param(case, backend, structure, form,
                                            id=f"{case.id}-{backend}-{structure}-{form}"))
    return out


@pytest.mark.parametrize("case,backend,structure,form", _matrix())
def test_every_idiom_trains_every_parameter_as_the_reference(case, backend, structure, form, track):
    ours = case.params()
    if structure == "params" and form == "tensor":  # torch's Optimizer takes no bare tensor: its error
        for make, params in case.sides(backend):
            with pytest.raises(TypeError, match="should be an iterable of Tensors or dicts"):
                track(make(params[0]))
        return
    starts = [p.detach().clone() for p in ours]
    opt, fresh, groups = run_idiom(case, lambda ps, **kw: case.make(ps, backend, **kw), structure, form, ours, track)

    given = [p for g in groups for p in g]
    for o in (opt, fresh):
        held = [list(g["params"]) for g in o.param_groups]
        assert [[id(p) for p in g] for g in held] == [[id(p) for p in g] for g in groups], \
            f"groups hold {[len(g) for g in held]} parameters, given {[len(g) for g in groups]}"
    lrs = [g["lr"] for g in fresh.param_groups]
    decay = 0.5 ** (STEPS // 2)
    expected = [case.hyper["lr"] * decay] if structure == "params" else [lr * decay for lr in LRS[:len(groups)]]
    assert lrs == pytest.approx(expected, rel=1e-12), "the scheduler's in-place lrs"
    for k, (p, p0) in enumerate(zip(ours, starts)):
        moved = not torch.equal(p.detach(), p0)
        assert moved == any(p is q for q in given), f"parameter {k} moved: {moved}"

    (_, _), (make_ref, theirs) = case.sides(backend)
    index = {id(p): k for k, p in enumerate(ours)}
    ref_groups = [[theirs[index[id(p)]] for p in g] for g in groups]
    ref = track(reference_of(make_ref, structure, ref_groups))
    scheduler = StepLR(ref, step_size=2, gamma=0.5)
    train(case, ref, theirs, SAVE_AT, 0, scheduler)
    reloaded = track(reference_of(make_ref, structure, ref_groups))
    reloaded.load_state_dict(saved(ref.state_dict(), weights_only=False))
    scheduler2 = StepLR(reloaded, step_size=2, gamma=0.5)
    scheduler2.load_state_dict(scheduler.state_dict())
    train(case, reloaded, theirs, STEPS - SAVE_AT, SAVE_AT, scheduler2)
    assert_match(ours, theirs, case.tolerance(backend))


@pytest.mark.parametrize("make", [pytest.param(lambda ps: DiskSparseAdam(ps), id="dsa"),
                                  pytest.param(lambda ps: Gefen(ps, layout="published"), id="gefen")])
@pytest.mark.parametrize("how", ["params", "add_param_group"])
def test_a_tensor_given_twice_in_a_group_is_refused_by_name(make, how, track):
    """torch only warns and then updates the tensor twice a step; ours keep one state per tensor."""
    a, b = torch.nn.Parameter(torch.randn(6, 3)), torch.nn.Parameter(torch.randn(6, 3))
    with pytest.raises(ValueError, match=r"group \d gives one tensor twice, as parameters 0 and 2"):
        if how == "params":
            make([a, b, a])
        else:
            track(make([torch.nn.Parameter(torch.randn(6, 3))])).add_param_group({"params": [a, b, a]})
