"""Throughput of Disk Sparse Adam against torch.optim.SparseAdam and the no-optimizer ceiling.

    python experiments/dsa_throughput.py            # full run -> results/dsa_throughput.csv
    python experiments/dsa_throughput.py --quick    # smaller KG table, fewer repeats -> results/quick/
    python analysis/dsa_throughput.py               # paper_figs/dsa_throughput.png

Two configurations, each measured side by side in one process and reported as medians over repeats;
the warm variants are interleaved within every repeat (in a shuffled order), the cold one follows
(dropping the cache also drops the mapping's page tables, which would tax an interleaved warm step):

- ``seed``: the Disk Sparse Adam seed's setup, ``nn.Embedding(1_000_000, 128, sparse=True)`` (--quick:
  200k rows), batch 2048 uniform indices, loss ``mean(x**2)``, lr 1e-3.
- ``kg``: a knowledge-graph scorer (DistMult), entity table 2M x 64 (--quick: 200k) with Zipf-skewed
  entity frequencies plus a 1000 x 64 relation table, 1024 triples with 4 negative tails each,
  logistic loss: two tables, heavy duplicates.

Variants: ``ceiling`` (forward+backward, no optimizer step), ``SparseAdam`` (moments in RAM),
``SparseAdam/fresh`` and ``DiskSparseAdam/fresh`` (where a user starts: a new optimizer, for DSA on a
new state_dir, its construction and first --fresh-steps steps timed; one of each per repeat in
alternating order, after the imports and kernels are loaded; ``throughput`` over the steps after the
first 10, ``throughput_with_construction`` over all of them with the construction counted),
``DiskSparseAdam/warm`` (state file in the page cache; the default ``huge_pages=None`` maps it
with 2 MiB pages, as it fits in RAM), ``DiskSparseAdam/warm-fused`` (the same optimizer and state
with ``bitwise=False``: one fused pass, a correctly rounded sqrt), ``DiskSparseAdam/cold`` (the same files reopened with 4 KiB
pages, their pages dropped with madvise/posix_fadvise DONTNEED before every step; the drop itself
is not timed), next
to ``disk/4KiB-random-read`` (synchronous 4 KiB preads at random offsets of a dropped state file) and
the bound it implies for a cold step (one page read per touched row). Rows: samples/s (wall clock and
per CPU second of the process, the latter robust to other jobs on the machine), ratios, process RSS
(anonymous and file-backed) and bytes on disk. Before measuring, every state record is written once
(the steady state of a long run: ext4 converts the preallocated extents at the first write of a
page, a one-time cost that is not a step's). Torch runs single-threaded by default (--threads), so a
step's time is the kernels' and not the thread pool's; with --threads N > 1 every variant gets N threads and the configs are
tagged seed@Nt, kg@Nt.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time

import torch

from experiments.harness import check
from experiments.harness.common import Results, add_common_args
from experiments.harness.disk import random_read_rate
from experiments.harness.models import DistMult, EmbeddingSquare
from experiments.harness.registry import make_optimizer
from experiments.harness.train import interleaved


# the --check size: the full run's flags it overrides (experiments/harness/check.py)
CHECK = {"--reps": 5, "--fresh-reps": 3}
CHECK_NOTE = ("the full run's tables (seed 1M × 128, KG 2M × 64), 5 repeats where it has 11: the same ratios with a wider "
              "spread; timings on a machine shared with other jobs")


def rss_mib():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) / 1024
    return out


def make_batches(cfg, n, gen):
    if cfg["name"] == "seed":
        return [(torch.randint(0, cfg["rows"], (cfg["batch"],), generator=gen),) for _ in range(n)]
    rows, b = cfg["rows"], cfg["batch"]
    perm = torch.randperm(rows, generator=gen)

    def zipf(shape):  # rank = floor(rows * u^3): a few entities dominate, as in real KGs
        return perm[(rows * torch.rand(shape, generator=gen) ** 3).long().clamp_(max=rows - 1)]

    return [(zipf((b,)), torch.randint(0, 1000, (b,), generator=gen), zipf((b,)), zipf((b, 4)))
            for _ in range(n)]


def run_config(cfg, args, res, tmp):
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = EmbeddingSquare(cfg["rows"], cfg["dim"]) if cfg["name"] == "seed" else DistMult(cfg["rows"], 1000, cfg["dim"])
    batches = make_batches(cfg, 32, gen)
    # Runs on more than one torch thread are configs of their own ("seed@2t"): ceiling and optimizers
    # all get the threads, and the 1-thread rows stay comparable across commits.
    tag = cfg["name"] if args.threads == 1 else f"{cfg['name']}@{args.threads}t"
    x = dict(x_name="config", x_value=tag)
    params = list(model.parameters())

    def fwd_bwd(k):
        for p in params:
            p.grad = None
        model.loss(*batches[k % len(batches)]).backward()

    sparse_adam, dsa = _memory(res, tag, x, params, fwd_bwd, tmp)
    fresh, fresh_first = _fresh(args, cfg, params, fwd_bwd, os.path.join(tmp, f"{tag}-fresh"))

    def dsa_step(k, bitwise=True):
        for group in dsa.param_groups:  # a param-group option, like lr: both variants share the state
            group["bitwise"] = bitwise
        fwd_bwd(k)
        dsa.step()

    def steps(fn, n):
        return lambda: [fn(k) for k in range(n)]

    variants = {
        "ceiling": lambda k: fwd_bwd(k),
        "SparseAdam": lambda k: (fwd_bwd(k), sparse_adam.step()),
        "DiskSparseAdam/warm": dsa_step,
        "DiskSparseAdam/warm-fused": lambda k: dsa_step(k, bitwise=False),
    }
    # interleaved, in a different order every repeat; each call is args.steps steps
    times = interleaved({v: steps(fn, args.steps) for v, fn in variants.items()}, args.reps, shuffle=True,
                        progress=True, desc=f"{tag} warm repeats")
    samples = cfg["batch"] * args.steps
    walls = {v: [samples / w for w in t["wall"]] for v, t in times.items()}
    cpus = {v: [samples / c for c in t["cpu"]] for v, t in times.items()}
    res.add(f"{tag}/DiskSparseAdam/warm", "huge_pages", "bool", float(dsa.state_files()[0].huge_pages), **x)
    dsa.close()
    # Cold cache last: dropping the pages also drops the mapping's page tables, which would cost
    # the warm variant page faults if the two were interleaved. The cold optimizer reopens the same
    # (clean) state files with 4 KiB pages: the default maps files that fit in RAM with huge pages,
    # which a cold step would read 2 MiB at a time (the huge_pages=None rule never picks them for
    # state that does not stay in the page cache, which is what the cold variant stands for).
    dsa = make_optimizer("DiskSparseAdam", params, lr=1e-3, state_dir=os.path.join(tmp, tag), huge_pages=False,
                         resume=True)
    walls["DiskSparseAdam/cold"], cpus["DiskSparseAdam/cold"], reads = _cold(args, cfg, dsa, dsa_step)
    dsa.close()
    walls.update(fresh)
    for v, rates in fresh_first.items():
        res.add(f"{tag}/{v}", "throughput_with_construction", "samples/s", statistics.median(rates), **x)
    rows_per_step = statistics.median(sum(int(torch.unique(t).numel()) for t in _tensors(b))
                                      for b in batches[:8])
    _report(res, tag, x, args, walls, cpus, reads, cfg["batch"], rows_per_step)


def _memory(res, tag, x, params, fwd_bwd, tmp):
    """Both optimizers after one step each, and what each added to the process's memory and disk."""
    mem0 = rss_mib()
    sparse_adam = make_optimizer("SparseAdam", params, lr=1e-3)
    fwd_bwd(0)
    sparse_adam.step()
    mem1 = rss_mib()
    dsa = make_optimizer("DiskSparseAdam", params, lr=1e-3, state_dir=os.path.join(tmp, tag))
    stores = dsa.state_files()
    for st in stores:
        # Steady state of a long run: every record written once (ext4 turns the preallocated,
        # unwritten extents into written ones on first writeback; that one-time cost is not a step's).
        st.write_all(None, st.step)
    fwd_bwd(0)
    dsa.step()
    mem2 = rss_mib()
    res.add(f"{tag}/SparseAdam", "rss_anon_delta", "MiB", mem1["RssAnon"] - mem0["RssAnon"], **x)
    res.add(f"{tag}/DiskSparseAdam", "rss_anon_delta", "MiB", mem2["RssAnon"] - mem1["RssAnon"], **x)
    res.add(f"{tag}/DiskSparseAdam", "rss_file_delta", "MiB", mem2["RssFile"] - mem1["RssFile"], **x)
    res.add(f"{tag}/process", "rss", "MiB", mem2["VmRSS"], **x)
    res.add(f"{tag}/DiskSparseAdam", "bytes_on_disk", "bytes",
            sum(os.stat(st.path).st_blocks * 512 for st in stores), **x)
    res.add(f"{tag}/SparseAdam", "state_bytes_in_ram", "bytes",
            sum(2 * p.numel() * p.element_size() for p in params), **x)
    return sparse_adam, dsa


