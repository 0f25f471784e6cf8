"""Gefen's peak memory of a training step on CPU, next to its peers, and what each trains in a budget.

    python experiments/gefen_peak_memory.py            # full run -> results/gefen_peak_memory.csv
    python experiments/gefen_peak_memory.py --quick    # small models, one budget, no ranks -> results/quick/
    python analysis/gefen_peak_memory.py               # paper_figs/gefen_peak_memory.png + its section

    # gefen-x (the maintained fork of upstream gefen) installs as module ``gefen``, as upstream does;
    # it goes into a folder of its own, which the registry loads as ``gefen_x`` (skipped if absent):
    python -m pip install --no-deps --target third_party/gefen_x gefen-x==0.5.0

Claims judged (Gefen, arXiv 2606.13894): "the lowest peak memory among the compared methods", and
larger micro-batches and more throughput than AdamW under DDP and FSDP. The state bytes of
experiments/gefen_memory.py are not the peak of a step: weights, gradients and temporaries count too.

1. Peaks. Models: MLPs of twelve ``Linear(w, w)`` + ReLU (w = 2048: 50.4 M parameters, and
   w = 2896: 100.7 M) at micro-batches 8 and 64, and experiments/models.py's GPT (d=512, 4 layers,
   64 tokens, character data) at 4 and 16. Optimizers (registry names): AdamW (fused), AdamW on
   bf16 weights (pure bf16), Adam-mini, torchao-AdamW8bit/4bit, gefen-upstream, gefen-x and ours
   (Gefen-8bit, -4bit, -8bit-factored, -4bit-factored), ours also on bf16 weights with stochastic
   rounding (``+bf16-sr``) and with the step inside backward (``+in-backward``,
   ``optim.step_in_backward``). Each optimizer runs in a fresh process per model on one torch
   thread (its micro-batches in turn, each on a model built anew, with the allocator's free pages
   given back in between), first warmed up on a tiny model (and torchao's compiled steps on the
   measured shapes), so that what is measured is the training of the measured model. bf16 models are built in bf16 (the weights
   ``.to(torch.bfloat16)`` gives, without the fp32 copy on the way). Every step (0: the first;
   1-3: later) is measured with experiments/peak.PeakMemory around forward + backward + step +
   ``zero_grad(set_to_none=True)``, the batch made before. Rows, per parameter: ``tensor_peak``
   (live tensor bytes at the peak, what ``torch.cuda.max_memory_allocated`` reports on a GPU) and
   its split at the peak (``weights``, ``gradients``, ``state``, ``rest``), ``transient`` (the
   largest ``rest``), ``rss_peak`` (the rise of the resident set above its level at the step's
   start) and ``rss_total`` (resident set at the step's peak above the warmed process before the
   model was built); ``state_bytes_per_param`` (registry.state_bytes after the steps).
2. Budgets. In a memory cgroup that the process joins after its warm-up (so the budget counts what
   training the model adds, as a GPU's memory would), 3 steps must run without an OOM kill: the
   largest micro-batch of the GPT under each of ``--mb-budgets-gib``, and the largest MLP (twelve
   layers, micro-batch 8, width searched in multiples of 64 as real models' widths are: Gefen's
   blocks divide a tensor's rows, and at a width like 2602 = 2 x 1301 it keeps one v per element,
   5 B of state a parameter) under each of ``--model-budgets-gib``. Search: a geometric ladder from
   the size the peaks predict, then bisection to 10% in micro-batch and 6% in width (12% in
   parameters).
3. Distributed: 2 gloo ranks (one process and one thread each), DDP and FSDP2 (``fully_shard`` per
   GPT block and the root), the GPT's tokens/s over both ranks at the micro-batch every optimizer
   fits (equal) and under the first micro-batch budget, every rank in a cgroup of that size: at
   each one's single-process largest micro-batch, divided by 1.4 after each kill for memory (up to
   3 times; a rank holds more than one process does: buckets, gathered shards). A run that fails or
   is killed is a row (``outcome``: 0 ok, 1 killed for memory, 2 error, 3 timeout) and a note in
   the config. With DDP the ranks' weights are compared after the steps (``ranks_agree``).

Rows (variant; x): peaks ``<model>/mb<m>/<optimizer>[+mode]``; x = step. Budgets:
``micro_batch@<b>GiB/<opt>`` and ``model@<b>GiB/<opt>`` per trial (``fits``: 1, 0 killed for
memory, -1 failed otherwise; ``cgroup_peak_bytes``), ``micro_batch/<opt>`` and ``model/<opt>``
(``largest_micro_batch``, ``largest_model_params``, ``largest_model_width``, ``smallest_failing_*``);
x = budget_GiB. Distributed: ``ddp/<opt>``, ``fsdp2/<opt>``; x = micro_batch.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import contextlib
import ctypes
import gc
import io
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

from experiments.common import REPO_ROOT, Results, add_common_args
from experiments.child import child_env, emit_result, module_cmd, run_child, run_ranks
from experiments.memcg import CGROUP_ROOT, cgroups_usable, join_memory_cgroup, largest_that_fits
from experiments.models import GPT, GPTConfig, mlp_stack
from experiments.peak import PeakMemory, peak_rss_bytes, reset_peak_rss, rss_bytes
from experiments.registry import GEFEN_X_DIR, GEFEN_X_INSTALL, gefen_x, gefen_x_version, make_optimizer, state_bytes

LR = 1e-3
STEPS = 4  # measured steps: 0 is the first, 1..3 later ones
FIT_STEPS = 3
WIDTH_STEP = 64  # the budgets' MLP widths are multiples of it, as real models' are (see the module doc)
DIST_STEP_DOWN = 1.4  # a distributed run killed for memory is tried again at micro-batch / this, up to 3 times
LEAN = "Gefen-8bit-factored+bf16-sr+in-backward"

SIZES = {  # models of the peaks (name -> spec, micro-batches), the budget searches and the ranks
    "full": dict(
        peaks=[(dict(kind="mlp", width=2048, depth=12), (8, 64)), (dict(kind="mlp", width=2896, depth=12), (8, 64)),
               (dict(kind="gpt", n_embd=512, n_layer=4, n_head=8, block=64), (4, 16))],
        ladder=dict(kind="mlp", depth=12, micro_batch=8, max_width=16384), max_micro_batch=512,
        mb_budgets=[0.5], model_budgets=[0.5, 1.0], equal_micro_batch=8, dist_steps=(1, 3), timeout=900,
        search_trials=8),
    "quick": dict(
        peaks=[(dict(kind="mlp", width=256, depth=12), (8, 64)),
               (dict(kind="gpt", n_embd=64, n_layer=2, n_head=4, block=32), (4, 16))],
        ladder=dict(kind="mlp", depth=4, micro_batch=8, max_width=4096), max_micro_batch=128,
        mb_budgets=[0.03125], model_budgets=[0.125], equal_micro_batch=4, dist_steps=(1, 2), timeout=300,
        search_trials=2),
}
# (optimizer, weights, step in backward); "bf16" for ours means stochastic rounding
PEERS = [("AdamW", "fp32", False), ("AdamW", "bf16", False), ("Adam-mini", "fp32", False),
         ("torchao-AdamW8bit", "fp32", False), ("torchao-AdamW4bit", "fp32", False),
         ("gefen-upstream", "fp32", False), ("gefen-x", "fp32", False)]
OURS = [("Gefen-8bit", "fp32", False), ("Gefen-8bit", "fp32", True), ("Gefen-4bit", "fp32", False),
        ("Gefen-4bit", "fp32", True), ("Gefen-8bit-factored", "fp32", False), ("Gefen-8bit-factored", "fp32", True),
        ("Gefen-8bit-factored", "bf16", False), ("Gefen-8bit-factored", "bf16", True),
        ("Gefen-4bit-factored", "fp32", False), ("Gefen-4bit-factored", "bf16", True)]
FIT = ["AdamW", "AdamW+bf16", "torchao-AdamW8bit", "torchao-AdamW4bit", "gefen-upstream", "gefen-x", "Gefen-8bit",
       LEAN]
DIST = ["AdamW", "AdamW+bf16", "torchao-AdamW8bit", "gefen-upstream", "Gefen-8bit", LEAN]
QUICK = dict(peaks=["AdamW", "Gefen-8bit", LEAN],
             fit=["AdamW", LEAN], dist=["AdamW"])


def label(name, weights, in_backward) -> str:
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
    """The model of ``spec`` with weights in fp32 or bf16 (built in that dtype)."""
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
    """MLP: Gaussian inputs; GPT: windows of experiments/data.py's character corpus."""
    if spec["kind"] == "mlp":
        dtype = torch.bfloat16 if weights == "bf16" else torch.float32
        return (torch.randn(micro_batch, spec["width"], generator=gen).to(dtype),)
    from experiments import data

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


