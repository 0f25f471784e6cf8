"""PyTorch's optimizer protocol, once for every optimizer here.

A case says how to make parameters and the loss whose backward gives their gradients (row-sparse
embedding gradients with duplicate rows for the Disk Sparse optimizers, dense ones for Gefen), how to
construct ours, and the independent optimizer ours must reduce to, if any:

- ``dsa``: DiskSparseAdam beside ``torch.optim.SparseAdam``, bit for bit (Triton to an ulp); state
  dicts interchangeable.
- ``ball``: DiskSparseRiemannianAdam beside ``geoopt.optim.SparseRiemannianAdam`` in float32, to a
  tolerance: the same operations in other code (duplicate rows may be summed in another order).
- ``gefen-adamw``: Gefen with ``share_second_moment=False, quantize_first_moment=False`` beside
  ``torch.optim.AdamW``, to 1e-6: the fast paths run other kernels than AdamW's.
- ``gefen``: quantised Gefen, which nothing else computes: the protocol's own properties only (a
  resumed run is the uninterrupted one bit for bit, hooks, errors, ...).

The protocol, as PyTorch's ``TestOptimRenewed`` states it: state-dict round trips (through a file,
``torch.load(map_location="cpu", weights_only=True)``, into a fresh optimizer) with and without
parameter names, deepcopy, step / state_dict / load_state_dict hooks and their order, closures,
``zero_grad``, parameters without gradients, late ``add_param_group``, float and tensor ``lr`` under
schedulers, ``repr``, and constructor errors of PyTorch's types with the messages its tests match.
Only public API is used. What is particular to one optimizer (element-sparse gradients, ``maximize``,
compact state, codebooks, ...) is tested in its own files.
"""

import contextlib
import copy
import re
import warnings

import pytest
import torch
from torch.optim.lr_scheduler import ExponentialLR, ReduceLROnPlateau, StepLR

from tests.optimizer_cases import (CASES, ON_BACKENDS, STEPS, TOL, _copy, counts, each_case, named, params_of, run,
                                   saved, steps_of, tick, two_groups, without_names)
from tests.utils import assert_match, assert_same_state_dict


# -- ours reduces to the reference ------------------------------------------------------------------
@pytest.mark.parametrize("case,backend", [p for p in ON_BACKENDS if p.values[0].reference is not None])
def test_matches_the_reference(case, backend, track):
    """Two groups (the second at its own lr), parameter 1 without a gradient at step 3: every step as
    the reference's, and the same step counts."""
    (_, ps), (make_ref, qs) = case.sides()
    opt = track(case.make(two_groups(ps, 3e-3), backend))
    ref = make_ref(two_groups(qs, 3e-3))
    for t in range(STEPS):
        run(case, opt, ps, 1, start=t)
        run(case, ref, qs, 1, start=t)
        assert_match(ps, qs, case.tolerance(backend))
    assert steps_of(opt, ps) == steps_of(ref, qs) == counts(ps, range(STEPS))


# -- state dicts ------------------------------------------------------------------------------------
@pytest.mark.parametrize("case,backend", ON_BACKENDS)
def test_state_dict_round_trip_resumes_bitwise(case, backend, tmp_path, track):
    """Save after 3 steps (groups at a float and a tensor lr) with the weights; torch.load with
    map_location="cpu" and weights_only=True into a fresh optimizer made with another lr: the groups
    come from the dict, the loaded state dict is the saved one, and the next steps are the
    uninterrupted run's bit for bit (and the reference's)."""
    ps = case.params()
    opt = track(case.make(two_groups(ps, torch.tensor(3e-3)), backend))
    run(case, opt, ps, 3)
    torch.save({"opt": opt.state_dict(), "params": [p.detach().clone() for p in ps]}, tmp_path / "ckpt.pt")
    run(case, opt, ps, STEPS - 3, start=3)  # the uninterrupted run

    ckpt = torch.load(tmp_path / "ckpt.pt", map_location="cpu", weights_only=True)
    qs = [torch.nn.Parameter(w) for w in ckpt["params"]]
    resumed = track(case.make(two_groups(qs, 0.5), backend, lr=0.5))
    resumed.load_state_dict(ckpt["opt"])
    assert resumed.param_groups[0]["lr"] == case.hyper["lr"] and torch.is_tensor(resumed.param_groups[1]["lr"])
    assert_same_state_dict(resumed.state_dict(), torch.load(tmp_path / "ckpt.pt", weights_only=True)["opt"])
    run(case, resumed, qs, STEPS - 3, start=3)
    assert_match(qs, ps)
    assert_same_state_dict(resumed.state_dict(), opt.state_dict())
    for make_ref, rs in case.sides()[1:]:
        run(case, make_ref(two_groups(rs, torch.tensor(3e-3))), rs, STEPS)
        assert_match(qs, rs, case.tolerance(backend))


