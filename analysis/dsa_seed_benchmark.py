"""Figure and README section: the Disk Sparse Adam seed's own benchmark, reproduced end to end.

    python analysis/dsa_seed_benchmark.py [--results-dir results] [--out paper_figs/dsa_seed_benchmark.png]

Reads ``dsa_seed_benchmark.csv``: per optimizer (variant) and epoch (``x_name="epoch"``) the
metrics ``loss``, ``throughput``, ``peak_rss``, ``bytes_on_disk`` and ``accelerator_memory``.
Figure: the loss per epoch (log scale) with the seed's two reported losses, and samples/s per epoch.
Section: a table per epoch and the verdict on the seed's numbers.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    import _install_check  # noqa: F401

from analysis.common import Report, fmt, main, md_table, save_figure, select, variants

OURS, GEOOPT = "DiskSparseRiemannianAdam", "geoopt-SparseRiemannianAdam"


def series(rows, metric, variant):
    return sorted((int(r["x_value"]), r["value"]) for r in select(rows, metric, variant, x_name="epoch"))


def draw(rows, out, config):
    from analysis.common import figure_legend, finding_title, new_figure, styles

    seed_loss = {int(k): v for k, v in config.get("config", {}).get("seed_loss", {}).items()}
    fig, axes = new_figure(1, 2, width=11, height=4.2)
    ax, axt = axes[0]
    names = variants(rows, "loss")
    look = styles(names, baseline="SparseAdam")
    base = dict(series(rows, "throughput", "SparseAdam"))
    for v in names:
        ax.plot(*zip(*series(rows, "loss", v)), "o-" if v == OURS else "x--", label=v, **look[v])
        pts = [(e, t / base[e]) for e, t in series(rows, "throughput", v) if base.get(e)]
        if pts:
            axt.plot(*zip(*pts), "o-" if v == OURS else "x--", **look[v])
    if seed_loss:
        ax.plot(list(seed_loss), list(seed_loss.values()), "k*", ms=12, label="the seed's reported loss")
    ax.set_yscale("log")
    ax.set(xlabel="epoch", ylabel="mean loss over the epoch (log scale)")
    axt.axhline(1, color="black", linewidth=1)
    axt.set(xlabel="epoch", ylabel="samples / s ÷ SparseAdam's (black: 1×)")
    for a in (ax, axt):
        a.grid(alpha=0.3)
    figure_legend(fig, ncols=4, fontsize=8)
    save_figure(fig, out, finding_title(finding(rows), "The seed's benchmark: 1M x 128 on the Poincaré ball, "
                                                       "batch 2048", fig))


def finding(rows):
    """The title: our samples/s × SparseAdam's, median over epochs."""
    import statistics

    base = dict(series(rows, "throughput", "SparseAdam"))
    ratio = [t / base[e] for e, t in series(rows, "throughput", OURS) if base.get(e)]
    return (f"{OURS}: {statistics.median(ratio):.2f}× SparseAdam's samples/s (median over epochs)" if ratio
            else "The seed's benchmark")


def body(rows, config):
    c = config.get("config", {})
    names = variants(rows, "loss")
    epochs = sorted({int(r["x_value"]) for r in select(rows, "loss")})
    head = ["epoch"] + [f"{v} loss" for v in names] + [f"{v} samples/s" for v in names]
    table = [[e] + [fmt(dict(series(rows, "loss", v)).get(e), 3) for v in names]
             + [fmt(dict(series(rows, "throughput", v)).get(e)) for v in names] for e in epochs]
    last = epochs[-1]
    mem = md_table(["optimizer", "peak RSS (MiB)", "state on disk (MiB)", "accelerator memory (MiB)"],
                   [[v, fmt(dict(series(rows, "peak_rss", v))[last]),
                     fmt(dict(series(rows, "bytes_on_disk", v))[last] / 2**20),
                     fmt(dict(series(rows, "accelerator_memory", v))[last])] for v in names])
    text = [(f"The seed's setup: {fmt(c.get('rows'))} entities × {c.get('dim', '?')}, batch {c.get('batch', '?')}, "
             f"{c.get('epochs', '?')} epochs of one random permutation each, loss `emb(idx).pow(2).sum(-1).mean()` "
             f"from weights N(0, 1e-3²), lr {c.get('lr', '?')}, {c.get('threads', '?')} thread(s), device "
             f"{c.get('device', '?')}; each optimizer in its own process."), md_table(head, table), mem]
    seed_loss = {int(k): v for k, v in c.get("seed_loss", {}).items()}
    if OURS in names and seed_loss:
        ours = dict(series(rows, "loss", OURS))
        got = ", ".join(f"epoch {e}: {fmt(ours.get(e), 3)} (seed {fmt(v, 3)})" for e, v in seed_loss.items())
        rate = [r for _, r in series(rows, "throughput", OURS)]
        geo = dict(series(rows, "loss", GEOOPT)) if GEOOPT in names else {}
        same = max((abs(ours[e] - geo[e]) / geo[e] for e in ours if e in geo), default=None)
        text.append(
            f"Loss of DiskSparseRiemannianAdam: {got}. "
            + (f"It follows geoopt's SparseRiemannianAdam to a relative {fmt(same)} at every epoch. " if same is not None
               else "")
            + f"Throughput: {fmt(min(rate))} to {fmt(max(rate))} samples/s per epoch on {config.get('device', '?')} "
            f"(the first epoch includes loading the compiled kernels), against the seed's "
            f"{fmt(c.get('seed_throughput'))} on a Kaggle GPU (a GPU's figure at the seed's configuration is "
            "bench_dsa_gpu.py's, results/gpu/dsa_gpu.csv).")
    return "\n\n".join(text)


REPORT = Report("dsa_seed_benchmark", "dsa_seed_benchmark", "The seed's own benchmark, end to end", body, draw,
                metrics=("loss", "throughput"))

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
