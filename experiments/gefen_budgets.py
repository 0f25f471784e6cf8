"""What each optimizer trains in a memory budget on CPU: the largest GPT micro-batch and the largest MLP.

    python experiments/gefen_budgets.py            # full run -> results/gefen_budgets.csv
    python experiments/gefen_budgets.py --quick    # small models, one budget each, two optimizers -> results/quick/
    python analysis/gefen_budgets.py               # paper_figs/gefen_budgets.png + its section

Claims judged (Gefen, arXiv 2606.13894): larger micro-batches than AdamW, and (ours) a lean mode that
trains a model of at least 3x the parameters fused AdamW does in the same budget.

In a memory cgroup that the worker joins after its warm-up (so the budget counts what training the
model adds, as a GPU's memory would), 3 steps must run without an OOM kill (experiments/
measured_step.fit_trial, the step and configurations of experiments/gefen_peak_memory.py): the
largest micro-batch of the peaks' GPT under each of ``--mb-budgets-gib``, and the largest MLP (twelve
layers, micro-batch 8, width searched in multiples of 64) under each of ``--model-budgets-gib``.
The search is experiments/harness/budget.py's: a geometric ladder from a start, then bisection to 10% in
micro-batch and 6% in width (12% in parameters). The start is the size the peaks predict, read from
``gefen_peak_memory.csv`` in the same results folder (run experiments/gefen_peak_memory.py first, as
experiments/reproduce.py does); without it, or for an optimizer it lacks, a fixed guess (4 samples,
width 512), which costs trials, not accuracy. Memory cgroups need root and the cgroup v1 memory
controller; without them the run writes no rows and says so in a note.

Rows (x = the trial's micro-batch or parameters): ``micro_batch@<b>GiB/<opt>`` and
``model@<b>GiB/<opt>`` per trial (``fits``: 1, 0 killed for memory, -1 failed otherwise;
``cgroup_peak_bytes``); x = budget_GiB: ``micro_batch/<opt>`` (``largest_micro_batch``,
``smallest_failing_micro_batch``) and ``model/<opt>`` (``largest_model_params``, ``largest_model_width``,
``smallest_failing_model_params``).
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

from experiments.harness import budget
from experiments.harness import check
from experiments.harness.common import Results, add_common_args, output_dir
from experiments.harness.measured_step import (CONFIGS, FIT_STEPS, GPT_SPEC, LEAN, LR, TIMEOUT, available, fit_trial,
                                       model_name, note, train_in_budget, versions, worker_main)
from experiments.harness.memcg import CGROUP_ROOT, cgroups_usable

MODULE = "experiments.gefen_budgets"
LADDER = {"full": dict(kind="mlp", depth=12, micro_batch=8, max_width=16384, budgets=[0.5, 1.0], trials=8),
          "quick": dict(kind="mlp", depth=4, micro_batch=8, max_width=4096, budgets=[0.125], trials=2)}
OPTIMIZERS = ["AdamW", "AdamW+bf16", "torchao-AdamW8bit", "torchao-AdamW4bit", "gefen-upstream", "gefen-x",
              "Gefen-8bit", LEAN]
QUICK = ["AdamW", LEAN]


# the --check size: the full run's flags it overrides (experiments/harness/check.py)
CHECK = {"--optimizers": ["AdamW", "Gefen-8bit-factored+bf16-sr+in-backward"], "--model-budgets-gib": 0.5}
CHECK_NOTE = ("AdamW and lean mode only, one model budget: the micro-batch comparison of the claim, not every peer")


def search(args, size, config, what, gib, peaks):
    """One optimizer's search under ``gib`` GiB: (largest, smallest failure, trials)."""
    gpt, ladder = GPT_SPEC[size], LADDER[size]
    if what == "micro_batch":
        start = budget.micro_batch_start(peaks, model_name(gpt), config, gib)
        trial = lambda mb: fit_trial(MODULE, config, gpt, mb, gib, args.seed, TIMEOUT[size])  # noqa: E731
        return budget.search(trial, what, start, budget.MICRO_BATCH[size])
    start = budget.width_start(peaks, config, gib, ladder["depth"], ladder["micro_batch"])
    trial = lambda w: fit_trial(MODULE, config, dict(kind="mlp", width=w, depth=ladder["depth"]),  # noqa: E731
                                ladder["micro_batch"], gib, args.seed, TIMEOUT[size])
    return budget.search(trial, "width", start, dict(max_width=ladder["max_width"], trials=ladder["trials"]))


