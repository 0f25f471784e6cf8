"""Gefen's memory at the peak of a step (stochastic rounding: ``tests/test_gefen_rounding.py``).

The bound on transients: at no moment of a step (the first included: blocks and codebook) does
Gefen hold more than max(the largest parameter's bytes, 0.25 B per parameter) beyond weights,
gradients and state, on every backend, at 8 and 4 bits, factored or not. Measured with
``experiments.harness.peak.PeakMemory`` (live tensor bytes, what CUDA's ``max_memory_allocated`` counts).
"""

import pytest
import torch

from experiments.harness.peak import PeakMemory
from optim import Gefen, GefenLayout
from tests.utils import GEFEN_CPU_BACKENDS, wide_mlp


def _bound(params) -> float:
    params = list(params)
    largest = max(p.numel() * p.element_size() for p in params)
    return max(largest, 0.25 * sum(p.numel() for p in params))


_LAYOUTS = [(8, False, torch.float32, "8bit"), (4, False, torch.float32, "4bit"),
            (8, True, torch.float32, "8bit-factored"), (8, True, torch.bfloat16, "8bit-factored-bf16-sr")]


def _cases():
    """Every layout on every CPU backend; interpreted Triton beyond the 8-bit case is slow."""
    for backend in GEFEN_CPU_BACKENDS:
        name, marks = (backend, ()) if isinstance(backend, str) else (backend.values[0], backend.marks)
        for bits, factored, dtype, label in _LAYOUTS:
            slow = (pytest.mark.slow,) if name == "triton" and label != "8bit" else ()
            yield pytest.param(bits, factored, dtype, name, id=f"{label}-{name}", marks=(*marks, *slow))


@pytest.mark.parametrize("bits,factored,dtype,backend", list(_cases()))
def test_no_transient_above_the_bound_at_any_step(backend, bits, factored, dtype):
    model = wide_mlp(dtype)
    params = list(model.parameters())
    opt = Gefen(params, lr=1e-3, bits=bits, backend=backend, layout=GefenLayout(factor_second_moment=factored),
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


def test_the_tracker_counts_a_set_aside_gradient_as_a_gradient_while_it_lives():
    """A gradient taken off ``p.grad`` but still referenced (``step_in_backward`` holds the others'
    aside while it steps one parameter) is counted as a gradient, not as ``rest``; once freed, it
    counts nowhere."""
    w = torch.nn.Parameter(torch.zeros(1000))
    with PeakMemory([w]) as pk:
        w.grad = torch.ones(1000)  # 4,000 bytes
        torch.zeros(10)  # an operation after it: the split sees w.grad
        aside, w.grad = w.grad, None
        tmp = torch.ones(3000)  # 12,000 bytes: the peak, with the gradient held aside
        torch.zeros(10)
        held = dict(pk.at_peak)
        del aside, tmp
        tmp = torch.ones(6000)  # 24,000 bytes: a higher peak, the gradient freed before it
    assert held == {"weights": 4000, "gradients": 4000, "state": 0, "rest": 12_000}
    assert pk.at_peak == {"weights": 4000, "gradients": 0, "state": 0, "rest": 24_000}
