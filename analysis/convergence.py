"""Figure: validation loss of the character GPT per optimizer, against steps and against state bytes.

Reads only results/convergence.csv (written by experiments/convergence.py) and draws
paper_figs/convergence.png:

- left: validation loss against training steps, each optimizer at its chosen learning rate,
  mean over seeds with a band from the lowest to the highest seed;
- right: final validation loss (mean, error bar = standard deviation over seeds) against
  optimizer-state bytes per parameter (log scale).

    python analysis/convergence.py
    python analysis/convergence.py --results-dir results/quick --out paper_figs/quick/convergence.png
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.common import add_analysis_args, latest_run, read_results, save_figure  # noqa: E402

# fixed order and colours so every figure of this experiment reads the same
ORDER = ["AdamW", "Adam-mini", "torchao-AdamW8bit", "torchao-AdamW4bit", "gefen-upstream",
         "Gefen-8bit", "Gefen-4bit"]


def split_variant(variant: str):
    """"<optimizer>/lr=<lr>" -> (optimizer, lr); a bare optimizer name -> (name, None)."""
    if "/lr=" in variant:
        name, lr = variant.rsplit("/lr=", 1)
        return name, float(lr)
    return variant, None


def summarise(rows):
    """Per optimizer at its chosen lr: curves per seed, final losses per seed, bytes/param.

    The chosen lr is the experiment's ``best_lr`` row; without one, the lr whose mean final loss
    is lowest among those with the most seeds.
    """
    rows = latest_run(rows)
    best_lr = {}
    per = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))  # name -> lr -> metric -> seed -> ...
    for r in rows:
        name, lr = split_variant(r["variant"])
        if lr is None:
            if r["metric"] == "best_lr":
                best_lr[name] = r["value"]
            continue
        m = per[name][lr][r["metric"]]
        if r["x_name"] == "step":
            m.setdefault(r["seed"], []).append((r["x_value"], r["value"]))
        else:
            m[r["seed"]] = r["value"]
    out = {}
    for name, by_lr in per.items():
        lr = best_lr.get(name)
        if lr is None or lr not in by_lr:
            def key(item):
                finals = [v for v in item[1]["final_val_loss"].values() if math.isfinite(v)]
                return (-len(item[1]["final_val_loss"]), statistics.fmean(finals) if finals else math.inf)
            lr = min(by_lr.items(), key=key)[0]
        d = by_lr[lr]
        finals = list(d["final_val_loss"].values())
        out[name] = dict(
            lr=lr,
            curves={s: sorted(c) for s, c in d["val_loss"].items()},
            finals=finals,
            final_by_seed=dict(d["final_val_loss"]),
            bpp=statistics.fmean(d["state_bytes_per_param"].values()) if d["state_bytes_per_param"] else math.nan,
            step_ms=statistics.median(d["step_time"].values()) if d["step_time"] else math.nan,
            grid={l: statistics.fmean(v["final_val_loss"].values()) for l, v in by_lr.items()
                  if v["final_val_loss"]},
        )
    return dict(sorted(out.items(), key=lambda kv: ORDER.index(kv[0]) if kv[0] in ORDER else len(ORDER)))


def paired_gap(summary, name, baseline):
    """Mean over shared seeds of final loss / baseline's final loss - 1 (same init and batches per seed)."""
    if name not in summary or baseline not in summary:
        return math.nan
    a, b = summary[name]["final_by_seed"], summary[baseline]["final_by_seed"]
    gaps = [a[s] / b[s] - 1 for s in a if s in b and math.isfinite(a[s]) and math.isfinite(b[s])]
    return statistics.fmean(gaps) if gaps else math.nan


