"""The README's claims table and results/README.md's "Claims in detail", generated from the results.

    python analysis/claims.py            # rewrite the README's claims table and the results' claims detail
    python analysis/claims.py --check    # exit 1 if either differs from what would be written

One function per row reads the CSVs of ``results/`` (and ``results/gpu/``) and returns the row's
cells: the claim, a verdict in plain words, a short headline figure formatted from the data, the
figure and the command, and the detail paragraph (the conditions and caveats behind the headline,
formatted from the same values, so the table and the detail cannot disagree). The detail block adds,
for every CSV a row read, the run's commit, seeds and command and a link to the section with the full
tables. Every ratio is a speed ("×" = times as fast as the named baseline) unless the text says
"times ... time", memory is bytes per parameter or MiB, loss is a percentage above or below AdamW's.
A row whose CSV lacks a metric raises ``ResultsError`` naming the file.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from analysis.common import (GEFEN_TARGET_BPP, ResultsError, anchor, load_config, load_rows, read_section, select,
                             value, write_section)
from analysis.dsa_out_of_core import ISSUE_BASELINE as OOC_BASELINE
from analysis.gefen_memory import TARGET_FACTORED_STEP
from experiments.common import REPO_ROOT, RESULTS_DIR

README = REPO_ROOT / "README.md"
BEGIN, END = "<!-- begin claims -->", "<!-- end claims -->"
DETAIL = "claims_detail"  # the section of results/README.md that expands each row

SEED_GPU_SAMPLES_PER_S = 134_212  # the Disk Sparse Adam article's own figure (one GPU, the seed)
LOSS_TARGET = {"8bit": 0.003, "4bit": 0.006}  # factored Gefen: loss within +0.3% / +0.6% of AdamW's
BF16_TARGET = 0.005  # bf16 weights with stochastic rounding: within +0.5% of fp32 AdamW's loss
QUALITY_TOL = 0.03  # "AdamW's quality": within 3% of AdamW's loss
MAP_TOL = 1e-3  # Riemannian DSA against geoopt: MAP equal to this
THREADS = 1.0  # the CPU step times the speed row quotes: one torch thread
LAUNCH_TARGET = 8  # Gefen's Triton path: at most this many launches a step after the first
OUT_OF_CORE_LIMIT_GIB = 2.0  # the memory cgroup that DSA's out-of-core target is set in
S1_RHO, S3_NATS = 0.3, 0.01  # Hessian statements: |ρ| below this is no correlation; a tie in nats
MODELS = {"char-gpt-116k": "116k", "char-gpt-1266k": "1.27M", "char-gpt-429k-docstrings": "429k prose"}


@dataclass(frozen=True)
class Row:
    claim: str
    verdict: str
    headline: str
    figure: str
    command: str
    detail: str = ""  # the conditions and caveats behind the headline, formatted from the same data


class Results:
    """The CSVs of one results folder, each read once; ``need`` is a value that must be there.
    ``read`` lists the experiments read since it was last emptied (the detail names their runs)."""

    def __init__(self, results_dir=RESULTS_DIR):
        self.dir = Path(results_dir)
        self._rows = {}
        self.read = []

    def rows(self, experiment, *metrics):
        if experiment not in self._rows:
            self._rows[experiment] = load_rows(experiment, self.dir)
        if experiment not in self.read:
            self.read.append(experiment)
        rows = self._rows[experiment]
        load_rows_check(rows, experiment, self.dir, metrics)
        return rows

    def config(self, experiment) -> dict:
        """The run's settings (the config's ``config``), {} without a config file."""
        return self.run(experiment).get("config") or {}

    def run(self, experiment) -> dict:
        """The run's whole config file (commit, device, command, settings), {} without one."""
        path = self.dir / experiment
        return load_config(path.name, path.parent)

    def values(self, experiment, metric, variant, **where) -> list:
        """Every value of (metric, variant[, columns]), one per seed or x; at least one."""
        vals = [r["value"] for r in select(self.rows(experiment, metric), metric, variant, **where)]
        if not vals:
            raise ResultsError(f"{self.dir / experiment}.csv: no value of {metric} for {variant}; "
                               f"rerun experiments/{experiment.split('/')[-1]}.py")
        return vals

    def median(self, experiment, metric, variant, **where) -> float:
        return statistics.median(self.values(experiment, metric, variant, **where))

    def need(self, experiment, metric, variant, **where) -> float:
        x = value(self.rows(experiment, metric), metric, variant, **where)
        if not math.isfinite(x):
            detail = ", ".join(f"{k}={v}" for k, v in where.items())
            raise ResultsError(f"{self.dir / experiment}.csv: no value of {metric} for {variant}"
                               + (f" ({detail})" if detail else "") + f"; rerun experiments/{experiment.split('/')[-1]}.py")
        return x


def load_rows_check(rows, experiment, results_dir, metrics):
    missing = sorted(set(metrics) - {r["metric"] for r in rows})
    if missing:
        raise ResultsError(f"{Path(results_dir) / experiment}.csv: no rows of metric(s) {missing}; "
                           f"rerun experiments/{experiment.split('/')[-1]}.py")


# ------------------------------------------------------------------------------------- formatting
def pct(ratio) -> str:
    """A loss ratio to AdamW's as a signed percentage: 1.0028 -> "+0.28%"."""
    return f"{(ratio - 1) * 100:+.2f}%".replace("-", "−")


def times(x, digits=2) -> str:
    return f"{x:.{digits}f}×"


def span(xs, digits=2) -> str:
    """"a–b×" for the smallest and largest of ``xs``."""
    return f"{min(xs):.{digits}f}–{max(xs):.{digits}f}×"


def sci(x, digits=2) -> str:
    """A small number in short scientific notation: 1.3e-06 -> "1.3e-6"; 0 -> "0"."""
    return "0" if x == 0 else re.sub(r"e([+-])0*(\d)", r"e\1\2", f"{x:.{digits - 1}e}").replace("e+", "e")


def pct_range(ratios) -> str:
    """"a .. b" for the smallest and largest loss ratio, as signed percentages."""
    return f"{pct(min(ratios))} .. {pct(max(ratios))}"


def points(a, b) -> str:
    """The difference of two loss ratios in percentage points: "+0.26 points"."""
    return f"{(a - b) * 100:+.2f} points".replace("-", "−")


def signed(x, digits=2) -> str:
    """"+0.09" / "−0.41" (a typographic minus, as ``pct``)."""
    return f"{x:+.{digits}f}".replace("-", "−")


def mib(n_bytes, digits=1) -> str:
    return f"{n_bytes / 2 ** 20:,.{digits}f} MiB"


def gib(n_bytes, digits=1) -> str:
    return f"{n_bytes / 2 ** 30:,.{digits}f} GiB"


def listed(items) -> str:
    """"a", "a and b", "a, b and c"."""
    items = list(items)
    return " and ".join(items) if len(items) < 3 else ", ".join(items[:-1]) + " and " + items[-1]


def joined(xs, form) -> str:
    """"a / b / c", each formatted by ``form``."""
    return " / ".join(form(x) for x in xs)


def thousands(x) -> str:
    return f"{x:,.0f}"


def fig(name) -> str:
    return f"[{name}.png](paper_figs/{name}.png)"


def cmd(text) -> str:
    return f"`{text}`"


def median_over_seeds(rows, metric, variant, seeds=None, **where):
    vals = [r["value"] for r in select(rows, metric, variant, **where) if seeds is None or r["seed"] in seeds]
    return statistics.median(vals) if vals else math.nan


# ------------------------------------------------------------------------------------ DSA rows
def dsa_correctness(R):
    e = "correctness"
    errs = [R.need(e, "max_abs_err", f"DiskSparseAdam[{b}] vs SparseAdam") for b in ("numba", "torch")]
    steps = select(R.rows(e), "max_abs_err", "DiskSparseAdam[numba] vs SparseAdam")[0]["x_value"]
    triton = R.need(e, "max_abs_err", "DiskSparseAdam[triton] vs SparseAdam")
    loose = R.need(e, "max_abs_err", "DiskSparseAdam[numba,bitwise=False] vs SparseAdam")
    verdict = "reproduced, bit for bit" if max(errs) == 0 else "not met: differs from SparseAdam"
    detail = (f"The Triton backend (under `TRITON_INTERPRET=1`) ends {sci(triton)} from SparseAdam's weights and "
              f"`bitwise=False` (numba) {sci(loose)}: neither promises SparseAdam's bits (its order of duplicate sums "
              "and MKL's square root). The same section holds the Riemannian variant against geoopt's and Gefen "
              "with both switches off against AdamW.")
    return Row("DSA matches `torch.optim.SparseAdam`", verdict,
               f"max abs error {max(errs):g} after {steps:g} steps (numba and torch backends)", "—",
               cmd("python experiments/correctness.py"), detail)


def _table_configs(R, e):
    """"seed: 1,000,000 × 128, batch 2,048; kg: ..." from the run's config."""
    return "; ".join(f"{c['name']} {c['rows']:,} × {c['dim']}, batch {c['batch']:,}" for c in R.config(e)["configs"])


