"""Disk Sparse Adam out of core: cold rows at the disk's parallel rate, memory limits, the compact format.

    python experiments/dsa_out_of_core.py            # full run -> results/dsa_out_of_core.csv
    python experiments/dsa_out_of_core.py --quick    # smaller tables, fewer repeats -> results/quick/
    python experiments/dsa_out_of_core.py --parts cold,limits   # some parts only
    python analysis/dsa_out_of_core.py               # paper_figs/dsa_out_of_core.png

Parts (``--parts``; each writes its own rows):

- ``cold``: the seed configuration's table (``nn.Embedding(1M, 128, sparse=True)``, batch 2048
  uniform rows; --quick 200k rows) with its state file's pages dropped once per repeat, then
  ``--cold-steps`` steps on fresh uniform batches, so every step's rows are cold (a step's rows
  repeat an earlier step's rarely). Variants, interleaved in a shuffled order per repeat: exact DSA
  reading its pages one fault at a time (``store.SAMPLE_PAGES = 0``: no parallel reads), with the
  step's pages read in parallel (the default), with the next batch announced (``prefetch``) before
  each step's forward pass, and the compact format likewise. In the same repeats the disk's
  4 KiB random-read rate on the dropped state file: one ``pread`` at a time (queue depth 1) and 32
  threads doing ``pread`` (queue depth 32). Bound of a cold step: one page read per touched record
  page at that rate. Then warm steps of both formats (state files read into the cache), interleaved.
- ``limits``: a 2M x 128 table (1 GiB of float32 weights in RAM; --quick 500k x 64), batch 2048
  uniform rows, under memory cgroup (v1) limits (--quick: 1 GiB only, at most 100 steps): each run is a child process in a fresh cgroup
  (removed afterwards) that reads the state file once (keeping what the limit allows), then steps
  with the next batch announced for ``--limit-seconds`` (or ``--limit-steps``), reporting samples/s
  after the first steps. ``SparseAdam`` (moments in RAM), exact and compact DSA. A run the kernel
  kills for memory counts as not completed. Skipped with a message where cgroups cannot be created.
- ``quality``: a knowledge-graph task (the KG configuration's DistMult scorer: 64 dims, Zipf-skewed
  heads, 4 negatives, batch 1024; 5,000 entities, 100 relations, 500k training triples, 8 epochs;
  the tail of a triple is the best of 32 random entities under a planted rank-16 DistMult teacher;
  --quick 2,000 entities, 50k triples, 3 epochs, 1 seed) trained with exact and compact DSA from the
  same start on the same batches, 3 seeds; final validation loss (held-out triples of the same teacher) per seed. Also the first moments' reconstruction error of the compact format's
  linear int8 code against a 256-level codebook learned from their histogram (Gefen's exact DP), on
  the exact run's final moments.

Timings were taken on whatever else the machine ran: ratios come from one run, interleaved.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn

from experiments.harness import memcg
from experiments.harness.child import emit_result, module_cmd, run_child
from experiments.harness import check
from experiments.harness.common import Results, add_common_args
from experiments.harness.disk import drop_cache, random_read_rate
from experiments.harness.models import DistMult
from experiments.harness.registry import dsa_state_bytes_per_row, make_optimizer

# -- cold steps ------------------------------------------------------------------------------------
# the --check size: the full run's flags it overrides (experiments/harness/check.py)
CHECK = {"--reps": 2, "--cold-steps": 8, "--limits": "2", "--limit-seconds": 10}
CHECK_NOTE = ("the seed's table, 2 cold repeats of 8 steps, one memory limit (2 GiB, the claim's): the same ratios to the "
              "disk's QD32 rate with a wider spread; timings on a machine shared with other jobs")


def _seed_step(emb, opt, idx, announce=None):
    if announce is not None:
        opt.prefetch(announce)
    emb.weight.grad = None
    (emb(idx) ** 2).mean().backward()
    opt.step()


def run_cold(args, res, tmp):
    from optim.disk_sparse import store as store_mod

    rows, dim, batch = (200_000 if args.quick else 1_000_000), 128, 2048
    x = dict(x_name="config", x_value="seed")
    torch.manual_seed(args.seed)
    embs, opts = {}, {}
    for fmt in ("exact", "compact"):
        embs[fmt] = nn.Embedding(rows, dim, sparse=True)
        opts[fmt] = make_optimizer("DiskSparseAdam", embs[fmt].parameters(), lr=1e-3, huge_pages=False,
                                   state_dir=os.path.join(tmp, f"cold-{fmt}"), state_format=fmt)
        for st in opts[fmt].state_files():
            st.write_all(None, 0)  # real blocks: unwritten extents would read as zeros without I/O
    gen = torch.Generator().manual_seed(args.seed)
    sample_pages = store_mod.SAMPLE_PAGES
    variants = {"exact/one-at-a-time": ("exact", False, 0), "exact/parallel": ("exact", False, sample_pages),
                "exact/prefetch": ("exact", True, sample_pages), "compact/parallel": ("compact", False, sample_pages),
                "compact/prefetch": ("compact", True, sample_pages)}
    speed = {v: [] for v in variants}
    cpu = {v: [] for v in variants}  # samples per CPU second of the process (user + system)
    reads = {1: [], 32: []}
    pages_per_step = {"exact": [], "compact": []}
    for rep in range(args.reps):
        order = list(variants)
        random.Random(rep).shuffle(order)
        for name in order:
            fmt, announce, sample = variants[name]
            emb, opt = embs[fmt], opts[fmt]
            batches = [torch.randint(0, rows, (batch,), generator=gen) for _ in range(args.cold_steps + 1)]
            store_mod.SAMPLE_PAGES = sample
            st = opt.state_files()[0]
            st.drop_cache()
            t, c = time.perf_counter(), os.times()
            for k in range(args.cold_steps):
                _seed_step(emb, opt, batches[k], batches[k + 1] if announce else None)
            speed[name].append(batch * args.cold_steps / (time.perf_counter() - t))
            c1 = os.times()
            cpu[name].append(batch * args.cold_steps / (c1.user + c1.system - c.user - c.system))
            store_mod.SAMPLE_PAGES = sample_pages
            pages_per_step[fmt] += [int(st._page_runs(torch.unique(b).numpy())[1].sum()) for b in batches[:2]]
        path = opts["exact"].state_files()[0].path
        for qd in reads:
            reads[qd].append(random_read_rate(path, args.disk_reads, args.seed + rep, threads=qd))
    _warm(args, res, x, embs, opts, gen, rows, batch)
    for opt in opts.values():
        opt.close()
    # pages a step's rows lie on (of the first step after a drop: later steps of a compact table
    # find some pages read by earlier ones, 30 rows sharing a page)
    pages = {fmt: statistics.median(p) for fmt, p in pages_per_step.items()}
    med = {v: statistics.median(s) for v, s in speed.items()}
    rate = {qd: statistics.median(r) for qd, r in reads.items()}
    for qd, r in rate.items():
        res.add(f"disk/QD{qd}", "random_read_4KiB", "reads/s", r, **x)
        for fmt, n in pages.items():
            res.add(f"disk/QD{qd}/{fmt}", "cold_bound", "samples/s", batch * r / n, **x)
    for fmt, n in pages.items():
        res.add(f"disk/{fmt}", "pages_per_step", "pages", n, **x)
    for v, s in med.items():
        res.add(f"DiskSparseAdam/{v}", "cold_throughput", "samples/s", s, **x)
        res.add(f"DiskSparseAdam/{v}", "cold_throughput_per_cpu_second", "samples/s", statistics.median(cpu[v]), **x)
        for qd, r in rate.items():
            res.add(f"DiskSparseAdam/{v}", f"cold_over_QD{qd}_bound", "x", s / (batch * r / pages[variants[v][0]]), **x)
    print(f"[cold] disk QD1 {rate[1]:,.0f} reads/s, QD32 {rate[32]:,.0f} reads/s, pages/step {pages}; "
          + ", ".join(f"{v} {s:,.0f} samples/s ({s / (batch * rate[32] / pages[variants[v][0]]):.2f} of QD32 bound)"
                      for v, s in med.items()))


def _warm(args, res, x, embs, opts, gen, rows, batch):
    """Warm steps (both state files read into the page cache first), the formats interleaved."""
    for opt in opts.values():
        with open(opt.state_files()[0].path, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass
    speed = {fmt: [] for fmt in opts}
    for rep in range(args.reps):
        order = list(opts)
        random.Random(100 + rep).shuffle(order)
        for fmt in order:
            batches = [torch.randint(0, rows, (batch,), generator=gen) for _ in range(args.warm_steps)]
            t = time.perf_counter()
            for idx in batches:
                _seed_step(embs[fmt], opts[fmt], idx)
            speed[fmt].append(batch * len(batches) / (time.perf_counter() - t))
    med = {fmt: statistics.median(v) for fmt, v in speed.items()}
    for fmt, v in med.items():
        res.add(f"DiskSparseAdam/{fmt}/warm", "warm_throughput", "samples/s", v, **x)
    res.add("ratio", "compact_over_exact_warm", "x", med["compact"] / med["exact"], **x)
    print(f"[warm] exact {med['exact']:,.0f}, compact {med['compact']:,.0f} samples/s "
          f"(compact / exact {med['compact'] / med['exact']:.2f})")


# -- memory limits ---------------------------------------------------------------------------------
def _cgroups_usable():
    if memcg.cgroups_usable():
        return True
    print(f"[limits] skipped: cannot create a memory cgroup under {memcg.CGROUP_ROOT}; run as root on "
          "a machine with the cgroup v1 memory controller, or use systemd-run --user --scope -p "
          "MemoryMax=... for one run")
    return False


def _child_main(spec):
    """One run inside a cgroup: build the table, read the state file once, step, print the result line."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rows, dim, batch = spec["rows"], spec["dim"], spec["batch"]
    emb = nn.Embedding(rows, dim, sparse=True)
    name = spec["optimizer"]
    if name == "SparseAdam":
        opt = torch.optim.SparseAdam(list(emb.parameters()), lr=1e-3)
    else:
        opt = make_optimizer("DiskSparseAdam", emb.parameters(), lr=1e-3, state_dir=spec["state_dir"],
                             resume=True, huge_pages=False, state_format=spec["state_format"])
        with open(opt.state_files()[0].path, "rb", buffering=0) as f:  # what fits stays in the cache
            while f.read(8 << 20):
                pass
    gen = torch.Generator().manual_seed(1)
    nxt = torch.randint(0, rows, (batch,), generator=gen)
    times = []
    t0 = os.times()
    t_end = time.perf_counter() + spec["seconds"]
    while len(times) < spec["steps"] and time.perf_counter() < t_end:
        idx, nxt = nxt, torch.randint(0, rows, (batch,), generator=gen)
        t = time.perf_counter()
        _seed_step(emb, opt, idx, nxt if name != "SparseAdam" else None)
        times.append(time.perf_counter() - t)
    if hasattr(opt, "close"):
        opt.close()
    steady = times[spec["warmup"]:] or times
    t1 = os.times()
    emit_result(dict(steps=len(times), samples_per_s=batch * len(steady) / sum(steady),
                     user_s_per_step=(t1.user - t0.user) / len(times), sys_s_per_step=(t1.system - t0.system) / len(times),
                     wall_s_per_step=sum(times) / len(times)))