@pytest.mark.parametrize("named1", [False, True], ids=["plain1", "named1"])
@pytest.mark.parametrize("named0", [False, True], ids=["plain0", "named0"])
@each_case
def test_state_dict_with_and_without_param_names(case, named0, named1, track):
    """A state dict with or without ``param_names`` loads into an optimizer with or without them and
    continues bitwise; a state dict keeps the names; one of repeated groups still works."""
    ps = case.params()
    opt = track(case.make(named(ps, named0)))
    run(case, opt, ps, 3)
    assert ("param_names" in opt.state_dict()["param_groups"][0]) == named0
    qs = [_copy(p) for p in ps]
    twin = track(case.make(named(qs, named1)))
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    for t in range(3, STEPS):
        run(case, opt, ps, 1, start=t)
        run(case, twin, qs, 1, start=t)
        assert_match(qs, ps)
    assert_same_state_dict(without_names(twin.state_dict()), without_names(opt.state_dict()))
    twin.param_groups.extend(twin.param_groups)
    assert without_names(opt.state_dict())["param_groups"][-1] == without_names(twin.state_dict())["param_groups"][-1]


@pytest.mark.parametrize("names", [False, True], ids=["plain", "named"])
@each_case
def test_saved_state_dict_loads_equal_with_weights_only(case, names, track):
    ps = case.params()
    opt = track(case.make(named(ps, names)))
    run(case, opt, ps, 2)
    sd = opt.state_dict()
    for weights_only in (False, True):
        loaded = saved(sd, weights_only)
        assert_same_state_dict(loaded, sd)
        assert loaded["param_groups"][0].get("param_names") == sd["param_groups"][0].get("param_names")


@pytest.mark.parametrize("lr", [1e-2, "tensor"], ids=["float-lr", "tensor-lr"])
@pytest.mark.parametrize("into", ["reference", "ours"])
@pytest.mark.parametrize("case", [c for c in CASES if c.drop_in], ids=repr)
def test_state_dict_continues_in_the_other_optimizer(case, into, lr, track):
    """A drop-in's state dicts carry the reference's keys and types: a run of one continues bitwise in
    the other, either way; the step is a live count of the reference's type."""
    lr = torch.tensor(1e-2) if lr == "tensor" else lr
    (make, ps), (make_ref, qs) = case.sides()
    ours, ref = track(make(ps, lr=lr)), make_ref(qs, lr=lr)
    (first, firsts), (second, seconds) = ((ours, ps), (ref, qs))[::1 if into == "reference" else -1]
    run(case, first, firsts, 3)
    with torch.no_grad():
        for a, b in zip(seconds, firsts):
            a.copy_(b)
    second.load_state_dict(saved(first.state_dict()))
    assert steps_of(second, seconds) == steps_of(first, firsts)
    run(case, ours, ps, STEPS - 3, start=3)
    run(case, ref, qs, STEPS - 3, start=3)
    assert_match(ps, qs)
    sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert_same_state_dict(sd["state"], ref_sd["state"])  # keys, values, dtypes and the step's type
    assert [{k: g[k] for k in h} for g, h in zip(sd["param_groups"], ref_sd["param_groups"])] == ref_sd["param_groups"]
    assert steps_of(ours, ps) == counts(ps, range(STEPS))
    assert all(type(ours.state[p]["step"]) is type(ref.state[q]["step"]) for p, q in zip(ps, qs))