def dsa_speed(R):
    e, cs = "dsa_throughput", ("seed", "kg")
    warm = [R.need(e, "DiskSparseAdam_warm/SparseAdam", f"{c}/ratio") for c in cs]
    fresh = [R.need(e, "DiskSparseAdam_fresh/SparseAdam_fresh", f"{c}/ratio") for c in cs]
    cold = [R.need(e, "throughput", f"{c}/DiskSparseAdam/cold") / R.need(e, "throughput", f"{c}/SparseAdam")
            for c in cs]
    built = [R.need(e, "throughput_with_construction", f"{c}/DiskSparseAdam/fresh")
             / R.need(e, "throughput_with_construction", f"{c}/SparseAdam/fresh") for c in cs]
    loose = [R.need(e, "DiskSparseAdam_warm_fused/SparseAdam", f"{c}/ratio") for c in cs]
    bound = [R.need(e, "DiskSparseAdam_cold/disk_bound", f"{c}/ratio") for c in cs]
    verdict = ("faster when the state is cached; slower from a cold disk" if min(warm + fresh) > 1 > max(cold)
               else "measured")
    head = (f"warm {times(warm[0])} / {times(warm[1])}, fresh {times(fresh[0])} / {times(fresh[1])}, "
            f"cold {times(cold[0])} / {times(cold[1])} SparseAdam (seed / KG)")
    detail = (f"Tables ({_table_configs(R, e)}). SparseAdam keeps its state in RAM in every condition; DSA's state "
              "is in files: fresh (a new optimizer on a new state directory, against a new SparseAdam), warm (in the "
              f"page cache) or cold (pages dropped). Warm with `bitwise=False`: {joined(loose, times)}. With the construction "
              f"counted, the first {R.config(e)['fresh_steps']} steps run at {joined(built, times)} SparseAdam's speed: a fresh "
              "state file that fits in the page cache is populated at creation in one sequential pass and never read "
              "ahead, so its steps run near the warm rate, but that pass is slow when the page cache must take memory "
              "the virtual machine has not touched yet (it varies from run to run; SparseAdam's anonymous zeros come "
              "from recently freed memory). A cold step issues all its rows' reads together "
              f"(`posix_fadvise(WILLNEED)`), which is how it runs at {joined(bound, times)} the disk's one-read-at-a-time bound; "
              "the out-of-core row measures it against the disk's parallel rate.")
    return Row("DSA is faster than SparseAdam on CPU", verdict, head, fig(e), cmd(f"python experiments/{e}.py"), detail)


def dsa_seed_benchmark(R):
    e = "dsa_seed_benchmark"
    rows = select(R.rows(e, "throughput"), "throughput", "DiskSparseRiemannianAdam")
    if not rows:
        raise ResultsError(f"{R.dir / e}.csv: no throughput of DiskSparseRiemannianAdam")
    last = max(rows, key=lambda r: float(r["x_value"]))
    verdict = ("reproduced on CPU; throughput exceeded" if last["value"] > SEED_GPU_SAMPLES_PER_S
               else "reproduced on CPU; throughput not reached")
    c = R.config(e)
    rate = {n: R.values(e, "throughput", n) for n in ("DiskSparseRiemannianAdam", "geoopt-SparseRiemannianAdam", "SparseAdam")}
    ours = {r["x_value"]: r["value"] for r in select(R.rows(e, "loss"), "loss", "DiskSparseRiemannianAdam")}
    ref = {r["x_value"]: r["value"] for r in select(R.rows(e, "loss"), "loss", "geoopt-SparseRiemannianAdam")}
    rel = max(abs(ours[x] - ref[x]) / abs(ref[x]) for x in ours if x in ref)
    gpu = R.need("gpu/dsa_gpu", "throughput", "DiskSparseRiemannianAdam")

    def between(xs):
        return f"{thousands(min(xs))}–{thousands(max(xs))}"

    detail = (f"{c['rows']:,} × {c['dim']} on the Poincaré ball, batch {c['batch']:,}, {c['epochs']} epochs: "
              f"DiskSparseRiemannianAdam (numba) {between(rate['DiskSparseRiemannianAdam'])} samples/s per epoch on "
              f"{c['threads']} CPU thread{'s' * (c['threads'] != 1)}, its loss equal to geoopt's to {sci(rel)} relative (geoopt "
              f"{between(rate['geoopt-SparseRiemannianAdam'])} samples/s, SparseAdam {between(rate['SparseAdam'])}). "
              "The seed's loss function is not given; the one used here matches its first loss. On the GPU run the "
              f"same optimizer ran {thousands(gpu)} samples/s.")
    return Row(f"The seed's benchmark, end to end ({c['epochs']} epochs)", verdict,
               f"{thousands(last['value'])} samples/s in epoch {last['x_value']:g} on one CPU thread "
               f"(the seed: {thousands(SEED_GPU_SAMPLES_PER_S)} on a GPU)", fig(e), cmd(f"python experiments/{e}.py"),
               detail)


def dsa_billions(R):
    e = "dsa_billions"
    params = R.need(e, "params", "DiskSparseAdam/exact")
    rate = R.need(e, "steady_samples_per_s", "DiskSparseAdam/exact")
    compact = R.need(e, "steady_samples_per_s", "DiskSparseAdam/compact")
    disk = [R.need(e, "bytes_on_disk", f"DiskSparseAdam/{f}") for f in ("exact", "compact")]
    limit = R.need(e, "memory_limit", "SparseAdam") / 2 ** 30
    status = R.need(e, "exit_status", "SparseAdam")
    verdict = "holds" if rate > 0 and status != 0 else "not met"
    other = "killed, out of memory" if status == -9 else f"exit status {status:g}"
    c = R.config(e)
    detail = (f"{c['rows']:,} × {c['dim']} = {params:,.0f} parameters, weights and state in files, the process in a "
              f"{limit:g} GiB memory cgroup: {thousands(rate)} samples/s steady with the exact state ({gib(disk[0])} on "
              f"disk), {thousands(compact)} with the compact state ({gib(disk[1])}); SparseAdam in the same budget: "
              f"{other}.")
    return Row("Tables of billions of parameters, limited only by the disk", verdict,
               f"{params / 1e9:.2f} billion parameters in a {limit:g} GiB cgroup at {thousands(rate)} samples/s "
               f"(SparseAdam: {other})", "—", cmd(f"python experiments/{e}.py"), detail)


def dsa_no_device_memory(R):
    g, e, cs = "gpu/dsa_gpu", "dsa_throughput", ("seed", "kg")
    dsa = R.need(g, "device_memory_over_weights", "DiskSparseAdam")
    ref = R.need(g, "device_memory_over_weights", "SparseAdam")
    anon = [R.need(e, "rss_anon_delta", f"{c}/DiskSparseAdam") for c in cs]
    disk = [R.need(e, "bytes_on_disk", f"{c}/DiskSparseAdam") for c in cs]
    ram = [R.need(e, "state_bytes_in_ram", f"{c}/SparseAdam") for c in cs]
    verdict = "reproduced (by construction)" if dsa < ref / 10 else "not met"
    detail = (f"The moments live in files: {mib(disk[0], 0)} / {mib(disk[1], 0)} on disk (seed / KG), "
              f"{anon[0]:.1f} / {anon[1]:.3f} MiB of anonymous RAM added by DSA, against SparseAdam's "
              f"{mib(ram[0], 0)} / {mib(ram[1], 0)} of RAM. On CUDA, weights stage their rows through pinned buffers "
              "of O(rows per batch) (`opt.device_staging_bytes()`).")
    return Row("DSA state costs no accelerator memory", verdict,
               f"GPU memory beyond the weights: {dsa:.1f} MiB (SparseAdam {ref:.1f} MiB); "
               f"{anon[0]:.1f} MiB of anonymous RAM on CPU (seed)", fig("dsa_throughput"),
               cmd("python experiments/dsa_throughput.py"), detail)


def dsa_out_of_core(R):
    e = "dsa_out_of_core"
    prefetch = R.need(e, "cold_over_QD32_bound", "DiskSparseAdam/exact/prefetch")
    single = R.need(e, "cold_over_QD32_bound", "DiskSparseAdam/exact/one-at-a-time")
    cold = R.need(e, "cold_throughput", "DiskSparseAdam/exact/prefetch")
    rows, dim = R.need(e, "rows", "table"), R.need(e, "dim", "table")
    lim = OUT_OF_CORE_LIMIT_GIB
    exact = R.need(e, "throughput", "DiskSparseAdam/exact", x_value=lim)
    compact = R.need(e, "throughput", "DiskSparseAdam/compact", x_value=lim)
    free = R.need(e, "throughput", "DiskSparseAdam/compact", x_value="none")
    done = sorted(r["x_value"] for r in select(R.rows(e, "completed"), "completed", "SparseAdam")
                  if r["value"] and r["x_value"] != "none")
    sparse = f"SparseAdam is killed below {done[0]:g} GiB" if done else "SparseAdam is killed at every limit"
    detail = (f"Cold steps at the seed's table with prefetch reach {thousands(cold)} samples/s, {times(prefetch)} the "
              f"disk's QD32 `pread` bound of that run; one page at a time {times(single)} of it. In a {lim:g} GiB memory "
              f"cgroup ({rows:,.0f} × {dim:g}): exact state {thousands(exact)} samples/s ({exact / OOC_BASELINE:.0f}× the "
              f"{thousands(OOC_BASELINE)} that its target is set against: exact DSA without parallel reads), compact "
              f"state {thousands(compact)} ({compact / free:.2f} of its unlimited rate); {sparse}. Compact state takes "
              f"{R.need(e, 'compact_bytes_per_row', 'table'):g} B a row at D = {dim:g}, and its KG loss is "
              f"{times(R.need(e, 'compact_over_exact_val_loss', 'ratio'), 3)} the exact state's. Timings come from a "
              "machine shared with other jobs.")
    return Row("DSA out of core: cold rows read in parallel", "measured",
               f"cold steps with prefetch {times(prefetch)} the disk's QD32 read rate; one read at a time "
               f"{times(single)}", fig(e), cmd(f"python experiments/{e}.py"), detail)


