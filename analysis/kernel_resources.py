"""README section (no figure): compiled resources of every Triton kernel and the predicted traffic of
one optimizer step.

    python analysis/kernel_resources.py [--results-dir results]

Reads ``kernel_resources.csv``: per compiled configuration (variant) and target (x_value ``sm_NN``)
registers, spills, shared memory, warps and theoretical occupancy; and ``predicted/...`` variants:
bytes of one step and their time at the run's stated bandwidth. Writes one table per part and the
verdicts on the targets (no spills; the memory-bound kernels at >= 50% occupancy on sm_90; Gefen's
predicted step <= 0.55x fused AdamW's).
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

from collections import defaultdict

from analysis.common import Report, fmt, main, md_table, select

MEMORY_BOUND = ("adam_rows", "gefen_8bit", "gefen_4bit", "gefen_fp32_m")
TARGET_RATIO = 0.55


def by_kernel(rows):
    """{(kernel family, arch): {metric: [values]}} over compiled configurations."""
    out = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if not r["variant"].startswith("predicted/"):
            out[(r["variant"].split("/")[0], r["x_value"])][r["metric"]].append(r["value"])
    return out


def resource_table(rows):
    table = []
    for (kernel, arch), m in sorted(by_kernel(rows).items()):
        table.append([f"`{kernel}`", arch, fmt(len(m["registers"])),
                      f"{fmt(min(m['registers']))}-{fmt(max(m['registers']))}",
                      fmt(max(m["spill_stores"])), fmt(max(m["shared_memory"]) / 1024, 3),
                      f"{fmt(min(m['num_warps']))}-{fmt(max(m['num_warps']))}",
                      fmt(min(m["occupancy"]), 2), fmt(len(m.get("compile_error", [])))])
    return md_table(["kernel", "target", "configs", "registers/thread", "max spill (B)",
                     "max shared (KiB)", "warps/block", "min occupancy", "failed"], table)


def verdicts(rows):
    k = by_kernel(rows)
    spills = sum(1 for m in k.values() for s in m["spill_stores"] if s > 0)
    errors = sum(len(m.get("compile_error", [])) for m in k.values())
    occ = {kern: min(m["occupancy"]) for (kern, arch), m in k.items() if arch == "sm_90" and kern in MEMORY_BOUND}
    low = {kern: o for kern, o in occ.items() if o < 0.5}
    n = sum(len(m["registers"]) for m in k.values())
    lines = [f"- Compiled: {n} configurations, {errors} failed to compile.",
             f"- No register spills at any compiled configuration: **{'holds' if not spills else 'fails'}** "
             f"({spills} spilling).",
             "- Memory-bound kernels (DSA's Adam rows, Gefen's step) at >= 50% theoretical occupancy on "
             f"sm_90: **{'holds' if not low else 'fails'}** (lowest: "
             + ", ".join(f"`{kern}` {fmt(o, 2)}" for kern, o in sorted(occ.items())) + ")."]
    return "\n".join(lines)


def traffic_table(rows):
    table = []
    for r in select(rows, "bytes_per_param"):
        v = r["variant"]
        _, opt, dtype, size = v.split("/")
        table.append([opt, dtype, size, fmt(r["value"], 4),
                      fmt(select(rows, "step_time", v)[0]["value"], 3),
                      fmt(select(rows, "time_vs_AdamW", v)[0]["value"], 3)])
    return md_table(["optimizer", "params", "model", "bytes/param", "predicted step (ms)",
                     "predicted / fused AdamW"], table)


def gefen_verdict(rows):
    ratios = {r["variant"]: r["value"] for r in select(rows, "time_vs_AdamW") if "/Gefen-" in r["variant"]}
    ok = [v for v, x in ratios.items() if x <= TARGET_RATIO]
    bad = {v: x for v, x in ratios.items() if x > TARGET_RATIO}
    text = (f"- Gefen's predicted step <= {TARGET_RATIO}x fused AdamW's: **holds for {len(ok)} of "
            f"{len(ratios)}**")
    if bad:
        text += ("; not for " + ", ".join(f"{v.split('/', 1)[1]} ({fmt(x, 3)}x)" for v, x in sorted(bad.items()))
                 + ": with bf16 parameters fused AdamW keeps its moments in bf16 (14 B/param), and "
                   "Gefen's p, g and one code byte are already 8 of it")
    return text + "."


def dsa_lines(rows, config):
    v = "predicted/DiskSparseAdam/seed"
    get = {r["metric"]: r["value"] for r in select(rows, variant=v)}
    seed = config.get("config", {}).get("seed_dsa", {})
    return (f"Disk Sparse Adam at the seed's configuration ({fmt(seed.get('rows', 0))} x {fmt(seed.get('dim', 0))} "
            f"fp32, batches of {fmt(seed.get('batch', 0))}): {fmt(get['unique_rows'], 4)} distinct rows a step; "
            f"the row kernel moves {fmt((get['kernel_read'] + get['kernel_written']) / 1e6, 3)} MB "
            f"(predicted {fmt(get['kernel_time'], 2)} us), and the state records cross PCIe "
            f"{fmt(get['pcie_each_way'] / 1e6, 3)} MB each way (predicted {fmt(get['pcie_time'], 3)} us "
            f"at 64 GB/s): PCIe and the host's gathers from the state file, not the kernel, bound the step.")


def coverage(cfg):
    words = {"each": "every axis value", "pairs": "every pair of axis values", "all": "every combination"}
    plan = cfg.get("plan", {})
    return "; ".join(f"{words[cover]}{'' if stride == 1 else f' (every {stride}th)'} for sm_{cap}"
                     for cap, (cover, stride) in sorted(plan.items(), key=lambda kv: int(kv[0])))


def body(rows, config):
    cfg = config.get("config", {})
    bw = cfg.get("bandwidth", 0) / 1e12
    return "\n\n".join([
        "Every Triton kernel compiled ahead of time on a machine without a GPU, at the configurations "
        f"its launcher's planning code lists (`PLAN_AXES` in `optim/*/triton_ops.py`; {coverage(cfg)}), "
        "read from `ptxas -v` and the cubin. Occupancy is theoretical: resident warps per SM / 64 from registers, threads, blocks and "
        "shared memory (`experiments/harness/triton_aot.py`).",
        resource_table(rows),
        verdicts(rows),
        f"**Predicted** traffic of one optimizer step: every tensor read once and every written tensor "
        f"written once, at {fmt(bw, 3)} TB/s ({cfg.get('bandwidth_source', 'stated bandwidth')}), without "
        "launch latency. Gefen's block lengths are those its rule finds on row-structured gradients (row "
        "length capped at 1,024, vectors per element), as `experiments/bench_kernels.py` times them.",
        traffic_table(rows),
        gefen_verdict(rows),
        dsa_lines(rows, config),
    ])


REPORT = Report("kernel_resources", "kernel_resources", "Triton kernels: compiled resources and predicted traffic",
                body, metrics=("registers", "occupancy", "bytes_per_param"))

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
