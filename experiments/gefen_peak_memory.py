"""Gefen's peak memory of a training step on CPU, next to its peers.

    python experiments/gefen_peak_memory.py            # full run -> results/gefen_peak_memory.csv
    python experiments/gefen_peak_memory.py --quick    # small models, three optimizers -> results/quick/
    python analysis/gefen_peak_memory.py               # paper_figs/gefen_peak_memory.png + its section

    # gefen-x (the maintained fork of upstream gefen) installs as module ``gefen``, as upstream does;
    # it goes into a folder of its own, which the registry loads as ``gefen_x`` (skipped if absent):
    python -m pip install --no-deps --target third_party/gefen_x gefen-x==0.5.0

Claim judged (Gefen, arXiv 2606.13894): "the lowest peak memory among the compared methods". The
state bytes of experiments/gefen_memory.py are not the peak of a step: weights, gradients and
temporaries count too. What each optimizer trains in a memory budget is experiments/gefen_budgets.py
(it starts its searches from these peaks), its throughput on two ranks experiments/gefen_distributed.py.

Models: MLPs of twelve ``Linear(w, w)`` + ReLU (w = 2048: 50.4 M parameters, and w = 2896: 100.7 M)
at micro-batches 8 and 64, and experiments/harness/models.py's GPT (d=512, 4 layers, 64 tokens, character
data) at 4 and 16. Optimizers (registry names): AdamW (fused), AdamW on bf16 weights (pure bf16),
Adam-mini, torchao-AdamW8bit/4bit, gefen-upstream, gefen-x and ours (Gefen-8bit, -4bit,
-8bit-factored, -4bit-factored), ours also on bf16 weights with stochastic rounding (``+bf16-sr``)
and with the step inside backward (``+in-backward``, ``optim.step_in_backward``); the step and the
configurations are experiments/harness/measured_step.py's. Each optimizer runs in a fresh process per model
on one torch thread (its micro-batches in turn, each on a model built anew, with the allocator's
free pages given back in between), first warmed up on a tiny model (and torchao's compiled steps on
the measured shapes), so that what is measured is the training of the measured model. bf16 models
are built in bf16 (the weights ``.to(torch.bfloat16)`` gives, without the fp32 copy on the way).
Every step (0: the first; 1-3: later) is measured with experiments/peak.PeakMemory around forward +
backward + step + ``zero_grad(set_to_none=True)``, the batch made before. A run that fails is a
note in the config.

Rows (variant ``<model>/mb<m>/<optimizer>[+mode]``; x = step), per parameter: ``tensor_peak``
(live tensor bytes at the peak, what ``torch.cuda.max_memory_allocated`` reports on a GPU) and its
split at the peak (``weights``, ``gradients``, ``state``, ``rest``), ``transient`` (the largest
``rest``), ``rss_peak`` (the rise of the resident set above its level at the step's start) and
``rss_total`` (resident set at the step's peak above the warmed process before the model was
built); once (x = steps): ``state_bytes_per_param`` (registry.state_bytes after the steps),
``params``, ``largest_tensor_bytes``, ``baseline_rss_bytes``.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import concurrent.futures as futures
import json
import sys

import torch

from experiments.harness import check
from experiments.harness.common import Results, add_common_args
from experiments.harness.measured_step import (CONFIGS, GPT_SPEC, LEAN, LR, TIMEOUT, available, build_model, build_optimizer,
                                       make_batch, model_name, note, release, run_worker, train_step, versions,
                                       warm_up, worker_main)
from experiments.harness.peak import PeakMemory, peak_rss_bytes, rss_bytes
from experiments.harness.registry import state_bytes

STEPS = 4  # measured steps: 0 is the first, 1..3 later ones
MODELS = {  # (model spec, micro-batches) of the peaks
    "full": [(dict(kind="mlp", width=2048, depth=12), (8, 64)), (dict(kind="mlp", width=2896, depth=12), (8, 64)),
             (GPT_SPEC["full"], (4, 16))],
    "quick": [(dict(kind="mlp", width=256, depth=12), (8, 64)), (GPT_SPEC["quick"], (4, 16))],
}
QUICK = ["AdamW", "Gefen-8bit", LEAN]


# the --check size: the full run's flags it overrides (experiments/harness/check.py)
CHECK = {"--optimizers": ["AdamW", "AdamW+bf16", "Gefen-8bit", "Gefen-8bit-factored+bf16-sr+in-backward"]}
CHECK_NOTE = ("four of the optimizers on the full run's models: the row's verdict also needs every peer's peak, so it "
              "is computed only where they are run")


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


def peaks_job(spec):
    """A worker's job: one optimizer on its models and micro-batches, each warmed up and measured."""
    results = []
    for job in spec["jobs"]:
        warm_up(spec["config"], job["model"], CONFIGS[spec["config"]][1])
        results.append(dict(job, **measure_peaks(spec["config"], job["model"], job["micro_batch"], spec["seed"])))
    return dict(results=results)


