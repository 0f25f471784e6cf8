"""bf16 gradients on fp32 weights (mixed-precision training; CPU-offloaded optimizer steps).

The compiled CPU step reads contiguous bf16 gradients where they are, widening a scale block at a
time on the stack. Widening bf16 to fp32 is exact, so the oracle is the same step on the
gradients widened by torch (``g.float()``): weights and every state tensor equal bit for bit, on
every layout, at 8 and 4 bits, at one and two threads, through shapes that take many parallel
jobs, factor tiles of rows, and row-group scales longer than the kernel's stack scratch. And the
step allocates no tensor memory after the first, where before it made fp32 copies of the
gradients a piece at a time.
"""

import pytest
import torch

from experiments.harness.peak import PeakMemory
from optim import Gefen
from tests.utils import row_scaled_grad

# 50,000 elements: two parallel jobs of whole scale blocks; 1,000: a vector; 33 x 7: one odd block
SHAPES = [(500, 100), (64, 256), (1000,), (33, 7)]
LAYOUTS = ["published", "factored", "compact", "adamw"]


def _grads(shapes, step):
    torch.manual_seed(1000 + step)
    return [row_scaled_grad(s).mul_(1e-2).bfloat16() for s in shapes]


def _run(layout, bits, widen, steps=3):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(0.1 * torch.randn(s)) for s in SHAPES]
    for p in params:
        p.grad_dtype = None  # a gradient of another dtype than its weight, as autocast leaves it
    opt = Gefen(params, lr=1e-2, weight_decay=0.1, bits=bits, layout=layout, backend="numba")
    for step in range(steps):
        for p, g in zip(params, _grads(SHAPES, step)):
            p.grad = g.float() if widen else g
        opt.step()
    return [p.detach().clone() for p in params], opt.state_dict()["state"]


# every layout at both code widths on one thread; the parallel kernel (jobs on two threads) on two
CASES = [(layout, bits, 1) for layout in LAYOUTS for bits in (8, 4)] + [("factored", 8, 2), ("compact", 4, 2)]


@pytest.mark.parametrize("layout,bits,threads", CASES)
def test_bf16_gradients_step_as_their_fp32_widening(layout, bits, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        (p16, s16), (p32, s32) = _run(layout, bits, widen=False), _run(layout, bits, widen=True)
    finally:
        torch.set_num_threads(before)
    for i, (a, b) in enumerate(zip(p16, p32)):
        assert torch.equal(a, b), f"weight {i}: max |diff| {(a - b).abs().max().item():.3g}"
    assert s16.keys() == s32.keys()
    for i in s32:
        for key, value in s32[i].items():
            if torch.is_tensor(value):
                assert torch.equal(s16[i][key], value), f"state {key} of parameter {i} differs"
    assert any(k == "exp_avg_sq" or k.startswith("v") for k in s32[0])  # the state was compared


@pytest.mark.parametrize("layout", ["published", "compact"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_step_after_the_first_allocates_no_tensor_memory(layout, dtype):
    """At two sizes, 4x apart: no transient tensor bytes at all (nothing proportional to the
    parameters) in the steps after the first."""
    for d in (256, 512):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(d, d)) for _ in range(3)] + [torch.nn.Parameter(torch.randn(d))]
        for p in params:
            p.grad_dtype = None
        opt = Gefen(params, lr=1e-3, layout=layout, backend="numba")
        for step in range(3):
            for p in params:
                p.grad = row_scaled_grad(p.shape).to(dtype)
            with PeakMemory(params, opt) as peak:
                opt.step()
            if step:
                assert peak.transient == 0, f"d={d}, step {step + 1}: {peak.transient} bytes ({peak.at_peak})"
