"""bf16 / fp16 weights with stochastic rounding, checked against what it promises: a weight
whose every update is under half a unit in the last place moves on average by the fp32 run's
movement, where round-to-nearest does not move it at all; runs repeat under one torch seed and leave
the global random stream alone; the seed travels in the state dict and a resumed run is the
uninterrupted one; the three backends draw the same bits (the documented hash).
"""

import copy

import pytest
import torch

from optim import Gefen
from optim._rounding import random_bits, round_stochastic
from optim.backends import triton_interpreted
from optim.gefen import state as K
from tests.utils import GEFEN_CPU_BACKENDS, mlp_params, row_growing_grads, wide_mlp


def _constant_gradient_run(dtype, sr, backend, steps=40, n=1 << 14, seed=0):
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.ones(n, dtype=dtype))
    opt = Gefen([p], layout="published", lr=1e-3, backend=backend, stochastic_rounding=sr)
    g = torch.ones(n, dtype=dtype)
    for _ in range(steps):
        p.grad = g.clone()
        opt.step()
    return p.detach().float(), opt


@pytest.mark.parametrize("backend", GEFEN_CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_stochastic_rounding_is_exact_in_expectation(backend, dtype):
    """Updates of about lr = 1e-3 on weights at 1.0 (bf16 ulp 2**-7, fp16 ulp 2**-10 below 1: the
    bf16 update is a quarter of an ulp, the fp16 one about one ulp) against the fp32 run."""
    steps, n = 30, 1 << 13
    fp32, _ = _constant_gradient_run(torch.float32, False, backend, steps, n)
    sr, _ = _constant_gradient_run(dtype, True, backend, steps, n)
    rn, _ = _constant_gradient_run(dtype, False, backend, steps, n)
    moved = float(1.0 - fp32.mean())
    assert moved == pytest.approx(steps * 1e-3, rel=0.02)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    # each step's rounding error is zero-mean with |e| < ulp: over n weights the mean error of
    # `steps` steps has a standard deviation below ulp * sqrt(steps / n)
    tol = 6 * ulp * (steps / n) ** 0.5
    assert abs(float(sr.mean()) - float(fp32.mean())) < tol, (float(sr.mean()), float(fp32.mean()), tol)
    if dtype == torch.bfloat16:
        assert bool((rn == 1.0).all())  # round-to-nearest never moves it
    # every stochastically rounded value is one of the two neighbours of some fp32 trajectory value
    assert sr.unique().numel() > 1


@pytest.mark.parametrize("backend", GEFEN_CPU_BACKENDS)
def test_stochastic_rounding_repeats_under_one_seed_and_differs_under_another(backend):
    a, opt = _constant_gradient_run(torch.bfloat16, True, backend, steps=5, n=4096, seed=3)
    b, _ = _constant_gradient_run(torch.bfloat16, True, backend, steps=5, n=4096, seed=3)
    c, _ = _constant_gradient_run(torch.bfloat16, True, backend, steps=5, n=4096, seed=4)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_stochastic_rounding_leaves_fp32_parameters_alone():
    a, _ = _constant_gradient_run(torch.float32, True, "torch", steps=5, n=4096)
    b, _ = _constant_gradient_run(torch.float32, False, "torch", steps=5, n=4096)
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_stochastic_rounding_resumes_from_the_state_dict(backend, tmp_path):
    torch.manual_seed(0)
    model = wide_mlp(torch.bfloat16)
    twin = copy.deepcopy(model)
    grads = [[torch.randn(p.shape).bfloat16() for p in model.parameters()] for _ in range(6)]
    torch.manual_seed(7)  # the generator state the seeds are drawn from, for both runs
    opt = Gefen(model.parameters(), layout="published", lr=1e-2, backend=backend, stochastic_rounding=True)
    for gs in grads:
        for p, g in zip(model.parameters(), gs):
            p.grad = g.clone()
        opt.step()
    torch.manual_seed(7)
    opt2 = Gefen(twin.parameters(), layout="published", lr=1e-2, backend=backend, stochastic_rounding=True)
    for gs in grads[:3]:
        for p, g in zip(twin.parameters(), gs):
            p.grad = g.clone()
        opt2.step()
    torch.save(opt2.state_dict(), tmp_path / "opt.pt")
    torch.manual_seed(12345)  # another generator state: the saved seeds decide
    opt3 = Gefen(twin.parameters(), layout="published", lr=1e-2, backend=backend, stochastic_rounding=True)
    opt3.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    for gs in grads[3:]:
        for p, g in zip(twin.parameters(), gs):
            p.grad = g.clone()
        opt3.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_a_saved_seed_of_the_wrong_kind_is_refused():
    p = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    opt = Gefen([p], layout="published", stochastic_rounding=True, backend="torch")
    p.grad = torch.randn(64).bfloat16()
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["seed"] = -1.5
    with pytest.raises(ValueError, match="seed"):
        Gefen([p], layout="published", stochastic_rounding=True, backend="torch").load_state_dict(sd)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_round_stochastic_picks_a_neighbour_with_the_right_probability(dtype):
    """Brute force: for values between two neighbours, the frequency of rounding up over many
    seeds is the fraction of the gap (binomial tolerance), and only the two neighbours appear."""
    lo = torch.tensor([1.0, -3.0, 1e-3, 1000.0], dtype=dtype).float()
    up = torch.nextafter(lo.to(dtype), torch.full_like(lo, float("inf")).to(dtype)).float()
    frac = torch.tensor([0.1, 0.5, 0.9, 0.3])
    x = lo + frac * (up - lo)
    trials = 4000
    hits = torch.zeros(4)
    for seed in range(trials):
        y = round_stochastic(x, dtype, seed).float()
        assert bool(((y == lo) | (y == up)).all())
        hits += (y == up).float()
    f = hits / trials
    exact = (x - lo) / (up - lo)
    assert bool(((f - exact).abs() < 5 * (exact * (1 - exact) / trials).sqrt() + 1e-3).all()), (f, exact)


def test_random_bits_are_the_documented_hash():
    """``random_bits`` against a plain-Python lowbias32 of ``i * 0x9E3779B9 + seed``."""
    def lowbias32(x):
        x &= 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)
    seed, off = 0xDEADBEEF, (1 << 32) - 3
    got = random_bits(seed, off, 7, "cpu").tolist()
    assert got == [lowbias32(((i & 0xFFFFFFFF) * 0x9E3779B9 + seed) & 0xFFFFFFFF) for i in range(off, off + 7)]


