"""Helpers used by the tests: tolerances with one message format, gloo launches on 127.0.0.1, a fresh
interpreter for code that could crash, checkpoint round trips, and the parameters, gradients,
batches and small models several test files draw alike."""

import functools
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from optim.backends import triton_interpreted


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative RMS error ||a - e|| / max(||e||, tiny), computed in float64."""
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


def assert_close(actual, expected, *, atol=0.0, rtol=0.0, rel_rms_tol=None, name="tensor"):
    """Fail if any |a - e| > atol + rtol*|e| (or the relative RMS error exceeds rel_rms_tol).

    The failure message carries the max-abs error, the relative RMS error and the first mismatching
    indices with their values, so a failing CI log is enough to start debugging.
    """
    actual = torch.as_tensor(actual)
    expected = torch.as_tensor(expected)
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    diff = (a - e).abs()
    nan_mismatch = a.isnan() != e.isnan()
    bad = (diff > atol + rtol * e.abs()) | nan_mismatch
    bad &= ~(a.isnan() & e.isnan())
    rr = rel_rms(a.nan_to_num(), e.nan_to_num())
    msgs = []
    if bad.any():
        idx = bad.nonzero()[:5]
        first = ", ".join(f"{tuple(i.tolist())}: {a[tuple(i)].item():.10g} vs {e[tuple(i)].item():.10g}" for i in idx)
        msgs.append(f"{int(bad.sum())}/{bad.numel()} elements exceed atol={atol:g} rtol={rtol:g}; first: {first}")
    if rel_rms_tol is not None and rr > rel_rms_tol:
        msgs.append(f"relative RMS error {rr:.3e} > {rel_rms_tol:g}")
    if msgs:
        maxabs = float(diff.nan_to_num().max()) if diff.numel() else 0.0
        raise AssertionError(f"{name}: max|Δ|={maxabs:.3e}, rel RMS={rr:.3e}; " + "; ".join(msgs))


def run_python(code: str, env_drop=(), timeout=300) -> subprocess.CompletedProcess:
    """Run ``code`` (dedented) in a fresh interpreter at the repository root, without the variables
    named in ``env_drop``: what could crash the interpreter inside compiled code fails one test."""
    root = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_gloo_ranks(world: int, script: Path, args: list, logs: list, timeout: float) -> list:
    """Run ``script args`` as ``world`` gloo ranks on 127.0.0.1 (rank r's output in ``logs[r]``),
    kill every rank still running after ``timeout`` seconds, and return the ranks' exit codes."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen([sys.executable, str(script), *map(str, args)],
                                          env=dict(env, RANK=str(rank)), stdout=out, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs]


def row_scaled_grad(shape, *, scale_columns=False):
    """A N(0, 1) gradient whose rows differ in scale by factors e^(2 N(0, 1)) (and, with
    ``scale_columns``, its columns by e^N(0, 1)), so Gefen finds blocks > 1 where the shape has rows.
    A 1-D shape is plain N(0, 1)."""
    g = torch.randn(shape)
    if len(shape) == 1:
        return g
    g = g * torch.exp(torch.randn(shape[0], *([1] * (len(shape) - 1))) * 2)
    return g * torch.exp(torch.randn(1, shape[1])) if scale_columns else g


def scaled_grad_steps(shapes, steps, seed=0, vector=None):
    """``steps`` lists of gradients, one per shape, from one generator of ``seed``: a matrix N(0, 1)
    with rows scaled by e^(2 N(0, 1)) and columns by e^N(0, 1) (Gefen's rule shares v along whole
    rows); a vector N(0, 1) times ``vector(n)`` (1 by default)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        gs = []
        for s in shapes:
            if len(s) < 2:
                gs.append(torch.randn(s, generator=gen) * (1.0 if vector is None else vector(s[0])))
            else:
                g = torch.randn(s, generator=gen) * torch.exp(2 * torch.randn(s[0], 1, generator=gen))
                gs.append(g * torch.exp(torch.randn(1, s[1], generator=gen)))
        out.append(gs)
    return out


def small_params(shapes, seed=1):
    """One parameter per shape, 0.1 N(0, 1) from a generator of ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(0.1 * torch.randn(s, generator=gen)) for s in shapes]


