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
from tests.utils import assert_close

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_python(code: str, env_drop=(), timeout=300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _structured_grad(shape):
    return torch.randn(shape) * torch.exp(torch.randn(shape[0], 1) * 2)


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
    p.grad = _structured_grad((16, 96))
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