def measure(res, args, size, configs, peaks, pool):
    """Every search, ``args.jobs`` at once; the rows, per kind, budget and optimizer."""
    tasks = {}
    for what, budgets in (("micro_batch", args.mb_budgets_gib), ("model", args.model_budgets_gib)):
        for gib in budgets:
            for config in configs:
                tasks[pool.submit(search, args, size, config, what, gib, peaks)] = (what, gib, config)
    done = {tasks[fut]: fut.result() for fut in futures.as_completed(tasks)}
    depth = LADDER[size]["depth"]
    for (what, gib, config), (ok, bad, trials) in sorted(done.items(), key=lambda kv: (
            kv[0][0], kv[0][1], configs.index(kv[0][2]))):
        add_rows(res, what, gib, config, ok, bad, trials, depth)
    res.flush()


def add_rows(res, what, gib, config, ok, bad, trials, depth):
    """The rows of one search: each trial, then the largest size and the smallest failure."""
    x_name = "micro_batch" if what == "micro_batch" else "params"
    size_of = (lambda w: w) if what == "micro_batch" else (lambda w: depth * (w * w + w))
    for x, code, peak, why in trials:
        v = f"{what}@{gib:g}GiB/{config}"
        res.add(v, "fits", "bool", code, x_name=x_name, x_value=size_of(x))
        res.add(v, "cgroup_peak_bytes", "bytes", peak, x_name=x_name, x_value=size_of(x))
        if why:
            note(res, f"{what} {config} at {size_of(x)} in {gib:g} GiB: {why}")
    b = dict(x_name="budget_GiB", x_value=gib)
    if bad is None:
        note(res, f"{what} {config} in {gib:g} GiB: no failure up to {size_of(ok):,} (the search's cap or "
                  "its last trial): the largest is a lower bound")
    if what == "micro_batch":
        res.add(f"micro_batch/{config}", "largest_micro_batch", "samples", ok, **b)
        if bad is not None:
            res.add(f"micro_batch/{config}", "smallest_failing_micro_batch", "samples", bad, **b)
    else:
        res.add(f"model/{config}", "largest_model_params", "count", size_of(ok) if ok else 0, **b)
        res.add(f"model/{config}", "largest_model_width", "count", ok, **b)
        if bad is not None:
            res.add(f"model/{config}", "smallest_failing_model_params", "count", size_of(bad), **b)
    print(f"[budget {gib:g} GiB] {config}: largest {what} {size_of(ok) if ok else 0:,} "
          f"(first failure {size_of(bad) if bad else '-'})", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--optimizers", nargs="+", default=None, choices=list(CONFIGS),
                        help="default: eight (--quick: AdamW and the lean configuration)")
    parser.add_argument("--mb-budgets-gib", type=float, nargs="+", default=None)
    parser.add_argument("--model-budgets-gib", type=float, nargs="+", default=None)
    parser.add_argument("--jobs", type=int, default=2, help="searches at once (one worker process each)")
    args = check.parse(parser, argv)
    if args.worker is not None:
        return worker_main(json.loads(args.worker), {"fit": train_in_budget})
    size = "quick" if args.quick else "full"
    args.mb_budgets_gib = args.mb_budgets_gib or budget.MICRO_BATCH[size]["budgets"]
    args.model_budgets_gib = args.model_budgets_gib or LADDER[size]["budgets"]
    wanted = args.optimizers or (QUICK if args.quick else OPTIMIZERS)
    folder = output_dir(args)
    peaks = budget.read_peaks(folder)
    starts_from = ("the peaks' prediction (gefen_peak_memory.csv beside this run's CSV)" if peaks
                   else f"fixed guesses {budget.GUESS} (no gefen_peak_memory.csv beside this run's CSV)")
    config = dict(vars(args), fit_steps=FIT_STEPS, lr=LR, lean=LEAN, optimizers=wanted, timeout=TIMEOUT[size],
                  models={model_name(GPT_SPEC[size]): GPT_SPEC[size]}, starts_from=starts_from,
                  size=dict(ladder=LADDER[size], micro_batch_search=budget.MICRO_BATCH[size],
                            mb_budgets=args.mb_budgets_gib, model_budgets=args.model_budgets_gib),
                  versions=versions(), notes=[])
    with Results("gefen_budgets", args, config=config) as res:
        configs = available(res, wanted)
        if not cgroups_usable():
            note(res, f"budgets skipped: memory cgroups need root and the cgroup v1 memory controller at {CGROUP_ROOT}")
            return 0
        with futures.ThreadPoolExecutor(args.jobs) as pool:
            measure(res, args, size, configs, peaks, pool)
    return 0


if __name__ == "__main__":
    sys.exit(main())
