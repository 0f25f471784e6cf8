"""Gefen under the cases of PyTorch's optimizer test suite (``TestOptimRenewed`` with AdamW's
``OptimizerInfo``) that apply to its arguments on CPU, written here in our own words.

With ``share_second_moment=False, quantize_first_moment=False`` Gefen is AdamW, so those runs are
compared with ``torch.optim.AdamW`` fed the same gradients. The quantised default has no such
reference; for it the tests check invariants: bitwise state round trips, hooks, untouched
parameters without gradients, descent on a simple loss.

Not applicable here: CUDA-only cases (``test_state_dict_with_cuda_params``, capturable, fused
kernels, peak memory), AdamW-only keywords Gefen does not take (``amsgrad``, ``maximize``,
``foreach``, ``differentiable``, ``capturable``), and ``test_can_load_older_state_dict``
(it loads AdamW's own older formats; Gefen has a single state format).
"""

import copy
import io

import pytest
import torch

from optim import Gefen

BACKENDS = ["torch", "numba", "triton"]
ADAMW = dict(share_second_moment=False, quantize_first_moment=False)
SHAPES = [(5, 6), (5,), (300,)]


def _params(dtype=torch.float32, shapes=SHAPES):
    g = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]


def _twin(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]


def _set(params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()


def _tol(dtype):
    return dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)


def _assert_params_close(ours, ref, dtype=torch.float32):
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.detach(), q.detach(), **_tol(dtype))


