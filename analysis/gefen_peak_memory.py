"""Figure and README section: the peak memory of a training step per optimizer, and what fits a budget.

    python analysis/gefen_peak_memory.py [--results-dir results] [--out paper_figs/gefen_peak_memory.png]

Reads ``gefen_peak_memory.csv``. Top row: per model (at its first micro-batch), stacked bars of the
live tensor bytes at the peak, split into weights, gradients, state and the rest, for the first
step (hatched) and the later step with the highest peak, per optimizer, the RSS above the process
marked. Bottom row: the largest MLP and the largest GPT micro-batch each optimizer trained under
each budget, and tokens/s on two gloo ranks (DDP, FSDP2). The section gives the same numbers and
judges three targets from the CSV:

(i) lowest peak: a Gefen's tensor peak at every step of every model and micro-batch is at most
every compared optimizer's at that step, and its first step's at most its later steps' highest plus
max(largest tensor, 0.25 B/param); (ii) the lean mode (8-bit factored, bf16 weights with stochastic
rounding, step in backward) peaks at <= 4.5 B/param on the 50.4 M MLP; (iii) under one budget the
lean mode trains a model >= 3x the parameters fused AdamW does.
"""

from __future__ import annotations

import math

import numpy as np

from analysis.common import Report, fmt, main, md_table, save_figure, select, value

PARTS = ("weights", "gradients", "state", "rest")
PART_COLOURS = {"weights": "#4c72b0", "gradients": "#dd8452", "state": "#55a868", "rest": "#c44e52"}
LEAN = "Gefen-8bit-factored+bf16-sr+in-backward"
TARGET_LEAN_BPP = 4.5
TARGET_MODEL_RATIO = 3.0
FIRST_STEP_SLACK_BPP = 0.25
# compared optimizers (none of them a Gefen) and the Gefen implementations, fp32 weights, ordinary step
PEERS = ["AdamW", "Adam-mini", "torchao-AdamW8bit", "torchao-AdamW4bit"]
GEFENS = ["gefen-upstream", "gefen-x", "Gefen-8bit", "Gefen-4bit", "Gefen-8bit-factored", "Gefen-4bit-factored"]


def runs(rows):
    """[(model, micro_batch)] of the peaks, in the order written."""
    out = []
    for r in select(rows, "tensor_peak_per_param"):
        model, mb, _ = r["variant"].split("/", 2)
        if (model, int(mb[2:])) not in out:
            out.append((model, int(mb[2:])))
    return out


def configs(rows, model=None, mb=None):
    """Optimizer configurations with peaks (of one model and micro-batch if given), in order written."""
    out = []
    for r in select(rows, "tensor_peak_per_param"):
        m, b, c = r["variant"].split("/", 2)
        if (model is None or m == model) and (mb is None or b == f"mb{mb}") and c not in out:
            out.append(c)
    return out


def per_step(rows, model, mb, config, metric="tensor_peak_per_param"):
    """{step: value} of one configuration's peaks."""
    return {int(r["x_value"]): r["value"] for r in select(rows, metric, f"{model}/mb{mb}/{config}")}


def later_peak_step(rows, model, mb, config):
    steps = {s: v for s, v in per_step(rows, model, mb, config).items() if s > 0}
    return max(steps, key=steps.get) if steps else None


def split_at(rows, model, mb, config, step):
    return {p: value(rows, f"{p}_per_param", f"{model}/mb{mb}/{config}", x_value=float(step)) for p in PARTS}


def once(rows, model, mb, config, metric):
    return value(rows, metric, f"{model}/mb{mb}/{config}")


# ---------------------------------------------------------------------------------------- verdicts
def lowest_peak(rows, gefen, peers):
    """(met, worst excess over the best peer (B/param), where) of ``gefen`` on every run and step."""
    worst, where, seen = -math.inf, "", False
    for model, mb in runs(rows):
        mine = per_step(rows, model, mb, gefen)
        others = [per_step(rows, model, mb, p) for p in peers if p != gefen]
        others = [o for o in others if o]
        if not mine or not others:
            continue
        for step, v in mine.items():
            best = min(o[step] for o in others if step in o)
            seen = True
            if v - best > worst:
                worst, where = v - best, f"{model}, micro-batch {mb}, step {step}"
    return (seen and worst <= 1e-9), worst, where