def draw(summary, out: Path, title: str = ""):
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    colours = plt.get_cmap("tab10")
    for i, (name, s) in enumerate(summary.items()):
        c = colours(ORDER.index(name) if name in ORDER else i)
        by_step = defaultdict(list)
        for curve in s["curves"].values():
            for x, v in curve:
                by_step[x].append(v)
        steps = sorted(by_step)
        mean = [statistics.fmean(by_step[x]) for x in steps]
        lo = [min(by_step[x]) for x in steps]
        hi = [max(by_step[x]) for x in steps]
        n = len(s["curves"])
        ax1.plot(steps, mean, color=c, label=f"{name} (lr {s['lr']:g}, {n} seed{'s' if n > 1 else ''})")
        if n > 1:
            ax1.fill_between(steps, lo, hi, color=c, alpha=0.2, linewidth=0)
        finals = [v for v in s["finals"] if math.isfinite(v)]
        if finals and math.isfinite(s["bpp"]):
            sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
            ax2.errorbar([s["bpp"]], [statistics.fmean(finals)], yerr=[sd], fmt="o", color=c, capsize=4,
                         label=name)
            # alternate label sides: optimizers with the same state size would overprint
            ax2.annotate(name, (s["bpp"], statistics.fmean(finals)), textcoords="offset points",
                         xytext=(6, 4) if i % 2 == 0 else (-6, -10), ha="left" if i % 2 == 0 else "right",
                         fontsize=7, color=c)
    ax1.set_xlabel("training step")
    ax1.set_ylabel("validation loss (nats/char)")
    ax1.set_title("validation loss, each optimizer at its best lr")
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    # the untrained model's loss squashes the interesting part: start the y axis at 10% of training
    finals_all = [v for s in summary.values() for v in s["finals"] if math.isfinite(v)]
    early = []
    for s in summary.values():
        for curve in s["curves"].values():
            last = max(x for x, _ in curve)
            later = [v for x, v in curve if x >= 0.1 * last and math.isfinite(v)]
            early += later[:1]
    if finals_all and early:
        ax1.set_ylim(min(finals_all) - 0.05, max(early) + 0.05)
    ax2.set_xscale("log")
    ticks = [t for t in (0.25, 0.5, 1, 2, 4, 8, 16)
             if any(t / 2 < sv["bpp"] < t * 2 for sv in summary.values() if math.isfinite(sv["bpp"]))]
    ax2.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax2.xaxis.set_minor_formatter(plt.NullFormatter())
    ax2.set_xlabel("optimizer state (bytes / parameter, tensor bytes of state_dict)")
    ax2.set_ylabel("final validation loss (nats/char)")
    ax2.set_title("final loss vs optimizer memory (mean ± std over seeds)")
    ax2.grid(alpha=0.3, which="both")
    return save_figure(fig, out, title)


def setup_line(rows) -> str:
    r = rows[0] if rows else {}
    return f"char GPT on pydoc topics + stdlib sources; {r.get('device', '?')}, torch {r.get('torch_version', '?')}, " \
           f"commit {r.get('git_commit', '?')}"


def main(argv=None):
    parser = add_analysis_args(argparse.ArgumentParser(description=__doc__), "convergence")
    args = parser.parse_args(argv)
    rows = read_results("convergence", args.results_dir)
    summary = summarise(rows)
    if not summary:
        raise SystemExit(f"{args.results_dir}/convergence.csv has no per-run rows to draw")
    draw(summary, args.out, setup_line(rows))
    print(f"{'optimizer':<20} {'best lr':>8} {'final val loss':>18} {'vs AdamW':>9} {'B/param':>8} "
          f"{'step ms':>8}  mean final loss per lr of the grid")
    for name, s in summary.items():
        finals = [v for v in s["finals"] if math.isfinite(v)]
        mean = statistics.fmean(finals) if finals else math.nan
        sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
        grid = ", ".join(f"{lr:g}: {v:.3f}" for lr, v in sorted(s["grid"].items()))
        rel = paired_gap(summary, name, "AdamW")
        print(f"{name:<20} {s['lr']:>8g} {mean:>10.4f} ± {sd:.4f} {rel:>+8.2%} {s['bpp']:>8.3f} "
              f"{s['step_ms']:>8.2f}  {grid}")
    print(f"wrote {args.out}")
    return summary


if __name__ == "__main__":
    main()
