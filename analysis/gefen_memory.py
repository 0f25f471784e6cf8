"""Figure: optimizer-state bytes per parameter and CPU step time of every optimizer, per model.

Reads only results/gefen_memory.csv (written by experiments/gefen_memory.py) and draws
paper_figs/gefen_memory.png:

- left: tensor bytes of ``state_dict()`` per parameter, one bar per optimizer and model, with
  Gefen's targets (1.05 B/param at 8 bits, 0.55 at 4 bits) as dashed lines;
- middle: median CPU ``step()`` time (ms, log scale), labelled with the ratio to fused AdamW's
  median from the same run (the target: at most 4x);
- right (when the CSV has it): final validation loss of the character model relative to AdamW's,
  mean over seeds with the standard deviation as an error bar (the target: within 3%).

The timing and the loss runs may come from separate runs of the experiment (``--skip-loss``,
``--skip-timing``): per variant and metric, the newest run's rows are kept.

    python analysis/gefen_memory.py
    python analysis/gefen_memory.py --results-dir results/quick --out paper_figs/quick/gefen_memory.png
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.common import add_analysis_args, read_results  # noqa: E402

TARGETS_BPP = {"8-bit target 1.05": 1.05, "4-bit target 0.55": 0.55}


def latest_per_metric(rows):
    """Rows of the newest run of each (variant, metric): timing and loss runs may be separate runs."""
    newest = {}
    for r in rows:
        key = (r["variant"], r["metric"])
        if key not in newest or r["timestamp"] > newest[key]:
            newest[key] = r["timestamp"]
    return [r for r in rows if r["timestamp"] == newest[(r["variant"], r["metric"])]]


def table(rows, metric):
    """{model (or x value): {variant: value}} for one metric, variants in first-seen order."""
    out: dict = {}
    for r in rows:
        if r["metric"] == metric:
            x = r["x_value"]
            key = x if isinstance(x, str) else f"{x:g}"
            out.setdefault(key, {})[r["variant"]] = r["value"]
    return out


def variants_in_order(rows):
    seen = []
    for r in rows:
        if r["variant"] not in seen:
            seen.append(r["variant"])
    return seen


def _bars(ax, data, order, log=False, labels=None, rotate=False):
    import numpy as np

    models = list(data)
    width = 0.8 / max(1, len(models))
    x = np.arange(len(order))
    for j, model in enumerate(models):
        vals = [data[model].get(v, math.nan) for v in order]
        bars = ax.bar(x + (j - (len(models) - 1) / 2) * width, vals, width, label=model)
        for k, (b, v) in enumerate(zip(bars, vals)):
            if not math.isfinite(v):
                continue
            text = labels[model].get(order[k]) if labels else f"{v:.2f}"
            if text:
                ax.annotate(text, (b.get_x() + b.get_width() / 2, v), textcoords="offset points",
                            xytext=(0, 2), ha="center", fontsize=6, rotation=90 if rotate else 0)
    ax.set_xticks(x, order, rotation=30, ha="right", fontsize=8)
    if log:
        from matplotlib.ticker import LogLocator, NullFormatter, StrMethodFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    finite = [v for d in data.values() for v in d.values() if math.isfinite(v) and (v > 0 or not log)]
    if finite:  # room above the bars for the value labels
        if log:
            ax.set_ylim(min(finite) / 1.3, max(finite) * 2.0)
        else:
            ax.set_ylim(min(0.0, min(finite)), max(finite) * 1.12)
    ax.grid(alpha=0.3, axis="y", which="both")
    if len(models) > 1:
        ax.legend(fontsize=7, title="model", title_fontsize=7)


def draw(rows, out: Path, title: str = ""):
    import matplotlib.pyplot as plt

    order = variants_in_order(rows)
    bpp = table(rows, "state_bytes_per_param")
    step = {m: {v: 1e3 * s for v, s in d.items()} for m, d in table(rows, "step_time_median").items()}
    ratio = table(rows, "step_time_vs_adamw_fused")
    loss_ratio = table(rows, "val_loss_vs_adamw_mean")
    loss_std = table(rows, "val_loss_vs_adamw_std")
    panels = 2 + bool(loss_ratio)
    fig, axes = plt.subplots(1, panels, figsize=(6.2 * panels, 5))

    ax = axes[0]
    _bars(ax, bpp, [v for v in order if any(v in d for d in bpp.values())], log=True)
    for (name, y), style in zip(TARGETS_BPP.items(), ["--", ":"]):
        ax.axhline(y, color="grey", linestyle=style, linewidth=1, label=name)
    ax.set_ylabel("optimizer state (bytes / parameter, log scale)")
    ax.set_title("state bytes per parameter (tensor bytes of state_dict)")
    ax.legend(fontsize=7)

    ax = axes[1]
    labels = {m: {v: f"{r:.1f}x" for v, r in d.items() if math.isfinite(r)} for m, d in ratio.items()}
    _bars(ax, step, [v for v in order if any(v in d for d in step.values())], log=True,
          labels=labels if labels else None, rotate=True)
    ax.set_ylabel("CPU step time, median (ms)")
    ax.set_title("one optimizer step on CPU (label: x fused AdamW)")

    if loss_ratio:
        ax = axes[2]
        lorder = [v for v in order if any(v in d for d in loss_ratio.values())]
        _bars(ax, {f"{k} steps": v for k, v in loss_ratio.items()}, lorder)
        import numpy as np

        for k, d in loss_ratio.items():  # one model (the character model): bars at 0..n-1
            err = [loss_std.get(k, {}).get(v, 0.0) for v in lorder]
            ax.errorbar(np.arange(len(lorder)), [d.get(v, math.nan) for v in lorder], yerr=err,
                        fmt="none", ecolor="black", capsize=3, linewidth=1)
        ax.axhline(1.03, color="grey", linestyle="--", linewidth=1, label="target: within 3%")
        ax.axhline(1.0, color="black", linewidth=0.8)
        lo = min(v for d in loss_ratio.values() for v in d.values() if math.isfinite(v))
        hi = max(v + loss_std.get(k, {}).get(n, 0.0) for k, d in loss_ratio.items() for n, v in d.items()
                 if math.isfinite(v))
        ax.set_ylim(min(lo, 1.0) - 0.01, max(hi, 1.03) + 0.01)
        ax.set_ylabel("final validation loss / AdamW's")
        ax.set_title("character model: loss / AdamW's (mean ± std over seeds)")
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def main(argv=None):
    parser = add_analysis_args(argparse.ArgumentParser(description=__doc__), "gefen_memory")
    args = parser.parse_args(argv)
    used = {"state_bytes_per_param", "step_time_median", "step_time_vs_adamw_fused", "threads",
            "val_loss_vs_adamw_mean", "val_loss_vs_adamw_std"}
    rows = [r for r in latest_per_metric(read_results("gefen_memory", args.results_dir)) if r["metric"] in used]
    if not any(r["metric"] == "state_bytes_per_param" for r in rows):
        raise SystemExit(f"{args.results_dir}/gefen_memory.csv has no state_bytes_per_param rows to draw")
    r0 = rows[0]
    threads = sorted({int(r["value"]) for r in rows if r["metric"] == "threads"})
    commits = "/".join(sorted({r["git_commit"] for r in rows}))
    setup = f"{r0['device']}, torch {r0['torch_version']}, commit {commits}"
    if threads:
        setup += f", {'/'.join(map(str, threads))} thread(s) for every optimizer's step"
    draw(rows, args.out, setup)
    print(setup)
    bpp, step = table(rows, "state_bytes_per_param"), table(rows, "step_time_median")
    ratio = table(rows, "step_time_vs_adamw_fused")
    for model in bpp:
        print(f"\n{model}\n{'optimizer':<22} {'B/param':>8} {'step ms':>9} {'x AdamW':>8}")
        for v in variants_in_order(rows):
            if v in bpp[model]:
                ms = 1e3 * step.get(model, {}).get(v, math.nan)
                print(f"{v:<22} {bpp[model][v]:>8.3f} {ms:>9.2f} {ratio.get(model, {}).get(v, math.nan):>8.2f}")
    mean, std = table(rows, "val_loss_vs_adamw_mean"), table(rows, "val_loss_vs_adamw_std")
    for steps, d in mean.items():
        print(f"\ncharacter model, {steps} steps: final validation loss / AdamW's (mean +- std over seeds)")
        for v, m in d.items():
            print(f"{v:<22} {m:.4f} +- {std.get(steps, {}).get(v, math.nan):.4f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