def dsa_fault_injection(R):
    e = "dsa_fault_injection"
    failures = R.need(e, "failures", "DiskSparseAdam", x_value="all")
    trials = R.need(e, "trials", "DiskSparseAdam", x_value="all")
    phases = list(dict.fromkeys(r["x_value"] for r in select(R.rows(e), "trials") if r["variant"].startswith("DiskSparseAdam/")
                                and r["x_value"] != "all"))
    phases = [{"done": "after the last step"}.get(p, p) for p in phases]
    refused = R.need(e, "refused_dirty", "DiskSparseAdam", x_value="all")
    bitwise = R.need(e, "bitwise_continuations", "DiskSparseAdam", x_value="all")
    accepted = R.need(e, "accepted_clean", "DiskSparseAdam", x_value="all")
    detail = (f"{trials:g} trials, SIGKILL and SIGINT (Ctrl-C) in turn, in the phases {listed(phases)}: {failures:g} failures. "
              f"A reopen was refused as dirty ({refused:g}) or accepted as clean ({accepted:g}), and the run continued "
              f"bitwise like SparseAdam ({bitwise:g} of {trials:g}).")
    return Row("A killed or interrupted process cannot silently corrupt DSA state",
               "holds" if failures == 0 else "not met", f"{failures:g} failures in {trials:g} SIGKILL and SIGINT trials",
               "—", cmd(f"python experiments/{e}.py"), detail)


def dsa_gpu(R):
    g, k = "gpu/dsa_gpu", "kernel_resources"
    rate = R.need(g, "throughput", "DiskSparseRiemannianAdam")
    ratio = R.need(g, "throughput_vs_SparseAdam", "DiskSparseRiemannianAdam")
    verdict = "exceeded (one H200)" if rate > SEED_GPU_SAMPLES_PER_S else "not met (one H200)"
    pred = "predicted/DiskSparseAdam/seed"
    moved = R.need(k, "kernel_read", pred) + R.need(k, "kernel_written", pred)
    c = R.config(k)
    detail = (f"At the seed's configuration ({R.need(k, 'unique_rows', pred):,.0f} distinct rows a step) the row kernel "
              f"moves {moved / 1e6:.1f} MB ({R.need(k, 'kernel_time', pred):.1f} µs at {c['bandwidth'] / 1e12:g} TB/s); "
              f"the state records cross PCIe, {R.need(k, 'pcie_each_way', pred) / 1e6:.1f} MB each way "
              f"({R.need(k, 'pcie_time', pred):.0f} µs at {c['pcie_bandwidth'] / 1e9:g} GB/s): the host and PCIe, not "
              "the GPU, bound the step, which is why SparseAdam with its moments in GPU memory is faster. On the same "
              f"GPU DiskSparseAdam ran {thousands(R.need(g, 'throughput', 'DiskSparseAdam'))} samples/s and SparseAdam "
              f"{thousands(R.need(g, 'throughput', 'SparseAdam'))}, at "
              f"{R.need(g, 'device_memory_over_weights', 'DiskSparseAdam'):.1f} MiB of device memory over the weights "
              f"for DiskSparseAdam against SparseAdam's {R.need(g, 'device_memory_over_weights', 'SparseAdam'):.1f} MiB.")
    return Row(f"{thousands(SEED_GPU_SAMPLES_PER_S)} samples/s on a GPU (the seed, DiskSparseRiemannianAdam)", verdict,
               f"{thousands(rate)} samples/s; {times(ratio)} SparseAdam with its moments in GPU memory", "—",
               cmd("bash experiments/gpu_checks.sh"), detail)


def dsa_distributed(R):
    e = "dsa_distributed"
    rows = select(R.rows(e, "bytes_per_step"), "bytes_per_step", "paper/sharded")
    if not rows:
        raise ResultsError(f"{R.dir / e}.csv: no bytes_per_step of paper/sharded")
    top = max(rows, key=lambda r: float(r["x_value"]))
    ddp = R.need(e, "bytes_per_step", "paper/ddp", x_value=top["x_value"])
    ranks = max(r["x_value"] for r in select(R.rows(e), "bytes_per_step", "sharded"))
    measured = R.need(e, "bytes_per_step", "sharded", x_value=ranks)
    model = R.need(e, "bytes_per_step", "paper/sharded", x_value=ranks)
    gbit = {v: R.need(e, "bandwidth_needed", f"paper/{v}", x_value=top["x_value"]) for v in ("sharded", "ddp")}
    detail = (f"{mib(measured, 2)} per rank and step measured on {ranks:g} ranks, against the model's {mib(model, 2)}; "
              f"on paper at {top['x_value']:g} ranks {mib(top['value'], 2)} ({gbit['sharded']:.1f} Gbit/s for a "
              f"{R.need(e, 'step_time', 'paper') * 1e3:.1f} ms step) against DDP's {mib(ddp, 0)} ({gbit['ddp']:.0f} "
              "Gbit/s). The measured ranks share the machine's cores, so the measured rows show what the exchange "
              "costs, not how it scales. `tests/test_dsa_distributed.py` checks on gloo ranks that sharded training "
              "equals `torch.optim.SparseAdam` on the whole table and batch to its stated tolerance (the order of "
              "duplicate sums differs), that DCP round trips continue bit for bit, that loads into more ranks hold the "
              "saved state exactly and that a killed rank's directory is refused on restart; DDP equals SparseAdam to "
              "the same tolerance. Under DDP every rank holds the whole table and its state.")
    return Row("DSA tables sharded by rows exchange little", f"measured on {ranks:g} ranks; beyond them, on paper",
               f"{top['value'] / 2 ** 20:.2f} MiB sent per rank and step at {top['x_value']:g} ranks "
               f"(DDP {ddp / 2 ** 20:,.0f} MiB)", fig(e), cmd(f"python experiments/{e}.py"), detail)


def dsa_poincare(R):
    e = "poincare"
    rows = select(R.rows(e, "map"), "map", "DiskSparseRiemannianAdam")
    dims = [r["x_value"] for r in rows]
    if not dims:
        raise ResultsError(f"{R.dir / e}.csv: no map of DiskSparseRiemannianAdam")
    ours = [R.need(e, "map", "DiskSparseRiemannianAdam", x_value=d) for d in dims]
    diff = max(abs(o - R.need(e, "map", "geoopt-SparseRiemannianAdam", x_value=d)) for o, d in zip(ours, dims))
    clip = max(R.values(e, "map", "DiskSparseAdam+clip"))
    detail = (f"In float64 on a real hierarchy, each optimizer at the same settings; the published clip-into-the-ball "
              f"mode (`DiskSparseAdam+clip`) reaches a MAP of at most {clip:.3f}.")
    return Row("Riemannian DSA follows geoopt", "reproduced" if diff <= MAP_TOL else "not met",
               f"MAP {' / '.join(f'{m:.3f}' for m in ours)} at d = {' / '.join(f'{d:g}' for d in dims)}; "
               f"largest difference from geoopt's {diff:.1e}", fig(e), cmd(f"python experiments/{e}.py"), detail)


# ---------------------------------------------------------------------------------- Gefen rows
def gefen_memory(R):
    e = "gefen_memory"
    b8, b4, adamw = (R.need(e, "state_bytes_per_param", v, x_value="transformer")
                     for v in ("Gefen-8bit", "Gefen-4bit", "AdamW"))
    verdict = "reproduced" if b8 <= GEFEN_TARGET_BPP["Gefen-8bit"] else "not met"
    mlp = [R.need(e, "state_bytes_per_param", v, x_value="mlp") for v in ("Gefen-8bit", "AdamW")]
    detail = (f"AdamW keeps {adamw / b8:.1f} times Gefen 8-bit's state on the transformer and {mlp[1] / mlp[0]:.1f} "
              f"times on the MLP ({mlp[0]:.3f} B/param). The section adds every peer's bytes, the bytes by kind of tensor "
              "and the CPU step times.")
    return Row("Gefen keeps about 1 B/param of state (AdamW: 8)", verdict,
               f"8-bit {b8:.3f}, 4-bit {b4:.3f} B/param; AdamW {adamw:.3f} (transformer)", fig(e),
               cmd(f"python experiments/{e}.py"), detail)


