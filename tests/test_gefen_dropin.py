"""Gefen as a drop-in for ``torch.optim.AdamW`` on the inputs AdamW takes: float64 and bf16 parameters,
strided and non-finite gradients, ``maximize``, parameter versions, casts after construction.

Independent references: ``torch.optim.AdamW`` (float64 reduction, deep copies, maximize, versions);
the state layout of ``optim/gefen/state.py``. Arguments, state dicts, first gradients and rounding
have files of their own (``tests/README.md``).
"""

import copy

import pytest
import torch

from optim import Gefen
from optim.gefen import layout_of
from optim.gefen import state as K
from tests.utils import ADAMW, assert_close, mlp_params, row_growing_grads, row_scaled_grad

# ----------------------------------------------------------------------------- AdamW reduction


def test_float64_parameters_keep_float64_moments_and_reduce_to_adamw():
    """Both switches off, float64: 30 steps within 1e-13 of AdamW in float64 (fp32 moments were
    ~1e-7 away). Not bitwise: AdamW runs its foreach kernels, Gefen generic ops on padded rows."""
    shapes = [(24, 48), (300,), (1,)]
    ps = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in shapes]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ours = Gefen(ps, lr=1e-2, weight_decay=0.1, layout="adamw")
    ref = torch.optim.AdamW(qs, lr=1e-2, weight_decay=0.1)
    for _ in range(30):
        for p, q in zip(ps, qs):
            p.grad = torch.randn(p.shape, dtype=torch.float64)
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
    for p, q in zip(ps, qs):
        assert ours.state[p][K.V].dtype == ours.state[p][K.M].dtype == torch.float64
        assert_close(p.detach(), q.detach(), atol=1e-13, name="float64 p vs AdamW")
        assert_close(ours.state[p][K.M], ref.state[q]["exp_avg"].reshape(-1), atol=1e-15, name="m")


# ------------------------------------------------------------------------ torch protocol


def test_deepcopy_is_independent_and_continues_like_the_original():
    ps = [torch.nn.Parameter(torch.randn(s)) for s in [(16, 96), (300,)]]
    opt = Gefen(ps, layout="published", lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        for p in ps:
            p.grad = row_scaled_grad(p.shape) if p.dim() > 1 else torch.randn(p.shape)
        opt.step()
    opt2 = copy.deepcopy(opt)
    ps2 = opt2.param_groups[0]["params"]
    assert all(p2 is not p for p, p2 in zip(ps, ps2))
    assert opt2.state[ps2[0]][K.CODES].data_ptr() != opt.state[ps[0]][K.CODES].data_ptr()
    for p, p2 in zip(ps, ps2):
        p2.grad = p.grad.clone()
    opt.step()
    opt2.step()
    assert torch.equal(opt2.codebook, opt.codebook)
    for p, p2 in zip(ps, ps2):
        assert torch.equal(p, p2)
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[p2][k]) if torch.is_tensor(v) else v == opt2.state[p2][k]


# ------------------------------------------------------------------------------ arguments


@pytest.mark.parametrize("alias", ["v_as_int32", "v_shorter", "codes_as_int8", "scales_strided"])
def test_triton_launch_cache_checks_a_state_tensor_at_a_known_address(alias):
    """A tensor at the address of one launched before (a view of it) is checked again, not taken
    from the launch cache."""
    from optim.gefen import reference as R, triton_ops
    from optim.gefen.codebook import code_table
    from optim.gefen.plan import Hyper, Tile

    cb = torch.linspace(-1, 1, 256)
    n, block = 4096, 64
    p, g = torch.randn(n), torch.randn(n)
    v, s, c = R.init_state(n, block=block, bits=8)
    kw = dict(tables=code_table(cb), block=block, bits=8)
    hyper = Hyper(1, 1e-3, 0.9, 0.999, 1e-8, 0.0)
    triton_ops.gefen_step_([Tile(p, v, s, c)], [g], cb, hyper, **kw)
    bad = {"v_as_int32": Tile(p, v.view(torch.int32), s, c), "v_shorter": Tile(p, v[:-1], s, c),
           "codes_as_int8": Tile(p, v, s, c.view(torch.int8)),
           "scales_strided": Tile(p, v, s.view(-1, 2)[:, 0], c)}[alias]
    with pytest.raises(ValueError):
        triton_ops.gefen_step_([bad], [g], cb, hyper, **kw)


