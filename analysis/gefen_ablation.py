"""Every Gefen ablation in one table and one figure: its page of the results book.

    python analysis/gefen_ablation.py [--results-dir results] [--out paper_figs/gefen_ablation.png]

Reads each ablation's CSV (``<name>.csv`` of experiments/gefen_ablation.py's ``ABLATIONS``, the ones in
the results folder): per variant and seed ``val_loss_vs_adamw``, the final validation loss over AdamW's
of the same seed, and ``state_bytes_per_param`` where the runs recorded it; else ``gefen_memory.csv``
for the state bytes of the variants that are a named layout. The summary table has one row a variant of
each model of each ablation: its median ratio over seeds, the paired change against the ablation's
reference (``none``, the published Gefen, where it ran, else ``factored``) per seed, mean ± standard
error, and its state bytes per parameter. The figure: where the published Gefen's gap comes from (v per
element on one kind of tensor, each seed a dot), every change on top of the factor as its paired
change, 8-bit and 4-bit codes, and the frontier: every variant whose state bytes are known, its bytes
against its loss, beside the byte cap and the loss target.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import itertools
import math
import statistics
from typing import NamedTuple

from analysis.common import (Report, colour_of, configurations, finding_title, in_configuration, figure_legend,
                             label_of, main, md_table, new_figure, save_figure, select, variants)
from experiments.gefen_ablation import (ABLATIONS, CHANGES, COMPACT_VARIANT, DROPIN_LR, FACTORED, PEERS, REFRESH_EVERY,
                                        variant_layout)
from optim.gefen.layout import LAYOUTS

METRIC = "val_loss_vs_adamw"
MEMORY = "gefen_memory"  # the state bytes of the named layouts, per model
FIRST = "gefen_ablation"  # the ablation whose rows this report's setup line describes; the others are read beside it
# the kinds of tensor and changes, as words
KIND_WORDS = {"none": "Gefen as published", "all": "v per element on every tensor", "factored": "the factored layout",
              "embedding": "the embeddings", "lm_head": "the output head", "attn_qkv": "the attention input matrices",
              "attn_out": "the attention output matrices", "mlp_in": "the MLP input matrices",
              "mlp_out": "the MLP output matrices", "vectors": "the vectors (norm gains, biases)"}
CHANGE_WORDS = {"fp32_m": "the first moment in fp32", "sr_m": "the first moment's codes rounded stochastically",
                "vec_v": "the vectors' v shared", "rows_v": "v over whole rows where the rule finds no block",
                "scale_rows": "one m scale per group of rows (≤ 2,048 elements)",
                "whole_w": "one column factor a matrix",
                "layout": "the compact layout's four options as first measured (one fp32 column factor a matrix)",
                "refresh": f"the codebook learned again every {REFRESH_EVERY} steps", "w16": "the column factors in bf16",
                "bound": "each element's m^ clipped to AdamW's bound on |m| / sqrt(v)"}
TARGET = {8: 1.003, 4: 1.006}  # the factored layout's loss targets by code width (the claims')
BYTE_CAP = {8: 1.06, 4: 0.56}  # state B/param at Gefen-X's bytes (width >= 128), by code width
MARKERS = "osD^v<>Px*"  # one a model in the frontier


def words(variant: str) -> str:
    """A variant name in words: ``factored+attn_qkv`` -> "the factored layout, v per element on the
    attention input matrices"."""
    if variant in PEERS:
        return f"{variant} (a peer, same lr)"
    own = variant.removeprefix(f"{FACTORED}+")
    head = "the factored layout, " if own != variant else ""
    if own in KIND_WORDS and own not in ("none", "all", FACTORED):
        return head + "v per element on " + KIND_WORDS[own]
    return head + (KIND_WORDS.get(own) or CHANGE_WORDS.get(own) or f"`{own}`")


def ablation_rows(rows, config) -> dict:
    """{ablation name: its rows} of every ablation in the results folder, this report's first."""
    other = config.get("other_rows") or {}
    return {FIRST: rows, **{name: other[name] for name in ABLATIONS if name != FIRST and name in other}}


