"""Gefen's step plan (``optim/gefen/plan.py``) never outlives what it describes.

Each test changes what a plan was built for between two steps (the parameter's data replaced,
resized or cast; a gradient that appears or disappears; a group added; options edited in place;
a state dict loaded; state replaced) and checks the next steps against an independent reference:
``torch.optim.AdamW`` stepping the same parameters through the same changes (Gefen with
``share_second_moment=False, quantize_first_moment=False`` is AdamW: max |Δ| <= 1e-6, as in
tests/test_gefen_optimizer.py), or a clear error naming the parameter. A stale plan would step the
old storage (the parameter unchanged), skip a parameter, or launch on a buffer of another size.
"""

import pytest
import torch

from optim import Gefen
from optim.backends import numba_available
from optim.gefen import state as K
from tests.utils import assert_close, set_grads

ADAMW = dict(layout="adamw")
SHAPES = [(24, 48), (7, 13), (300,), (64, 64)]
BACKENDS = ["torch", pytest.param("numba", marks=pytest.mark.skipif(not numba_available(), reason="no numba")),
            "triton"]


def _pair(backend, lr=1e-2, wd=0.1, shapes=SHAPES):
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = Gefen(params, lr=lr, weight_decay=wd, backend=backend, **ADAMW)
    ref = torch.optim.AdamW(twins, lr=lr, weight_decay=wd, foreach=False)
    return params, twins, ours, ref


def _step_both(params, twins, ours, ref, skip=(), times=1):
    """``times`` steps of both on the same fresh gradients; parameters in ``skip`` get none."""
    for _ in range(times):
        grads = [None if i in skip else torch.randn(p.shape) for i, p in enumerate(params)]
        for ps in (params, twins):
            for p, g in zip(ps, grads):
                p.grad = None if g is None else g.clone()
        ours.step()
        ref.step()


def _assert_same(params, twins, what):
    for i, (p, q) in enumerate(zip(params, twins)):
        assert_close(p.detach(), q.detach(), atol=1e-6, name=f"{what}: parameter {i}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_replaced_data_is_stepped_not_the_old_storage(backend):
    params, twins, ours, ref = _pair(backend)
    _step_both(params, twins, ours, ref, times=3)
    for p, q in zip(params, twins):  # new storage, same shape: the plan's addresses are stale
        new = torch.randn(p.shape)
        p.data, q.data = new, new.clone()
    _step_both(params, twins, ours, ref, times=3)
    _assert_same(params, twins, "after p.data was replaced")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_that_come_and_go_skip_exactly_those_parameters(backend):
    params, twins, ours, ref = _pair(backend)
    for skip in [(), (1,), (), (0, 3), (2,), (), (), (1, 2, 3), ()]:
        _step_both(params, twins, ours, ref, skip=skip)
        _assert_same(params, twins, f"skipping {skip}")
    assert [ours.state[p][K.STEP] for p in params] == [int(ref.state[q]["step"]) for q in twins]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_group_added_later_is_stepped(backend):
    params, twins, ours, ref = _pair(backend)
    _step_both(params, twins, ours, ref, times=2)
    extra = torch.nn.Parameter(torch.randn(33, 5))
    twin = torch.nn.Parameter(extra.detach().clone())
    ours.add_param_group({"params": [extra], "lr": 3e-3})
    ref.add_param_group({"params": [twin], "lr": 3e-3})
    params, twins = params + [extra], twins + [twin]
    _step_both(params, twins, ours, ref, times=3)
    _assert_same(params, twins, "after add_param_group")


@pytest.mark.parametrize("backend", BACKENDS)
def test_options_edited_in_place_take_effect_at_the_next_step(backend):
    params, twins, ours, ref = _pair(backend)
    for lr, wd, betas in [(1e-2, 0.1, (0.9, 0.999)), (3e-2, 0.0, (0.8, 0.99)), (1e-3, 0.5, (0.9, 0.9))]:
        for opt in (ours, ref):
            opt.param_groups[0].update(lr=lr, weight_decay=wd, betas=betas)
        _step_both(params, twins, ours, ref, times=2)
    _assert_same(params, twins, "after lr, weight_decay and betas changed")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_loaded_state_dict_is_what_the_next_step_reads(backend):
    params, twins, ours, ref = _pair(backend)
    _step_both(params, twins, ours, ref, times=2)
    saved, saved_ref = ours.state_dict(), ref.state_dict()
    weights = [p.detach().clone() for p in params]
    _step_both(params, twins, ours, ref, times=3)  # steps the load undoes (the plan was built on their state)
    ours.load_state_dict(saved)
    ref.load_state_dict(saved_ref)
    with torch.no_grad():
        for p, q, w in zip(params, twins, weights):
            p.copy_(w)
            q.copy_(w)
    _step_both(params, twins, ours, ref, times=3)
    _assert_same(params, twins, "after load_state_dict")


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_in_another_order_of_parameters_keeps_their_steps(backend):
    """Plans for several sets of gradients at once: the parameters' steps part and join again."""
    params, twins, ours, ref = _pair(backend)
    for skip in [(), (0,), (1, 2, 3), (), (0,), (1, 2, 3), ()]:
        _step_both(params, twins, ours, ref, skip=skip)
    _assert_same(params, twins, "alternating sets of gradients")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["resized", "reshaped_bigger"])