# ------------------------------------------------------------------- non-finite gradients later on


@pytest.mark.parametrize("backend", ["torch", "numba", "triton"])
@pytest.mark.parametrize("spike", [1e20, float("inf"), float("nan")], ids=["overflow", "inf", "nan"])
def test_one_bad_element_leaves_the_factor_and_the_other_blocks_alone(backend, spike):
    """With the factored second moment, one gradient element whose square is not finite (at step 3
    of 5) keeps the factor finite and positive, and every parameter outside the element's blocks
    stays within a few learning rates of the same run without that element. (Random gradients get
    block length 1 here, so the element's scale block is its chunk of 256: rows 6 and 7.)"""
    runs = []
    for bad in (None, spike):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64, 128) * 0.1)
        opt = Gefen([p], lr=1e-2, layout="factored", backend=backend)
        gen = torch.Generator().manual_seed(1)
        for t in range(5):
            p.grad = torch.randn(64, 128, generator=gen)
            if t == 2 and bad is not None:
                p.grad[7, 5] = bad
            opt.step()
        w = opt.state[p]["w"]
        assert bool(torch.isfinite(w).all()) and float(w.min()) > 0
        runs.append(p.detach().clone())
    diff = (runs[1] - runs[0]).abs()
    diff[6:8] = 0  # the element's own scale block
    assert float(diff.max()) < 0.05, float(diff.max())


@pytest.mark.parametrize("backend", ["torch", "numba", "triton"])
def test_an_inf_gradient_after_the_first_step_does_not_crash(backend):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(300))
    opt = Gefen([p], layout="published", lr=1e-2, backend=backend)
    for t in range(3):
        p.grad = torch.randn(300)
        if t == 1:
            p.grad[10] = float("inf")
        opt.step()
    assert opt.state[p]["step"] == 3


# ------------------------------------------------------------------- strided gradients in the kernels


@pytest.mark.parametrize("backend", ["numba", "triton"])
@pytest.mark.parametrize("layout", ["transposed", "column_slice"])
@pytest.mark.parametrize("quant", [True, False], ids=["codes", "fp32_m"])
def test_strided_gradients_step_as_their_contiguous_copies(backend, layout, quant):
    """A gradient that is not contiguous (a transposed dense one, a slice of columns) is stepped from
    a contiguous copy that must live until the kernel has read it: the step equals the torch
    step's on the same values. (A copy freed before the launch leaves the kernel reading freed
    memory: garbage in v and the weights.)"""
    from optim.gefen import numba_ops, reference as R, torch_ops, triton_ops
    from optim.gefen.codebook import code_table
    from optim.gefen.plan import Hyper, Tile

    fn = {"numba": numba_ops, "triton": triton_ops}[backend].gefen_step_
    torch.manual_seed(0)
    shapes, block = [(48, 40), (40, 64)], 8
    p0 = [torch.randn(s) for s in shapes]
    dense = [torch.randn(s) for s in shapes]
    strided = ([g.t().contiguous().t() for g in dense] if layout == "transposed"
               else [torch.cat([g, torch.randn(g.shape)], dim=1)[:, :g.shape[1]] for g in dense])
    assert not any(g.is_contiguous() for g in strided) and all(torch.equal(a, b) for a, b in zip(dense, strided))
    cb = torch.linspace(-1, 1, 256) if quant else None
    out = {}
    for name, step, gs in (("torch", torch_ops.gefen_step_, dense), (backend, fn, strided)):
        ps = [p.clone() for p in p0]
        st = [R.init_state(p.numel(), block=block, bits=8, quantized=quant) for p in ps]
        tiles = [Tile(p, s[0], s[1] if quant else None, s[-1]) for p, s in zip(ps, st)]
        for t in (1, 2):
            step(tiles, gs, cb, Hyper(t, 1e-2, 0.9, 0.999, 1e-8, 0.1), tables=code_table(cb) if quant else None,
                 block=block, bits=8)
        out[name] = (ps, [x.v for x in tiles], [x.first for x in tiles])
    for (a, va, ca), (b, vb, cb_) in [(out["torch"], out[backend])]:
        for i in range(len(shapes)):
            assert_close(b[i], a[i], atol=1e-6, name=f"p[{i}]")
            assert_close(vb[i], va[i], rtol=1e-5, name=f"v[{i}]")
            if quant:
                assert torch.equal(cb_[i], ca[i]), f"codes[{i}] differ"