def first_step_bound(rows, config):
    """(met, worst excess of the first step over later + slack (B/param), where) on every run."""
    worst, where, seen = -math.inf, "", False
    for model, mb in runs(rows):
        steps = per_step(rows, model, mb, config)
        if 0 not in steps or len(steps) < 2:
            continue
        params = once(rows, model, mb, config, "params")
        slack = max(once(rows, model, mb, config, "largest_tensor_bytes") / params, FIRST_STEP_SLACK_BPP)
        excess = steps[0] - (max(v for s, v in steps.items() if s > 0) + slack)
        seen = True
        if excess > worst:
            worst, where = excess, f"{model}, micro-batch {mb}"
    return (seen and worst <= 1e-9), worst, where


def budget_values(rows, metric, config):
    return {r["x_value"]: r["value"] for r in select(rows, metric, config)}


def verdicts(rows, target_model):
    out = []
    for g in [g for g in GEFENS if configs(rows) and g in configs(rows)]:
        met, worst, where = lowest_peak(rows, g, PEERS)
        fmet, fworst, fwhere = first_step_bound(rows, g)
        if math.isfinite(worst):
            out.append(f"- (i) {g} (fp32 weights, ordinary step) against {', '.join(p for p in PEERS if p in configs(rows))}: "
                       f"lowest peak at every step **{'met' if met else 'missed'}** (largest excess over the lowest "
                       f"peer {worst:+.2f} B/param, {where}); first step within later + max(largest tensor, "
                       f"{FIRST_STEP_SLACK_BPP} B/param) **{'met' if fmet else 'missed'}** ({fworst:+.2f} B/param, "
                       f"{fwhere}).")
    if LEAN in configs(rows):
        everyone = [c for c in configs(rows) if not c.startswith("Gefen")]
        met, worst, where = lowest_peak(rows, LEAN, everyone)
        fmet, fworst, fwhere = first_step_bound(rows, LEAN)
        out.append(f"- (i) lean mode `{LEAN}` against every peer in every mode ({', '.join(everyone)}): lowest peak "
                   f"at every step **{'met' if met else 'missed'}** (largest excess {worst:+.2f} B/param, {where}); "
                   f"first step bound **{'met' if fmet else 'missed'}** ({fworst:+.2f} B/param, {fwhere}).")
    target = [(m, b) for m, b in runs(rows) if m == target_model]
    if target and LEAN in configs(rows, *target[0]):
        m, b = target[0]
        steps = per_step(rows, m, b, LEAN)
        top = max(steps.values())
        later = max([v for s, v in steps.items() if s > 0] or [math.nan])
        rss = max(per_step(rows, m, b, LEAN, "rss_total_per_param").values())
        adamw_rss = max(per_step(rows, m, b, "AdamW", "rss_total_per_param").values() or [math.nan])
        out.append(f"- (ii) lean mode on {m} (micro-batch {b}): tensor peak {top:.2f} B/param at its highest step "
                   f"(first step {steps.get(0, math.nan):.2f}, later steps {later:.2f}; target ≤ {TARGET_LEAN_BPP} at "
                   f"every step: **{'met' if top <= TARGET_LEAN_BPP else 'missed'}**); resident set {rss:.2f} B/param "
                   f"above the warmed process at its highest step (fused AdamW: {fmt(adamw_rss)}).")
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
# the optimizers the figure draws (the results table lists every one)
FIGURE_SET = ["AdamW", "AdamW+bf16", "Adam-mini", "torchao-AdamW8bit", "gefen-x", "Gefen-8bit", "Gefen-8bit-factored", LEAN]


def label_of(name: str) -> str:
    return "Gefen lean mode" if name == LEAN else name


