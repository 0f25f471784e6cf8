"""Gefen against bad input and as a drop-in for ``torch.optim.AdamW``.

Independent references: ``torch.optim.AdamW`` (zero-gradient steps, float64 reduction,
deep copies, torch's optimizer protocol); the state layout of ``optim/gefen/state.py``. Anything
that could crash the interpreter inside compiled code runs in a subprocess, so a crash is a
failure of one test, not the end of the run.
"""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from optim import Gefen
from optim.gefen import state as K
from tests.utils import assert_close, row_scaled_grad

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_python(code: str, env_drop=(), timeout=300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------ state dicts and compiled code

_CAST_SCRIPT = """
import torch
from optim import Gefen
torch.manual_seed(0)
m = torch.nn.Linear(512, 512); opt = Gefen(m.parameters(), backend="numba")
m(torch.randn(8, 512)).sum().backward(); opt.step(); sd = opt.state_dict()
CAST
opt2 = Gefen(m.parameters(), backend="numba")
try:
    opt2.load_state_dict(sd)
except ValueError as e:
    print("REFUSED", e)
else:
    m.zero_grad(); m(torch.randn(8, 512)).sum().backward(); opt2.step()
    print("STEPPED")
"""

_CASTS = {
    "floats_to_bf16": """
for st in sd["state"].values():
    for k, v in st.items():
        if torch.is_tensor(v) and v.is_floating_point(): st[k] = v.bfloat16()
""",
    "codes_to_float": """
for st in sd["state"].values():
    st["codes"] = st["codes"].float()
""",
    "codes_to_int64": """
for st in sd["state"].values():
    st["codes"] = st["codes"].long()
""",
    "v_to_float64": """
for st in sd["state"].values():
    st["v"] = st["v"].double()
""",
    "codes_truncated": """
for st in sd["state"].values():
    st["codes"] = st["codes"][:-1].clone()
""",
    "v_2d": """
for st in sd["state"].values():
    st["v"] = st["v"].view(1, -1)
""",
    "v_missing": """
for st in sd["state"].values():
    del st["v"]
""",
    "step_float": """
for st in sd["state"].values():
    st["step"] = 1.5
""",
}


@pytest.mark.parametrize("cast", list(_CASTS), ids=list(_CASTS))
def test_state_dict_of_other_dtype_or_shape_is_refused_at_load(cast):
    """The issue's reproducer (Linear 512x512, numba step) with each kind of foreign state."""
    r = _run_python(_CAST_SCRIPT.replace("CAST", _CASTS[cast]))
    assert r.returncode == 0, f"crashed (rc {r.returncode}): {r.stderr[-2000:]}"
    assert "REFUSED Gefen.load_state_dict" in r.stdout, r.stdout + r.stderr[-2000:]


def test_state_dict_of_noncontiguous_tensors_is_loaded_contiguous():
    """A strided copy of the right dtype and size is the same state: loaded as a contiguous copy."""
    p = torch.nn.Parameter(torch.randn(16, 96))
    opt = Gefen([p], backend="numba")
    p.grad = row_scaled_grad((16, 96))
    opt.step()
    sd = opt.state_dict()
    st = sd["state"][0]
    for k in (K.V, K.SCALES, K.CODES):
        st[k] = torch.stack([st[k], st[k]], dim=1)[:, 0]
        assert not st[k].is_contiguous()
    opt2 = Gefen([torch.nn.Parameter(p.detach().clone())], backend="numba")
    opt2.load_state_dict(sd)
    for k in (K.V, K.SCALES, K.CODES):
        assert opt2.state[opt2.param_groups[0]["params"][0]][k].is_contiguous()


_LAUNCH_SCRIPT = """
import torch
from optim.gefen import numba_ops, reference as R
from optim.gefen.codebook import code_table
cb = torch.linspace(-1, 1, 256)
n, block = 4096, 64
def state():
    v, s, c = R.init_state(n, block=block, bits=8)
    return v, s, c
bad = {
    "v_bf16": lambda v, s, c: (v.bfloat16(), s, c),
    "v_short": lambda v, s, c: (v[:-1].clone(), s, c),
    "scales_f64": lambda v, s, c: (v, s.double(), c),
    "codes_float": lambda v, s, c: (v, s, c.float()),
    "codes_short": lambda v, s, c: (v, s, c[:-1].clone()),
    "v_strided": lambda v, s, c: (torch.zeros(2 * v.numel())[::2], s, c),
}
for name, f in bad.items():
    v, s, c = f(*state())
    p, g = torch.randn(n), torch.randn(n)
    try:
        numba_ops.gefen_step_([p], [g], [v], [s], [c], cb, tables=code_table(cb), step=1, lr=1e-3,
                              beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, block=block, bits=8)
    except ValueError as e:
        print("REFUSED", name, e)
    else:
        print("LAUNCHED", name)
p, g = torch.randn(n), torch.randn(n + 1)
try:
    numba_ops.gefen_step_([p], [g], *[[t] for t in state()], cb, tables=code_table(cb), step=1,
                          lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, block=block, bits=8)
except ValueError as e:
    print("REFUSED", "g_long", e)
"""


def test_numba_step_checks_every_state_tensor_before_launch():
    r = _run_python(_LAUNCH_SCRIPT)
    assert r.returncode == 0, f"crashed (rc {r.returncode}): {r.stderr[-2000:]}"
    for name in ("v_bf16", "v_short", "scales_f64", "codes_float", "codes_short", "v_strided", "g_long"):
        assert f"REFUSED {name}" in r.stdout, r.stdout + r.stderr[-2000:]


_MUTATED_SCRIPT = """
import torch
from optim import Gefen
p = torch.nn.Parameter(torch.randn(256, 256)); opt = Gefen([p], backend=BACKEND)
p.grad = torch.randn(256, 256); opt.step()
opt.state[p]["v"] = opt.state[p]["v"].bfloat16()
try:
    opt.step()
except ValueError as e:
    print("REFUSED", e)
"""


@pytest.mark.parametrize("backend", ["numba", "triton"])
def test_state_changed_after_load_is_refused_before_launch(backend):
    r = _run_python(_MUTATED_SCRIPT.replace("BACKEND", repr(backend)))
    assert r.returncode == 0, f"crashed (rc {r.returncode}): {r.stderr[-2000:]}"
    assert "REFUSED" in r.stdout and "float32" in r.stdout, r.stdout + r.stderr[-2000:]


# ----------------------------------------------------------------------------- AdamW reduction


def test_float64_parameters_keep_float64_moments_and_reduce_to_adamw():
    """Both switches off, float64: 30 steps within 1e-13 of AdamW in float64 (fp32 moments were
    ~1e-7 away). Not bitwise: AdamW runs its foreach kernels, Gefen generic ops on padded rows."""
    shapes = [(24, 48), (300,), (1,)]
    ps = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in shapes]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ours = Gefen(ps, lr=1e-2, weight_decay=0.1, share_second_moment=False,
                 quantize_first_moment=False)
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


