"""Figure and README section: validation loss of the character GPT per optimizer, against steps and
against optimizer-state bytes; Gefen's loss relative to AdamW's.

    python analysis/convergence.py [--results-dir results] [--out paper_figs/convergence.png]

Reads ``convergence.csv`` (variant = optimizer): ``lr_sweep_val_loss`` against ``lr`` (first seed),
``best_lr``; per seed at the best lr ``val_loss`` against ``step`` and ``final_val_loss``,
``state_bytes_per_param``, ``step_time``; ``val_loss_vs_adamw`` per seed against ``model``.
Left panel: validation loss against steps, mean over seeds with a min-max band. Right panel: final
validation loss (mean ± std over seeds) against state bytes per parameter (log scale). A second row
draws each extra configuration (variants ``<model label>/<optimizer>``) where the run has them, and
a row each configuration's drop-in protocol (variants ``[<model label>/]dropin/<optimizer>``, every
optimizer at AdamW's best lr; ``lr`` in place of ``best_lr``).

The section: the character GPTs at each optimizer's best lr, their tables and the claims; then the
architectures the optimizers were not developed on (``char-encoder-*``, ``char-llama-*``) and every
drop-in protocol, as tables of the paired ratio's median, min and max; then the targets judged on
every configuration under every protocol the run has.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import math
import statistics
from collections import defaultdict

import functools

from analysis.claims_common import pct
from analysis.common import (CORPUS_TEXT, GEFEN_TARGET_BPP, OPTIMIZERS, TARGET_WIDTH, Report, configurations, fixed, fmt,
                             in_configuration, kind_table, label_of, main, md_table, mean_std, pm, save_figure, select,
                             value, variants)

TARGET = 0.03  # Gefen's claim: final loss within 3% of AdamW's
# the factored second moment's targets, in either layout (median over seeds, paired): loss within this of AdamW's
FACTORED_TARGET = {"Gefen-8bit-factored": 0.003, "Gefen-4bit-factored": 0.006, "Gefen-8bit-compact": 0.003,
                   "Gefen-4bit-compact": 0.006}
# bf16 weights with stochastic rounding: loss within this of fp32 AdamW's (median over seeds, paired)
BF16_TARGET = {"Gefen-8bit+bf16-sr": 0.005, "Gefen-8bit-factored+bf16-sr": 0.005}
GEFEN = ("Gefen-8bit", "Gefen-4bit", *FACTORED_TARGET, *BF16_TARGET)
DROPIN = "dropin/"  # experiments/convergence.py's variant prefix of the drop-in protocol
GEFEN_X = "gefen-x"  # the peer whose loss the factored variants must reach at no more bytes
ARCH_TEXT = {
    "gpt": "character GPT",
    "encoder": "character LM of PyTorch's pre-norm `nn.TransformerEncoderLayer` under a causal mask (fused q/k/v "
               "`in_proj_weight`, biases, PyTorch's default initialisation, positional embeddings at zero, untied "
               "head)",
    "llama": "Llama-style character LM (RMSNorm, SwiGLU MLP, rotary position embeddings, no biases, untied head)",
}


def is_dropin(prefix: str) -> bool:
    """Whether a configuration prefix is a drop-in protocol's (``dropin/`` or ``<label>/dropin/``)."""
    return prefix == DROPIN or prefix.endswith("/" + DROPIN)


def prefixes_of(rows):
    """The run's configuration prefixes (``configurations``) that have rows, each configuration's
    drop-in prefix right after its own."""
    names = variants(rows, "final_val_loss")
    return ordered([p for p in configurations(rows, "final_val_loss") if any(in_configuration(v, p) for v in names)])


def ordered(prefixes):
    """Configuration prefixes with each configuration's drop-in prefix right after its own."""
    bases = [p for p in prefixes if not is_dropin(p)]
    bases += [b for b in dict.fromkeys(p.removesuffix(DROPIN) for p in prefixes) if b not in bases]
    return [p for b in bases for p in (b, b + DROPIN) if p in prefixes]


