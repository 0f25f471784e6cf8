"""Figure and README section: Gefen's step time as a ratio to fused AdamW's, and the Triton path's work per step.

    python analysis/gefen_speed.py [--results-dir results] [--out paper_figs/gefen_speed.png]

Reads ``gefen_speed.csv`` (experiments/gefen_speed.py). CPU rows: variant ``<model>/<optimizer>``
against ``threads``: ``step_time_median`` (s), ``step_time_vs_adamw``, ``step_time_vs_unfactored``,
``host_us_per_tensor`` (the small-tensor model). Triton path: variant ``<optimizer>`` against
``tensors``: ``device_ops_per_step``, ``launches_per_step``, ``host_syncs_per_step``. GPU rows, where
the run had one: variant ``gpt2-<size>/<optimizer>`` against ``params``.

Figure (one row of panels): the CPU step's speed over fused AdamW's (AdamW's time / ours) per
optimizer (each in its colour, one marker per model; filled at 1 thread, hollow at 2) with the 1x
target (transformer, MLP) and the 0.5x one (small tensors); the Triton path's device operations and
launches per step at each tensor count with the target of 8; the GPU step's speed over AdamW's where
there are GPU rows. The section gives the
same numbers in tables and, for a full run, each target met or missed.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import math
from pathlib import Path

from analysis.common import OPTIMIZERS, Report, colour_of, fmt, main, md_table, select, suptitle, value

# Every target is a speed, as the claims table's: the baseline's step time / ours (above 1: faster).
TARGET_CPU = 1.0  # Gefen's speed over fused AdamW's at 1 thread on the transformer and the MLP
STRETCH_CPU = 1 / 0.7  # a step in 0.7 of fused AdamW's time
TARGET_FACTORED_4BIT = 1 / 1.1  # the 4-bit factored step's speed over the 4-bit unfactored one's (CPU, 1 thread)
TARGET_SMALL = 1.0  # over fused AdamW's on the model of many small tensors (the claim's "≥ 1×" holds for both)
TARGET_COUNT = 8  # device operations, and launches, per step of the Triton path
TARGET_GPU = {"gpt2-125M": 1.0, "gpt2-1.5B": 1 / 0.7}  # whole fp32 step's speed over fused AdamW's
TARGET_GPU_FACTORED = 1 / 1.15  # the factored step's speed over the unfactored one's on the GPU
TARGET_MODELS = ("transformer", "mlp")
SMALL = "small-tensors"
OFFLOAD = "offload-"
MODEL_STYLE = {"transformer": ("o", "0.2"), "mlp": ("s", "0.2"), SMALL: ("^", "0.2"),  # the legend's marker of each model
               "offload-128M-fp32": ("D", "0.2"), "offload-128M-bf16": ("d", "0.2"),
               "offload-512M-fp32": ("P", "0.2"), "offload-512M-bf16": ("X", "0.2")}
# AdamW's steps at offload scale: the fastest of them is the bar a Gefen layout must also meet there
ADAMW_PEERS = ("AdamW", "deepspeed-CPUAdam")
TARGET_OFFLOAD_STRETCH = 1 / 0.7  # speed over fused AdamW's at offload scale (the bytes say 2x)
# sockets the offload projection is made for: (cores, peak GB/s of DDR5-4800 channels, 38.4 GB/s each)
SOCKETS = {"32 cores, 8 × DDR5-4800": (32, 8 * 38.4), "64 cores, 12 × DDR5-4800": (64, 12 * 38.4)}
SUSTAINED = 0.8  # the fraction of a socket's peak bandwidth a streaming step is assumed to reach
SPEED = "speed = fused AdamW's step time / the optimizer's"  # every ratio of the figure
# every layout at 8 and 4 bits: the claims table's speed row and the figure's title
HEADLINE_GEFENS = ("Gefen-8bit", "Gefen-4bit", "Gefen-8bit-factored", "Gefen-4bit-factored", "Gefen-8bit-compact",
                   "Gefen-4bit-compact")
PEER = "0.6"


def _order(names):
    """AdamW, ours, then the peers, each in analysis/common.py's order."""
    def key(n):
        return (n != "AdamW", not _ours(n), OPTIMIZERS.index(n) if n in OPTIMIZERS else len(OPTIMIZERS), n)
    return sorted(dict.fromkeys(names), key=key)


