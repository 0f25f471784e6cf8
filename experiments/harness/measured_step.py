"""The training step that the memory experiments measure, and the worker processes that run it.

    CONFIGS["Gefen-8bit-factored+bf16-sr+in-backward"]    # (optimizer, weights, step in backward)
    model = build_model(spec, "bf16"); opt, handle = build_optimizer(config, model, spec)
    train_step(model, opt, handle, make_batch(spec, micro_batch, "bf16", gen))
    out, run = run_worker("experiments.gefen_budgets", spec, limit_bytes, timeout)   # a fresh process
    code, peak_bytes, why = fit_trial("experiments.gefen_budgets", config, spec, micro_batch, budget_gib, seed, timeout)

experiments/gefen_peak_memory.py (peaks), gefen_budgets.py (what fits a memory budget) and
gefen_distributed.py (DDP and FSDP2 throughput) share it: the optimizer configurations, the models
(``{"kind": "mlp", "width", "depth"}`` or ``{"kind": "gpt", "n_embd", "n_layer", "n_head", "block"}``,
built by experiments/harness/models.py in fp32 or bf16), their batches, the warm-up and one step. Each job
runs in a worker process of its script (``python -m <script> --worker JSON``, its result line last:
experiments/harness/child.py) on one torch thread, so that a memory limit or a crash ends the worker only
and what is measured starts from nothing. ``fit_trial`` is one trial of a budget search
(experiments/harness/budget.py): ``FIT_STEPS`` steps in a memory cgroup the worker joins after its warm-up,
so the budget counts what training the model adds, as a GPU's memory would.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import json
import os

import torch
import torch.nn as nn

from experiments.harness.child import child_env, emit_result, module_cmd, run_child
from experiments.harness.common import REPO_ROOT
from experiments.harness.memcg import join_memory_cgroup
from experiments.harness.models import GPT, GPTConfig, mlp_stack
from experiments.harness.registry import GEFEN_X_DIR, GEFEN_X_INSTALL, gefen_x, gefen_x_version, make_optimizer

LR = 1e-3
FIT_STEPS = 3  # steps a budget's trial must run without an OOM kill
LEAN = "Gefen-8bit-factored+bf16-sr+in-backward"
# the GPT of the peaks, the micro-batch budgets and the ranks (the same model in all three)
GPT_SPEC = {"full": dict(kind="gpt", n_embd=512, n_layer=4, n_head=8, block=64),
            "quick": dict(kind="gpt", n_embd=64, n_layer=2, n_head=4, block=32)}
TIMEOUT = {"full": 900, "quick": 300}  # seconds a worker may run

# (optimizer, weights, step in backward); "bf16" for ours means stochastic rounding
PEERS = [("AdamW", "fp32", False), ("AdamW", "bf16", False), ("Adam-mini", "fp32", False),
         ("torchao-AdamW8bit", "fp32", False), ("torchao-AdamW4bit", "fp32", False),
         ("gefen-upstream", "fp32", False), ("gefen-x", "fp32", False)]
OURS = [("Gefen-8bit", "fp32", False), ("Gefen-8bit", "fp32", True), ("Gefen-4bit", "fp32", False),
        ("Gefen-4bit", "fp32", True), ("Gefen-8bit-factored", "fp32", False), ("Gefen-8bit-factored", "fp32", True),
        ("Gefen-8bit-factored", "bf16", False), ("Gefen-8bit-factored", "bf16", True),
        ("Gefen-4bit-factored", "fp32", False), ("Gefen-4bit-factored", "bf16", True)]


def label(name, weights, in_backward) -> str:
    """A configuration's name: the optimizer, ``+bf16`` (pure bf16) or ``+bf16-sr`` (ours, stochastic
    rounding), ``+in-backward``."""
    mode = {"fp32": "", "bf16": "+bf16-sr" if name.startswith("Gefen") else "+bf16"}[weights]
    return name + mode + ("+in-backward" if in_backward else "")


CONFIGS = {label(*c): c for c in PEERS + OURS}


def model_name(spec) -> str:
    return f"{spec['kind']}-{num_params(spec) / 1e6:.1f}M"


def num_params(spec) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(spec, "fp32").parameters())


# ------------------------------------------------------------------------------------------ a step
def build_model(spec, weights):
    """The model of ``spec`` with weights in fp32 or bf16 (built in that dtype, without an fp32 copy)."""
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if spec["kind"] == "mlp":
            return mlp_stack(spec["width"], spec["depth"])
        return GPT(GPTConfig(block=spec["block"], n_layer=spec["n_layer"], n_head=spec["n_head"],
                             n_embd=spec["n_embd"]))
    finally:
        torch.set_default_dtype(old)


_TEXT = []


def make_batch(spec, micro_batch, weights, gen):
    """MLP: Gaussian inputs; GPT: windows of experiments/harness/data.py's character corpus."""
    if spec["kind"] == "mlp":
        dtype = torch.bfloat16 if weights == "bf16" else torch.float32
        return (torch.randn(micro_batch, spec["width"], generator=gen).to(dtype),)
    from experiments.harness import data

    if not _TEXT:
        _TEXT.append(data.load_splits(200_000)[0])
    return data.get_batch(_TEXT[0], micro_batch, spec["block"], gen)