# ------------------------------------------------- dtypes, versions and gradients left as given


def _steps(opt, params, steps, start=0):
    for t in range(start, start + steps):
        for p, g in zip(params, row_growing_grads(t, params)):
            p.grad = g
        opt.step()


@pytest.mark.parametrize("default", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_state_dtypes_do_not_follow_the_default_dtype(default, backend):
    """fp32 parameters stepped under another ``torch.get_default_dtype()`` keep fp32 state and step
    as under the fp32 default (bit for bit), and a state dict saved there loads under the fp32
    default; AdamW's
    reduction with a factor (per element, so a no-op) matches ``torch.optim.AdamW``."""
    runs = {}
    for dflt in (torch.float32, default):
        ps, ps2 = mlp_params(), mlp_params()
        old = torch.get_default_dtype()
        torch.set_default_dtype(dflt)
        try:
            opt = Gefen(ps, lr=1e-2, backend=backend, layout="factored")
            _steps(opt, ps, 3)
            sd = opt.state_dict()
            ref, ours = mlp_params(), mlp_params()
            adamw = Gefen(ours, lr=1e-2, weight_decay=0.1, backend="torch",
                          layout=layout_of("adamw").replace(factor_second_moment=True))
            _steps(adamw, ours, 3)
        finally:
            torch.set_default_dtype(old)
        Gefen(ps2, lr=1e-2, backend=backend, layout="factored").load_state_dict(sd)  # loads under fp32
        _steps(torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1), ref, 3)
        for a, b in zip(ours, ref):
            assert_close(a, b, atol=1e-6, rtol=1e-5)
        for st in opt.state.values():
            for key in (K.SCALES, K.W, K.V):
                assert st[key].dtype == torch.float32, (key, st[key].dtype)
        runs[dflt] = [p.detach().clone() for p in ps]
    for a, b in zip(runs[torch.float32], runs[default]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["torch", "numba", "triton"])
