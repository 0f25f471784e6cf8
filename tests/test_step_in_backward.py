"""step_in_backward against the ordinary loop ``backward(); step(); zero_grad()`` as the reference.

Both runs execute the same kernels on the same gradients, one parameter per call instead of all
at once, so weights and state must match bitwise.
"""

import copy
import warnings

import pytest
import torch
import torch.nn as nn

from experiments.harness.peak import PeakMemory
from optim import DiskSparseAdam, DiskSparseRiemannianAdam, Gefen, step_in_backward
from optim.backends import numba_available

STEPS = 4


def mlp(widths=(12, 16, 16, 8, 1)):
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def batches(n=STEPS, rows=6, cols=12):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(rows, cols, generator=g) for _ in range(n)]


def loss_of(model, x):
    return model(x).pow(2).mean()


def ordinary(model, opt, data, sched=None):
    for x in data:
        loss_of(model, x).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def fused(model, opt, data, sched=None):
    with step_in_backward(opt):
        for x in data:
            loss_of(model, x).backward()
            assert all(p.grad is None for p in model.parameters())
            if sched is not None:
                sched.step()


def assert_same(model_a, opt_a, model_b, opt_b):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), f"{name} differs"
        sa, sb = opt_a.state[a], opt_b.state[b]
        assert sa.keys() == sb.keys(), name
        for k in sa:
            va, vb = sa[k], sb[k]
            same = torch.equal(va, vb) if torch.is_tensor(va) else va == vb
            assert same, f"state {k!r} of {name} differs"


def twin(make_opt):
    model = mlp()
    other = copy.deepcopy(model)
    return model, make_opt(model.parameters()), other, make_opt(other.parameters())


OPTIMIZERS = [
    pytest.param(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), id="AdamW"),
    pytest.param(lambda ps: torch.optim.Adam(ps, lr=1e-2), id="Adam"),
    pytest.param(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True), id="SGD-momentum"),
    pytest.param(lambda ps: Gefen(ps, layout="published", lr=1e-2, weight_decay=0.1, backend="torch"),
                 id="Gefen-torch"),
    pytest.param(lambda ps: Gefen(ps, lr=1e-2, bits=4, layout="factored", backend="torch"),
                 id="Gefen-torch-4bit-factored"),
    pytest.param(lambda ps: Gefen(ps, layout="published", lr=1e-2, weight_decay=0.1, backend="numba"), id="Gefen-numba",
                 marks=pytest.mark.skipif(not numba_available(), reason="numba is not installed")),
]


@pytest.mark.parametrize("make_opt", OPTIMIZERS)
def test_matches_the_ordinary_loop_bitwise(make_opt):
    ref_model, ref_opt, model, opt = twin(make_opt)
    data = batches()
    ordinary(ref_model, ref_opt, data)
    fused(model, opt, data)
    assert_same(ref_model, ref_opt, model, opt)
    if isinstance(opt, Gefen):
        assert torch.equal(ref_opt.codebook, opt.codebook)


def test_gefen_first_step_holds_every_gradient_until_backward_ends():
    """The codebook is learned from all gradients: the first backward keeps them until it ends,
    learns the codebook from all n, then steps (and frees) one parameter at a time, as the hooks
    of later backwards do."""
    model = mlp()
    opt = Gefen(model.parameters(), layout="published", lr=1e-2, backend="torch")
    seen, learned = [], []
    params = list(model.parameters())
    opt.register_step_post_hook(lambda o, a, k: seen.append(sum(p.grad is not None for p in params)))
    learn = opt.learn_from_gradients

    def counting_learn():
        learned.append((sum(p.grad is not None for p in params), len(seen)))
        learn()

    opt.learn_from_gradients = counting_learn
    n = len(params)
    with step_in_backward(opt):
        assert opt.needs_every_gradient()
        for x in batches(3):
            loss_of(model, x).backward()
            assert all(p.grad is None for p in params)
        assert not opt.needs_every_gradient()
    assert learned == [(n, 0)]  # once, before any step, with every gradient
    assert seen == [1] * (3 * n)  # one step per parameter, the first backward's too