def _run_limited(spec, limit_bytes, timeout):
    """Run ``_child_main(spec)`` in a fresh memory cgroup (no limit for None): (result or None, the run)."""
    run = run_child(module_cmd("experiments.dsa_out_of_core", "--child", json.dumps(spec)), timeout=timeout,
                    memory=("dsa-ooc", limit_bytes))
    if run.returncode not in (0, -signal.SIGKILL, None):
        print(f"[limits] child failed ({run.returncode}): {run.stderr[-2000:]}")
    return run.result, run


def run_limits(args, res, tmp):
    if not _cgroups_usable():
        return
    from optim import DiskSparseAdam

    rows, dim = (500_000, 64) if args.quick else (2_000_000, 128)
    base = dict(rows=rows, dim=dim, batch=2048, seconds=args.limit_seconds, steps=args.limit_steps, warmup=5)
    x_name = "memory_limit_GiB"
    dirs = {}
    for fmt in ("exact", "compact"):  # written once, reopened by every run
        dirs[fmt] = os.path.join(tmp, f"limits-{fmt}")
        with DiskSparseAdam([torch.empty(rows, dim)], state_dir=dirs[fmt], state_format=fmt) as opt:
            opt.state_files()[0].write_all(None, 0)
    limits = [float(v) for v in args.limits.split(",")]
    runs = [(name, fmt) for name, fmt in (("SparseAdam", None), ("DiskSparseAdam", "exact"),
                                          ("DiskSparseAdam", "compact"))]
    for limit in limits + [None]:
        for name, fmt in runs:
            variant = name if fmt is None else f"{name}/{fmt}"
            spec = dict(base, optimizer=name, state_format=fmt, state_dir=dirs.get(fmt))
            if fmt is not None:
                _drop_file_cache(dirs[fmt])
            limit_bytes = None if limit is None else limit * 2**30
            out, run = _run_limited(spec, limit_bytes, timeout=args.limit_seconds + 300)
            peak = run.peak_bytes
            if fmt is not None:  # the next run's weights are not those this one flushed: resume refuses them
                _reset_state(dirs[fmt], rows, dim, fmt)
            xv = "none" if limit is None else limit
            done = out is not None
            res.add(variant, "completed", "bool", float(done), x_name=x_name, x_value=xv)
            res.add(variant, "throughput", "samples/s", out["samples_per_s"] if done else 0.0, x_name=x_name, x_value=xv)
            res.add(variant, "peak_memory", "bytes", peak, x_name=x_name, x_value=xv)
            print(f"[limits] {variant} @ {xv} GiB: " + (f"{out['samples_per_s']:,.0f} samples/s over {out['steps']} steps"
                                                       if done else f"not completed ({run.outcome})")
                  + f", peak {peak / 2**30:.2f} GiB")
    table = dict(x_name="config", x_value=f"{rows}x{dim}")
    res.add("table", "rows", "rows", rows, **table)
    res.add("table", "dim", "values", dim, **table)
    res.add("table", "weights_bytes", "bytes", rows * dim * 4, **table)
    res.add("table", "exact_state_bytes", "bytes", rows * dsa_state_bytes_per_row(dim, "exact"), **table)
    res.add("table", "compact_state_bytes", "bytes", rows * dsa_state_bytes_per_row(dim, "compact"), **table)
    res.add("table", "compact_bytes_per_row", "bytes", dsa_state_bytes_per_row(dim, "compact"), **table)


