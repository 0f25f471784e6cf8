"""Convergence: a character-level GPT trained by every memory-light optimizer and its peers.

    python experiments/convergence.py              # full run -> results/convergence.csv
    python experiments/convergence.py --quick      # smaller model, fewer steps -> results/quick/
    python analysis/convergence.py                 # paper_figs/convergence.png
    python experiments/convergence.py --optimizers AdamW Gefen-8bit --lrs 1e-3 3e-3 --seeds 1
    python experiments/convergence.py --extra none   # the full run without the extra configurations

Does Gefen reach AdamW's validation loss with about one byte of optimizer state per parameter?
This is the one experiment that answers it: one Gefen-vs-AdamW number per model. A nanoGPT-style
character model (experiments/models.py) learns Python's documentation topics plus standard-library
sources (experiments/data.py; 90/10 train/validation split by chunks). Optimizers (registry names):
AdamW, Adam-mini, torchao-AdamW8bit, torchao-AdamW4bit, gefen-upstream, Gefen-8bit, Gefen-4bit,
Gefen-8bit-factored, Gefen-4bit-factored (``factor_second_moment=True``); and on bf16 weights (the
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
and deterministic).

Protocol (experiments/train.py): the same initialisation and batches per seed for every optimizer,
linear warm-up over 5% of the steps then cosine decay to 10%, gradient clipping at 1.0, decoupled
weight decay 0.1 on every tensor (Adam-mini exempts norms and biases by its own name rule). Each
optimizer's peak learning rate is the best of a grid by the final validation loss of the first
seed; that rate is rerun with the other seeds. An optimizer that fails to construct or to step is
skipped with its reason printed, and writes no rows.

Rows (variant = the optimizer's registry name):
- per grid point, first seed: ``lr_sweep_val_loss`` against ``lr``; per optimizer ``best_lr``;
- per seed at the best lr: ``val_loss`` and ``train_loss`` (nats/char) against ``step``;
  ``final_val_loss``, ``state_bytes``, ``state_bytes_per_param``, ``params``, ``step_time`` (median
  ``optimizer.step()``, ms) and ``wall_time`` against ``lr``;
- ``val_loss_vs_adamw`` per seed (final validation loss / AdamW's of the same seed) and its
  ``_mean``, ``_median`` and ``_std`` over seeds, against ``model`` (variant = the optimizer's
  name for both configurations).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

import torch

from experiments import data
from experiments.common import Results, add_common_args
from experiments.models import GPT
from experiments.pool import RunPool
from experiments.registry import DENSE, make_optimizer, state_bytes
from experiments.train import CHAR_LM, WEIGHT_DECAY, char_lm_label, char_lm_problem, train_lm

EXPERIMENT = "convergence"
# bf16 weights: "<registry name>+bf16" (rounding to nearest) or "+bf16-sr" (Gefen's stochastic rounding)
BF16 = ["AdamW+bf16", "Gefen-8bit+bf16-sr", "Gefen-8bit-factored+bf16-sr"]
OPTIMIZERS = DENSE + BF16
LARGE = ["AdamW", "Adam-mini", "torchao-AdamW8bit", "gefen-upstream", "Gefen-8bit", "Gefen-4bit",
         "Gefen-8bit-factored", "Gefen-4bit-factored"] + BF16
# the optimizers of each extra configuration (LARGE for a size not named here): on the second
# corpus the question is Gefen's against AdamW's and Adam-mini's, so the slow CPU peers stay out
EXTRA_OPTIMIZERS = {"docstrings": ["AdamW", "Adam-mini", "Gefen-8bit", "Gefen-4bit", "Gefen-8bit-factored",
                                   "Gefen-4bit-factored"]}
FULL_EXTRA = ["large", "docstrings"]


def build(name, model, lr, cfg):
    """The optimizer of variant ``name`` over ``model`` (a "+bf16" variant's model must be bf16)."""
    base, _, mode = name.partition("+")
    options = {"dim": cfg.n_embd, "n_heads": cfg.n_head} if base == "Adam-mini" else {}
    if mode == "bf16-sr":
        options["stochastic_rounding"] = True
    return make_optimizer(base, model, lr, WEIGHT_DECAY, **options)


def make_model(name, cfg):
    """The GPT of ``cfg``, bf16 for a "+bf16" variant (initialised in fp32, as every other)."""
    model = GPT(cfg)
    return model.to(torch.bfloat16) if "+bf16" in name else model


def train_one(name, lr, seed, size, cfg, corpus, progress):
    torch.manual_seed(seed)
    model = make_model(name, cfg)
    opt = build(name, model, lr, cfg)
    out = train_lm(model, opt, corpus[0], corpus[1], lr=lr, steps=size["steps"], batch=size["batch"], seed=seed,
                   eval_every=size["eval_every"], progress=progress, desc=f"{name} lr={lr:g} seed={seed}")
    out["params"] = sum(p.numel() for p in model.parameters())
    out["state_bytes"] = state_bytes(opt)
    return out


def _job(name, lr, seed, size, progress):
    """One training run; the problem is built once per process."""
    cfg, corpus, _ = char_lm_problem(size)
    try:
        build(name, make_model(name, cfg), 1e-3, cfg)
        out = train_one(name, lr, seed, size, cfg, corpus, progress)
    except Exception as exc:  # a peer that cannot run here is skipped, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}
    print(f"[convergence] {cfg.n_embd}d {name} lr={lr:g} seed={seed}: final val loss {out['final']:.4f} "
          f"({out['wall']:.0f} s)", flush=True)
    return out


def run_all(names, size, lrs, seeds, jobs, progress):
    """Every optimizer's lr sweep on the first seed, then its best lr on the other seeds, ``jobs``
    runs at a time: ({name: (sweep, best, {seed: run})}, {name: reason skipped})."""
    with RunPool(jobs) as pool:
        first = {(n, lr): pool.submit(_job, n, lr, seeds[0], size, progress) for n in names for lr in lrs}
        done, skipped, later = {}, {}, {}
        for n in names:
            runs = {lr: first[(n, lr)].result() for lr in lrs}
            err = next((r["error"] for r in runs.values() if "error" in r), None)
            if err:
                skipped[n] = err
                print(f"[convergence] skipping {n}: {err}", flush=True)
                continue
            sweep = {lr: r["final"] for lr, r in runs.items()}
            best = min(lrs, key=lambda lr: sweep[lr] if math.isfinite(sweep[lr]) else math.inf)
            done[n] = (sweep, best, {seeds[0]: runs[best]})
            later[n] = {s: pool.submit(_job, n, best, s, size, progress) for s in seeds[1:]}
        for n, fs in later.items():
            for s, f in fs.items():
                r = f.result()
                if "error" in r:
                    skipped[n] = r["error"]
                    done.pop(n, None)
                    break
                done[n][2][s] = r
    return done, skipped


def add_rows(res, name, sweep, best, chosen, first_seed):
    for lr, final in sweep.items():
        res.add(name, "lr_sweep_val_loss", "nats/char", final, x_name="lr", x_value=lr, seed=first_seed)
    res.add(name, "best_lr", "lr", best, x_name="selected_by", x_value="lr_sweep_val_loss")
    for seed, out in chosen.items():
        for step, val in out["val"]:
            res.add(name, "val_loss", "nats/char", val, x_name="step", x_value=step, seed=seed)
        for step, val in out["train"]:
            res.add(name, "train_loss", "nats/char", val, x_name="step", x_value=step, seed=seed)
        x = dict(x_name="lr", x_value=best, seed=seed)
        res.add(name, "final_val_loss", "nats/char", out["final"], **x)
        res.add(name, "state_bytes", "bytes", out["state_bytes"], **x)
        res.add(name, "state_bytes_per_param", "B/param", out["state_bytes"] / out["params"], **x)
        res.add(name, "params", "count", out["params"], **x)
        res.add(name, "step_time", "ms", 1e3 * out["step_time"], **x)
        res.add(name, "wall_time", "s", out["wall"], **x)


def add_ratio_rows(res, finals, model_label):
    """Final validation loss / AdamW's, paired by seed: per seed, mean, median and std."""
    base = finals.get("AdamW")
    if base is None:
        return {}
    x = dict(x_name="model", x_value=model_label)
    out = {}
    for name, per_seed in finals.items():
        ratios = {s: v / base[s] for s, v in per_seed.items() if s in base}
        for s, r in ratios.items():
            res.add(name, "val_loss_vs_adamw", "ratio", r, seed=s, **x)
        vals = list(ratios.values())
        mean, std = statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0
        res.add(name, "val_loss_vs_adamw_mean", "ratio", mean, **x)
        res.add(name, "val_loss_vs_adamw_median", "ratio", statistics.median(vals), **x)
        res.add(name, "val_loss_vs_adamw_std", "ratio", std, **x)
        out[name] = (mean, std)
    return out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--tiny", action="store_true", help="test size: a 1-layer model for a few steps")
    parser.add_argument("--optimizers", nargs="+", default=OPTIMIZERS, metavar="NAME",
                        help=f"subset of {', '.join(OPTIMIZERS)} (default: all)")
    parser.add_argument("--lrs", nargs="+", type=float, default=None, help="learning-rate grid (default per size)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds at the best lr (default per size)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default per size)")
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
    args = parser.parse_args(argv)
    unknown = [n for n in args.optimizers if n not in OPTIMIZERS]
    if unknown:
        parser.error(f"--optimizers: unknown {unknown}; choose from {OPTIMIZERS}")
    return args


def run_config(res, names, size, lrs, seeds, jobs, progress, prefix=""):
    """Train and write one configuration's rows; returns (summary, skipped, ratios)."""
    summary, finals = [], {}
    done, skipped = run_all(names, size, lrs, seeds, jobs, progress)
    for name in names:
        if name not in done:
            continue
        sweep, best, chosen = done[name]
        add_rows(res, prefix + name, sweep, best, chosen, seeds[0])
        finals[name] = {s: out["final"] for s, out in chosen.items()}
        bpp = statistics.fmean(o["state_bytes"] / o["params"] for o in chosen.values())
        summary.append((prefix + name, best, list(finals[name].values()), bpp,
                        statistics.fmean(o["step_time"] for o in chosen.values())))
    ratios = add_ratio_rows(res, finals, char_lm_label(size))
    res.flush()
    return summary, skipped, {prefix + k: v for k, v in ratios.items()}


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    size_name = "tiny" if args.tiny else "quick" if args.quick else "full"
    size = dict(CHAR_LM[args.size or size_name])
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
                  train_tokens=corpus[0].numel(), val_windows=len(corpus[1][0]), python=sys.version.split()[0],
                  stdlib_files=len(data.stdlib_sources()), threads=torch.get_num_threads(), jobs=jobs)
    extras = []
    for name in extra_names:
        extra = dict(CHAR_LM[name])
        ecfg, _, _ = char_lm_problem(extra)
        label = char_lm_label(extra)
        extras.append((extra, dict(extra, size=name, model=vars(ecfg), model_label=label,
                                   seeds=[args.seed + i for i in range(extra["seeds"])],
                                   optimizers=[n for n in EXTRA_OPTIMIZERS.get(name, LARGE) if n in args.optimizers])))
    config["extra"] = {ec["model_label"]: ec for _, ec in extras}
    print(f"[convergence] {model_label} size={size_name} model={vars(cfg)} steps={size['steps']} "
          f"batch={size['batch']} lrs={lrs} seeds={seeds} jobs={jobs}", flush=True)
    progress = not args.no_progress and jobs == 1
    with Results(EXPERIMENT, args, config=config) as res:
        summary, skipped, ratios = run_config(res, args.optimizers, size, lrs, seeds, jobs, progress)
        for extra, ec in extras:
            print(f"[convergence] extra configuration {ec['model_label']} model={ec['model']} "
                  f"steps={extra['steps']} batch={extra['batch']} lrs={extra['lrs']}", flush=True)
            s2, k2, r2 = run_config(res, ec["optimizers"], extra, extra["lrs"], ec["seeds"], jobs, progress,
                                    prefix=ec["model_label"] + "/")
            summary += s2
            skipped.update({ec["model_label"] + "/" + k: v for k, v in k2.items()})
            ratios.update(r2)
        res.config.update(optimizers_run=[s[0] for s in summary], optimizers_skipped=skipped)
    print(f"\n{'optimizer':<36} {'best lr':>8} {'final val loss':>18} {'vs AdamW':>16} {'B/param':>8} {'step ms':>8}")
    for name, best, fin, bpp, st in summary:
        sd = statistics.stdev(fin) if len(fin) > 1 else 0.0
        rm, rs = ratios.get(name, (math.nan, math.nan))
        print(f"{name:<36} {best:>8g} {statistics.fmean(fin):>10.4f} ± {sd:.4f} {rm:>8.4f} ± {rs:.4f} "
              f"{bpp:>8.3f} {1e3 * st:>8.2f}")
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    return summary, skipped


if __name__ == "__main__":
    main()
