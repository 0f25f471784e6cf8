"""Figure and README section: Gefen's loss relative to AdamW's with a per-element v on one kind of tensor.

    python analysis/gefen_ablation.py [--results-dir results] [--out paper_figs/gefen_ablation.png]

Reads ``gefen_ablation.csv``: per variant (which tensors keep v per element; ``none`` is Gefen as
published) and seed, ``val_loss_vs_adamw``, the final validation loss over AdamW's of the same seed;
variants ``<label>/<name>`` belong to a further configuration. Figure: per configuration one
horizontal bar per variant (on top of the factored second moment in orange), mean over seeds with
the standard deviation and every seed as a dot, the target dashed (3% for the published Gefen here;
analysis/gefen_ablation_arch.py: the factored 8-bit's +0.3%). Peers (gefen-x) are grey bars; ``fp32_m``
is the first moment in fp32 on every tensor. Section: the same means, deviations and medians.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    import _install_check  # noqa: F401

import functools
import math
import statistics

from analysis.common import (CORPUS_TEXT, Report, configurations, fmt, in_configuration, main, md_table, mean_std, pm, save_figure,
                             select, variants)
from experiments.gefen_ablation import REFRESH_EVERY

# variants that change an option on every tensor (experiments/gefen_ablation.py's CHANGES), as words
CHANGES = {"fp32_m": "the first moment in fp32", "sr_m": "the first moment's codes rounded stochastically",
           "vec_v": "the vectors' v shared (the published rule's blocks, else one a vector)",
           "rows_v": "v over whole rows where the rule finds no block",
           "scale_rows": "one first-moment scale per group of rows",
           "whole_w": "one column factor per matrix",
           "layout": "the vectors' v shared, whole-row v, row-group scales and one column factor per matrix",
           "scale_rows512": "one first-moment scale per group of rows of at most 512 elements",
           "layout512": "the four layout options with scale groups of at most 512 elements",
           "refresh": f"the codebook learned again every {REFRESH_EVERY} steps",
           "layout_refresh": f"the four layout options and the codebook learned again every {REFRESH_EVERY} steps",
           "layout512_refresh": "the four layout options with scale groups of at most 512 elements and the codebook "
                                f"learned again every {REFRESH_EVERY} steps",
           "w16": "the column factors in bf16, rounded stochastically",
           "layout512_tiles": "the 512-element layout, a column factor per tile",
           "layout512_w16": "the 512-element layout, a bf16 column factor per tile",
           "scale_rows256": "one first-moment scale per group of rows of at most 256 elements",
           "layout256": "the four layout options with scale groups of at most 256 elements",
           "layout256_w16": "the 256-element layout, its column factor in bf16",
           **{f"layout512_no_{k}": f"the 512-element layout without {w}"
              for k, w in (("vec_v", "the vectors' shared v"), ("rows_v", "whole-row v"),
                           ("scale_rows", "row-group scales (one scale a row)"),
                           ("whole_w", "one column factor a matrix (one a tile)"))}}
# optimizers trained beside AdamW as they are (registry names), not variants
PEER_LABELS = {"gefen-x": "(peer) gefen-x 0.5.0 at its defaults, same lr",
               "Gefen-4bit-factored": "(beside) Gefen-4bit-factored, same lr"}
LABELS = {"none": "nothing (Gefen as published)", "all": "every tensor", "embedding": "the embeddings",
          "vectors": "the vectors (norm gains, biases)",
          "factored": "nothing, the second moment factored",
          **PEER_LABELS,
          **{k: f"nothing, {text}" for k, text in CHANGES.items()}}
NOT_KINDS = ("none", "all", "factored", *PEER_LABELS, *CHANGES)  # variants that are no kind of tensor
TARGET = 1.03
ARCH_TEXT = {"gpt": "character GPT", "encoder": "character LM of PyTorch's pre-norm `nn.TransformerEncoderLayer`",
             "llama": "Llama-style character LM"}


def collect(rows, prefix=""):
    """{variant: (mean, std, [per-seed ratios])} of one configuration (names without its prefix), in
    the order the experiment ran them."""
    out = {}
    for v in variants(rows, "val_loss_vs_adamw"):
        if in_configuration(v, prefix):
            seeds = [r["value"] for r in select(rows, "val_loss_vs_adamw", v)]
            out[v.removeprefix(prefix)] = (*mean_std(seeds), seeds)
    return out


def _label(name: str) -> str:
    base, plus, own = name.rpartition("+")
    if plus and own in CHANGES:
        return f"factored, and {CHANGES[own]}"
    if plus:
        return f"factored, and per element on {LABELS.get(own, f'`{own}`')}"
    return LABELS.get(name, f"`{name}`")


def draw(rows, out, config, target=TARGET, title="Gefen 8-bit: v per element on one kind of tensor"):
    from analysis.common import finding_title, legend_below, new_figure

    prefixes = configurations(rows, "val_loss_vs_adamw")
    data = [collect(rows, p) for p in prefixes]
    heights = [0.26 * len(d) + 1.3 for d in data]
    fig, axes = new_figure(len(prefixes), 1, width=8, height=sum(heights) + 0.9,
                           gridspec_kw={"height_ratios": heights})
    for ax, prefix, d in zip(axes[:, 0], prefixes, data):
        _draw_one(ax, d, prefix.rstrip("/") or _main_label(config), target)
    legend_below(axes[-1, 0], ncols=4)
    save_figure(fig, out, finding_title(_figure_finding(data, prefixes, config), title + "; rows as the table's", fig))


def _figure_finding(data, prefixes, config):
    """The title: the variant nearest AdamW's loss in each configuration (mean ratio)."""
    parts = []
    for prefix, d in zip(prefixes, data):
        kinds = {n: v[0] for n, v in d.items() if n not in PEER_LABELS and math.isfinite(v[0])}
        if kinds:
            best = min(kinds, key=kinds.get)
            parts.append(f"{prefix.rstrip('/') or _main_label(config)}: nearest AdamW's loss with "
                         f"{_label(best).replace('`', '')} ({(kinds[best] - 1):+.2%})")
    return "; ".join(parts) or "Gefen: the loss relative to AdamW's per variant"