@pytest.mark.skipif(not triton_interpreted(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_backends_round_with_the_same_bits(dtype):
    """One step from p = 0: every backend rounds with the same random bits, so the results agree
    except where the backends' fp32 updates differ by a rounding (the documented ulps of p) and
    that difference crosses the random threshold: then by one unit of the weight's dtype."""
    out = {}
    for backend in ("torch", "numba", "triton"):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.zeros(4096, dtype=dtype))
        opt = Gefen([p], lr=3e-3, backend=backend, stochastic_rounding=True,
                    layout="adamw")
        p.grad = torch.randn(4096).to(dtype)
        opt.step()
        out[backend] = p.detach().clone()
    for other in ("numba", "triton"):
        differ = out["torch"] != out[other]
        assert int(differ.sum()) <= 4, (other, int(differ.sum()))  # of 4096
        ulp = (out["torch"].float().abs() * 2.0 ** -10 if dtype == torch.float16 else
               out["torch"].float().abs() * 2.0 ** -7)
        assert bool(((out["torch"].float() - out[other].float()).abs() <= ulp * 1.01)[differ].all())


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-sr"])
def test_a_strided_parameter_steps_as_its_contiguous_twin(backend, dtype):
    """The steps work on pieces of flat views; a transposed parameter is stepped through a
    contiguous copy written back, bitwise as the same values laid out contiguously."""
    torch.manual_seed(0)
    base = torch.randn(96, 64).to(dtype)
    a = torch.nn.Parameter(base.clone().t())
    b = torch.nn.Parameter(base.clone().t().contiguous())
    assert not a.is_contiguous()
    grads = [torch.randn(64, 96).to(dtype) for _ in range(3)]
    for p in (a, b):
        torch.manual_seed(5)  # the same rounding seed for both
        opt = Gefen([p], layout="published", lr=1e-2, backend=backend, stochastic_rounding=True)
        for g in grads:
            p.grad = g.clone()
            opt.step()
    assert torch.equal(a, b)
    assert not torch.equal(a, base.t())


def _bf16_params():
    return [torch.nn.Parameter(p.detach().bfloat16()) for p in mlp_params()]


def _sr_steps(opt, params, steps, start=0, late=2):
    """Steps of bf16 gradients; the second parameter's are zero before step ``late`` (so it
    gets its state, and its seed, only then)."""
    for t in range(start, start + steps):
        for k, (p, g) in enumerate(zip(params, row_growing_grads(t, params))):
            p.grad = g if k == 0 or t >= late else torch.zeros_like(g)
        opt.step()


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_stochastic_rounding_leaves_the_global_random_stream_alone(backend):
    torch.manual_seed(5)
    want = torch.rand(4)
    torch.manual_seed(5)
    ps = _bf16_params()
    _sr_steps(Gefen(ps, layout="published", lr=1e-3, stochastic_rounding=True, backend=backend), ps, 3)
    assert torch.equal(torch.rand(4), want)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_a_resumed_rounding_run_equals_the_uninterrupted_one(backend):
    """Checkpoint after two steps, before the second parameter has its seed; the resumed process
    has another random state: the next three steps are the uninterrupted run's, bit for bit."""
    torch.manual_seed(11)
    whole = _bf16_params()
    _sr_steps(Gefen(whole, layout="published", lr=1e-3, stochastic_rounding=True, backend=backend), whole, 5)
    torch.manual_seed(11)
    first = _bf16_params()
    opt = Gefen(first, layout="published", lr=1e-3, stochastic_rounding=True, backend=backend)
    _sr_steps(opt, first, 2)
    assert K.SEED not in opt.state[first[1]]
    buf = __import__("io").BytesIO()
    torch.save({"opt": opt.state_dict(), "params": [p.detach() for p in first]}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    torch.manual_seed(999)  # another process
    resumed = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    opt2 = Gefen(resumed, layout="published", lr=1e-3, stochastic_rounding=True, backend=backend)
    opt2.load_state_dict(saved["opt"])
    _sr_steps(opt2, resumed, 3, start=2)
    for a, b in zip(resumed, whole):
        assert torch.equal(a, b)


def test_loading_a_checkpoint_saved_without_rounding_keeps_rounding_on():
    """The group's stochastic_rounding is how this run writes its weights: a checkpoint of a
    run without it (or saved before the keyword existed) does not turn it off (every parameter
    gets its seed at the next steps); one that rounded, loaded into a run without, does not turn it on."""
    ps = _bf16_params()
    plain = Gefen(ps, layout="published", lr=1e-3)
    _sr_steps(plain, ps, 2)
    sd = plain.state_dict()
    old = copy.deepcopy(sd)
    for g in old["param_groups"]:
        del g["stochastic_rounding"]
    for saved in (sd, old):
        qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        opt = Gefen(qs, layout="published", lr=1e-3, stochastic_rounding=True)
        opt.load_state_dict(saved)
        assert opt.param_groups[0]["stochastic_rounding"] is True
        _sr_steps(opt, qs, 2, start=2)
        assert all(K.SEED in opt.state[q] for q in qs)
    off = Gefen([torch.nn.Parameter(p.detach().clone()) for p in ps], layout="published", lr=1e-3)
    off.load_state_dict(opt.state_dict())
    assert off.param_groups[0]["stochastic_rounding"] is False


