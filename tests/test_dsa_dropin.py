"""DiskSparseAdam as a drop-in for torch.optim.SparseAdam, run side by side on the same inputs.

The cases follow PyTorch's own optimizer tests for SparseAdam (``TestOptimRenewed`` with its
``OptimizerInfo``): constructor errors, live ``step``, checkpoints in both directions, state-dict
hooks, 1-D parameters and element-sparse gradients, tensor ``lr`` and ``deepcopy``.
"""

import copy

import pytest
import torch

from optim import DiskSparseAdam

N, DIM = 20, 5


def _pair(shape=(N, DIM), seed=0, dtype=torch.float32, **kw):
    """The same initial parameter under SparseAdam and DiskSparseAdam."""
    torch.manual_seed(seed)
    w = torch.randn(shape, dtype=dtype)
    p_ref, p_dsa = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    return p_ref, torch.optim.SparseAdam([p_ref], **kw), p_dsa, DiskSparseAdam([p_dsa], **kw)


def _row_grad(shape, t):
    """A row-sparse gradient (sparse_dim 1) with duplicate rows; depends only on t."""
    gen = torch.Generator().manual_seed(1000 + t)
    idx = torch.randint(0, shape[0], (7,), generator=gen)
    vals = torch.randn((7,) + tuple(shape[1:]), generator=gen)
    return torch.sparse_coo_tensor(idx[None], vals, shape)


def _element_grad(shape, t):
    """An element-sparse gradient (sparse_dim == dim), what ``dense.to_sparse()`` gives."""
    gen = torch.Generator().manual_seed(2000 + t)
    dense = torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) < 0.3)
    return dense.to_sparse()


def _steps(pairs, grad_fn, t0, t1):
    for t in range(t0, t1):
        for p, opt in pairs:
            p.grad = grad_fn(p.shape, t)
            opt.step()


def _assert_bitwise(a, b, name):
    assert torch.equal(a, b), f"{name}: max|diff| {(a.double() - b.double()).abs().max().item():.3e}"


# -- constructor errors -------------------------------------------------------------------------------
def test_tensor_params_raise_torchs_type_error():
    emb = torch.nn.Embedding(N, DIM, sparse=True)
    with pytest.raises(TypeError) as ref:
        torch.optim.SparseAdam(emb.weight)
    with pytest.raises(TypeError) as ours:
        DiskSparseAdam(emb.weight)
    assert "iterable" in str(ours.value) and "iterable" in str(ref.value)


@pytest.mark.parametrize("kw", [
    pytest.param(dict(lr=-1e-2), id="lr-negative"),
    pytest.param(dict(lr=torch.tensor([1e-3, 1e-3])), id="lr-two-element-tensor"),
    pytest.param(dict(eps=-1.0), id="eps-negative"),
    pytest.param(dict(betas=(1.0, 0.999)), id="beta1-one"),
    pytest.param(dict(betas=(0.9, -0.1)), id="beta2-negative"),
])
def test_bad_hyperparameters_raise_sparseadams_type(kw):
    with pytest.raises(Exception) as ref:
        torch.optim.SparseAdam([torch.nn.Parameter(torch.zeros(N, DIM))], **kw)
    with pytest.raises(type(ref.value)):
        DiskSparseAdam([torch.nn.Parameter(torch.zeros(N, DIM))], **kw)


@pytest.mark.parametrize("param", [
    pytest.param(lambda: torch.zeros(N, DIM).to_sparse(), id="sparse-param"),
    pytest.param(lambda: torch.zeros(N, DIM, dtype=torch.complex64), id="complex-param"),
])
def test_bad_params_raise_sparseadams_type(param):
    with pytest.raises(Exception) as ref:
        torch.optim.SparseAdam([param()])
    with pytest.raises(type(ref.value)):
        DiskSparseAdam([param()])


def test_dense_gradient_raises_runtime_error_naming_the_fix():
    p = torch.nn.Parameter(torch.zeros(N, DIM))
    opt = DiskSparseAdam([p])
    p.grad = torch.ones(N, DIM)
    with pytest.raises(RuntimeError, match="sparse=True|Adam"):
        opt.step()
    opt.close()


# -- step and checkpoints ---------------------------------------------------------------------------
def test_state_step_is_live_and_an_int_like_sparseadams():
    p_ref, ref, p_dsa, dsa = _pair(lr=1e-2)
    _steps([(p_ref, ref), (p_dsa, dsa)], _row_grad, 0, 3)
    assert ref.state[p_ref]["step"] == 3
    assert dsa.state[p_dsa]["step"] == 3
    assert type(dsa.state[p_dsa]["step"]) is type(ref.state[p_ref]["step"])
    assert type(dsa.state_dict()["state"][0]["step"]) is type(ref.state_dict()["state"][0]["step"])
    dsa.close()


@pytest.mark.parametrize("lr", [pytest.param(1e-2, id="float-lr"), pytest.param(None, id="tensor-lr")])
def test_dsa_checkpoint_continues_bitwise_in_sparseadam(lr):
    lr = torch.tensor(1e-2) if lr is None else lr
    p_ref, ref, p_dsa, dsa = _pair(lr=lr)
    _steps([(p_dsa, dsa)], _row_grad, 0, 5)
    p_ref.data.copy_(p_dsa.data)
    ref.load_state_dict(dsa.state_dict())
    _steps([(p_ref, ref), (p_dsa, dsa)], _row_grad, 5, 12)
    _assert_bitwise(p_dsa.data, p_ref.data, "weights")
    _assert_bitwise(dsa.state_dict()["state"][0]["exp_avg"], ref.state[p_ref]["exp_avg"], "exp_avg")
    dsa.close()


