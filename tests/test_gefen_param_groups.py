"""Gefen under the cases of PyTorch's optimizer test suite (``TestOptimRenewed`` with AdamW's
``OptimizerInfo``) particular to Gefen, on CPU, written here in our own words: per-group
``weight_decay``, ``betas`` and ``eps`` in float32 and float64 against ``torch.optim.AdamW``
(``share_second_moment=False, quantize_first_moment=False`` is AdamW). The other cases of that
suite particular to Gefen live with their behaviour: zero first gradients in
``test_gefen_first_gradient.py``, the codebook in state-dict hooks in ``test_gefen_state_dict.py``,
complex parameters and upstream keywords in ``test_gefen_arguments.py``.

The protocol every optimizer shares (state dicts, deepcopy, hooks, closures, ``zero_grad``, late
groups, schedulers, PyTorch's constructor errors, ...) runs on Gefen, quantised and reduced to AdamW,
in ``tests/test_protocol.py``.

Not applicable here: CUDA-only cases (``test_state_dict_with_cuda_params``, capturable, fused
kernels, peak memory), AdamW-only keywords Gefen does not take (``amsgrad``, ``maximize``,
``foreach``, ``differentiable``, ``capturable``), and ``test_can_load_older_state_dict``
(it loads AdamW's own older formats; Gefen has a single state format).
"""

import pytest
import torch

from optim import Gefen
from tests.utils import ADAMW, seeded_grads, seeded_params, set_or_clear_grads, twin_params

BACKENDS = ["torch", "numba", "triton"]
SHAPES = [(5, 6), (5,), (300,)]


def _tol(dtype):
    return dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)


def _assert_params_close(ours, ref, dtype=torch.float32):
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.detach(), q.detach(), **_tol(dtype))


# ------------------------------------------------------------------ AdamW reduction cases
@pytest.mark.parametrize("backend,dtype", [(b, torch.float32) for b in BACKENDS] + [("torch", torch.float64)],
                         ids=[f"{b}-float32" for b in BACKENDS] + ["torch-float64"])
def test_param_groups_different_lr_and_weight_decay(backend, dtype):
    """Groups with their own lr, weight_decay, betas and eps step as AdamW's groups do (float64
    moments on the torch step only: the compiled ones refuse them)."""
    ours_p = seeded_params(SHAPES, dtype)
    ref_p = twin_params(ours_p)

    def groups(ps):
        return [{"params": ps[:1], "weight_decay": 0.1},
                {"params": ps[1:], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.99),
                 "eps": 1e-6}]

    ours = Gefen(groups(ours_p), lr=1e-2, backend=backend, **ADAMW)
    ref = torch.optim.AdamW(groups(ref_p), lr=1e-2)
    for t in range(8):
        grads = seeded_grads(ours_p, t)
        set_or_clear_grads(ours_p, grads), set_or_clear_grads(ref_p, grads)
        ours.step(), ref.step()
    _assert_params_close(ours_p, ref_p, dtype)