def ratios(rows, prefix) -> dict:
    """{variant (without ``prefix``): {seed: ratio}} of one configuration, in the order the run wrote them."""
    out = {}
    for v in variants(rows, METRIC):
        if in_configuration(v, prefix) and not v.endswith("AdamW"):
            out[v.removeprefix(prefix)] = {r["seed"]: r["value"] for r in select(rows, METRIC, v)}
    return out


def reference(data: dict) -> str | None:
    """The variant the paired changes are taken against: ``none`` where it ran, else ``factored``."""
    return next((v for v in ("none", FACTORED) if v in data), None)


def paired_diffs(data: dict, variant: str, ref: str) -> list:
    """``variant``'s ratio minus ``ref``'s, seed by seed (the seeds both ran); [] for the reference itself."""
    if ref is None or variant == ref:
        return []
    return [r - data[ref][s] for s, r in data[variant].items() if s in data[ref]]


def paired(data: dict, variant: str, ref: str):
    """(mean, standard error) over seeds of ``variant``'s ratio minus ``ref``'s, or None."""
    diffs = paired_diffs(data, variant, ref)
    if not diffs:
        return None
    return statistics.fmean(diffs), (statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan)


def registry_name(variant: str, bits: int) -> str | None:
    """The registry name of a variant that is a named layout on every tensor (or a peer), else None;
    with or without the first-moment bound (it holds no state: the named layout's bytes and colour)."""
    if variant in PEERS:
        return variant
    own = variant.removeprefix(f"{FACTORED}+")
    if own not in ("none", FACTORED) and own not in CHANGES:
        return None  # a kind of tensor with v per element: no named layout
    layout = variant_layout(variant, bits).replace(bound_first_moment=False)
    for name, by_bits in LAYOUTS.items():
        if name != "adamw" and by_bits[bits].replace(bound_first_moment=False) == layout:
            return f"Gefen-{bits}bit" + ("" if name == "published" else f"-{name}")
    return None


def bytes_per_param(memory_rows, label: str, name: str | None) -> float:
    """State bytes per parameter of registry ``name`` on model ``label`` from gefen_memory.csv's bytes by
    kind of tensor (weighted by the kinds' parameters, as its section's table); NaN where it holds none."""
    if not memory_rows or name is None:
        return math.nan
    per = {r["x_value"]: r["value"] for r in select(memory_rows, "state_bytes_per_param_of_kind", f"{label}/{name}")}
    counts = {r["x_value"]: r["value"] for r in select(memory_rows, "params_of_kind", f"{label}/{name}")}
    total = sum(counts.values())
    if "shared" not in per or not total:
        return math.nan
    return per["shared"] + sum(per[k] * n for k, n in counts.items() if k in per and k != "shared") / total


def configurations_of(rows) -> list:
    """[(prefix, label, steps, seeds)] of one ablation's CSV, in its order."""
    out = []
    for prefix in configurations(rows, METRIC):
        data = ratios(rows, prefix)
        if not data:
            continue
        r0 = select(rows, METRIC, prefix + next(iter(data)))[0]
        label = prefix.rstrip("/") or None
        out.append((prefix, label, int(float(r0["x_value"])), max(len(s) for s in data.values())))
    return out


class SummaryRow(NamedTuple):
    """One row of the summary: a variant of one model of one ablation."""

    ablation: str
    variant: str
    model: str  # the configuration's model label
    steps: int
    seeds: int
    median: float  # median over seeds of the loss ratio to AdamW's
    change: tuple | None  # (mean, standard error) of the paired change against the reference; None for it
    bytes: float  # state B/param: the median of the runs' own, else a named layout's (gefen_memory), else NaN


def summary(rows, config) -> list:
    """The summary's rows (``SummaryRow``), every ablation in ``ABLATIONS`` order."""
    return summarise(ablation_rows(rows, config), (config.get("other_rows") or {}).get(MEMORY), config)


