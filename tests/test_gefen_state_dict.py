"""Gefen's state dicts: what a loaded state dict must hold, and what is refused by name.

Refused at load, before any compiled code sees it: tensors of another dtype or shape, a state changed
after the load, a group that contradicts its state, AdamW's own state dict, a state dict of another
model. Loaded: non-contiguous tensors (as contiguous ones), zero-gradient state, the codebook through
torch's state-dict hooks. Anything that could crash the interpreter inside compiled code runs in a
subprocess. Round trips that continue bit for bit are in ``tests/test_protocol.py``.
"""

import pytest
import torch

from optim import Gefen
from optim.gefen import state as K
from tests.utils import (ADAMW, row_scaled_grad, run_python, seeded_grads, seeded_params, set_or_clear_grads, twin_params)


_CAST_SCRIPT = """
import copy, sys, torch
from optim import Gefen
torch.manual_seed(0)
m = torch.nn.Linear(512, 512); opt = Gefen(m.parameters(), backend="numba")
m(torch.randn(8, 512)).sum().backward(); opt.step(); saved = opt.state_dict()
for name, cast in CASTS.items():
    print("CASE", name, flush=True)
    sd = copy.deepcopy(saved)
    exec(cast)
    opt2 = Gefen(m.parameters(), backend="numba")
    try:
        opt2.load_state_dict(sd)
    except ValueError as e:
        print("REFUSED", name, e, flush=True)
    else:
        m.zero_grad(); m(torch.randn(8, 512)).sum().backward(); opt2.step()
        print("STEPPED", name, flush=True)
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


def test_state_dict_of_other_dtype_or_shape_is_refused_at_load():
    """The issue's reproducer (Linear 512x512, numba step) with each kind of foreign state, one after
    another in one child process (a crash names the case it was in)."""
    r = run_python(_CAST_SCRIPT.replace("CASTS", repr(_CASTS)))
    cases = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("CASE")]
    assert r.returncode == 0, f"crashed in case {cases[-1] if cases else None} (rc {r.returncode}): {r.stderr[-2000:]}"
    for cast in _CASTS:
        assert f"REFUSED {cast} Gefen.load_state_dict" in r.stdout, (cast, r.stdout + r.stderr[-2000:])


def test_state_dict_of_noncontiguous_tensors_is_loaded_contiguous():
    """A strided copy of the right dtype and size is the same state: loaded as a contiguous copy."""
    p = torch.nn.Parameter(torch.randn(16, 96))
    opt = Gefen([p], layout="published", backend="numba")
    p.grad = row_scaled_grad((16, 96))
    opt.step()
    sd = opt.state_dict()
    st = sd["state"][0]
    for k in (K.V, K.SCALES, K.CODES):
        st[k] = torch.stack([st[k], st[k]], dim=1)[:, 0]
        assert not st[k].is_contiguous()
    opt2 = Gefen([torch.nn.Parameter(p.detach().clone())], layout="published", backend="numba")
    opt2.load_state_dict(sd)
    for k in (K.V, K.SCALES, K.CODES):
        assert opt2.state[opt2.param_groups[0]["params"][0]][k].is_contiguous()


_LAUNCH_SCRIPT = """
import torch
from optim.gefen import numba_ops, reference as R
from optim.gefen.codebook import code_table
from optim.gefen.plan import Hyper, Tile
hyper = Hyper(1, 1e-3, 0.9, 0.999, 1e-8, 0.0)
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
        numba_ops.gefen_step_([Tile(p, v, s, c)], [g], cb, hyper, tables=code_table(cb), block=block, bits=8)
    except ValueError as e:
        print("REFUSED", name, e)
    else:
        print("LAUNCHED", name)
p, g = torch.randn(n), torch.randn(n + 1)
try:
    numba_ops.gefen_step_([Tile(p, *state())], [g], cb, hyper, tables=code_table(cb), block=block, bits=8)
except ValueError as e:
    print("REFUSED", "g_long", e)
"""


def test_numba_step_checks_every_state_tensor_before_launch():
    r = run_python(_LAUNCH_SCRIPT)
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
    r = run_python(_MUTATED_SCRIPT.replace("BACKEND", repr(backend)))
    assert r.returncode == 0, f"crashed (rc {r.returncode}): {r.stderr[-2000:]}"
    assert "REFUSED" in r.stdout and "float32" in r.stdout, r.stdout + r.stderr[-2000:]


def test_zero_gradient_state_survives_state_dict_round_trip():
    p = torch.nn.Parameter(torch.randn(16, 96))
    opt = Gefen([p], layout="published")
    p.grad = torch.zeros(16, 96)
    opt.step()
    opt2 = Gefen([torch.nn.Parameter(p.detach().clone())], layout="published")
    opt2.load_state_dict(opt.state_dict())
    assert dict(opt2.state[opt2.param_groups[0]["params"][0]]) == {K.STEP: 1}


@pytest.mark.parametrize("option", ["quantize_first_moment", "factor_second_moment"])
def test_a_saved_group_that_contradicts_its_state_is_named(option):
    p = torch.nn.Parameter(torch.randn(16, 8))
    opt = Gefen([p], lr=1e-2, layout="factored")
    p.grad = row_scaled_grad((16, 8))
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0][option] = False
    with pytest.raises(ValueError, match=f"saved group says {option}=False"):
        Gefen([p], layout="factored").load_state_dict(sd)


def test_an_adamw_state_dict_is_refused_as_adamws():
    """AdamW's state (float step tensor, exp_avg, exp_avg_sq) into the Gefen that reduces to AdamW."""
    q = torch.nn.Parameter(torch.randn(16, 8))
    adamw = torch.optim.AdamW([q])
    q.grad = torch.randn(16, 8)
    adamw.step()
    with pytest.raises(ValueError, match="AdamW's .*not Gefen's.*into torch.optim.AdamW"):
        Gefen([q], **ADAMW).load_state_dict(adamw.state_dict())


def test_state_dict_from_another_model_is_rejected():
    a = torch.nn.Parameter(torch.randn(16, 96))
    opt = Gefen([a], layout="published")
    a.grad = row_scaled_grad((16, 96))
    opt.step()
    sd = opt.state_dict()
    other = Gefen([torch.nn.Parameter(torch.randn(16, 97))], layout="published")
    with pytest.raises(ValueError, match="does not fit its shape"):
        other.load_state_dict(sd)
    with pytest.raises(ValueError, match="2 parameters|1 parameters"):
        Gefen([torch.nn.Parameter(torch.randn(16, 96)), torch.nn.Parameter(torch.randn(3))],
              layout="published").load_state_dict(sd)
    with pytest.raises(ValueError, match="bits"):
        Gefen([torch.nn.Parameter(torch.randn(16, 96))], layout="published", bits=4).load_state_dict(sd)


SHAPES = [(5, 6), (5,), (300,)]


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "quantised"])
def test_state_dict_hooks_see_the_codebook(adamw):
    """state_dict's post-hook sees the dict state_dict() returns, codebook included, and its edits
    last; load_state_dict's post-hook sees the loaded codebook (none reduced to AdamW)."""
    kw = ADAMW if adamw else {"layout": "published"}
    ps = seeded_params(SHAPES)
    opt = Gefen(ps, lr=1e-2, **kw)
    set_or_clear_grads(ps, seeded_grads(ps, 0))
    opt.step()
    sd = opt.state_dict()
    seen = {}
    other = Gefen(twin_params(ps), **kw)
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