# ---------------------------------------------------------------------- first gradients


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_zero_first_gradients_match_adamw_and_blocks_come_from_first_nonzero(backend):
    """Three all-zero gradients (a zero-initialised layer): no state but the step count, and the
    parameters are AdamW's (weight decay only, bitwise). The first non-zero gradient then chooses
    a block > 1: about one byte a parameter, not block 1's five."""
    shape = (32, 256)
    p = torch.nn.Parameter(torch.randn(shape))
    q = torch.nn.Parameter(p.detach().clone())
    ours = Gefen([p], lr=1e-2, weight_decay=0.1, backend=backend)
    ref = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        p.grad, q.grad = torch.zeros(shape), torch.zeros(shape)
        ours.step()
        ref.step()
        assert torch.equal(p, q)
        assert set(ours.state[p]) == {K.STEP} and ours.codebook is None
    assert ours.state[p][K.STEP] == 3
    p.grad = row_scaled_grad(shape)
    ours.step()
    st = ours.state[p]
    per_param = sum(st[k].numel() * st[k].element_size() for k in (K.V, K.SCALES, K.CODES)) / p.numel()
    assert st[K.BLOCK] >= 256 and per_param <= 1 + 8 / 256 and st[K.STEP] == 4


def test_zero_first_gradients_then_adamw_trajectory_with_switches_off():
    """Both switches off, zero gradients at steps 1-2: the whole trajectory is AdamW's, whose bias
    corrections count the zero-gradient steps."""
    p = torch.nn.Parameter(torch.randn(16, 96))
    q = torch.nn.Parameter(p.detach().clone())
    ours = Gefen([p], lr=1e-2, weight_decay=0.1, share_second_moment=False,
                 quantize_first_moment=False)
    ref = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1)
    for t in range(10):
        g = torch.zeros(16, 96) if t < 2 else torch.randn(16, 96)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert_close(p.detach(), q.detach(), atol=1e-6, name="p vs AdamW")