def arch_of(label: str) -> str:
    """The architecture of a model label ``char-<arch>-<k>k[-<corpus>]``."""
    parts = label.split("-")
    return parts[1] if len(parts) > 2 and parts[0] == "char" else "gpt"


def summarise(rows, prefix=""):
    """{optimizer: dict(lr, curves {seed: [(step, loss)]}, finals, bpp, step_ms, grid {lr: loss})} of the
    configuration whose variants start with ``prefix`` (names without it)."""
    out = {}
    names = [v.removeprefix(prefix) for v in variants(rows, "final_val_loss") if in_configuration(v, prefix)]
    for short in sorted(names, key=lambda n: OPTIMIZERS.index(n) if n in OPTIMIZERS else len(OPTIMIZERS)):
        name = prefix + short
        curves = defaultdict(list)
        for r in select(rows, "val_loss", name, x_name="step"):
            curves[r["seed"]].append((r["x_value"], r["value"]))
        out[short] = dict(
            lr=_lr(rows, name),
            curves={s: sorted(c) for s, c in curves.items()},
            finals=[r["value"] for r in select(rows, "final_val_loss", name)],
            bpp=value(rows, "state_bytes_per_param", name),
            step_ms=statistics.median([r["value"] for r in select(rows, "step_time", name)] or [math.nan]),
            grid={r["x_value"]: r["value"] for r in select(rows, "lr_sweep_val_loss", name)},
        )
    return out


def _lr(rows, name):
    """The variant's lr: its ``best_lr``, or in the drop-in protocol its ``lr``."""
    best = value(rows, "best_lr", name)
    return best if math.isfinite(best) else value(rows, "lr", name)


def ratios(rows):
    """{model: {optimizer: [final loss / AdamW's, per seed]}}."""
    out = defaultdict(lambda: defaultdict(list))
    for r in select(rows, "val_loss_vs_adamw"):
        out[r["x_value"]][r["variant"]].append(r["value"])
    return out


def target_of(name: str) -> float | None:
    """The loss target of optimizer ``name`` relative to AdamW's (0.03: within +3%), None for a peer."""
    base = name.removesuffix("@0.6")
    return FACTORED_TARGET.get(base) or BF16_TARGET.get(base) or (TARGET if base in ("Gefen-8bit", "Gefen-4bit") else None)


def paired_ratios(rows, prefix):
    """{optimizer: [final loss / AdamW's, per seed both ran]} of the configuration ``prefix``, AdamW's
    own left out; optimizers in the run's order."""
    def by_seed(name):
        return {r["seed"]: r["value"] for r in select(rows, "final_val_loss", prefix + name)}

    base = by_seed("AdamW")
    out = {}
    for short in summarise(rows, prefix):
        if short != "AdamW":
            finals = by_seed(short)
            out[short] = [finals[s] / base[s] for s in sorted(finals, key=str) if s in base and base[s]]
    return out


def panel_label(rows, prefix):
    label = prefix.removesuffix(DROPIN).rstrip("/") or _main_label(rows)
    return label + (", drop-in: AdamW's lr" if is_dropin(prefix) else ", each at its best lr")


def setup_of(config) -> str:
    """The run's setup in words: steps, seeds, and the lr protocol's grid (or the one lr held fixed)."""
    c = config.get("config") or {}
    lrs = c.get("lrs") or []
    lr = (f"every optimizer at lr {lrs[0]:g}" if len(lrs) == 1 else
          f"lr grid {', '.join(f'{x:g}' for x in lrs)}" if lrs else "")
    parts = [f"{c['steps']:,} steps" if c.get("steps") else "", f"{len(c['seeds'])} seeds" if c.get("seeds") else "", lr]
    return ", ".join(p for p in parts if p)


def model_short(label: str) -> str:
    """A model label as the claims table names it: char-gpt-1266k -> "1.27M", char-gpt-429k-docstrings ->
    "429k prose"."""
    parts = label.split("-")
    k = next((int(p[:-1]) for p in parts if p.endswith("k") and p[:-1].isdigit()), None)
    size = label if k is None else f"{k / 1000:.2f}M" if k >= 1000 else f"{k}k"
    return size + (" prose" if "docstrings" in parts else "")


