"""Figure and README section: the exact codebook DP (time against bins and levels) and the
quantisation error of learned and fixed codes.

    python analysis/codebook.py [--results-dir results] [--out paper_figs/codebook.png]

Reads ``codebook_dp.csv``. Left: median DP CPU time against histogram bins for ours (numba, numpy)
and upstream gefen's ``exact_dp`` at each number of levels (variants ``<impl>/K<levels>``). Middle:
speed-up over upstream (median over median, same run). Right: relative error Σ(m − m̂)²/Σm² of
AdamW first moments quantised with each code (variants ``<code>/<bits>/<blocking>``).
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import math
from collections import defaultdict

from analysis.common import Report, finding_title, fmt, legend_below, main, md_table, new_figure, save_figure, select, value

COLORS = {"ours-numba": "tab:blue", "ours-numpy": "tab:green", "upstream": "tab:red"}
STYLES = {"K16": "--", "K256": "-"}
CODES = {"learned": "learned (on these moments)", "learned-step1": "learned (on step-1 gradients, as Gefen)",
         "linear": "linear", "dynamic": "dynamic exponent (bitsandbytes)"}
GROUPS = [(bits, blocking) for bits in ("8bit", "4bit") for blocking in ("absmax256", "gefen")]


def series(rows, metric):
    """{(impl, K): sorted [(bins, value)]} for rows of one metric."""
    out = defaultdict(list)
    for r in select(rows, metric, x_name="bins"):
        impl, k = r["variant"].rsplit("/", 1)
        out[(impl, k)].append((r["x_value"], r["value"]))
    return {key: sorted(v) for key, v in sorted(out.items())}


def errors(rows):
    """{(code, bits, blocking): relative error}."""
    return {tuple(r["variant"].split("/")): r["value"] for r in select(rows, "rel_mse")}


def _lines(ax, rows, metric, ylabel, title):
    for (impl, k), pts in series(rows, metric).items():
        ax.plot(*zip(*pts), STYLES.get(k, ":"), marker="o", ms=3, color=COLORS.get(impl),
                label=f"{impl}, {k[1:]} levels")
    ax.set(yscale="log", xlabel="histogram bins", ylabel=ylabel)
    ax.set_title(title, fontsize=9)
    ax.set_xscale("log", base=2)
    legend_below(ax, ncols=2)
    ax.grid(alpha=0.3, which="both")


SPEED = "cpu_speedup_vs_upstream"  # upstream's CPU time / ours: the figure's and the claims table's speed


def fastest(rows) -> dict:
    """The claims table's numbers: the largest relative cost difference from upstream, and our numba DP's
    speed over upstream's at its largest size (bins, then levels): {"diff", "speed", "bins", "levels", "variant"}."""
    diffs = [abs(r["value"]) for r in select(rows, "cost_rel_diff_vs_upstream") if math.isfinite(r["value"])]
    ours = [r for r in select(rows, SPEED) if r["variant"].startswith("ours-numba/")]
    if not diffs or not ours:
        return {}
    top = max(ours, key=lambda r: (float(r["x_value"]), int(r["variant"].split("/K")[-1])))
    return dict(diff=max(diffs), speed=top["value"], bins=int(float(top["x_value"])),
                levels=int(top["variant"].split("/K")[-1]), variant=top["variant"])


def headline(rows) -> str:
    """The claims table's "Gefen's codebook DP is exact" headline."""
    f = fastest(rows)
    return (f"largest relative cost difference from upstream {f['diff']:.1g}; {f['speed']:.0f}× upstream's speed at "
            f"{f['bins']:,} bins × {f['levels']} levels") if f else "Exact optimal codebooks"


def finding(rows):
    """The title: the claims table's headline, then our DP's speed range over upstream's."""
    speed = series(rows, SPEED)
    ups = [v for (impl, _), pts in speed.items() if impl == "ours-numba" for _, v in pts]
    return (f"Our exact codebook DP: {headline(rows)}" + (f" ({min(ups):.1f}× at the smallest)" if ups else ""))


