"""Figure: does Hessian coupling predict stable squared-gradient ratios, and do Gefen's blocks group
coupled parameters?

Reads only results/hessian_alignment.csv (written by experiments/hessian_alignment.py) and draws
paper_figs/hessian_alignment.png, one row of panels per model:

- (a) median spread of log(g_i**2/g_j**2) over minibatches per coupling decile (x: the decile's
  median coupling |H_ij|/sqrt(|H_ii H_jj|), log scale), one line per checkpoint; dotted: median
  level |log(E g_i**2 / E g_j**2)|; dashed: pi, the spread of two independent zero-mean Gaussian
  gradients; the title carries the Spearman correlations;
- (b) within-block coupling per block scheme, at initialisation and at the last checkpoint;
- (c) within-block dispersion of the second moment (RMS log(v_i / block mean v)) per scheme;
- (d) final validation loss per scheme minus AdamW's, mean over seeds with a min-max bar.

    python analysis/hessian_alignment.py
    python analysis/hessian_alignment.py --results-dir results/quick --out paper_figs/quick/hessian_alignment.png
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.common import add_analysis_args, latest_run, read_results  # noqa: E402

SCHEMES = ["gefen", "random_gefen", "gefen_var", "random_gefen_var", "adam_mini", "per_tensor"]
LABELS = {"gefen": "Gefen", "random_gefen": "random\n(Gefen sizes)", "gefen_var": "Gefen\nvariance rule",
          "random_gefen_var": "random\n(var. sizes)", "adam_mini": "Adam-mini", "per_tensor": "per tensor",
          "adamw": "AdamW"}
COLORS = {"gefen": "C0", "random_gefen": "C7", "gefen_var": "C1", "random_gefen_var": "0.75",
          "adam_mini": "C2", "per_tensor": "C3", "adamw": "k"}


def collect(rows):
    """{model: {...}} with decile curves, Spearman values, block statistics and losses."""
    out = defaultdict(lambda: {"curves": defaultdict(dict), "rho": {}, "blocks": defaultdict(dict),
                               "loss": defaultdict(list)})
    for r in latest_run(rows):
        parts = r["variant"].split("/")
        kind = parts[0]
        m = out[kind]
        if len(parts) == 2 and parts[1].startswith("step") and r["x_name"] == "coupling_decile":
            m["curves"][int(parts[1][4:])].setdefault(r["metric"], {})[r["x_value"]] = r["value"]
        elif len(parts) == 1 and r["metric"] in ("spearman_spread", "spearman_level"):
            m["rho"][(r["metric"], r["x_value"])] = r["value"]
        elif len(parts) == 2 and r["x_name"] == "step" and r["metric"] in ("coupling_within", "dispersion"):
            m["blocks"][(parts[1], r["metric"])][r["x_value"]] = r["value"]
        elif len(parts) == 2 and r["metric"] == "val_loss":
            m["loss"][parts[1]].append((r["seed"], r["value"]))
    return out


def draw(data, out_path):
    import matplotlib.pyplot as plt

    models = [k for k in ("transformer", "mlp") if k in data] + [k for k in data if k not in ("transformer", "mlp")]
    if not models:
        raise SystemExit("hessian_alignment.csv has no rows this figure can use")
    fig, axes = plt.subplots(len(models), 4, figsize=(20, 4.4 * len(models)), squeeze=False)
    for row, kind in zip(axes, models):
        d = data[kind]
        ax = row[0]
        steps = sorted(d["curves"])
        for i, step in enumerate(steps):
            c = d["curves"][step]
            if "coupling_median" not in c or "spread_median" not in c:
                continue
            xs = sorted(c["coupling_median"])
            col = plt.cm.viridis(i / max(1, len(steps) - 1))
            ax.plot([c["coupling_median"][k] for k in xs], [c["spread_median"][k] for k in xs], "o-", color=col,
                    label=f"spread, step {step}")
            if "level_median" in c:
                ax.plot([c["coupling_median"][k] for k in xs], [c["level_median"][k] for k in xs], ":",
                        color=col, label=f"level, step {step}")
        # std of log(g_i²/g_j²) for independent zero-mean Gaussian g_i, g_j: sqrt(2) * pi/sqrt(2) = pi
        ax.axhline(math.pi, ls="--", color="0.5", lw=0.8, label="independent Gaussians (π)")
        ax.set_xscale("log")
        ax.set_xlabel("coupling |H_ij| / sqrt|H_ii H_jj|  (decile median)")
        ax.set_ylabel("median over pairs")
        rho = ", ".join(f"{d['rho'][('spearman_spread', s)]:+.2f}" for s in steps
                        if ("spearman_spread", s) in d["rho"])
        ax.set_title(f"{kind}: std log(g_i²/g_j²) vs coupling\nSpearman per checkpoint: {rho}", fontsize=10)
        ax.legend(fontsize=7)

        for ax, metric, title in ((row[1], "coupling_within", "within-block coupling (mean)"),
                                  (row[2], "dispersion", "within-block dispersion RMS log(v_i / v_block)")):
            names = [s for s in SCHEMES if (s, metric) in d["blocks"]]
            if not names:
                ax.set_visible(False)
                continue
            all_steps = sorted({x for s in names for x in d["blocks"][(s, metric)]})
            first, last = all_steps[0], all_steps[-1]
            w = 0.38
            for j, s in enumerate(names):
                vals = d["blocks"][(s, metric)]
                ax.bar(j - w / 2, vals.get(first, float("nan")), w, color=COLORS[s], alpha=0.55,
                       label=f"step {first:g}" if j == 0 else None)
                ax.bar(j + w / 2, vals.get(last, float("nan")), w, color=COLORS[s],
                       label=f"step {last:g}" if j == 0 else None)
            ax.set_xticks(range(len(names)), [LABELS[s] for s in names], fontsize=7, rotation=30)
            ax.set_title(f"{kind}: {title}", fontsize=10)
            ax.legend(fontsize=7)

        ax = row[3]
        if "adamw" in d["loss"]:
            base = dict(d["loss"]["adamw"])
            names = [s for s in SCHEMES if s in d["loss"]]
            for j, s in enumerate(names):
                diffs = [v - base[seed] for seed, v in d["loss"][s] if seed in base]
                if not diffs:
                    continue
                mu = statistics.fmean(diffs)
                ax.bar(j, mu, color=COLORS[s], yerr=[[mu - min(diffs)], [max(diffs) - mu]], capsize=3)
            ax.axhline(0, color="k", lw=0.8)
            ax.set_xticks(range(len(names)), [LABELS[s] for s in names], fontsize=7, rotation=30)
            mean_adamw = statistics.fmean(base.values())
            ax.set_title(f"{kind}: final val loss − AdamW's ({mean_adamw:.3f} nats), "
                         f"{len(base)} seeds", fontsize=10)
        else:
            ax.set_visible(False)
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    print(f"wrote {out_path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_analysis_args(parser, "hessian_alignment")
    args = parser.parse_args(argv)
    try:
        rows = read_results("hessian_alignment", args.results_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(str(exc))
    draw(collect(rows), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
