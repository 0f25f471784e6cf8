"""Convergence: a character-level GPT trained by every memory-light optimizer and its peers.

    python experiments/convergence.py              # full run -> results/convergence.csv
    python experiments/convergence.py --quick      # smaller model, fewer steps -> results/quick/
    python analysis/convergence.py                 # paper_figs/convergence.png
    python experiments/convergence.py --optimizers AdamW Gefen-8bit --lrs 1e-3 3e-3 --seeds 1
    python experiments/convergence.py --extra none   # the full run without the extra configurations
    # two architectures the optimizers were not developed on, under both protocols (below), a file each
    python experiments/convergence.py --experiment convergence_encoder   # -> results/convergence_encoder.csv
    python experiments/convergence.py --experiment convergence_llama     # -> results/convergence_llama.csv
    python analysis/convergence_encoder.py; python analysis/convergence_llama.py   # their figures and tables
    # the encoder at 3,000 steps (3 seeds, drop-in) -> results/convergence_long.csv
    python experiments/convergence.py --experiment convergence_long; python analysis/convergence_long.py
    # the same at the 1,000-step run's lr, 4e-3, held fixed, 5 seeds -> results/convergence_long_lr.csv
    python experiments/convergence.py --experiment convergence_long_lr; python analysis/convergence_long_lr.py
    # bf16 weights (stochastic rounding) beside fp32 AdamW on the 1.27M model -> results/convergence_bf16.csv
    python experiments/convergence.py --experiment convergence_bf16 --size large --extra none \
        --optimizers AdamW AdamW+bf16 Gefen-8bit-factored Gefen-8bit+bf16-sr Gefen-8bit-factored+bf16-sr
    python analysis/convergence_bf16.py            # paper_figs/convergence_bf16.png

Does Gefen reach AdamW's validation loss with about one byte of optimizer state per parameter?
This is the one experiment that answers it: one Gefen-vs-AdamW number per model. A nanoGPT-style
character model (experiments/harness/models.py) learns Python's documentation topics plus standard-library
sources (experiments/harness/data.py; 90/10 train/validation split by chunks). Optimizers (registry names):
AdamW, Adam-mini, torchao-AdamW8bit, torchao-AdamW4bit, gefen-upstream, gefen-x, Gefen-8bit, Gefen-4bit,
Gefen-8bit-factored, Gefen-4bit-factored (``layout="factored"``), Gefen-8bit-compact,
Gefen-4bit-compact (the factored state at Gefen-X's bytes or fewer, ``layout="compact"``): the full
run's, and every configuration's below; and on
bf16 weights (``--experiment convergence_bf16``: the
model converted with ``.to(torch.bfloat16)``, no fp32 copy anywhere; the loss in fp32): AdamW+bf16
(fused AdamW, its moments bf16 as the weights, rounding to nearest), Gefen-8bit+bf16-sr and
Gefen-8bit-factored+bf16-sr (``stochastic_rounding=True``). Their ratios are to fp32 AdamW's loss.
The step stays outside backward (``optim.step_in_backward`` cannot clip by the global norm).

The full run also trains two extra configurations, each with its own lr grid, whose rows carry the
variant ``<model label>/<optimizer>``: a larger one (``CHAR_LM["large"]``: about 11x the
parameters, 1,000 steps) with the optimizers of ``LARGE`` (one quantised torchao peer, the slowest
on CPU, is enough there), and one on another corpus and shape (``CHAR_LM["docstrings"]``: English
prose only, the standard library's docstrings; a 429k-parameter model, 1,000 steps) with AdamW,
Adam-mini and the Gefen variants. Runs are single-threaded; ``--jobs 2`` (the full run's default)
trains two at a time, each in its own process (results do not depend on it: every run is seeded
and deterministic). Each finished run is journaled (``results/partial/<experiment>.jsonl``,
``harness.journal``): a run stopped part way and started again with the same code, configuration,
versions and CPU reuses the runs it finished; the journal goes once the CSV is written. Two more
configurations judge the optimizers on architectures they were not
developed on, each its own experiment and results file (``--experiment convergence_encoder``,
``convergence_llama``: the architecture as the main configuration, no extra ones, the optimizers
of ``UNTUNED``, both protocols; ``--extra encoder llama`` adds them to a run of this file instead;
``convergence_long`` trains the encoder 3,000 steps, 3 seeds, drop-in protocol, AdamW on lrs 2e-3..8e-3;
``convergence_long_lr`` the same at 4e-3 only, the 1,000-step run's drop-in lr, 5 seeds):
``CHAR_LM["encoder"]``, a stack of
PyTorch's pre-norm ``nn.TransformerEncoderLayer`` with its fused q/k/v tensor, and
``CHAR_LM["llama"]``, a Llama-style decoder (RMSNorm, SwiGLU, rotary embeddings, no biases); both
430k parameters on the default corpus, batch 32, 1,000 steps, 5 seeds, with the optimizers of
``EXTRA_OPTIMIZERS``.

Protocol (experiments/harness/train.py): the same initialisation and batches per seed for every optimizer,
linear warm-up over 5% of the steps then cosine decay to 10%, gradient clipping at 1.0, decoupled
weight decay 0.1 on every tensor (Adam-mini exempts norms and biases by its own name rule). Each
optimizer's peak learning rate is the best of a grid by the final validation loss of the first
seed; that rate is rerun with the other seeds (``--protocol best``). The drop-in protocol
(``--protocol dropin``; ``both``, the default but for convergence_bf16, runs the two, sharing the runs
they have in common) is a user's who
swaps AdamW out without tuning: AdamW's grid on the first seed, then every optimizer at AdamW's best
rate on every seed; an optimizer of ``LR_SCALED`` also runs at the multiple of that rate its authors
advise, as variant ``<name>@<multiple>`` (gefen-x's README: about 0.6x AdamW's). An optimizer that
fails to construct or to step is skipped with its reason printed, and writes no rows.

Rows (variant = the optimizer's registry name):
- per grid point, first seed: ``lr_sweep_val_loss`` against ``lr``; per optimizer ``best_lr``;
- per seed at the best lr: ``val_loss`` and ``train_loss`` (nats/char) against ``step``;
  ``final_val_loss``, ``state_bytes``, ``state_bytes_per_param``, ``params``, ``step_time`` (median
  ``optimizer.step()``, ms) and ``wall_time`` against ``lr``; ``state_bytes_per_param_of_kind`` and
  ``params_of_kind`` against ``kind`` (experiments/harness/registry.py's ``state_bytes_by_kind``: matrix, embedding, vector,
  and shared state per parameter of the model);
- ``val_loss_vs_adamw`` per seed (final validation loss / AdamW's of the same seed) and its
  ``_mean``, ``_median``, ``_std``, ``_min`` and ``_max`` over seeds, against ``model`` (variant = the
  optimizer's name in every configuration).

Drop-in rows carry the variant ``dropin/<optimizer>`` (``<model label>/dropin/<optimizer>`` in an
extra configuration; ``val_loss_vs_adamw`` rows ``dropin/<optimizer>``, against ``model``): AdamW's
rows as above, every other optimizer's the per-seed rows and ``lr`` (against ``selected_by``) in
place of the sweep and ``best_lr``.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import math
import statistics
import sys

import torch

from experiments.harness import check, data
from experiments.harness.common import Results, add_common_args, add_kind_rows
from experiments.harness.models import char_lm_model
from experiments.harness.journal import Journal, host_cpu, journaled
from experiments.harness.pool import RunPool
from experiments.harness.registry import DENSE, make_optimizer, state_bytes, state_bytes_by_kind
from experiments.harness.tracking import Run, Tracking, curve_summary, live_logger
from experiments.harness.train import CHAR_LM, GRAD_CLIP, WEIGHT_DECAY, char_lm_label, char_lm_problem, train_lm

EXPERIMENT = "convergence"
# bf16 weights: "<registry name>+bf16" (rounding to nearest) or "+bf16-sr" (Gefen's stochastic rounding)
BF16 = ["AdamW+bf16", "Gefen-8bit+bf16-sr", "Gefen-8bit-factored+bf16-sr"]
OPTIMIZERS = DENSE + BF16
COMPACT = ["Gefen-8bit-compact", "Gefen-4bit-compact"]  # the factored state at Gefen-X's bytes or fewer
LARGE = ["AdamW", "Adam-mini", "torchao-AdamW8bit", "gefen-upstream", "gefen-x", "Gefen-8bit", "Gefen-4bit",
         "Gefen-8bit-factored", "Gefen-4bit-factored", *COMPACT]
# the optimizers of each extra configuration (LARGE for a size not named here): on the second
# corpus Gefen's against AdamW's, Adam-mini's and the two quantised peers', upstream (ours' numerics) out
EXTRA_OPTIMIZERS = {"docstrings": ["AdamW", "Adam-mini", "torchao-AdamW8bit", "gefen-x", "Gefen-8bit", "Gefen-4bit",
                                   "Gefen-8bit-factored", "Gefen-4bit-factored", *COMPACT]}
# on the architectures Gefen was not developed on: the published Gefen, the factored one (both layouts) and gefen-x
UNTUNED = ["AdamW", "gefen-x", "torchao-AdamW8bit", "Gefen-8bit", "Gefen-8bit-factored", "Gefen-4bit-factored",
           *COMPACT]
EXTRA_OPTIMIZERS.update(encoder=UNTUNED, llama=UNTUNED)
FULL_EXTRA = ["large", "docstrings"]
# results files of one architecture each, run as the main configuration (no extra configurations)
# with defaults of their own: CHAR_LM size, optimizers, protocol, and steps and seeds where not the size's
ARCH_EXPERIMENTS = {
    "convergence_encoder": dict(size="encoder", optimizers=UNTUNED, protocol="both"),
    "convergence_llama": dict(size="llama", optimizers=UNTUNED, protocol="both"),
    # does the gap grow with training? the encoder 3x as long, fewer seeds, AdamW's lr (on a grid of
    # factors of two around its best at 1,000 steps, 4e-3)
    "convergence_long": dict(size="encoder", optimizers=["AdamW", "gefen-x", "Gefen-8bit-factored",
                                                         "Gefen-4bit-factored", *COMPACT], protocol="dropin",
                             steps=3000, seeds=3,
                             lrs=[2e-3, 4e-3, 8e-3]),
}
# the same 3,000 steps at the 1,000-step run's drop-in lr held fixed (AdamW's best there, 4e-3): with
# the lr unchanged, a gap that still grows is the training length's, not the lr's
ARCH_EXPERIMENTS["convergence_long_lr"] = dict(ARCH_EXPERIMENTS["convergence_long"], lrs=[4e-3], seeds=5)
PROTOCOLS = ("best", "dropin", "both")
DROPIN = "dropin/"  # the variant prefix of the drop-in protocol's rows
# optimizers whose authors advise a multiple of AdamW's lr: in the drop-in protocol they also run at
# it, as "<name>@<multiple>" (gefen-x's README: about 0.6x)
LR_SCALED = {"gefen-x": 0.6}


def build(name, model, lr, cfg):
    """The optimizer of variant ``name`` over ``model`` (a "+bf16" variant's model must be bf16; an
    "@<multiple>" suffix names the drop-in lr, not the optimizer)."""
    base, _, mode = name.partition("@")[0].partition("+")
    options = {"dim": cfg.n_embd, "n_heads": cfg.n_head} if base == "Adam-mini" else {}
    if mode == "bf16-sr":
        options["stochastic_rounding"] = True
    return make_optimizer(base, model, lr, WEIGHT_DECAY, **options)


def make_model(name, cfg):
    """The model of ``cfg``, bf16 for a "+bf16" variant (initialised in fp32, as every other)."""
    model = char_lm_model(cfg)
    return model.to(torch.bfloat16) if "+bf16" in name else model


def train_one(name, lr, seed, size, cfg, corpus, progress, tracking: Tracking | None = None):
    """One run of optimizer ``name`` at ``lr`` and ``seed``; with ``tracking``, its own W&B run (the
    curves live at every evaluation, the summary at the end)."""
    torch.manual_seed(seed)
    model = make_model(name, cfg)
    opt = build(name, model, lr, cfg)
    params = sum(p.numel() for p in model.parameters())
    run = tracking.train_run(model=char_lm_label(size), optimizer=name, lr=lr, seed=seed, config=dict(
        {k: v for k, v in size.items() if k not in ("lrs", "seeds")}, model=vars(cfg), params=params, weight_decay=WEIGHT_DECAY, grad_clip=GRAD_CLIP,
        schedule="5% linear warm-up, cosine to 10%", threads=torch.get_num_threads())) if tracking else Run()
    with run:
        out = train_lm(model, opt, corpus[0], corpus[1], lr=lr, steps=size["steps"], batch=size["batch"], seed=seed,
                       eval_every=size["eval_every"], progress=progress, desc=f"{name} lr={lr:g} seed={seed}",
                       on_eval=live_logger(run, lambda: {"state/bytes": state_bytes(opt)}))
        out["params"] = params
        out["state_bytes_by_kind"] = state_bytes_by_kind(opt, model)
        out["state_bytes"] = state_bytes(opt)
        run.summary(curve_summary(out["val"], out["train"], out.pop("step_times"), extra={
            "final/state_bytes": out["state_bytes"], "final/state_bytes_per_param": out["state_bytes"] / params,
            "params": params, "wall_seconds": out["wall"]}))
    return out


def _job(name, lr, seed, size, progress, tracking=None):
    """One training run; the problem is built once per process."""
    cfg, corpus, _ = char_lm_problem(size)
    try:
        build(name, make_model(name, cfg), 1e-3, cfg)
        out = train_one(name, lr, seed, size, cfg, corpus, progress, tracking)
    except Exception as exc:  # a peer that cannot run here is skipped, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}
    print(f"[convergence] {cfg.n_embd}d {name} lr={lr:g} seed={seed}: final val loss {out['final']:.4f} "
          f"({out['wall']:.0f} s)", flush=True)
    return out


# the code a run executes: a full run reuses the runs its journal holds while this code is unchanged
JOURNAL_CODE = ("optim", "experiments/harness", "experiments/convergence.py")


def dropin_lr(name, adamw_lr):
    """The drop-in protocol's lr of variant ``name``: AdamW's, times the multiple an "@<multiple>"
    suffix names."""
    _, at, multiple = name.partition("@")
    return float(f"{float(multiple) * adamw_lr:.6g}") if at else adamw_lr


def dropin_names(names):
    """The drop-in protocol's variants: ``names``, each of ``LR_SCALED`` followed by its "@" variant."""
    out = []
    for n in names:
        out += [n] + ([f"{n}@{LR_SCALED[n]:g}"] if n in LR_SCALED else [])
    return out


