"""The Triton path's factored second moment: w computed by the statistics kernels, and a repeated
step that issues no per-tensor torch operation.

Independent reference: w written out in float64 from the rule of ``reference.factor_update``
(column means of g**2 over a tensor's blocks, then the EMA; an offset whose new value is not finite
keeps its old one), and the torch step's ``tiling.factor_update_`` beside it. The kernels add the squares in
another order than either (rows in order in each lane, lanes in a tree, programs' partial sums in
order), so w agrees to fp32 rounding, not bitwise. A sum of non-negative fp32 terms errs by at most
its depth (the additions on its longest chain) times 2**-24, relative; the deepest here is about 70
(a lane of the block-1024 tensor of 127 blocks adds 64 rows), with a few roundings of the mean and
the EMA after it: 5e-6, so RTOL = 1e-5 (observed: below 5e-7).

Op counts are taken on CPU tensors under the interpreter by a ``TorchDispatchMode`` that counts the
aten operations a call issues, paused inside kernel launches (where the interpreter itself touches
the tensors): that is what a GPU step would issue as host-side torch operations around its kernels.
"""

import functools
from collections import Counter

import pytest
import torch
import triton.runtime.interpreter as interpreter
from torch.utils._python_dispatch import TorchDispatchMode

from optim.gefen import tiling, triton_ops
from optim.gefen.codebook import code_table
from optim.gefen.plan import Hyper, Tile
from optim.gefen.reference import init_state
from tests.utils import assert_close

BETA2 = 0.9  # a small beta2, so that w's new column means weigh as much as its old value
RTOL = 1e-5  # see the module docstring
HYPER = dict(lr=1e-3, beta1=0.9, beta2=BETA2, eps=1e-8, weight_decay=0.1)
CODEBOOK = torch.linspace(-1, 1, 256)


def _state(numels, block, quant):
    """Fresh p, v, scales, codes (fp32 m when not ``quant``) and w of tensors of ``numels``."""
    ps, vs, ss, cs = [], [], [], []
    for n in numels:
        v, s, c = init_state(n, block=block, bits=8, quantized=quant)
        ps.append(torch.randn(n))
        vs.append(v)
        ss.append(s)
        cs.append(c)
    return ps, vs, ss, cs, [torch.rand(block) for _ in numels]


