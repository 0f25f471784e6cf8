"""Gefen's constructor arguments: AdamW's and upstream gefen's keywords accepted at their
defaults, odd values, complex and sparse parameters, and backends that cannot update a parameter
refused at construction with an error that names the fix.
"""

import pytest
import torch

from optim import Gefen
from optim.backends import numba_available
from optim.gefen import state as K
from tests.utils import (ADAMW, row_scaled_grad, run_python, seeded_grads, seeded_params, set_or_clear_grads, tiny_mlp, train_steps)


def test_upstream_fused_and_verbose_keywords(capsys):
    """``fused=False`` is the torch step; ``fused=True`` (upstream's default) the compiled one
    where the device has it; ``verbose`` prints each tensor's block length when it is chosen."""
    p = torch.nn.Parameter(torch.randn(32, 256))
    assert Gefen([p], layout="published", fused=False).backend_of(p) == "torch"
    assert Gefen([p], layout="published", fused=True).backend_of(p) == "numba"
    with pytest.raises(ValueError, match="fused=False"):
        Gefen([p], layout="published", fused=False, backend="numba")
    opt = Gefen([p], layout="published", verbose=True)
    p.grad = row_scaled_grad((32, 256))
    opt.step()
    out = capsys.readouterr().out
    assert f"block {opt.state[p][K.BLOCK]}" in out and "(32, 256)" in out


@pytest.mark.parametrize("betas", [(0.9,), (0.9, 0.99, 0.999), 0.9], ids=["one", "three", "float"])
def test_betas_must_be_a_pair(betas):
    with pytest.raises(ValueError, match="betas must be two numbers"):
        Gefen([torch.nn.Parameter(torch.randn(4))], layout="published", betas=betas)


def test_triton_on_cpu_without_interpreter_says_what_to_do():
    r = run_python("""
        import torch
        from optim import Gefen
        try:
            Gefen([torch.nn.Parameter(torch.randn(4))], backend="triton")
        except RuntimeError as e:
            print("REFUSED", e)
        """, env_drop=("TRITON_INTERPRET",))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "REFUSED" in r.stdout and "TRITON_INTERPRET=1" in r.stdout and "backend='torch'" in r.stdout


def test_sparse_gradient_names_disk_sparse_adam():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = Gefen(emb.parameters(), layout="published")
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="DiskSparseAdam"):
        opt.step()


def test_complex_parameter_is_rejected():
    with pytest.raises(ValueError, match="complex"):
        Gefen([torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))], layout="published")


@pytest.mark.parametrize("kwargs,match", [({"bits": 3}, "bits"), ({"backend": "cuda"}, "backend"),
                                          ({"lr": -1.0}, "lr"), ({"betas": (0.9, 1.0)}, "betas"),
                                          ({"layout": "names"}, "layout")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Gefen([torch.nn.Parameter(torch.randn(4))], **kwargs)


def test_adamws_keywords_at_their_defaults_run_unchanged():
    """A configuration written for AdamW, all keywords spelled out at AdamW's defaults."""
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=False, maximize=False,
              foreach=None, capturable=False, differentiable=False, fused=None)
    ours, ref = tiny_mlp(), tiny_mlp()
    train_steps(ours, Gefen(ours.parameters(), **kw, **ADAMW), 5)
    train_steps(ref, torch.optim.AdamW(ref.parameters(), **kw), 5)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for name in ("amsgrad", "capturable", "differentiable"):
        with pytest.raises(ValueError, match=f"Gefen does not implement {name}=True"):
            Gefen(tiny_mlp().parameters(), **{name: True})
    with pytest.raises(ValueError, match="amsgrad must be True or False"):
        Gefen(tiny_mlp().parameters(), layout="published", amsgrad="no")


def test_odd_values_are_refused_at_construction():
    for bad in (dict(bits=8.0), dict(bits="8"), dict(layout="no"), dict(maximize="yes"),
                dict(layout=3), dict(backend="cuda")):
        with pytest.raises(ValueError):
            Gefen(tiny_mlp().parameters(), **bad)


SHAPES = [(5, 6), (5,), (300,)]


def test_complex_params_refused_clearly():
    """Complex parameters are refused at construction and in add_param_group, pointing to
    view_as_real, rather than stepping wrongly."""
    z = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="complex"):
        Gefen([z], layout="published")
    opt = Gefen(seeded_params(SHAPES), layout="published")
    with pytest.raises(ValueError, match="view_as_real"):
        opt.add_param_group({"params": [z]})


def test_upstream_keywords_accepted():
    """``fused`` and ``verbose`` (AdamW's and upstream Gefen's keywords) are accepted."""
    ps = seeded_params(SHAPES)
    opt = Gefen(ps, layout="published", fused=False, verbose=False)
    set_or_clear_grads(ps, seeded_grads(ps, 0))
    opt.step()
    assert opt.backend == "torch"


@pytest.mark.parametrize("backend", ["torch", pytest.param("numba", marks=pytest.mark.skipif(
    not numba_available(), reason="no numba"))])
def test_capturable_is_refused_off_the_triton_path(backend):
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(ValueError, match=r"Gefen does not implement capturable=True for parameter 0 of group 0 "
                                         rf"\(shape \(4, 4\).*would run on {backend}.*needs the Triton step"):
        Gefen(params, layout="published", backend=backend, capturable=True)
    with pytest.raises(ValueError, match="capturable=True for parameter 0 of group 0 .*on cpu.*(numba|torch)"):
        Gefen(params, layout="published", capturable=True)  # "auto" puts CPU tensors on numba or torch
