"""Convergence: a character-level GPT trained by every memory-light optimizer and its peers.

    python experiments/convergence.py              # full run -> results/convergence.csv
    python experiments/convergence.py --quick      # smaller model, fewer steps -> results/quick/
    python analysis/convergence.py                 # paper_figs/convergence.png
    python experiments/convergence.py --optimizers AdamW Gefen-8bit --lrs 1e-3 3e-3 --seeds 1

Does Gefen reach AdamW's validation loss with about one byte of optimizer state per parameter?
This is the one experiment that answers it: one Gefen-vs-AdamW number per model. A nanoGPT-style
character model (experiments/models.py) learns Python's documentation topics plus standard-library
sources (experiments/data.py; 90/10 train/validation split by chunks). Optimizers (registry names):
AdamW, Adam-mini, torchao-AdamW8bit, torchao-AdamW4bit, gefen-upstream, Gefen-8bit, Gefen-4bit.

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
  ``_mean`` and ``_std`` over seeds, against ``model``.
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
from experiments.registry import DENSE, make_optimizer, state_bytes
from experiments.train import CHAR_LM, WEIGHT_DECAY, char_lm_problem, train_lm

EXPERIMENT = "convergence"


def build(name, model, lr, cfg):
    return make_optimizer(name, model, lr, WEIGHT_DECAY, **({"dim": cfg.n_embd, "n_heads": cfg.n_head}
                                                             if name == "Adam-mini" else {}))


def train_one(name, lr, seed, size, cfg, corpus, progress):
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = build(name, model, lr, cfg)
    out = train_lm(model, opt, corpus[0], corpus[1], lr=lr, steps=size["steps"], batch=size["batch"], seed=seed,
                   eval_every=size["eval_every"], progress=progress, desc=f"{name} lr={lr:g} seed={seed}")
    out["params"] = sum(p.numel() for p in model.parameters())
    out["state_bytes"] = state_bytes(opt)
    return out


def run_optimizer(name, size, lrs, seeds, cfg, corpus, progress):
    """LR sweep on the first seed, then the best LR on the other seeds: (sweep, best, {seed: run})."""
    sweep, runs = {}, {}
    for lr in lrs:
        runs[lr] = train_one(name, lr, seeds[0], size, cfg, corpus, progress)
        sweep[lr] = runs[lr]["final"]
    best = min(lrs, key=lambda lr: sweep[lr] if math.isfinite(sweep[lr]) else math.inf)
    chosen = {seeds[0]: runs[best]}
    for s in seeds[1:]:
        chosen[s] = train_one(name, best, s, size, cfg, corpus, progress)
    return sweep, best, chosen


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
    """Final validation loss / AdamW's, paired by seed: per seed, mean and std."""
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
        res.add(name, "val_loss_vs_adamw_std", "ratio", std, **x)
        out[name] = (mean, std)
    return out


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--tiny", action="store_true", help="test size: a 1-layer model for a few steps")
    parser.add_argument("--optimizers", nargs="+", default=DENSE, metavar="NAME",
                        help=f"subset of {', '.join(DENSE)} (default: all)")
    parser.add_argument("--lrs", nargs="+", type=float, default=None, help="learning-rate grid (default per size)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds at the best lr (default per size)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default per size)")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: a model this small gives a second thread "
                             "little work to share)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.optimizers if n not in DENSE]
    if unknown:
        parser.error(f"--optimizers: unknown {unknown}; choose from {DENSE}")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    size_name = "tiny" if args.tiny else "quick" if args.quick else "full"
    size = dict(CHAR_LM[size_name])
    if args.steps is not None:
        size["steps"] = args.steps
    lrs = args.lrs or size["lrs"]
    seeds = [args.seed + i for i in range(args.seeds or size["seeds"])]
    cfg, corpus, n_params = char_lm_problem(size)
    model_label = f"char-gpt-{n_params // 1000}k"

    config = dict(vars(args), size=size_name, **dict(size, lrs=lrs, seeds=seeds), model=vars(cfg),
                  model_label=model_label, weight_decay=WEIGHT_DECAY, schedule="5% linear warm-up, cosine to 10%",
                  lr_selection="best final val loss of the first seed; best lr rerun on the other seeds",
                  train_tokens=corpus[0].numel(), val_windows=len(corpus[1][0]), python=sys.version.split()[0],
                  stdlib_files=len(data.stdlib_sources()), threads=torch.get_num_threads())
    print(f"[convergence] {model_label} size={size_name} model={vars(cfg)} steps={size['steps']} "
          f"batch={size['batch']} lrs={lrs} seeds={seeds}", flush=True)
    summary, skipped, finals = [], {}, {}
    with Results(EXPERIMENT, args, config=config) as res:
        for name in args.optimizers:
            try:
                build(name, GPT(cfg), 1e-3, cfg)
                sweep, best, chosen = run_optimizer(name, size, lrs, seeds, cfg, corpus, not args.no_progress)
            except Exception as exc:  # a peer that cannot run here is skipped, not fatal
                skipped[name] = f"{type(exc).__name__}: {exc}"
                print(f"[convergence] skipping {name}: {skipped[name]}", flush=True)
                continue
            add_rows(res, name, sweep, best, chosen, seeds[0])
            res.flush()  # keep what is measured if a later optimizer takes the process down
            finals[name] = {s: out["final"] for s, out in chosen.items()}
            bpp = statistics.fmean(o["state_bytes"] / o["params"] for o in chosen.values())
            summary.append((name, best, list(finals[name].values()), bpp,
                            statistics.fmean(o["step_time"] for o in chosen.values())))
        ratios = add_ratio_rows(res, finals, model_label)
        res.config.update(optimizers_run=[s[0] for s in summary], optimizers_skipped=skipped)
    print(f"\n{'optimizer':<20} {'best lr':>8} {'final val loss':>18} {'vs AdamW':>16} {'B/param':>8} {'step ms':>8}")
    for name, best, fin, bpp, st in summary:
        sd = statistics.stdev(fin) if len(fin) > 1 else 0.0
        rm, rs = ratios.get(name, (math.nan, math.nan))
        print(f"{name:<20} {best:>8g} {statistics.fmean(fin):>10.4f} ± {sd:.4f} {rm:>8.4f} ± {rs:.4f} "
              f"{bpp:>8.3f} {1e3 * st:>8.2f}")
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    return summary, skipped


if __name__ == "__main__":
    main()