def _drop_file_cache(state_dir):
    for f in os.listdir(state_dir):
        drop_cache(os.path.join(state_dir, f))


def _reset_state(state_dir, rows, dim, fmt):
    """A fresh state file for the next run: a run killed mid-step leaves its file dirty, and one that
    completed flushed it with weights the next run does not have (``resume=True`` refuses them)."""
    from optim import DiskSparseAdam

    for f in os.listdir(state_dir):
        os.unlink(os.path.join(state_dir, f))
    with DiskSparseAdam([torch.empty(rows, dim)], state_dir=state_dir, state_format=fmt) as opt:
        opt.state_files()[0].write_all(None, 0)


# -- quality of the compact format -----------------------------------------------------------------
def kg_triples(n, entities, relations, gen, teacher, candidates=32, chunk=50_000):
    """(h, r, t, negatives): Zipf-skewed heads, uniform relations, and as tail the best of
    ``candidates`` random entities under a planted DistMult ``teacher`` (entity and relation
    tables), so the task has structure a DistMult model can learn; 4 uniform negatives."""
    ent, rel = teacher
    h = (entities * torch.rand(n, generator=gen) ** 3).long().clamp_(max=entities - 1)
    r = torch.randint(0, relations, (n,), generator=gen)
    cand = torch.randint(0, entities, (n, candidates), generator=gen)
    t = torch.empty(n, dtype=torch.long)
    for s in range(0, n, chunk):
        q = (ent[h[s:s + chunk]] * rel[r[s:s + chunk]]).unsqueeze(1)
        best = (q * ent[cand[s:s + chunk]]).sum(-1).argmax(1)
        t[s:s + chunk] = cand[s:s + chunk].gather(1, best[:, None])[:, 0]
    return h, r, t, torch.randint(0, entities, (n, 4), generator=gen)