def _fresh(args, cfg, params, fwd_bwd, root):
    """Per repeat, a new SparseAdam and a new DiskSparseAdam on a new state_dir (alternating which goes
    first): ({variant: samples/s after the first 10 steps}, {variant: samples/s over all
    --fresh-steps steps with the construction counted}), one value per repeat."""
    after, first = {}, {}
    for rep in range(args.fresh_reps):
        names = ["SparseAdam", "DiskSparseAdam"][::1 if rep % 2 == 0 else -1]
        for name in names:
            gc.collect()
            state_dir = os.path.join(root, f"{rep}")
            kw = dict(state_dir=state_dir) if name == "DiskSparseAdam" else {}
            t0 = time.perf_counter()
            opt = make_optimizer(name, params, lr=1e-3, **kw)
            for k in range(args.fresh_steps):
                if k == 10:
                    t10 = time.perf_counter()
                fwd_bwd(k)
                opt.step()
            t1 = time.perf_counter()
            if hasattr(opt, "close"):
                opt.close()
            del opt
            shutil.rmtree(state_dir, ignore_errors=True)
            after.setdefault(f"{name}/fresh", []).append(cfg["batch"] * (args.fresh_steps - 10) / (t1 - t10))
            first.setdefault(f"{name}/fresh", []).append(cfg["batch"] * args.fresh_steps / (t1 - t0))
    return after, first


