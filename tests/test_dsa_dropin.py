"""DiskSparseAdam as a drop-in for torch.optim.SparseAdam, run side by side on the same inputs:
1-D parameters and element-sparse gradients on the CPU backends, zero-column tables, dense gradients
(refused), and deepcopy's refusal of a fixed state_dir.

The protocol DiskSparseAdam shares with every optimizer here, including state dicts that continue
in SparseAdam and back, tensor ``lr``, hooks, deepcopy and PyTorch's constructor errors, is in
``tests/test_protocol.py``; SparseAdam's own errors are in ``tests/test_dsa_sparseadam_cases.py``.
"""

import copy

import pytest
import torch

from optim import DiskSparseAdam

N, DIM = 20, 5


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


# -- what neither takes ----------------------------------------------------------------------------
def test_dense_gradient_raises_runtime_error_naming_the_fix():
    p = torch.nn.Parameter(torch.zeros(N, DIM))
    opt = DiskSparseAdam([p])
    p.grad = torch.ones(N, DIM)
    with pytest.raises(RuntimeError, match="sparse=True|Adam"):
        opt.step()
    opt.close()


# -- shapes SparseAdam takes ------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "numba", "auto"])
@pytest.mark.parametrize("shape,grad_fn", [
    pytest.param((N,), _row_grad, id="1d"),
    pytest.param((N,), _element_grad, id="1d-to_sparse"),
    pytest.param((N, DIM), _element_grad, id="2d-to_sparse"),
    pytest.param((N, 1), _element_grad, id="2d-one-column-to_sparse"),
])
def test_shapes_and_gradients_sparseadam_takes(shape, grad_fn, backend):
    w = torch.randn(shape)
    p_ref, p_dsa = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    ref, dsa = torch.optim.SparseAdam([p_ref], lr=1e-2), DiskSparseAdam([p_dsa], lr=1e-2, backend=backend)
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
def test_deepcopy_with_fixed_state_dir_is_refused(tmp_path):
    p = torch.nn.Parameter(torch.zeros(N, DIM))
    opt = DiskSparseAdam([p], state_dir=tmp_path / "s")
    with pytest.raises(RuntimeError, match="state_dir"):
        copy.deepcopy(opt)
    opt.close()