def _train_kg(fmt, data, cfg, seed, tmp):
    torch.manual_seed(seed)
    model = DistMult(cfg["entities"], cfg["relations"], cfg["dim"], init_std=0.1)
    opt = make_optimizer("DiskSparseAdam", model.parameters(), lr=cfg["lr"], state_format=fmt,
                         state_dir=os.path.join(tmp, f"kg-{fmt}-{seed}"))
    train, val = data
    gen = torch.Generator().manual_seed(seed + 1)
    n, b = train[0].shape[0], cfg["batch"]
    for _ in range(cfg["epochs"]):
        perm = torch.randperm(n, generator=gen)
        for s in range(0, n - b + 1, b):
            idx = perm[s:s + b]
            opt.zero_grad()
            model.loss(*(x[idx] for x in train)).backward()
            opt.step()
    with torch.no_grad():
        val_loss = float(model.loss(*val))
    m = opt.state_dict()["state"][0]["exp_avg"].clone() if fmt == "exact" else None
    opt.close()
    return val_loss, m


def code_errors(m):
    """Relative RMS reconstruction error of the rows of ``m`` (non-zero ones) under the linear int8
    code and under a 256-level codebook fitted to the histogram of m / max|m| (Gefen's exact DP)."""
    from optim.disk_sparse.reference import decode_rows, encode_rows
    from optim.gefen.codebook import optimal_codebook

    m = m[m.abs().amax(1) > 0]
    lin = decode_rows(*encode_rows(m))
    s = m.abs().amax(1, keepdim=True)
    u = (m / s).flatten()
    bins = 4096
    counts = torch.histc(u.double(), bins=bins, min=-1.0, max=1.0)
    centers = torch.linspace(-1 + 1 / bins, 1 - 1 / bins, bins, dtype=torch.float64)
    cb, _ = optimal_codebook(centers[counts > 0], counts[counts > 0], 256)
    cb = cb.to(u.dtype)
    mid = (cb[1:] + cb[:-1]) / 2
    book = cb[torch.bucketize(u, mid)].view_as(m) * s
    err = lambda a: float((a - m).norm() / m.norm())  # noqa: E731
    return err(lin), err(book)