def run_all(names, size, lrs, seeds, jobs, progress, protocol="best", tracking=None, journal=None):
    """Train one configuration under ``protocol`` ("best", "dropin" or "both"), ``jobs`` runs at a
    time, a run shared by the protocols (the same optimizer, lr and seed) trained once.

    "best": every optimizer's lr sweep on the first seed, then its best lr on the other seeds.
    "dropin": AdamW's sweep, then every variant of ``dropin_names`` at its ``dropin_lr`` on every seed.
    Returns {protocol: ({name: (sweep, lr, {seed: run})}, {name: reason skipped})}; in the drop-in
    result only AdamW has a sweep (the others' are empty). ``journal`` (``harness.journal``): runs it
    holds are not trained again, every run that finishes without an error is added to it.
    """
    protocols = ["best", "dropin"] if protocol == "both" else [protocol]
    out = {p: ({}, {}) for p in protocols}
    with RunPool(jobs) as pool:
        futs = {}

        def run(n, lr, s):
            key = (n.partition("@")[0], lr, s)
            if key not in futs:
                futs[key] = journaled(journal, (char_lm_label(size), *key),
                                      lambda: pool.submit(_job, key[0], lr, s, size, progress, tracking),
                                      keep=lambda out: "error" not in out)
            return futs[key]

        def failed(p, n, err):
            out[p][1][n] = err
            print(f"[convergence] skipping {n}{' (drop-in)' if p == 'dropin' else ''}: {err}", flush=True)

        sweepers = names if "best" in protocols else [n for n in names if n == "AdamW"]
        for n in sweepers:
            for lr in lrs:
                run(n, lr, seeds[0])

        def sweep_of(n):
            runs = {lr: run(n, lr, seeds[0]).result() for lr in lrs}
            err = next((r["error"] for r in runs.values() if "error" in r), None)
            sweep = {lr: r.get("final", math.nan) for lr, r in runs.items()}
            return err, sweep, min(lrs, key=lambda lr: sweep[lr] if math.isfinite(sweep[lr]) else math.inf)

        if "dropin" in protocols:
            err, sweep, adamw_lr = sweep_of("AdamW")
            if err:
                for n in dropin_names(names):
                    failed("dropin", n, f"AdamW, whose lr the drop-in protocol uses, failed: {err}")
            else:
                for n in dropin_names(names):
                    out["dropin"][0][n] = ((sweep if n == "AdamW" else {}), dropin_lr(n, adamw_lr),
                                           {s: run(n, dropin_lr(n, adamw_lr), s) for s in seeds})
        if "best" in protocols:
            for n in names:
                err, sweep, best = sweep_of(n)
                if err:
                    failed("best", n, err)
                    continue
                out["best"][0][n] = (sweep, best, {s: run(n, best, s) for s in seeds})
        for p in protocols:
            done, skipped = out[p]
            for n in list(done):
                sweep, lr, fs = done[n]
                chosen = {s: f.result() for s, f in fs.items()}
                err = next((r["error"] for r in chosen.values() if "error" in r), None)
                if err:
                    done.pop(n)
                    failed(p, n, err)
                else:
                    done[n] = (sweep, lr, chosen)
    return out


