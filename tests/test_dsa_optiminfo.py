"""PyTorch's optimizer test cases (``TestOptimRenewed`` with SparseAdam's ``OptimizerInfo``), run on
DiskSparseAdam beside ``torch.optim.SparseAdam``.

PyTorch's tests check that the loss moves the right way; here every case also runs SparseAdam on the
same inputs and asserts that DiskSparseAdam gives the same parameters bit for bit, and the same
error message where SparseAdam refuses. The inputs are SparseAdam's ``optim_inputs_func``: default,
another ``lr``, a tensor ``lr`` and ``maximize``. The CUDA-only, foreach, fused and complex cases do
not apply (SparseAdam has none of them).
"""

import copy
import functools
import io
import warnings

import pytest
import torch
from torch.nn import Parameter
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR

from optim import DiskSparseAdam

OPTIMS = (torch.optim.SparseAdam, DiskSparseAdam)
INPUTS = {
    "default": lambda: {},
    "lr": lambda: {"lr": 0.01},
    "tensor-lr": lambda: {"lr": torch.tensor(0.001)},
    "maximize": lambda: {"maximize": True},
}
SCHEDULERS = {
    "none": [],
    "steplr": [lambda o: StepLR(o, gamma=0.9, step_size=10)],
    "plateau": [lambda o: ReduceLROnPlateau(o)],
}


def _close(opt):
    if isinstance(opt, DiskSparseAdam):
        opt.close()


def _sparse_grads(*params):
    """PyTorch's tests turn the dense gradient into an element-sparse one (``to_sparse``)."""
    for p in params:
        if p.grad is not None:
            p.grad = p.grad.to_sparse()


def _linear_problem(seed, contiguous=True):
    """PyTorch's ``(weight @ x + bias)^2`` problem, the same tensors for each optimizer."""
    torch.manual_seed(seed)
    if contiguous:
        w, b = torch.randn(10, 5), torch.randn(10)
    else:
        w, b = torch.randn(10, 5, 2), torch.randn(10, 2)
    x = torch.randn(5)

    def make():
        if contiguous:
            return Parameter(w.clone()), Parameter(b.clone())
        return Parameter(w.clone()[..., 0]), Parameter(b.clone()[..., 0])  # strided views

    return make, x


def _train(cls, make, x, kwargs, schedulers=(), groups=None, steps=20):
    weight, bias = make()
    params = groups(weight, bias) if groups else [weight, bias]
    opt = cls(params, **kwargs)
    scheds = [s(opt) for s in schedulers]

    def closure():
        opt.zero_grad()
        loss = (weight.mv(x) + bias).pow(2).sum()
        loss.backward()
        _sparse_grads(weight, bias)
        return loss

    first = closure().item()
    for _ in range(steps):
        loss = opt.step(closure)
        for s in scheds:
            s.step(loss) if isinstance(s, ReduceLROnPlateau) else s.step()
    last = closure().item()
    _close(opt)
    return weight.detach(), bias.detach(), first, last


def _assert_same(ref, ours):
    for a, b in zip(ref, ours):
        if torch.is_tensor(a):
            assert torch.equal(a, b), f"max|diff| {(a - b).abs().max().item():.3e}"


# -- errors ----------------------------------------------------------------------------------------
def _p():
    return Parameter(torch.randn(1, 1))


