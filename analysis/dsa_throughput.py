"""Figure and README section: Disk Sparse Adam throughput and memory against SparseAdam and the ceiling.

    python analysis/dsa_throughput.py [--results-dir results] [--out paper_figs/dsa_throughput.png]

Reads ``dsa_throughput.csv``: variants ``<config>/<what>`` with ``x_name="config"`` (configs such as
``seed`` and ``kg``). Left panel: samples/s per config for the ceiling (forward and backward, no
optimizer), SparseAdam with moments in RAM, DiskSparseAdam warm (default and ``bitwise=False``) and
cold, with the cold bound from the disk's 4 KiB random-read rate. Right panel: optimizer-state
memory in anonymous RAM and on disk. The section gives the same numbers, the ratios the experiment
measured interleaved in one run, and each target met or missed.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import matplotlib.ticker

from analysis.common import Report, fmt, main, md_table, save_figure, select, value

BARS = [("ceiling", "no optimizer (ceiling)"), ("SparseAdam", "SparseAdam (RAM)"),
        ("SparseAdam/fresh", "SparseAdam fresh"), ("DiskSparseAdam/fresh", "DSA fresh"),
        ("DiskSparseAdam/warm", "DSA warm"), ("DiskSparseAdam/warm-fused", "DSA warm, `bitwise=False`"),
        ("DiskSparseAdam/cold", "DSA cold")]
MEMORY = [("SparseAdam", "state_bytes_in_ram", 1.0, "SparseAdam state (RAM)"),
          ("DiskSparseAdam", "rss_anon_delta", 2.0**20, "DiskSparseAdam anonymous RSS"),
          ("DiskSparseAdam", "bytes_on_disk", 1.0, "DiskSparseAdam on disk")]
# (ratio metric the experiment writes, label, the least ratio that meets the target)
TARGETS = [("DiskSparseAdam_fresh/SparseAdam_fresh", "fresh / SparseAdam fresh", 3.0),
           ("DiskSparseAdam_warm/SparseAdam", "warm / SparseAdam", 2.5),
           ("DiskSparseAdam_warm/ceiling", "warm / ceiling", 0.5),
           ("DiskSparseAdam_cold/disk_bound", "cold / disk bound", 0.5)]
FUSED = {"DiskSparseAdam_warm/SparseAdam": "DiskSparseAdam_warm_fused/SparseAdam",
         "DiskSparseAdam_warm/ceiling": "DiskSparseAdam_warm_fused/ceiling"}


def configs(rows):
    return list(dict.fromkeys(r["x_value"] for r in rows if r["x_name"] == "config"))


def get(rows, config, what, metric):
    return value(rows, metric, f"{config}/{what}", x_value=config)


CONFIG_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"]


def _rows_of_bars(ax, rows, cfgs, items, value_of):
    """Horizontal bars: one row per item (label down the y axis), one bar per config."""
    height = 0.8 / len(cfgs)
    for i, c in enumerate(cfgs):
        ys = [j + (i - (len(cfgs) - 1) / 2) * height for j in range(len(items))]
        ax.barh(ys, [value_of(c, item) for item in items], height, color=CONFIG_COLOURS[i % 4], label=c)
    ax.set_ylim(len(items) - 0.5, -0.5)
    ax.set_xscale("log")
    ax.grid(alpha=0.3, axis="x", which="both")
    ax.tick_params(labelsize=8)


HEADLINE_CONFIGS = ("seed", "kg")  # the tables the claims table quotes, in its order
GPU = "gpu/dsa_gpu"  # the GPU run's device memory, read beside this run


def speeds(rows) -> dict:
    """{"warm", "fresh", "cold": [Disk Sparse Adam's samples/s ÷ SparseAdam's per ``HEADLINE_CONFIGS``]}:
    warm and fresh against SparseAdam in the same condition, cold against SparseAdam (its state in RAM)."""
    cold = [value(rows, "throughput", f"{c}/DiskSparseAdam/cold") / value(rows, "throughput", f"{c}/SparseAdam")
            for c in HEADLINE_CONFIGS]
    return {"warm": [get(rows, c, "ratio", "DiskSparseAdam_warm/SparseAdam") for c in HEADLINE_CONFIGS],
            "fresh": [get(rows, c, "ratio", "DiskSparseAdam_fresh/SparseAdam_fresh") for c in HEADLINE_CONFIGS],
            "cold": cold}


def speed_headline(rows) -> str:
    """The claims table's "DSA is faster than SparseAdam on CPU"."""
    return ", ".join(f"{k} {' / '.join(f'{x:.2f}×' for x in v)}" for k, v in speeds(rows).items()) + \
        " SparseAdam (seed / KG)"