def add_rows(res, name, sweep, lr, chosen, first_seed, selected_by="lr_sweep_val_loss"):
    """One variant's rows: its sweep (if any) and ``best_lr``, or without a sweep its ``lr`` against
    ``selected_by``; then the per-seed rows at ``lr``."""
    for grid_lr, final in sweep.items():
        res.add(name, "lr_sweep_val_loss", "nats/char", final, x_name="lr", x_value=grid_lr, seed=first_seed)
    res.add(name, "best_lr" if sweep else "lr", "lr", lr, x_name="selected_by", x_value=selected_by)
    for seed, out in chosen.items():
        for step, val in out["val"]:
            res.add(name, "val_loss", "nats/char", val, x_name="step", x_value=step, seed=seed)
        for step, val in out["train"]:
            res.add(name, "train_loss", "nats/char", val, x_name="step", x_value=step, seed=seed)
        x = dict(x_name="lr", x_value=lr, seed=seed)
        res.add(name, "final_val_loss", "nats/char", out["final"], **x)
        res.add(name, "state_bytes", "bytes", out["state_bytes"], **x)
        res.add(name, "state_bytes_per_param", "B/param", out["state_bytes"] / out["params"], **x)
        res.add(name, "params", "count", out["params"], **x)
        add_kind_rows(res, name, out["state_bytes_by_kind"], out["params"], seed=seed)
        res.add(name, "step_time", "ms", 1e3 * out["step_time"], **x)
        res.add(name, "wall_time", "s", out["wall"], **x)


