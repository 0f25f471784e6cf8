"""Registers, spills, shared memory and occupancy of every Triton kernel configuration on NVIDIA
targets, and the memory traffic of one optimizer step with the time it predicts. Compile-only: no
GPU needed, deterministic for one Triton version.

    python experiments/kernel_resources.py           # -> results/kernel_resources.csv
    python experiments/kernel_resources.py --quick   # sm_90, every axis value once -> results/quick/
    # predicted times at a measured copy bandwidth instead of the vendor's peak:
    python experiments/kernel_resources.py --bandwidth-from results/gpu/gefen_kernels.csv

Resources: each launcher's planning code lists its configurations as axes (``PLAN_AXES`` in
``optim/*/triton_ops.py``); the full run compiles every pair of axis values for sm_90 (the H100 /
H200 class the targets are about) and every axis value for sm_80 and sm_100, as ``kernel[grid]``
would specialise them (``experiments/harness/triton_aot.py``), and reads ``ptxas -v`` and the cubin. Occupancy is
the theoretical one: resident warps per SM / 64, from registers (65,536 per SM, allocated per warp in
units of 256), threads (2,048 per SM), resident blocks (32) and shared memory (227 KiB a block on
sm_90 / sm_100, 163 KiB on sm_80).

Traffic (labelled predicted): the bytes each kernel must move for one optimizer step, every tensor
read once and every written tensor written once (codebook tables are a few KiB, L2-resident, left
out), at a stated bandwidth (default: H200's 4.8 TB/s HBM3e peak), without launch latency.
- Disk Sparse Adam at the seed's configuration (1,000,000 x 128 fp32 table, batches of 2,048 uniform
  rows): the row kernel on the device (weights, gradient and state rows) and the state rows that
  cross PCIe both ways (PCIe 5.0 x16: 64 GB/s a direction).
- Gefen (8- and 4-bit) and fused AdamW on GPT-2 small (124 M) and XL (1.56 B) parameter sets, fp32
  and bf16 parameters, with the block lengths Gefen's rule finds on row-structured gradients (the row
  length capped at 1,024; vectors per element), as ``experiments/bench_kernels.py`` times them.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import sys

from experiments.harness import check
from experiments.harness.common import Results, add_common_args, read_results
from experiments.harness.models import GPT2_SIZES, gpt2_shapes

HBM_PEAK = 4.8e12  # B/s, H200 SXM (vendor); H100 SXM: 3.35e12
PCIE_PEAK = 64e9  # B/s a direction, PCIe 5.0 x16
SEED_DSA = dict(rows=1_000_000, dim=128, batch=2048)
RESOURCE_METRICS = [("regs", "registers", "per thread"), ("spill_stores", "spill_stores", "B/thread"),
                    ("spill_loads", "spill_loads", "B/thread"), ("stack", "stack", "B/thread"),
                    ("shared", "shared_memory", "B/block"), ("num_warps", "num_warps", "warps/block"),
                    ("warps", "resident_warps", "warps/SM"), ("occupancy", "occupancy", "fraction")]


# ------------------------------------------------------------------------------------- resources
# the --check size: the full run's flags it overrides (experiments/harness/check.py)
CHECK = {}
CHECK_NOTE = ("the full run's size (every kernel compiled ahead of time); the rows' headlines and verdicts come from "
              "the GPU runs (results/gpu/), this experiment gives their detail: compiled resources, predicted traffic")


def compile_plan(quick: bool) -> dict:
    """{capability: (cover, stride)} for ``experiments.harness.triton_aot.reports``."""
    if quick:
        return {90: ("each", 1)}
    return {80: ("each", 1), 90: ("pairs", 1), 100: ("each", 1)}


def resource_rows(res, report: dict) -> dict:
    """One CSV row per (configuration, target, metric); returns counts for the summary."""
    errors = 0
    for r in report["rows"]:
        if "error" in r:
            errors += 1
            res.add(r["config"], "compile_error", "count", 1, "arch", r["arch"])
            print(f"  {r['arch']} {r['config']}: {r['error'][-300:]}")
            continue
        for key, metric, unit in RESOURCE_METRICS:
            res.add(r["config"], metric, unit, r[key], "arch", r["arch"])
    return dict(rows=len(report["rows"]), errors=errors)


def summarise(report: dict) -> None:
    by = {}
    for r in report["rows"]:
        if "error" not in r:
            by.setdefault((r["kernel"], r["arch"]), []).append(r)
    for (kernel, arch), rs in sorted(by.items()):
        print(f"  {arch} {kernel:30s} {len(rs):4d} configs  registers {min(r['regs'] for r in rs)}-"
              f"{max(r['regs'] for r in rs)}  spilled {max(r['spill_stores'] for r in rs)} B  "
              f"occupancy >= {min(r['occupancy'] for r in rs):.2f}")


# --------------------------------------------------------------------------------------- traffic
def expected_unique(rows: int, batch: int) -> float:
    """Expected distinct rows among ``batch`` uniform draws from ``rows``."""
    return rows * (1 - (1 - 1 / rows) ** batch)


def dsa_traffic(rows: int, dim: int, batch: int) -> dict:
    """Bytes of one DiskSparseAdam step (fp32): the row kernel's device traffic, per direction over
    PCIe the state records ([m | v], 2D fp32 a row) staged to the device and back."""
    u = expected_unique(rows, batch)
    row = 4 * dim
    return dict(unique_rows=u, kernel_read=u * (row + row + 2 * row), kernel_written=u * (row + 2 * row),
                pcie_each_way=u * 2 * row)


def gefen_block(shape) -> int:
    """The block length Gefen's rule finds on row-structured gradients: the row length capped at
    MAX_BLOCK (partition.cap_block), 1 for vectors."""
    from optim.gefen.partition import cap_block

    return cap_block(shape[-1]) if len(shape) == 2 else 1


def gefen_traffic(shapes, p_bytes: int, bits: int) -> dict:
    """Bytes of one fused Gefen step: p read and written, g read (p's dtype), v, scales and codes
    read and written (the layout of optim/gefen/reference.py)."""
    from optim.gefen.reference import num_code_bytes, num_scales

    read = written = 0
    for sh in shapes:
        n = _numel(sh)
        block = gefen_block(sh)
        state = 4 * (n // block) + 4 * num_scales(n, block) + num_code_bytes(n, bits)
        read += 2 * n * p_bytes + state
        written += n * p_bytes + state
    return dict(read=read, written=written)


def adamw_traffic(shapes, p_bytes: int) -> dict:
    """Bytes of one fused AdamW step: p, exp_avg, exp_avg_sq (p's dtype) read and written, g read."""
    n = sum(_numel(s) for s in shapes)
    return dict(read=4 * n * p_bytes, written=3 * n * p_bytes)


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def bandwidth(path) -> tuple:
    """(bytes/s, source): the copy bandwidth a GPU run measured (``copy``/``bandwidth`` rows of its
    CSV), or the vendor's peak."""
    if path is None:
        return HBM_PEAK, "vendor peak (H200 HBM3e)"
    rows = [r for r in read_results(path) if r["variant"] == "copy" and r["metric"] == "bandwidth"]
    if not rows:
        raise SystemExit(f"{path}: no copy bandwidth row (variant 'copy', metric 'bandwidth')")
    return rows[0]["value"] * 1e9, f"measured copy on {rows[0]['device']}"


def traffic_rows(res, bw: float) -> None:
    d = dsa_traffic(**SEED_DSA)
    name = "predicted/DiskSparseAdam/seed"
    res.add(name, "unique_rows", "rows", d["unique_rows"], "batch", SEED_DSA["batch"])
    for key in ("kernel_read", "kernel_written", "pcie_each_way"):
        res.add(name, key, "B", d[key], "batch", SEED_DSA["batch"])
    kernel_t = (d["kernel_read"] + d["kernel_written"]) / bw
    res.add(name, "kernel_time", "us", kernel_t * 1e6, "batch", SEED_DSA["batch"])
    res.add(name, "pcie_time", "us", d["pcie_each_way"] / PCIE_PEAK * 1e6, "batch", SEED_DSA["batch"])
    print(f"  DSA seed step: {d['unique_rows']:.0f} rows, kernel {(d['kernel_read'] + d['kernel_written']) / 1e6:.2f} MB "
          f"-> {kernel_t * 1e6:.2f} us; PCIe {d['pcie_each_way'] / 1e6:.2f} MB a direction -> "
          f"{d['pcie_each_way'] / PCIE_PEAK * 1e6:.1f} us (predicted)")
    for size, (dm, layers) in GPT2_SIZES.items():
        shapes = gpt2_shapes(dm, layers)
        n = sum(_numel(s) for s in shapes)
        for dname, pb in (("fp32", 4), ("bf16", 2)):
            adamw = adamw_traffic(shapes, pb)
            t_adamw = (adamw["read"] + adamw["written"]) / bw
            for opt, tr in (("AdamW", adamw), ("Gefen-8bit", gefen_traffic(shapes, pb, 8)),
                            ("Gefen-4bit", gefen_traffic(shapes, pb, 4))):
                total = tr["read"] + tr["written"]
                v = f"predicted/{opt}/{dname}/{size}"
                res.add(v, "bytes_per_param", "B/param", total / n, "params", n)
                res.add(v, "step_time", "ms", total / bw * 1e3, "params", n)
                res.add(v, "time_vs_AdamW", "ratio", total / bw / t_adamw, "params", n)
                print(f"  {v:34s} {total / n:6.2f} B/param  {total / bw * 1e3:7.3f} ms  "
                      f"{total / bw / t_adamw:.3f}x AdamW (predicted)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--bandwidth-from", default=None,
                        help="a GPU run's CSV with a measured copy bandwidth (Default: H200's 4.8 TB/s peak)")
    parser.add_argument("--workers", type=int, default=2, help="compiler processes")
    args = check.parse(parser, argv)
    from experiments.harness.triton_aot import reports

    bw, source = bandwidth(args.bandwidth_from)
    plan = compile_plan(args.quick)
    config = dict(vars(args), plan={str(k): v for k, v in plan.items()}, bandwidth=bw,
                  bandwidth_source=source, pcie_bandwidth=PCIE_PEAK, seed_dsa=SEED_DSA)
    with Results("kernel_resources", args, config=config) as res:
        report = reports(plan, workers=args.workers)
        res.config["targets"] = [f"sm_{c}" for c in report["caps"]]
        counts = resource_rows(res, report)
        print(f"[kernel_resources] {counts['rows']} compiled configurations, {counts['errors']} failed")
        summarise(report)
        print(f"[kernel_resources] traffic at {bw / 1e12:.2f} TB/s ({source})")
        traffic_rows(res, bw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
