"""Every Gefen layout of commit a61f9ed steps bit for bit as that code did, on every backend.

``tests/data/gefen_a61f9ed_trajectories.pt`` holds, per layout, bits, backend and case, the weights and
the state after each step of runs made by the code of a61f9ed (where the layouts were spelled as
constructor switches, ``SWITCHES``; now they are given as ``GefenLayout`` records of the same fields, since
a name may stand for another record later). It was written by this file's ``__main__`` copied into a
checkout of that commit::

    git archive a61f9ed | tar -x -C /tmp/old; cp tests/test_gefen_unchanged.py /tmp/old/tests/
    cd /tmp/old; TRITON_INTERPRET=1 PYTHONPATH=. python tests/test_gefen_unchanged.py <out>

The cases cover fp32 matrices and vectors (factored tiles, shared vector moments, row-group scales,
4-bit codes) and bf16 weights with stochastic rounding; Triton runs interpreted on CPU tensors.
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

import pytest
import torch

SAVED = Path(__file__).parent / "data" / "gefen_a61f9ed_trajectories.pt"
_COMPACT = dict(factor_second_moment=True, share_vector_second_moment=True, share_matrix_rows=True,
                row_group_scales=True, whole_matrix_factor=True)
SWITCHES = {  # (layout, bits): the constructor switches that chose it at a61f9ed
    ("published", 8): {}, ("published", 4): {},
    ("factored", 8): dict(factor_second_moment=True), ("factored", 4): dict(factor_second_moment=True),
    ("compact", 8): _COMPACT, ("compact", 4): dict(_COMPACT, row_group_scales=512),
    ("adamw", 8): dict(share_second_moment=False, quantize_first_moment=False),
}
CASES = {  # name: (shapes, dtype, stochastic_rounding)
    "fp32": ([(24, 16), (16,), (40, 8), (7,), (3, 300)], torch.float32, False),
    "bf16-sr": ([(32, 16), (16,)], torch.bfloat16, True),
}
BACKENDS = ("torch", "numba", "triton")
STEPS = {"torch": 4, "numba": 4, "triton": 2}


def _problem(case):
    shapes, dtype, _ = CASES[case]
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [[(torch.randn(s, generator=gen) * (torch.exp(torch.randn(s[0], 1, generator=gen))
                                                  if len(s) == 2 else 1)).to(dtype) for s in shapes]
             for _ in range(4)]
    return init, grads


def _optimizer(params, layout, bits, backend, sr):
    from optim import Gefen

    hyper = dict(lr=1e-2, weight_decay=0.1, bits=bits, backend=backend, stochastic_rounding=sr)
    if "layout" in inspect.signature(Gefen).parameters:  # the record the name was at a61f9ed
        from optim.gefen.layout import GefenLayout

        return Gefen(params, layout=GefenLayout(**SWITCHES[layout, bits]), **hyper)
    torch.manual_seed(0)  # at a61f9ed the rounding seed came from torch.initial_seed() too
    return Gefen(params, **SWITCHES[layout, bits], **hyper)


def _trajectory(layout, bits, backend, case):
    """The weights and state tensors after each step (torch.initial_seed() fixed for the rounding)."""
    torch.manual_seed(0)
    init, grads = _problem(case)
    ps = [torch.nn.Parameter(x.clone()) for x in init]
    opt = _optimizer(ps, layout, bits, backend, CASES[case][2])
    out = []
    for gs in grads[:STEPS[backend]]:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
        state = {k: {n: v.clone() for n, v in st.items() if torch.is_tensor(v)}
                 for k, st in opt.state_dict()["state"].items()}
        out.append({"weights": [p.detach().clone() for p in ps], "state": state})
    return out


KEYS = [(layout, bits, backend, case) for (layout, bits) in SWITCHES for backend in BACKENDS for case in CASES]


@pytest.fixture(scope="module")
def saved():
    return torch.load(SAVED, weights_only=True)


@pytest.mark.parametrize("layout,bits,backend,case", KEYS)
def test_every_layout_steps_bit_for_bit_as_at_a61f9ed(layout, bits, backend, case, saved):
    from optim.backends import numba_available

    if backend == "numba" and not numba_available():
        pytest.skip("numba is not installed")
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs interpreted here only")
    old = saved[f"{layout}-{bits}-{backend}-{case}"]
    now = _trajectory(layout, bits, backend, case)
    assert len(now) == len(old)
    for t, (a, b) in enumerate(zip(now, old), 1):
        for i, (x, y) in enumerate(zip(a["weights"], b["weights"])):
            assert torch.equal(x, y), f"step {t}: parameter {i}'s weights differ"
        assert set(a["state"]) == set(b["state"]), f"step {t}"
        for k in b["state"]:
            assert set(a["state"][k]) == set(b["state"][k]), (t, k)
            for n, y in b["state"][k].items():
                assert torch.equal(a["state"][k][n], y), f"step {t}: parameter {k}'s {n} differs"


if __name__ == "__main__":  # copied into a checkout of a61f9ed (module docstring): write SAVED there
    torch.save({f"{layout}-{bits}-{backend}-{case}": _trajectory(layout, bits, backend, case)
                for layout, bits, backend, case in KEYS}, sys.argv[1])