def test_zero_gradient_state_survives_state_dict_round_trip():
    p = torch.nn.Parameter(torch.randn(16, 96))
    opt = Gefen([p])
    p.grad = torch.zeros(16, 96)
    opt.step()
    opt2 = Gefen([torch.nn.Parameter(p.detach().clone())])
    opt2.load_state_dict(opt.state_dict())
    assert dict(opt2.state[opt2.param_groups[0]["params"][0]]) == {K.STEP: 1}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("late", [False, True], ids=["first_step", "late_parameter"])
def test_non_finite_first_gradient_is_refused(bad, late):
    """The block length and codebook come from the first gradient: a NaN is refused as an inf is,
    also for a parameter whose first gradient comes after the codebook was learned."""
    a, b = torch.nn.Parameter(torch.randn(16, 96)), torch.nn.Parameter(torch.randn(16, 96))
    opt = Gefen([a, b])
    if late:
        a.grad = row_scaled_grad((16, 96))
        opt.step()
    b.grad = row_scaled_grad((16, 96))
    b.grad[3, 5] = bad
    with pytest.raises(ValueError, match=r"first gradient of parameter 1 .*NaN or inf"):
        opt.step()
    assert K.BLOCK not in opt.state[b]


# ------------------------------------------------------------------------ torch protocol


def test_deepcopy_is_independent_and_continues_like_the_original():
    ps = [torch.nn.Parameter(torch.randn(s)) for s in [(16, 96), (300,)]]
    opt = Gefen(ps, lr=1e-2, weight_decay=0.1)
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


def test_upstream_fused_and_verbose_keywords(capsys):
    """``fused=False`` is the torch step; ``fused=True`` (upstream's default) the compiled one
    where the device has it; ``verbose`` prints each tensor's block length when it is chosen."""
    p = torch.nn.Parameter(torch.randn(32, 256))
    assert Gefen([p], fused=False).backend_of(p) == "torch"
    assert Gefen([p], fused=True).backend_of(p) == "numba"
    with pytest.raises(ValueError, match="fused=False"):
        Gefen([p], fused=False, backend="numba")
    opt = Gefen([p], verbose=True)
    p.grad = row_scaled_grad((32, 256))
    opt.step()
    out = capsys.readouterr().out
    assert f"block {opt.state[p][K.BLOCK]}" in out and "(32, 256)" in out


# ------------------------------------------------------------------------------ arguments


@pytest.mark.parametrize("betas", [(0.9,), (0.9, 0.99, 0.999), 0.9], ids=["one", "three", "float"])
def test_betas_must_be_a_pair(betas):
    with pytest.raises(ValueError, match="betas must be two numbers"):
        Gefen([torch.nn.Parameter(torch.randn(4))], betas=betas)


def test_triton_on_cpu_without_interpreter_says_what_to_do():
    r = _run_python("""
        import torch
        from optim import Gefen
        try:
            Gefen([torch.nn.Parameter(torch.randn(4))], backend="triton")
        except RuntimeError as e:
            print("REFUSED", e)
        """, env_drop=("TRITON_INTERPRET",))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "REFUSED" in r.stdout and "TRITON_INTERPRET=1" in r.stdout and "backend='torch'" in r.stdout