@pytest.mark.parametrize("lr", [pytest.param(1e-2, id="float-lr"), pytest.param(None, id="tensor-lr")])
def test_sparseadam_checkpoint_continues_bitwise_in_dsa(lr):
    lr = torch.tensor(1e-2) if lr is None else lr
    p_ref, ref, p_dsa, dsa = _pair(lr=lr)
    _steps([(p_ref, ref)], _row_grad, 0, 5)
    p_dsa.data.copy_(p_ref.data)
    dsa.load_state_dict(ref.state_dict())
    assert dsa.state[p_dsa]["step"] == 5
    _steps([(p_ref, ref), (p_dsa, dsa)], _row_grad, 5, 12)
    _assert_bitwise(p_dsa.data, p_ref.data, "weights")
    dsa.close()


def test_tensor_lr_is_bitwise():
    p_ref, ref, p_dsa, dsa = _pair(lr=torch.tensor(3e-3))
    _steps([(p_ref, ref), (p_dsa, dsa)], _row_grad, 0, 10)
    _assert_bitwise(p_dsa.data, p_ref.data, "weights")
    dsa.close()


# -- hooks ------------------------------------------------------------------------------------------
def _hook_log(opt, log):
    def pre_load(o, sd):
        log.append("pre_load")
        sd = dict(sd)
        sd["param_groups"] = [dict(g, lr=0.125) for g in sd["param_groups"]]
        return sd

    opt.register_load_state_dict_pre_hook(pre_load)
    opt.register_load_state_dict_post_hook(lambda o: log.append(("post_load", o.param_groups[0]["lr"])))
    opt.register_state_dict_pre_hook(lambda o: log.append("pre_save"))

    def post_save(o, sd):
        log.append(("post_save", sorted(sd["state"][0])))
        sd["extra"] = 1
        return sd

    opt.register_state_dict_post_hook(post_save)


def test_state_dict_hooks_run_as_in_sparseadam():
    p_ref, ref, p_dsa, dsa = _pair(lr=1e-2)
    _steps([(p_ref, ref), (p_dsa, dsa)], _row_grad, 0, 2)
    logs = [], []
    _hook_log(ref, logs[0])
    _hook_log(dsa, logs[1])
    sds = ref.state_dict(), dsa.state_dict()
    assert sds[0]["extra"] == sds[1]["extra"] == 1
    ref.load_state_dict(sds[0])
    dsa.load_state_dict(sds[1])
    assert logs[0] == logs[1]
    assert dsa.param_groups[0]["lr"] == 0.125
    dsa.close()


# -- shapes SparseAdam takes ------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "numba", "auto"])
@pytest.mark.parametrize("shape,grad_fn", [
    pytest.param((N,), _row_grad, id="1d"),
    pytest.param((N,), _element_grad, id="1d-to_sparse"),
    pytest.param((N, DIM), _element_grad, id="2d-to_sparse"),
    pytest.param((N, 1), _element_grad, id="2d-one-column-to_sparse"),
])
def test_shapes_and_gradients_sparseadam_takes(shape, grad_fn, backend):
    p_ref, ref, p_dsa, dsa = _pair(shape=shape, lr=1e-2)
    dsa.close()
    dsa = DiskSparseAdam([p_dsa], lr=1e-2, backend=backend)
    _steps([(p_ref, ref), (p_dsa, dsa)], grad_fn, 0, 8)
    _assert_bitwise(p_dsa.data, p_ref.data, "weights")
    sd = dsa.state_dict()["state"][0]
    for key in ("exp_avg", "exp_avg_sq"):
        assert sd[key].shape == ref.state[p_ref][key].shape
        _assert_bitwise(sd[key], ref.state[p_ref][key], key)
    dsa.close()


def test_zero_column_table():
    p = torch.nn.Parameter(torch.zeros(N, 0))
    try:
        opt = DiskSparseAdam([p])
    except ValueError as exc:
        assert "column" in str(exc)
        return
    p.grad = torch.sparse_coo_tensor(torch.tensor([[1, 2]]), torch.zeros(2, 0), (N, 0))
    opt.step()
    opt.close()


# -- deepcopy ---------------------------------------------------------------------------------------
def test_deepcopy_is_independent_and_continues_as_the_original():
    p_ref, ref, p_dsa, dsa = _pair(lr=1e-2)
    _steps([(p_ref, ref), (p_dsa, dsa)], _row_grad, 0, 4)
    twin = copy.deepcopy(dsa)
    q = twin.param_groups[0]["params"][0]
    assert q is not p_dsa and torch.equal(q, p_dsa)
    assert twin.state_dir != dsa.state_dir
    assert twin.state[q]["step"] == 4
    _steps([(p_dsa, dsa), (q, twin), (p_ref, ref)], _row_grad, 4, 9)
    _assert_bitwise(q.data, p_dsa.data, "copy vs original")
    _assert_bitwise(q.data, p_ref.data, "copy vs SparseAdam")
    dsa.close()
    _steps([(q, twin)], _row_grad, 9, 10)  # the copy's files outlive the original's
    twin.close()


def test_deepcopy_with_fixed_state_dir_is_refused(tmp_path):
    p = torch.nn.Parameter(torch.zeros(N, DIM))
    opt = DiskSparseAdam([p], state_dir=tmp_path / "s")
    with pytest.raises(RuntimeError, match="state_dir"):
        copy.deepcopy(opt)
    opt.close()