def test_gefen_first_step_in_backward_frees_each_gradient_after_its_step():
    """The first step's peak: weights and gradients, plus one parameter's new state at a time, well
    under the ordinary step's weights + gradients + all of the state (12 equal layers: one is a
    twelfth of the state). Width 512: the codebook's own fixed temporaries are small beside it."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(12)])
    opt = Gefen(model.parameters(), layout="published", lr=1e-2, backend="torch")
    params = list(model.parameters())
    weights = grads = sum(p.numel() * p.element_size() for p in params)
    with step_in_backward(opt):
        with PeakMemory(params, opt) as first:
            model(torch.randn(4, 512)).pow(2).mean().backward()
    state = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                if torch.is_tensor(t))
    assert state > 0.2 * weights  # 8-bit codes and scales: about a quarter of fp32 weights
    assert first.tensor_peak <= weights + grads + 0.5 * state, (first.tensor_peak, weights, state)


@pytest.mark.parametrize("cls", [DiskSparseAdam, DiskSparseRiemannianAdam], ids=lambda c: c.__name__)
def test_disk_sparse_with_sparse_embedding_gradients(cls, tmp_path):
    def run(emb, opt, data, hooked):
        if hooked:
            handle = step_in_backward(opt)
        for idx in data:
            emb(idx).pow(2).sum().backward()  # small loss: rows stay inside the ball
            if not hooked:
                opt.step()
                opt.zero_grad()
        if hooked:
            assert emb.weight.grad is None
            handle.remove()

    emb_ref = nn.Embedding(50, 4, sparse=True)
    with torch.no_grad():
        emb_ref.weight.uniform_(-0.1, 0.1)  # inside the Poincaré ball
    emb = copy.deepcopy(emb_ref)
    g = torch.Generator().manual_seed(2)
    data = [torch.randint(0, 50, (7,), generator=g) for _ in range(STEPS)]  # duplicates included
    with cls(emb_ref.parameters(), lr=0.1, state_dir=tmp_path / "ref") as ref_opt, \
         cls(emb.parameters(), lr=0.1, state_dir=tmp_path / "fused") as opt:
        run(emb_ref, ref_opt, data, hooked=False)
        run(emb, opt, data, hooked=True)
        assert torch.equal(emb_ref.weight, emb.weight)
        a, b = ref_opt.state_dict()["state"][0], opt.state_dict()["state"][0]
        for k in a:
            assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])), k


@pytest.mark.parametrize("scheduler_first", [True, False], ids=["scheduler-first", "scheduler-after"])
@pytest.mark.parametrize("make_sched", [
    pytest.param(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5), id="StepLR"),
    pytest.param(lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1.0 / (1 + t)), id="LambdaLR"),
])
def test_lr_schedulers_change_the_rate_the_hooks_use(make_sched, scheduler_first):
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    ref_model, ref_opt, model, opt = twin(make)
    data = batches()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would fail here
        ordinary(ref_model, ref_opt, data, make_sched(ref_opt))
        if scheduler_first:
            sched = make_sched(opt)
            fused(model, opt, data, sched)
        else:
            handle = step_in_backward(opt)
            sched = make_sched(opt)
            for x in data:
                loss_of(model, x).backward()
                sched.step()
            handle.remove()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert_same(ref_model, ref_opt, model, opt)


def test_refuses_a_step_by_hand_and_a_closure():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    with step_in_backward(opt):
        with pytest.raises(RuntimeError, match=r"step\(\) was called while step_in_backward is installed"):
            opt.step()
        with pytest.raises(RuntimeError, match=r"step\(closure\).*closure cannot be re-evaluated"):
            opt.step(lambda: loss_of(model, batches(1)[0]))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # its wrapper refuses too
        with pytest.raises(RuntimeError, match="called while step_in_backward is installed"):
            opt.step()
        del sched


def test_refuses_installing_twice():
    opt = torch.optim.SGD(mlp().parameters(), lr=0.1)
    handle = step_in_backward(opt)
    with pytest.raises(RuntimeError, match="already run in backward"):
        step_in_backward(opt)
    handle.remove()
    step_in_backward(opt).remove()  # after remove() it may be installed again


@pytest.mark.parametrize("stale", ["unstepped-backward", "zero_grad-not-none"])
def test_refuses_gradient_accumulation(stale):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = batches(1)[0]
    loss_of(model, x).backward()  # a gradient from before: it would be added to
    if stale == "zero_grad-not-none":
        opt.zero_grad(set_to_none=False)
    before = [p.detach().clone() for p in model.parameters()]
    with step_in_backward(opt):
        with pytest.raises(RuntimeError, match="already has a gradient when backward reaches it"):
            loss_of(model, x).backward()
        opt.zero_grad()
        loss_of(model, x).backward()  # fixed by zeroing: steps
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_remove_restores_the_ordinary_step():
    ref_model, ref_opt, model, opt = twin(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    data = batches()
    ordinary(ref_model, ref_opt, data)
    handle = step_in_backward(opt)
    assert "step" in vars(opt)
    for x in data[:2]:
        loss_of(model, x).backward()
    handle.remove()
    handle.remove()  # harmless
    assert "step" not in vars(opt) and "add_param_group" not in vars(opt)
    ordinary(model, opt, data[2:])  # hooks gone: gradients stay until step
    assert_same(ref_model, ref_opt, model, opt)


def test_remove_with_a_scheduler_made_after_keeps_it_working():
    ref_model, ref_opt, model, opt = twin(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9))
    data = batches()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ordinary(ref_model, ref_opt, data, torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.5))
        handle = step_in_backward(opt)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)  # wraps the guarded step
        for x in data[:2]:
            loss_of(model, x).backward()
            sched.step()
        handle.remove()  # the guard stays under the scheduler's wrapper, passing calls through
        ordinary(model, opt, data[2:], sched)
    assert_same(ref_model, ref_opt, model, opt)


def test_skips_frozen_parameters_and_hooks_added_groups():
    model = mlp()
    frozen, *rest = list(model.parameters())
    frozen.requires_grad_(False)
    opt = torch.optim.SGD([frozen] + rest[:2], lr=0.1)
    with step_in_backward(opt) as handle:
        opt.add_param_group({"params": rest[2:], "lr": 0.05})
        assert len(handle._hooks) == len(rest)
        before = [p.detach().clone() for p in model.parameters()]
        loss_of(model, batches(1)[0]).backward()
    after = list(model.parameters())
    assert torch.equal(before[0], after[0])
    assert all(not torch.equal(b, a) for b, a in zip(before[1:], after[1:]))
    assert all(p.grad is None for p in model.parameters())


def test_gradients_are_freed_in_backward():
    """At the peak of a later step, at most the largest parameter's gradient is alive (the
    ordinary loop holds all of them then)."""
    model = mlp((64, 96, 96, 96, 8))
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(4, 64)

    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref_model.parameters())
    ordinary(ref_model, ref_opt, [x])
    with PeakMemory(ref_model.parameters(), ref_opt) as pk:
        ordinary(ref_model, ref_opt, [x])
    assert pk.at_peak["gradients"] == total

    opt = torch.optim.AdamW(model.parameters())
    with step_in_backward(opt):
        loss_of(model, x).backward()
        with PeakMemory(model.parameters(), opt) as pk:
            loss_of(model, x).backward()
    assert 0 < pk.at_peak["gradients"] <= largest


# ------------------------------------------------------------------ misuse: AMP, wrappers, schedules

def test_refuses_grad_scaler_before_any_parameter_is_stepped():
    """GradScaler must see every gradient before the step (to skip it on inf or NaN); a step inside
    backward cannot wait: ``scaler.scale`` is refused, and nothing was stepped."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    before = [p.detach().clone() for p in model.parameters()]
    with step_in_backward(opt):
        with pytest.raises(RuntimeError, match="GradScaler.*bf16"):
            scaler.scale(loss_of(model, batches(1)[0])).backward()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    scaler.scale(loss_of(model, batches(1)[0]))  # removed: the scaler works again