def summarise(by_name: dict, memory_rows, config) -> list:
    """``SummaryRow``s of the ablations ``by_name`` ({ablation name: its rows}) in that order; B/param from
    ``memory_rows`` (gefen_memory.csv's, or None); ``config`` the first ablation's run config (its model label)."""
    out = []
    for name, arows in by_name.items():
        first_label = _first_label(name, config)
        for prefix, label, steps, n in configurations_of(arows):
            label = label or first_label
            data = ratios(arows, prefix)
            ref = reference(data)
            for v, seeds in data.items():
                own = [r["value"] for r in select(arows, "state_bytes_per_param", prefix + v)]
                b = (statistics.median(own) if own
                     else bytes_per_param(memory_rows, label, registry_name(v, ABLATIONS[name].bits)))
                out.append(SummaryRow(name, v, label, steps, n, statistics.median(seeds.values()), paired(data, v, ref),
                                      b))
    return out


def _first_label(name, config):
    """The label of an ablation's first (unprefixed) configuration: this run's config for the first
    ablation, else the model of the ablation's first size."""
    from experiments.harness.train import CHAR_LM, char_lm_label

    if name == FIRST and (config.get("config") or {}).get("label"):
        return config["config"]["label"]
    return char_lm_label(CHAR_LM[ABLATIONS[name].sizes[0]])


def _change(p) -> str:
    if p is None:
        return "—"
    mean, se = p
    return f"{mean * 100:+.2f} ± {se * 100:.2f}".replace("-", "−") if math.isfinite(se) else f"{mean * 100:+.2f}"


def _loss(ratio) -> str:
    """A loss ratio to AdamW's as a signed percentage: "+0.61%"."""
    return f"{(ratio - 1) * 100:+.2f}%".replace("-", "−")


def sentence(rows) -> str:
    """One ablation's ``SummaryRow``s as a sentence: its question, code width and lr, then per model its
    steps, seeds and reference, each variant's loss over AdamW's and, in brackets, its paired change
    (points) and its B/param where it is a named layout."""
    a = ABLATIONS[rows[0].ablation]
    lr = f"lr {a.lr:g}" if a.lr is not None else "AdamW's best lr of each model"
    parts = []
    for (model, steps, seeds), group in itertools.groupby(rows, lambda s: (s.model, s.steps, s.seeds)):
        group = list(group)
        parts.append(f"{model} at {steps:,} steps, {seeds} seeds, against `{reference({s.variant: s for s in group})}`: "
                     + ", ".join(map(_variant_text, group)))
    return f"`{a.name}` ({a.question}; {a.bits}-bit codes, {lr}) on " + "; on ".join(parts) + "."


def _variant_text(s) -> str:
    """"`factored+layout` +0.61% (+0.24 ± 0.10; 1.049 B/param)" of one ``SummaryRow``."""
    extra = [_change(s.change)] if s.change is not None else []
    extra += [f"{s.bytes:.3f} B/param"] if math.isfinite(s.bytes) else []
    return f"`{s.variant}` {_loss(s.median)}" + (f" ({'; '.join(extra)})" if extra else "")