def _split(variant):
    prefix, _, name = variant.rpartition("/")
    return prefix, name


def cpu_rows(rows):
    """The in-cache and small-tensor regimes' rows (per model)."""
    return [r for r in rows if r["x_name"] == "threads" and not r["variant"].startswith((OFFLOAD, "memory/"))]


def offload_rows(rows):
    """The offload regime's rows: variant ``offload-<size>-<gradient dtype>/<optimizer>``."""
    return [r for r in rows if r["x_name"] == "threads" and r["variant"].startswith(OFFLOAD)]


def bandwidth(rows) -> dict:
    """{threads: the STREAM triad's GB/s} of the run."""
    return {int(r["x_value"]): r["value"] for r in select(rows, "bandwidth", "memory/triad")}


def skipped(rows) -> dict:
    """{variant: why it was left out} (``skipped`` rows: the reason in the unit column)."""
    return {r["variant"]: r["unit"] for r in select(rows, "skipped")}


def gpu_rows(rows):
    return [r for r in rows if r["x_name"] == "params"]


def count_sets(rows) -> dict:
    """{device: count rows with the optimizer as variant}: "" for the counts under the interpreter
    (variant ``<optimizer>``), "cuda" for those on CUDA tensors (``cuda/<optimizer>``)."""
    out = {}
    for r in rows:
        if r["x_name"] == "tensors":
            prefix, name = _split(r["variant"])
            out.setdefault(prefix, []).append(dict(r, variant=name))
    return dict(sorted(out.items()))


def count_rows(rows):
    """The counts the figure shows: the interpreter's, else the first device's."""
    sets = count_sets(rows)
    return next(iter(sets.values()), [])


COUNT_WHERE = {"": "CPU tensors under `TRITON_INTERPRET=1`", "cuda": "CUDA tensors"}
COUNT_TITLE = {"": "Triton path (interpreter, CPU tensors)", "cuda": "Triton path on CUDA tensors"}


def models(rows, part=None):
    """The models (or offload sets) of ``part``'s rows (default ``cpu_rows``)."""
    return list(dict.fromkeys(_split(r["variant"])[0] for r in select((part or cpu_rows)(rows), "step_time_vs_adamw")))


def threads(rows, part=None):
    return sorted({int(r["x_value"]) for r in select((part or cpu_rows)(rows), "step_time_vs_adamw")})


def optimizers(rows, part):
    return _order(_split(r["variant"])[1] for r in select(part(rows), "step_time_vs_adamw"))


def _ours(name):
    return name.startswith("Gefen")