def _model_prefix(model) -> str:
    """The variant prefix of ``model`` in convergence.csv: "" for the first model, else "<model>/"."""
    return "" if model == next(iter(MODELS)) else f"{model}/"


def gefen_quality(R):
    e = "convergence"
    gaps = [R.need(e, "val_loss_vs_adamw_mean", "Gefen-8bit", x_value=m) for m in MODELS]
    within = sum(g - 1 <= QUALITY_TOL for g in gaps)
    verdict = (f"reproduced with caveats: within {QUALITY_TOL:.0%} on {within} of {len(gaps)} models"
               if within else "not met")
    parts = []
    for m, name in MODELS.items():
        g8, g4 = (R.need(e, "val_loss_vs_adamw_mean", f"Gefen-{b}", x_value=m) for b in ("8bit", "4bit"))
        seeds = R.values(e, "val_loss_vs_adamw", "Gefen-8bit", x_value=m)
        ok = sum(s - 1 <= QUALITY_TOL for s in seeds)
        parts.append(f"{pct(g8)} / {pct(g4)} ({name}, {len(seeds)} seeds, {ok} of them within {QUALITY_TOL:.0%} at 8 bits)")
    upstream = [f"{pct(R.need(e, 'val_loss_vs_adamw_mean', 'gefen-upstream', x_value=m))} ({name})"
                for m, name in MODELS.items() if select(R.rows(e), "val_loss_vs_adamw_mean", "gefen-upstream", x_value=m)]
    detail = (f"Validation loss over AdamW's, mean over seeds, 8-bit / 4-bit: {'; '.join(parts)}; upstream `gefen` "
              f"{listed(upstream)}. Each optimizer runs at its best lr of a grid.")
    return Row("Gefen trains at AdamW's quality", verdict,
               f"8-bit {' / '.join(pct(g) for g in gaps)} vs AdamW's loss ({' / '.join(MODELS.values())}; mean of seeds)",
               fig(e), cmd(f"python experiments/{e}.py"), detail)


def gefen_ablation(R):
    e = "gefen_ablation"
    every = R.need(e, "val_loss_vs_adamw_mean", "all")
    shared = R.need(e, "val_loss_vs_adamw_mean", "none")
    prose = "char-gpt-429k-docstrings/"

    def mean(v):
        return R.need(e, "val_loss_vs_adamw_mean", v)

    kinds = sorted({r["variant"][len(prose + "factored+"):] for r in select(R.rows(e), "val_loss_vs_adamw_mean")
                    if r["variant"].startswith(prose + "factored+")})
    base = mean(prose + "factored")
    moves = [abs(mean(f"{prose}factored+{k}") - base) for k in kinds]
    spread = statistics.median(R.values(e, "val_loss_vs_adamw_std", prose + "factored"))
    detail = (f"Per-element v everywhere leaves {pct(every)} ({MODELS['char-gpt-116k']}) and {pct(mean(prose + 'all'))} "
              f"({MODELS[prose[:-1]]}); on the "
              f"attention input matrices alone {pct(mean('attn_qkv'))} / {pct(mean(prose + 'attn_qkv'))}; the factored "
              f"second moment {pct(mean('factored'))} / {pct(base)}, and per-element v on any one kind of tensor on top of "
              f"it moves the prose model by at most {max(moves) * 100:.2f} points (its seeds' standard deviation: "
              f"{spread * 100:.1f} points). Means over seeds.")
    return Row("… the gap is the shared second moment", "found here",
               f"v per element everywhere: {pct(every)} vs AdamW's loss (shared v: {pct(shared)}; {MODELS['char-gpt-116k']} model)",
               fig(e), cmd(f"python experiments/{e}.py"), detail)


def _factored(R, e, model, prefix=""):
    """(8-bit, 4-bit) median loss ratios, worst of both protocols, and mean state B/param."""
    loss = [max(R.need(e, "val_loss_vs_adamw_median", p + f"Gefen-{b}-factored", x_value=model) for p in ("", "dropin/"))
            for b in ("8bit", "4bit")]
    state = [_state(R, e, prefix + f"Gefen-{b}-factored") for b in ("8bit", "4bit")]
    return loss, state


def _state(R, e, variant):
    """Mean state bytes per parameter of ``variant`` over its seeds."""
    return statistics.fmean(R.values(e, "state_bytes_per_param", variant))


def _factored_verdict(losses, states):
    """Loss met where both widths are within their targets; bytes met where both are within theirs."""
    loss_ok = [l8 - 1 <= LOSS_TARGET["8bit"] and l4 - 1 <= LOSS_TARGET["4bit"] for l8, l4 in losses]
    bytes_ok = all(s8 <= GEFEN_TARGET_BPP["Gefen-8bit-factored"] and s4 <= GEFEN_TARGET_BPP["Gefen-4bit-factored"]
                   for s8, s4 in states)
    return loss_ok, "bytes met" if bytes_ok else "bytes not met"


def _lr_share(variant) -> str:
    """"0.6×" from a drop-in variant named "gefen-x@0.6" (its lr as a share of AdamW's)."""
    return f"{float(variant.rpartition('@')[2]):g}×"


def _by_kind(R, model, name, kind):
    return R.need("gefen_memory", "state_bytes_per_param_of_kind", f"{model}/{name}", x_value=kind)


def _factored_detail(R, e):
    names = list(MODELS.values())

    def med(v, m):
        return R.need(e, "val_loss_vs_adamw_median", v, x_value=m)

    seeds = [len(R.values(e, "val_loss_vs_adamw", "Gefen-8bit-factored", x_value=m)) for m in MODELS]
    prose = list(MODELS)[-1]
    spread = R.values(e, "val_loss_vs_adamw", "Gefen-8bit-factored", x_value=prose)
    at = {p: {b: [med(f"{p}Gefen-{b}-factored", m) for m in MODELS] for b in ("8bit", "4bit")} for p in ("", "dropin/")}
    published = [R.need(e, "val_loss_vs_adamw_mean", "Gefen-8bit", x_value=m) for m in MODELS]
    share = next(v for v in variants_of(R, e, "val_loss_vs_adamw_median") if v.startswith("dropin/gefen-x@"))
    gx = {"own": [med("gefen-x", m) for m in MODELS], "dropin": [med("dropin/gefen-x", m) for m in MODELS],
          "share": [med(share, m) for m in MODELS]}
    state = [[_state(R, e, _model_prefix(m) + f"Gefen-{b}-factored") for m in MODELS] for b in ("8bit", "4bit")]
    gx_state = [_state(R, e, _model_prefix(m) + "gefen-x") for m in MODELS]
    reach = {b: [n for n, ours, x in zip(names, at[""][b], gx["own"]) if ours <= x] for b in ("8bit", "4bit")}
    kinds = [m for m in ("char-gpt-116k", "char-encoder-430k", "char-llama-427k")
             if select(R.rows("gefen_memory"), "state_bytes_per_param_of_kind", f"{m}/Gefen-8bit-factored")]
    vec = [_by_kind(R, m, "Gefen-8bit-factored", "vector") for m in kinds]
    gx_vec = [_by_kind(R, m, "gefen-x", "vector") for m in kinds]
    width = R.config(e)["n_embd"]
    big = [R.need("gefen_memory", "state_bytes_per_param", f"Gefen-{b}-factored", x_value="transformer")
           for b in ("8bit", "4bit")]
    steps = [R.need("gefen_speed", "step_time_vs_unfactored", f"{m}/Gefen-{b}-factored", x_value=1.0)
             for m in ("transformer", "mlp") for b in ("8bit", "4bit")]
    return (f"Factored / AdamW final loss, medians paired by seed ({' / '.join(map(str, seeds))} seeds), 8-bit / 4-bit "
            f"per model ({' / '.join(names)}): each optimizer at its best lr of a grid {joined(at['']['8bit'], pct)} and "
            f"{joined(at['']['4bit'], pct)}; under the drop-in protocol (AdamW's lr for all) {joined(at['dropin/']['8bit'], pct)} "
            f"and {joined(at['dropin/']['4bit'], pct)}. The prose model's seeds spread {pct_range(spread)} at 8 bits (the "
            f"optimizers differ in when a loss plateau ends). Published Gefen {joined(published, pct)} (8-bit, means); "
            f"gefen-x {joined(gx['own'], pct)} at its best lr, {joined(gx['dropin'], pct)} at AdamW's, and {joined(gx['share'], pct)} at "
            f"the {_lr_share(share)} its README advises. So the factored 8-bit reaches gefen-x's loss on "
            f"{listed(reach['8bit']) or 'none of the models'}, the 4-bit on {listed(reach['4bit']) or 'none'}. "
            f"State: {' / '.join(f'{x:.3g}' for x in state[0])} B/param at 8 bits, "
            f"{' / '.join(f'{x:.2f}' for x in state[1])} at 4 (gefen-x {' / '.join(f'{x:.3f}' for x in gx_state)}). "
            f"Which tensors carry the bytes (section \"Gefen: optimizer memory\", its seed): the vectors at "
            f"{min(vec):.1f}–{max(vec):.1f} B/param (a v per element; gefen-x {min(gx_vec):.1f}–{max(gx_vec):.1f}), the "
            f"{names[0]} model's matrices at {_by_kind(R, 'char-gpt-116k', 'Gefen-8bit-factored', 'matrix'):.3f} (width "
            f"{width}: a scale, a v and a column-factor share per row), the embeddings where the rule keeps a table per "
            f"element. On the memory benchmark's transformer the factored state is {big[0]:.3f} / {big[1]:.3f} B/param "
            f"(targets {GEFEN_TARGET_BPP['Gefen-8bit-factored']:g} / {GEFEN_TARGET_BPP['Gefen-4bit-factored']:g}). The "
            f"numba step on one thread takes {min(steps):.2f}–{max(steps):.2f} times the unfactored step's time on the "
            f"transformer and MLP (target at most {TARGET_FACTORED_STEP:g}: the factor adds a pass over the gradients, "
            "and a tiled matrix is stepped as several tensors).")