def measure_peaks(config, spec, micro_batch, seed):
    """One model and micro-batch: PeakMemory of each of ``STEPS`` steps (bytes per parameter)."""
    weights = CONFIGS[config][1]
    release()
    base = rss_bytes()
    torch.manual_seed(seed)
    model = build_model(spec, weights)
    opt, handle = build_optimizer(config, model, spec)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(STEPS):
        batch = make_batch(spec, micro_batch, weights, gen)
        with PeakMemory(params, opt) as peak:
            train_step(model, opt, handle, batch)
        rec = peak.report(n)
        rec["rss_total_per_param"] = max(0, peak_rss_bytes() - base) / n
        steps.append(rec)
    out = dict(params=n, steps=steps, state_bytes_per_param=state_bytes(opt) / n, baseline_rss_bytes=base,
               largest_tensor_bytes=max(p.numel() * p.element_size() for p in params))
    if handle is not None:
        handle.remove()
    return out


# ---------------------------------------------------------------------------------------- workers
def worker(spec):
    """One subprocess's job (``--worker JSON``); its result line last (experiments/child.py)."""
    torch.set_num_threads(1)
    task = spec["task"]
    if task == "peaks":
        results = []
        for job in spec["jobs"]:
            warm_up(spec["config"], job["model"], CONFIGS[spec["config"]][1])
            results.append(dict(job, **measure_peaks(spec["config"], job["model"], job["micro_batch"], spec["seed"])))
        out = dict(results=results)
    elif task == "fit":
        config, model_spec, weights = spec["config"], spec["model"], CONFIGS[spec["config"]][1]
        warm_up(config, model_spec, weights)
        if os.environ.get("MEMCG_PATH"):
            join_memory_cgroup(os.environ["MEMCG_PATH"])
        model = build_model(model_spec, weights)
        opt, handle = build_optimizer(config, model, model_spec)
        gen = torch.Generator().manual_seed(spec["seed"])
        for _ in range(FIT_STEPS):
            train_step(model, opt, handle, make_batch(model_spec, spec["micro_batch"], weights, gen))
        out = dict(ok=True)
    else:
        out = distributed_rank(spec)
    emit_result(out)


