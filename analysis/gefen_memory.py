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

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import math

import matplotlib.ticker

from analysis.common import (GEFEN_TARGET_BPP as TARGET_BPP, OPTIMIZERS, Report, fixed, fmt, kind_table, main, md_table, save_figure,
                             select, value, variants)
TARGET_STEP = 4.0  # Gefen's step at most this many times AdamW's
TARGET_FACTORED_STEP = 1.15  # the factored second moment: step time over the unfactored Gefen's


def models(rows):
    return list(dict.fromkeys(r["x_value"] for r in select(rows, "state_bytes_per_param")))


def optimizers(rows):
    names = variants(rows, "state_bytes_per_param")
    return sorted(names, key=lambda n: OPTIMIZERS.index(n) if n in OPTIMIZERS else len(OPTIMIZERS))


def _dots(ax, rows, metric, names, scale=1.0):
    """One row per optimizer, a marker per model: ``metric`` × ``scale`` on a log axis."""
    from analysis.common import names_axis

    names_axis(ax, names, order=OPTIMIZERS)
    for j, (m, marker) in enumerate(zip(models(rows), "oDs^v")):
        vals = [value(rows, metric, n, x_value=m) * scale for n in names]
        ax.scatter(vals, range(len(names)), marker=marker, s=28, facecolors="none" if j else "#333333",
                   edgecolors="#333333", linewidths=1.1, zorder=4, label=m)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(alpha=0.3, axis="x", which="both")
    ax.tick_params(axis="x", labelsize=8)


def headline(rows) -> str:
    """The claims table's headline: Gefen's 8-bit and 4-bit state and AdamW's on the transformer."""
    b8, b4, adamw = (value(rows, "state_bytes_per_param", n, x_value="transformer")
                     for n in ("Gefen-8bit", "Gefen-4bit", "AdamW"))
    return f"8-bit {b8:.3f}, 4-bit {b4:.3f} B/param; AdamW {adamw:.3f} (transformer)"


def finding(rows):
    """The title: the claims table's headline, the Gefen variant nearest its byte target, and the
    slowest Gefen step × AdamW's."""
    parts = [f"Gefen's state {headline(rows)}"]
    over = [(value(rows, "state_bytes_per_param", n, x_value=m) - t, n, m) for n, t in TARGET_BPP.items()
            for m in models(rows) if math.isfinite(value(rows, "state_bytes_per_param", n, x_value=m))]
    if over:
        d, n, m = max(over)
        v = value(rows, "state_bytes_per_param", n, x_value=m)
        parts.append(f"every Gefen's state {'within' if d <= 0 else 'not within'} its byte target (closest: {n}, "
                     f"{v:.2f} of {TARGET_BPP[n]:g} B/param, {m})")
    steps = [(value(rows, "step_time_vs_adamw", n, x_value=m), n, m) for n in optimizers(rows) if n.startswith("Gefen")
             for m in models(rows)]
    steps = [s for s in steps if math.isfinite(s[0])]
    if steps:
        v, n, m = max(steps)
        parts.append(f"slowest Gefen CPU step {v:.1f}× AdamW's ({n}, {m}; target at most {TARGET_STEP:g}×)")
    return "; ".join(parts)


def draw(rows, out, config):
    from matplotlib.collections import PolyCollection

    from analysis.common import finding_title, new_figure

    names = optimizers(rows)
    fig, axes = new_figure(1, 2, width=11, height=0.3 * len(names) + 2.2)
    ax1, ax2 = axes[0]
    _dots(ax1, rows, "state_bytes_per_param", names)
    bands = [[(0.01, y - 0.35), (0.01, y + 0.35), (TARGET_BPP[n], y + 0.35), (TARGET_BPP[n], y - 0.35)]
             for y, n in enumerate(names) if n in TARGET_BPP]
    lo = min(value(rows, "state_bytes_per_param", n, x_value=m) for n in names for m in models(rows))
    ax1.add_collection(PolyCollection(bands, facecolor="#2ca02c", alpha=0.18, linewidth=0, zorder=1))
    ax1.set_xlim(lo / 1.5, 16)
    ax1.set_xlabel("optimizer state (bytes / parameter, log scale)", fontsize=8)
    ax1.set_title("state bytes (green: each Gefen's target span)", fontsize=9)
    _dots(ax2, rows, "step_time_vs_adamw", names)
    ax2.axvline(1, color="black", linewidth=1)
    ax2.axvline(TARGET_STEP, color="#2ca02c", linestyle="--", linewidth=1.2)
    ax2.set_xlabel("CPU step time × AdamW's (median, log scale)", fontsize=8)
    ax2.set_title(f"step time (black: AdamW's; dashed: the {TARGET_STEP:g}× target)", fontsize=9)
    ax2.tick_params(axis="y", labelleft=False)
    ax1.legend(title="model", fontsize=7, title_fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14),
               ncols=len(models(rows)), frameon=False)
    save_figure(fig, out, title=finding_title(finding(rows), "one marker per model; values in the table", fig))


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