def sparse_embedding(rows, dim, *, dtype=torch.float32, seed=None):
    """``nn.Embedding(rows, dim, sparse=True)``, its weights drawn after ``torch.manual_seed(seed)``
    where a seed is given."""
    if seed is not None:
        torch.manual_seed(seed)
    return torch.nn.Embedding(rows, dim, sparse=True, dtype=dtype)


ADAMW = dict(layout="adamw")  # the Gefen layout whose state is AdamW's


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone().to(p.dtype)


def checkpoint_and_continue(make, grad_steps, path, split=3):
    """Step ``make()``'s optimizer through ``grad_steps[:split]``, save its state dict and weights to
    ``path``, step on; then rebuild with ``make()``, load the checkpoint and take the same remaining
    steps. Returns (params, opt, params2, opt2, saved) for the caller to compare."""
    params, opt = make()
    for gs in grad_steps[:split]:
        set_grads(params, gs)
        opt.step()
    torch.save({"opt": opt.state_dict(), "params": [p.detach().clone() for p in params]}, path)
    for gs in grad_steps[split:]:
        set_grads(params, gs)
        opt.step()
    saved = torch.load(path, map_location="cpu")
    params2, opt2 = make()
    with torch.no_grad():
        for p, q in zip(params2, saved["params"]):
            p.copy_(q)
    opt2.load_state_dict(saved["opt"])
    for gs in grad_steps[split:]:
        set_grads(params2, gs)
        opt2.step()
    return params, opt, params2, opt2, saved


def assert_same_state(opt, opt2, params, params2):
    """Same weights and the same state, value and dtype, for every parameter."""
    for p, q in zip(params, params2):
        assert torch.equal(p, q)
        for key, val in opt.state[p].items():
            other = opt2.state[q][key]
            assert (torch.equal(val, other) and val.dtype == other.dtype) if torch.is_tensor(val) else val == other


def step_side_by_side(runs, grad_steps):
    """Step each (optimizer, params) of ``runs`` on every gradient list of ``grad_steps`` in turn."""
    for gs in grad_steps:
        for opt, params in runs:
            set_grads(params, gs)
            opt.step()


def assert_copies_step_alike(opt, params, grad_steps, check=None):
    """A deepcopy and a pickle of ``opt`` each take ``grad_steps`` beside it and end in its state
    (``assert_same_state``); ``check(copy)`` first, where given."""
    import copy
    import pickle

    for copy_ in (copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
        twin = copy_(opt)
        if check is not None:
            check(twin)
        mine = [p for g in twin.param_groups for p in g["params"]]
        step_side_by_side([(opt, params), (twin, mine)], grad_steps)
        assert_same_state(opt, twin, params, mine)


def assert_match(actual, expected, tol=None):
    """Tensor by tensor: bitwise (``tol`` None), or to assert_close's keyword tolerances ``tol``."""
    for k, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if tol is None:
            assert torch.equal(a, e), f"tensor {k}: max|Δ|={(a.double() - e.double()).abs().max().item():.3e}"
        else:
            assert_close(a, e, **tol, name=f"tensor {k}")


def assert_same_state_dict(a, b, path="state_dict"):
    """Two state dicts equal: the same structure, tensors bitwise with the same dtype and shape."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, set(a) ^ set(b))
        for k in a:
            assert_same_state_dict(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for k, (x, y) in enumerate(zip(a, b)):
            assert_same_state_dict(x, y, f"{path}[{k}]")
    else:
        assert a == b, (path, a, b)


# -- Disk Sparse Adam: batches of rows and one step on them
def index_batches(n, rows, seed=1):
    """``n`` batches of 40 random row indices below ``rows``, from a generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, rows, (40,), generator=gen) for _ in range(n)]


