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

from analysis.common import Report, colour, fmt, main, md_table, save_figure, select, value

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
def _stacked(ax, rows, model, mb):
    names = configs(rows, model, mb)
    x = np.arange(len(names))
    for k, name in enumerate(names):
        later = later_peak_step(rows, model, mb, name)
        for dx, step, hatch in ((-0.2, 0, "//"), (0.2, later, None)):
            if step is None:
                continue
            split, bottom = split_at(rows, model, mb, name, step), 0.0
            for part in PARTS:
                v = split[part]
                if math.isfinite(v) and v > 0:
                    ax.bar(x[k] + dx, v, 0.4, bottom=bottom, color=PART_COLOURS[part], hatch=hatch,
                           edgecolor="white", linewidth=0.3)
                    bottom += v
            rss = per_step(rows, model, mb, name, "rss_total_per_param").get(step, math.nan)
            ax.plot(x[k] + dx, rss, "k_", markersize=7)
    ax.set_xticks(x, names, rotation=60, ha="right", fontsize=6)
    top = 1.3 * max((sum(split_at(rows, model, mb, n, s)[p] for p in PARTS)
                     for n in names for s in per_step(rows, model, mb, n)), default=1.0)
    ax.set_ylim(0, top)
    for line in ax.lines:  # RSS marks above the bars' scale sit at the top, labelled
        (px,), (py,) = line.get_data()
        if py > top:
            line.set_ydata([top * 0.985])
            ax.annotate(f"↑{py:.0f}", (px, top * 0.985), ha="center", va="top", fontsize=5)
    ax.set(ylabel="bytes / parameter at the peak", title=f"{model}, micro-batch {mb} (hatched: first step; "
                                                           f"—: RSS)")
    ax.title.set_fontsize(8)
    ax.grid(alpha=0.3, axis="y")


def _budget_bars(ax, rows, prefix, metric, scale, ylabel, title):
    names = [r["variant"].split("/", 1)[1] for r in select(rows, metric) if r["variant"].startswith(prefix)]
    names = list(dict.fromkeys(names))
    budgets = sorted({r["x_value"] for r in select(rows, metric)})
    if not names:
        ax.set_axis_off()
        return
    width = 0.8 / max(len(budgets), 1)
    x = np.arange(len(names))
    for j, b in enumerate(budgets):
        vals = [value(rows, metric, f"{prefix}{n}", x_value=b) * scale for n in names]
        ax.bar(x + (j - (len(budgets) - 1) / 2) * width, vals, width, label=f"{b:g} GiB")
    ax.set_xticks(x, names, rotation=60, ha="right", fontsize=6)
    ax.set(ylabel=ylabel, title=title)
    ax.title.set_fontsize(8)
    ax.legend(fontsize=6, title="budget", title_fontsize=6)
    ax.grid(alpha=0.3, axis="y")


def _throughput(ax, rows):
    names = list(dict.fromkeys(r["variant"].split("/", 1)[1] for r in rows
                               if r["metric"].startswith("outcome_") and "/" in r["variant"]))
    if not names:
        ax.set_axis_off()
        return
    x = np.arange(len(names))
    bars = [("ddp", "equal"), ("ddp", "budget"), ("fsdp2", "equal"), ("fsdp2", "budget")]
    width = 0.8 / len(bars)
    for j, (strategy, kind) in enumerate(bars):
        vals = [value(rows, f"tokens_per_s_{kind}_micro_batch", f"{strategy}/{n}") for n in names]
        pos = x + (j - (len(bars) - 1) / 2) * width
        ax.bar(pos, [v if math.isfinite(v) else 0 for v in vals], width, label=f"{strategy}, {kind} micro-batch",
               color=colour("", j))
        agree = [value(rows, f"ranks_agree_{kind}_micro_batch", f"{strategy}/{n}") for n in names]
        for p, v, a in zip(pos, vals, agree):
            if not math.isfinite(v):
                ax.annotate("×", (p, 0), ha="center", va="bottom", fontsize=7, color="red")
            elif a == 0:
                ax.annotate("≠", (p, v), ha="center", va="bottom", fontsize=8, color="red")
    ax.set_xticks(x, names, rotation=60, ha="right", fontsize=6)
    ax.set(ylabel="tokens / s, 2 gloo ranks",
           title="GPT on 2 ranks (×: failed or killed; ≠: the DDP ranks' weights differ after the steps)")
    ax.title.set_fontsize(8)
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3, axis="y")


def draw(rows, out, config):
    import matplotlib.pyplot as plt

    models = []
    for model, mb in runs(rows):
        if model not in [m for m, _ in models]:
            models.append((model, mb))
    top = max(len(models), 3)
    fig, axes = plt.subplots(2, top, figsize=(5.2 * top, 10))
    for ax, (model, mb) in zip(axes[0], models):
        _stacked(ax, rows, model, mb)
    from matplotlib.patches import Patch

    axes[0][0].legend(handles=[Patch(color=PART_COLOURS[p], label=p) for p in PARTS]
                      + [Patch(facecolor="white", edgecolor="grey", hatch="//", label="first step")], fontsize=7)
    for ax in axes[0][len(models):]:
        ax.set_axis_off()
    _budget_bars(axes[1][0], rows, "model/", "largest_model_params", 1e-6, "parameters (millions)",
                 "largest MLP trained (3 steps) under the budget")
    _budget_bars(axes[1][1], rows, "micro_batch/", "largest_micro_batch", 1, "samples",
                 "largest GPT micro-batch under the budget")
    _throughput(axes[1][2], rows)
    for ax in axes[1][3:]:
        ax.set_axis_off()
    save_figure(fig, out, title="Peak memory of a training step on CPU (live tensor bytes split at the peak) "
                                "and what each optimizer trains in a memory budget")


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