def distributed_rank(spec):
    """One gloo rank: the GPT under DDP or FSDP2, ``warm`` + ``timed`` steps; tokens/s of both ranks."""
    import datetime

    import torch.distributed as dist

    config, model_spec, weights = spec["config"], spec["model"], CONFIGS[spec["config"]][1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec["timeout"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    warm_up(config, model_spec, weights)
    base = rss_bytes()
    reset_peak_rss()
    if os.environ.get("MEMCG_PATH"):
        join_memory_cgroup(os.environ["MEMCG_PATH"])
    torch.manual_seed(spec["seed"])
    model = build_model(model_spec, weights)
    if spec["strategy"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.h:
            fully_shard(block)
        fully_shard(model)
    opt, handle = build_optimizer(config, model, model_spec)
    gen = torch.Generator().manual_seed(spec["seed"] * 100 + rank)
    warm, timed = spec["steps"]
    times = []
    for i in range(warm + timed):
        batch = make_batch(model_spec, spec["micro_batch"], weights, gen)
        dist.barrier()
        t = time.perf_counter()
        train_step(model, opt, handle, batch)
        dist.barrier()
        if i >= warm:
            times.append(time.perf_counter() - t)
    sums = torch.tensor([sum(float(p.detach().double().sum()) for p in model.parameters()
                             if not hasattr(p, "to_local"))], dtype=torch.float64)
    gathered = [torch.zeros_like(sums) for _ in range(world)]
    dist.all_gather(gathered, sums)
    agree = all(torch.equal(g, gathered[0]) for g in gathered)
    dist.destroy_process_group()
    step = statistics.median(times)
    return dict(tokens_per_s=world * spec["micro_batch"] * model_spec["block"] / step, step_s=step,
                ranks_agree=agree, rss_peak_bytes=max(0, peak_rss_bytes() - base), rank=rank)


def _worker_cmd(spec):
    return module_cmd("experiments.gefen_peak_memory", "--worker", json.dumps(spec))


def _env():
    # one thread everywhere, torch.compile (torchao) without a pool of compile processes
    return child_env(OMP_NUM_THREADS=1, NUMBA_NUM_THREADS=1, TORCHINDUCTOR_COMPILE_THREADS=1)


def run_worker(spec, limit_bytes=None, timeout=None, join_at_start=False):
    """(result dict or None, child.ChildRun) of one worker process, in a memory cgroup of ``limit_bytes``."""
    run = run_child(_worker_cmd(spec), memory=("gefen-peak", limit_bytes), timeout=timeout, env=_env(),
                    join_at_start=join_at_start)
    return run.result, run


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


# -------------------------------------------------------------------------------------------- parts
def peaks(res, args, size, configs, pool):
    jobs = [dict(model=spec, micro_batch=mb, name=model_name(spec)) for spec, mbs in size["peaks"] for mb in mbs]
    key = {"run": lambda j: (j["name"], j["micro_batch"]), "model": lambda j: j["name"], "optimizer": lambda j: 0}
    groups = [(c, [j for j in jobs if key[args.process_per](j) == k])
              for c in configs for k in dict.fromkeys(map(key[args.process_per], jobs))]
    runs = {pool.submit(run_worker, dict(task="peaks", config=c, jobs=js, seed=args.seed), None,
                        size["timeout"]): (c, js) for c, js in groups}
    found = {}
    for fut in futures.as_completed(runs):
        config, js = runs[fut]
        out, run = fut.result()
        if out is None:
            note(res, f"peaks {config} on {', '.join(j['name'] for j in js)}: {run.why()}")
            continue
        for r in out["results"]:
            found[(r["name"], r["micro_batch"], config)] = r
    for spec, mbs in size["peaks"]:
        for mb in mbs:
            for config in configs:
                r = found.get((model_name(spec), mb, config))
                if r is None:
                    continue
                v = f"{model_name(spec)}/mb{mb}/{config}"
                for k, rec in enumerate(r["steps"]):
                    for key, val in rec.items():
                        res.add(v, key, "B/param", val, x_name="step", x_value=k)
                once = dict(x_name="steps", x_value=STEPS)
                res.add(v, "state_bytes_per_param", "B/param", r["state_bytes_per_param"], **once)
                res.add(v, "params", "count", r["params"], **once)
                res.add(v, "largest_tensor_bytes", "bytes", r["largest_tensor_bytes"], **once)
                res.add(v, "baseline_rss_bytes", "bytes", r["baseline_rss_bytes"], **once)
                top = max(s["tensor_peak_per_param"] for s in r["steps"])
                print(f"[peaks] {v}: tensor peak {r['steps'][0]['tensor_peak_per_param']:.2f} first, "
                      f"{top:.2f} max B/param; RSS total {max(s['rss_total_per_param'] for s in r['steps']):.2f}",
                      flush=True)
    res.flush()
    return found


def fit_search(args, size, config, what, budget, start):
    """One optimizer's search under one budget; (largest, smallest failure, trials)."""
    trials = []
    ladder = size["ladder"]
    mb_model = size["peaks"][-1][0]

    def fits(x):
        if what == "micro_batch":
            spec = dict(task="fit", config=config, model=mb_model, micro_batch=x, seed=args.seed)
        else:
            spec = dict(task="fit", config=config, seed=args.seed, micro_batch=ladder["micro_batch"],
                        model=dict(kind="mlp", width=WIDTH_STEP * x, depth=ladder["depth"]))
        out, run = run_worker(spec, int(budget * 2**30), size["timeout"])
        code = 1 if out else (0 if run.oom_killed else -1)
        trials.append((x, code, run.peak_bytes, None if code >= 0 else run.why()))
        print(f"[budget {budget:g} GiB] {config} {what}={x if what == 'micro_batch' else WIDTH_STEP * x}: "
              f"{run.outcome} (cgroup peak "
              f"{run.peak_bytes / 2**20:.0f} MiB)", flush=True)
        return None if code < 0 else code == 1

    if what == "micro_batch":
        ok, bad = largest_that_fits(fits, start, 1, size["max_micro_batch"], grow=1.5, max_trials=size["search_trials"])
    else:  # on the width in steps of WIDTH_STEP: 6% in width is about 12% in parameters
        ok, bad = largest_that_fits(fits, start / WIDTH_STEP, 1, ladder["max_width"] // WIDTH_STEP, grow=1.25, tol=1.06,
                         max_trials=size["search_trials"])
        ok, bad = WIDTH_STEP * ok, bad and WIDTH_STEP * bad
        trials = [(WIDTH_STEP * x, *rest) for x, *rest in trials]
    return ok, bad, trials


def predicted_start(found, config, what, budget, size):
    """The size the peaks predict fits in ``budget`` (a starting point only): the micro-batch from the
    tensor peaks at the GPT's two micro-batches (less 15% for what tensors do not count), the width
    from the resident set per parameter on the MLPs."""
    gib = budget * 2**30
    if what == "micro_batch":
        spec, mbs = size["peaks"][-1]
        pts = [(mb, found[(model_name(spec), mb, config)]) for mb in mbs if (model_name(spec), mb, config) in found]
        per = [(mb, max(s["tensor_peak_per_param"] for s in r["steps"]) * r["params"]) for mb, r in pts]
        if len(per) >= 2 and per[-1][1] > per[0][1]:
            slope = (per[-1][1] - per[0][1]) / (per[-1][0] - per[0][0])
            return max(1, 0.85 * (gib - (per[0][1] - slope * per[0][0])) / slope)
        return 4
    mlps = [(model_name(s), s) for s, _ in size["peaks"] if s["kind"] == "mlp"]
    rec = next((found[(n, 8, config)] for n, _ in reversed(mlps) if (n, 8, config) in found), None)
    if rec is None:
        return 512
    bpp = max(s["rss_total_per_param"] for s in rec["steps"])
    return math.sqrt(gib / bpp / size["ladder"]["depth"])


def budgets(res, args, size, configs, found, pool):
    if not cgroups_usable():
        note(res, "budgets and distributed runs skipped: memory cgroups need root and the cgroup v1 memory "
                  f"controller at {CGROUP_ROOT}")
        return {}
    tasks = {}
    for what, key in (("micro_batch", "mb_budgets"), ("model", "model_budgets")):
        for budget in size[key]:
            for config in configs:
                start = predicted_start(found, config, what, budget, size)
                tasks[pool.submit(fit_search, args, size, config, what, budget, start)] = (what, budget, config)
    largest = {}
    done = {}
    for fut in futures.as_completed(tasks):
        done[tasks[fut]] = fut.result()
    for (what, budget, config), (ok, bad, trials) in sorted(done.items(), key=lambda kv: (
            kv[0][0], kv[0][1], configs.index(kv[0][2]))):
        x_name = "micro_batch" if what == "micro_batch" else "params"
        depth = size["ladder"]["depth"]
        size_of = (lambda w: w) if what == "micro_batch" else (lambda w: depth * (w * w + w))
        for x, code, peak, why in trials:
            v = f"{what}@{budget:g}GiB/{config}"
            res.add(v, "fits", "bool", code, x_name=x_name, x_value=size_of(x))
            res.add(v, "cgroup_peak_bytes", "bytes", peak, x_name=x_name, x_value=size_of(x))
            if why:
                note(res, f"{what} {config} at {size_of(x)} in {budget:g} GiB: {why}")
        b = dict(x_name="budget_GiB", x_value=budget)
        if bad is None:
            note(res, f"{what} {config} in {budget:g} GiB: no failure up to {size_of(ok):,} (the search's cap or "
                      "its last trial): the largest is a lower bound")
        if what == "micro_batch":
            res.add(f"micro_batch/{config}", "largest_micro_batch", "samples", ok, **b)
            if bad is not None:
                res.add(f"micro_batch/{config}", "smallest_failing_micro_batch", "samples", bad, **b)
            largest[(budget, config)] = ok
        else:
            res.add(f"model/{config}", "largest_model_params", "count", size_of(ok) if ok else 0, **b)
            res.add(f"model/{config}", "largest_model_width", "count", ok, **b)
            if bad is not None:
                res.add(f"model/{config}", "smallest_failing_model_params", "count", size_of(bad), **b)
        print(f"[budget {budget:g} GiB] {config}: largest {what} {size_of(ok) if ok else 0:,} "
              f"(first failure {size_of(bad) if bad else '-'})", flush=True)
    res.flush()
    return largest


def distributed(res, args, size, configs, largest):
    """Tokens/s on 2 ranks at an equal micro-batch and under the first micro-batch budget: from each
    optimizer's single-process largest, divided by ``DIST_STEP_DOWN`` after each kill for memory."""
    budget = size["mb_budgets"][0]
    for strategy in ("ddp", "fsdp2"):
        for config in configs:
            runs = [("equal", size["equal_micro_batch"], None)]
            if largest.get((budget, config)):
                runs.append(("budget", largest[(budget, config)], int(budget * 2**30)))
            for kind, mb, limit in runs:
                for _ in range(4 if limit else 1):
                    code = distributed_run(res, args, size, strategy, config, kind, mb, limit, budget)
                    if code != 1 or mb == 1:
                        break
                    mb = max(1, min(mb - 1, int(mb / DIST_STEP_DOWN)))
            res.flush()


def distributed_run(res, args, size, strategy, config, kind, mb, limit, budget):
    """One run on the ranks; its rows; its outcome code (0 ok, 1 killed for memory, 2 error, 3 timeout)."""
    spec = dict(task="dist", config=config, model=size["peaks"][-1][0], micro_batch=mb, strategy=strategy,
                steps=size["dist_steps"], seed=args.seed, timeout=size["timeout"])
    # both ranks, each in its own memory cgroup of ``limit`` bytes
    ranks = run_ranks(_worker_cmd(spec), 2, env=_env(), timeout=size["timeout"], memory=("gefen-peak-rank", limit),
                      join_at_start=False)
    outs = [r.result for r in ranks]
    v, x = f"{strategy}/{config}", dict(x_name="micro_batch", x_value=mb)
    if any(r.oom_killed for r in ranks):
        code = 1
    elif all(outs):
        code = 0
    else:
        code = 3 if any(r.returncode is None for r in ranks) else 2
    res.add(v, f"outcome_{kind}_micro_batch", "code", code, **x)
    if code:
        why = ("; ".join(f"rank {i}: {r.why()}" for i, r in enumerate(ranks) if r.outcome != "ok")
               if code != 1 else ", ".join(f"rank {i}" for i, r in enumerate(ranks) if r.oom_killed)
               + " killed for memory (a rank left alive then fails in its next collective)")
        note(res, f"{strategy} {config} at micro-batch {mb} ({kind}{f', {budget:g} GiB a rank' if limit else ''}): "
                  f"{why}")
        return code
    res.add(v, f"tokens_per_s_{kind}_micro_batch", "tokens/s", outs[0]["tokens_per_s"], **x)
    res.add(v, f"rank_rss_peak_bytes_{kind}_micro_batch", "bytes", max(o["rss_peak_bytes"] for o in outs), **x)
    if strategy == "ddp":
        res.add(v, f"ranks_agree_{kind}_micro_batch", "bool", float(outs[0]["ranks_agree"]), **x)
    print(f"[{strategy}] {config} mb={mb} ({kind}): {outs[0]['tokens_per_s']:,.0f} tokens/s, rank RSS peak "
          f"{max(o['rss_peak_bytes'] for o in outs) / 2**20:.0f} MiB, ranks agree {outs[0]['ranks_agree']}", flush=True)
    return 0


def note(res, text):
    print(f"[gefen_peak_memory] note: {text}", flush=True)
    res.config.setdefault("notes", []).append(text)


def _versions():
    import importlib.metadata as md

    out = {"gefen-x": gefen_x_version()}
    for dist_name in ("torchao", "gefen", "adam-mini", "numba"):
        try:
            out[dist_name] = md.version(dist_name)
        except md.PackageNotFoundError:
            out[dist_name] = ""
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--parts", nargs="+", default=None, choices=["peaks", "budgets", "distributed"],
                        help="default: all (--quick: peaks and budgets; its ranks would run AdamW only)")
    parser.add_argument("--optimizers", nargs="+", default=None, choices=list(CONFIGS),
                        help="peaks (default: all; --quick: AdamW, Gefen-8bit and the lean configuration)")
    parser.add_argument("--fit-optimizers", nargs="+", default=None, choices=list(CONFIGS))
    parser.add_argument("--dist-optimizers", nargs="+", default=None, choices=list(CONFIGS))
    parser.add_argument("--mb-budgets-gib", type=float, nargs="+", default=None)
    parser.add_argument("--model-budgets-gib", type=float, nargs="+", default=None)
    parser.add_argument("--jobs", type=int, default=2, help="worker processes at once (one thread each)")
    parser.add_argument("--process-per", choices=["run", "model", "optimizer"], default=None,
                        help="peaks: a fresh process per optimizer and model (default), also per micro-batch "
                             "(run), or one for all models (optimizer; --quick's default)")
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker(json.loads(args.worker))
    args.parts = args.parts or (["peaks", "budgets"] if args.quick else ["peaks", "budgets", "distributed"])
    size = dict(SIZES["quick" if args.quick else "full"])
    size["mb_budgets"] = args.mb_budgets_gib or size["mb_budgets"]
    size["model_budgets"] = args.model_budgets_gib or size["model_budgets"]
    args.process_per = args.process_per or ("optimizer" if args.quick else "model")
    wanted = {"peaks": args.optimizers or (QUICK["peaks"] if args.quick else list(CONFIGS)),
              "fit": args.fit_optimizers or (QUICK["fit"] if args.quick else FIT),
              "dist": args.dist_optimizers or (QUICK["dist"] if args.quick else DIST)}
    config = dict(vars(args), size=size, steps=STEPS, fit_steps=FIT_STEPS, lr=LR, lean=LEAN, optimizers=wanted,
                  models={model_name(s): s for s, _ in size["peaks"]}, target_model=model_name(size["peaks"][0][0]),
                  versions=_versions(), notes=[])
    with Results("gefen_peak_memory", args, config=config) as res:
        reasons = {c: unavailable(c) for c in set(sum(wanted.values(), []))}
        for c, why in sorted((c, w) for c, w in reasons.items() if w):
            note(res, f"skipped {why}")
        ok = {part: [c for c in names if not reasons[c]] for part, names in wanted.items()}
        found, largest = {}, {}
        with futures.ThreadPoolExecutor(args.jobs) as pool:
            if "peaks" in args.parts:
                found = peaks(res, args, size, ok["peaks"], pool)
            if "budgets" in args.parts:
                largest = budgets(res, args, size, ok["fit"], found, pool)
        if "distributed" in args.parts:
            distributed(res, args, size, ok["dist"], largest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
