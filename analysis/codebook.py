"""Figure: the exact codebook DP (time vs bins and levels) and the quantisation error of the codes.

Reads only results/codebook_dp.csv (written by experiments/codebook_dp.py); writes
paper_figs/codebook.png:

    python analysis/codebook.py [--results-dir results] [--out paper_figs/codebook.png]

Left: median DP CPU time (wall time if the CSV has none) against histogram bins, ours (numba,
numpy) and upstream gefen's exact_dp, at 16 and 256 levels. Middle: speed-up over upstream (median/median, same run).
Right: relative error sum (m − m̂)² / sum m² of AdamW first moments quantised with each code, at
8 and 4 bits, with absmax-256 blocks and with Gefen's blocks.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from experiments.common import FIGS_DIR, RESULTS_DIR, read_results  # noqa: E402

COLORS = {"ours-numba": "tab:blue", "ours-numpy": "tab:green", "upstream": "tab:red"}
STYLES = {"K16": "--", "K256": "-"}
CODE_ORDER = ["learned", "learned-step1", "linear", "dynamic"]


def _series(rows, metric):
    """{(impl, K): sorted [(bins, value)]} for rows of one metric."""
    out = defaultdict(list)
    for r in rows:
        if r["metric"] == metric and r["x_name"] == "bins":
            impl, k = r["variant"].rsplit("/", 1)
            out[(impl, k)].append((float(r["x_value"]), r["value"]))
    return {key: sorted(v) for key, v in out.items()}


def draw(rows, out: Path):
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    # CPU time of the (single-threaded) DP is the primary number: the shared 2-core machine this
    # runs on is often oversubscribed, which inflates wall time; wall medians stay in the CSV
    cpu = any(r["metric"] == "dp_cpu_time" for r in rows)
    tmetric, smetric = ("dp_cpu_time", "cpu_speedup_vs_upstream") if cpu else ("dp_time", "speedup_vs_upstream")
    for (impl, k), pts in sorted(_series(rows, tmetric).items()):
        ax.plot(*zip(*pts), STYLES.get(k, ":"), marker="o", ms=3, color=COLORS.get(impl),
                label=f"{impl}, {k[1:]} levels")
    ax.set(xscale="log", yscale="log", xlabel="histogram bins",
           ylabel=f"DP {'CPU' if cpu else 'wall'} time, median (s)", title="Exact optimal codebook: DP time")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")

    ax = axes[1]
    for (impl, k), pts in sorted(_series(rows, smetric).items()):
        ax.plot(*zip(*pts), STYLES.get(k, ":"), marker="o", ms=3, color=COLORS.get(impl),
                label=f"{impl}, {k[1:]} levels")
        bx, by = pts[-1]
        ax.annotate(f"{by:.0f}x", (bx, by), fontsize=7, xytext=(3, 0), textcoords="offset points")
    ax.axhline(10, color="gray", lw=0.8, ls=":")
    ax.axhline(50, color="gray", lw=0.8, ls="--")
    ax.set(xscale="log", yscale="log", xlabel="histogram bins", ylabel="upstream time / ours (medians)",
           title="Speed-up over upstream exact_dp (same optimum)")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")

    ax = axes[2]
    err = {}
    for r in rows:
        if r["metric"] == "rel_mse":
            code, bits, blocking = r["variant"].split("/")
            err[(code, bits, blocking)] = r["value"]
    codes = [c for c in CODE_ORDER if any(k[0] == c for k in err)] + sorted({k[0] for k in err} - set(CODE_ORDER))
    groups = [(bits, blocking) for bits in ("8bit", "4bit") for blocking in ("absmax256", "gefen")
              if any(k[1:] == (bits, blocking) for k in err)]
    width = 0.8 / max(len(codes), 1)
    cmap = plt.get_cmap("tab10")
    for ci, code in enumerate(codes):
        xs = [gi + (ci - (len(codes) - 1) / 2) * width for gi in range(len(groups))]
        ys = [err.get((code, *g), float("nan")) for g in groups]
        ax.bar(xs, ys, width, label=code, color=cmap(ci))
    ax.set_xticks(range(len(groups)), [f"{b}\n{bl}" for b, bl in groups], fontsize=8)
    ax.set(yscale="log", ylabel="sum (m - m_q)^2 / sum m^2", title="AdamW first moments: quantisation error")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y", which="both")

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--out", type=Path, default=FIGS_DIR / "codebook.png")
    args = parser.parse_args()
    rows = read_results("codebook_dp", args.results_dir)
    print(f"wrote {draw(rows, args.out)}")


if __name__ == "__main__":
    main()