def body(rows, config):
    """The page: what the ablations ask, the variant names, the summary table."""
    table = summary(rows, config)
    shown = list(dict.fromkeys(t[0] for t in table))
    text = ["Each ablation is one row of `ABLATIONS` in experiments/gefen_ablation.py, run by "
            "`python experiments/gefen_ablation.py --ablation NAME` into `results/NAME.csv`; every ablation trains "
            "AdamW beside its variants on the same seeds, initialisations and batches, so each ratio is paired by seed. "
            "A variant is one Gefen layout record (`GefenLayout`) on every tensor; a kind of tensor also keeps its own "
            "tensors' v per element (block length 1).",
            "The ablations (the commit each CSV was run at):",
            "\n".join(f"- `{n}`: {ABLATIONS[n].question} ({ABLATIONS[n].bits}-bit codes; commit "
                      f"`{ablation_rows(rows, config)[n][0]['git_commit']}`)." for n in shown),
            "Variant names: `none` is Gefen as published, `factored` the factored layout without the first-moment "
            "bound (as every run before it measured it; `layout=\"factored\"` is `factored+bound`), `factored+X` X "
            "on top of it; "
            "a kind of tensor (`embedding`, `lm_head`, `attn_qkv`, `attn_out`, `mlp_in`, `mlp_out`, `vectors`, "
            "`all`) keeps v per element on those tensors; a change replaces layout fields on every tensor: "
            + "; ".join(f"`{k}` {w}" for k, w in CHANGE_WORDS.items())
            + "; `scale_rowsN` / `layoutN` the same with row groups of at most N elements; `_no_X` the layout without "
              "option X; `_tiles` a column factor per square tile; `_w16` in bf16; `_bound` with the bound. "
              "`layout=\"compact\"` is "
            + " and ".join(f"`{v}_bound` at {bits} bits" for bits, v in COMPACT_VARIANT.items()) + ".",
            "Columns: *loss / AdamW* is the median over seeds of the final validation loss over AdamW's, as a "
            "percentage above it; *paired change* is the variant's ratio minus the reference's (`none` where the "
            "ablation ran it, else `factored`) per seed, mean ± standard error, in percentage points; *B/param* is "
            "the state bytes per parameter: the median of the runs' own where they recorded them, else a named "
            f"layout's from `{MEMORY}.csv` (— where neither is known).",
            "The figure's last panels are the frontier: every (variant, model, steps, seeds) whose bytes are known, "
            "its bytes against its loss over AdamW's (the median over seeds), beside the byte cap (Gefen-X's bytes "
            f"at width ≥ 128: {BYTE_CAP[8]} B/param at 8 bits, {BYTE_CAP[4]} at 4) and the loss target "
            f"({TARGET[8] - 1:+.1%} / {TARGET[4] - 1:+.1%}); a layout that meets both lies in the lower left box.",
            md_table(["ablation", "variant", "model", "steps", "seeds", "loss / AdamW", "paired change", "B/param"],
                     [[n.removeprefix("gefen_ablation_") if n != FIRST else "(gap)", f"`{v}`", label, f"{steps:,}",
                       seeds, _loss(med), _change(p),
                       "—" if not math.isfinite(b) else f"{b:.3f}"]
                      for n, v, label, steps, seeds, med, p, b in table])]
    return "\n\n".join(text)


# ------------------------------------------------------------------------------------------- figure
def colour(variant: str, bits: int) -> str:
    """A variant's colour: its named layout's (``registry_name``), else the layout it changes (the
    published or the factored Gefen at ``bits``)."""
    name = registry_name(variant, bits)
    if name is None or name in PEERS:
        name = f"Gefen-{bits}bit" + ("-factored" if variant.startswith(FACTORED) else "")
    return colour_of(name)


def changes_on_factor(rows, config) -> dict:
    """{bits: [(label, (mean, s.e.), colour)]}: each change on the factored layout of every ablation
    but the first, paired with the factored layout by seed; a (change, model, steps) that several
    ablations ran on the same seeds is shown once, from the first; an lr other than the drop-in
    protocol's is named."""
    out = {8: {}, 4: {}}
    for name, arows in ablation_rows(rows, config).items():
        a = ABLATIONS[name]
        bits, lr = a.bits, a.lr
        at = f", lr {lr:g}" if lr is not None and any(lr != DROPIN_LR[s] for s in a.sizes) else ""
        for prefix, label, steps, _ in configurations_of(arows) if name != FIRST else ():
            data = ratios(arows, prefix)
            for v in data:
                p = paired(data, v, FACTORED if FACTORED in data else None)
                if p is not None and v not in PEERS and v.startswith(f"{FACTORED}+"):
                    model = (label or _first_label(name, config)).removeprefix("char-")
                    out[bits].setdefault(f"{v.removeprefix('factored+')} ({model}, {steps:,}{at})", (p, colour(v, bits)))
    return {b: [(k, p, c) for k, (p, c) in items.items()] for b, items in out.items()}