def variants_of(R, e, metric):
    return list(dict.fromkeys(r["variant"] for r in select(R.rows(e, metric), metric)))


def gefen_factored(R):
    e = "convergence"
    prefixes = ["", "char-gpt-1266k/", "char-gpt-429k-docstrings/"]
    out = [_factored(R, e, m, p) for m, p in zip(MODELS, prefixes)]
    loss_ok, bytes_word = _factored_verdict([o[0] for o in out], [o[1] for o in out])
    names = list(MODELS.values())
    met = [n for n, ok in zip(names, loss_ok) if ok]
    missed = [n for n, ok in zip(names, loss_ok) if not ok]
    verdict = (f"loss met on {', '.join(met) or 'none'}" + (f"; not on {', '.join(missed)}" if missed else "")
               + f"; {bytes_word}")
    head = (f"worse protocol: 8-bit {' / '.join(pct(o[0][0]) for o in out)}, 4-bit {' / '.join(pct(o[0][1]) for o in out)}; "
            f"8-bit state {' / '.join(f'{o[1][0]:.2f}' for o in out)} B/param ({' / '.join(names)})")
    return Row("Gefen at AdamW's loss with a factored second moment (ours), both protocols", verdict, head,
               fig(e), cmd(f"python experiments/{e}.py"), _factored_detail(R, e))


def _ablation_arch(R, prefix):
    """What the committed architecture ablation finds for one model: medians by seed."""
    a = "gefen_ablation_arch"

    def med(v):
        return R.median(a, "val_loss_vs_adamw", prefix + v)

    kinds = sorted({r["variant"][len(prefix + "factored+"):] for r in select(R.rows(a, "val_loss_vs_adamw"), "val_loss_vs_adamw")
                    if r["variant"].startswith(prefix + "factored+") and "/" not in r["variant"][len(prefix):]})
    fp32 = [k for k in kinds if k.startswith("fp32")]
    kinds = [k for k in kinds if k not in fp32]
    moved = sorted((med("factored+" + k), k) for k in kinds)
    seeds = sorted({r["seed"] for r in select(R.rows(a), "val_loss_vs_adamw", prefix + "factored")}, key=str)
    spread = statistics.median(R.values(a, "val_loss_vs_adamw_std", prefix + "factored"))
    return (f"The committed ablation (section \"Gefen: what the factored second moment leaves\", seeds "
            f"{', '.join(map(str, seeds))}, AdamW's lr) puts the factored 8-bit at {pct(med('factored'))} and v per "
            f"element everywhere at {pct(med('all'))}: per-element v on any one kind of matrix on top of the factor "
            f"moves the median between {pct(moved[0][0])} (`{moved[0][1]}`) and {pct(moved[-1][0])} (`{moved[-1][1]}`), "
            f"the first moment in fp32 {pct(med('factored+' + fp32[0])) if fp32 else '—'}; the factored run's seeds have "
            f"a standard deviation of {spread * 100:.2f} points.")


def _untuned(R, e, model, claim, about, ablation_prefix):
    """A row of a model Gefen was not tuned on; ``about`` says what the architecture is, in words."""
    loss, state = _factored(R, e, model)
    loss_ok, bytes_word = _factored_verdict([loss], [state])
    verdict = ("loss met" if loss_ok[0] else "loss not met") + f"; {bytes_word}"
    head = f"8-bit {pct(loss[0])}, 4-bit {pct(loss[1])} vs AdamW (both protocols); {state[0]:.2f} / {state[1]:.2f} B/param"
    return Row(claim, verdict, head, fig(e), cmd(f"python experiments/convergence.py --experiment {e}"),
               _untuned_detail(R, e, model, about, state) + " " + _ablation_arch(R, ablation_prefix))


def _untuned_detail(R, e, model, about, state):
    c = R.config(e)
    best = {r["variant"]: r["value"] for r in select(R.rows(e, "best_lr"), "best_lr")}
    adamw_lr = best["AdamW"]
    gefens = all(v == adamw_lr for k, v in best.items() if k.startswith("Gefen"))
    protocols = "so the two protocols coincide" if all(v == adamw_lr for v in best.values()) else "under both protocols"

    def med(v):
        return R.need(e, "val_loss_vs_adamw_median", v, x_value=model)

    share = next(v for v in variants_of(R, e, "val_loss_vs_adamw_median") if v.startswith("dropin/gefen-x@"))
    seeds = {b: R.values(e, "val_loss_vs_adamw", f"Gefen-{b}-factored", x_value=model) for b in ("8bit", "4bit")}
    gx_state = _state(R, e, "gefen-x")
    against = [f"the {b}-bit {'beats' if med(f'Gefen-{b}bit-factored') < med('gefen-x') else 'trails'} its loss at "
               f"{signed(s - gx_state)} B/param" for b, s in zip((8, 4), state)]
    kind = {k: _by_kind(R, model, "Gefen-8bit-factored", k) for k in ("matrix", "embedding", "vector")}
    gx_kind = [_by_kind(R, model, "gefen-x", k) for k in ("matrix", "embedding", "vector")]
    return (f"The {model} model ({about}), {c['steps']:,} steps, {len(c['seeds'])} seeds; AdamW's best lr of the grid is "
            f"{adamw_lr:g}" + (", every Gefen's too" if gefens else "") + f", {protocols}. Medians paired by seed "
            f"against AdamW: factored 8-bit {pct(med('Gefen-8bit-factored'))} ({pct_range(seeds['8bit'])}), 4-bit "
            f"{pct(med('Gefen-4bit-factored'))} ({pct_range(seeds['4bit'])}); the published 8-bit {pct(med('Gefen-8bit'))}, "
            f"torchao 8-bit {pct(med('torchao-AdamW8bit'))}, gefen-x {pct(med('gefen-x'))} at its own best lr "
            f"({best['gefen-x']:g}), {pct(med('dropin/gefen-x'))} at AdamW's and {pct(med(share))} at the "
            f"{_lr_share(share)} its README advises. State: {state[0]:.3f} / {state[1]:.3f} B/param (gefen-x "
            f"{gx_state:.3f}: {listed(against)}) against caps of {GEFEN_TARGET_BPP['Gefen-8bit-factored']:g} / "
            f"{GEFEN_TARGET_BPP['Gefen-4bit-factored']:g}: at width {c['n_embd']} the codes plus a v, a scale and a column "
            f"factor per row hold the matrices at {kind['matrix']:.3f} B/param, and the block rule keeps the embeddings "
            f"({kind['embedding']:.2f}) and vectors ({kind['vector']:.2f}) per element (section \"Gefen: optimizer "
            f"memory\", its seed; gefen-x {' / '.join(f'{x:.2f}' for x in gx_kind)}).")


def gefen_encoder(R):
    return _untuned(R, "convergence_encoder", "char-encoder-430k",
                    "… on a model it was not tuned on (pre-norm `nn.TransformerEncoderLayer`)",
                    "an encoder stack with the fused q/k/v `in_proj_weight` under a causal mask; the factored second "
                    "moment in square tiles of rows, q, k and v a column factor each, one v per element of a vector", "")


def gefen_llama(R):
    return _untuned(R, "convergence_llama", "char-llama-427k", "… on a Llama-style model",
                    "RMSNorm, SwiGLU, rotary positions, no biases, an untied head; the only tiles in the gate and up "
                    "projections", "char-llama-427k/")


def gefen_long(R):
    e, short, best = "convergence_long_lr", "convergence_encoder", "convergence_long"
    seeds = {r["seed"] for r in select(R.rows(e, "val_loss_vs_adamw"), "val_loss_vs_adamw")}
    long = [R.need(e, "val_loss_vs_adamw_median", f"dropin/Gefen-{b}-factored") for b in ("8bit", "4bit")]
    before = [median_over_seeds(R.rows(short, "val_loss_vs_adamw"), "val_loss_vs_adamw",
                                f"dropin/Gefen-{b}-factored", seeds) for b in ("8bit", "4bit")]
    if not all(math.isfinite(b) for b in before):
        raise ResultsError(f"{R.dir / short}.csv: no val_loss_vs_adamw of the factored Gefens' seeds {sorted(seeds)}")
    verdict = "not met: the factored gaps grow" if any(a > b for a, b in zip(long, before)) else "met"
    return Row(f"… and after {R.config(e)['steps']:,} steps (the encoder, drop-in, same lr)", verdict,
               f"8-bit {pct(long[0])} ({R.config(short)['steps']:,} steps: {pct(before[0])}), 4-bit {pct(long[1])} "
               f"({pct(before[1])}) vs AdamW",
               fig(e), cmd(f"python experiments/convergence.py --experiment {e}"), _long_detail(R, e, short, best, seeds))