def _ratio(rows, stat, variant, **where) -> float:
    """The run's own summary of ``variant``'s loss over AdamW's (``val_loss_vs_adamw_<stat>``, stat "mean"
    or "median" over seeds paired by seed), the number the claims table reads."""
    return value(rows, f"val_loss_vs_adamw_{stat}", variant, **where)


def quality_headline(rows, config) -> str:
    """The published 8-bit Gefen on every model of the run, median over seeds paired by seed (the
    claims table's "Gefen trains at AdamW's quality")."""
    models = list(dict.fromkeys(r["x_value"] for r in select(rows, "val_loss_vs_adamw_median", "Gefen-8bit")))
    gaps = [pct(_ratio(rows, "median", "Gefen-8bit", x_value=m)) for m in models]
    return (f"{label_of('Gefen-8bit')}: {' / '.join(gaps)} over AdamW's loss "
            f"({' / '.join(model_short(m) for m in models)}; median of seeds, each at its best lr)")


SEEDS = "gefen_ablation_seeds"  # the drop-in protocol on many seeds (experiments/gefen_ablation.py), read beside a run
SEEDS_NAMES = ("factored", "Gefen-4bit-factored")  # its factored 8-bit and 4-bit variants


def seeds_prefix(model: str):
    """The variant prefix of convergence model ``model`` (a label) in the runs on many seeds: "" for
    the ablation's first size, "<label>/" for another, None where they did not train it."""
    from experiments.gefen_ablation import ABLATIONS
    from experiments.harness.train import CHAR_LM, char_lm_label

    labels = [char_lm_label(CHAR_LM[s]) for s in ABLATIONS[SEEDS].sizes]
    return None if model not in labels else "" if model == labels[0] else f"{model}/"


def factored_loss(rows, model, prefix="", seeds_rows=None) -> list:
    """[8-bit, 4-bit] factored Gefen's loss ratio on ``model``: the worse of both protocols' medians
    over seeds paired by seed (``model`` the x value; ``prefix`` its variants' in the best-lr rows). Where the runs on many seeds
    (``seeds_rows``) trained ``model``, they give the drop-in protocol's median, and the other's
    where that protocol's best lr is AdamW's: they hold this run's seeds and more."""
    names = [f"Gefen-{b}-factored" for b in ("8bit", "4bit")]
    loss = [max(_ratio(rows, "median", p + n, x_value=model) for p in ("", DROPIN)) for n in names]
    many_prefix = seeds_prefix(model)
    if not seeds_rows or many_prefix is None:
        return loss
    best = {r["variant"]: r["value"] for r in select(rows, "best_lr")}
    many = [statistics.median(r["value"] for r in select(seeds_rows, "val_loss_vs_adamw", many_prefix + v))
            for v in SEEDS_NAMES]
    own = [m if best[prefix + n] == best[prefix + "AdamW"] else _ratio(rows, "median", n, x_value=model)
           for m, n in zip(many, names)]
    return [max(a, b) for a, b in zip(own, many)]


def _models(rows) -> list:
    """[(model label, variant prefix)] of a convergence run: its first model unprefixed."""
    labels = list(dict.fromkeys(r["x_value"] for r in select(rows, "val_loss_vs_adamw_median")))
    return [(m, "" if k == 0 else f"{m}/") for k, m in enumerate(labels)]


def factored_headline(rows, config) -> str:
    """The factored 8-bit and 4-bit on every model of the run, ``factored_loss`` (the claims table's
    rows of the factored layout)."""
    seeds = (config.get("other_rows") or {}).get(SEEDS)
    models = _models(rows)
    losses = [factored_loss(rows, m, p, seeds) for m, p in models]
    many = [m for m, _ in models if seeds and seeds_prefix(m) is not None]
    return (f"Gefen factored (ours): 8-bit {' / '.join(pct(x[0]) for x in losses)}, 4-bit "
            f"{' / '.join(pct(x[1]) for x in losses)} vs AdamW's loss (median of seeds, the worse of both protocols"
            + (f"; drop-in: {len({r['seed'] for r in seeds})} seeds on {', '.join(map(model_short, many))}" if many else "")
            + ")")