def frontier(table) -> dict:
    """{bits: [(variant, model, steps, seeds, B/param, median ratio)]}: every summary row whose bytes
    are known, once per (variant, model, steps, seeds) (the first ablation that ran it), by code width."""
    out, seen = {8: [], 4: []}, set()
    for t in table:
        bits = 4 if t.variant.startswith("Gefen-4bit") else 8 if t.variant in PEERS else ABLATIONS[t.ablation].bits
        key = (bits, t.variant, t.model, t.steps, t.seeds)
        if math.isfinite(t.bytes) and key not in seen:
            seen.add(key)
            out[bits].append((t.variant, t.model, t.steps, t.seeds, t.bytes, t.median))
    return out


def draw(rows, out, config):
    """Top: each configuration of the first ablation, every seed's ratio per variant (dots) and their
    median (a bar); below: each change on the factor as its paired change, mean ± s.e., by code width;
    last: the frontier of bytes against loss, by code width."""
    firsts = [(p, ratios(rows, p)) for p in configurations(rows, METRIC)]
    firsts = [(p, d) for p, d in firsts if d]
    on_factor = changes_on_factor(rows, config)
    fronts = frontier(summary(rows, config))
    panels = ([("gap", p, d) for p, d in firsts] + [("factor", b, on_factor[b]) for b in (8, 4) if on_factor[b]]
              + [("frontier", b, fronts[b]) for b in (8, 4) if fronts[b]])
    heights = [4.0 if kind == "frontier" else 0.2 * len(d) + 1.3 for kind, _, d in panels]
    fig, axes = new_figure(len(panels), 1, width=8, height=sum(heights) + 1.1,
                           gridspec_kw={"height_ratios": heights})
    for ax, (kind, key, data) in zip(axes[:, 0], panels):
        if kind == "gap":
            _draw_gap(ax, data, key.rstrip("/") or _first_label(FIRST, config))
        elif kind == "frontier":
            _draw_frontier(ax, data, key, list(dict.fromkeys(p[1] for b in (8, 4) for p in fronts[b])))
        else:
            _draw_changes(ax, data, key)
    _legend(fig, {b for _, b, _ in panels if isinstance(b, int)})
    finding = _finding(firsts, on_factor)
    save_figure(fig, out, finding_title(finding, "Gefen ablations: loss against AdamW's, paired by seed", fig))


def _legend(fig, widths):
    """One legend below every panel: the layouts' colours (the published Gefen, ours at each code
    width shown) and what a dot is."""
    from matplotlib.lines import Line2D

    names = ["Gefen-8bit", *(f"Gefen-{b}bit-{k}" for b in sorted(widths, reverse=True) for k in ("factored", "compact")),
             "gefen-x"]
    handles = [Line2D([], [], color=colour_of(n), marker="s", ls="none", ms=5, label=label_of(n)) for n in names]
    handles.append(Line2D([], [], color="black", alpha=0.6, marker="o", ls="none", ms=3, label="one seed"))
    figure_legend(fig, handles, [h.get_label() for h in handles], ncols=3)


def _finding(firsts, on_factor):
    """The title: what v per element everywhere leaves, and the largest change on the factor."""
    parts = []
    if firsts and "none" in firsts[0][1] and "all" in firsts[0][1]:
        d = firsts[0][1]
        parts.append(f"published {statistics.median(d['none'].values()) - 1:+.2%}, v per element everywhere "
                     f"{statistics.median(d['all'].values()) - 1:+.2%}")
    changes = [c for items in on_factor.values() for c in items]
    if changes:
        worst = max(changes, key=lambda c: c[1][0])
        parts.append(f"largest change on the factor: {worst[0]} {worst[1][0] * 100:+.2f} points")
    return "; ".join(parts) or "Gefen ablations"