def _long_detail(R, e, short, best, seeds):
    names = ["dropin/Gefen-8bit-factored", "dropin/Gefen-4bit-factored", "dropin/gefen-x"]
    share = next(v for v in variants_of(R, e, "val_loss_vs_adamw_median") if v.startswith("dropin/gefen-x@"))

    def per_seed(x, v):
        """{seed: loss ratio} of variant ``v`` in experiment ``x``, on this run's seeds."""
        return {r["seed"]: r["value"] for r in select(R.rows(x, "val_loss_vs_adamw"), "val_loss_vs_adamw", v)
                if r["seed"] in seeds}

    def med(x, v):
        return statistics.median(per_seed(x, v).values())

    def mean(x, v):
        return statistics.fmean(per_seed(x, v).values())

    now = {v: med(e, v) for v in names + [share]}
    then = {v: med(short, v) for v in names}
    hi = {v: med(best, v) for v in names + [share]}
    long8, short8 = per_seed(e, names[0]), per_seed(short, names[0])
    worse = sum(long8[s] > short8[s] for s in long8 if s in short8)
    grid = R.config(best)["lrs"]
    sweep = {r["x_value"]: r["value"] for r in select(R.rows(best, "lr_sweep_val_loss"), "lr_sweep_val_loss", "dropin/AdamW")}
    top = R.need(best, "best_lr", "dropin/AdamW")
    fixed_lr = R.config(e)["lrs"][0]
    near = sweep[fixed_lr] / sweep[top] - 1 if fixed_lr in sweep and top in sweep else math.nan
    steps = (R.config(e)["steps"], R.config(short)["steps"])
    return (f"The encoder {steps[0] // steps[1]}× as long, {len(seeds)} seeds, drop-in protocol, twice: at AdamW's best "
            f"lr of {' / '.join(f'{x:g}' for x in grid)} ({top:g}" + (", the grid's top" if top == max(grid) else "")
            + f"; {fixed_lr:g} within {near:.2%}), and at the {steps[1]:,}-step run's lr, {fixed_lr:g}, held fixed, so "
            f"that length alone changes. Medians paired by seed against the same seeds at {steps[1]:,} steps: at "
            f"{fixed_lr:g}, factored 8-bit {pct(now[names[0]])} (from {pct(then[names[0]])}; {pct_range(long8.values())}, "
            f"{worse} of {len(long8)} seeds worse), 4-bit {pct(now[names[1]])} (from {pct(then[names[1]])}), gefen-x "
            f"{pct(now[names[2]])} (from {pct(then[names[2]])}; {pct_range(per_seed(e, names[2]).values())}), gefen-x at "
            f"{_lr_share(share)} {pct(now[share])}; at {top:g}, factored 8-bit {pct(hi[names[0]])}, 4-bit "
            f"{pct(hi[names[1]])}, gefen-x {pct(hi[names[2]])}, at {_lr_share(share)} {pct(hi[share])}. So at an "
            f"unchanged lr the factored gaps move by {points(now[names[0]], then[names[0]])} (8-bit) and "
            f"{points(now[names[1]], then[names[1]])} (4-bit) with training, and gefen-x's by "
            f"{points(now[names[2]], then[names[2]])}; the means at {fixed_lr:g} are {pct(mean(e, names[2]))} (gefen-x) "
            f"and {pct(mean(e, names[0]))} (factored 8-bit), within {len(seeds)} seeds' spread. State "
            f"{_state(R, e, names[0]):.3f} / {_state(R, e, names[1]):.3f} B/param (gefen-x {_state(R, e, names[2]):.3f}).")


def gefen_bf16(R):
    e = "convergence_bf16"
    ours = R.need(e, "val_loss_vs_adamw_median", "Gefen-8bit-factored+bf16-sr")
    published = R.need(e, "val_loss_vs_adamw_median", "Gefen-8bit+bf16-sr")
    ok = [x - 1 <= BF16_TARGET for x in (ours, published)]
    verdict = (("holds for the factored 8-bit" if ok[0] else "not met for the factored 8-bit")
               + ("; holds for the published 8-bit" if ok[1] else "; not for the published 8-bit")
               + f" (target {BF16_TARGET:+.1%})")
    c = R.config(e)
    detail = (f"Medians over {len(c['seeds'])} seeds, {c['steps']:,} steps, each optimizer at its best lr of a grid, "
              f"against fp32 AdamW: plain bf16 AdamW (no fp32 copy, no stochastic rounding) "
              f"{pct(R.need(e, 'val_loss_vs_adamw_median', 'AdamW+bf16'))}, the factored 8-bit on fp32 weights "
              f"{pct(R.need(e, 'val_loss_vs_adamw_median', 'Gefen-8bit-factored'))}.")
    return Row("Gefen on bf16 weights, no fp32 copy (stochastic rounding, ours)", verdict,
               f"factored 8-bit {pct(ours)}, published 8-bit {pct(published)} vs fp32 AdamW's loss "
               f"({MODELS.get(c['model_label'], c['model_label'])} model)",
               fig(e), cmd(f"python experiments/convergence.py --experiment {e}"), detail)


def gefen_codebook(R):
    e = "codebook_dp"
    rows = R.rows(e, "cost_rel_diff_vs_upstream", "speedup_vs_upstream")
    diff = max(abs(r["value"]) for r in select(rows, "cost_rel_diff_vs_upstream"))
    fast = [r for r in select(rows, "speedup_vs_upstream") if r["variant"].startswith("ours-numba/")]
    top = max(fast, key=lambda r: (float(r["x_value"]), r["variant"]))
    levels = top["variant"].split("/K")[-1]
    numpy = R.need(e, "speedup_vs_upstream", top["variant"].replace("numba", "numpy"), x_value=top["x_value"])
    detail = (f"Upstream's optimum to {sci(diff)} (relative cost) at every size measured; the numpy path "
              f"{times(numpy, 0)} upstream's speed at the same size. The section adds the codebooks' quantisation "
              "error against absmax and dynamic codes.")
    return Row("Gefen's codebook DP is exact", "reproduced, faster" if diff < 1e-6 else "not met",
               f"largest relative cost difference from upstream {diff:.1g}; {times(top['value'], 0)} upstream's speed "
               f"at {int(float(top['x_value'])):,} bins × {levels} levels", fig("codebook"), cmd(f"python experiments/{e}.py"),
               detail)


def gefen_speed(R):
    from experiments.gefen_speed import SMALL_TENSORS  # the small-tensor model's count of tensors

    e = "gefen_speed"
    rows = R.rows(e, "step_time_vs_adamw", "launches_per_step")
    ours = ("Gefen-8bit", "Gefen-4bit", "Gefen-8bit-factored", "Gefen-4bit-factored")

    def speeds(model, names=ours):
        return [1 / R.need(e, "step_time_vs_adamw", f"{model}/{n}", x_value=THREADS) for n in names]

    large = speeds("transformer") + speeds("mlp")
    small = speeds("small-tensors")
    launches = [r["value"] for r in select(rows, "launches_per_step") if r["variant"] in ours]
    parts = [("met" if min(large) >= 1 else "not met") + " on CPU for large tensors",
             ("met" if min(small) >= 1 else "not met") + " for many small tensors",
             ("met" if max(launches) <= LAUNCH_TARGET else "not met") + " for the Triton path's launches"]
    peers = {p: [s for m in ("transformer", "mlp", "small-tensors") for s in speeds(m, (p,))]
             for p in ("torchao-AdamW8bit", "gefen-x")}
    counted = {m: [r["value"] for r in select(R.rows(e, m), m) if r["variant"] in ours]
               for m in ("device_ops_per_step", "host_syncs_per_step")}
    counts = sorted({r["x_value"] for r in select(rows, "launches_per_step") if r["variant"] in ours})
    detail = (f"{THREADS:g} thread: {span(large)} fused AdamW's speed on the transformer and MLP (8/4-bit, factored), "
              f"{span(small)} on {SMALL_TENSORS} small tensors; torchao 8-bit {span(peers['torchao-AdamW8bit'], 3)}, gefen-x "
              f"{span(peers['gefen-x'], 3)}. The Triton path issues {max(counted['device_ops_per_step']):g} torch device "
              f"operations, {max(counted['host_syncs_per_step']):g} host synchronisations and "
              f"{min(launches):g}–{max(launches):g} launches a step after the first, at "
              f"{listed(f'{c:g}' for c in counts)} tensors alike. The GPU timing of the step plan is not in these "
              "results (`bash experiments/gpu_checks.sh` measures it).")
    return Row(f"Gefen's step at the speed of its bytes (CPU: ≥ 1× fused AdamW's speed; Triton: ≤ {LAUNCH_TARGET} launches)",
               "; ".join(parts),
               f"{THREADS:g} thread: {span(large)} fused AdamW on large tensors, {span(small)} on {SMALL_TENSORS} small ones; "
               f"Triton path {min(launches):g}–{max(launches):g} launches a step", fig(e), cmd(f"python experiments/{e}.py"),
               detail)


