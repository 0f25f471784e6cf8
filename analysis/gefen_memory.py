"""Figure and README section: optimizer-state bytes per parameter and CPU step time per optimizer and model.

    python analysis/gefen_memory.py [--results-dir results] [--out paper_figs/gefen_memory.png]

Reads ``gefen_memory.csv`` (variant = optimizer, ``x_name="model"``): ``state_bytes_per_param``,
``step_time_median`` (s), ``step_time_vs_adamw`` (ratio to AdamW's median of the same run) and
``threads``. Left panel: bytes per parameter with Gefen's targets dashed. Right panel: median step
time (log scale), labelled with the ratio to AdamW's. The section gives the same numbers per model
and each target met or missed; then, per convergence model (variants ``<model label>/<optimizer>``:
``state_bytes_per_param_of_kind`` and ``params_of_kind`` against ``kind``), the bytes by kind of tensor.
"""

from __future__ import annotations

import math

import numpy as np

from analysis.common import (GEFEN_TARGET_BPP as TARGET_BPP, OPTIMIZERS, Report, fixed, fmt, kind_table, main, md_table, save_figure,
                             select, value, variants)
TARGET_STEP = 4.0  # Gefen's step at most this many times AdamW's
TARGET_FACTORED_STEP = 1.15  # the factored second moment: step time over the unfactored Gefen's


def models(rows):
    return list(dict.fromkeys(r["x_value"] for r in select(rows, "state_bytes_per_param")))


def optimizers(rows):
    names = variants(rows, "state_bytes_per_param")
    return sorted(names, key=lambda n: OPTIMIZERS.index(n) if n in OPTIMIZERS else len(OPTIMIZERS))


def _bars(ax, rows, metric, scale=1.0, labels=None):
    names, mods = optimizers(rows), models(rows)
    width = 0.8 / len(mods)
    x = np.arange(len(names))
    for j, m in enumerate(mods):
        vals = [value(rows, metric, n, x_value=m) * scale for n in names]
        bars = ax.bar(x + (j - (len(mods) - 1) / 2) * width, vals, width, label=m)
        for n, b, v in zip(names, bars, vals):
            if math.isfinite(v):
                text = labels(n, m) if labels else f"{v:.2f}"
                ax.annotate(text, (b.get_x() + b.get_width() / 2, v), textcoords="offset points", xytext=(0, 2),
                            ha="center", fontsize=6, rotation=90 if labels else 0)
    ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.grid(alpha=0.3, axis="y", which="both")
    ax.legend(fontsize=7, title="model", title_fontsize=7)


def draw(rows, out, config):
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12.4, 5))
    _bars(ax1, rows, "state_bytes_per_param")
    for (name, y), style in zip(TARGET_BPP.items(), ["--", ":"]):
        ax1.axhline(y, color="grey", linestyle=style, linewidth=1)
    ax1.set_ylim(top=ax1.get_ylim()[1] * 2)
    ax1.set(ylabel="optimizer state (bytes / parameter, log scale)",
            title="state bytes per parameter (dashed: Gefen's 8- and 4-bit targets)")
    _bars(ax2, rows, "step_time_median", 1e3,
          labels=lambda n, m: f"{value(rows, 'step_time_vs_adamw', n, x_value=m):.1f}x")
    ax2.set_ylim(top=ax2.get_ylim()[1] * 3)
    ax2.set(ylabel="CPU step time, median (ms)", title="one optimizer step on CPU (label: × AdamW)")
    save_figure(fig, out)


def body(rows, config):
    c = config.get("config", {})
    threads = sorted({int(r["value"]) for r in select(rows, "threads")})
    text = [f"State bytes are the tensor bytes of `state_dict()` after one step, over the parameter count. Step "
            f"time is the median of {c.get('repeats', '?')} interleaved steps on fixed gradients, every "
            f"optimizer on {'/'.join(map(str, threads)) or '?'} torch thread(s); the ratio is to AdamW's "
            "(fused) median of the same run. The loss against AdamW is the convergence section's."]
    verdicts = []
    for m in models(rows):
        table = [[f"**{n}**" if n in TARGET_BPP else n, fixed(value(rows, "state_bytes_per_param", n, x_value=m), 3),
                  fmt(1e3 * value(rows, "step_time_median", n, x_value=m)),
                  fmt(value(rows, "step_time_vs_adamw", n, x_value=m))] for n in optimizers(rows)]
        text.append(f"Model `{m}`:\n\n" + md_table(["optimizer", "state B/param", "step (ms)", "× AdamW"], table))
        for n, target in TARGET_BPP.items():
            bpp, ratio = value(rows, "state_bytes_per_param", n, x_value=m), value(rows, "step_time_vs_adamw", n, x_value=m)
            if math.isfinite(bpp):
                verdicts.append(f"- {n} on {m}: {fixed(bpp, 3)} B/param (target ≤ {target}: "
                                f"{'met' if bpp <= target else 'missed'}); step {fmt(ratio)}× AdamW's (target ≤ "
                                f"{TARGET_STEP:g}×: {'met' if ratio <= TARGET_STEP else 'missed'}).")
        for n in [n for n in optimizers(rows) if n.endswith("-factored")]:
            r = value(rows, "step_time_vs_unfactored", n, x_value=m)
            if math.isfinite(r):
                verdicts.append(f"- {n} on {m}: step {fixed(r, 3)}× {n.removesuffix('-factored')}'s, interleaved "
                                f"(target ≤ {TARGET_FACTORED_STEP:g}×: "
                                f"{'met' if r <= TARGET_FACTORED_STEP else 'missed'}).")
    adamw = value(rows, "state_bytes_per_param", "AdamW", x_value=models(rows)[0])
    ours = value(rows, "state_bytes_per_param", "Gefen-8bit", x_value=models(rows)[0])
    if math.isfinite(adamw) and math.isfinite(ours):
        verdicts.append(f"- Memory claim (≈8× less than AdamW, ≈6.5 GiB saved per billion parameters): on "
                        f"{models(rows)[0]}, {fmt(adamw / ours)}× less, {fmt(adamw - ours)} B/param saved, "
                        f"{fmt((adamw - ours) * 1e9 / 2**30)} GiB per billion parameters.")
    text.append("\n".join(verdicts))
    text += by_kind(rows, c.get("seed", "?"))
    return "\n\n".join(text)


def by_kind(rows, seed):
    """Per convergence model (variants ``<model label>/<optimizer>``), the bytes by kind of tensor
    after the first training step of ``seed``."""
    text = []
    names = variants(rows, "state_bytes_per_param_of_kind")
    for label in dict.fromkeys(n.rpartition("/")[0] for n in names):
        opts = [n.removeprefix(label + "/") for n in names if n.startswith(label + "/")]
        text.append(f"`{label}` (experiments/convergence.py's model, after the first step of its seed-"
                    f"{seed} run, which fixes the blocks). " + kind_table(rows, label + "/", opts))
    return text


REPORT = Report("gefen_memory", "gefen_memory", "Gefen: optimizer memory and CPU step time", body, draw,
                metrics=("state_bytes_per_param", "step_time_median", "step_time_vs_adamw"))

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