def quality_and_factored_headline(rows, config) -> str:
    """The main run's title: the published 8-bit (``quality_headline``), then ours (``factored_headline``)."""
    return quality_headline(rows, config) + "; " + factored_headline(rows, config)


def bf16_headline(rows, config) -> str:
    """The factored and published 8-bit on bf16 weights against fp32 AdamW, medians over seeds."""
    ours, published = (_ratio(rows, "median", n) for n in ("Gefen-8bit-factored+bf16-sr", "Gefen-8bit+bf16-sr"))
    return (f"bf16 weights, stochastic rounding: factored 8-bit {pct(ours)} (ours), published 8-bit {pct(published)} "
            "vs fp32 AdamW's loss (median of seeds)")


def draw(rows, out, config, headline=None):
    """One panel per configuration: each optimizer's final validation loss relative to AdamW's
    (paired by seed; dots the seeds, a bar the median), its target band shaded; ours in colour. The
    title: ``headline(rows, config)`` where given (the claim's number, as the claims table has it),
    else the Gefen median closest to or furthest past its target; then the run's setup."""
    from analysis.common import finding_title, new_figure, signed_pct

    prefixes = prefixes_of(rows)
    ncols = 2 if len(prefixes) > 1 else 1
    nrows = math.ceil(len(prefixes) / ncols)
    per = [paired_ratios(rows, p) for p in prefixes]
    height = max((len(r) for r in per), default=1) * 0.3 + 1.5
    fig, axes = new_figure(nrows, ncols, width=6.6 * ncols, height=height * nrows + 1.0)
    worst = None
    for ax, prefix, ratios_ in zip(axes.flat, prefixes, per):
        summary = summarise(rows, prefix)
        _draw_ratios(ax, ratios_, {n: s["bpp"] for n, s in summary.items()}, panel_label(rows, prefix))
        for name, seeds in ratios_.items():
            if target_of(name) is not None and seeds:
                med = statistics.median(seeds)
                if worst is None or med - target_of(name) > worst[0] - target_of(worst[1]):
                    worst = (med, name, panel_label(rows, prefix))
    for ax in list(axes.flat)[len(prefixes):]:
        ax.set_axis_off()
    if headline is not None:
        finding = headline(rows, config)
    elif worst:
        med, name, where = worst
        t = target_of(name)
        if med - 1 <= t:
            finding = (f"Every Gefen median within its target; the closest: {label_of(name)} at {signed_pct(med)} over "
                       f"AdamW's loss (target at most {t:+.1%}; {where})")
        else:
            finding = f"{label_of(name)}: median {signed_pct(med)} over AdamW's loss, past its {t:+.1%} target ({where})"
    else:
        finding = "Final validation loss relative to AdamW's"
    setup = "; ".join(p for p in (setup_of(config), "dots: seeds, bar: median, green: the target's span, "
                                                     "B/p: optimizer state bytes per parameter") if p)
    save_figure(fig, out, finding_title(finding, setup, fig))


def _main_label(rows):
    return next(iter(ratios(rows)), "main model")