def gefen_peak_memory(R):
    e = "gefen_peak_memory"
    rows = R.rows(e, "tensor_peak_per_param")
    R.rows("gefen_budgets", "largest_micro_batch")
    lean = "Gefen-8bit-factored+bf16-sr+in-backward"
    pre = "mlp-50.4M/mb8/"

    def peak(name):
        vals = select(rows, "tensor_peak_per_param", pre + name)
        if not vals:
            raise ResultsError(f"{R.dir / e}.csv: no tensor_peak_per_param of {pre + name}")
        return max(vals, key=lambda r: float(r["x_value"]))["value"]  # the last step: steady state

    peers = ["AdamW", "Adam-mini", "torchao-AdamW8bit", "torchao-AdamW4bit", "gefen-upstream", "gefen-x"]
    ours, lean_peak, adamw = peak("Gefen-8bit"), peak(lean), peak("AdamW")
    lowest = ours < min(peak(p) for p in peers) and lean_peak < peak("AdamW+bf16")
    mb = {n: R.need("gefen_budgets", "largest_micro_batch", f"micro_batch/{n}", x_value=0.5) for n in (lean, "AdamW")}
    return Row("Gefen has the lowest peak memory and trains larger micro-batches",
               "holds for ours (fp32 and lean mode)" if lowest else "not met",
               f"peak 8-bit {ours:.1f}, lean mode {lean_peak:.1f}, fused AdamW {adamw:.1f} B/param (50.4M MLP); "
               f"micro-batch in 0.5 GiB: lean {mb[lean]:g}, AdamW {mb['AdamW']:g}", fig(e), cmd(f"python experiments/{e}.py"))


def gefen_hessian(R):
    e = "hessian_alignment"
    rows = R.rows(e, "spearman_spread", "coupling_within", "val_loss")
    rho = max(abs(r["value"]) for r in select(rows, "spearman_spread"))
    models = sorted({r["variant"] for r in select(rows, "spearman_spread")})

    def last(metric, variant):
        vals = select(rows, metric, variant)
        if not vals:
            raise ResultsError(f"{R.dir / e}.csv: no {metric} of {variant}")
        return max(vals, key=lambda r: float(r["x_value"]))["value"]

    s2 = all(last("coupling_within", f"{m}/gefen") > last("coupling_within", f"{m}/random_gefen") for m in models)
    gap = {k: max(R.need(e, "val_loss", f"{m}/{k}") - R.need(e, "val_loss", f"{m}/adamw") for m in models)
           for k in ("gefen", "random_gefen")}
    s3 = gap["gefen"] <= S3_NATS
    words = ["not reproduced" if rho < S1_RHO else "reproduced", "reproduced" if s2 else "not reproduced",
             "reproduced" if s3 else "not reproduced"]
    if s3 and gap["random_gefen"] <= S3_NATS:
        words[2] += ", but random blocks of the same sizes do as well"
    m0 = models[-1]
    c = R.config(e)
    detail = (f"On a small {listed(models)} ({c['steps']} steps, {c['checkpoints']} checkpoints). S1: |Spearman "
              f"ρ(coupling, spread)| at most {rho:.2f} at every checkpoint, below the {S1_RHO:g} that would show a "
              f"correlation. S2: within-block coupling {last('coupling_within', m0 + '/gefen'):.2f} for Gefen's blocks "
              f"against {last('coupling_within', m0 + '/random_gefen'):.2f} for random blocks of the same sizes ({m0}). "
              f"S3: the final loss of Gefen's blocks is at most {gap['gefen']:+.3f} nats from AdamW's, of random blocks "
              f"{gap['random_gefen']:+.3f} (a tie is within {S3_NATS:g}); means over seeds.")
    return Row("Blocks follow Hessian coupling (S1 / S2 / S3)", " / ".join(words),
               f"S1: largest \\|Spearman ρ\\| {rho:.2f}; S2: within-block coupling {last('coupling_within', m0 + '/gefen'):.2f} "
               f"vs random {last('coupling_within', m0 + '/random_gefen'):.2f} ({m0})", fig(e), cmd(f"python experiments/{e}.py"),
               detail)


def _junit(path) -> dict:
    """Passed, failed and skipped counts of a pytest JUnit XML file."""
    import xml.etree.ElementTree as ET

    try:
        suites = ET.parse(path).getroot().iter("testsuite")
    except (OSError, ET.ParseError) as exc:
        raise ResultsError(f"{path}: not a test report ({exc})") from None
    n = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in n:
            n[k] += int(s.get(k, 0))
    return {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": n["failures"] + n["errors"],
            "skipped": n["skipped"]}


def gefen_gpu(R):
    g, k = "gpu/gefen_kernels", "kernel_resources"
    rows = select(R.rows(g, "speedup_vs_AdamW"), "speedup_vs_AdamW", "Gefen-8bit/fp32")
    sizes = sorted({r["x_value"] for r in rows}, key=float)
    if not sizes:
        raise ResultsError(f"{R.dir / g}.csv: no speedup_vs_AdamW of Gefen-8bit/fp32")
    step = [R.need(g, "speedup_vs_AdamW", "Gefen-8bit/fp32", x_value=s) for s in sizes]
    kernel = [R.need(g, "speedup_vs_AdamW", "Gefen-8bit/kernel/fp32", x_value=s) for s in sizes]
    label = " / ".join(f"{float(s) / 1e9:.2g}B" if float(s) >= 1e9 else f"{float(s) / 1e6:.0f}M" for s in sizes)

    def need(m, v):
        return [R.need(g, m, v, x_value=s) for s in sizes]

    ms = {v: need("step_time", v) for v in ("Gefen-8bit/fp32", "AdamW/fp32", "Gefen-8bit/kernel/fp32")}
    ours_f, adam_f = need("frac_of_copy", "Gefen-8bit/kernel/fp32"), need("frac_of_copy", "AdamW/fp32")
    floor = [R.need(g, "floor_bytes", "Gefen-8bit/fp32", x_value=s) / R.need(g, "floor_bytes", "AdamW/fp32", x_value=s)
             for s in sizes]
    around = [(a - b) / b for a, b in zip(ms["Gefen-8bit/fp32"], ms["Gefen-8bit/kernel/fp32"])]
    predicted = {d: max(r["value"] for r in select(R.rows(k, "time_vs_AdamW"), "time_vs_AdamW")
                        if r["variant"].startswith(f"predicted/Gefen-8bit/{d}/")) for d in ("fp32", "bf16")}
    copy = R.values(g, "bandwidth", "copy")[0]
    c = R.config(g)
    tests = _junit(R.dir / "gpu" / "kernel_tests.xml")
    moves = _junit(R.dir / "gpu" / "device_moves.xml")
    detail = (f"`Gefen.step()` against fused AdamW's step, median of {c['reps']} steps: "
              f"{' / '.join(f'{a:.1f} vs {b:.2f} ms' for a, b in zip(ms['Gefen-8bit/fp32'], ms['AdamW/fp32']))} at "
              f"{label} fp32 parameters ({joined(step, times)} AdamW's speed); bf16 parameters "
              f"{joined(need('speedup_vs_AdamW', 'Gefen-8bit/bf16'), times)}. The kernel alone (launch tables built once, the "
              f"`/kernel` variants) runs at {joined(kernel, times)} AdamW's speed in fp32, "
              f"{joined(need('speedup_vs_AdamW', 'Gefen-8bit/kernel/bf16'), times)} in bf16, at {min(ours_f):.0%}–{max(ours_f):.0%} "
              f"of the device's copy bandwidth in fp32 ({copy / 1e3:.1f} TB/s measured) where fused AdamW reaches "
              f"{min(adam_f):.0%}–{max(adam_f):.0%}. So the prediction from the compiled kernels and a traffic model "
              f"({predicted['fp32']:.2f} times AdamW's step time in fp32, {predicted['bf16']:.2f} in bf16: section "
              "\"Triton kernels\") is not met: the kernel moves "
              f"{min(floor):.2f} of AdamW's bytes but does not reach the bandwidth AdamW does, and the optimizer's work "
              f"around the kernel (per step, on the host and in extra device passes) costs {min(around):.1f}–"
              f"{max(around):.1f} times the kernel's time. The kernel tests on the GPU (`results/gpu/kernel_tests.xml`): "
              f"{tests['passed']} passed, {tests['failed']} failed; parameters moved to the GPU after the optimizer was "
              "built (DSA staged and direct, the ball, Gefen) train as SparseAdam and AdamW built there "
              f"(`device_moves.xml`: {moves['passed']} passed, {moves['failed']} failed). `bash "
              "experiments/gpu_checks.sh [DIR]` runs every GPU check on one GPU, each step time-limited (what it runs: "
              "[docs/DESIGN.md](../docs/DESIGN.md)); both benchmarks also run on the CPU with `--dry-run` (in the tests).")
    return Row("Gefen's Triton step on a GPU at fused AdamW's speed", "met (one H200)" if min(step) >= 1 else "not met (one H200)",
               f"step {' / '.join(times(s) for s in step)} fused AdamW ({label} fp32); kernel alone "
               f"{' / '.join(times(k) for k in kernel)}", "—", cmd("bash experiments/gpu_checks.sh"), detail)