def draw(rows, out, config):
    import matplotlib.pyplot as plt

    fig, axes = new_figure(1, 3, width=16, height=4.9)
    axes = axes[0]
    _lines(axes[0], rows, "dp_cpu_time", "DP CPU time, median (s)", "Exact optimal codebook: DP time")
    _lines(axes[1], rows, "cpu_speedup_vs_upstream", "upstream time / ours (medians)",
           "Speed-up over upstream exact_dp (dotted 10×, dashed 50×)")
    for ref in (10, 50):
        axes[1].axhline(ref, color="gray", lw=0.8, ls=":" if ref == 10 else "--")
    ax, err = axes[2], errors(rows)
    codes = [c for c in CODES if any(k[0] == c for k in err)]
    groups = [g for g in GROUPS if any(k[1:] == g for k in err)]
    width = 0.8 / max(len(codes), 1)
    for ci, code in enumerate(codes):
        xs = [gi + (ci - (len(codes) - 1) / 2) * width for gi in range(len(groups))]
        ax.bar(xs, [err.get((code, *g), float("nan")) for g in groups], width, label=code,
               color=plt.get_cmap("tab10")(ci))
    ax.set_xticks(range(len(groups)), [f"{b}\n{bl}" for b, bl in groups], fontsize=8)
    ax.set(yscale="log", ylabel="sum (m - m_q)^2 / sum m^2")
    ax.set_title("AdamW first moments: quantisation error", fontsize=9)
    legend_below(ax, ncols=2)
    ax.grid(alpha=0.3, axis="y", which="both")
    save_figure(fig, out, finding_title(finding(rows), "", fig))


def _ms(seconds):
    return fmt(seconds * 1e3, 2) + " ms" if seconds < 1 else fmt(seconds, 3) + " s"


def body(rows, config):
    c = config.get("config", {})
    times = series(rows, "dp_cpu_time")
    impls = list(dict.fromkeys(impl for impl, _ in times))
    table = []
    for _, k in sorted({key for key in times if key[0] == "upstream"}, key=lambda x: int(x[1][1:])):
        for bins, up in times[("upstream", k)]:
            t = {i: value(rows, "dp_cpu_time", f"{i}/{k}", x_value=bins) for i in impls}
            speed = " / ".join(fmt(up / t[i], 3) + "×" for i in impls if i != "upstream")
            diff = max(value(rows, "cost_rel_diff_vs_upstream", f"{i}/{k}", x_value=bins)
                       for i in impls if i != "upstream")
            table.append([f"{bins:g} × {k[1:]}"] + [_ms(t[i]) for i in impls] + [speed, fmt(diff, 2)])
    ours = [i for i in impls if i != "upstream"]
    text = [f"CPU-time medians of interleaved repeats, one thread, fp64 DP. The histogram holds the "
            f"block-normalised first gradients of a {c.get('model', 'character model')} with "
            f"{fmt(c.get('n_params'))} parameters.",
            md_table(["bins × levels"] + impls + [f"speed-up {' / '.join(ours)}", "cost rel. diff (max)"], table),
            "The DP is divide and conquer over the Monge property, O(K·B·log B); ours and upstream reach the "
            "same optimum (the last column)."]
    err = errors(rows)
    codes = [code for code in CODES if any(key[0] == code for key in err)]
    if err:
        text.append(f"Learned against fixed codes on AdamW first moments after {c.get('steps', '?')} steps; "
                    "relative quantisation error Σ(m − m̂)²/Σm²:")
        text.append(md_table(["blocking, bits"] + [CODES[code] for code in codes],
                             [[f"{'absmax-256' if bl == 'absmax256' else 'Gefen blocks'}, {b[:-3]}-bit"]
                              + [fmt(err.get((code, b, bl)), 2) for code in codes]
                              for b, bl in GROUPS if any(k[1:] == (b, bl) for k in err)]))
    return "\n\n".join(text)


REPORT = Report("codebook", "codebook_dp", "Gefen's codebook: exact and fast", body, draw,
                metrics=("dp_cpu_time",))

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