def step_rows(emb, opt, idx):
    """One step of ``opt`` on the loss sum(emb(idx)²)."""
    opt.zero_grad()
    emb(idx).pow(2).sum().backward()
    opt.step()


def step_random_rows(emb, opt, t):
    """One step of ``opt`` on sum(emb(idx)²) over 32 random rows drawn from a generator seeded with ``t``."""
    gen = torch.Generator().manual_seed(t)
    idx = torch.randint(0, emb.num_embeddings, (32,), generator=gen)
    opt.zero_grad()
    (emb(idx) ** 2).sum().backward()
    opt.step()


# -- Gefen: parameters, gradients and small models
GEFEN_CPU_BACKENDS = ["torch", "numba", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_interpreted(), reason="Triton runs on CPU tensors only under TRITON_INTERPRET=1"))]


def seeded_params(shapes, dtype=torch.float32):
    """One N(0, 1) parameter per shape, from a generator seeded with 1."""
    g = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]


def twin_params(params):
    """Independent copies of ``params``, for the reference optimizer."""
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def seeded_grads(params, seed):
    """One N(0, 1) gradient per parameter, from a generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]


def set_or_clear_grads(params, grads):
    """``p.grad`` = a copy of each gradient (None clears it)."""
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()


def mlp_params(seed=0):
    """A (24, 16) weight and a (24,) bias, N(0, 1) from a generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(24, 16, generator=g, dtype=torch.float32)),
            torch.nn.Parameter(torch.randn(24, generator=g, dtype=torch.float32))]


def row_growing_grads(step, params):
    """Gradients for step ``step`` whose row i is scaled by i + 1 (seed 100 + step)."""
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) * (1 + torch.arange(p.shape[0]).view(-1, *[1] * (p.dim() - 1)))
            for p in params]


def tiny_mlp(seed=0):
    """Linear(16, 32), ReLU, Linear(32, 4), initialised after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def train_steps(model, opt, steps, compiled=False):
    """``steps`` steps on mean(model(x)²) for one fixed batch x; the losses (``torch.compile`` with ``compiled``)."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))

    def step():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    fn = torch.compile(step, backend="eager") if compiled else step
    return [float(fn()) for _ in range(steps)]


def wide_mlp(dtype=torch.float32):
    """Linear(384, 512), GELU, Linear(512, 512), GELU, Linear(512, 24) in ``dtype``, after ``torch.manual_seed(0)``."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(384, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                               torch.nn.GELU(), torch.nn.Linear(512, 24)).to(dtype)


def write_results(folder, experiment, rows, config):
    """``rows`` (variant, metric, value, x_name, x_value) as ``<folder>/<experiment>.csv`` of one run
    (seed 0, a test device and commit), and ``config`` as its config.json."""
    import csv
    import json

    from experiments.harness.common import FIELDS

    with open(Path(folder) / f"{experiment}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for variant, metric, val, x_name, x_value in rows:
            w.writerow(dict(experiment=experiment, variant=variant, metric=metric, unit="", x_name=x_name,
                            x_value=x_value, value=val, seed=0, device="cpu:Test x2", torch_version=torch.__version__,
                            git_commit="abc1234", timestamp="2026-01-01T00:00:00+00:00"))
    (Path(folder) / f"{experiment}.config.json").write_text(json.dumps(config))


@functools.lru_cache(maxsize=None)
def committed_figure(name: str):
    """The geometry of figure ``name`` drawn from the committed results (``figure_check``), once per
    test session: the figure tests and the headline tests read the same drawing."""
    from analysis.figure_check import draw_and_measure
    from experiments.harness.common import RESULTS_DIR

    return draw_and_measure(name, RESULTS_DIR)