def run_quality(args, res, tmp):
    # a few hundred triples per entity: with tens per entity DistMult memorises and never generalises
    cfg = dict(entities=2_000 if args.quick else 5_000, relations=100, dim=64, batch=1024, lr=1e-2,
               epochs=3 if args.quick else 8, train=50_000 if args.quick else 500_000, val=20_000)
    x = dict(x_name="config", x_value="kg")
    finals = {"exact": [], "compact": []}
    for seed in range(args.seed, args.seed + (1 if args.quick else 3)):
        gen = torch.Generator().manual_seed(1000 + seed)
        teacher = (torch.randn(cfg["entities"], 16, generator=gen), torch.randn(cfg["relations"], 16, generator=gen))
        train = kg_triples(cfg["train"], cfg["entities"], cfg["relations"], gen, teacher)
        val = kg_triples(cfg["val"], cfg["entities"], cfg["relations"], gen, teacher)
        for fmt in finals:
            loss, m = _train_kg(fmt, (train, val), cfg, seed, tmp)
            finals[fmt].append(loss)
            res.add(f"DiskSparseAdam/{fmt}", "final_val_loss", "nats", loss, seed=seed, **x)
            if m is not None:
                lin, book = code_errors(m)
                res.add("code/linear-int8", "m_rel_rms_error", "x", lin, seed=seed, **x)
                res.add("code/codebook-256", "m_rel_rms_error", "x", book, seed=seed, **x)
        print(f"[quality] seed {seed}: exact {finals['exact'][-1]:.4f}, compact {finals['compact'][-1]:.4f}; "
              f"m error linear {lin:.4f}, codebook {book:.4f}")
    ratio = statistics.mean(finals["compact"]) / statistics.mean(finals["exact"])
    res.add("ratio", "compact_over_exact_val_loss", "x", ratio, **x)
    print(f"[quality] mean final validation loss: exact {statistics.mean(finals['exact']):.4f}, "
          f"compact {statistics.mean(finals['compact']):.4f} (ratio {ratio:.4f})")


def main(argv=None):
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--child":
        return _child_main(json.loads(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--parts", default="cold,limits,quality", help="comma-separated: cold, limits, quality")
    parser.add_argument("--reps", type=int, default=None, help="cold repeats (default 5, --quick 2)")
    parser.add_argument("--cold-steps", type=int, default=None, help="steps per cold repeat (default 16, --quick 4)")
    parser.add_argument("--warm-steps", type=int, default=20, help="steps per warm repeat")
    parser.add_argument("--disk-reads", type=int, default=4000)
    parser.add_argument("--limits", default=None,
                        help="memory limits in GiB (default 1.75,2,2.5,3,4; --quick 1); no limit is always run")
    parser.add_argument("--limit-seconds", type=float, default=None, help="seconds per limited run (default 25, --quick 5)")
    parser.add_argument("--limit-steps", type=int, default=None,
                        help="at most this many steps per limited run (default 400, --quick 100)")
    parser.add_argument("--state-dir", default=None, help="where the state files go (default: a temp dir)")
    args = check.parse(parser, argv)
    args.reps = args.reps or (2 if args.quick else 5)
    args.cold_steps = args.cold_steps or (4 if args.quick else 16)
    args.limits = args.limits or ("1" if args.quick else "1.75,2,2.5,3,4")
    args.limit_steps = args.limit_steps or (100 if args.quick else 400)
    args.limit_seconds = args.limit_seconds or (5.0 if args.quick else 25.0)
    torch.set_num_threads(1)
    parts = args.parts.split(",")
    with Results("dsa_out_of_core", args, config=vars(args)) as res, \
            tempfile.TemporaryDirectory(prefix="dsa-ooc-", dir=args.state_dir) as tmp:
        for part, fn in (("cold", run_cold), ("limits", run_limits), ("quality", run_quality)):
            if part in parts:
                fn(args, res, tmp)


if __name__ == "__main__":
    main()