def memory_headline(rows, gpu_rows) -> str:
    """The claims table's "DSA state costs no accelerator memory": the GPU run's device memory over the
    weights and this run's anonymous RAM (seed)."""
    dsa, ref = (value(gpu_rows, "device_memory_over_weights", n) for n in ("DiskSparseAdam", "SparseAdam"))
    anon = get(rows, "seed", "DiskSparseAdam", "rss_anon_delta")
    return (f"GPU memory beyond the weights: {dsa:.1f} MiB (SparseAdam {ref:.1f} MiB); {anon:.1f} MiB of anonymous "
            "RAM on CPU (seed)")


def finding(rows, cfgs, gpu_rows=None):
    """The title: the claims table's two headlines (speeds; memory where the GPU run is beside)."""
    head = "Disk Sparse Adam: " + speed_headline(rows)
    return head + (f"; {memory_headline(rows, gpu_rows)}" if gpu_rows else "")


def draw(rows, out, config):
    from analysis.common import finding_title, legend_below, new_figure

    cfgs = configs(rows)
    fig, axes = new_figure(1, 2, width=12, height=3.9, gridspec_kw={"width_ratios": [3, 2]})
    ax, axm = axes[0]
    _rows_of_bars(ax, rows, cfgs, TARGETS, lambda c, t: get(rows, c, "ratio", t[0]))
    ax.set_yticks(range(len(TARGETS)), [f"{label} (target ≥ {least:g}×)" for _, label, least in TARGETS], fontsize=8)
    ax.scatter([least for _, _, least in TARGETS], range(len(TARGETS)), marker="|", s=500, color="#2ca02c",
               linewidths=2, zorder=4, label="target")
    ax.axvline(1, color="black", linewidth=1)
    ax.set_xlabel("Disk Sparse Adam's samples/s ÷ the reference (log scale; black: 1×)", fontsize=8)
    ax.set_title("throughput relative to SparseAdam, the ceiling and the disk's bound", fontsize=9)
    ax.set_xticks([0.25, 0.5, 1, 2, 4], ["0.25×", "0.5×", "1×", "2×", "4×"])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    legend_below(ax, ncols=len(cfgs) + 1)
    _rows_of_bars(axm, rows, cfgs, MEMORY, lambda c, m: get(rows, c, m[0], m[1]) * m[2] / 2**20)
    axm.set_yticks(range(len(MEMORY)), [label.replace("DiskSparseAdam", "DSA") for *_, label in MEMORY], fontsize=8)
    axm.set_xlabel("MiB (log scale)", fontsize=8)
    axm.set_title("optimizer state memory", fontsize=9)
    legend_below(axm, ncols=len(cfgs))
    gpu_rows = (config.get("other_rows") or {}).get(GPU)
    save_figure(fig, out, title=finding_title(finding(rows, cfgs, gpu_rows), "configs: " + ", ".join(cfgs), fig))


def _describe(cfg):
    return f"{cfg['name']}: {cfg['rows']:,} × {cfg['dim']}, batch {cfg['batch']:,}"