def test_a_step_bumps_the_version_of_the_parameters_as_adamw(backend):
    """A graph retained over a step (a GAN loop's second backward) must see that the weights
    changed: autograd's in-place error, as with AdamW, never the new weights silently."""
    w = torch.nn.Parameter(torch.randn(32, 32))
    opt = Gefen([w], layout="published", lr=1e-2, backend=backend)
    x = torch.randn(4, 32, requires_grad=True)
    for _ in range(2):  # the first step learns the codebook; the second is the plan's fast path
        loss = (x @ w).tanh().sum()
        loss.backward(retain_graph=True)
        before = w._version
        opt.step()
        assert w._version > before
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        opt.zero_grad()


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("quant", [True, False], ids=["codes", "adamw"])
def test_maximize_with_one_gradient_shared_by_two_parameters(backend, quant):
    """One gradient tensor (or one storage) given to two parameters: each steps on -g once, as
    AdamW(maximize=True); the gradient is left as it was."""
    kw = {"layout": "published"} if quant else ADAMW
    a, b = torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(16, 8))
    c, d = torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone())
    up = Gefen([a, b], lr=1e-2, maximize=True, backend=backend, **kw)
    down = Gefen([c, d], lr=1e-2, backend=backend, **kw)
    for t in range(3):
        g = row_scaled_grad((16, 8))
        a.grad = b.grad = g  # one tensor
        c.grad, d.grad = -g, -g.clone()
        kept = g.clone()
        up.step()
        down.step()
        assert torch.equal(g, kept)
    assert torch.equal(a, c) and torch.equal(b, d)
    storage = torch.randn(2, 16, 8)
    e, f = torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(16, 8))
    e2, f2 = torch.nn.Parameter(e.detach().clone()), torch.nn.Parameter(f.detach().clone())
    opt = Gefen([e, f], lr=1e-2, maximize=True, backend=backend, **ADAMW)
    ref = torch.optim.AdamW([e2, f2], lr=1e-2, weight_decay=0.0, maximize=True)
    for t in range(3):
        storage.normal_()
        e.grad, f.grad = storage[0], storage[0].view(16, 8)  # one storage, two tensors
        e2.grad, f2.grad = storage[0].clone(), storage[0].clone()
        opt.step()
        ref.step()
    assert_close(e, e2, atol=1e-6, rtol=1e-5, name="e")
    assert_close(f, f2, atol=1e-6, rtol=1e-5, name="f")


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_maximize_takes_create_graph_and_expanded_gradients_as_adamw(backend):
    """maximize never writes into ``p.grad``: a gradient that requires grad (``create_graph=True``)
    and an expanded one (stride 0) step as AdamW(maximize=True) steps them."""
    ours, ref = mlp_params(), mlp_params()
    opt = Gefen(ours, lr=1e-2, maximize=True, backend=backend, **ADAMW)
    adamw = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0, maximize=True)
    x = torch.randn(5, 16)
    for _ in range(3):
        for ps, o in ((ours, opt), (ref, adamw)):
            o.zero_grad()
            loss = (x @ ps[0].t() + ps[1]).pow(2).sum()
            loss.backward(create_graph=True)
            assert ps[0].grad.requires_grad
            ps[1].grad = torch.randn(1, generator=torch.Generator().manual_seed(3)).expand(24)
            o.step()
    for a, b in zip(ours, ref):
        assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("cast", ["float", "double"])
def test_a_cast_after_construction_is_followed_as_a_state_dict_loaded_after_it(cast):
    """AdamW's reduction keeps float64 moments for float64 parameters; ``model.float()`` (or
    ``.double()``) after the optimizer was built casts them with the parameter, as
    ``torch.optim.AdamW.load_state_dict`` does for a state dict loaded after the cast."""
    start, end = (torch.float64, torch.float32) if cast == "float" else (torch.float32, torch.float64)
    ours = [torch.nn.Parameter(p.detach().to(start)) for p in mlp_params()]
    ref = [torch.nn.Parameter(p.detach().to(start)) for p in mlp_params()]
    opt = Gefen(ours, lr=1e-2, weight_decay=0.1, **ADAMW)
    adamw = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    _steps(opt, ours, 2)
    _steps(adamw, ref, 2)
    for p in ours + ref:
        p.data = p.data.to(end)
    sd = adamw.state_dict()
    adamw = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    adamw.load_state_dict(sd)  # casts the moments to the parameters' dtype
    _steps(opt, ours, 2, start=2)
    _steps(adamw, ref, 2, start=2)
    for p, q in zip(ours, ref):
        assert opt.state[p][K.STEP] == 4 and opt.state[p][K.V].dtype == end
        assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_a_step_the_kernel_refuses_is_not_counted():
    """A step refused by the compiled kernel's checks (a state tensor replaced by a strided one)
    leaves the step count alone; with the state put back, the next step is the uninterrupted run's."""
    ps, ref = mlp_params(), mlp_params()
    opt = Gefen(ps, layout="published", lr=1e-2, backend="numba")
    opt_ref = Gefen(ref, layout="published", lr=1e-2, backend="numba")
    _steps(opt, ps, 1)
    _steps(opt_ref, ref, 2)
    st = opt.state[ps[0]]
    good = st[K.V]
    st[K.V] = torch.zeros(2 * good.numel())[::2]
    for p, g in zip(ps, row_growing_grads(1, ps)):
        p.grad = g
    with pytest.raises(ValueError, match="contiguous"):
        opt.step()
    assert st[K.STEP] == 1
    st[K.V] = good
    _steps(opt, ps, 1, start=1)
    for p, q in zip(ps, ref):
        assert opt.state[p][K.STEP] == 2
        assert torch.equal(p, q)