ERROR_CASES = {
    "tensor-params": lambda: (_p(), {}),
    "duplicates-across-groups": lambda: ((lambda q: [{"params": q}, {"params": q}])(_p()), {}),
    "two-element-tensor-lr": lambda: ([_p()], {"lr": torch.tensor([1e-3, 1e-3])}),
    "names-missing": lambda: ([("weight", _p()), _p()], {}),
    "group-names-mixed": lambda: ([{"params": [_p()], "lr": 1e-2}, {"params": [("w", _p())]}], {}),
    "beta1-one": lambda: ([_p()], {"lr": 1e-2, "betas": (1.0, 0.0)}),
    "beta2-one": lambda: ([_p()], {"betas": (0.9, 1.0)}),
    "negative-lr": lambda: ([_p()], {"lr": -1.0}),
    "negative-eps": lambda: ([_p()], {"eps": -1.0}),
    "sparse-param": lambda: ([torch.zeros(3, layout=torch.sparse_coo)], {}),
    "sparse-param-in-group": lambda: ([{"params": [torch.zeros(3, layout=torch.sparse_coo)]}], {}),
    "complex-param": lambda: ([torch.rand(2, 3, dtype=torch.complex64)], {}),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_carry_sparseadams_type_and_message(case):
    params, kwargs = ERROR_CASES[case]()
    with pytest.raises(Exception) as ref:
        torch.optim.SparseAdam(params, **kwargs)
    params, kwargs = ERROR_CASES[case]()
    with pytest.raises(type(ref.value)) as ours:
        DiskSparseAdam(params, **kwargs)
    # PyTorch's tests match SparseAdam's sentence; SparseAdam prefixes some with where it looked
    expected = str(ref.value)
    expected = expected[expected.find("SparseAdam"):] if "SparseAdam" in expected else expected
    assert expected in str(ours.value), (str(ref.value), str(ours.value))


def test_duplicate_parameters_in_a_group_warn_as_in_sparseadam():
    q = _p()
    for cls in OPTIMS:
        with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
            _close(cls([q, q]))


# -- training goes where SparseAdam goes ------------------------------------------------------------
@pytest.mark.parametrize("sched", list(SCHEDULERS))
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
@pytest.mark.parametrize("inp", list(INPUTS))
def test_training_equals_sparseadam(inp, contiguous, sched):
    make, x = _linear_problem(1, contiguous)
    ref, ours = (_train(cls, make, x, INPUTS[inp](), SCHEDULERS[sched]) for cls in OPTIMS)
    _assert_same(ref, ours)
    first, last = ours[2], ours[3]
    assert (last > first) if inp == "maximize" else (last < first)


@pytest.mark.parametrize("sched", ["steplr", "plateau"])
def test_param_group_lr_with_scheduler_equals_sparseadam(sched):
    make, x = _linear_problem(2)

    def groups(w, b):
        return [{"params": [w]}, {"params": [b], "lr": 0.01}]

    ref, ours = (_train(cls, make, x, {}, SCHEDULERS[sched], groups) for cls in OPTIMS)
    _assert_same(ref, ours)
    assert ours[3] < ours[2]


@pytest.mark.parametrize("inp", list(INPUTS))
def test_param_groups_lr_and_unknown_group_keys(inp):
    """A group with its own lr trains; a group at the outer lr 1e-28 does not move; a group key
    SparseAdam does not know (``weight_decay``) is kept, not refused."""
    make, x = _linear_problem(3)
    kw = INPUTS[inp]()
    kw.setdefault("lr", 1e-3)
    still = torch.randn(2)
    outs = []
    for cls in OPTIMS:
        irrelevant = Parameter(still.clone())

        def groups(w, b, irrelevant=irrelevant):
            return [dict(params=[w, b], weight_decay=0.0, **kw), dict(params=[irrelevant])]

        weight, bias = make()
        opt = cls(groups(weight, bias), lr=1e-28)
        for t in range(20):
            opt.zero_grad()
            (weight.mv(x) + bias).pow(2).sum().backward()
            irrelevant.grad = torch.rand(2, generator=torch.Generator().manual_seed(t))
            _sparse_grads(weight, bias, irrelevant)
            opt.step()
        assert torch.equal(irrelevant.detach(), still)
        outs.append((weight.detach(), bias.detach()))
        _close(opt)
    _assert_same(*outs)


# -- Rosenbrock with uncoalesced 1-D sparse gradients -------------------------------------------------
def _rosenbrock(t):
    x, y = t
    return (1 - x) ** 2 + 100 * (y - x ** 2) ** 2


def _rosenbrock_grad(t):
    x, y = t
    return torch.stack((-400 * x * (y - x ** 2) - 2 * (1 - x), 200 * (y - x ** 2)))


def _uncoalesced_coordinate_grad(p, w):
    """One coordinate's gradient split over two entries of the same index (PyTorch's torture test)."""
    g = _rosenbrock_grad(p.detach())[w]
    idx = torch.tensor([[w, w]])
    vals = torch.stack([g / 4.0, g - g / 4.0]) if w == 0 else torch.stack([g - g / 4.0, g / 4.0])
    return torch.sparse_coo_tensor(idx, vals, (2,))


@pytest.mark.parametrize("maximize", [False, True])
def test_rosenbrock_with_uncoalesced_gradients_equals_sparseadam(maximize):
    start = torch.tensor([1.5, 1.5])
    finals = []
    for cls in OPTIMS:
        p = Parameter(start.clone())
        opt = cls([p], lr=4e-2, maximize=maximize)
        for i in range(1800):  # cyclic coordinate descent, as in PyTorch's test
            opt.zero_grad()
            p.grad = _uncoalesced_coordinate_grad(p, 1 - i % 2)
            opt.step()
        finals.append(p.detach().clone())
        _close(opt)
    assert torch.equal(finals[0], finals[1]), (finals[0], finals[1])
    if maximize:
        assert _rosenbrock(finals[1]) >= _rosenbrock(start)
    else:
        assert finals[1].dist(torch.ones(2)) <= start.dist(torch.ones(2))


# -- no-op steps ----------------------------------------------------------------------------------
@pytest.mark.parametrize("inp", list(INPUTS))
def test_step_without_gradients_or_with_an_empty_one_is_a_noop(inp):
    frozen = [torch.randn(2, 3) for _ in range(2)]  # requires_grad=False
    before = [t.clone() for t in frozen]
    opt = DiskSparseAdam(frozen, **INPUTS[inp]())
    assert opt.step(lambda: torch.tensor([1.0])).item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(frozen, before))
    opt.close()
    param = torch.randn(5, 1, requires_grad=True)
    old = param.detach().clone()
    opt = DiskSparseAdam([param], **INPUTS[inp]())
    # a multi-dimensional empty value tensor, with float indices, as PyTorch's case builds it
    param.grad = torch.sparse_coo_tensor(torch.empty(1, 0), torch.empty(0, 1), (5, 1))
    opt.step()
    assert torch.equal(param.detach(), old)
    opt.close()