def _color(name):
    """Grey for a peer, orange on top of the factor, blue on the published Gefen."""
    return "tab:gray" if name in PEER_LABELS else "tab:orange" if name.startswith("factored") else "tab:blue"


def _draw_one(ax, data, label, target=TARGET):
    """A dot plot: per variant its seeds' ratios to AdamW's (dots) and their mean (a bar), the 1× and
    target lines."""
    names = list(data)
    means = [data[n][0] for n in names]
    seeds = [(x, k) for k, n in enumerate(names) for x in data[n][2]]
    ax.scatter([x for x, _ in seeds], [k for _, k in seeds], s=10, color="black", alpha=0.6, linewidths=0, zorder=3,
               label="seeds")
    ax.scatter(means, range(len(names)), marker="|", s=200, linewidths=2.2, c=[_color(n) for n in names], zorder=4,
               label="mean (blue: on Gefen, orange: on the factored)")
    ax.axvline(1.0, color="k", lw=1, label="AdamW")
    ax.axvline(target, color="tab:green", ls="--", lw=1.2, label=f"{target - 1:+.1%} target")
    ax.set_yticks(range(len(names)), [_label(n).replace("`", "") for n in names], fontsize=7)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlabel("final validation loss / AdamW's (paired by seed)", fontsize=8)
    ax.set_title(label, fontsize=9)
    xs = [x for x, _ in seeds]
    ax.set_xlim(min(0.99, min(xs) - 0.005), max(target + 0.005, max(xs)) + 0.005)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(alpha=0.3, axis="x")


def _main_label(config):
    c = config.get("config", {})
    return c.get("label") or f"character model, {c.get('steps', '?')} steps"


