"""Figure and README section: the peak memory of a training step per optimizer.

    python analysis/gefen_peak_memory.py [--results-dir results] [--out paper_figs/gefen_peak_memory.png]

Reads ``gefen_peak_memory.csv``. Per model (at its first micro-batch), stacked bars of the live tensor
bytes at the peak of the step with the highest peak, split into weights, gradients, state and the
rest, per optimizer, the RSS above the process marked. The section gives every model and
micro-batch's numbers and judges two targets from the CSV (what fits a budget is
analysis/gefen_budgets.py's, throughput on two ranks analysis/gefen_distributed.py's):

(i) lowest peak: a Gefen's tensor peak at every step of every model and micro-batch is at most
every compared optimizer's at that step, and its first step's at most its later steps' highest plus
max(largest tensor, 0.25 B/param); (ii) the lean mode (8-bit factored, bf16 weights with stochastic
rounding, step in backward) peaks at <= 4.5 B/param at every step of every model (each at its first
micro-batch, as drawn). The claims table's row judges these targets and the largest micro-batch in
0.5 GiB (``claim_targets``; ``gefen_budgets.csv``, read beside this run).
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import math

import numpy as np

from analysis.common import Report, fmt, main, md_table, names_axis, save_figure, select, value

PARTS = ("weights", "gradients", "state", "rest")
PART_COLOURS = {"weights": "#4c72b0", "gradients": "#dd8452", "state": "#55a868", "rest": "#c44e52"}
LEAN = "Gefen-8bit-factored+bf16-sr+in-backward"
TARGET_LEAN_BPP = 4.5
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


def verdicts(rows):
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
    for m, b in drawn_runs(rows):
        if LEAN not in configs(rows, m, b):
            continue
        steps = per_step(rows, m, b, LEAN)
        top = max(steps.values())
        later = max([v for s, v in steps.items() if s > 0] or [math.nan])
        rss = max(per_step(rows, m, b, LEAN, "rss_total_per_param").values())
        adamw_rss = max(per_step(rows, m, b, "AdamW", "rss_total_per_param").values() or [math.nan])
        out.append(f"- (ii) lean mode on {m} (micro-batch {b}): tensor peak {top:.2f} B/param at its highest step "
                   f"(first step {steps.get(0, math.nan):.2f}, later steps {later:.2f}; target ≤ {TARGET_LEAN_BPP} at "
                   f"every step: **{'met' if top <= TARGET_LEAN_BPP else 'missed'}**); resident set {rss:.2f} B/param "
                   f"above the warmed process at its highest step (fused AdamW: {fmt(adamw_rss)}).")
    return out


# ------------------------------------------------------------------------------------------ figure
# the optimizers the figure draws (the results table lists every one)
FIGURE_SET = ["AdamW", "AdamW+bf16", "Adam-mini", "torchao-AdamW8bit", "gefen-x", "Gefen-8bit", "Gefen-8bit-factored", LEAN]


def label_of(name: str) -> str:
    return "Gefen lean mode" if name == LEAN else name


def optimizer_axis(ax, names):
    """Optimizer names down the y axis (``common.names_axis``), one colour per optimizer in every
    panel of the three figures, the lean mode by its name."""
    names_axis(ax, names, [label_of(n) for n in names], order=FIGURE_SET + GEFENS)


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
    optimizer_axis(ax, names)
    ax.set_xlabel("bytes / parameter at the step's peak", fontsize=8)
    ax.set_title(f"{model}, micro-batch {mb}", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(alpha=0.3, axis="x")


HEADLINE_RUN = ("mlp-50.4M", 8)  # the model and micro-batch the claims table quotes
BUDGETS = "gefen_budgets"  # the largest micro-batch in a memory budget, read beside this run
MB_BUDGET_GIB = 0.5  # the budget the claims table quotes


def drawn_runs(rows) -> list:
    """[(model, micro-batch)]: each model at its first micro-batch, as the figure draws them."""
    out = []
    for model, mb in runs(rows):
        if model not in [m for m, _ in out]:
            out.append((model, mb))
    return out


def lean_peaks(rows) -> list:
    """[(highest peak over the steps, model)] of the lean mode on each drawn run, highest first."""
    return sorted(((max(per_step(rows, m, b, LEAN).values()), m) for m, b in drawn_runs(rows)
                   if per_step(rows, m, b, LEAN)), reverse=True)


def micro_batches(budget_rows) -> dict:
    """{"lean", "AdamW": the largest micro-batch in ``MB_BUDGET_GIB``} from gefen_budgets.csv's rows ({}: none)."""
    out = {k: value(budget_rows or [], "largest_micro_batch", f"micro_batch/{n}", x_value=MB_BUDGET_GIB)
           for k, n in (("lean", LEAN), ("AdamW", "AdamW"))}
    return out if all(math.isfinite(v) for v in out.values()) else {}


