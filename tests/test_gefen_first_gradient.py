"""Gefen's first gradient, which fixes each parameter's block length: zero first gradients leave
the parameters as AdamW does (``torch.optim.AdamW``) and blocks come from the first nonzero gradient;
a non-finite first gradient is refused.
"""

import pytest
import torch

from optim import Gefen
from optim.gefen import state as K
from tests.utils import assert_close, row_scaled_grad, seeded_grads, seeded_params, set_or_clear_grads


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_zero_first_gradients_match_adamw_and_blocks_come_from_first_nonzero(backend):
    """Three all-zero gradients (a zero-initialised layer): no state but the step count, and the
    parameters are AdamW's (weight decay only, bitwise). The first non-zero gradient then chooses
    a block > 1: about one byte a parameter, not block 1's five."""
    shape = (32, 256)
    p = torch.nn.Parameter(torch.randn(shape))
    q = torch.nn.Parameter(p.detach().clone())
    ours = Gefen([p], layout="published", lr=1e-2, weight_decay=0.1, backend=backend)
    ref = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        p.grad, q.grad = torch.zeros(shape), torch.zeros(shape)
        ours.step()
        ref.step()
        assert torch.equal(p, q)
        assert set(ours.state[p]) == {K.STEP} and ours.codebook is None
    assert ours.state[p][K.STEP] == 3
    p.grad = row_scaled_grad(shape)
    ours.step()
    st = ours.state[p]
    per_param = sum(st[k].numel() * st[k].element_size() for k in (K.V, K.SCALES, K.CODES)) / p.numel()
    assert st[K.BLOCK] >= 256 and per_param <= 1 + 8 / 256 and st[K.STEP] == 4


def test_zero_first_gradients_then_adamw_trajectory_with_switches_off():
    """Both switches off, zero gradients at steps 1-2: the whole trajectory is AdamW's, whose bias
    corrections count the zero-gradient steps."""
    p = torch.nn.Parameter(torch.randn(16, 96))
    q = torch.nn.Parameter(p.detach().clone())
    ours = Gefen([p], lr=1e-2, weight_decay=0.1, layout="adamw")
    ref = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1)
    for t in range(10):
        g = torch.zeros(16, 96) if t < 2 else torch.randn(16, 96)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert_close(p.detach(), q.detach(), atol=1e-6, name="p vs AdamW")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("late", [False, True], ids=["first_step", "late_parameter"])
def test_non_finite_first_gradient_is_refused(bad, late):
    """The block length and codebook come from the first gradient: a NaN is refused as an inf is,
    also for a parameter whose first gradient comes after the codebook was learned."""
    a, b = torch.nn.Parameter(torch.randn(16, 96)), torch.nn.Parameter(torch.randn(16, 96))
    opt = Gefen([a, b], layout="published")
    if late:
        a.grad = row_scaled_grad((16, 96))
        opt.step()
    b.grad = row_scaled_grad((16, 96))
    b.grad[3, 5] = bad
    with pytest.raises(ValueError, match=r"first gradient of parameter 1 .*NaN or inf"):
        opt.step()
    assert K.BLOCK not in opt.state[b]


BACKENDS = ["torch", "numba", "triton"]


SHAPES = [(5, 6), (5,), (300,)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_first_gradients_leave_params_alone_without_decay(backend):
    """With m = v = 0, AdamW's update at g = 0 is zero: the quantised default leaves the
    parameters unchanged over all-zero first gradients, then steps once real ones arrive."""
    ps = seeded_params(SHAPES)
    before = [p.detach().clone() for p in ps]
    opt = Gefen(ps, layout="published", lr=1e-2, backend=backend)
    for _ in range(2):
        set_or_clear_grads(ps, [torch.zeros_like(p) for p in ps])
        opt.step()
    for p, b in zip(ps, before):
        assert torch.equal(p, b)
    set_or_clear_grads(ps, seeded_grads(ps, 0))
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(ps, before))