ROWS = [dsa_correctness, dsa_speed, dsa_seed_benchmark, dsa_billions, dsa_no_device_memory, dsa_out_of_core,
        dsa_fault_injection, dsa_gpu, dsa_distributed, dsa_poincare, gefen_memory, gefen_quality, gefen_ablation,
        gefen_factored, gefen_encoder, gefen_llama, gefen_long, gefen_bf16, gefen_codebook, gefen_speed,
        gefen_peak_memory, gefen_hessian, gefen_gpu]

GLOSSARY = """Terms used in the table:

- **×**: times as fast as the baseline named (above 1: faster). **B/param**: bytes per parameter.
- **the seed**: the Disk Sparse Adam article's own benchmark: a 1M × 128 Poincaré-ball embedding table, batch 2048.
- **fresh / warm / cold**: DSA's state file just created (fresh), in the page cache (warm), or its pages dropped so
  every step reads the disk (cold). **QD32**: the disk's random-read rate with 32 reads in flight.
- **both protocols**: the convergence runs' two ways of choosing the lr: each optimizer at its own best lr of a
  grid, and every optimizer at AdamW's best lr (**drop-in**: a user swapping AdamW out without tuning).
- **S1 / S2 / S3**: the Gefen article's Hessian statements: (S1) larger Hessian coupling goes with a steadier
  ratio of squared gradients; (S2) Gefen's blocks group coupled parameters better than random blocks of the same
  sizes; (S3) a shared v on Gefen's blocks trains as well as AdamW.
- **lean mode**: 8-bit factored Gefen on bf16 weights with stochastic rounding, its step inside backward.
- **factored / published**: Gefen with `factor_second_moment=True` (ours) / the article's Gefen.
- **Verdicts**: *reproduced*: the article's claim holds here; *exceeded*: holds with a better figure; *holds*: a
  claim of this repository holds; *met / not met*: a stated target reached or not; *measured*: a figure with no
  target; *found here*: a result of this repository, not a claim of the articles."""


def setup_line(R) -> str:
    """Versions, devices and commits of the committed runs, from the CSVs and their configs."""
    def runs(pattern):
        out = []
        for path in sorted(R.dir.glob(pattern)):
            name = str(path.relative_to(R.dir))[:-4]
            rows = R.rows(name)
            out.append((rows[0], load_config(path.stem, path.parent)))
        return out

    def describe(items):
        torch = sorted({r["torch_version"] for r, _ in items})
        device = sorted({r["device"] for r, _ in items})
        ordered = sorted(items, key=lambda it: it[0]["timestamp"])
        commits = {r["git_commit"] for r, _ in items}
        # a run split into several experiments' files counts once
        walls = {(c.get("split_from") or {}).get("timestamp") or id(c): float(c.get("wall_seconds") or 0)
                 for _, c in items}
        wall = sum(walls.values())
        first, last = ordered[0][0]["git_commit"], ordered[-1][0]["git_commit"]
        where = f"commit {first}" if len(commits) == 1 else f"{len(commits)} commits, {first} (first run) .. {last} (last)"
        return f"torch {', '.join(torch)} on {', '.join(device)}, {where}", wall

    cpu, cpu_wall = describe(runs("*.csv"))
    gpu, gpu_wall = describe(runs("gpu/*.csv"))
    return (f"Setup: CPU rows: {cpu}; GPU rows: {gpu}. The full reproduction took {(cpu_wall + gpu_wall) / 3600:.1f} h "
            "of wall time (the runs' configs).")


def block(results_dir=RESULTS_DIR) -> str:
    """The Markdown between the claims markers."""
    R = Results(results_dir)
    cells = [f(R) for f in ROWS]
    lines = ["× = times as fast as the baseline named; every figure is read from the CSV named in "
             "results/README.md's section.", "", setup_line(R), "",
             "| claim | verdict | headline figure | figure | command |", "|---|---|---|---|---|"]
    lines += [f"| {r.claim} | **{r.verdict}** | {r.headline} | {r.figure} | {r.command} |" for r in cells]
    return "\n".join(lines + ["", GLOSSARY])


DETAIL_INTRO = ("Each row of the README's claims table with the conditions and caveats behind its headline, written by "
                "`python analysis/claims.py` from the same values as the table: every figure here is formatted from the "
                "CSVs and configs, and each entry names the runs it read and links the section with their full tables.")
DETAIL_SETUP = ("The CPU runs shared their machine with other jobs; weights are fp32 unless a row says otherwise. The GPU "
                "rows were measured once (`bash experiments/gpu_checks.sh`, `results/gpu/`); the \"Triton kernels\" "
                "section predicts from the kernels compiled ahead of time (`ptxas -v`, theoretical occupancy) and a "
                "traffic model.")
DETAIL_NOTES = ("**Gefen checkpoints under torch.distributed** (no row of the table). DCP needs shapes that do not depend "
                "on the blocks, so these checkpoints take several times the in-memory state's bytes on disk; loading into "
                "a different number of ranks works where every new shard is a whole number of the saved blocks, "
                "otherwise a `ValueError` names the parameter. `tests/test_gefen_distributed.py` checks on gloo ranks "
                "that DDP, FSDP2 and HSDP equal one process bit for bit and that DCP round trips and loads into fewer "
                "ranks continue bit for bit.")


def section_titles() -> dict:
    """{experiment: title of its section in results/README.md}, from every analysis script's ``REPORT``."""
    import importlib
    import pkgutil

    import analysis

    out = {}
    for module in pkgutil.iter_modules(analysis.__path__):
        if module.name in ("claims", "common", "figure_check"):
            continue
        report = getattr(importlib.import_module(f"analysis.{module.name}"), "REPORT", None)
        if report is not None:
            out[report.experiment] = report.title
    return out


def seeds_text(seeds) -> str:
    """"seed 0", "seeds 0–2" (a run of integers) or "seeds 0, 3"."""
    seeds = sorted(seeds, key=lambda s: (len(str(s)), str(s)))
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    ints = [int(s) for s in seeds if str(s).isdigit()]
    if len(ints) == len(seeds) and ints == list(range(ints[0], ints[0] + len(ints))):
        return f"seeds {ints[0]}–{ints[-1]}"
    return "seeds " + ", ".join(map(str, seeds))


def run_text(R, experiment, titles) -> str:
    """Where a row's figures come from: the section (or CSV) of ``experiment``, its run's commit, seeds, command."""
    rows = R.rows(experiment)
    config = R.run(experiment)
    title = titles.get(experiment)
    where = f"[{title}](#{anchor(title)})" if title else f"[results/{experiment}.csv]({experiment}.csv)"
    facts = [f"commit `{config.get('git_commit') or rows[0]['git_commit']}`"]
    device = config.get("device") or rows[0]["device"]
    if not device.startswith("cpu"):
        facts.append(f"{device}, torch {config.get('torch_version') or rows[0]['torch_version']}")
    seeds = {r["seed"] for r in rows if r.get("seed") not in (None, "")}
    if seeds:
        facts.append(seeds_text(seeds))
    if config.get("command"):
        facts.append(cmd(config["command"]))
    return f"{where} ({', '.join(facts)})"


def detail(results_dir=RESULTS_DIR) -> str:
    """The section "Claims in detail" of results/README.md: one paragraph a row of the table, after its setup."""
    R = Results(results_dir)
    titles = section_titles()
    parts = ["## Claims in detail", DETAIL_INTRO, f"{setup_line(R)} {DETAIL_SETUP}"]
    for f in ROWS:
        R.read = []
        row = f(R)
        runs = "; ".join(run_text(R, e, titles) for e in list(R.read))
        parts.append(f"**{row.claim}** (*{row.verdict}*): {row.headline}." + (f" {row.detail}" if row.detail else "")
                     + f" From {runs}.")
    parts.append(DETAIL_NOTES)
    return "\n\n".join(parts)


def replace_block(doc: str, text: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(doc):
        raise ResultsError(f"README.md has no {BEGIN} ... {END} block; add the two markers where the table goes")
    return pattern.sub(lambda _: f"{BEGIN}\n{text}\n{END}", doc, count=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument("--results-readme", type=Path, default=None,
                        help=f"where the claims' detail goes (default: RESULTS_DIR/README.md, its section {DETAIL})")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the README's table or the results' detail is not what would be written")
    args = parser.parse_args(argv)
    results_readme = args.results_readme or args.results_dir / "README.md"
    doc = args.readme.read_text()
    new = replace_block(doc, block(args.results_dir))
    text = detail(args.results_dir)
    if args.check:
        stale = [str(p) for p, ok in ((args.readme, new == doc),
                                      (results_readme, results_readme.exists() and read_section(results_readme, DETAIL) == text))
                 if not ok]
        for path in stale:
            print(f"{path}: the claims differ from the results; run python analysis/claims.py")
        return 1 if stale else 0
    args.readme.write_text(new)
    write_section(results_readme, DETAIL, text)
    print(f"wrote the claims table of {args.readme} and the claims' detail of {results_readme}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