def _grads(numels, block, dtypes):
    """Gradients whose offsets differ in scale (so the columns' means differ), in ``dtypes`` in turn."""
    return [(torch.randn(n // block, block) * torch.exp(torch.randn(block))).reshape(-1).to(dtypes[k % len(dtypes)])
            for k, n in enumerate(numels)]


def _brute_force(w, g, block):
    """The new w in float64: column means of g**2 over the (n / block, block) view, then the EMA;
    offsets whose new value is not finite keep the old one."""
    g = g.double().reshape(-1, block)
    new = BETA2 * w.double() + (1 - BETA2) * (g * g).mean(dim=0)
    return torch.where(torch.isfinite(new), new, w.double())


@functools.cache
def _tables():
    return code_table(CODEBOOK)


def _tiles(ps, vs, ss, cs, ws, quant):
    """The ``plan.Tile`` records of ``_state``'s tensors (no scales when not ``quant``)."""
    return [Tile(p, v, s if quant else None, c, w) for p, v, s, c, w in zip(ps, vs, ss, cs, ws)]


def _step(state, gs, block, quant, step=1, seeds=None):
    triton_ops.gefen_step_(_tiles(*state, quant), gs, CODEBOOK if quant else None, Hyper(step, **HYPER),
                           tables=_tables() if quant else None, block=block, bits=8, seeds=seeds)


BLOCKS_OF_TENSORS = [1, 3, 63, 127]  # blocks in each tensor of a call
CASES = [
    # (block, numels, gradient dtypes): the last tensor of the first three spans several statistics programs
    pytest.param(1, BLOCKS_OF_TENSORS + [70001], [torch.float32], id="block1-per-element"),
    pytest.param(2, [2 * b for b in BLOCKS_OF_TENSORS] + [2 * 40000], [torch.float32], id="block2"),
    pytest.param(3, [3 * b for b in BLOCKS_OF_TENSORS] + [3 * 20000], [torch.float16], id="block3-fp16"),
    pytest.param(64, [64 * b for b in BLOCKS_OF_TENSORS], [torch.bfloat16], id="block64-bf16"),
    pytest.param(1024, [1024 * b for b in BLOCKS_OF_TENSORS], [torch.float32, torch.bfloat16, torch.float16],
                 id="block1024-mixed-dtypes"),
    pytest.param(3000, [3000, 3 * 3000], [torch.float32], id="block3000-column-chunks"),
]


@pytest.mark.parametrize("block, numels, dtypes", CASES)
def test_factor_matches_float64_brute_force_and_torch_ops(block, numels, dtypes):
    """Three steps of one call over tensors of 1, 3, 63 and 127 blocks (and one of several
    statistics programs), each step on new gradient tensors (the plan re-points its tables at
    them): every w equals the float64 brute force and ``tiling.factor_update_`` to ``RTOL``."""
    quant = block <= 64  # the quantised and the unquantised step kernels both read the new w
    state = _state(numels, block, quant)
    want = [w.double() for w in state[4]]
    ref = [w.clone() for w in state[4]]
    for t in range(1, 4):
        gs = _grads(numels, block, dtypes)
        _step(state, gs, block, quant, step=t)
        want = [_brute_force(w, g, block) for w, g in zip(want, gs)]
        tiling.factor_update_(ref, gs, block=block, beta2=BETA2)
        for k, (w, w64, w_torch) in enumerate(zip(state[4], want, ref)):
            assert_close(w, w64, rtol=RTOL, name=f"w[{k}] vs float64, step {t}")
            assert_close(w, w_torch, rtol=RTOL, name=f"w[{k}] vs torch_ops, step {t}")


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's numpy on inf, NaN
@pytest.mark.parametrize("block", [1, 3, 64])
def test_an_offset_of_non_finite_gradient_keeps_its_w(block):
    """An inf in one tensor's gradient and a NaN in another's: those offsets keep their w bit for
    bit (``reference.factor_update``), every other offset moves as the brute force says."""
    numels = [block * b for b in (3, 63, 127)]
    state = _state(numels, block, quant=True)
    before = [w.clone() for w in state[4]]
    gs = _grads(numels, block, [torch.float32])
    gs[0][block * 2 + block // 2] = float("inf")
    gs[2][block * 100 + block - 1] = float("nan")
    _step(state, gs, block, quant=True)
    frozen = {0: block // 2, 2: block - 1}
    for k, (w, w0, g) in enumerate(zip(state[4], before, gs)):
        assert_close(w, _brute_force(w0, g, block), rtol=RTOL, name=f"w[{k}]")
        if k in frozen:
            assert torch.equal(w[frozen[k]], w0[frozen[k]])
    assert torch.isfinite(torch.cat(state[4])).all()


class _OpCounter(TorchDispatchMode):
    """Counts the aten operations issued under it, except inside kernel launches."""

    def __init__(self):
        super().__init__()
        self.ops, self.launches, self.paused = Counter(), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


@pytest.fixture
def counter(monkeypatch):
    """An ``_OpCounter`` whose counting pauses inside every interpreted kernel launch."""
    mode = _OpCounter()
    run = interpreter.InterpretedFunction.run

    def paused_run(self, *args, **kwargs):
        mode.launches += 1
        mode.paused += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            mode.paused -= 1

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", paused_run)
    return mode


# At most: one host-to-device copy of the gradients' pointers when they moved (the host tensor and
# the copy: 2 operations) and one of the stochastic-rounding seeds (2 more); nothing per tensor.
MAX_OPS = 4


@pytest.mark.slow
@pytest.mark.parametrize("block", [8, 1])
def test_a_repeated_factored_step_issues_no_per_tensor_torch_operation(counter, block):
    """After a first call (which builds the plan), a factored step over 40 and over 160 tensors
    issues the same few aten operations outside its launches (none for the same gradients, two
    for new gradient tensors, two more for stochastic rounding's seeds) and the same launches:
    statistics, finalize and the step."""
    seen = {}
    for count in (40, 160):
        numels = [block * (2 + k % 5) for k in range(count)]
        state = _state(numels, block, quant=True)
        state = ([p.bfloat16() for p in state[0]],) + state[1:]  # bf16 p: the seeds are used
        gs = _grads(numels, block, [torch.float32])
        seeds = list(range(count))
        _step(state, gs, block, quant=True, seeds=seeds)
        runs = []
        for new_grads in (False, True):
            if new_grads:
                gs = [g.clone() for g in gs]
            before = counter.launches
            with counter:
                _step(state, gs, block, quant=True, step=2, seeds=seeds)
            runs.append((counter.total, counter.launches - before))
            counter.ops.clear()
        seen[count] = runs
    assert seen[40] == seen[160], seen
    (same_ops, launches), (new_ops, _) = seen[40]
    assert same_ops <= 2 and new_ops <= MAX_OPS, seen
    assert launches == 3, seen


def test_the_unfactored_step_counts_the_same(counter):
    """Without a factor (no statistics launches) a repeated call with new gradients issues the same
    two operations at 40 and 160 tensors, in one launch."""
    seen = {}
    for count in (40, 160):
        numels = [8 * (2 + k % 5) for k in range(count)]
        ps, vs, ss, cs, _ = _state(numels, 8, quant=True)
        tiles = [Tile(p, v, s, c) for p, v, s, c in zip(ps, vs, ss, cs)]
        gs = _grads(numels, 8, [torch.float32])
        kw = dict(block=8, bits=8, tables=_tables())
        triton_ops.gefen_step_(tiles, gs, CODEBOOK, Hyper(1, **HYPER), **kw)
        gs = [g.clone() for g in gs]
        before = counter.launches
        with counter:
            triton_ops.gefen_step_(tiles, gs, CODEBOOK, Hyper(1, **HYPER), **kw)
        seen[count] = (dict(counter.ops), counter.launches - before)
        counter.ops.clear()
    assert seen[40] == seen[160] and sum(seen[40][0].values()) <= 2 and seen[40][1] == 1, seen