def _names_axis(ax, names):
    """Optimizer names down the y axis, ours in colour and bold (one colour per optimizer in every
    panel), the first at the top."""
    from analysis.common import styles

    look = styles(list(dict.fromkeys(FIGURE_SET + GEFENS + names)))
    ax.set_yticks(range(len(names)), [label_of(n) for n in names], fontsize=7)
    for tick, n in zip(ax.get_yticklabels(), names):
        tick.set_color(look[n]["color"])
        tick.set_fontweight("bold" if n.startswith("Gefen") else "normal")
    ax.set_ylim(len(names) - 0.5, -0.5)


def highest_step(rows, model, mb, name):
    steps = per_step(rows, model, mb, name)
    return max(steps, key=steps.get) if steps else None


def _stacked(ax, rows, model, mb):
    """Each drawn optimizer's tensor peak at its highest step, split into weights, gradients, state
    and the rest; its resident set a black tick; the lean mode's target a dashed line."""
    names = [n for n in FIGURE_SET if n in configs(rows, model, mb)]
    splits = [split_at(rows, model, mb, n, highest_step(rows, model, mb, n)) for n in names]
    left = np.zeros(len(names))
    for part in PARTS:
        vals = np.array([sp[part] if math.isfinite(sp[part]) else 0.0 for sp in splits])
        ax.barh(range(len(names)), vals, 0.7, left=left, color=PART_COLOURS[part], label=part)
        left += vals
    rss = [per_step(rows, model, mb, n, "rss_total_per_param").get(highest_step(rows, model, mb, n), math.nan)
           for n in names]
    ax.scatter(rss, range(len(names)), marker="|", s=120, color="black", linewidths=1.5, zorder=4,
               label="resident set (RSS)")
    ax.axvline(TARGET_LEAN_BPP, color="#2ca02c", linestyle="--", linewidth=1.2,
               label=f"lean mode's target ({TARGET_LEAN_BPP:g} B/param)")
    _names_axis(ax, names)
    ax.set_xlabel("bytes / parameter at the step's peak", fontsize=8)
    ax.set_title(f"{model}, micro-batch {mb}", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(alpha=0.3, axis="x")


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
    _names_axis(ax, names)
    ax.set_xlabel("× fused AdamW's", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, frameon=False)


def _throughput(ax, rows):
    """Tokens per second of the GPT on two gloo ranks, DDP and FSDP2, at an equal and at each
    optimizer's budget micro-batch; × a run that failed, ≠ ranks whose weights differ."""
    names = list(dict.fromkeys(r["variant"].split("/", 1)[1] for r in rows
                               if r["metric"].startswith("outcome_") and "/" in r["variant"]))
    if not names:
        ax.set_axis_off()
        return
    bars = [("ddp", "equal"), ("ddp", "budget"), ("fsdp2", "equal"), ("fsdp2", "budget")]
    height = 0.8 / len(bars)
    for j, (strategy, kind) in enumerate(bars):
        vals = [value(rows, f"tokens_per_s_{kind}_micro_batch", f"{strategy}/{n}") for n in names]
        pos = np.arange(len(names)) + (j - (len(bars) - 1) / 2) * height
        ax.barh(pos, [v if math.isfinite(v) else 0 for v in vals], height, label=f"{strategy}, {kind} micro-batch",
                color=["#c6dbef", "#6baed6", "#fdd0a2", "#fd8d3c"][j])
        agree = [value(rows, f"ranks_agree_{kind}_micro_batch", f"{strategy}/{n}") for n in names]
        for p, v, a in zip(pos, vals, agree):
            if not math.isfinite(v):
                ax.annotate("×", (0, p), ha="left", va="center", fontsize=6, color="red")
            elif a == 0:
                ax.annotate("≠", (v, p), xytext=(2, 0), textcoords="offset points", ha="left", va="center",
                            fontsize=6, color="red")
    _names_axis(ax, names)
    ax.set_xlabel("tokens / s, 2 gloo ranks on CPU", fontsize=8)
    ax.set_title("GPT on 2 ranks (×: failed; ≠: ranks differ)", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, frameon=False)


def finding(rows):
    """The figure's title: the lean mode's highest peak against its target, and its largest model
    under the largest budget against fused AdamW's."""
    drawn = {m: b for m, b in reversed(runs(rows))}  # each model's first micro-batch, as drawn
    tops = [max(per_step(rows, m, b, LEAN).values()) for m, b in drawn.items() if per_step(rows, m, b, LEAN)]
    parts = []
    if tops:
        parts.append(f"Gefen lean mode ({LEAN}): highest peak {max(tops):.2f} B/param (target "
                     f"{TARGET_LEAN_BPP:g})")
    adamw, ours = (budget_values(rows, "largest_model_params", f"model/{n}") for n in ("AdamW", LEAN))
    common_budgets = sorted(set(adamw) & set(ours))
    if common_budgets and adamw[common_budgets[-1]]:
        b = common_budgets[-1]
        parts.append(f"trains a {ours[b] / adamw[b]:.1f}× larger MLP than fused AdamW in {b:g} GiB "
                     f"(target {TARGET_MODEL_RATIO:g}×)")
    return "; ".join(parts) or "Peak memory of a training step"


def draw(rows, out, config):
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    from analysis.common import finding_title, new_figure

    models = []
    for model, mb in runs(rows):
        if model not in [m for m, _ in models]:
            models.append((model, mb))
    top = max(len(models), 3)
    fig, axes = new_figure(2, top, width=5.0 * top, height=8.6)
    for ax, (model, mb) in zip(axes[0], models):
        _stacked(ax, rows, model, mb)
    for ax in axes[0][len(models):]:
        ax.set_axis_off()
    _budget_ratios(axes[1][0], rows, "model/", "largest_model_params",
                   f"largest MLP trained under the budget (dashed: the {TARGET_MODEL_RATIO:g}× target)")
    _budget_ratios(axes[1][1], rows, "micro_batch/", "largest_micro_batch", "largest GPT micro-batch under the budget")
    _throughput(axes[1][2], rows)
    for ax in axes[1][3:]:
        ax.set_axis_off()
    handles = [Patch(color=PART_COLOURS[p], label=p) for p in PARTS] + [
        Line2D([], [], marker="|", color="black", linestyle="none", markersize=9, label="resident set (RSS)"),
        Line2D([], [], color="#2ca02c", linestyle="--", label=f"lean mode's target, {TARGET_LEAN_BPP:g} B/param")]
    # the parts' legend sits between the rows: under the peaks it explains, above the budgets
    axes[0][1].legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=6, fontsize=7,
                      frameon=False)
    save_figure(fig, out, title=finding_title(finding(rows), "Live tensor bytes at the peak of a CPU training step "
                                              "(the highest of its steps), and what each optimizer trains in a "
                                              "memory budget; every optimizer is in the results table", fig))