def measure(res, args, models, configs, pool, timeout):
    """Every optimizer's peaks, its workers ``args.process_per``; the rows, in the order of the models."""
    jobs = [dict(model=spec, micro_batch=mb, name=model_name(spec)) for spec, mbs in models for mb in mbs]
    key = {"run": lambda j: (j["name"], j["micro_batch"]), "model": lambda j: j["name"], "optimizer": lambda j: 0}
    groups = [(c, [j for j in jobs if key[args.process_per](j) == k])
              for c in configs for k in dict.fromkeys(map(key[args.process_per], jobs))]
    runs = {pool.submit(run_worker, "experiments.gefen_peak_memory",
                        dict(task="peaks", config=c, jobs=js, seed=args.seed), None, timeout): (c, js)
            for c, js in groups}
    found = {}
    for fut in futures.as_completed(runs):
        config, js = runs[fut]
        out, run = fut.result()
        if out is None:
            note(res, f"peaks {config} on {', '.join(j['name'] for j in js)}: {run.why()}")
            continue
        for r in out["results"]:
            found[(r["name"], r["micro_batch"], config)] = r
    for spec, mbs in models:
        for mb in mbs:
            for config in configs:
                r = found.get((model_name(spec), mb, config))
                if r is not None:
                    add_rows(res, f"{model_name(spec)}/mb{mb}/{config}", r)
    res.flush()


def add_rows(res, v, r):
    """The rows of one optimizer, model and micro-batch."""
    for k, rec in enumerate(r["steps"]):
        for key, val in rec.items():
            res.add(v, key, "B/param", val, x_name="step", x_value=k)
    once = dict(x_name="steps", x_value=STEPS)
    res.add(v, "state_bytes_per_param", "B/param", r["state_bytes_per_param"], **once)
    res.add(v, "params", "count", r["params"], **once)
    res.add(v, "largest_tensor_bytes", "bytes", r["largest_tensor_bytes"], **once)
    res.add(v, "baseline_rss_bytes", "bytes", r["baseline_rss_bytes"], **once)
    top = max(s["tensor_peak_per_param"] for s in r["steps"])
    print(f"[peaks] {v}: tensor peak {r['steps'][0]['tensor_peak_per_param']:.2f} first, {top:.2f} max B/param; "
          f"RSS total {max(s['rss_total_per_param'] for s in r['steps']):.2f}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--optimizers", nargs="+", default=None, choices=list(CONFIGS),
                        help="default: all (--quick: AdamW, Gefen-8bit and the lean configuration)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes at once (one thread each)")
    parser.add_argument("--process-per", choices=["run", "model", "optimizer"], default=None,
                        help="a fresh process per optimizer and model (default), also per micro-batch (run), "
                             "or one for all models (optimizer; --quick's default)")
    args = check.parse(parser, argv)
    if args.worker is not None:
        return worker_main(json.loads(args.worker), {"peaks": peaks_job})
    size = "quick" if args.quick else "full"
    models = MODELS[size]
    args.process_per = args.process_per or ("optimizer" if args.quick else "model")
    wanted = args.optimizers or (QUICK if args.quick else list(CONFIGS))
    config = dict(vars(args), steps=STEPS, lr=LR, lean=LEAN, optimizers=wanted, timeout=TIMEOUT[size],
                  models={model_name(s): s for s, _ in models}, micro_batches={model_name(s): mbs for s, mbs in models},
                  target_model=model_name(models[0][0]), versions=versions(), notes=[])
    with Results("gefen_peak_memory", args, config=config) as res:
        configs = available(res, wanted)
        with futures.ThreadPoolExecutor(args.jobs) as pool:
            measure(res, args, models, configs, pool, TIMEOUT[size])
    return 0


if __name__ == "__main__":
    sys.exit(main())