@pytest.mark.parametrize("make_opt", [
    pytest.param(lambda ps: torch.optim.AdamW(ps, lr=1e-2), id="AdamW"),
    pytest.param(lambda ps: Gefen(ps, layout="published", lr=1e-2, backend="torch"), id="Gefen-torch"),
])
def test_an_accelerate_wrapped_optimizer_matches_the_ordinary_loop(make_opt):
    """accelerate's ``AcceleratedOptimizer`` is unwrapped: Gefen's first step still holds every
    gradient (one codebook from all of them), and the run is the ordinary loop's, bit for bit."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    ref_model, ref_opt, model, inner = twin(make_opt)
    data = batches()
    ordinary(ref_model, ref_opt, data)
    try:
        wrapped = Accelerator(cpu=True).prepare_optimizer(inner)
        assert wrapped is not inner
        with step_in_backward(wrapped) as handle:
            assert handle.optimizer is inner
            for x in data:
                loss_of(model, x).backward()
            with pytest.raises(RuntimeError, match="called while step_in_backward is installed"):
                wrapped.step()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert_same(ref_model, ref_opt, model, inner)


@pytest.mark.parametrize("layer", [0, -1], ids=["first-layer", "last-layer"])
@pytest.mark.parametrize("make_opt", [
    pytest.param(lambda ps: torch.optim.AdamW(ps, lr=1e-2), id="AdamW"),
    pytest.param(lambda ps: Gefen(ps, layout="published", lr=1e-2, backend="torch"), id="Gefen-torch"),
])
def test_a_layer_unfrozen_later_is_stepped_as_in_the_ordinary_loop(make_opt, layer):
    """Fine-tuning schedule: a layer frozen when step_in_backward is installed and unfrozen after
    two backwards is stepped from then on (the last layer's gradient comes first in backward,
    before any hook of the others runs)."""
    ref_model, ref_opt, model, opt = twin(make_opt)
    linears = lambda m: [mod for mod in m if isinstance(mod, nn.Linear)]  # noqa: E731
    for m in (ref_model, model):
        linears(m)[layer].requires_grad_(False)
    data = batches(5)
    ordinary(ref_model, ref_opt, data[:2])
    linears(ref_model)[layer].requires_grad_(True)
    ordinary(ref_model, ref_opt, data[2:])
    with step_in_backward(opt):
        for k, x in enumerate(data):
            if k == 2:
                linears(model)[layer].requires_grad_(True)
            loss_of(model, x).backward()
            assert all(p.grad is None for p in model.parameters())
    assert_same(ref_model, ref_opt, model, opt)


class _Fails(torch.autograd.Function):
    """Identity whose backward raises while ``armed``."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if _Fails.armed:
            raise ValueError("failed inside backward")
        return g


