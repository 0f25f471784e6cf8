"""The claims table's rows of Disk Sparse Adam (``analysis/claims.py``), one function a row."""

from __future__ import annotations

import math

from analysis import dsa_distributed as distributed
from analysis import dsa_seed_benchmark as seed_benchmark
from analysis import poincare
from analysis import dsa_throughput as throughput
from analysis.common import ResultsError, select
from analysis.dsa_out_of_core import ISSUE_BASELINE as OOC_BASELINE
from analysis.claims_common import Row, cmd, fig, gib, joined, listed, mib, sci, thousands, times

SEED_GPU_SAMPLES_PER_S = 134_212  # the Disk Sparse Adam article's own figure (one GPU, the seed)
MAP_TOL = 1e-3  # Riemannian DSA against geoopt: MAP equal to this
OUT_OF_CORE_LIMIT_GIB = 2.0  # the memory cgroup that DSA's out-of-core target is set in


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
    ratio = throughput.speeds(R.rows(e, "throughput", "DiskSparseAdam_warm/SparseAdam"))
    warm, fresh, cold = ratio["warm"], ratio["fresh"], ratio["cold"]
    if not all(map(math.isfinite, warm + fresh + cold)):
        raise ResultsError(f"{R.dir / e}.csv: no warm, fresh or cold throughput of {cs}; rerun experiments/{e}.py")
    built = [R.need(e, "throughput_with_construction", f"{c}/DiskSparseAdam/fresh")
             / R.need(e, "throughput_with_construction", f"{c}/SparseAdam/fresh") for c in cs]
    loose = [R.need(e, "DiskSparseAdam_warm_fused/SparseAdam", f"{c}/ratio") for c in cs]
    bound = [R.need(e, "DiskSparseAdam_cold/disk_bound", f"{c}/ratio") for c in cs]
    verdict = ("faster when the state is cached; slower from a cold disk" if min(warm + fresh) > 1 > max(cold)
               else "measured")
    head = throughput.speed_headline(R.rows(e))
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
    last = R.at_end(e, "throughput", "DiskSparseRiemannianAdam")
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
               seed_benchmark.headline(R.rows(e), R.run(e)), fig(e), cmd(f"python experiments/{e}.py"),
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
    return Row("DSA state costs no accelerator memory", verdict, throughput.memory_headline(R.rows(e), R.rows(g)),
               fig("dsa_throughput"),
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
    top = R.at_end(e, "bytes_per_step", "paper/sharded")
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
               distributed.headline(R.rows(e)), fig(e), cmd(f"python experiments/{e}.py"), detail)


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
               poincare.headline(R.rows(e)), fig(e), cmd(f"python experiments/{e}.py"), detail)


# ---------------------------------------------------------------------------------- Gefen rows


ROWS = [dsa_correctness, dsa_speed, dsa_seed_benchmark, dsa_billions, dsa_no_device_memory, dsa_out_of_core,
        dsa_fault_injection, dsa_gpu, dsa_distributed, dsa_poincare]