def test_a_resized_parameter_is_refused_by_name(backend, how):
    p = torch.nn.Parameter(torch.randn(64, 32))
    opt = Gefen([torch.nn.Parameter(torch.randn(8)), p], layout="published", backend=backend)
    for q in opt.param_groups[0]["params"]:
        q.grad = torch.randn(q.shape)
    opt.step()
    p.data = torch.randn(32, 32) if how == "resized" else torch.randn(128, 32)
    p.grad = torch.randn(p.shape)
    with pytest.raises((ValueError, RuntimeError), match="parameter 1 of group 0"):
        opt.step()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_parameter_cast_after_the_plan_is_stepped_in_its_new_dtype(backend):
    """fp32 -> bf16 between steps: the bf16 tensor is updated (a stale plan would write fp32 values
    through the old storage's address and leave it unchanged)."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64))]
    opt = Gefen(ps, layout="published", lr=1e-2, backend=backend)
    for _ in range(2):
        set_grads(ps, [torch.randn(p.shape) for p in ps])
        opt.step()
    ps[0].data = ps[0].data.bfloat16()
    before = ps[0].detach().clone()
    set_grads(ps, [torch.randn(p.shape, dtype=p.dtype) for p in ps])
    opt.step()
    assert ps[0].dtype == torch.bfloat16
    assert (ps[0].detach() != before).float().mean() > 0.5, "the cast parameter was not stepped"
    assert opt.state[ps[0]][K.STEP] == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_steps_reuse_one_plan(backend):
    """After the first step the plan is built once: the same set of gradients finds it."""
    params, twins, ours, ref = _pair(backend)
    _step_both(params, twins, ours, ref, times=4)
    assert len(ours._plans) == 1
    _assert_same(params, twins, "four steps on one plan")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_that_change_layout_between_steps(backend):
    """A transposed (non-contiguous) gradient one step, a contiguous one the next: a plan made for
    one layout is never launched on the other (a kernel reading the strided one by address would
    step the transpose)."""
    params, twins, ours, ref = _pair(backend, shapes=[(16, 16), (24, 24), (50,)])
    for strided in [False, True, True, False, True, False]:
        grads = [torch.randn(p.shape) for p in params]
        if strided:
            grads = [g.t().contiguous().t() if g.dim() == 2 else g for g in grads]
        for ps in (params, twins):
            for p, g in zip(ps, grads):
                p.grad = g.clone() if not strided else g.t().clone().t()
        assert params[0].grad.is_contiguous() != strided
        ours.step()
        ref.step()
        _assert_same(params, twins, f"strided={strided}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("option", ["quantize_first_moment", "factor_second_moment", "share_second_moment"])
def test_a_state_option_flipped_in_place_is_refused_by_name(backend, option):
    """An option that decides the state's layout, edited in the group after the state was made, is
    refused naming the parameter (never a kernel on state of another layout)."""
    ps = [torch.nn.Parameter(torch.randn(32, 64)), torch.nn.Parameter(torch.randn(64))]
    opt = Gefen(ps, layout="published", backend=backend)
    row_scaled = torch.randn(32, 64) * torch.exp(2 * torch.randn(32, 1))  # rows of other scales: blocks > 1
    set_grads(ps, [row_scaled, torch.randn(64)])
    opt.step()
    assert opt.state[ps[0]][K.BLOCK] > 1
    opt.param_groups[0][option] = not opt.param_groups[0][option]
    set_grads(ps, [torch.randn(p.shape) for p in ps])
    with pytest.raises(ValueError, match="parameter 0 of group 0"):
        opt.step()


@pytest.mark.parametrize("backend", BACKENDS)
def test_maximize_and_rounding_flipped_in_place_take_effect(backend):
    """Options that leave the state's layout alone are read at the next step: maximize flipped on
    and off steps as AdamW with maximize flipped the same way."""
    params, twins, ours, ref = _pair(backend)
    for flag in (False, True, True, False):
        for opt in (ours, ref):
            opt.param_groups[0]["maximize"] = flag
        _step_both(params, twins, ours, ref)
        _assert_same(params, twins, f"maximize={flag}")