def loss_of(model, batch):
    if len(batch) == 1:
        return model(batch[0]).float().pow(2).mean()
    return model(*batch)


def build_optimizer(config, model, spec):
    """(optimizer, step-in-backward handle or None) of a ``CONFIGS`` entry."""
    name, weights, in_backward = CONFIGS[config]
    kw = {}
    if name == "Adam-mini":
        kw = dict(dim=spec.get("n_embd", spec.get("width")), n_heads=spec.get("n_head", 1))
    if weights == "bf16" and name.startswith("Gefen"):
        kw["stochastic_rounding"] = True
    opt = make_optimizer(name, model, LR, **kw)
    if not in_backward:
        return opt, None
    from optim import step_in_backward

    return opt, step_in_backward(opt)


def train_step(model, opt, handle, batch):
    """Forward, backward, step (unless it ran inside backward), ``zero_grad(set_to_none=True)``."""
    with contextlib.redirect_stdout(io.StringIO()):  # upstream gefen prints at its first steps
        loss_of(model, batch).backward()
        if handle is None:
            opt.step()
        opt.zero_grad(set_to_none=True)


def release():
    """Free what is unreferenced and give the allocator's free pages back to the system."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def warm_up(config, spec, weights):
    """Compile what the optimizer compiles (numba kernels, torchao's torch.compile'd step) on a tiny
    model of the same kind, torchao's also on the measured shapes, then release everything."""
    tiny = (dict(kind="mlp", width=64, depth=2) if spec["kind"] == "mlp"
            else dict(kind="gpt", n_embd=32, n_layer=1, n_head=2, block=16))
    for s in [tiny] + ([spec] if config.startswith("torchao") else []):
        model = build_model(s, weights)
        opt, handle = build_optimizer(config, model, s)
        gen = torch.Generator().manual_seed(0)
        for _ in range(2):
            train_step(model, opt, handle, make_batch(s, 1, weights, gen))
        if handle is not None:
            handle.remove()
        del model, opt, handle
    release()


def train_in_budget(spec):
    """A ``fit`` job (worker side): warm up, join the memory cgroup (``MEMCG_PATH``), build the model
    and run ``FIT_STEPS`` steps; an OOM kill ends the worker before it returns."""
    config, model_spec, weights = spec["config"], spec["model"], CONFIGS[spec["config"]][1]
    warm_up(config, model_spec, weights)
    if os.environ.get("MEMCG_PATH"):
        join_memory_cgroup(os.environ["MEMCG_PATH"])
    model = build_model(model_spec, weights)
    opt, handle = build_optimizer(config, model, model_spec)
    gen = torch.Generator().manual_seed(spec["seed"])
    for _ in range(FIT_STEPS):
        train_step(model, opt, handle, make_batch(model_spec, spec["micro_batch"], weights, gen))
    return dict(ok=True)