def _draw_ratios(ax, per, bpp, label):
    """A dot plot of ``per`` ({optimizer: ratios per seed}) as percent over AdamW's, one row each."""
    from matplotlib.collections import PolyCollection

    from analysis.common import styles

    names = list(per)
    ax.set_title(label, fontsize=9)
    if not names:  # AdamW alone: nothing to compare
        ax.set_axis_off()
        return
    look = styles(names + ["AdamW"])
    ys = range(len(names))
    seeds = [(100 * (r - 1), y) for y, n in zip(ys, names) for r in per[n]]
    colours = [look[n]["color"] for n in names for _ in per[n]]
    if seeds:
        ax.scatter(*zip(*seeds), s=14, c=colours, alpha=0.6, linewidths=0, zorder=3)
    meds = [(100 * (statistics.median(per[n]) - 1), y) for y, n in zip(ys, names) if per[n]]
    if meds:
        ax.scatter(*zip(*meds), marker="|", s=260, linewidths=2.2, zorder=4,
                   c=[look[n]["color"] for n in names if per[n]])
    bands = [[(0, y - 0.35), (0, y + 0.35), (100 * target_of(n), y + 0.35), (100 * target_of(n), y - 0.35)]
             for y, n in zip(ys, names) if target_of(n) is not None]
    ax.add_collection(PolyCollection(bands, facecolor="#2ca02c", alpha=0.18, linewidth=0, zorder=1))
    ax.axvline(0, color="black", linewidth=1, zorder=2)
    ax.set_yticks(list(ys), [f"{label_of(n)} · {fmt(bpp.get(n, math.nan), 2)} B/p" for n in names], fontsize=8)
    for tick, n in zip(ax.get_yticklabels(), names):
        tick.set_color(look[n]["color"])
        tick.set_fontweight("bold" if n in GEFEN or n.removesuffix("@0.6") in GEFEN else "normal")
    ax.set_ylim(len(names) - 0.5, -0.5)
    xs = [x for x, _ in seeds] + [0, 100 * max((target_of(n) or 0) for n in names)]
    pad = 0.08 * (max(xs) - min(xs) or 1)
    ax.set_xlim(min(xs) - pad, max(xs) + pad)
    ax.set_xlabel("final validation loss over AdamW's (%, paired by seed)", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(alpha=0.3, axis="x")


def _table(rows, summary, prefix, rel):
    models = list(rel)
    head = ["optimizer", "best lr", "final val loss (nats/char)", "state B/param", "step (ms)"]
    head += [f"loss / AdamW's ({m}, paired by seed, mean ± std)" for m in models]
    table = []
    for name, s in summary.items():
        cells = [f"**{name}**" if name in GEFEN else name, f"{s['lr']:g}", pm(*mean_std(s["finals"])),
                 fmt(s["bpp"], 4), fmt(s["step_ms"])]
        cells += [pm(*mean_std(rel[m].get(name, [])), 3) if name != "AdamW" else "—" for m in models]
        table.append(cells)
    lrs = sorted({lr for s in summary.values() for lr in s["grid"]})
    grid = md_table(["optimizer"] + [f"lr {lr:g}" for lr in lrs],
                    [[name] + [fixed(s["grid"].get(lr)) for lr in lrs] for name, s in summary.items()])
    return md_table(head, table) + "\n\nFinal validation loss of the first seed over the lr grid:\n\n" + grid


def _widths(rows, c):
    """{configuration label: its model's width (n_embd), None where the config does not say}."""
    out = {_main_label(rows): (c.get("model") or {}).get("n_embd")}
    out.update({k: (v.get("model") or {}).get("n_embd") for k, v in (c.get("extra") or {}).items()})
    return out


def _bytes_judged(bpp, cap, width):
    """The bytes' verdict: against ``cap`` from TARGET_WIDTH on; a narrower model has no cap (its
    vectors weigh more), only the comparison with Gefen-X's bytes."""
    if width is not None and width < TARGET_WIDTH:
        return f"no cap at width {width} (from {TARGET_WIDTH}: ≤ {cap:g})"
    return f"{_judge(bpp <= cap)} (target ≤ {cap:g})"


def _verdicts(rel, bpp_of, widths):
    lines = []
    for m, per in rel.items():
        for name in GEFEN:
            seeds = per.get(name)
            if not seeds:
                continue
            mean, _ = mean_std(seeds)
            med = statistics.median(seeds)
            worse = sum(1 for v in seeds if v > 1)
            if name in BF16_TARGET:
                t = BF16_TARGET[name]
                pure = per.get("AdamW+bf16")
                lines.append(f"- {name} (bf16 weights, no fp32 copy) on {m}: median {(med - 1):+.2%} against fp32 "
                             f"AdamW; target within {t:+.1%}: {'**met**' if med - 1 <= t else '**not met**'}; worse "
                             f"than AdamW on {worse} of {len(seeds)} seeds; {fmt(bpp_of(m, name), 4)} B/param of "
                             "state" + (f" (pure bf16 AdamW, rounding to nearest: median "
                                        f"{statistics.median(pure) - 1:+.2%})." if pure else "."))
            elif name in FACTORED_TARGET:
                t, cap = FACTORED_TARGET[name], GEFEN_TARGET_BPP[name]
                published = name.rsplit("-", 1)[0]  # its bytes beside: the same bits, published
                bpp = bpp_of(m, name)
                lines.append(f"- {name} on {m}: median {(med - 1):+.2%} (mean {(mean - 1):+.2%}) against AdamW; "
                             f"target within {t:+.1%}: {'**met**' if med - 1 <= t else '**not met**'}; worse than "
                             f"AdamW on {worse} of {len(seeds)} seeds. {fmt(bpp, 4)} B/param: "
                             f"{_bytes_judged(bpp, cap, widths.get(m))} ({published}: "
                             f"{fmt(bpp_of(m, published), 4)}).")
            else:
                within = sum(1 for v in seeds if v - 1 <= TARGET)
                lines.append(f"- {name} on {m}: median {(med - 1):+.2%} (mean {(mean - 1):+.2%}) against AdamW; "
                             f"within {TARGET:.0%} on {within} of {len(seeds)} seeds, worse than AdamW on {worse}.")
    return lines


def body(rows, config):
    c = config.get("config", {})
    rel = ratios(rows)
    text, summaries = [], {}
    extra = c.get("extra") or {}
    prefixes = prefixes_of(rows)
    for prefix in prefixes:
        if is_dropin(prefix) or arch_of(prefix.rstrip("/") or _main_label(rows)) != "gpt":
            continue  # in the part on untuned configurations below
        cc = (extra.get(prefix.rstrip("/")) or c.get("large") or {}) if prefix else c
        spec = cc.get("model")
        model = ", ".join(f"{k}={v}" for k, v in spec.items()) if isinstance(spec, dict) else ""
        label = prefix.rstrip("/") or _main_label(rows)
        summary = summaries[label] = summarise(rows, prefix)
        text.append(f"**{label}**: character GPT ({model}; {fmt(value(rows, 'params', prefix + 'AdamW'))} "
                    f"parameters) on {CORPUS_TEXT.get(cc.get('corpus', 'docs+code'), cc.get('corpus'))}, "
                    f"{cc.get('steps', '?')} steps, "
                    f"batch {cc.get('batch', '?')}. Warm-up then cosine decay, clipping 1.0, weight decay 0.1. Each "
                    "optimizer's lr is the best of the grid by the first seed's final validation loss; that lr is "
                    "rerun on the other seeds.")
        text.append(_table(rows, summary, prefix, {label: rel.get(label, {})}))
        text.append(kind_table(rows, prefix, summary))

    def bpp_of(model, name):
        return summaries.get(model, {}).get(name, {}).get("bpp", math.nan)

    verdicts = _verdicts({m: per for m, per in rel.items() if arch_of(m) == "gpt"}, bpp_of, _widths(rows, c))
    if verdicts:
        text.append(f"Claims: Gefen's loss stays within {TARGET:.0%} of AdamW's; the factored second moment "
                    "(`factor_second_moment=True`) within +0.3% (8 bits) and +0.6% (4 bits), median over seeds "
                    f"paired by seed, at most {GEFEN_TARGET_BPP['Gefen-8bit-factored']:g} and "
                    f"{GEFEN_TARGET_BPP['Gefen-4bit-factored']:g} B/param at width {TARGET_WIDTH} or more; on bf16 "
                    "weights with stochastic rounding "
                    f"within +{BF16_TARGET['Gefen-8bit+bf16-sr']:.1%} of fp32 AdamW's. On a small model the vectors (per-element v "
                    "at block length 1) are a large share of the parameters, so the published Gefen itself can "
                    "exceed those bytes there.\n\n" + "\n".join(verdicts))
    text += _untuned(rows, c, prefixes, rel)
    return "\n\n".join(t for t in text if t)


def _describe(rows, c, prefix):
    """The configuration line of one (configuration, protocol) prefix."""
    base = prefix.removesuffix(DROPIN)
    label = base.rstrip("/") or _main_label(rows)
    cc = ((c.get("extra") or {}).get(label) or {}) if base else c
    spec = cc.get("model")
    model = ", ".join(f"{k}={v}" for k, v in spec.items()) if isinstance(spec, dict) else ""
    how = ("Drop-in protocol: AdamW's lr grid on the first seed, then every optimizer at AdamW's best lr on every "
           "seed (`gefen-x@0.6`: gefen-x at 0.6x that lr, as its README advises)." if is_dropin(prefix) else
           "Each optimizer's lr is the best of the grid by the first seed's final validation loss; that lr is "
           "rerun on the other seeds.")
    grid = summarise(rows, prefix).get("AdamW", {}).get("grid") or {}
    best = _lr(rows, prefix + "AdamW")
    if len(grid) > 2 and best in (min(grid), max(grid)):
        how += f" AdamW's best lr ({best:g}) is at the edge of the grid: a wider grid may find a better one."
    return (f"**{label}, {'drop-in' if is_dropin(prefix) else 'best lr'}**: "
            f"{ARCH_TEXT.get(arch_of(label), arch_of(label))} ({model}; "
            f"{fmt(value(rows, 'params', prefix + 'AdamW'))} parameters) on "
            f"{CORPUS_TEXT.get(cc.get('corpus', 'docs+code'), cc.get('corpus'))}, {cc.get('steps', '?')} steps, batch "
            f"{cc.get('batch', '?')}. Warm-up then cosine decay, clipping 1.0, weight decay 0.1. {how}")


def _paired(rel, label, prefix, name):
    """Per-seed ratios to AdamW of ``name`` in the configuration of ``prefix``."""
    return rel.get(label, {}).get((DROPIN if is_dropin(prefix) else "") + name, [])


def _spread(vals):
    """(median, min, max) of per-seed ratios; NaNs when there are none."""
    return (statistics.median(vals), min(vals), max(vals)) if vals else (math.nan,) * 3


def _ratio_table(rows, summary, prefix, per):
    head = ["optimizer", "lr", "final val loss (nats/char, mean ± std)", "state B/param", "step (ms)",
            "loss / AdamW's: median", "min", "max", "seeds worse than AdamW"]
    table = []
    for name, s in summary.items():
        seeds = per(name)
        med, lo, hi = _spread(seeds)
        cells = [f"**{name}**" if name in GEFEN else name, f"{s['lr']:g}", pm(*mean_std(s["finals"])), fmt(s["bpp"], 4),
                 fmt(s["step_ms"])]
        cells += (["—"] * 4 if name == "AdamW" else
                  [f"{med - 1:+.2%}", f"{lo - 1:+.2%}", f"{hi - 1:+.2%}", f"{sum(v > 1 for v in seeds)} of {len(seeds)}"])
        table.append(cells)
    lrs = sorted({lr for s in summary.values() for lr in s["grid"]})
    gridded = {n: s for n, s in summary.items() if s["grid"]}
    grid = md_table(["optimizer"] + [f"lr {lr:g}" for lr in lrs],
                    [[n] + [fixed(s["grid"].get(lr)) for lr in lrs] for n, s in gridded.items()])
    return md_table(head, table) + "\n\nFinal validation loss of the first seed over the lr grid:\n\n" + grid


def _judge(ok):
    return "—" if ok is None else "**met**" if ok else "**not met**"


def _target_rows(rows, prefixes, rel, summaries, widths):
    """One row per (configuration, protocol, factored variant): its targets and Gefen-X's loss."""
    out = []
    for prefix in prefixes:
        label = prefix.removesuffix(DROPIN).rstrip("/") or _main_label(rows)
        summary = summaries[prefix]
        med = {n: _spread(_paired(rel, label, prefix, n))[0] for n in summary}
        peers = [n for n in summary if n.partition("@")[0] == GEFEN_X and math.isfinite(med[n])]
        gx = min(peers, key=med.get) if peers else None
        for name, t in FACTORED_TARGET.items():
            if name not in summary or not math.isfinite(med[name]):
                continue
            bpp, cap = summary[name]["bpp"], GEFEN_TARGET_BPP[name]
            cells = [label, "drop-in" if is_dropin(prefix) else "best lr", name,
                     f"{med[name] - 1:+.2%} {_judge(med[name] - 1 <= t)} (target {t:+.1%})",
                     f"{fmt(bpp, 4)} {_bytes_judged(bpp, cap, widths.get(label))}"]
            if gx is None:
                cells += ["—", "—"]
            else:
                gbpp = summary[gx]["bpp"]
                cells += [f"{gx}: {med[gx] - 1:+.2%}, {fmt(gbpp, 4)} B/param",
                          _judge(med[name] <= med[gx] and bpp <= gbpp)]
            out.append(cells)
    return out


def _untuned(rows, c, prefixes, rel):
    """The architectures the optimizers were not developed on and every drop-in protocol: per
    configuration a table of the paired ratio's median, min and max; then every target, judged on
    every configuration and protocol of the run."""
    text = []
    summaries = {p: summarise(rows, p) for p in prefixes}
    for prefix in prefixes:
        label = prefix.removesuffix(DROPIN).rstrip("/") or _main_label(rows)
        if not is_dropin(prefix) and arch_of(label) == "gpt":
            continue
        text.append(_describe(rows, c, prefix))
        text.append(_ratio_table(rows, summaries[prefix], prefix, lambda n: _paired(rel, label, prefix, n)))
        if not is_dropin(prefix) or prefix.removesuffix(DROPIN) not in prefixes:  # the same bytes in both
            text.append(kind_table(rows, prefix, summaries[prefix]))
    if not any(n in s for s in summaries.values() for n in FACTORED_TARGET):
        return text
    head = ["configuration", "protocol", "variant", "median vs AdamW", "B/param",
            "Gefen-X (its best lr variant): median, B/param", "Gefen-X's loss or lower at its bytes or fewer"]
    text.append("Targets on every configuration and protocol: the factored second moment (either layout) within "
                "+0.3% (8 bits) and "
                "+0.6% (4 bits) of AdamW's loss, median over seeds paired by seed, at most "
                f"{GEFEN_TARGET_BPP['Gefen-8bit-factored']:g} and {GEFEN_TARGET_BPP['Gefen-4bit-factored']:g} B/param "
                f"at width {TARGET_WIDTH} or more; and a median ratio no higher than Gefen-X's (the lower of its "
                "variants in the protocol: in the "
                "drop-in one, AdamW's lr or 0.6x it) at no more state bytes than Gefen-X's.\n\n"
                + md_table(head, _target_rows(rows, prefixes, rel, summaries, _widths(rows, c))))
    return text


REPORT = Report("convergence", "convergence", "Gefen: convergence at AdamW's quality", body,
                functools.partial(draw, headline=quality_and_factored_headline),
                metrics=("final_val_loss", "val_loss", "best_lr"), reads=(SEEDS,))


def arch_report(arch: str, name: str = "", more: str = "") -> Report:
    """The report of ``<name>.csv`` (default ``convergence_<arch>``), a run of one architecture of
    ``ARCH_TEXT``; ``more`` ends its title."""
    name = name or f"convergence_{arch}"
    return Report(name, name, f"Gefen where it was not tuned: the {ARCH_TEXT[arch].split(' (')[0]}{more}", body,
                  functools.partial(draw, headline=factored_headline), metrics=("final_val_loss", "val_loss", "best_lr"),
                  reads=(SEEDS,))


def arch_main(report: Report, doc: str):
    """The command line of an architecture's analysis script (``main`` of analysis/common.py)."""
    main(report, doc=doc)


if __name__ == "__main__":
    main(REPORT, doc=__doc__)
