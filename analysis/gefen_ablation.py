"""Figure: Gefen's final loss relative to AdamW's with a per-element v on one kind of tensor.

Reads only results/gefen_ablation.csv (written by experiments/gefen_ablation.py), the newest run,
and draws paper_figs/gefen_ablation.png: one horizontal bar per variant (which tensors keep v per
element; ``none`` is Gefen as published), the mean over seeds of final validation loss / AdamW's
with the standard deviation as an error bar and every seed as a dot, the 3% target as a dashed
line and AdamW (1.0) as a solid one.

    python analysis/gefen_ablation.py
    python analysis/gefen_ablation.py --results-dir results/quick --out paper_figs/quick/gefen_ablation.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.common import add_analysis_args, latest_run, read_results, save_figure  # noqa: E402


def collect(rows):
    """{variant: (mean, std, [per-seed ratios])} in the order the experiment ran them."""
    out = {}
    for r in rows:
        v = r["variant"]
        if r["metric"] == "val_loss_vs_adamw":
            out.setdefault(v, [None, None, []])[2].append(r["value"])
        elif r["metric"] == "val_loss_vs_adamw_mean":
            out.setdefault(v, [None, None, []])[0] = r["value"]
        elif r["metric"] == "val_loss_vs_adamw_std":
            out.setdefault(v, [None, None, []])[1] = r["value"]
    return {v: tuple(x) for v, x in out.items() if x[0] is not None}


def draw(data, out, setup):
    import matplotlib.pyplot as plt

    names = list(data)
    fig, ax = plt.subplots(figsize=(7.2, 0.45 * len(names) + 1.8))
    y = range(len(names))
    means = [data[n][0] for n in names]
    ax.barh(list(y), [m - 1 for m in means], left=1, xerr=[data[n][1] for n in names], color="tab:blue",
            alpha=0.7, capsize=3)
    for k, n in enumerate(names):
        ax.plot(data[n][2], [k] * len(data[n][2]), "k.", ms=4)
        ax.annotate(f"{means[k]:.3f}", (max(means[k], 1) + 0.002, k), va="center", fontsize=7)
    ax.axvline(1.0, color="k", lw=1, label="AdamW")
    ax.axvline(1.03, color="tab:red", ls="--", lw=1, label="3% target")
    ax.set_yticks(list(y), [f"v per element on: {n}" for n in names], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("final validation loss / AdamW's (paired by seed)")
    hi = max(max(data[n][2]) for n in names)
    ax.set_xlim(min(0.99, min(min(data[n][2]) for n in names) - 0.005), max(1.035, hi) + 0.012)
    ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=2, frameon=False)
    ax.grid(alpha=0.3, axis="x")
    return save_figure(fig, out, setup)


def main(argv=None):
    parser = add_analysis_args(argparse.ArgumentParser(description=__doc__), "gefen_ablation")
    args = parser.parse_args(argv)
    rows = latest_run(read_results("gefen_ablation", args.results_dir))
    data = collect(rows)
    if not data:
        raise SystemExit(f"{args.results_dir}/gefen_ablation.csv has no val_loss_vs_adamw rows to draw")
    r0 = rows[0]
    steps = int(r0["x_value"])
    seeds = max(len(v[2]) for v in data.values())
    setup = (f"Gefen 8-bit, char model, {steps} steps, {seeds} seed(s)\n{r0['device']}, "
             f"torch {r0['torch_version']}, commit {r0['git_commit']}")
    draw(data, args.out, setup)
    print(setup.replace("\n", "; "))
    for n, (m, s, _) in data.items():
        print(f"v per element on {n:<16} {m:.4f} +- {s:.4f} x AdamW")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