def add_ratio_rows(res, finals, model_label, prefix=""):
    """Final validation loss / AdamW's, paired by seed: per seed, mean, median, std, min and max; the
    variant is ``prefix`` + the optimizer's name."""
    base = finals.get("AdamW")
    if base is None:
        return {}
    x = dict(x_name="model", x_value=model_label)
    out = {}
    for name, per_seed in finals.items():
        ratios = {s: v / base[s] for s, v in per_seed.items() if s in base}
        for s, r in ratios.items():
            res.add(prefix + name, "val_loss_vs_adamw", "ratio", r, seed=s, **x)
        vals = list(ratios.values())
        mean, std = statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0
        res.add(prefix + name, "val_loss_vs_adamw_mean", "ratio", mean, **x)
        res.add(prefix + name, "val_loss_vs_adamw_median", "ratio", statistics.median(vals), **x)
        res.add(prefix + name, "val_loss_vs_adamw_std", "ratio", std, **x)
        res.add(prefix + name, "val_loss_vs_adamw_min", "ratio", min(vals), **x)
        res.add(prefix + name, "val_loss_vs_adamw_max", "ratio", max(vals), **x)
        out[name] = (mean, std)
    return out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--experiment", default=EXPERIMENT, choices=[EXPERIMENT, "convergence_bf16", *ARCH_EXPERIMENTS],
                        help="results file name: convergence_bf16 for the bf16 run; convergence_encoder and "
                             "convergence_llama for one architecture each (module docstring)")
    parser.add_argument("--tiny", action="store_true", help="test size: a 1-layer model for a few steps")
    parser.add_argument("--optimizers", nargs="+", default=None, metavar="NAME",
                        help=f"subset of {', '.join(OPTIMIZERS)} (default: the fp32-weight ones; UNTUNED for an "
                             "architecture's experiment)")
    parser.add_argument("--lrs", nargs="+", type=float, default=None, help="learning-rate grid (default per size)")
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds at the chosen lr, in every configuration (default per size)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps, in every configuration (default per size)")
    parser.add_argument("--protocol", default=None, choices=PROTOCOLS,
                        help="best: each optimizer at its best lr of the grid (convergence_bf16's default); dropin: "
                             "every optimizer at AdamW's best lr (and LR_SCALED's multiples of it); both (the "
                             "default otherwise)")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    parser.add_argument("--size", default=None, choices=list(CHAR_LM),
                        help="the main configuration's CHAR_LM size (default: tiny/quick/full by the flags)")
    parser.add_argument("--extra", "--large", nargs="+", default=None, choices=[*CHAR_LM, "none"],
                        help=f"extra configurations, CHAR_LM sizes (default: {' '.join(FULL_EXTRA)} for the "
                             "full run, none otherwise)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="single-threaded runs at a time, each in its own process (default: 2 for the "
                             "full run, 1 otherwise)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: a model this small gives a second thread "
                             "little work to share)")
    args = check.parse(parser, argv)
    args.quick = args.quick or args.tiny  # a test size never writes the committed results
    own = ARCH_EXPERIMENTS.get(args.experiment)
    if own:  # --quick / --tiny: the quick / tiny dimensions and steps in this architecture (main)
        args.size = args.size or (None if args.quick else own["size"])
        args.extra = args.extra or ["none"]
        if not args.quick:
            args.steps = args.steps or own.get("steps")
            args.seeds = args.seeds or own.get("seeds")
            args.lrs = args.lrs or own.get("lrs")
    # the full run's default: the fp32-weight optimizers (bf16 weights are their own experiment), both
    # protocols; convergence_bf16 (given its optimizers) each at its best lr
    args.optimizers = args.optimizers or (own["optimizers"] if own else DENSE)
    args.protocol = args.protocol or (own["protocol"] if own else "both" if args.experiment == EXPERIMENT else "best")
    unknown = [n for n in args.optimizers if n not in OPTIMIZERS]
    if unknown:
        parser.error(f"--optimizers: unknown {unknown}; choose from {OPTIMIZERS}")
    if args.protocol != "best" and "AdamW" not in args.optimizers:
        parser.error(f"--protocol {args.protocol}: the drop-in protocol trains at AdamW's lr; add AdamW to --optimizers")
    return args


def CHECK(args):
    """--experiment: its main model only, the claim's Gefen layouts beside AdamW at one lr (the committed
    run's best), 2 seeds."""
    fixed = {"--extra": "none", "--seeds": 2, "--protocol": "best", "--jobs": 2}
    if args.experiment == "convergence_bf16":
        return {**fixed, "--size": "large", "--lrs": 1e-3, "--steps": 300,
                "--optimizers": ["AdamW", "Gefen-8bit-factored+bf16-sr", "Gefen-8bit+bf16-sr"]}
    if args.experiment in ARCH_EXPERIMENTS:
        return {**fixed, "--lrs": 4e-3 if "long" in args.experiment or "encoder" in args.experiment else 2e-3,
                "--steps": 500, "--optimizers": ["AdamW", "Gefen-8bit-factored", "Gefen-4bit-factored"]}
    return {**fixed, "--lrs": 3e-3, "--optimizers": ["AdamW", "Gefen-8bit", "Gefen-4bit", "Gefen-8bit-factored",
                                                     "Gefen-4bit-factored"]}


CHECK_NOTE = ("the main model alone at one lr, 2 seeds, AdamW and the claim's Gefen layouts: the loss ratios of "
              "one model; the claims' rows compare three models, both protocols and the runs on many seeds, so "
              "they are computed only where the check CSV has what they read")


def run_config(res, names, size, lrs, seeds, jobs, progress, prefix="", protocol="best", journal=None):
    """Train and write one configuration's rows under ``protocol``; returns (summary, skipped, ratios),
    keyed by variant (drop-in variants ``<prefix>dropin/<name>``)."""
    summary, skipped, ratios = [], {}, {}
    label = char_lm_label(size)
    for p, (done, skipped_p) in run_all(names, size, lrs, seeds, jobs, progress, protocol, res.tracking,
                                        journal).items():
        pre = prefix + (DROPIN if p == "dropin" else "")
        finals = {}
        for name in (dropin_names(names) if p == "dropin" else names):
            if name not in done:
                continue
            sweep, lr, chosen = done[name]
            if p == "dropin" and name != "AdamW":
                add_rows(res, pre + name, {}, lr, chosen, seeds[0],
                         selected_by=f"{name.partition('@')[2] or '1'} x AdamW's best lr")
            else:
                add_rows(res, pre + name, sweep, lr, chosen, seeds[0])
            finals[name] = {s: out["final"] for s, out in chosen.items()}
            bpp = statistics.fmean(o["state_bytes"] / o["params"] for o in chosen.values())
            summary.append((pre + name, lr, list(finals[name].values()), bpp,
                            statistics.fmean(o["step_time"] for o in chosen.values())))
        r = add_ratio_rows(res, finals, label, DROPIN if p == "dropin" else "")
        ratios.update({pre + k: v for k, v in r.items()})
        skipped.update({pre + k: v for k, v in skipped_p.items()})
    res.flush()
    return summary, skipped, ratios


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    size_name = "tiny" if args.tiny else "quick" if args.quick else "full"
    size = dict(CHAR_LM[args.size or size_name])
    if args.experiment in ARCH_EXPERIMENTS and args.size is None:
        size["arch"] = CHAR_LM[ARCH_EXPERIMENTS[args.experiment]["size"]]["arch"]
    if args.steps is not None:
        size["steps"] = args.steps
    lrs = args.lrs or size["lrs"]
    seeds = [args.seed + i for i in range(args.seeds or size["seeds"])]
    cfg, corpus, n_params = char_lm_problem(size)
    model_label = char_lm_label(size)
    extra_names = [n for n in args.extra or (FULL_EXTRA if size_name == "full" else []) if n != "none"]
    jobs = args.jobs or (2 if size_name == "full" else 1)
    config = dict(vars(args), size=size_name, **dict(size, lrs=lrs, seeds=seeds), model=vars(cfg),
                  model_label=model_label, weight_decay=WEIGHT_DECAY, schedule="5% linear warm-up, cosine to 10%",
                  lr_selection="best final val loss of the first seed; best lr rerun on the other seeds",
                  protocol=args.protocol, dropin="AdamW's best lr for every optimizer, on every seed; "
                  + ", ".join(f"{n} also at {f:g}x" for n, f in LR_SCALED.items()),
                  train_tokens=corpus[0].numel(), val_windows=len(corpus[1][0]), python=sys.version.split()[0],
                  stdlib_files=len(data.stdlib_sources()), threads=torch.get_num_threads(), jobs=jobs)
    extras = []
    for name in extra_names:
        extra = dict(CHAR_LM[name])
        if args.steps is not None:
            extra["steps"] = args.steps
        ecfg, _, _ = char_lm_problem(extra)
        label = char_lm_label(extra)
        extras.append((extra, dict(extra, size=name, model=vars(ecfg), model_label=label,
                                   seeds=[args.seed + i for i in range(args.seeds or extra["seeds"])],
                                   optimizers=[n for n in EXTRA_OPTIMIZERS.get(name, LARGE) if n in args.optimizers])))
    config["extra"] = {ec["model_label"]: ec for _, ec in extras}
    print(f"[convergence] {model_label} size={size_name} model={vars(cfg)} steps={size['steps']} "
          f"batch={size['batch']} lrs={lrs} seeds={seeds} jobs={jobs}", flush=True)
    progress = not args.no_progress and jobs == 1
    with Results(args.experiment, args, config=config, wandb_rows=False) as res:
        journal = (Journal.open(res.results_dir / "partial" / f"{args.experiment}.jsonl",
                                dict(config, versions=res.versions, cpu=host_cpu()), JOURNAL_CODE)
                   if not args.check else None)
        if journal is not None and len(journal):
            print(f"[convergence] {len(journal)} runs finished earlier ({journal.path})", flush=True)
        summary, skipped, ratios = run_config(res, args.optimizers, size, lrs, seeds, jobs, progress,
                                              protocol=args.protocol, journal=journal)
        for extra, ec in extras:
            print(f"[convergence] extra configuration {ec['model_label']} model={ec['model']} "
                  f"steps={extra['steps']} batch={extra['batch']} lrs={extra['lrs']}", flush=True)
            s2, k2, r2 = run_config(res, ec["optimizers"], extra, extra["lrs"], ec["seeds"], jobs, progress,
                                    prefix=ec["model_label"] + "/", protocol=args.protocol, journal=journal)
            summary += s2
            skipped.update(k2)
            ratios.update(r2)
        res.config.update(optimizers_run=[s[0] for s in summary], optimizers_skipped=skipped)
    if journal is not None:
        journal.remove()
    print(f"\n{'optimizer':<44} {'lr':>8} {'final val loss':>18} {'vs AdamW':>16} {'B/param':>8} {'step ms':>8}")
    for name, best, fin, bpp, st in summary:
        sd = statistics.stdev(fin) if len(fin) > 1 else 0.0
        rm, rs = ratios.get(name, (math.nan, math.nan))
        print(f"{name:<44} {best:>8g} {statistics.fmean(fin):>10.4f} ± {sd:.4f} {rm:>8.4f} ± {rs:.4f} "
              f"{bpp:>8.3f} {1e3 * st:>8.2f}")
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    return summary, skipped


if __name__ == "__main__":
    main()