# -- state dicts ------------------------------------------------------------------------------------
def _named(params, named):
    return [(f"name{i}", p) for i, p in enumerate(params)] if named else params


def _without_names(sd):
    sd = copy.deepcopy(sd)
    for g in sd["param_groups"]:
        g.pop("param_names", None)
    return sd


def _assert_state_dicts_equal(a, b):
    assert a.keys() == b.keys()
    assert a["param_groups"] == b["param_groups"] or all(
        {k: v for k, v in ga.items() if k != "lr"} == {k: v for k, v in gb.items() if k != "lr"}
        and torch.equal(torch.as_tensor(ga["lr"]), torch.as_tensor(gb["lr"]))
        for ga, gb in zip(a["param_groups"], b["param_groups"]))
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        sa, sb = a["state"][k], b["state"][k]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), key


@pytest.mark.parametrize("named1", [False, True], ids=["plain1", "named1"])
@pytest.mark.parametrize("named0", [False, True], ids=["plain0", "named0"])
@pytest.mark.parametrize("inp", list(INPUTS))
def test_state_dict_round_trip_is_deterministic(inp, named0, named1):
    make, _ = _linear_problem(4)
    torch.manual_seed(5)
    x = torch.randn(5)
    weight, bias = make()
    opt = DiskSparseAdam(_named([weight, bias], named0), **INPUTS[inp]())

    def fwd_bwd(o, w, b):
        o.zero_grad()
        (w.mv(x) + b).pow(2).sum().backward()
        _sparse_grads(w, b)

    for _ in range(10):
        fwd_bwd(opt, weight, bias)
        opt.step()
    weight_c, bias_c = Parameter(weight.detach().clone()), Parameter(bias.detach().clone())
    opt_c = DiskSparseAdam(_named([weight_c, bias_c], named1), **INPUTS[inp]())
    opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(10):
        fwd_bwd(opt, weight, bias)
        fwd_bwd(opt_c, weight_c, bias_c)
        opt.step()
        opt_c.step()
        assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c)
    _assert_state_dicts_equal(_without_names(opt.state_dict()), _without_names(opt_c.state_dict()))
    opt_c.param_groups.extend(opt_c.param_groups)
    assert (_without_names(opt.state_dict())["param_groups"][-1]
            == _without_names(opt_c.state_dict())["param_groups"][-1])
    opt.close()
    opt_c.close()


