"""The numba step splits each group into jobs of whole scale blocks run in parallel.

The split must not change a single bit: with 4-bit codes two elements share a byte, so a job
boundary inside a byte (odd block lengths) would race. One and two threads must agree exactly.
"""

import numba
import pytest
import torch

from optim import Gefen, GefenLayout
from optim.gefen import _numba_kernels as C, state as K

# numels: odd blocks (3 x 7 x 11 rows), a prime (per-element v, chunked scales), a large even tensor
# so a group spans several ~32K-element jobs.
SHAPES = [(231, 3), (7, 11, 5), (4099,), (96, 1024), (33, 17)]


def _run(threads, bits, steps=3, factored=False):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(11)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
        opt = Gefen(params, lr=1e-2, weight_decay=0.01, bits=bits, backend="numba",
                    layout=GefenLayout(factor_second_moment=factored))
        for _ in range(steps):
            for p in params:
                # row-structured gradient magnitudes so the block rule finds blocks > 1
                scale = torch.rand(p.shape[0], *([1] * (p.dim() - 1)), generator=gen) * 3 + 0.1
                p.grad = torch.randn(p.shape, generator=gen) * scale
            opt.step()
        return [p.detach().clone() for p in params], opt.state_dict()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("bits,factored", [(8, False), (4, False), (8, True)])
def test_one_and_two_threads_agree_bitwise(bits, factored, monkeypatch):
    """One thread runs the serial kernel, two the prange one: the same bits (factored: w too, whose
    column sums are added per job in job order)."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba has a single thread here")
    used = []
    real = C.kernel
    monkeypatch.setattr(C, "kernel", lambda b, pe, parallel=True, **kw: used.append(parallel) or
                        real(b, pe, parallel, **kw))
    p1, s1 = _run(1, bits, factored=factored)
    p2, s2 = _run(2, bits, factored=factored)
    assert False in used and True in used
    for a, b in zip(p1, p2):
        assert torch.equal(a, b)
    blocks = []
    for k, st in s1["state"].items():
        st2 = s2["state"][k]
        blocks.append(int(st[K.BLOCK]) if K.BLOCK in st else None)
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, st2[key]), f"state {k}/{key} differs between 1 and 2 threads"
    assert any(b is not None and b > 1 and b % 2 == 1 for b in blocks) or bits == 8, blocks