# ------------------------------------------------------------------------------------------ section
def _peak_table(rows, model, mb):
    table = []
    for name in configs(rows, model, mb):
        steps = per_step(rows, model, mb, name)
        later = later_peak_step(rows, model, mb, name)
        split = split_at(rows, model, mb, name, later) if later is not None else {}
        rss = per_step(rows, model, mb, name, "rss_total_per_param")
        table.append([f"**{name}**" if name == LEAN else name, fmt(steps.get(0)), fmt(steps.get(later))]
                     + [fmt(split.get(p)) for p in PARTS]
                     + [fmt(max(per_step(rows, model, mb, name, "transient_per_param").values())),
                        fmt(max(rss.values())), fmt(once(rows, model, mb, name, "state_bytes_per_param"))])
    return md_table(["optimizer", "first step", "later (highest)", "weights", "gradients", "state", "rest",
                     "transient", "RSS", "state bytes"], table)


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


def _dist_table(rows):
    names = list(dict.fromkeys(r["variant"].split("/", 1)[1] for r in rows if r["metric"].startswith("outcome_")))
    if not names:
        return ""
    code = {0: "", 1: "killed for memory", 2: "error", 3: "timeout"}
    table = []
    for n in names:
        row = [f"**{n}**" if n == LEAN else n]
        for strategy in ("ddp", "fsdp2"):
            for kind in ("equal", "budget"):
                out = select(rows, f"outcome_{kind}_micro_batch", f"{strategy}/{n}")
                if not out:
                    row.append("—")
                    continue
                tps = select(rows, f"tokens_per_s_{kind}_micro_batch", f"{strategy}/{n}")
                failed = [f"{code[int(r['value'])]} at mb {int(r['x_value'])}" for r in out if r["value"]]
                if tps:
                    cell = f"{fmt(tps[0]['value'])} (mb {int(tps[0]['x_value'])})"
                    agree = value(rows, f"ranks_agree_{kind}_micro_batch", f"{strategy}/{n}")
                    cell += ", ranks differ" if agree == 0 else ""
                    cell += f"; {', '.join(failed)}" if failed else ""
                else:
                    cell = ", ".join(failed)
                row.append(cell)
        table.append(row)
    return md_table(["optimizer", "DDP, equal mb", "DDP, budget mb", "FSDP2, equal mb", "FSDP2, budget mb"], table)


