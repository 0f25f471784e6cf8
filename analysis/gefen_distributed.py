"""Figure and README section: the GPT's throughput on two gloo ranks, DDP and FSDP2, per optimizer.

    python analysis/gefen_distributed.py [--results-dir results] [--out paper_figs/gefen_distributed.png]

Reads ``gefen_distributed.csv``. Tokens/s of both ranks per optimizer, DDP and FSDP2, at an equal
micro-batch and at each optimizer's largest micro-batch under the budget (× a run that failed, ≠
ranks whose weights differ after the steps). The section gives every run, the kills for memory
before the micro-batch that ran, and the throughput under the budget × fused AdamW's (the claim:
more throughput than AdamW under DDP and FSDP).
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import math

import numpy as np

from analysis.common import Report, fmt, main, md_table, save_figure, select, value
from analysis.gefen_peak_memory import LEAN, optimizer_axis, split_from

STRATEGIES = ("ddp", "fsdp2")
KINDS = ("equal", "budget")
CODE = {0: "", 1: "killed for memory", 2: "error", 3: "timeout"}


def names(rows):
    """The optimizers with runs, in the order written."""
    return list(dict.fromkeys(r["variant"].split("/", 1)[1] for r in rows
                              if r["metric"].startswith("outcome_") and "/" in r["variant"]))


def tokens_ratio(rows, strategy, kind, name, base="AdamW"):
    """``name``'s tokens/s × ``base``'s, one strategy and kind of run (NaN where either did not run)."""
    ours, theirs = (value(rows, f"tokens_per_s_{kind}_micro_batch", f"{strategy}/{n}") for n in (name, base))
    return ours / theirs if theirs else math.nan


# ------------------------------------------------------------------------------------------ figure
def _throughput(ax, rows):
    """Tokens per second of the GPT on two gloo ranks, DDP and FSDP2, at an equal and at each
    optimizer's budget micro-batch; × a run that failed, ≠ ranks whose weights differ."""
    drawn = names(rows)
    if not drawn:
        ax.set_axis_off()
        return
    bars = [(s, k) for s in STRATEGIES for k in KINDS]
    height = 0.8 / len(bars)
    for j, (strategy, kind) in enumerate(bars):
        vals = [value(rows, f"tokens_per_s_{kind}_micro_batch", f"{strategy}/{n}") for n in drawn]
        pos = np.arange(len(drawn)) + (j - (len(bars) - 1) / 2) * height
        ax.barh(pos, [v if math.isfinite(v) else 0 for v in vals], height, label=f"{strategy}, {kind} micro-batch",
                color=["#c6dbef", "#6baed6", "#fdd0a2", "#fd8d3c"][j])
        agree = [value(rows, f"ranks_agree_{kind}_micro_batch", f"{strategy}/{n}") for n in drawn]
        for p, v, a in zip(pos, vals, agree):
            if not math.isfinite(v):
                ax.annotate("×", (0, p), ha="left", va="center", fontsize=6, color="red")
            elif a == 0:
                ax.annotate("≠", (v, p), xytext=(2, 0), textcoords="offset points", ha="left", va="center",
                            fontsize=6, color="red")
    optimizer_axis(ax, drawn)
    ax.set_xlabel("tokens / s, 2 gloo ranks on CPU", fontsize=8)
    ax.set_title("GPT on 2 ranks (×: failed; ≠: ranks differ)", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, frameon=False)


def finding(rows):
    """The figure's title: the lean mode's throughput under the budget × fused AdamW's, per strategy."""
    ratios = {s: tokens_ratio(rows, s, "budget", LEAN) for s in STRATEGIES}
    if not any(math.isfinite(r) for r in ratios.values()):
        return "Throughput on two ranks per optimizer"
    parts = [f"{fmt(r)}× ({s.upper()})" for s, r in ratios.items() if math.isfinite(r)]
    return "Gefen lean mode at its largest micro-batch under the budget: fused AdamW's tokens/s " + ", ".join(parts)


def draw(rows, out, config):
    from analysis.common import finding_title, new_figure

    fig, axes = new_figure(1, 1, width=6.4, height=4.8)
    _throughput(axes[0][0], rows)
    save_figure(fig, out, title=finding_title(finding(rows), "The GPT on two gloo ranks (one thread each) at an "
                                              "equal micro-batch and at each optimizer's largest under the budget",
                                              fig))


# ------------------------------------------------------------------------------------------ section
def _cell(rows, strategy, kind, name):
    out = select(rows, f"outcome_{kind}_micro_batch", f"{strategy}/{name}")
    if not out:
        return "—"
    tps = select(rows, f"tokens_per_s_{kind}_micro_batch", f"{strategy}/{name}")
    failed = [f"{CODE[int(r['value'])]} at mb {int(r['x_value'])}" for r in out if r["value"]]
    if not tps:
        return ", ".join(failed)
    cell = f"{fmt(tps[0]['value'])} (mb {int(tps[0]['x_value'])})"
    cell += ", ranks differ" if value(rows, f"ranks_agree_{kind}_micro_batch", f"{strategy}/{name}") == 0 else ""
    return cell + (f"; {', '.join(failed)}" if failed else "")


def _dist_table(rows):
    table = [[f"**{n}**" if n == LEAN else n] + [_cell(rows, s, k, n) for s in STRATEGIES for k in KINDS]
             + [fmt(tokens_ratio(rows, s, "budget", n)) + "×" for s in STRATEGIES] for n in names(rows)]
    return md_table(["optimizer", "DDP, equal mb", "DDP, budget mb", "FSDP2, equal mb", "FSDP2, budget mb",
                     "DDP budget / AdamW", "FSDP2 budget / AdamW"], table)


def body(rows, config):
    c = config.get("config", {})
    size = c.get("size", {})
    steps = size.get("dist_steps", [1, 3])
    text = [split_from(config)
            + f"Two gloo ranks on CPU (one thread each), the peaks' GPT, tokens/s of both ranks (median of {steps[1]} "
            f"steps after {steps[0]}): at an equal micro-batch, and under {(size.get('mb_budgets') or [0])[0]:g} GiB "
            "a rank (every rank in a cgroup of that size) at each optimizer's single-process largest micro-batch "
            "(experiments/gefen_budgets.py's), divided by 1.4 after each kill for memory (the kills listed after "
            "the micro-batch that ran). With DDP the ranks' weights are compared after the steps. Lean mode: "
            f"**{LEAN}**.\n\n" + _dist_table(rows)]
    notes = c.get("notes") or []
    if notes:
        text.append("Notes from the run:\n\n" + "\n".join(f"- {n}" for n in notes))
    return "\n\n".join(text)


REPORT = Report("gefen_distributed", "gefen_distributed", "Gefen: throughput on two ranks (DDP, FSDP2)", body, draw,
                metrics=("outcome_equal_micro_batch",))

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