def claim_targets(rows, budget_rows) -> list:
    """[(target in words, met, what was measured, by how much it is missed: "" where met)] of everything
    the claims row states: the lowest peak (8-bit on fp32 weights against the peers; the lean mode
    against every peer in every mode), the lean mode's ``TARGET_LEAN_BPP`` on every drawn run, a larger
    micro-batch than AdamW's in ``MB_BUDGET_GIB``."""
    everyone = [c for c in configs(rows) if not c.startswith("Gefen")]
    out = []
    for name, words, against in (("Gefen-8bit", "8-bit lowest peak", PEERS), (LEAN, "lean mode lowest peak", everyone)):
        met, worst, where = lowest_peak(rows, name, against)
        out.append((words, met, f"largest excess over the lowest peer {worst:+.2f} B/param, {where}",
                    "" if met else f"by {worst:.2f} B/param"))
    top, where = lean_peaks(rows)[0]
    out.append((f"lean mode ≤ {TARGET_LEAN_BPP:g} B/param", top <= TARGET_LEAN_BPP, f"highest {top:.2f} on {where}",
                "" if top <= TARGET_LEAN_BPP else f"by {top - TARGET_LEAN_BPP:.2f} ({top:.2f} on {where})"))
    mb = micro_batches(budget_rows)
    larger = bool(mb) and mb["lean"] > mb["AdamW"]
    fits = f"lean {mb.get('lean', math.nan):g}, AdamW {mb.get('AdamW', math.nan):g}"
    out.append((f"larger micro-batch in {MB_BUDGET_GIB:g} GiB", larger, fits, "" if larger else f"({fits})"))
    return out


def finding(rows, budget_rows=None):
    """The figure's title: the claims table's peaks (the published 8-bit, lean mode at its last and
    first step, fused AdamW, on ``HEADLINE_RUN``), then the lean mode's highest peak of every run
    drawn against its target and the largest micro-batch in ``MB_BUDGET_GIB`` (``budget_rows``)."""
    model, mb = HEADLINE_RUN
    at = {n: per_step(rows, model, mb, n) for n in ("Gefen-8bit", LEAN, "AdamW")}
    if not lean_peaks(rows):
        return "Peak memory of a training step"
    top, where = lean_peaks(rows)[0]
    lean_target = (f"lean mode's highest peak {top:.2f} B/param ({where}), "
                   f"{'within' if top <= TARGET_LEAN_BPP else 'over'} its {TARGET_LEAN_BPP:g} target")
    fits = micro_batches(budget_rows)
    if fits:
        lean_target += f"; micro-batch in {MB_BUDGET_GIB:g} GiB: lean {fits['lean']:g}, AdamW {fits['AdamW']:g}"
    if not all(at.values()):
        return lean_target
    last = {n: steps[max(steps)] for n, steps in at.items()}
    return (f"Peak 8-bit {last['Gefen-8bit']:.1f}, lean mode {last[LEAN]:.1f} (its first step "
            f"{at[LEAN][min(at[LEAN])]:.1f}), fused AdamW {last['AdamW']:.1f} B/param ({model.removeprefix('mlp-')} "
            f"MLP, micro-batch {mb}); {lean_target}")


def draw(rows, out, config):
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    from analysis.common import finding_title, new_figure

    models = drawn_runs(rows)
    top = max(len(models), 3)
    fig, axes = new_figure(1, top, width=5.0 * top, height=4.6)
    for ax, (model, mb) in zip(axes[0], models):
        _stacked(ax, rows, model, mb)
    for ax in axes[0][len(models):]:
        ax.set_axis_off()
    handles = [Patch(color=PART_COLOURS[p], label=p) for p in PARTS] + [
        Line2D([], [], marker="|", color="black", linestyle="none", markersize=9, label="resident set (RSS)"),
        Line2D([], [], color="#2ca02c", linestyle="--", label=f"lean mode's target, {TARGET_LEAN_BPP:g} B/param")]
    axes[0][1].legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=6, fontsize=7,
                      frameon=False)
    budget_rows = (config.get("other_rows") or {}).get(BUDGETS)
    save_figure(fig, out, title=finding_title(finding(rows, budget_rows), "Live tensor bytes at the peak of a CPU training step "
                                              "(the highest of its steps); every optimizer is in the results "
                                              "table", fig))


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


def split_from(config) -> str:
    """A sentence naming the run these results were split from ("" for a run of their own)."""
    src = config.get("split_from")
    if not src:
        return ""
    return (f"These rows are the {src['part']} of one run of `{src['experiment']}` ({src['timestamp']}), split from "
            f"its CSV when that experiment became three; the wall time is that whole run's. ")


def body(rows, config):
    c = config.get("config", {})
    text = [split_from(config) + f"Live tensor bytes at the peak of forward + backward + step + `zero_grad(set_to_none=True)` "
            f"(experiments/peak.PeakMemory: what `torch.cuda.max_memory_allocated` counts on a GPU), per parameter, "
            f"split at the peak; step 0 is the first, the later column the highest of steps 1-{c.get('steps', 4) - 1}. "
            "RSS: the resident set at the step's peak above the process before the model was built (after a warm-up "
            "on a tiny model that compiles what each optimizer compiles). Each optimizer in a fresh process, one "
            f"torch thread. `+bf16`: pure bf16 weights and state (AdamW); `+bf16-sr`: bf16 weights with stochastic "
            f"rounding (ours); `+in-backward`: `optim.step_in_backward`. Lean mode: **{LEAN}**."]
    for model, mb in runs(rows):
        text.append(f"`{model}`, micro-batch {mb}:\n\n" + _peak_table(rows, model, mb))
    notes = c.get("notes") or []
    if notes:
        text.append("Notes from the run:\n\n" + "\n".join(f"- {n}" for n in notes))
    text.append("Verdicts:\n\n" + "\n".join(verdicts(rows)))
    return "\n\n".join(text)


REPORT = Report("gefen_peak_memory", "gefen_peak_memory", "Gefen: the peak memory of a training step",
                body, draw, metrics=("tensor_peak_per_param",), reads=(BUDGETS,))

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