def _cold(args, cfg, dsa, dsa_step):
    """Samples/s (wall and per CPU second) of steps that find no state page cached, and the disk's
    4 KiB random-read rate measured after each repeat."""
    stores = dsa.state_files()

    def drop(_name=None):
        for st in stores:
            st.drop_cache()

    walls, cpus, reads = [], [], []
    samples = cfg["batch"] * args.cold_steps
    for rep in range(args.reps):
        # one step per call, every page dropped (untimed) before it
        batch_ids = iter(range(rep * args.cold_steps, (rep + 1) * args.cold_steps))
        t = interleaved({"cold": lambda: dsa_step(next(batch_ids))}, args.cold_steps, before=drop)["cold"]
        walls.append(samples / sum(t["wall"]))
        cpus.append(samples / sum(t["cpu"]))
        reads.append(random_read_rate(stores[0].path, args.disk_reads, args.seed + rep))
    return walls, cpus, reads


def _report(res, tag, x, args, walls, cpus, reads, batch, rows_per_step):
    """Medians, the cold bound (one page read per touched row: records are 1 KiB or less, rows
    scattered) and the ratios, into the results and the log."""
    med = {v: statistics.median(walls[v]) for v in walls}
    med_cpu = {v: statistics.median(cpus[v]) for v in cpus}
    for v in walls:
        res.add(f"{tag}/{v}", "throughput", "samples/s", med[v], **x)
        if v in med_cpu:  # the fresh variants are timed on the wall clock only
            res.add(f"{tag}/{v}", "throughput_per_cpu_second", "samples/s", med_cpu[v], **x)
    read_rate = statistics.median(reads)
    bound = batch * read_rate / rows_per_step
    res.add(f"{tag}/disk", "random_read_4KiB", "reads/s", read_rate, **x)
    res.add(f"{tag}/disk", "cold_bound", "samples/s", bound, **x)
    ratios = {
        "DiskSparseAdam_warm/SparseAdam": med["DiskSparseAdam/warm"] / med["SparseAdam"],
        "DiskSparseAdam_warm/ceiling": med["DiskSparseAdam/warm"] / med["ceiling"],
        "DiskSparseAdam_cold/disk_bound": med["DiskSparseAdam/cold"] / bound,
        "cpu:DiskSparseAdam_warm/SparseAdam": med_cpu["DiskSparseAdam/warm"] / med_cpu["SparseAdam"],
        "cpu:DiskSparseAdam_warm/ceiling": med_cpu["DiskSparseAdam/warm"] / med_cpu["ceiling"],
        "DiskSparseAdam_warm_fused/SparseAdam": med["DiskSparseAdam/warm-fused"] / med["SparseAdam"],
        "DiskSparseAdam_warm_fused/ceiling": med["DiskSparseAdam/warm-fused"] / med["ceiling"],
        "DiskSparseAdam_fresh/SparseAdam_fresh": med["DiskSparseAdam/fresh"] / med["SparseAdam/fresh"],
    }
    for name, r in ratios.items():
        res.add(f"{tag}/ratio", name, "x", r, **x)
    print(f"[{tag}] samples/s (wall, median of {args.reps}): "
          + ", ".join(f"{v} {med[v]:,.0f}" for v in walls)
          + f"; disk {read_rate:,.0f} reads/s -> cold bound {bound:,.0f}")
    print(f"[{tag}] ratios: " + ", ".join(f"{k} {r:.2f}" for k, r in ratios.items()))


