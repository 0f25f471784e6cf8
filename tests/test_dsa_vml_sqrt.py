"""Torch's own CPU sqrt, called from the tiled Disk Sparse Adam kernel (``optim/disk_sparse/vml_sqrt.py``).

The oracle is ``torch.sqrt`` itself and ``torch.optim.SparseAdam``; inputs are drawn fresh here, with
another generator than the module's own check.
"""

import copy
import ctypes

import pytest
import torch
import torch.nn as nn

from optim import DiskSparseAdam
from optim.disk_sparse import vml_sqrt

needs_vml = pytest.mark.skipif(vml_sqrt.address(torch.float32) is None,
                               reason="this torch build has no MKL vector sqrt (torch's sqrt is used instead)")


def test_vml_is_found_where_torch_uses_mkl():
    if torch.backends.mkl.is_available():
        # Torch built with MKL computes CPU sqrt with it; the fast bitwise path needs the symbols.
        # (Whether they reproduce torch.sqrt on this CPU is the next test's question; where they do
        # not, address() is None and the optimizer keeps torch's sqrt.)
        lib = vml_sqrt._library()
        assert lib is not None and lib.vmsSqrt and lib.vmdSqrt and lib.MKL_Set_Num_Threads_Local
        assert vml_sqrt.threads_local_address() != 0
    assert vml_sqrt.address(torch.float16) is None and vml_sqrt.address(torch.int64) is None


@needs_vml
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_vml_sqrt_reproduces_torch_sqrt_bitwise(dtype):
    fn = ctypes.CFUNCTYPE(None, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(
        vml_sqrt.address(dtype))
    gen = torch.Generator().manual_seed(2026)
    # Moments of Adam: squares of gradients of every magnitude, EMA-decayed.
    g = torch.randn(300, 77, generator=gen, dtype=torch.float64) * torch.logspace(-30, 8, 77, dtype=torch.float64)
    x = ((g * g) * torch.rand(300, 77, generator=gen, dtype=torch.float64)).to(dtype).contiguous()
    expected = x.sqrt()
    out = torch.empty_like(x)
    for row in range(x.shape[0]):  # one call per row, as a tile of one row would make it
        fn(x.shape[1], x[row].data_ptr(), out[row].data_ptr(), vml_sqrt.MODE)
    assert torch.equal(out, expected)
    flat = torch.empty_like(x)
    fn(x.numel(), x.data_ptr(), flat.data_ptr(), vml_sqrt.MODE)
    assert torch.equal(flat, expected)


def _train(dim, dtype, tmp_path, steps=60):
    """``steps`` steps of SparseAdam and DiskSparseAdam side by side, on one and two threads in turn;
    both must agree bitwise."""
    emb_ref = nn.Embedding(5000, dim, sparse=True, dtype=dtype)
    emb = copy.deepcopy(emb_ref)
    ref = torch.optim.SparseAdam(emb_ref.parameters(), lr=3e-2, betas=(0.8, 0.95), eps=1e-9)
    opt = DiskSparseAdam(emb.parameters(), lr=3e-2, betas=(0.8, 0.95), eps=1e-9, state_dir=tmp_path)
    gen = torch.Generator().manual_seed(dim)
    saved = torch.get_num_threads()
    try:
        _steps(emb_ref, ref, emb, opt, gen, dim, dtype, steps)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(emb.weight, emb_ref.weight)
    st = opt.state_dict()["state"][0]
    assert torch.equal(st["exp_avg"], ref.state[emb_ref.weight]["exp_avg"])
    assert torch.equal(st["exp_avg_sq"], ref.state[emb_ref.weight]["exp_avg_sq"])
    opt.close()


def _steps(emb_ref, ref, emb, opt, gen, dim, dtype, steps):
    for t in range(steps):
        torch.set_num_threads(1 + t % 2)
        # Rows once, twice (radix order) and many times (Tensor.sort order); gradients of mixed scales.
        idx = torch.cat([torch.randint(0, 5000, (300,), generator=gen), torch.randint(0, 20, (100,), generator=gen)])
        scale = torch.logspace(-6, 2, dim, dtype=dtype)
        target = torch.randn(idx.numel(), dim, generator=gen, dtype=dtype) * scale
        for e, o in ((emb_ref, ref), (emb, opt)):
            o.zero_grad()
            ((e(idx) - target) ** 2).sum().backward()
            o.step()


@needs_vml
@pytest.mark.parametrize("dim", [1, 37, 128, 3000])  # tiles of 2048, 55, 16 and 1 rows (a tail in each)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tiled_kernel_is_bitwise_sparse_adam(dim, dtype, tmp_path, monkeypatch):
    from optim.disk_sparse import _numba_kernels as K

    calls = []
    for name in ("tiled", "tiled_parallel"):  # ~320 unique rows a step: both run, on 1 and 2 threads
        real = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, real=real, name=name: (calls.append(name), real(*a)))
    _train(dim, dtype, tmp_path, steps=20 if dim == 3000 else 60)
    assert set(calls) == {"tiled", "tiled_parallel"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_without_vml_the_two_pass_path_is_bitwise_sparse_adam(dtype, tmp_path, monkeypatch):
    monkeypatch.setattr(vml_sqrt, "address", lambda dtype: None)
    from optim.disk_sparse import _numba_kernels as K

    monkeypatch.setattr(K, "tiled", None)  # would raise if called
    monkeypatch.setattr(K, "tiled_parallel", None)
    _train(37, dtype, tmp_path)


@needs_vml
@pytest.mark.skipif(not vml_sqrt.threads_local_address(), reason="no MKL_Set_Num_Threads_Local in torch's library")
@pytest.mark.parametrize("n_idx", [50, 600])  # the serial kernel and the parallel one
def test_tiled_kernel_leaves_mkl_threads_as_they_were(n_idx, tmp_path):
    """The kernel asks MKL for one thread per calling thread while it runs (MKL would otherwise thread
    every small tile) and must put the previous per-thread setting back."""
    lib = vml_sqrt._library()
    set_local = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(vml_sqrt.threads_local_address())
    max_threads = lib.mkl_get_max_threads
    max_threads.restype = ctypes.c_int
    emb = nn.Embedding(3000, 16, sparse=True)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with DiskSparseAdam(emb.parameters(), state_dir=tmp_path) as opt:
            for local in (0, 3):  # no per-thread setting, then one of 3 threads
                set_local(local)
                before = max_threads()
                emb(torch.randint(0, 3000, (n_idx,))).sum().backward()
                opt.step()
                assert max_threads() == before
                assert set_local(0) == local  # the per-thread setting in force after the step
    finally:
        set_local(0)
        torch.set_num_threads(saved)