@pytest.mark.parametrize("make_opt", [
    pytest.param(lambda ps: torch.optim.AdamW(ps, lr=1e-2), id="AdamW"),
    pytest.param(lambda ps: Gefen(ps, layout="published", lr=1e-2, backend="torch"), id="Gefen-torch-held-first-step"),
])
def test_an_exception_inside_backward_leaves_the_next_backward_working(make_opt):
    """A backward that raises half-way: the parameters stepped before it keep their step (those
    after the failure in backward order), the others drop this backward's gradient; the next
    backwards are ordinary steps, equal to the ordinary loop run from the state it left."""
    model = mlp()
    opt = make_opt(model.parameters())

    def loss(m, x):
        h = m[:2](x)
        return m[2:](_Fails.apply(h)).pow(2).mean()

    data = batches(3)
    with step_in_backward(opt):
        _Fails.armed = True
        try:
            with pytest.raises(ValueError, match="failed inside backward"):
                loss(model, data[0]).backward()
        finally:
            _Fails.armed = False
        ref_model = copy.deepcopy(model)
        ref_model.zero_grad()  # the failed backward's gradients are dropped
        ref_opt = make_opt(ref_model.parameters())
        ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # AdamW shares step tensors otherwise
        for x in data[1:]:
            loss(model, x).backward()
    for x in data[1:]:
        loss(ref_model, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same(ref_model, ref_opt, model, opt)


def test_clip_grad_norm_is_refused_on_parameters_stepped_in_backward():
    """Their gradients were stepped and freed in backward: clip_grad_norm_ would return 0 and clip
    nothing. Parameters of no installed optimizer clip as usual."""
    model, other = mlp(), mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with step_in_backward(opt):
        loss_of(model, batches(1)[0]).backward()
        with pytest.raises(RuntimeError, match="clip_grad_norm_.*stepped inside backward"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        loss_of(other, batches(1)[0]).backward()
        assert float(torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)) > 0
    loss_of(model, batches(1)[0]).backward()
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) > 0


def test_refuses_accelerates_gradient_accumulation_at_the_first_micro_batch():
    """Inside ``accelerator.accumulate`` a micro-batch that should not step is refused at its
    backward, before any parameter is stepped (not micro-batches later at ``optimizer.step()``)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    model = mlp()
    try:
        acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
        opt = acc.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        before = [p.detach().clone() for p in model.parameters()]
        with step_in_backward(opt):
            with acc.accumulate(model):
                with pytest.raises(RuntimeError, match="accumulate.*ordinary loop"):
                    loss_of(model, batches(1)[0]).backward()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_a_dropped_model_with_its_handle_installed_is_collected():
    """A handle never removed does not keep its model and optimizer alive (nor refuse a GradScaler
    of another model) once they are dropped."""
    import gc
    import weakref

    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step_in_backward(opt)
    loss_of(model, batches(1)[0]).backward()
    gone = weakref.ref(opt)
    del model, opt
    gc.collect()
    assert gone() is None
    other = mlp()
    torch.amp.GradScaler("cpu").scale(loss_of(other, batches(1)[0])).backward()


def _torch_functions():
    from torch.nn.utils import clip_grad
    return [torch.amp.GradScaler.__dict__["scale"], clip_grad.clip_grad_norm_, clip_grad.clip_grad_value_,
            torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_]


def test_torch_is_as_it_was_once_every_handle_is_removed():
    """The refusals of GradScaler and clipping stand only while a handle is installed: after the last
    remove() (or once a handle never removed is collected) torch's own functions are back, the same
    objects; with two handles, removing one keeps the refusals for the other."""
    import gc

    originals = _torch_functions()
    a, b = mlp(), mlp()
    first = step_in_backward(torch.optim.AdamW(a.parameters(), lr=1e-2))
    second = step_in_backward(torch.optim.AdamW(b.parameters(), lr=1e-2))
    first.remove()
    loss_of(b, batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="clip_grad_value_.*stepped inside backward"):
        torch.nn.utils.clip_grad_value_(b.parameters(), 1.0)
    second.remove()
    assert all(x is y for x, y in zip(_torch_functions(), originals))

    c = mlp()
    step_in_backward(torch.optim.AdamW(c.parameters(), lr=1e-2))
    assert _torch_functions()[0] is not originals[0]
    del c
    gc.collect()
    assert all(x is y for x, y in zip(_torch_functions(), originals))