@pytest.mark.parametrize("alias", ["v_as_int32", "v_shorter", "codes_as_int8", "scales_strided"])
def test_triton_launch_cache_checks_a_state_tensor_at_a_known_address(alias):
    """A tensor at the address of one launched before (a view of it) is checked again, not taken
    from the launch cache."""
    from optim.gefen import reference as R, triton_ops
    from optim.gefen.codebook import code_table

    cb = torch.linspace(-1, 1, 256)
    n, block = 4096, 64
    p, g = torch.randn(n), torch.randn(n)
    v, s, c = R.init_state(n, block=block, bits=8)
    kw = dict(tables=code_table(cb), step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.0, block=block, bits=8)
    triton_ops.gefen_step_([p], [g], [v], [s], [c], cb, **kw)
    bad = {"v_as_int32": ([v.view(torch.int32)], [s], [c]), "v_shorter": ([v[:-1]], [s], [c]),
           "codes_as_int8": ([v], [s], [c.view(torch.int8)]),
           "scales_strided": ([v], [s.view(-1, 2)[:, 0]], [c])}[alias]
    with pytest.raises(ValueError):
        triton_ops.gefen_step_([p], [g], *bad, cb, **kw)


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
        opt = Gefen([p], lr=1e-2, factor_second_moment=True, backend=backend)
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
    opt = Gefen([p], lr=1e-2, backend=backend)
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
        vs, ss, cs = ([s[0] for s in st], [s[1] if quant else s[0] for s in st], [s[-1] for s in st])
        for t in (1, 2):
            step(ps, gs, vs, ss, cs, cb, tables=code_table(cb) if quant else None, step=t, lr=1e-2, beta1=0.9,
                 beta2=0.999, eps=1e-8, weight_decay=0.1, block=block, bits=8)
        out[name] = (ps, vs, cs)
    for (a, va, ca), (b, vb, cb_) in [(out["torch"], out[backend])]:
        for i in range(len(shapes)):
            assert_close(b[i], a[i], atol=1e-6, name=f"p[{i}]")
            assert_close(vb[i], va[i], rtol=1e-5, name=f"v[{i}]")
            if quant:
                assert torch.equal(cb_[i], ca[i]), f"codes[{i}] differ"


# ------------------------------------------------- dtypes, versions and gradients left as given

ADAMW = dict(share_second_moment=False, quantize_first_moment=False)  # Gefen reduced to AdamW


def _mlp(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(24, 16, generator=g, dtype=torch.float32)),
            torch.nn.Parameter(torch.randn(24, generator=g, dtype=torch.float32))]


def _grads(step, params):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) * (1 + torch.arange(p.shape[0]).view(-1, *[1] * (p.dim() - 1)))
            for p in params]


def _steps(opt, params, steps, start=0):
    for t in range(start, start + steps):
        for p, g in zip(params, _grads(t, params)):
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
        ps, ps2 = _mlp(), _mlp()
        old = torch.get_default_dtype()
        torch.set_default_dtype(dflt)
        try:
            opt = Gefen(ps, lr=1e-2, backend=backend, factor_second_moment=True)
            _steps(opt, ps, 3)
            sd = opt.state_dict()
            ref, ours = _mlp(), _mlp()
            adamw = Gefen(ours, lr=1e-2, weight_decay=0.1, factor_second_moment=True, backend="torch", **ADAMW)
            _steps(adamw, ours, 3)
        finally:
            torch.set_default_dtype(old)
        Gefen(ps2, lr=1e-2, backend=backend, factor_second_moment=True).load_state_dict(sd)  # loads under fp32
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
    opt = Gefen([w], lr=1e-2, backend=backend)
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
    kw = {} if quant else ADAMW
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
    opt, ref = Gefen([e, f], lr=1e-2, maximize=True, backend=backend, **ADAMW), torch.optim.AdamW([e2, f2], lr=1e-2, weight_decay=0.0, maximize=True)
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
    ours, ref = _mlp(), _mlp()
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
    ours = [torch.nn.Parameter(p.detach().to(start)) for p in _mlp()]
    ref = [torch.nn.Parameter(p.detach().to(start)) for p in _mlp()]
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
    ps, ref = _mlp(), _mlp()
    opt, opt_ref = Gefen(ps, lr=1e-2, backend="numba"), Gefen(ref, lr=1e-2, backend="numba")
    _steps(opt, ps, 1)
    _steps(opt_ref, ref, 2)
    st = opt.state[ps[0]]
    good = st[K.V]
    st[K.V] = torch.zeros(2 * good.numel())[::2]
    for p, g in zip(ps, _grads(1, ps)):
        p.grad = g
    with pytest.raises(ValueError, match="contiguous"):
        opt.step()
    assert st[K.STEP] == 1
    st[K.V] = good
    _steps(opt, ps, 1, start=1)
    for p, q in zip(ps, ref):
        assert opt.state[p][K.STEP] == 2
        assert torch.equal(p, q)