def _primed(inp, steps=3, named=False):
    params = [Parameter(torch.randn(2, 3)) for _ in range(2)]
    opt = DiskSparseAdam(_named(params, named), **INPUTS[inp]())
    for t in range(steps):
        for p in params:
            p.grad = torch.rand(2, 3, generator=torch.Generator().manual_seed(t)).to_sparse()
        opt.step()
    return opt


@pytest.mark.parametrize("named", [False, True])
@pytest.mark.parametrize("inp", list(INPUTS))
def test_saved_state_dict_loads_equal_with_weights_only(inp, named):
    opt = _primed(inp, named=named)
    sd = opt.state_dict()
    for weights_only in (False, True):
        f = io.BytesIO()
        torch.save(sd, f)
        f.seek(0)
        loaded = torch.load(f, weights_only=weights_only)
        _assert_state_dicts_equal(loaded, sd)
        assert loaded["param_groups"][0].get("param_names") == sd["param_groups"][0].get("param_names")
    opt.close()


@pytest.mark.parametrize("inp", list(INPUTS))
def test_loads_a_python_int_step_and_an_older_dict_without_maximize(inp):
    opt = _primed(inp)
    sd = copy.deepcopy(opt.state_dict())
    for st in sd["state"].values():
        st["step"] = int(st["step"])
    for g in sd["param_groups"]:
        del g["maximize"]
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["maximize"] is False
    opt.step()
    assert all(opt.state[p]["step"] == 4 for p in opt.param_groups[0]["params"])
    opt.close()


def test_load_state_dict_pre_hook_prepend_order_as_in_sparseadam():
    lrs = []
    for cls in OPTIMS:
        opt = cls([torch.rand(2, 3, requires_grad=True)])
        sd = opt.state_dict()
        opt.register_load_state_dict_pre_hook(lambda o, s: s["param_groups"][0].__setitem__("lr", 0.002))
        opt.load_state_dict(sd)

        def replace(o, s):
            s = copy.deepcopy(s)
            s["param_groups"][0]["lr"] = 0.003
            return s

        opt.register_load_state_dict_pre_hook(replace, prepend=True)
        opt.load_state_dict(sd)
        lrs.append(opt.param_groups[0]["lr"])
        _close(opt)
    assert lrs == [0.002, 0.002]


def test_global_and_local_step_hooks_run_in_sparseadams_order():
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    logs = []
    for cls in OPTIMS:
        params = [torch.tensor([1.0, 1.0])]
        opt, sgd, log = cls(params), torch.optim.SGD(params), []
        handles = [register_optimizer_step_pre_hook(lambda *a: log.append(0)),
                   register_optimizer_step_post_hook(lambda *a: log.append(5))]
        for o in (opt, sgd):
            handles += [o.register_step_pre_hook(lambda *a: log.append(1)),
                        o.register_step_post_hook(lambda *a: log.append(2))]
        try:
            opt.step()
            sgd.step()
            opt.step()
        finally:
            for h in handles:
                h.remove()
        opt.step()
        logs.append(log)
        _close(opt)
    assert logs[0] == logs[1] == [0, 1, 2, 5] * 3


@pytest.mark.parametrize("inp", list(INPUTS))
def test_deepcopy_has_the_same_public_attributes(inp):
    opt = _primed(inp)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        twin = copy.deepcopy(opt)
    public = functools.partial(lambda o: {k for k in vars(o) if not k.startswith("_")})
    assert public(opt) == public(twin)
    opt.close()
    twin.close()


@pytest.mark.parametrize("inp", list(INPUTS))
def test_state_is_not_empty_after_a_step(inp):
    model = torch.nn.Linear(5, 5)
    opt = DiskSparseAdam(model.parameters(), **INPUTS[inp]())
    model(torch.rand(2, 5)).sum().backward()
    _sparse_grads(*model.parameters())
    opt.step()
    assert len(opt.state) == 2 and all(len(s) > 0 for s in opt.state.values())
    opt.close()
