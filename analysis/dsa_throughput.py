"""Figure: Disk Sparse Adam throughput and memory against SparseAdam and the no-optimizer ceiling.

    python analysis/dsa_throughput.py            # results/dsa_throughput.csv -> paper_figs/dsa_throughput.png

Reads only ``results/dsa_throughput.csv`` (written by ``experiments/dsa_throughput.py``), the most
recent run of each variant. Left: samples/s per configuration for the ceiling (forward+backward, no
optimizer), SparseAdam with moments in RAM, DiskSparseAdam with a warm and a cold page cache, and the
cold bound implied by the disk's 4 KiB random-read rate. Right: optimizer-state bytes in anonymous
memory (what competes with the model for RAM) and on disk.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.common import add_analysis_args, latest_run, read_results, save_figure  # noqa: E402

BARS = [("ceiling", "no optimizer (ceiling)"), ("SparseAdam", "torch SparseAdam (RAM)"),
        ("DiskSparseAdam/warm", "DiskSparseAdam, warm cache"),
        ("DiskSparseAdam/warm-fused", "DiskSparseAdam, warm, bitwise=False"),
        ("DiskSparseAdam/cold", "DiskSparseAdam, cold cache")]


def collect(rows):
    """{config: {(variant, metric): value}} of the newest run per variant."""
    out: dict = {}
    for r in latest_run(rows):
        config, _, variant = r["variant"].partition("/")
        out.setdefault(config, {})[(variant, r["metric"])] = r["value"]
    return out


def draw(rows, out_path):
    import matplotlib.pyplot as plt

    data = collect(rows)
    configs = sorted(data)
    if not configs:
        raise ValueError("dsa_throughput.csv holds no rows")
    fig, (ax, axm) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(BARS)
    for i, (variant, label) in enumerate(BARS):
        xs, ys = [], []
        for j, c in enumerate(configs):
            v = data[c].get((variant, "throughput"))
            if v is not None:
                xs.append(j + (i - (len(BARS) - 1) / 2) * width)
                ys.append(v)
        ax.bar(xs, ys, width, label=label)
    for j, c in enumerate(configs):
        bound = data[c].get(("disk", "cold_bound"))
        if bound is not None:
            ax.plot([j - 0.45, j + 0.45], [bound, bound], "k--", lw=1,
                    label="cold bound from 4 KiB random reads" if j == 0 else None)
    ax.set_xticks(range(len(configs)), configs)
    ax.set_yscale("log")
    ax.set_ylabel("samples / s (median, log scale)")
    ax.set_title("throughput")
    ax.legend(fontsize=8)

    mem = [("SparseAdam", "state_bytes_in_ram", "SparseAdam state (RAM)"),
           ("DiskSparseAdam", "rss_anon_delta", "DiskSparseAdam anon RSS"),
           ("DiskSparseAdam", "bytes_on_disk", "DiskSparseAdam on disk")]
    width = 0.8 / len(mem)
    for i, (variant, metric, label) in enumerate(mem):
        xs, ys = [], []
        for j, c in enumerate(configs):
            v = data[c].get((variant, metric))
            if v is not None:
                xs.append(j + (i - (len(mem) - 1) / 2) * width)
                ys.append(v * (2**20 if metric.startswith("rss") else 1) / 2**20)
        axm.bar(xs, ys, width, label=label)
    axm.set_xticks(range(len(configs)), configs)
    axm.set_ylabel("MiB")
    axm.set_title("optimizer state memory")
    axm.legend(fontsize=8)
    last = rows[-1]
    title = f"Disk Sparse Adam ({last['device']}, torch {last['torch_version']}, {last['git_commit']})"
    return save_figure(fig, out_path, title)


def main(argv=None):
    parser = add_analysis_args(argparse.ArgumentParser(description=__doc__), "dsa_throughput")
    args = parser.parse_args(argv)
    path = draw(read_results("dsa_throughput", args.results_dir), args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