@pytest.mark.parametrize("option", ["quantize_first_moment", "factor_second_moment"])
def test_a_saved_group_that_contradicts_its_state_is_named(option):
    p = torch.nn.Parameter(torch.randn(16, 8))
    opt = Gefen([p], lr=1e-2, factor_second_moment=True)
    p.grad = row_scaled_grad((16, 8))
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0][option] = False
    with pytest.raises(ValueError, match=f"saved group says {option}=False"):
        Gefen([p], factor_second_moment=True).load_state_dict(sd)


def test_an_adamw_state_dict_is_refused_as_adamws():
    """AdamW's state (float step tensor, exp_avg, exp_avg_sq) into the Gefen that reduces to AdamW."""
    q = torch.nn.Parameter(torch.randn(16, 8))
    adamw = torch.optim.AdamW([q])
    q.grad = torch.randn(16, 8)
    adamw.step()
    with pytest.raises(ValueError, match="AdamW's .*not Gefen's.*into torch.optim.AdamW"):
        Gefen([q], **ADAMW).load_state_dict(adamw.state_dict())


# ------------------------------------------------------------------- stochastic rounding's seed

def _bf16_params():
    return [torch.nn.Parameter(p.detach().bfloat16()) for p in _mlp()]


def _sr_steps(opt, params, steps, start=0, late=2):
    """Steps of bf16 gradients; the second parameter's are zero before step ``late`` (so it
    gets its state, and its seed, only then)."""
    for t in range(start, start + steps):
        for k, (p, g) in enumerate(zip(params, _grads(t, params))):
            p.grad = g if k == 0 or t >= late else torch.zeros_like(g)
        opt.step()


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_stochastic_rounding_leaves_the_global_random_stream_alone(backend):
    torch.manual_seed(5)
    want = torch.rand(4)
    torch.manual_seed(5)
    ps = _bf16_params()
    _sr_steps(Gefen(ps, lr=1e-3, stochastic_rounding=True, backend=backend), ps, 3)
    assert torch.equal(torch.rand(4), want)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_a_resumed_rounding_run_equals_the_uninterrupted_one(backend):
    """Checkpoint after two steps, before the second parameter has its seed; the resumed process
    has another random state: the next three steps are the uninterrupted run's, bit for bit."""
    torch.manual_seed(11)
    whole = _bf16_params()
    _sr_steps(Gefen(whole, lr=1e-3, stochastic_rounding=True, backend=backend), whole, 5)
    torch.manual_seed(11)
    first = _bf16_params()
    opt = Gefen(first, lr=1e-3, stochastic_rounding=True, backend=backend)
    _sr_steps(opt, first, 2)
    assert K.SEED not in opt.state[first[1]]
    buf = __import__("io").BytesIO()
    torch.save({"opt": opt.state_dict(), "params": [p.detach() for p in first]}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    torch.manual_seed(999)  # another process
    resumed = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    opt2 = Gefen(resumed, lr=1e-3, stochastic_rounding=True, backend=backend)
    opt2.load_state_dict(saved["opt"])
    _sr_steps(opt2, resumed, 3, start=2)
    for a, b in zip(resumed, whole):
        assert torch.equal(a, b)


def test_loading_a_checkpoint_saved_without_rounding_keeps_rounding_on():
    """The group's stochastic_rounding is how this run writes its weights: a checkpoint of a
    run without it (or saved before the keyword existed) does not turn it off (every parameter
    gets its seed at the next steps); one that rounded, loaded into a run without, does not turn it on."""
    ps = _bf16_params()
    plain = Gefen(ps, lr=1e-3)
    _sr_steps(plain, ps, 2)
    sd = plain.state_dict()
    old = copy.deepcopy(sd)
    for g in old["param_groups"]:
        del g["stochastic_rounding"]
    for saved in (sd, old):
        qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        opt = Gefen(qs, lr=1e-3, stochastic_rounding=True)
        opt.load_state_dict(saved)
        assert opt.param_groups[0]["stochastic_rounding"] is True
        _sr_steps(opt, qs, 2, start=2)
        assert all(K.SEED in opt.state[q] for q in qs)
    off = Gefen([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=1e-3)
    off.load_state_dict(opt.state_dict())
    assert off.param_groups[0]["stochastic_rounding"] is False
