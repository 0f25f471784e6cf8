"""Gefen's memory at the peak of a step, and bf16 / fp16 weights with stochastic rounding.

The bound on transients: at no moment of a step (the first included: blocks and codebook) does
Gefen hold more than max(the largest parameter's bytes, 0.25 B per parameter) beyond weights,
gradients and state, on every backend, at 8 and 4 bits, factored or not. Measured with
``experiments.peak.PeakMemory`` (live tensor bytes, what CUDA's ``max_memory_allocated`` counts).

Stochastic rounding is checked against what it promises: a bf16 (fp16) weight whose every update is
under half a unit in the last place moves on average by the fp32 run's movement, where
round-to-nearest does not move it at all; runs repeat under one torch seed; the seed travels in the
state dict; the three backends draw the same bits.
"""

import copy

import pytest
import torch

from experiments.peak import PeakMemory
from optim import Gefen
from optim._rounding import random_bits, round_stochastic
from optim.backends import triton_interpreted

BACKENDS = ["torch", "numba", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_interpreted(), reason="Triton runs on CPU tensors only under TRITON_INTERPRET=1"))]


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(384, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                               torch.nn.GELU(), torch.nn.Linear(512, 24)).to(dtype)


def _bound(params) -> float:
    params = list(params)
    largest = max(p.numel() * p.element_size() for p in params)
    return max(largest, 0.25 * sum(p.numel() for p in params))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits,factored,dtype", [
    pytest.param(8, False, torch.float32, id="8bit"),
    pytest.param(4, False, torch.float32, id="4bit"),
    pytest.param(8, True, torch.float32, id="8bit-factored"),
    pytest.param(8, True, torch.bfloat16, id="8bit-factored-bf16-sr"),
])
def test_no_transient_above_the_bound_at_any_step(backend, bits, factored, dtype):
    model = _model(dtype)
    params = list(model.parameters())
    opt = Gefen(params, lr=1e-3, bits=bits, backend=backend, factor_second_moment=factored,
                stochastic_rounding=dtype != torch.float32)
    bound = _bound(params)
    for step in range(2):  # the first step (blocks, codebook, state) and one after it
        for p in params:  # rows of different scale, so blocks > 1 are chosen where they can be
            p.grad = (torch.randn(p.shape) * torch.rand(p.shape[0], *[1] * (p.dim() - 1)) * 3).to(dtype)
        with PeakMemory(params, opt) as pk:
            opt.step()
        assert pk.transient <= bound, (
            f"step {step + 1}: {pk.transient} transient bytes, bound {bound:.0f} (split at the peak: {pk.at_peak})")
        if step == 0:
            assert pk.at_peak["state"] > 0  # the state made inside the step is counted as state


def test_the_tracker_sees_a_transient_and_frees_it():
    """An independent check of the measure: a temporary of known size shows up as ``rest``."""
    w = torch.nn.Parameter(torch.zeros(1000))
    with PeakMemory([w]) as pk:
        tmp = torch.ones(5000)  # 20,000 bytes
        del tmp
        tmp = torch.ones(2000)
    assert pk.transient == 20_000
    assert pk.tensor_peak == 4000 + 20_000
    assert pk.current == 4000 + 8000  # the second one is still alive


# ------------------------------------------------------------------------ stochastic rounding
def _constant_gradient_run(dtype, sr, backend, steps=40, n=1 << 14, seed=0):
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.ones(n, dtype=dtype))
    opt = Gefen([p], lr=1e-3, backend=backend, stochastic_rounding=sr)
    g = torch.ones(n, dtype=dtype)
    for _ in range(steps):
        p.grad = g.clone()
        opt.step()
    return p.detach().float(), opt


@pytest.mark.parametrize("backend", BACKENDS)
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


@pytest.mark.parametrize("backend", BACKENDS)
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
    model = _model(torch.bfloat16)
    twin = copy.deepcopy(model)
    grads = [[torch.randn(p.shape).bfloat16() for p in model.parameters()] for _ in range(6)]
    torch.manual_seed(7)  # the generator state the seeds are drawn from, for both runs
    opt = Gefen(model.parameters(), lr=1e-2, backend=backend, stochastic_rounding=True)
    for gs in grads:
        for p, g in zip(model.parameters(), gs):
            p.grad = g.clone()
        opt.step()
    torch.manual_seed(7)
    opt2 = Gefen(twin.parameters(), lr=1e-2, backend=backend, stochastic_rounding=True)
    for gs in grads[:3]:
        for p, g in zip(twin.parameters(), gs):
            p.grad = g.clone()
        opt2.step()
    torch.save(opt2.state_dict(), tmp_path / "opt.pt")
    torch.manual_seed(12345)  # another generator state: the saved seeds decide
    opt3 = Gefen(twin.parameters(), lr=1e-2, backend=backend, stochastic_rounding=True)
    opt3.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    for gs in grads[3:]:
        for p, g in zip(twin.parameters(), gs):
            p.grad = g.clone()
        opt3.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_a_saved_seed_of_the_wrong_kind_is_refused():
    p = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    opt = Gefen([p], stochastic_rounding=True, backend="torch")
    p.grad = torch.randn(64).bfloat16()
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["seed"] = -1.5
    with pytest.raises(ValueError, match="seed"):
        Gefen([p], stochastic_rounding=True, backend="torch").load_state_dict(sd)


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
                    share_second_moment=False, quantize_first_moment=False)
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
        opt = Gefen([p], lr=1e-2, backend=backend, stochastic_rounding=True)
        for g in grads:
            p.grad = g.clone()
            opt.step()
    assert torch.equal(a, b)
    assert not torch.equal(a, base.t())
