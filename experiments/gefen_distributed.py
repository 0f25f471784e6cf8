"""Throughput of the GPT on two gloo ranks under DDP and FSDP2, per optimizer, and under a memory budget.

    python experiments/gefen_distributed.py            # full run -> results/gefen_distributed.csv
    python experiments/gefen_distributed.py --quick    # the small GPT, AdamW only -> results/quick/
    python analysis/gefen_distributed.py               # paper_figs/gefen_distributed.png + its section

Claim judged (Gefen, arXiv 2606.13894): more throughput than AdamW under DDP and FSDP, from the larger
micro-batches its memory allows.

2 gloo ranks (one process and one thread each), DDP and FSDP2 (``fully_shard`` per GPT block and the
root), the peaks' GPT (experiments/harness/measured_step.py's step and configurations): tokens/s over both
ranks at the micro-batch every optimizer fits (equal), and under ``--budget-gib``, every rank in a
cgroup of that size, at each one's single-process largest micro-batch in that budget, divided by 1.4
after each kill for memory (up to 3 times; a rank holds more than one process does: buckets,
gathered shards). That largest micro-batch is experiments/gefen_budgets.py's, read from
``gefen_budgets.csv`` in the same results folder where that run searched the same GPT under the same
budget (run it first, as experiments/reproduce.py does); for an optimizer it lacks, this run searches
it itself with the same search (experiments/harness/budget.py, from the peaks' prediction where
``gefen_peak_memory.csv`` is there). A note of the run says which. A run that fails or is killed is a
row (``outcome``: 0 ok, 1 killed for memory, 2 error, 3 timeout) and a note. With DDP the ranks'
weights are compared after the steps (``ranks_agree``). The budget runs need memory cgroups (root,
cgroup v1); without them only the equal micro-batch runs.

Rows (variant ``ddp/<opt>`` or ``fsdp2/<opt>``; x = micro_batch), per kind of run (``equal``,
``budget``): ``outcome_<kind>_micro_batch``, and where it ran ``tokens_per_s_<kind>_micro_batch``,
``rank_rss_peak_bytes_<kind>_micro_batch`` and (DDP) ``ranks_agree_<kind>_micro_batch``.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import json
import os
import statistics
import sys
import time

import torch

from experiments.harness import budget
from experiments.harness.child import run_ranks
from experiments.harness import check
from experiments.harness.common import Results, add_common_args, read_results
from experiments.harness.measured_step import (CONFIGS, GPT_SPEC, LEAN, LR, TIMEOUT, available, build_model,
                                       build_optimizer, fit_trial, make_batch, model_name, note, train_in_budget,
                                       train_step, versions, warm_up, worker_cmd, worker_env, worker_main)
from experiments.harness.memcg import cgroups_usable, join_memory_cgroup
from experiments.harness.peak import peak_rss_bytes, reset_peak_rss, rss_bytes

MODULE = "experiments.gefen_distributed"
STEP_DOWN = 1.4  # a run killed for memory is tried again at micro-batch / this, up to 3 times
SIZES = {"full": dict(equal_micro_batch=8, dist_steps=(1, 3)), "quick": dict(equal_micro_batch=4, dist_steps=(1, 2))}
OPTIMIZERS = ["AdamW", "AdamW+bf16", "torchao-AdamW8bit", "gefen-upstream", "Gefen-8bit", LEAN]
QUICK = ["AdamW"]


# the --check size: the full run's flags it overrides (experiments/harness/check.py)
CHECK = {"--optimizers": ["AdamW", "Gefen-8bit"]}
CHECK_NOTE = ("two optimizers on the full run's model and budget; no row of the claims table reads this experiment")


def rank_job(spec):
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


# ------------------------------------------------------------------------- the budget's micro-batch
def searched_micro_batches(folder, gpt, gib) -> dict:
    """{optimizer: largest micro-batch} of ``gefen_budgets.csv`` in ``folder`` where that run searched
    the same GPT under ``gib`` GiB; {} without it."""
    path = folder / "gefen_budgets.csv"
    if not path.exists():
        return {}
    meta = json.loads((folder / "gefen_budgets.config.json").read_text()) if (
        folder / "gefen_budgets.config.json").exists() else {}
    if (meta.get("config") or {}).get("models", {}).get(model_name(gpt)) != gpt:
        return {}
    return {r["variant"].split("/", 1)[1]: int(r["value"]) for r in read_results(path)
            if r["metric"] == "largest_micro_batch" and r["variant"].startswith("micro_batch/") and r["x_value"] == gib}


def largest_micro_batches(res, args, size, configs) -> dict:
    """{optimizer: its single-process largest micro-batch under ``args.budget_gib``}: gefen_budgets'
    where it has it, else searched here (memory cgroups needed); the source of each in a note."""
    gpt, gib = GPT_SPEC[size], args.budget_gib
    found = searched_micro_batches(res.results_dir, gpt, gib)
    out = {c: found[c] for c in configs if c in found}
    if out:
        note(res, f"largest micro-batches in {gib:g} GiB from gefen_budgets.csv beside this run's CSV: "
                  + ", ".join(f"{c} {mb}" for c, mb in out.items()))
    missing = [c for c in configs if c not in out]
    if missing and not cgroups_usable():
        note(res, f"budget runs of {', '.join(missing)} skipped: no gefen_budgets.csv value to start from, and "
                  "memory cgroups (root, cgroup v1) to search one are missing")
        return out
    peaks = budget.read_peaks(res.results_dir)
    for config in missing:
        trial = lambda mb: fit_trial(MODULE, config, gpt, mb, gib, args.seed, TIMEOUT[size])  # noqa: E731
        start = budget.micro_batch_start(peaks, model_name(gpt), config, gib)
        ok, bad, _ = budget.search(trial, "micro_batch", start, budget.MICRO_BATCH[size])
        out[config] = ok
        note(res, f"largest micro-batch of {config} in {gib:g} GiB searched here: {ok} (first failure {bad})")
    return {c: mb for c, mb in out.items() if mb}


# ----------------------------------------------------------------------------------------- the runs
def measure(res, args, size, configs, largest):
    """Tokens/s on 2 ranks at an equal micro-batch and under the budget: from each optimizer's
    single-process largest, divided by ``STEP_DOWN`` after each kill for memory."""
    for strategy in ("ddp", "fsdp2"):
        for config in configs:
            runs = [("equal", SIZES[size]["equal_micro_batch"], None)]
            if largest.get(config):
                runs.append(("budget", largest[config], int(args.budget_gib * 2**30)))
            for kind, mb, limit in runs:
                for _ in range(4 if limit else 1):
                    code = ranks_run(res, args, size, strategy, config, kind, mb, limit)
                    if code != 1 or mb == 1:
                        break
                    mb = max(1, min(mb - 1, int(mb / STEP_DOWN)))
            res.flush()


def ranks_run(res, args, size, strategy, config, kind, mb, limit):
    """One run on the ranks; its rows; its outcome code (0 ok, 1 killed for memory, 2 error, 3 timeout)."""
    spec = dict(task="dist", config=config, model=GPT_SPEC[size], micro_batch=mb, strategy=strategy,
                steps=SIZES[size]["dist_steps"], seed=args.seed, timeout=TIMEOUT[size])
    # both ranks, each in its own memory cgroup of ``limit`` bytes
    ranks = run_ranks(worker_cmd(MODULE, spec), 2, env=worker_env(), timeout=TIMEOUT[size],
                      memory=("gefen-peak-rank", limit), join_at_start=False)
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
        note(res, f"{strategy} {config} at micro-batch {mb} ({kind}"
                  f"{f', {args.budget_gib:g} GiB a rank' if limit else ''}): {why}")
        return code
    res.add(v, f"tokens_per_s_{kind}_micro_batch", "tokens/s", outs[0]["tokens_per_s"], **x)
    res.add(v, f"rank_rss_peak_bytes_{kind}_micro_batch", "bytes", max(o["rss_peak_bytes"] for o in outs), **x)
    if strategy == "ddp":
        res.add(v, f"ranks_agree_{kind}_micro_batch", "bool", float(outs[0]["ranks_agree"]), **x)
    print(f"[{strategy}] {config} mb={mb} ({kind}): {outs[0]['tokens_per_s']:,.0f} tokens/s, rank RSS peak "
          f"{max(o['rss_peak_bytes'] for o in outs) / 2**20:.0f} MiB, ranks agree {outs[0]['ranks_agree']}", flush=True)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--optimizers", nargs="+", default=None, choices=list(CONFIGS),
                        help="default: six (--quick: AdamW)")
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="each rank's memory budget (default: gefen_budgets' first micro-batch budget)")
    args = check.parse(parser, argv)
    if args.worker is not None:
        return worker_main(json.loads(args.worker), {"fit": train_in_budget, "dist": rank_job})
    size = "quick" if args.quick else "full"
    args.budget_gib = args.budget_gib or budget.MICRO_BATCH[size]["budgets"][0]
    wanted = args.optimizers or (QUICK if args.quick else OPTIMIZERS)
    gpt = GPT_SPEC[size]
    config = dict(vars(args), lr=LR, lean=LEAN, optimizers=wanted, timeout=TIMEOUT[size], models={model_name(gpt): gpt},
                  size=dict(SIZES[size], mb_budgets=[args.budget_gib]), versions=versions(), notes=[])
    with Results("gefen_distributed", args, config=config) as res:
        configs = available(res, wanted)
        largest = largest_micro_batches(res, args, size, configs)
        measure(res, args, size, configs, largest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
