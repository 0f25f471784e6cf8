"""Figure and README section: what each optimizer trains in a memory budget, against fused AdamW.

    python analysis/gefen_budgets.py [--results-dir results] [--out paper_figs/gefen_budgets.png]

Reads ``gefen_budgets.csv``. Left: the largest MLP each optimizer trained under each budget, ×
fused AdamW's; right: the largest GPT micro-batch, likewise. The section gives the same numbers and
judges one target from the CSV: (iii) under one budget the lean mode (8-bit factored, bf16 weights
with stochastic rounding, step in backward) trains a model >= 3x the parameters fused AdamW does.
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

TARGET_MODEL_RATIO = 3.0


def budget_values(rows, metric, config):
    """{budget (GiB): value} of one ``model/`` or ``micro_batch/`` variant."""
    return {r["x_value"]: r["value"] for r in select(rows, metric, config)}


def verdicts(rows):
    out = []
    adamw = budget_values(rows, "largest_model_params", "model/AdamW")
    for name in [LEAN, "Gefen-8bit"]:
        ours = budget_values(rows, "largest_model_params", f"model/{name}")
        for budget in sorted(set(adamw) & set(ours)):
            ratio = ours[budget] / adamw[budget] if adamw[budget] else math.nan
            out.append(f"- (iii) {name} under {budget:g} GiB: {ours[budget] / 1e6:,.1f} M parameters, fused AdamW "
                       f"{adamw[budget] / 1e6:,.1f} M: {fmt(ratio)}× (target ≥ {TARGET_MODEL_RATIO:g}×: "
                       f"**{'met' if ratio >= TARGET_MODEL_RATIO else 'missed'}**).")
    return out


# ------------------------------------------------------------------------------------------ figure
def _budget_ratios(ax, rows, prefix, metric, title):
    """Each optimizer's largest model or micro-batch under each budget, × fused AdamW's, the 1× line
    and the ×3 target (of the model ladder) marked."""
    names = list(dict.fromkeys(r["variant"].split("/", 1)[1] for r in select(rows, metric)
                               if r["variant"].startswith(prefix)))
    budgets = sorted({r["x_value"] for r in select(rows, metric)})
    if not names:
        ax.set_axis_off()
        return
    height = 0.8 / max(len(budgets), 1)
    for j, b in enumerate(budgets):
        base = value(rows, metric, f"{prefix}AdamW", x_value=b)
        vals = [value(rows, metric, f"{prefix}{n}", x_value=b) / base if base else math.nan for n in names]
        ax.barh(np.arange(len(names)) + (j - (len(budgets) - 1) / 2) * height, vals, height,
                color=["#9ecae1", "#3182bd", "#08519c"][j % 3], label=f"{b:g} GiB budget")
    ax.axvline(1, color="black", linewidth=1)
    if metric == "largest_model_params":
        ax.axvline(TARGET_MODEL_RATIO, color="#2ca02c", linestyle="--", linewidth=1.2)
    optimizer_axis(ax, names)
    ax.set_xlabel("× fused AdamW's", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, frameon=False)


def finding(rows):
    """The figure's title: the lean mode's largest model under the largest budget against fused AdamW's."""
    adamw, ours = (budget_values(rows, "largest_model_params", f"model/{n}") for n in ("AdamW", LEAN))
    common_budgets = sorted(set(adamw) & set(ours))
    if not common_budgets or not adamw[common_budgets[-1]]:
        return "What each optimizer trains in a memory budget"
    b = common_budgets[-1]
    return (f"Gefen lean mode ({LEAN}) trains a {ours[b] / adamw[b]:.1f}× larger MLP than fused AdamW in {b:g} GiB "
            f"(target {TARGET_MODEL_RATIO:g}×)")


def draw(rows, out, config):
    from analysis.common import finding_title, new_figure

    fig, axes = new_figure(1, 2, width=10.0, height=4.4)
    _budget_ratios(axes[0][0], rows, "model/", "largest_model_params",
                   f"largest MLP trained under the budget (dashed: the {TARGET_MODEL_RATIO:g}× target)")
    _budget_ratios(axes[0][1], rows, "micro_batch/", "largest_micro_batch", "largest GPT micro-batch under the budget")
    save_figure(fig, out, title=finding_title(finding(rows), "The largest model and micro-batch each optimizer "
                                              "trains in a memory cgroup on CPU, × fused AdamW's", fig))


# ------------------------------------------------------------------------------------------ section
def _budget_table(rows):
    mb_budgets = sorted({r["x_value"] for r in select(rows, "largest_micro_batch")})
    model_budgets = sorted({r["x_value"] for r in select(rows, "largest_model_params")})
    names = list(dict.fromkeys(r["variant"].split("/", 1)[1] for r in rows
                               if r["metric"] in ("largest_micro_batch", "largest_model_params")))
    if not names:
        return ""
    table = []
    for n in names:
        row = [f"**{n}**" if n == LEAN else n]
        for b in mb_budgets:
            ours, base = (value(rows, "largest_micro_batch", f"micro_batch/{c}", x_value=b) for c in (n, "AdamW"))
            row.append(f"{fmt(ours)} ({fmt(ours / base if base else math.nan)}×)")
        for b in model_budgets:
            ours, base = (value(rows, "largest_model_params", f"model/{c}", x_value=b) for c in (n, "AdamW"))
            row.append(f"{fmt(ours / 1e6)} M ({fmt(ours / base if base else math.nan)}×)")
        table.append(row)
    return md_table(["optimizer"] + [f"GPT micro-batch, {b:g} GiB" for b in mb_budgets]
                    + [f"MLP, {b:g} GiB" for b in model_budgets], table)


def body(rows, config):
    c = config.get("config", {})
    size = c.get("size", {})
    text = [split_from(config)
            + f"Memory cgroups joined after the warm-up, so each counts what training adds, as a GPU's memory "
            f"would; {c.get('fit_steps', 3)} steps without an OOM kill: the largest micro-batch of the peaks' GPT "
            f"and the largest MLP (twelve layers, micro-batch {size.get('ladder', {}).get('micro_batch', 8)}, "
            "width in multiples of 64), searched to 10% (experiments/harness/budget.py); × fused AdamW's. Lean mode: "
            f"**{LEAN}**.\n\n" + _budget_table(rows)]
    notes = c.get("notes") or []
    if notes:
        text.append("Notes from the run:\n\n" + "\n".join(f"- {n}" for n in notes))
    text.append("Verdicts:\n\n" + "\n".join(verdicts(rows)))
    return "\n\n".join(text)


REPORT = Report("gefen_budgets", "gefen_budgets", "Gefen: what fits a memory budget", body, draw,
                metrics=("largest_model_params", "largest_micro_batch"))

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
