"""Gefen under the cases of PyTorch's optimizer test suite (``TestOptimRenewed`` with AdamW's
``OptimizerInfo``) particular to Gefen, on CPU, written here in our own words: per-group
``weight_decay``, ``betas`` and ``eps`` in float32 and float64 against ``torch.optim.AdamW``
(``share_second_moment=False, quantize_first_moment=False`` is AdamW), zero first gradients, the
codebook in state-dict hooks, complex parameters, upstream keywords.

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

BACKENDS = ["torch", "numba", "triton"]
ADAMW = dict(share_second_moment=False, quantize_first_moment=False)
SHAPES = [(5, 6), (5,), (300,)]


def _params(dtype=torch.float32, shapes=SHAPES):
    g = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]


def _twin(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]


def _set(params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()


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
    ours_p = _params(dtype)
    ref_p = _twin(ours_p)

    def groups(ps):
        return [{"params": ps[:1], "weight_decay": 0.1},
                {"params": ps[1:], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.99),
                 "eps": 1e-6}]

    ours = Gefen(groups(ours_p), lr=1e-2, backend=backend, **ADAMW)
    ref = torch.optim.AdamW(groups(ref_p), lr=1e-2)
    for t in range(8):
        grads = _grads(ours_p, t)
        _set(ours_p, grads), _set(ref_p, grads)
        ours.step(), ref.step()
    _assert_params_close(ours_p, ref_p, dtype)


# ------------------------------------------------------------------ quantised
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_first_gradients_leave_params_alone_without_decay(backend):
    """With m = v = 0, AdamW's update at g = 0 is zero: the quantised default leaves the
    parameters unchanged over all-zero first gradients, then steps once real ones arrive."""
    ps = _params()
    before = [p.detach().clone() for p in ps]
    opt = Gefen(ps, lr=1e-2, backend=backend)
    for _ in range(2):
        _set(ps, [torch.zeros_like(p) for p in ps])
        opt.step()
    for p, b in zip(ps, before):
        assert torch.equal(p, b)
    _set(ps, _grads(ps, 0))
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(ps, before))


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "quantised"])
def test_state_dict_hooks_see_the_codebook(adamw):
    """state_dict's post-hook sees the dict state_dict() returns, codebook included, and its edits
    last; load_state_dict's post-hook sees the loaded codebook (none reduced to AdamW)."""
    kw = ADAMW if adamw else {}
    ps = _params()
    opt = Gefen(ps, lr=1e-2, **kw)
    _set(ps, _grads(ps, 0))
    opt.step()
    sd = opt.state_dict()
    seen = {}
    other = Gefen(_twin(ps), **kw)
    other.register_load_state_dict_post_hook(lambda o: seen.update(codebook=o.codebook))
    other.load_state_dict(sd)
    if adamw:
        assert seen["codebook"] is None
        return
    assert torch.equal(seen["codebook"], opt.codebook)

    def post(o, sd):
        sd["saw_codebook"] = torch.equal(sd["codebook"], o.codebook)
        sd["codebook"] = sd["codebook"].double()
        return sd

    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert sd["saw_codebook"] is True and sd["codebook"].dtype == torch.float64


# ------------------------------------------------------------------ argument errors
def test_complex_params_refused_clearly():
    """Complex parameters are refused at construction and in add_param_group, pointing to
    view_as_real, rather than stepping wrongly."""
    z = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="complex"):
        Gefen([z])
    opt = Gefen(_params())
    with pytest.raises(ValueError, match="view_as_real"):
        opt.add_param_group({"params": [z]})


def test_upstream_keywords_accepted():
    """``fused`` and ``verbose`` (AdamW's and upstream Gefen's keywords) are accepted."""
    ps = _params()
    opt = Gefen(ps, fused=False, verbose=False)
    _set(ps, _grads(ps, 0))
    opt.step()
    assert opt.backend == "torch"