# ---------------------------------------------------------------------------------------- workers
def worker_main(spec, tasks) -> int:
    """A worker process's body (``--worker JSON``): one torch thread, ``tasks[spec["task"]](spec)``,
    its value printed as the result line."""
    torch.set_num_threads(1)
    emit_result(tasks[spec["task"]](spec))
    return 0


def worker_cmd(module, spec):
    return module_cmd(module, "--worker", json.dumps(spec))


def worker_env():
    # one thread everywhere, torch.compile (torchao) without a pool of compile processes
    return child_env(OMP_NUM_THREADS=1, NUMBA_NUM_THREADS=1, TORCHINDUCTOR_COMPILE_THREADS=1)


def run_worker(module, spec, limit_bytes=None, timeout=None):
    """(result dict or None, child.ChildRun) of one worker of ``module``, in a memory cgroup of
    ``limit_bytes`` that it joins itself (after its warm-up)."""
    run = run_child(worker_cmd(module, spec), memory=("gefen-peak", limit_bytes), timeout=timeout, env=worker_env(),
                    join_at_start=False)
    return run.result, run


def fit_trial(module, config, model, micro_batch, budget_gib, seed, timeout):
    """Whether ``config`` trains ``model`` at ``micro_batch`` in ``budget_gib`` (a worker of ``module``):
    (1 fits, 0 killed for memory, -1 failed otherwise; the cgroup's peak bytes; why it failed or None)."""
    spec = dict(task="fit", config=config, model=model, micro_batch=micro_batch, seed=seed)
    out, run = run_worker(module, spec, int(budget_gib * 2**30), timeout)
    code = 1 if out else (0 if run.oom_killed else -1)
    shape = f"width={model['width']}" if model["kind"] == "mlp" else f"micro_batch={micro_batch}"
    print(f"[budget {budget_gib:g} GiB] {config} {shape}: {run.outcome} (cgroup peak {run.peak_bytes / 2**20:.0f} MiB)",
          flush=True)
    return code, run.peak_bytes, None if code >= 0 else run.why()


# ------------------------------------------------------------------------------------ availability
def unavailable(config):
    """Why ``config`` cannot run here (printed as a note), or None."""
    name, weights, in_backward = CONFIGS[config]
    if name == "gefen-x" and gefen_x() is None:
        return f"gefen-x: not installed in {GEFEN_X_DIR.relative_to(REPO_ROOT)}; install it with `{GEFEN_X_INSTALL}`"
    if in_backward:
        import optim

        if not hasattr(optim, "step_in_backward"):
            return f"{config}: optim.step_in_backward is not available"
    if weights == "bf16" and name.startswith("Gefen"):
        from optim import Gefen

        try:
            Gefen([nn.Parameter(torch.zeros(2))], stochastic_rounding=True)
        except TypeError as exc:
            return f"{config}: Gefen(stochastic_rounding=True) is not available ({exc})"
    return None


def available(res, configs) -> list:
    """``configs`` less those that cannot run here, each of those a note of the run."""
    out = []
    for config in configs:
        why = unavailable(config)
        if why:
            note(res, f"skipped {why}")
        else:
            out.append(config)
    return out


def note(res, text):
    """A line printed now and kept in the run's config (``notes``), for the analysis to list."""
    print(f"[{res.experiment}] note: {text}", flush=True)
    res.config.setdefault("notes", []).append(text)


def versions() -> dict:
    """Versions of the peers (config.json records them)."""
    import importlib.metadata as md

    out = {"gefen-x": gefen_x_version()}
    for dist_name in ("torchao", "gefen", "adam-mini", "numba"):
        try:
            out[dist_name] = md.version(dist_name)
        except md.PackageNotFoundError:
            out[dist_name] = ""
    return out