def _assert_sd_equal(a, b):
    """Two state dicts equal: same structure, tensors bitwise (dtype included)."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _assert_sd_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_sd_equal(x, y)
    else:
        assert a == b


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ------------------------------------------------------------------ AdamW reduction cases
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_param_groups_different_lr_and_weight_decay(backend, dtype):
    """Groups with their own lr, weight_decay, betas and eps step as AdamW's groups do."""
    ours_p, ref_p = _params(dtype), None
    ref_p = _twin(ours_p)

    def groups(ps):
        return [{"params": ps[:1], "weight_decay": 0.1},
                {"params": ps[1:], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.99),
                 "eps": 1e-6}]

    ours = Gefen(groups(ours_p), lr=1e-2, backend=backend, **ADAMW)
    ref = torch.optim.AdamW(groups(ref_p), lr=1e-2)
    for t in range(8):
        grads = _grads(ours_p, t)
        _set(ours_p, grads), _set(ref_p, grads)
        ours.step(), ref.step()
    _assert_params_close(ours_p, ref_p, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lr_scheduler_steplr(backend):
    """StepLR changes ``group['lr']`` between steps; the update follows it as AdamW's does."""
    ours_p = _params()
    ref_p = _twin(ours_p)
    ours = Gefen(ours_p, lr=5e-2, weight_decay=0.1, backend=backend, **ADAMW)
    ref = torch.optim.AdamW(ref_p, lr=5e-2, weight_decay=0.1)
    s1 = torch.optim.lr_scheduler.StepLR(ours, step_size=2, gamma=0.3)
    s2 = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.3)
    for t in range(7):
        grads = _grads(ours_p, t)
        _set(ours_p, grads), _set(ref_p, grads)
        ours.step(), ref.step()
        s1.step(), s2.step()
    assert ours.param_groups[0]["lr"] == pytest.approx(ref.param_groups[0]["lr"])
    _assert_params_close(ours_p, ref_p)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_lr_with_scheduler(backend):
    """A 0-d tensor lr (AdamW accepts one without foreach/fused kernels) under ExponentialLR."""
    ours_p = _params()
    ref_p = _twin(ours_p)
    ours = Gefen(ours_p, lr=torch.tensor(1e-2), weight_decay=0.05, backend=backend, **ADAMW)
    ref = torch.optim.AdamW(ref_p, lr=torch.tensor(1e-2), weight_decay=0.05, foreach=False)
    s1 = torch.optim.lr_scheduler.ExponentialLR(ours, gamma=0.7)
    s2 = torch.optim.lr_scheduler.ExponentialLR(ref, gamma=0.7)
    for t in range(5):
        grads = _grads(ours_p, t)
        _set(ours_p, grads), _set(ref_p, grads)
        ours.step(), ref.step()
        s1.step(), s2.step()
    assert torch.is_tensor(ours.param_groups[0]["lr"])
    _assert_params_close(ours_p, ref_p)


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_with_closure_returns_loss(backend):
    """``step(closure)`` evaluates the closure with grad enabled and returns its loss."""
    x = torch.randn(16, 6)
    y = torch.randn(16, 5)

    def make():
        torch.manual_seed(3)
        return torch.nn.Linear(6, 5)

    m1, m2 = make(), make()
    ours = Gefen(m1.parameters(), lr=1e-2, weight_decay=0.1, backend=backend, **ADAMW)
    ref = torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1)

    def closure(m, opt):
        def f():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            return loss
        return f

    for _ in range(5):
        l1 = ours.step(closure(m1, ours))
        l2 = ref.step(closure(m2, ref))
        torch.testing.assert_close(l1, l2, atol=1e-6, rtol=1e-6)
    _assert_params_close(list(m1.parameters()), list(m2.parameters()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_add_param_group_later(backend):
    """A group added after some steps starts from fresh state, as in AdamW."""
    ours_p = _params()
    ref_p = _twin(ours_p)
    ours = Gefen(ours_p[:2], lr=1e-2, weight_decay=0.1, backend=backend, **ADAMW)
    ref = torch.optim.AdamW(ref_p[:2], lr=1e-2, weight_decay=0.1)
    for t in range(6):
        if t == 3:
            ours.add_param_group({"params": ours_p[2:], "lr": 2e-3})
            ref.add_param_group({"params": ref_p[2:], "lr": 2e-3})
        n = 2 if t < 3 else 3
        grads = _grads(ours_p, t)[:n]
        _set(ours_p[:n], grads), _set(ref_p[:n], grads)
        ours.step(), ref.step()
    assert ours.param_groups[1]["weight_decay"] == ref.param_groups[1]["weight_decay"]
    _assert_params_close(ours_p, ref_p)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_grad_from_empty_batch(backend):
    """An empty batch gives all-zero gradients; the step runs and matches AdamW's."""
    def make():
        torch.manual_seed(4)
        return torch.nn.Conv1d(8, 6, 3)

    m1, m2 = make(), make()
    ours = Gefen(m1.parameters(), lr=1e-2, weight_decay=0.1, backend=backend, **ADAMW)
    ref = torch.optim.AdamW(m2.parameters(), lr=1e-2, weight_decay=0.1)
    for batch in (0, 0, 4):
        x = torch.randn(batch, 8, 10)
        for m, opt in ((m1, ours), (m2, ref)):
            opt.zero_grad()
            m(x).sum().backward()
            opt.step()
    _assert_params_close(list(m1.parameters()), list(m2.parameters()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "quantised"])
def test_state_dict_deterministic_round_trip(backend, adamw):
    """Save after 3 steps through torch.save/torch.load(weights_only=True), load into a fresh
    optimizer over copies of the parameters: the next steps are bitwise those of the original,
    and the loaded optimizer's state dict is the saved one."""
    kw = ADAMW if adamw else {}
    p1 = _params()
    o1 = Gefen(p1, lr=1e-2, weight_decay=0.1, backend=backend, **kw)
    for t in range(3):
        _set(p1, _grads(p1, t))
        o1.step()
    saved = o1.state_dict()
    loaded = _roundtrip(saved)
    p2 = _twin(p1)
    o2 = Gefen(p2, lr=0.5, weight_decay=0.0, backend=backend, **kw)  # groups come from the dict
    o2.load_state_dict(loaded)
    _assert_sd_equal(o2.state_dict(), saved)
    for t in range(3, 6):
        grads = _grads(p1, t)
        _set(p1, grads), _set(p2, grads)
        o1.step(), o2.step()
    for a, b in zip(p1, p2):
        assert torch.equal(a, b)
    _assert_sd_equal(o2.state_dict(), o1.state_dict())


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_matches_adamw_continuation(backend):
    """A Gefen run split by a state-dict round trip still follows AdamW's unsplit run."""
    p1 = _params()
    ref_p = _twin(p1)
    o1 = Gefen(p1, lr=1e-2, weight_decay=0.1, backend=backend, **ADAMW)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, weight_decay=0.1)
    for t in range(3):
        grads = _grads(p1, t)
        _set(p1, grads), _set(ref_p, grads)
        o1.step(), ref.step()
    p2 = _twin(p1)
    o2 = Gefen(p2, backend=backend, **ADAMW)
    o2.load_state_dict(_roundtrip(o1.state_dict()))
    for t in range(3, 6):
        grads = _grads(p2, t)
        _set(p2, grads), _set(ref_p, grads)
        o2.step(), ref.step()
    _assert_params_close(p2, ref_p)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deepcopy_steps_like_original(backend):
    """``copy.deepcopy`` gives an independent optimizer that continues as the original."""
    p1 = _params()
    o1 = Gefen(p1, lr=1e-2, backend=backend)
    _set(p1, _grads(p1, 0))
    o1.step()
    o2 = copy.deepcopy(o1)
    p2 = o2.param_groups[0]["params"]
    assert all(a is not b for a, b in zip(p1, p2))
    for t in range(1, 3):
        grads = _grads(p1, t)
        _set(p1, grads), _set(p2, grads)
        o1.step(), o2.step()
    for a, b in zip(p1, p2):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ invariants, every mode
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "quantised"])
def test_params_without_grad_are_skipped(backend, adamw):
    """A parameter whose grad is None is not changed (not even by weight decay) and gets no
    state; the others step. A step where no parameter has a gradient changes nothing."""
    kw = ADAMW if adamw else {}
    ps = _params()
    before = [p.detach().clone() for p in ps]
    opt = Gefen(ps, lr=1e-2, weight_decay=0.1, backend=backend, **kw)
    opt.step()
    assert len(opt.state) == 0
    for p, b in zip(ps, before):
        assert torch.equal(p, b)
    for t in range(3):
        _set(ps, [g if i != 1 else None for i, g in enumerate(_grads(ps, t))])
        opt.step()
    assert ps[1] not in opt.state and torch.equal(ps[1], before[1])
    assert ps[0] in opt.state and not torch.equal(ps[0], before[0])
    if adamw:  # the same as AdamW over the parameters that had gradients
        ref_p = [torch.nn.Parameter(b.clone()) for b in before]
        ref = torch.optim.AdamW(ref_p, lr=1e-2, weight_decay=0.1)
        for t in range(3):
            _set(ref_p, [g if i != 1 else None for i, g in enumerate(_grads(ref_p, t))])
            ref.step()
        _assert_params_close(ps, ref_p)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(backend, set_to_none):
    """zero_grad drops gradients or zeroes them in place, as torch's Optimizer does."""
    ps = _params()
    opt = Gefen(ps, backend=backend)
    _set(ps, _grads(ps, 0))
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    for p in ps:
        if set_to_none:
            assert p.grad is None
        else:
            assert p.grad is not None and not p.grad.any()
    # zeroed gradients with no weight decay: m and v decay, but a step still moves p as AdamW's
    # would; a step with None gradients moves nothing
    before = [p.detach().clone() for p in ps]
    opt.step()
    if set_to_none:
        for p, b in zip(ps, before):
            assert torch.equal(p, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_first_gradients_leave_params_alone_without_decay(backend):
    """With m = v = 0, AdamW's update at g = 0 is zero: the quantised default leaves the
    parameters unchanged over all-zero first gradients, then steps once real ones arrive."""
    ps = _params()
    before = [p.detach().clone() for p in ps]
    opt = Gefen(ps, lr=1e-2, backend=backend)
    for _ in range(2):
        _set(ps, [torch.zeros_like(p) for p in ps])
        opt.step()
    for p, b in zip(ps, before):
        assert torch.equal(p, b)
    _set(ps, _grads(ps, 0))
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(ps, before))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "quantised"])
def test_goes_right_direction(backend, adamw):
    """Minimising a quadratic lowers it, with and without a StepLR schedule."""
    kw = ADAMW if adamw else {}
    torch.manual_seed(5)
    w = torch.nn.Parameter(torch.randn(10, 5))
    b = torch.nn.Parameter(torch.randn(10))
    x = torch.randn(5)
    opt = Gefen([{"params": [w]}, {"params": [b], "lr": 5e-2}], lr=5e-2, backend=backend, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)

    def loss():
        return (w @ x + b).pow(2).sum()

    first = float(loss().detach())
    for _ in range(10):
        opt.zero_grad()
        loss().backward()
        opt.step()
        sched.step()
    assert float(loss().detach()) < first


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_pre_and_post_hooks(backend):
    """Step pre/post hooks run around every step, in order, and can be removed."""
    ps = _params()
    opt = Gefen(ps, backend=backend)
    calls = []
    h1 = opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o is opt)))
    h2 = opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o is opt)))
    for t in range(2):
        _set(ps, _grads(ps, t))
        opt.step()
    assert calls == [("pre", True), ("post", True)] * 2
    h1.remove(), h2.remove()
    opt.step()
    assert len(calls) == 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_global_optimizer_step_hooks(backend):
    """torch.optim's process-wide step hooks see Gefen's steps too."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )
    ps = _params()
    opt = Gefen(ps, backend=backend)
    seen = []
    h1 = register_optimizer_step_pre_hook(lambda o, a, k: seen.append("pre") if o is opt else None)
    h2 = register_optimizer_step_post_hook(lambda o, a, k: seen.append("post") if o is opt else None)
    try:
        _set(ps, _grads(ps, 0))
        opt.step()
    finally:
        h1.remove(), h2.remove()
    assert seen == ["pre", "post"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_pre_and_post_hooks(backend):
    """A state-dict pre-hook can add to the state and a post-hook can edit the result."""
    ps = _params()
    opt = Gefen(ps, backend=backend)
    _set(ps, _grads(ps, 0))
    opt.step()

    def pre(o):
        o.state["extra"] = torch.tensor([1, 2, 3])

    def post(o, sd):
        sd["ran_pre"] = sd["state"].pop("extra", None) is not None
        # the post-hook sees the dict state_dict() returns, codebook included, and its edits last
        sd["saw_codebook"] = torch.equal(sd["codebook"], o.codebook)
        sd["codebook"] = sd["codebook"].double()
        return sd

    opt.register_state_dict_pre_hook(pre)
    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert sd["ran_pre"] is True and "extra" not in sd["state"]
    assert sd["saw_codebook"] is True and sd["codebook"].dtype == torch.float64


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "quantised"])
def test_load_state_dict_pre_and_post_hooks(backend, adamw):
    """Load pre-hooks run before anything is read, in order, and a returned dict replaces the
    argument (group settings and state alike); post-hooks run once loading is complete."""
    kw = ADAMW if adamw else {}
    ps = _params()
    opt = Gefen(ps, lr=1e-2, backend=backend, **kw)
    _set(ps, _grads(ps, 0))
    opt.step()
    sd = opt.state_dict()

    def pre1(o, d):
        d["param_groups"][0]["lr"] = 0.002

    def pre2(o, d):
        d = copy.deepcopy(d)
        assert d["param_groups"][0]["lr"] == 0.002  # pre1 ran first
        d["param_groups"][0]["lr"] = 0.003
        d["state"][0]["step"] = 7  # a hook may rewrite the state (say, an older format)
        return d

    seen = {}

    def post(o):
        seen["lr"] = o.param_groups[0]["lr"]
        seen["step"] = o.state[o.param_groups[0]["params"][0]]["step"]
        seen["codebook"] = None if o.codebook is None else o.codebook.clone()

    other = Gefen(_twin(ps), backend=backend, **kw)
    other.register_load_state_dict_pre_hook(pre1)
    other.register_load_state_dict_pre_hook(pre2)
    other.register_load_state_dict_post_hook(post)
    other.load_state_dict(sd)
    assert seen["lr"] == 0.003 and other.param_groups[0]["lr"] == 0.003
    assert seen["step"] == 7 and other.state[other.param_groups[0]["params"][0]]["step"] == 7
    if adamw:
        assert seen["codebook"] is None
    else:
        assert torch.equal(seen["codebook"], opt.codebook)


@pytest.mark.parametrize("backend", BACKENDS)
def test_optimizer_can_be_printed(backend):
    """repr names the class and every group's settings, as torch's Optimizer repr does."""
    ps = _params()
    opt = Gefen([{"params": ps[:1]}, {"params": ps[1:], "lr": 3e-3}], lr=1e-2,
                weight_decay=0.1, backend=backend)
    text = repr(opt)
    assert text.startswith("Gefen (")
    assert "Parameter Group 0" in text and "Parameter Group 1" in text
    for key in ("lr: 0.01", "lr: 0.003", "weight_decay: 0.1", "betas: (0.9, 0.999)", "eps: 1e-08"):
        assert key in text


# ------------------------------------------------------------------ argument errors
def test_empty_params_raise_value_error_like_adamw():
    with pytest.raises(ValueError) as ours:
        Gefen([])
    with pytest.raises(ValueError) as ref:
        torch.optim.AdamW([])
    assert str(ours.value) == str(ref.value)


def test_single_tensor_params_raise_type_error_like_adamw():
    t = torch.zeros(3, requires_grad=True)
    with pytest.raises(TypeError):
        torch.optim.AdamW(t)
    with pytest.raises(TypeError):
        Gefen(t)


def test_complex_params_refused_clearly():
    """Complex parameters are refused at construction and in add_param_group, pointing to
    view_as_real, rather than stepping wrongly."""
    z = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="complex"):
        Gefen([z])
    opt = Gefen(_params())
    with pytest.raises(ValueError, match="view_as_real"):
        opt.add_param_group({"params": [z]})


@pytest.mark.parametrize("kwargs", [dict(lr=-1.0), dict(betas=(1.0, 0.999)), dict(betas=(0.9, -0.1)),
                                    dict(eps=-1e-8), dict(weight_decay=-0.1)])
def test_invalid_arguments_raise_value_error_like_adamw(kwargs):
    with pytest.raises(ValueError):
        torch.optim.AdamW(_params(), **kwargs)
    with pytest.raises(ValueError):
        Gefen(_params(), **kwargs)


def test_upstream_keywords_accepted():
    """``fused`` and ``verbose`` (AdamW's and upstream Gefen's keywords) are accepted."""
    ps = _params()
    opt = Gefen(ps, fused=False, verbose=False)
    _set(ps, _grads(ps, 0))
    opt.step()
    assert opt.backend == "torch"