def body(rows, config):
    c = config.get("config", {})
    size = c.get("size", {})
    target = c.get("target_model") or (runs(rows)[0][0] if runs(rows) else "")
    text = [f"Live tensor bytes at the peak of forward + backward + step + `zero_grad(set_to_none=True)` "
            f"(experiments/peak.PeakMemory: what `torch.cuda.max_memory_allocated` counts on a GPU), per parameter, "
            f"split at the peak; step 0 is the first, the later column the highest of steps 1-{c.get('steps', 4) - 1}. "
            "RSS: the resident set at the step's peak above the process before the model was built (after a warm-up "
            "on a tiny model that compiles what each optimizer compiles). Each optimizer in a fresh process, one "
            f"torch thread. `+bf16`: pure bf16 weights and state (AdamW); `+bf16-sr`: bf16 weights with stochastic "
            f"rounding (ours); `+in-backward`: `optim.step_in_backward`. Lean mode: **{LEAN}**."]
    for model, mb in runs(rows):
        text.append(f"`{model}`, micro-batch {mb}:\n\n" + _peak_table(rows, model, mb))
    budget = _budget_table(rows)
    if budget:
        text.append(f"Budgets (memory cgroups joined after the warm-up, so each counts what training adds, as a "
                    f"GPU's memory would; {c.get('fit_steps', 3)} steps without an OOM kill): the largest GPT "
                    f"micro-batch and the largest MLP (twelve layers, micro-batch "
                    f"{size.get('ladder', {}).get('micro_batch', 8)}), searched to 10%; × fused AdamW's.\n\n" + budget)
    dist = _dist_table(rows)
    if dist:
        text.append(f"Two gloo ranks on CPU (one thread each), the GPT, tokens/s of both ranks (median of "
                    f"{size.get('dist_steps', [1, 3])[1]} steps after {size.get('dist_steps', [1, 3])[0]}): at an "
                    f"equal micro-batch, and under {(size.get('mb_budgets') or [0])[0]:g} GiB a rank (every rank in "
                    "a cgroup of that size) at each optimizer's single-process largest micro-batch, divided by 1.4 "
                    "after each kill for memory (the kills listed after the micro-batch that ran). With DDP the "
                    "ranks' weights are compared after the steps.\n\n" + dist)
    notes = c.get("notes") or []
    if notes:
        text.append("Notes from the run:\n\n" + "\n".join(f"- {n}" for n in notes))
    text.append("Verdicts:\n\n" + "\n".join(verdicts(rows, target)))
    return "\n\n".join(text)


REPORT = Report("gefen_peak_memory", "gefen_peak_memory", "Gefen: the peak memory of a training step, and budgets",
                body, draw, metrics=("tensor_peak_per_param",))

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
