"""Figure: Poincaré embeddings of the standard library's class hierarchy, reconstruction quality.

Reads only results/poincare.csv (written by experiments/poincare.py); writes paper_figs/poincare.png:

    python analysis/poincare.py [--results-dir results] [--out paper_figs/poincare.png]
    python analysis/poincare.py --results-dir results/quick --out paper_figs/quick/poincare.png

Left: mean rank (lower is better, log scale) against the embedding dimension, per optimizer.
Right: MAP (higher is better). The latest run of each variant is drawn.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.common import add_analysis_args, latest_run, read_results  # noqa: E402  (sets Agg)
import matplotlib.pyplot as plt  # noqa: E402

STYLE = {
    "DiskSparseRiemannianAdam": dict(color="tab:blue", marker="o", ls="-"),
    "geoopt.SparseRiemannianAdam": dict(color="tab:orange", marker="x", ls="--", ms=9),
    "DiskSparseAdam+clip": dict(color="tab:red", marker="s", ls=":"),
    "DiskSparseAdam-euclidean": dict(color="tab:green", marker="^", ls="-."),
}


def series(rows, metric):
    out = defaultdict(list)
    for r in rows:
        if r["metric"] == metric and r["x_name"] == "dim":
            out[r["variant"]].append((r["x_value"], r["value"]))
    return {k: sorted(v) for k, v in out.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_analysis_args(parser, "poincare")
    args = parser.parse_args(argv)
    rows = latest_run(read_results("poincare", args.results_dir))
    if not rows:
        raise SystemExit(f"{args.results_dir}/poincare.csv has no rows; run experiments/poincare.py first")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, metric, label in [(axes[0], "mean_rank", "mean rank (lower is better)"),
                              (axes[1], "map", "MAP (higher is better)")]:
        for variant, pts in series(rows, metric).items():
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=variant, **STYLE.get(variant, {}))
        ax.set_xlabel("embedding dimension")
        ax.set_ylabel(label)
        ax.set_xticks(sorted({r["x_value"] for r in rows if r["x_name"] == "dim"}))
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_ylim(0, 1)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=len(labels), frameon=False)
    r0 = rows[0]
    fig.suptitle("Poincaré embeddings of the Python stdlib class hierarchy (reconstruction)\n"
                 f"torch {r0['torch_version']}, {r0['device']}, seed {r0['seed']}, commit {r0['git_commit']}",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