def _ratio_axis(ax, values):
    """A log axis of ratios labelled 0.5×, 1×, 2×, ...: ticks at powers of two over a narrow range of
    ``values``, at powers of ten over a wide one."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    vals = [v for v in values if math.isfinite(v) and v > 0]
    wide = max(vals) / min(vals) > 64 if vals else False
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10 if wide else 2))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.2g}×" if v < 1 else f"{v:g}×"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.margins(x=0.08)


def _reference(name):
    return "AdamW (fused, reference)" if name == "AdamW" else name


def _cpu_panel(ax, rows, part=cpu_rows):
    names = [n for n in optimizers(rows, part) if n != "AdamW"]
    ths, mods = threads(rows, part), models(rows, part)
    slots = len(ths) * len(mods)  # one row offset per (model, threads): no two markers on one spot
    for j, m in enumerate(mods):
        marker, colour = MODEL_STYLE.get(m, ("DdPX"[j % 4], "0.2"))
        for k, t in enumerate(ths):
            xs, ys, cs = [], [], []
            for i, n in enumerate(names):
                v = 1 / value(rows, "step_time_vs_adamw", f"{m}/{n}", x_value=t)
                if math.isfinite(v):
                    xs.append(v)
                    ys.append(i + (j * len(ths) + k - (slots - 1) / 2) * 0.8 / slots)
                    cs.append(colour_of(n, PEER))
            filled = k == 0
            ax.scatter(xs, ys, marker=marker, s=26, facecolors=cs if filled else "none", edgecolors=cs,
                       linewidths=1.1, zorder=3)
            ax.scatter([], [], marker=marker, s=26, facecolors=colour if filled else "none", edgecolors=colour,
                       label=f"{m.removeprefix(OFFLOAD)}, {t} thread{'s' if t > 1 else ''}")
    if TARGET_SMALL == TARGET_CPU:
        ax.axvline(TARGET_CPU, color="tab:red", lw=1.2, label=f"target ≥ {TARGET_CPU:g}× (every model)")
    else:
        ax.axvline(TARGET_CPU, color="tab:red", lw=1.2, label=f"target ≥ {TARGET_CPU:g}× (transformer, MLP)")
        ax.axvline(TARGET_SMALL, color="tab:red", lw=1.2, ls="--", label=f"target ≥ {TARGET_SMALL:g}× (small tensors)")
    _ratio_axis(ax, [1 / r["value"] for r in select(part(rows), "step_time_vs_adamw")] + [TARGET_CPU, TARGET_SMALL])
    ax.set_yticks(range(len(names)), names)
    for label, n in zip(ax.get_yticklabels(), names):
        label.set(fontweight="bold" if _ours(n) else "normal", color=colour_of(n, PEER))
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlabel("CPU speed over fused AdamW's (×)")
    ax.set_title("CPU step, fixed gradients\n(one colour per optimizer, one marker per model)" if part is cpu_rows else
                 "CPU step at offload scale, GPT-2 shapes\n(one marker per size and gradient dtype)", fontsize=9)
    ax.grid(alpha=0.3, axis="x", which="both")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, frameon=False)


def _count_panel(ax, rows):
    where = next(iter(count_sets(rows)), "")
    rows = count_rows(rows)
    names = _order(r["variant"] for r in select(rows, "launches_per_step"))
    sizes = sorted({int(r["x_value"]) for r in select(rows, "launches_per_step")})
    styles = {"device_ops_per_step": ("o", "tab:purple", "device ops"), "launches_per_step": ("^", "tab:cyan", "launches")}
    top = max([r["value"] for r in rows if r["metric"] in styles] + [TARGET_COUNT])
    for j, (metric, (marker, colour, what)) in enumerate(styles.items()):
        for k, n_t in enumerate(sizes):
            vals = [value(rows, metric, n, x_value=n_t) for n in names]
            ys = [i + (j * len(sizes) + k - (2 * len(sizes) - 1) / 2) * 0.16 for i in range(len(names))]
            filled = k == len(sizes) - 1
            ax.scatter(vals, ys, marker=marker, s=34, facecolors=colour if filled else "none", edgecolors=colour,
                       linewidths=1.2, zorder=3, label=f"{what}, {n_t} tensors")
    ax.axvline(TARGET_COUNT, color="tab:red", lw=1.2, label=f"target ≤ {TARGET_COUNT}")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlim(-0.5, top * 3)
    ax.set_yticks(range(len(names)), [n if _ours(n) else _reference(n) for n in names])
    for label, n in zip(ax.get_yticklabels(), names):
        label.set(fontweight="bold" if _ours(n) else "normal", color="black" if _ours(n) else PEER)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlabel("per step after the first (symlog scale)")
    ax.set_title(COUNT_TITLE.get(where, f"Triton path on {where} tensors"), fontsize=9)
    ax.grid(alpha=0.3, axis="x", which="both")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, frameon=False)


def _gpu_panel(ax, rows):
    names = [n for n in optimizers(rows, gpu_rows) if n != "AdamW"]
    sets = list(dict.fromkeys(_split(r["variant"])[0] for r in select(gpu_rows(rows), "step_time_vs_adamw")))
    for k, s in enumerate(sets):
        vals = [1 / value(rows, "step_time_vs_adamw", f"{s}/{n}") for n in names]
        ys = [i + (k - (len(sets) - 1) / 2) * 0.22 for i in range(len(names))]
        marker = "os^D"[k % 4]
        ax.scatter(vals, ys, marker=marker, s=34, c=[colour_of(n, PEER) for n in names], zorder=3)
        ax.scatter([], [], marker=marker, s=34, c="0.2", label=s)
    for s in sets:
        if s in TARGET_GPU:
            ax.axvline(TARGET_GPU[s], color="tab:red", lw=1.2, ls="-" if TARGET_GPU[s] == 1 else "--",
                       label=f"target ≥ {TARGET_GPU[s]:.2g}× ({s})")
    _ratio_axis(ax, [1 / r["value"] for r in select(gpu_rows(rows), "step_time_vs_adamw")] + [TARGET_CPU])
    ax.set_yticks(range(len(names)), names)
    for label, n in zip(ax.get_yticklabels(), names):
        label.set(fontweight="bold" if _ours(n) else "normal", color=colour_of(n, PEER))
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlabel("GPU speed over fused AdamW's (×)")
    ax.set_title(f"GPU step, fp32, GPT-2 shapes\n{_device(gpu_rows(rows))}", fontsize=9)
    ax.grid(alpha=0.3, axis="x", which="both")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, frameon=False)


def _offload_panel(ax, rows):
    _cpu_panel(ax, rows, offload_rows)


def _device(rows):
    return rows[0]["device"].removeprefix("cuda:") if rows else "?"


def figure(rows):
    """The figure (not saved): one panel per part the run has."""
    import matplotlib.pyplot as plt

    panels = [p for p, have in ((_cpu_panel, cpu_rows(rows)), (_offload_panel, offload_rows(rows)),
                                (_count_panel, count_rows(rows)), (_gpu_panel, gpu_rows(rows))) if have]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.6), layout="constrained", squeeze=False)
    for ax, panel in zip(axes[0], panels):
        panel(ax, rows)
    from analysis.common import finding_title

    head, _, setup = finding(rows).partition("\n")
    suptitle(fig, finding_title(head, setup, fig), fontsize=9)
    return fig


def finding(rows):
    """The title: the speed of the published and factored Gefens' CPU step at one thread over fused
    AdamW's, on the large-tensor models and on the small-tensor one (the claims table's row)."""
    from experiments.gefen_speed import SMALL_TENSORS

    def speeds(models):
        vals = [1 / value(rows, "step_time_vs_adamw", f"{m}/{n}", x_value=1.0) for m in models for n in HEADLINE_GEFENS]
        return [v for v in vals if math.isfinite(v)]

    large, small = speeds(TARGET_MODELS), speeds([SMALL])
    if not large:
        return "Gefen's step against fused AdamW's"
    text = f"Gefen's CPU step at 1 thread: {min(large):.2f}–{max(large):.2f}× fused AdamW's speed on large tensors"
    if small:
        text += f", {min(small):.2f}–{max(small):.2f}× on {SMALL_TENSORS} small ones"
    return (text + f"\n(8/4-bit, published, factored and compact; {SPEED}; targets ≥ {TARGET_CPU:g}× on the transformer "
            f"and MLP, ≥ {TARGET_SMALL:g}× on small tensors)")


def draw(rows, out, config):
    import matplotlib.pyplot as plt

    fig = figure(rows)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)  # laid out by the figure's constrained layout (save_figure's tight one replaces it)
    plt.close(fig)


# ----------------------------------------------------------------------------------------- section
def _cell(rows, variant, t):
    r, s = value(rows, "step_time_vs_adamw", variant, x_value=t), value(rows, "step_time_median", variant, x_value=t)
    return f"{fmt(1 / r)}× ({fmt(s * 1e3)} ms)" if math.isfinite(r) else "—"


def _cpu_tables(rows):
    ths, mods = threads(rows), models(rows)
    head = ["optimizer"] + [f"{m}, {t} thr." for t in ths for m in mods]
    body = [[f"**{n}**" if _ours(n) else n] + [_cell(rows, f"{m}/{n}", t) for t in ths for m in mods]
            for n in optimizers(rows, cpu_rows)]
    text = ["Speed over fused AdamW's (its median step time / the optimizer's; the median step in ms):\n\n"
            + md_table(head, body)]
    fact = [n for n in optimizers(rows, cpu_rows) if n.endswith("-factored")]
    if fact:
        head = ["optimizer"] + [f"{m}, {t} thr." for t in ths for m in mods]
        body = [[n] + [fmt(1 / value(rows, "step_time_vs_unfactored", f"{m}/{n}", x_value=t)) for t in ths for m in mods]
                for n in fact]
        text.append("The factored step's speed over the unfactored one's of the same bits:\n\n" + md_table(head, body))
    if SMALL in mods:
        body = [[n] + [fmt(value(rows, "host_us_per_tensor", f"{SMALL}/{n}", x_value=t)) for t in ths]
                for n in optimizers(rows, cpu_rows)]
        text.append("Microseconds per tensor on the small-tensor model (step median / tensors):\n\n"
                    + md_table(["optimizer"] + [f"{t} thr." for t in ths], body))
    return text


def _traffic_table(rows, part, sets):
    """ns per parameter, effective GB/s and the bytes floor of every optimizer in ``sets``."""
    ths = threads(rows, part)
    head = ["optimizer", "floor B/param"] + [f"{m}, {t} thr." for t in ths for m in sets]
    body = []
    for n in optimizers(rows, part):
        floors = {fmt(value(rows, "bytes_floor", f"{m}/{n}", x_value=t)) for t in ths for m in sets} - {"—"}
        body.append([f"**{n}**" if _ours(n) else n, " / ".join(sorted(floors)) or "—"]
                    + [_traffic_cell(rows, f"{m}/{n}", t) for t in ths for m in sets])
    return md_table(head, body)


def _traffic_cell(rows, variant, t):
    ns, gbps = (value(rows, m, variant, x_value=t) for m in ("ns_per_param", "gbps_effective"))
    return f"{fmt(ns)} ns ({fmt(gbps)} GB/s)" if math.isfinite(ns) else "—"


def fastest_adamw(rows, prefix, t) -> float:
    """The median step time of the fastest of ``ADAMW_PEERS`` in one set and thread count."""
    times = [value(rows, "step_time_median", f"{prefix}/{n}", x_value=t) for n in ADAMW_PEERS]
    return min((x for x in times if math.isfinite(x)), default=math.nan)


def projection(rows, prefix) -> dict:
    """{socket: {optimizer: its projected step time over fused AdamW's}} of one offload set: a
    roofline from the measured 1-thread time per parameter (the work of one core) and the bytes
    floor, max(t1 / cores, floor / (SUSTAINED * peak bandwidth)) for each optimizer."""
    out = {}
    for socket, (cores, peak) in SOCKETS.items():
        proj = {}
        for n in optimizers(rows, offload_rows):
            t1, floor = (value(rows, m, f"{prefix}/{n}", x_value=1) for m in ("ns_per_param", "bytes_floor"))
            proj[n] = max(t1 / cores, floor / (SUSTAINED * peak))
        out[socket] = {n: t / proj["AdamW"] for n, t in proj.items() if "AdamW" in proj}
    return out


def best_gbps(rows, prefix, t) -> float:
    """The bandwidth one offload set and thread count is known to reach: the STREAM triad's, or the
    highest any optimizer's step moved there (the triad counts 24 B an element but, writing a
    fresh array, moves more; a read-modify-write step can go faster than it)."""
    moved = [r["value"] for r in select(offload_rows(rows), "gbps_effective", x_value=t)
             if _split(r["variant"])[0] == prefix]
    return max((x for x in [bandwidth(rows).get(t, math.nan), *moved] if math.isfinite(x)), default=math.nan)


def _offload_tables(rows):
    o, sets, ths = offload_rows(rows), models(rows, offload_rows), threads(rows, offload_rows)
    bw = bandwidth(rows)
    body = []
    for prefix in sets:
        for t in ths:
            fastest, best = fastest_adamw(o, prefix, t), best_gbps(rows, prefix, t)
            for n in optimizers(rows, offload_rows):
                v = f"{prefix}/{n}"
                med = value(o, "step_time_median", v, x_value=t)
                if not math.isfinite(med):
                    continue
                body.append([prefix.removeprefix(OFFLOAD), f"**{n}**" if _ours(n) else n, t,
                             fmt(value(o, "ns_per_param", v, x_value=t)),
                             fmt(1 / value(o, "step_time_vs_adamw", v, x_value=t)), fmt(fastest / med),
                             fmt(value(o, "gbps_effective", v, x_value=t)), fmt(value(o, "bytes_floor", v, x_value=t)),
                             fmt(value(o, "bytes_floor", v, x_value=t) / best),
                             fmt(value(rows, "transient_bytes", v) / 2**20)])
    n_params = {prefix: value(rows, "params", f"{prefix}/AdamW", x_value=ths[0]) for prefix in sets}
    text = [f"Offload scale: one fp32 parameter set of GPT-2's shapes shared by every optimizer (each with its own "
            f"state; {', '.join(f'{k.removeprefix(OFFLOAD)}: {fmt(v)} parameters' for k, v in n_params.items())}), "
            "gradients with rows of different scale in fp32 or bf16 (AdamW's bf16 rows time the cast into an fp32 "
            "buffer and its step: fused AdamW refuses bf16 gradients on fp32 weights). STREAM triad in the same run: "
            + ", ".join(f"{fmt(b)} GB/s at {t} thread{'s' if t > 1 else ''}" for t, b in bw.items())
            + ". Speed × fastest AdamW: over the faster of fused AdamW and DeepSpeed's CPU-Adam; floor: the bytes one "
            "pass over weights (read, written), gradient (read) and state (read, written) moves, and its time at "
            "the highest bandwidth known for the set and thread count (the triad's, or the most any step there "
            "moved, where that is more); transient: tensor bytes one step allocates beyond weights, gradients and "
            "state.\n\n" + md_table(["set", "optimizer", "threads", "ns/param", "speed × AdamW",
                                          "speed × fastest AdamW", "GB/s", "floor B/param", "floor ns", "transient MiB"],
                                         body)]
    if 1 in ths:
        head = ["optimizer"] + [f"{p.removeprefix(OFFLOAD)}, {k.split(',')[0]}" for p in sets for k in SOCKETS]
        proj = {p: projection(o, p) for p in sets}
        body = [[f"**{n}**" if _ours(n) else n] + [fmt(proj[p][k].get(n, math.nan)) for p in sets for k in SOCKETS]
                for n in optimizers(rows, offload_rows)]
        text.append("A projection, not a measurement: the step time over fused AdamW's on a "
                    + " and a ".join(SOCKETS) + " socket (peak bandwidth 38.4 GB/s a channel, "
                    f"{SUSTAINED:.0%} of it sustained), each optimizer's time max(its 1-thread ns per parameter / "
                    "cores, its floor bytes / bandwidth): a step bound by its bytes at scale runs at the ratio of its "
                    "floor to AdamW's.\n\n" + md_table(head, body))
    return text


def _skipped_lines(rows):
    return "\n".join(f"- {v}: left out ({why})" for v, why in skipped(rows).items())


def _count_table(rows, where=""):
    names = _order(r["variant"] for r in select(rows, "launches_per_step"))
    sizes = sorted({int(r["x_value"]) for r in select(rows, "launches_per_step")})
    head = (["optimizer"] + [f"device ops, {n} tensors" for n in sizes] + [f"launches, {n} tensors" for n in sizes]
            + ["host syncs"])
    body = [[f"**{n}**" if _ours(n) else _reference(n)]
            + [fmt(value(rows, m, n, x_value=s)) for m in ("device_ops_per_step", "launches_per_step") for s in sizes]
            + [fmt(max(value(rows, "host_syncs_per_step", n, x_value=s) for s in sizes))] for n in names]
    return (f"The Triton path (`backend=\"triton\"`, {COUNT_WHERE.get(where, where + ' tensors')}): torch operations "
            "that launch work on a device (views, profiler markers and bare allocations aside), issued outside "
            "the kernel launches, and launches, per step after the first (the largest of the counted steps); "
            "host syncs: values read back or shapes that depend on data.\n\n" + md_table(head, body))


def _gpu_table(rows):
    g = gpu_rows(rows)
    sets = list(dict.fromkeys(_split(r["variant"])[0] for r in select(g, "step_time_vs_adamw")))
    body = []
    for s in sets:
        n_params = select(g, "step_time_median", f"{s}/AdamW") or select(g, "step_time_median")
        for n in optimizers(rows, gpu_rows):
            v = f"{s}/{n}"
            if not select(g, "step_time_median", v):
                continue
            body.append([s, f"**{n}**" if _ours(n) else n, fmt(1e3 * value(g, "step_time_median", v)),
                         fmt(1 / value(g, "step_time_vs_adamw", v)), fmt(1 / value(g, "step_time_vs_unfactored", v)),
                         fmt(1e3 * value(g, "host_time_median", v))])
    params = fmt(n_params[0]["x_value"]) if n_params else "?"
    return (f"GPU ({_device(g)}), fp32 parameters of GPT-2's shapes ({params} in the first set), whole `step()` "
            "timed with CUDA events, interleaved; host time: the call's wall time without synchronisation:\n\n"
            + md_table(["set", "optimizer", "step (ms)", "speed × AdamW", "speed × unfactored", "host (ms)"], body))


def _met(ok):
    return "met" if ok else "missed"


def _count_verdicts(c, where):
    out = []
    on = "" if not where else f" on {COUNT_WHERE.get(where, where + ' tensors')}"
    for n in [n for n in _order(r["variant"] for r in select(c, "launches_per_step")) if _ours(n)]:
        ops = {int(r["x_value"]): r["value"] for r in select(c, "device_ops_per_step", n)}
        launches = {int(r["x_value"]): r["value"] for r in select(c, "launches_per_step", n)}
        bound = max(ops.values()) <= TARGET_COUNT and max(launches.values()) <= TARGET_COUNT
        same = len(set(ops.values())) == 1 and len(set(launches.values())) == 1
        # launches are one per kind of tensor (block length, dtypes): a model with one more block
        # length has one more, whatever its number of tensors; growth with tensors is what fails
        grows = any(a[k] < a[j] for a in (ops, launches) for k in a for j in a if k < j)
        out.append(f"- {n}, Triton path{on}: " + ", ".join(f"{fmt(ops[k])} device ops and {fmt(launches[k])} launches "
                                                           f"at {k} tensors" for k in sorted(ops))
                   + f" (target ≤ {TARGET_COUNT} each: {_met(bound)}; the same at every tensor count: {_met(same)}"
                   + ("" if same or grows else ", fewer at more tensors: one launch per block length of the model")
                   + ").")
    return out


def _offload_verdicts(rows):
    o, out = offload_rows(rows), []
    for prefix in models(rows, offload_rows):
        for t in threads(rows, offload_rows):
            fastest = fastest_adamw(o, prefix, t)
            for n in [n for n in optimizers(rows, offload_rows) if _ours(n)]:
                v = f"{prefix}/{n}"
                r = 1 / value(o, "step_time_vs_adamw", v, x_value=t)
                f = fastest / value(o, "step_time_median", v, x_value=t)
                out.append(f"- {n}, {prefix.removeprefix(OFFLOAD)}, {t} thread{'s' if t > 1 else ''}: {fmt(r)}× fused "
                           f"AdamW's speed (target ≥ {TARGET_CPU:g}×: {_met(r >= TARGET_CPU)}; stretch ≥ "
                           f"{TARGET_OFFLOAD_STRETCH:.2g}×: {_met(r >= TARGET_OFFLOAD_STRETCH)}), {fmt(f)}× the fastest "
                           f"AdamW's (target ≥ 1×: {_met(f >= 1)}).")
    return out


def verdicts(rows):
    out = []
    gefen = [n for n in optimizers(rows, cpu_rows) if _ours(n)]
    if 1 in threads(rows):
        for m in [m for m in models(rows) if m in TARGET_MODELS]:
            for n in gefen:
                r = 1 / value(rows, "step_time_vs_adamw", f"{m}/{n}", x_value=1)
                out.append(f"- {n} on {m}, 1 thread: {fmt(r)}× fused AdamW's speed (target ≥ {TARGET_CPU:g}×: "
                           f"{_met(r >= TARGET_CPU)}; stretch ≥ {STRETCH_CPU:.2g}×: {_met(r >= STRETCH_CPU)}).")
            r = 1 / value(rows, "step_time_vs_unfactored", f"{m}/Gefen-4bit-factored", x_value=1)
            if math.isfinite(r):
                out.append(f"- Gefen-4bit-factored on {m}, 1 thread: {fmt(r)}× Gefen-4bit's speed (target ≥ "
                           f"{TARGET_FACTORED_4BIT:.2g}×: {_met(r >= TARGET_FACTORED_4BIT)}).")
        if SMALL in models(rows):
            for n in gefen:
                r = 1 / value(rows, "step_time_vs_adamw", f"{SMALL}/{n}", x_value=1)
                out.append(f"- {n} on 160 small tensors, 1 thread: {fmt(r)}× fused AdamW's speed (target ≥ "
                           f"{TARGET_SMALL:g}×: {_met(r >= TARGET_SMALL)}).")
    out += _offload_verdicts(rows)
    for where, c in count_sets(rows).items():
        out += _count_verdicts(c, where)
    g = gpu_rows(rows)
    for s in dict.fromkeys(_split(r["variant"])[0] for r in select(g, "step_time_vs_adamw")):
        for n in [n for n in optimizers(rows, gpu_rows) if _ours(n)]:
            r, f = (1 / value(g, m, f"{s}/{n}") for m in ("step_time_vs_adamw", "step_time_vs_unfactored"))
            line = f"- {n} on the GPU, {s}: {fmt(r)}× fused AdamW's speed"
            if s in TARGET_GPU:
                line += f" (target ≥ {TARGET_GPU[s]:.2g}×: {_met(r >= TARGET_GPU[s])})"
            if math.isfinite(f):
                line += (f"; {fmt(f)}× the unfactored's speed (target ≥ {TARGET_GPU_FACTORED:.2g}×: "
                         f"{_met(f >= TARGET_GPU_FACTORED)})")
            out.append(line + ".")
    return out


def body(rows, config):
    c = config.get("config", {})
    text = []
    if cpu_rows(rows):
        text.append(f"CPU: median of {c.get('repeats', '?')} interleaved steps on fixed gradients (every optimizer "
                    "once per repeat, shuffled), each optimizer on its own copy of the model after its first step, "
                    "at each torch thread count (ours runs its numba kernels on as many). Models: the transformer and "
                    "MLP of gefen_memory and 40 × (Linear(64, 64) + LayerNorm(64)), 160 tensors. Ratios are to fused "
                    "AdamW's median of the same interleaved run.")
        text += _cpu_tables(rows)
        if select(cpu_rows(rows), "ns_per_param"):
            text.append("Time per parameter and effective bandwidth (the floor's bytes over the step's time) in the "
                        "same runs:\n\n" + _traffic_table(rows, cpu_rows, models(rows)))
    if offload_rows(rows):
        text += _offload_tables(rows)
    if skipped(rows):
        text.append(_skipped_lines(rows))
    for where, counted in count_sets(rows).items():
        text.append(_count_table(counted, where))
    if gpu_rows(rows):
        text.append(_gpu_table(rows))
    if c.get("dry_run"):
        text.append("A `--dry-run` (the GPU part's code on CPU tensors under the interpreter): no measurement, "
                    "no verdicts.")
    elif c.get("quick"):
        text.append("A `--quick` run (smaller models, few repeats): a smoke test, no verdicts.")
    else:
        text.append("\n".join(verdicts(rows)))
    return "\n\n".join(t for t in text if t)


REPORT = Report("gefen_speed", "gefen_speed", "Gefen: step time against fused AdamW (CPU, Triton path, GPU)", body,
                draw, metrics=("step_time_vs_adamw",))


if __name__ == "__main__":
    main(REPORT, doc=__doc__)