def _tensors(b):
    """A batch's index tensors, one per table: (rows,) or (entities, relations)."""
    if len(b) == 1:
        return [b[0]]
    return [torch.cat([b[0], b[2], b[3].flatten()]), b[1]]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--configs", default="seed,kg", help="comma-separated: seed, kg")
    parser.add_argument("--reps", type=int, default=None, help="repeats (default 11, --quick 3)")
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per variant and repeat (default 40, --quick 10)")
    parser.add_argument("--cold-steps", type=int, default=None,
                        help="cold-cache steps per repeat (default 5, --quick 2)")
    parser.add_argument("--disk-reads", type=int, default=2000)
    parser.add_argument("--fresh-steps", type=int, default=None,
                        help="steps of each fresh optimizer, the first 10 untimed for the rate (default 160, --quick 30)")
    parser.add_argument("--fresh-reps", type=int, default=None, help="fresh optimizers of each kind (default 5, --quick 2)")
    parser.add_argument("--rows", type=int, default=None,
                        help="table rows of every config (default: seed 1M, kg 2M, --quick 200k each); for smoke runs")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch (and so numba) threads for every variant; >1 tags the configs, e.g. seed@2t")
    parser.add_argument("--state-dir", default=None, help="where the state files go (default: a temp dir)")
    args = check.parse(parser, argv)
    args.reps = args.reps or (3 if args.quick else 11)
    args.steps = args.steps or (10 if args.quick else 40)
    args.cold_steps = args.cold_steps or (2 if args.quick else 5)
    args.fresh_steps = args.fresh_steps or (30 if args.quick else 160)
    args.fresh_reps = args.fresh_reps or (2 if args.quick else 5)
    if args.fresh_steps <= 10:
        parser.error("--fresh-steps must be > 10 (the first 10 are not in the rate)")
    torch.set_num_threads(args.threads)
    configs = {
        "seed": dict(name="seed", rows=200_000 if args.quick else 1_000_000, dim=128, batch=2048),
        "kg": dict(name="kg", rows=200_000 if args.quick else 2_000_000, dim=64, batch=1024),
    }
    chosen = [configs[c] for c in args.configs.split(",")]
    if args.rows is not None:
        if args.rows < 1000:
            parser.error("--rows must be >= 1000 (the KG config has 1000 relations and Zipf-skewed entities)")
        chosen = [dict(c, rows=args.rows) for c in chosen]
    with Results("dsa_throughput", args, config={**vars(args), "configs": chosen}) as res, \
            tempfile.TemporaryDirectory(prefix="dsa-bench-", dir=args.state_dir) as tmp:
        for cfg in chosen:
            run_config(cfg, args, res, tmp)


if __name__ == "__main__":
    main()