def body(rows, config):
    c = config.get("config", {})
    cfgs = configs(rows)
    shapes = [_describe(x) for x in c.get("configs", []) if {"name", "rows", "dim", "batch"} <= set(x)]
    text = []
    if shapes:
        text.append("Configs: " + "; ".join(shapes) + ".")
    text.append(f"Throughput in samples/s, median of {c.get('reps', '?')} interleaved repeats; "
                f"{c.get('threads', '?')} torch thread(s). Ratios are the experiment's, measured in the same run "
                "(in parentheses: `bitwise=False`).")
    head = ["config"] + [label for _, label in BARS] + ["cold bound (disk)"] + [t[1] for t in TARGETS]
    table = []
    for cfg in cfgs:
        ratios = []
        for metric, _, _ in TARGETS:
            cell = fmt(get(rows, cfg, "ratio", metric))
            if metric in FUSED and select(rows, FUSED[metric], f"{cfg}/ratio"):
                cell += f" ({fmt(get(rows, cfg, 'ratio', FUSED[metric]))})"
            ratios.append(cell)
        table.append([cfg] + [fmt(get(rows, cfg, w, "throughput")) for w, _ in BARS]
                     + [fmt(get(rows, cfg, "disk", "cold_bound"))] + ratios)
    text.append(md_table(head, table))
    first = [[cfg] + [fmt(get(rows, cfg, f"{o}/fresh", "throughput_with_construction")) for o in ("SparseAdam", "DiskSparseAdam")]
             + [fmt(get(rows, cfg, "DiskSparseAdam/fresh", "throughput_with_construction")
                    / get(rows, cfg, "SparseAdam/fresh", "throughput_with_construction"))]
             for cfg in cfgs if select(rows, "throughput_with_construction", f"{cfg}/DiskSparseAdam/fresh")]
    if first:
        text.append(f"Where users start, a new optimizer (DSA on a new state_dir): samples/s over its first "
                    f"{c.get('fresh_steps', '?')} steps with its construction counted, median of "
                    f"{c.get('fresh_reps', '?')} (target: DSA ≥ 2× SparseAdam).\n\n"
                    + md_table(["config", "SparseAdam", "DiskSparseAdam", "ratio"], first))
    mem = md_table(["config"] + [label for *_, label in MEMORY],
                   [[cfg] + [f"{fmt(get(rows, cfg, w, m) * s / 2**20)} MiB" for w, m, s, _ in MEMORY]
                    for cfg in cfgs])
    text.append("Optimizer-state memory: SparseAdam's moments live in anonymous RAM; DiskSparseAdam adds "
                "scratch buffers to anonymous memory and keeps its moments in files that the page cache "
                "may hold.\n\n" + mem)
    verdicts = []
    for metric, label, target in TARGETS:
        got = {cfg: get(rows, cfg, "ratio", metric) for cfg in cfgs}
        met = [cfg for cfg, v in got.items() if v >= target]
        missed = [cfg for cfg in got if cfg not in met]
        verdicts.append(f"- {label} ≥ {fmt(target)}: " + "; ".join(
            [f"met on {', '.join(met)}"] * bool(met) + [f"missed on {', '.join(missed)}"] * bool(missed)) + ".")
    text.append("Targets (cold / disk bound ≥ 0.5 means within 2× of the disk's random-read bound):\n\n"
                + "\n".join(verdicts))
    text.append("The cold bound is the disk's measured 4 KiB random-read rate one read at a time, at one page per "
                "touched row. A cold step issues all of its rows' reads together (posix_fadvise WILLNEED), so it can "
                "pass that bound; dsa_out_of_core.py measures it against the disk's parallel rate.")
    return "\n\n".join(text)


REPORT = Report("dsa_throughput", "dsa_throughput", "Disk Sparse Adam: throughput and memory", body, draw,
                metrics=("throughput", "cold_bound"), reads=(GPU,))

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