def body(rows, config, center="mean"):
    """The section: per configuration its setup, the table, and ``_finding`` on the ``center``
    ("mean" or "median") of the per-seed ratios."""
    c = config.get("config", {})
    text = ["Each variant gives a per-element v (block length 1) to one kind of tensor, through a parameter "
            "group with `share_second_moment=False`; names pick the tensors for this ablation only. `factored` "
            "is `factor_second_moment=True` on every tensor; `factored, and per element on X` gives X a "
            "per-element v and factors the rest. Vectors (norm gains, biases) already have block length 1 in "
            "the character GPT, and under the factor in every model."]
    names = {v.rpartition("/")[2] for v in variants(rows, "val_loss_vs_adamw")}
    if names & {"fp32_m", "factored+fp32_m"}:
        text[0] += (" `the first moment in fp32` keeps m uncompressed (`quantize_first_moment=False`) on every "
                    "tensor, v as the variant says.")
    peers = [p for p in PEER_LABELS if p in names]
    if peers:
        text[0] += f" {' and '.join(peers)} train{'s' if len(peers) == 1 else ''} at the same lr and seeds, as " + (
            "a peer." if len(peers) == 1 else "peers.")
    for prefix in configurations(rows, "val_loss_vs_adamw"):
        cc = (c.get("extra") or {}).get(prefix.rstrip("/"), {}) if prefix else c
        data = collect(rows, prefix)
        n_seeds = max(len(d[2]) for d in data.values())
        corpus = cc.get("corpus", "docs+code")
        text.append(f"**{prefix.rstrip('/') or _main_label(config)}**: {ARCH_TEXT[cc.get('arch', 'gpt')]} of "
                    f"{fmt(cc.get('params'))} parameters (n_embd {cc.get('model', {}).get('n_embd', '?')}) on "
                    f"{CORPUS_TEXT.get(corpus, corpus)}, {cc.get('steps', '?')} steps, {c.get('bits', 8)}-bit codes, "
                    f"lr {cc.get('lr') or c.get('lr', '?')}, {n_seeds} seed(s).")
        text.append(md_table(["v per element on", "loss / AdamW (mean ± std, paired by seed)", "median", "min .. max"],
                             [[_label(v), pm(m, s, 3), f"{statistics.median(x):.3f}", f"{min(x):.3f} .. {max(x):.3f}"]
                              for v, (m, s, x) in data.items()]))
        text.append(_finding({v: statistics.median(d[2]) if center == "median" else d[0] for v, d in data.items()},
                             center))
    return "\n\n".join(t for t in text if t)


def _finding(data, center="mean"):
    """What the figures say (``data``: {variant: the ``center`` of its ratios}): the gap, what
    per-element v everywhere leaves, what closes half of it, what the factor leaves."""
    if "none" not in data:
        return _factored_finding(data, center)
    gap = data["none"] - 1
    closes = [v for v, r in data.items() if v not in NOT_KINDS and "+" not in v and r - 1 < gap / 2]
    out = f"By the {center} over seeds, Gefen as published ends at {data['none']:.3f} of AdamW's loss"
    out += f", and {data['all']:.3f} with v per element everywhere." if "all" in data else "."
    if gap <= 0:
        out += " There is no gap to close here."
    elif any(v not in NOT_KINDS and "+" not in v for v in data):
        out += (f" Per-element v on {', '.join(_label(v) for v in closes)} alone closes at least half of the gap."
                if closes else " No single kind of tensor closes half of the gap.")
    if "factored" in data:
        out += f" The factored second moment leaves {data['factored'] - 1:+.2%}"
        on_top = {v.partition("+")[2]: r for v, r in data.items()
                  if v.startswith("factored+") and v.partition("+")[2] not in NOT_KINDS}
        if on_top:
            best = min(on_top, key=on_top.get)
            out += f"; with per-element v on top of it the lowest is on {_label(best)} ({on_top[best] - 1:+.2%})"
        for change, text in CHANGES.items():
            if f"factored+{change}" in data:
                out += f"; with {text} {data[f'factored+{change}'] - 1:+.2%}"
        out += "."
    return out + _peers_finding(data)


def _factored_finding(data, center):
    """The finding of a run of the factor and changes on top of it only (no published Gefen)."""
    if "factored" not in data:
        return ""
    out = f"By the {center} over seeds, the factored second moment ends at {data['factored'] - 1:+.2%} of AdamW's loss"
    for v, r in data.items():
        if v.startswith("factored+"):
            out += f"; {_label(v).removeprefix('factored, and ')} {r - 1:+.2%}"
    out += "."
    return out + _peers_finding(data)


def factored_report(name: str, title: str, figure_title: str, target: float = 1.003) -> Report:
    """The report of an ablation on top of the factor: this figure and table, findings by the median
    over seeds, the ``target`` dashed (the factored 8-bit's +0.3%)."""
    return Report(name, name, title, functools.partial(body, center="median"),
                  functools.partial(draw, target=target, title=figure_title), metrics=("val_loss_vs_adamw",))



def _peers_finding(data):
    """The peers' sentence: each one's ratio at the same lr (``data``: {variant: the center of its ratios})."""
    return "".join(f" {p} at the same lr: {data[p] - 1:+.2%}." for p in PEER_LABELS if p in data)

REPORT = Report("gefen_ablation", "gefen_ablation", "Gefen: where the loss gap comes from (ablation)", body, draw,
                metrics=("val_loss_vs_adamw",))

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