# -- deepcopy ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("case,backend", ON_BACKENDS)
def test_deepcopy_continues_as_the_original(case, backend, track):
    """deepcopy warns nothing and copies the parameters, the public attributes and the state; the
    copy steps as the original and goes on once the original is closed."""
    ps = case.params()
    opt = track(case.make(ps, backend))
    run(case, opt, ps, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        twin = track(copy.deepcopy(opt))
    qs = params_of(twin)
    assert all(q is not p and torch.equal(q, p) for p, q in zip(ps, qs))
    assert {k for k in vars(opt) if not k.startswith("_")} == {k for k in vars(twin) if not k.startswith("_")}
    assert_same_state_dict(twin.state_dict(), opt.state_dict())
    for t in range(2, STEPS - 1):
        run(case, opt, ps, 1, start=t)
        run(case, twin, qs, 1, start=t)
        assert_match(qs, ps)
    if hasattr(opt, "close"):
        opt.close()
    run(case, twin, qs, 1, start=STEPS - 1)
    assert steps_of(twin, qs) == counts(qs, range(STEPS))


# -- hooks ------------------------------------------------------------------------------------------
@each_case
def test_step_hooks_run_in_torchs_order(case, track):
    """Global and per-optimizer step pre/post hooks run global pre, local pre, local post, global post
    around every step (another optimizer's steps interleaved); removed hooks stop."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    ps = case.params()
    opt = track(case.make(ps))
    sgd = torch.optim.SGD([torch.zeros(2, requires_grad=True)])
    log = []
    handles = [register_optimizer_step_pre_hook(lambda *a: log.append(0)),
               register_optimizer_step_post_hook(lambda *a: log.append(5))]
    for o in (opt, sgd):
        handles += [o.register_step_pre_hook(lambda o_, args, kwargs, o=o: log.append(1 if o_ is o else -1)),
                    o.register_step_post_hook(lambda o_, args, kwargs, o=o: log.append(2 if o_ is o else -1))]
    try:
        run(case, opt, ps, 1)
        sgd.step()
        run(case, opt, ps, 1, start=1)
    finally:
        for h in handles:
            h.remove()
    run(case, opt, ps, 1, start=2)
    assert log == [0, 1, 2, 5] * 3


def _state_dict_hooks(opt, log):
    """A state_dict pre-hook that adds to the state, a post-hook that edits the returned dict, a load
    pre-hook that returns a replacement dict, a load post-hook."""
    def post_save(o, sd):
        log.append(("post_save", sd["state"].pop("extra", None) is not None))
        sd["extra"] = 1
        return sd

    def pre_load(o, sd):
        log.append("pre_load")
        return dict(sd, param_groups=[dict(g, lr=0.125) for g in sd["param_groups"]])

    opt.register_state_dict_pre_hook(lambda o: log.append("pre_save") or o.state.update(extra=torch.ones(3)))
    opt.register_state_dict_post_hook(post_save)
    opt.register_load_state_dict_pre_hook(pre_load)
    opt.register_load_state_dict_post_hook(lambda o: log.append(("post_load", o.param_groups[0]["lr"])))


@each_case
def test_state_dict_hooks(case, track):
    """state_dict's pre-hook runs before the dict is built and its post-hook's edits last;
    load_state_dict's pre-hook may replace the dict and its post-hook sees the loaded optimizer;
    the log is the reference's."""
    logs = []
    for make, params in case.sides():
        opt = track(make(params))
        run(case, opt, params, 2)
        logs.append([])
        _state_dict_hooks(opt, logs[-1])
        sd = opt.state_dict()
        assert sd["extra"] == 1 and "extra" not in sd["state"]
        opt.state.pop("extra", None)
        opt.load_state_dict(sd)
        assert opt.param_groups[0]["lr"] == 0.125
    assert logs[0] == ["pre_save", ("post_save", True), "pre_load", ("post_load", 0.125)]
    assert all(log == logs[0] for log in logs)


def _load_hooks(opt, log):
    def first(o, d):
        log.append("first")
        d["param_groups"][0]["lr"] = 0.002

    def second(o, d):
        log.append(("second", d["param_groups"][0]["lr"]))
        d = copy.deepcopy(d)
        d["param_groups"][0]["lr"] = 0.003
        d["state"][0]["step"] = 7  # a hook may rewrite the state (say, an older format)
        return d

    def prepended(o, d):
        log.append("prepended")
        d["param_groups"][0]["lr"] = 0.001

    opt.register_load_state_dict_pre_hook(first)
    opt.register_load_state_dict_pre_hook(second)
    opt.register_load_state_dict_pre_hook(prepended, prepend=True)
    opt.register_load_state_dict_post_hook(
        lambda o: log.append(("post", o.param_groups[0]["lr"], int(o.state[params_of(o)[0]]["step"]))))


@each_case
def test_load_state_dict_pre_hooks_run_in_order_and_may_replace_the_dict(case, track):
    """Load pre-hooks run in order of registration (a prepended one first), each sees the previous
    one's edits, a returned dict replaces the argument, state included; post-hooks run after; the log
    is the reference's."""
    logs = []
    for make, params in case.sides():
        source = track(make(params))
        run(case, source, params, 2)
        opt = track(make([_copy(p) for p in params]))
        logs.append([])
        _load_hooks(opt, logs[-1])
        opt.load_state_dict(copy.deepcopy(source.state_dict()))
    assert logs[0] == ["prepended", "first", ("second", 0.002), ("post", 0.003, 7)]
    assert all(log == logs[0] for log in logs)


# -- closures, zero_grad, missing gradients, late groups --------------------------------------------
@each_case
def test_step_with_closure(case, track):
    """step(closure) evaluates the closure with gradients enabled (ours even under no_grad), returns
    its loss, and steps as a step after the closure's backward does (and as the reference's)."""
    ends = []
    for side, (make, params) in enumerate(case.sides()):
        opt = track(make(params))
        losses = []
        for t in range(STEPS):
            def closure(t=t):
                assert torch.is_grad_enabled()
                opt.zero_grad()
                loss = case.loss(params, t)
                loss.backward()
                return loss

            with torch.no_grad() if side == 0 else contextlib.nullcontext():
                losses.append(opt.step(closure))
        ends.append((params, torch.stack(losses)))
    plain = case.params()
    run(case, track(case.make(plain)), plain, STEPS)
    assert_match(ends[0][0], plain)
    for params, losses in ends[1:]:
        assert_match(ends[0][0] + [ends[0][1]], params + [losses], case.tolerance())


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("case,backend", ON_BACKENDS)
def test_zero_grad(case, backend, set_to_none, track):
    """zero_grad drops the gradients or zeroes them in place (a sparse one becomes empty). A step after
    dropping them changes nothing; a step on zeroed ones counts, as the reference's does."""
    ends = []
    for make, params in case.sides(backend):
        opt = track(make(params))
        run(case, opt, params, 2)
        opt.zero_grad(set_to_none=set_to_none)
        assert all(p.grad is None if set_to_none else not p.grad.to_dense().any() for p in params)
        before = [p.detach().clone() for p in params]
        opt.step()
        if set_to_none:
            assert_match(params, before)
        assert steps_of(opt, params) == [2 + (not set_to_none)] * len(params)
        ends.append(params)
    for params in ends[1:]:
        assert_match(ends[0], params, case.tolerance(backend))


@pytest.mark.parametrize("case,backend", ON_BACKENDS)
def test_parameters_without_gradients(case, backend, track):
    """A step where no parameter has a gradient (or none requires one) returns the closure's loss and
    changes nothing; a parameter without a gradient is not changed and its step not counted while the
    others step; after a step every parameter with a gradient has state."""
    frozen = [p.detach() for p in case.params()]
    assert track(case.make(frozen, backend)).step(lambda: torch.tensor([1.0])).item() == 1.0
    assert_match(frozen, case.params())
    ps = case.params()
    opt = track(case.make(ps, backend))
    opt.step()
    assert_match(ps, case.params())
    unstepped = {None}
    assert set(steps_of(opt, ps)) <= unstepped and len(opt.state) == 0
    run(case, opt, ps, 1, start=3)  # parameter 1 has no gradient at steps 3 and 7
    run(case, opt, ps, 1, start=7)
    assert torch.equal(ps[1], case.params()[1]) and not torch.equal(ps[0], case.params()[0])
    assert steps_of(opt, ps)[0] == 2 and steps_of(opt, ps)[1] in unstepped
    run(case, opt, ps, 1)
    assert all(len(opt.state[p]) > 0 for p in ps)


@pytest.mark.parametrize("case,backend", ON_BACKENDS)
def test_add_param_group_later(case, backend, track):
    """A group added after 3 steps takes the defaults it does not set, starts from fresh state and
    steps as the reference's."""
    ends = []
    for make, params in case.sides(backend):
        opt = track(make(params[:1]))
        run(case, opt, params, 3)
        opt.add_param_group({"params": params[1:], "lr": 2e-3})
        assert ({k: v for k, v in opt.param_groups[1].items() if k not in ("params", "lr")}
                == {k: v for k, v in opt.param_groups[0].items() if k not in ("params", "lr")})
        run(case, opt, params, STEPS - 3, start=3)
        assert steps_of(opt, params) == [STEPS] + counts(params, range(3, STEPS))[1:]
        ends.append(params)
    for params in ends[1:]:
        assert_match(ends[0], params, case.tolerance(backend))


# -- learning rates and schedulers ------------------------------------------------------------------
SCHEDULERS = {
    "steplr": lambda o: StepLR(o, step_size=2, gamma=0.5),
    "exponential": lambda o: ExponentialLR(o, gamma=0.7),
    "plateau": lambda o: ReduceLROnPlateau(o, factor=0.5, patience=0),
}


@pytest.mark.parametrize("lr", [1e-2, "tensor"], ids=["float-lr", "tensor-lr"])
@pytest.mark.parametrize("sched", list(SCHEDULERS))
@pytest.mark.parametrize("case,backend", ON_BACKENDS)
def test_lr_under_schedulers(case, backend, sched, lr, track):
    """A scheduler changes each group's lr between steps (a tensor lr stays a tensor): the lrs are
    torch's (SGD's under the same scheduler), the steps the reference's; without a reference, a
    tensor lr steps as the float lr it holds (to its float32 rounding)."""
    def lr_of(x, tensor=lr == "tensor"):
        return torch.tensor(x) if tensor else x

    def trained(make, params, tensor=lr == "tensor"):
        opt = track(make(two_groups(params, lr_of(3e-3, tensor)), lr=lr_of(1e-2, tensor)))
        run(case, opt, params, STEPS, scheduler=SCHEDULERS[sched](opt))
        return opt, params

    ends = [trained(make, params) for make, params in case.sides(backend)]
    sgd = torch.optim.SGD(two_groups([torch.zeros(1, requires_grad=True) for _ in ends[0][1]], lr_of(3e-3)),
                          lr=lr_of(1e-2))
    scheduler = SCHEDULERS[sched](sgd)
    for _ in range(STEPS):
        sgd.step()
        tick(scheduler)
    for g, h in zip(ends[0][0].param_groups, sgd.param_groups):
        assert torch.is_tensor(g["lr"]) == (lr == "tensor") and float(g["lr"]) == float(h["lr"]) < 1e-2
    if case.reference is not None:
        assert_match(ends[0][1], ends[1][1], case.tolerance(backend))
    elif lr == "tensor":
        assert_match(ends[0][1], trained(case.sides(backend)[0][0], case.params(), tensor=False)[1], TOL)


@each_case
def test_descends(case, track):
    """Ten steps on the per-step losses lower the whole objective, under a StepLR schedule."""
    ps = case.params()
    opt = track(case.make(two_groups(ps, 5e-2), lr=5e-2))
    with torch.no_grad():
        first = case.loss(ps, None)
    run(case, opt, ps, 10, scheduler=StepLR(opt, step_size=5, gamma=0.5))
    with torch.no_grad():
        assert case.loss(ps, None) < first


@each_case
def test_repr_names_the_class_and_every_groups_settings(case, track):
    opt = track(case.make(two_groups(case.params(), 3e-3)))
    text = repr(opt)
    assert text.startswith(f"{type(opt).__name__} (")
    for k, g in enumerate(opt.param_groups):
        assert f"Parameter Group {k}" in text
        assert all(f"    {key}: {g[key]}\n" in text for key in g if key != "params")


# -- constructor errors -----------------------------------------------------------------------------
def _p():
    return torch.nn.Parameter(torch.randn(1, 1) * 0.1)


ERRORS = {  # id: (params and kwargs, PyTorch's type, the regex PyTorch's tests match or its message)
    "tensor-params": (lambda: (_p(), {}), TypeError,
                      "params argument given to the optimizer should be an iterable of Tensors or dicts"),
    "empty-params": (lambda: ([], {}), ValueError, "optimizer got an empty parameter list"),
    "duplicates-across-groups": (lambda: ((lambda q: [{"params": q}, {"params": q}])(_p()), {}), ValueError,
                                 "some parameters appear in more than one parameter group"),
    "names-missing": (lambda: ([("weight", _p()), _p()], {}), ValueError,
                      "all optimizer params should be with/without names. Some param names are missing"),
    "group-names-mixed": (lambda: ([{"params": [_p()], "lr": 1e-2}, {"params": [("w", _p())]}], {}), ValueError,
                          "all optimizer param groups should be with/without names. "
                          "cannot add param group with names to the optimizer"),
    "two-element-tensor-lr": (lambda: ([_p()], {"lr": torch.tensor([1e-3, 1e-3])}), ValueError,
                              "Tensor lr must be 1-element"),
    "lr-negative": (lambda: ([_p()], {"lr": -1.0}), ValueError, "Invalid learning rate: -1"),
    "eps-negative": (lambda: ([_p()], {"eps": -1.0}), ValueError, "Invalid epsilon value: -1"),
    "beta1-one": (lambda: ([_p()], {"lr": 1e-2, "betas": (1.0, 0.0)}), ValueError,
                  "Invalid beta parameter at index 0: 1.0"),
    "beta2-one": (lambda: ([_p()], {"betas": (0.9, 1.0)}), ValueError, "Invalid beta parameter at index 1: 1.0"),
    "beta2-negative": (lambda: ([_p()], {"betas": (0.9, -0.1)}), ValueError, "Invalid beta parameter at index 1: -0.1"),
}


def _error_params():
    out = []
    for case in CASES:
        extra = {eid: (lambda kw=kw: ([_p()], dict(kw)), ValueError, rx) for eid, kw, rx in case.bad_kwargs}
        for eid, (inputs, etype, regex) in {**ERRORS, **extra}.items():
            out.append(pytest.param(case, inputs, etype, regex, id=f"{case.id}-{eid}"))
    return out


def _raised(make, inputs, etype):
    """What ``make(*inputs())`` raises (or warns, for a Warning type)."""
    params, kwargs = inputs()
    if issubclass(etype, Warning):
        with pytest.warns(etype) as record:
            opt = make(params, **kwargs)
        getattr(opt, "close", lambda: None)()
        return next(w.message for w in record if issubclass(w.category, etype))
    with pytest.raises(Exception) as info:
        make(params, **kwargs)
    return info.value


@pytest.mark.parametrize("case,inputs,etype,regex", _error_params())
def test_invalid_arguments_raise_pytorchs_type_as_the_reference(case, inputs, etype, regex):
    """Ours raises PyTorch's type; so does the reference wherever it raises PyTorch's error (geoopt
    takes neither tensor lrs nor parameter names and fails otherwise there)."""
    ours = _raised(case.make, inputs, etype)
    assert isinstance(ours, etype), repr(ours)
    if case.reference is not None:
        ref = _raised(case.make_reference, inputs, etype)
        assert type(ours) is type(ref) or not re.search(regex, str(ref)), (ours, ref)


@pytest.mark.parametrize("case,inputs,etype,regex", _error_params())
def test_invalid_arguments_carry_pytorchs_message(case, inputs, etype, regex):
    assert re.search(regex, str(_raised(case.make, inputs, etype)))


ODD = {  # id: (keyword arguments, the argument the refusal must name): what torch accepts or fails on later
    "lr-string": (dict(lr="0.1"), "lr"), "lr-bool": (dict(lr=True), "lr"), "lr-none": (dict(lr=None), "lr"),
    "lr-inf": (dict(lr=float("inf")), "learning rate"), "eps-string": (dict(eps="1e-8"), "eps"),
    "eps-inf": (dict(eps=float("inf")), "epsilon"), "beta-string": (dict(betas=("0.9", 0.999)), r"betas\[0\]"),
    "betas-one": (dict(betas=(0.9,)), "betas"), "betas-three": (dict(betas=(0.9, 0.99, 0.999)), "betas"),
}
ODD_DECAY = {"weight_decay-string": (dict(weight_decay="0.1"), "weight_decay"),
             "weight_decay-inf": (dict(weight_decay=float("inf")), "weight_decay")}


@pytest.mark.parametrize("case,kw,name", [  # the Disk Sparse optimizers take no weight_decay, as SparseAdam
    pytest.param(c, *v, id=f"{c.id}-{k}") for c in CASES
    for k, v in {**ODD, **(ODD_DECAY if c.id.startswith("gefen") else {})}.items()])
def test_odd_hyper_parameters_are_refused_naming_the_argument_and_value(case, kw, name, track):
    """A string, bool, None, a non-finite number or the wrong count of betas is refused at construction
    with a ValueError that names the argument and shows the value (torch accepts some of these and
    fails on others at the first step, or with a bare TypeError)."""
    with pytest.raises(ValueError, match=name) as info:
        track(case.make([_p()], **kw))
    value = next(iter(kw.values()))
    shown = [value, value[0]] if isinstance(value, tuple) else [value]
    assert any(repr(v) in str(info.value) or str(v) in str(info.value) for v in shown), str(info.value)
