"""Gefen inside the idioms of training frameworks, each against ``torch.optim.AdamW`` or eager Gefen.

A training step under ``torch.compile``, AdamW's keywords in a configuration written for AdamW,
a re-creation from ``state_dict()["param_groups"][0]`` (PyKEEN), a model moved after the optimizer
was built (transformers' ``Trainer``, stood in for on CPU by a model built on ``meta``). The real
frameworks are in ``tests/test_integration.py``.
"""

import pytest
import torch
import torch.nn as nn

from optim import Gefen, GefenLayout
from optim.gefen.layout import FIELDS
from tests.utils import ADAMW, tiny_mlp, train_steps


@pytest.mark.parametrize("bits", [8, 4])
def test_a_compiled_training_step_equals_the_eager_one(bits):
    """The step chooses blocks and learns the codebook from data: it runs eagerly inside a compiled
    training step, which then equals the eager run bit for bit."""
    eager, compiled = tiny_mlp(), tiny_mlp()
    losses_e = train_steps(eager, Gefen(eager.parameters(), layout="published", lr=1e-2, bits=bits), 4)
    losses_c = train_steps(compiled, Gefen(compiled.parameters(), layout="published", lr=1e-2, bits=bits), 4,
                           compiled=True)
    assert losses_e == losses_c
    assert all(torch.equal(a, b) for a, b in zip(eager.parameters(), compiled.parameters()))


@pytest.mark.parametrize("backend", ["torch", "numba", "triton"])
def test_maximize_is_adamws(backend):
    ours, ref = tiny_mlp(), tiny_mlp()
    kw = dict(lr=1e-2, weight_decay=0.1, maximize=True)
    train_steps(ours, Gefen(ours.parameters(), backend=backend, **kw, **ADAMW), 5)
    train_steps(ref, torch.optim.AdamW(ref.parameters(), **kw), 5)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_maximize_with_codes_is_the_step_of_the_negated_loss():
    """Quantised Gefen maximizing f takes the steps that minimizing -f takes, bit for bit, and leaves
    the gradients as backward made them."""
    up, down = tiny_mlp(), tiny_mlp()
    x = torch.randn(8, 16)
    opt_up = Gefen(up.parameters(), layout="published", lr=1e-2, maximize=True)
    opt_down = Gefen(down.parameters(), layout="published", lr=1e-2)
    for _ in range(4):
        for model, opt, sign in ((up, opt_up, 1.0), (down, opt_down, -1.0)):
            opt.zero_grad()
            (sign * model(x).pow(2).mean()).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            opt.step()
            assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(up.parameters(), down.parameters()))


def test_a_recreation_from_param_groups_keeps_every_option():
    """PyKEEN re-creates the optimizer as ``type(opt)(params, **param_groups[0] minus params)``; Gefen's
    layout fields in the group make its ``layout`` record."""
    model = tiny_mlp()
    opt = Gefen(model.parameters(), lr=3e-3, bits=4, backend="torch",
                layout=GefenLayout(block_rule="variance_drop", factor_second_moment=True),
                maximize=True, weight_decay=0.1)
    kwargs = {k: v for k, v in opt.state_dict()["param_groups"][0].items() if k != "params"}
    twin = Gefen(model.parameters(), layout=GefenLayout(**{k: kwargs.pop(k) for k in FIELDS}), **kwargs)
    assert (twin.bits, twin.backend, twin.block_rule) == (4, "torch", "variance_drop")
    assert twin.defaults == opt.defaults
    with pytest.raises(ValueError, match="bits"):
        opt.add_param_group(dict(params=[nn.Parameter(torch.randn(3))], bits=8))
    assert len(opt.param_groups) == 1


def test_a_model_materialised_after_the_optimizer_trains_as_adamw():
    """transformers' Trainer moves the model after the optimizer is built; on CPU the stand-in is a
    model built on ``meta`` and materialised in place (the same Parameter objects)."""
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with torch.device("meta"):
            model = tiny_mlp()
        opt = Gefen(model.parameters(), lr=1e-2, weight_decay=0.01, **ADAMW)
        model.to_empty(device="cpu")
        ref = tiny_mlp()
        model.load_state_dict(ref.state_dict())
        train_steps(model, opt, 3)
        train_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 3)
        assert all(opt.backend_of(p) in ("numba", "torch") for p in model.parameters())
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


def test_meta_parameters_left_behind_by_to_empty_are_refused_at_the_step():
    """``module.to_empty`` (without swapping) gives the module new Parameters: an optimizer built
    on the meta model holds dead ones and would train nothing. Its first step says so."""
    with torch.device("meta"):
        model = tiny_mlp()
    opt = Gefen(model.parameters(), layout="published", lr=1e-2)
    model.to_empty(device="cpu")
    model.load_state_dict(tiny_mlp().state_dict())
    assert not any(p.is_meta for p in model.parameters())
    model(torch.randn(8, 16)).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="build the optimizer after to_empty"):
        opt.step()