def _draw_gap(ax, data, label):
    """Per variant its seeds' ratios (dots) and their median (a bar in its layout's colour), the 1× line."""
    names = list(data)
    seeds = [(x, k) for k, n in enumerate(names) for x in data[n].values()]
    ax.scatter(*zip(*seeds), s=10, color="black", alpha=0.6, linewidths=0, zorder=3)
    ax.scatter([statistics.median(data[n].values()) for n in names], range(len(names)), marker="|", s=200,
               linewidths=2.2, zorder=4, color=[colour(n, 8) for n in names])
    ax.axvline(1.0, color="k", lw=1)
    ax.set_yticks(range(len(names)), [words(n) for n in names], fontsize=6)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlabel("final validation loss / AdamW's (black line: AdamW)", fontsize=8)
    ax.set_title(f"where the gap comes from ({label.removeprefix('char-')}): seeds and their median", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(alpha=0.3, axis="x")


def _draw_changes(ax, items, bits):
    """Each change on the factor: its paired change (mean ± s.e.) in points, in its layout's colour;
    the target's margin dashed."""
    labels = [n for n, _, _ in items]
    means = [p[0] * 100 for _, p, _ in items]
    errs = [p[1] * 100 if math.isfinite(p[1]) else 0 for _, p, _ in items]
    ax.errorbar(means, range(len(items)), xerr=errs, fmt="none", ecolor="0.4", elinewidth=1, capsize=2)
    ax.scatter(means, range(len(items)), s=14, zorder=3, color=[c for _, _, c in items])
    ax.axvline(0.0, color="k", lw=1)
    ax.axvline((TARGET[bits] - 1) * 100, color="tab:green", ls="--", lw=1.2)
    ax.set_yticks(range(len(items)), labels, fontsize=6)
    ax.set_ylim(len(items) - 0.5, -0.5)
    ax.set_xlabel("paired change against the factored layout (percentage points; mean ± s.e.)", fontsize=8)
    ax.set_title(f"{bits}-bit codes: change (model, steps) on the factor; dashed: target {TARGET[bits] - 1:+.1%}",
                 fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(alpha=0.3, axis="x")


def _draw_frontier(ax, points, bits, models):
    """Bytes against loss: a point per (variant, model, steps, seeds) in its layout's colour, a marker a
    model (its place in ``models``), hollow at more than 1,000 steps (a peer in its own colour); the byte
    cap and the loss target dashed. The points are named in the page's table (its B/param and loss columns)."""
    from matplotlib.lines import Line2D

    handles = []
    for k, m in enumerate(models):
        mine = [p for p in points if p[1] == m]
        if not mine:
            continue
        handles.append(Line2D([], [], color="0.4", marker=MARKERS[k % len(MARKERS)], ls="none", ms=4,
                              label=m.removeprefix("char-")))
        colours = [colour_of(v) if v in PEERS else colour(v, bits) for v, *_ in mine]
        ax.scatter([p[4] for p in mine], [(p[5] - 1) * 100 for p in mine], s=22, marker=MARKERS[k % len(MARKERS)],
                   zorder=3, edgecolors=colours, linewidths=1,
                   facecolors=[("none" if p[2] > 1000 else c) for p, c in zip(mine, colours)])
    ax.axvline(BYTE_CAP[bits], color="tab:red", ls="--", lw=1)
    ax.axhline((TARGET[bits] - 1) * 100, color="tab:green", ls="--", lw=1.2)
    ax.axhline(0.0, color="k", lw=1)
    ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="model\n(hollow: > 1,000\nsteps)",
              title_fontsize=6)
    ax.set_xlabel("optimizer state, bytes per parameter", fontsize=8)
    ax.set_ylabel("loss / AdamW's − 1 (%, median)", fontsize=7)
    ax.set_title(f"{bits}-bit codes: the frontier (dashed: cap {BYTE_CAP[bits]} B/param, target "
                 f"{TARGET[bits] - 1:+.1%})", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)


REPORT = Report(FIRST, FIRST, "Gefen ablations: which part of the state carries the loss", body, draw,
                metrics=(METRIC,), reads=(*(n for n in ABLATIONS if n != FIRST), MEMORY))

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
