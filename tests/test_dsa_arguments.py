"""Disk Sparse Adam's arguments: parameters, gradients, hyperparameters and backends it cannot
take are refused at construction (or at the step, for a dense gradient) with an error that names
the fix, as are groups added after ``close()``.
"""

import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam, DiskSparseRiemannianAdam
from tests.utils import sparse_embedding


N, DIM = 200, 8


def test_add_param_group_after_close_is_refused(tmp_path):
    opt = DiskSparseAdam(sparse_embedding(N, DIM, seed=0).parameters(), state_dir=tmp_path / "a")
    opt.close()
    with pytest.raises(RuntimeError, match="closed"):
        opt.add_param_group({"params": [sparse_embedding(N, DIM, seed=1).weight]})
    assert not (tmp_path / "a" / "param0001.dsa").exists()


@pytest.mark.parametrize("kw, match", [
    pytest.param(dict(maximize="no"), "maximize", id="maximize-string"),
    pytest.param(dict(c=float("inf")), "c ", id="c-inf"),
    pytest.param(dict(exact="yes"), "exact", id="exact-string"),
])
def test_odd_arguments_are_refused(kw, match):
    from optim import DiskSparseRiemannianAdam

    cls = DiskSparseAdam if "maximize" in kw else DiskSparseRiemannianAdam
    with pytest.raises(ValueError, match=match):
        cls(sparse_embedding(N, DIM, seed=0).parameters(), **kw)


def test_dense_gradient_is_refused():
    emb = nn.Embedding(10, 3)  # sparse=False
    opt = DiskSparseAdam(emb.parameters())
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match=r"parameter 0 .*dense gradient.*sparse=True"):
        opt.step()
    opt.close()


@pytest.mark.parametrize("param,match", [
    pytest.param(nn.Parameter(torch.zeros(2, 3, 4)), "2-D", id="3-D"),
    pytest.param(nn.Parameter(torch.zeros(3, 4, dtype=torch.long), requires_grad=False), "floating", id="int"),
])
def test_bad_parameters(param, match):
    with pytest.raises(ValueError, match=match):
        DiskSparseAdam([param])


@pytest.mark.parametrize("kw,match", [
    ({"lr": 0.0}, "lr"), ({"lr": -1.0}, "lr"), ({"eps": 0.0}, "eps"), ({"betas": (1.0, 0.9)}, "betas"),
    ({"betas": (0.9, -0.1)}, "betas"), ({"backend": "cuda"}, "backend"),
])
def test_bad_hyperparameters(kw, match):
    with pytest.raises(ValueError, match=match):
        DiskSparseAdam(sparse_embedding(40, 6).parameters(), **kw)


@pytest.mark.parametrize("cls,backend,dtype,match", [
    pytest.param(DiskSparseAdam, "triton", torch.float64, "backend='triton' cannot update parameter 0", id="triton-f64"),
    pytest.param(DiskSparseAdam, "numba", torch.bfloat16, "backend='numba' cannot update parameter 0", id="numba-bf16"),
    pytest.param(DiskSparseRiemannianAdam, "numba", torch.bfloat16, "backend='numba' cannot update parameter 0",
                 id="ball-numba-bf16"),
    pytest.param(DiskSparseRiemannianAdam, "triton", torch.float64, "backend='triton' cannot update", id="ball-triton-f64"),
])
def test_backend_that_cannot_take_the_parameter_is_refused_at_construction(cls, backend, dtype, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        cls(sparse_embedding(10, 4, dtype=dtype).parameters(), backend=backend, state_dir=tmp_path)
    with cls(sparse_embedding(10, 4, dtype=dtype).parameters(), backend="auto", state_dir=tmp_path) as opt:  # "auto": torch
        assert opt.state_file(opt.param_groups[0]["params"][0]).rows == 10
