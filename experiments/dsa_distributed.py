"""Disk Sparse Adam across processes: samples/s and bytes exchanged per step, measured and on paper.

    python experiments/dsa_distributed.py            # full run -> results/dsa_distributed.csv
    python experiments/dsa_distributed.py --quick    # small table, few steps -> results/quick/
    python analysis/dsa_distributed.py               # paper_figs/dsa_distributed.png

The Disk Sparse Adam seed's setup (``nn.Embedding(1_000_000, 128)``, fp32, batches of 2048 uniform
indices per rank, loss ``mean(x**2)``, lr 1e-3) on 1 and 2 gloo ranks on 127.0.0.1, each rank a
process with one torch thread and its own state directory (every record written once before
measuring, as in ``dsa_throughput.py``). Setups, timed in one launch, interleaved in runs of steps
(repeats in a shuffled order):

- ``single`` (1 rank only): plain ``nn.Embedding(sparse=True)`` and ``DiskSparseAdam``, no process group;
- ``sharded``: ``ShardedEmbedding``, rows split over the ranks, ``all_to_all`` lookups;
- ``ddp``: the whole table on every rank under ``DistributedDataParallel`` (its sparse gradients are
  all-gathered by gloo).

Samples/s count every rank's batch (weak scaling: W x 2048 samples a step) over the median step
time, the slowest rank's per step. Bytes exchanged are per rank and step: for ``sharded`` the payload
the module sent to other ranks (its count), for ``ddp`` the coalesced gradient every other rank must
receive, ``(W - 1) x rows x (8 + 4 dim)``. The machine has 2 cores, so 2 ranks compete for them with
each other (and with anything else running): the 2-rank numbers show the exchange's cost, not scaling.

On paper (variants ``paper/...``), the same seed setup at W = 2, 8, 64, 512 ranks: the expected bytes
a rank sends per step (expected unique rows of a batch, a share (W - 1) / W of them remote) and the
network bandwidth that moves them within the step time of the seed's claimed 134,212 samples/s on a
GPU (2048 samples per step: 15.3 ms), with no overlap of communication and computation.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import json
import math
import os
import sys
import tempfile
import time

import torch

from experiments.harness.child import child_env, emit_result, module_cmd, run_ranks
from experiments.harness import check
from experiments.harness.common import Results, add_common_args

CLAIMED_SAMPLES_PER_S = 134_212  # the seed's GPU claim (README), for the bandwidth on paper
PAPER_RANKS = (2, 8, 64, 512)


# ----------------------------------------------------------------------------------- on paper
# the --check size: the full run's flags it overrides (experiments/harness/check.py)
CHECK = {}
CHECK_NOTE = ("the full run's size (2 ranks measured, the rest on paper): the claim itself")


def expected_unique(rows: int, batch: int) -> float:
    """Expected distinct rows among ``batch`` uniform draws from ``rows``."""
    return -rows * math.expm1(batch * math.log1p(-1.0 / rows))


def sharded_bytes(world: int, rows: int, dim: int, batch: int, itemsize: int = 4) -> float:
    """Bytes a rank sends per step with row sharding: a header of four int64 (count, error flag, table,
    kind of call) to every other rank in the forward and again in the backward; per remote unique row
    its 8-byte id and its gradient row; per row of its own another rank asks for, that row (by
    symmetry as many as its remote rows)."""
    remote = float(expected_unique(rows, batch)) * (world - 1) / world
    return 2 * 4 * 8 * (world - 1) + remote * (8 + 2 * dim * itemsize)


def ddp_bytes(world: int, rows: int, dim: int, batch: int, itemsize: int = 4) -> float:
    """Bytes of a rank's coalesced sparse gradient (ids and rows) that each other rank must receive."""
    return (world - 1) * float(expected_unique(rows, batch)) * (8 + dim * itemsize)


def add_paper_rows(res, cfg):
    step_s = cfg["batch"] / CLAIMED_SAMPLES_PER_S
    for w in PAPER_RANKS:
        x = dict(x_name="ranks", x_value=w)
        for name, fn in (("sharded", sharded_bytes), ("ddp", ddp_bytes)):
            b = fn(w, cfg["rows"], cfg["dim"], cfg["batch"])
            res.add(f"paper/{name}", "bytes_per_step", "bytes", b, **x)
            res.add(f"paper/{name}", "bandwidth_needed", "Gbit/s", 8 * b / step_s / 1e9, **x)
    res.add("paper", "step_time", "s", step_s)


# ----------------------------------------------------------------------------------- the ranks
def _setups(cfg, rank, world, state_root, backend):
    """name -> (model, optimizer, table module for the byte count or None)."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from optim import DiskSparseAdam
    from optim.disk_sparse.sharded import ShardedEmbedding, open_optimizer

    out = {}
    if world == 1:
        emb = nn.Embedding(cfg["rows"], cfg["dim"], sparse=True)
        out["single"] = (emb, DiskSparseAdam(emb.parameters(), lr=1e-3, backend=backend,
                                             state_dir=os.path.join(state_root, "single")), None)
    sharded = ShardedEmbedding(cfg["rows"], cfg["dim"])
    out["sharded"] = (sharded, open_optimizer(sharded, os.path.join(state_root, "sharded"), lr=1e-3,
                                              backend=backend), sharded)
    ddp = DDP(nn.Embedding(cfg["rows"], cfg["dim"], sparse=True))
    out["ddp"] = (ddp, DiskSparseAdam(ddp.parameters(), lr=1e-3, backend=backend,
                                      state_dir=os.path.join(state_root, f"ddp-rank{rank}")), None)
    for _, opt, _ in out.values():
        for st in opt.state_files():  # steady state: every record written once (see dsa_throughput.py)
            st.write_all(None, st.step)
    return out


def worker(cfg, backend):
    """One rank: warm-up steps, then ``reps`` repeats of ``steps`` steps of every setup, in a shuffled
    order per repeat; per step and setup the wall and CPU seconds (wall: the slowest rank's) and the
    bytes sent."""
    import random

    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)
    batches = [torch.randint(0, cfg["rows"], (cfg["batch"],), generator=gen) for _ in range(16)]
    times = {}
    with tempfile.TemporaryDirectory(prefix="dsa-dist-", dir=cfg["state_dir"]) as root:
        setups = _setups(cfg, rank, world, root, backend)
        times = {name: {"wall": [], "cpu": [], "bytes": [], "rows": []} for name in setups}
        for k in range(cfg["warmup"]):
            for name in setups:
                _timed_step(setups[name], batches[k % len(batches)], times[name], keep=False)
        for rep in range(cfg["reps"]):
            order = list(setups)
            random.Random(rep).shuffle(order)  # the same order on every rank
            for name in order:  # a run of steps per setup: three tables at once would share the caches
                for k in range(cfg["steps"]):
                    _timed_step(setups[name], batches[(rep * cfg["steps"] + k) % len(batches)], times[name], True)
        for _, opt, _ in setups.values():
            opt.close()
        del setups  # the DDP reducer and the sharded module go while their process group lives
    for t in times.values():  # the slowest rank's wall time per step
        wall = torch.tensor(t["wall"], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        t["wall"] = wall.tolist()
    dist.barrier()  # no rank tears its connections down while another still uses them
    dist.destroy_process_group()
    emit_result(times)


def _timed_step(setup, batch, log, keep):
    model, opt, table = setup
    before = table.exchanged_bytes if table is not None else 0
    w0, c0 = time.perf_counter(), time.process_time()
    opt.zero_grad()
    (model(batch) ** 2).mean().backward()
    opt.step()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    if keep:
        log["wall"].append(wall)
        log["cpu"].append(cpu)
        log["rows"].append(int(torch.unique(batch).numel()))
        if table is not None:
            log["bytes"].append(table.exchanged_bytes - before)


def launch(world, cfg, backend, timeout):
    """Run ``world`` worker processes; every rank's measurements, in rank order."""
    runs = run_ranks(module_cmd("experiments.dsa_distributed", "--worker", json.dumps(cfg), backend), world,
                     env=child_env(OMP_NUM_THREADS=1, GLOO_SOCKET_IFNAME="lo"), timeout=timeout)
    return [run.check(f"rank {r} of a {world}-rank launch").result for r, run in enumerate(runs)]


# ----------------------------------------------------------------------------------- report
def report(res, world, ranks, cfg):
    """Rows of one launch: samples/s (wall, and per CPU second of all ranks), median step time and
    bytes sent per rank and step."""
    import statistics

    x = dict(x_name="ranks", x_value=world)
    for name in ranks[0]:
        wall = statistics.median(ranks[0][name]["wall"])  # already the slowest rank's, per step
        cpu = statistics.median(sum(c) for c in zip(*(r[name]["cpu"] for r in ranks)))
        samples = world * cfg["batch"]
        res.add(name, "throughput", "samples/s", samples / wall, **x)
        res.add(name, "throughput_per_cpu_second", "samples/s", samples / cpu, **x)
        res.add(name, "step_time_median", "s", wall, **x)
        if name == "sharded":
            sent = statistics.fmean(b for r in ranks for b in r[name]["bytes"])
        elif name == "ddp":
            sent = statistics.fmean((world - 1) * n * (8 + 4 * cfg["dim"]) for r in ranks for n in r[name]["rows"])
        else:
            sent = 0.0
        res.add(name, "bytes_per_step", "bytes", sent, **x)
        print(f"[{world} rank(s)] {name}: {samples / wall:,.0f} samples/s, {sent / 2**20:.2f} MiB sent per "
              "rank and step", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--rows", type=int, default=None, help="table rows (default 1M, --quick 20k)")
    parser.add_argument("--dim", type=int, default=None, help="row width (default 128, --quick 32)")
    parser.add_argument("--batch", type=int, default=None, help="indices per rank and step (default 2048, --quick 256)")
    parser.add_argument("--steps", type=int, default=None, help="steps per setup and repeat (default 12, --quick 3)")
    parser.add_argument("--reps", type=int, default=None, help="repeats (default 5, --quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured first steps (default 5, --quick 1)")
    parser.add_argument("--ranks", default="1,2", help="comma-separated numbers of ranks to launch")
    parser.add_argument("--backend", default="auto", help="DiskSparseAdam backend (auto: numba on CPU)")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per launch")
    parser.add_argument("--state-dir", default=None, help="where the state files go (default: a temp dir)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = check.parse(parser, argv)
    if args.worker:
        cfg, backend = args.worker
        return worker(json.loads(cfg), backend)
    q = args.quick
    cfg = dict(rows=args.rows or (20_000 if q else 1_000_000), dim=args.dim or (32 if q else 128),
               batch=args.batch or (256 if q else 2048), steps=args.steps or (3 if q else 12),
               reps=args.reps or (2 if q else 5),
               warmup=args.warmup or (1 if q else 5), seed=args.seed, state_dir=args.state_dir)
    seed_cfg = dict(rows=1_000_000, dim=128, batch=2048)
    with Results("dsa_distributed", args, config={**vars(args), "measured": cfg, "paper": seed_cfg}) as res:
        add_paper_rows(res, seed_cfg)
        for world in map(int, args.ranks.split(",")):
            report(res, world, launch(world, cfg, args.backend, args.timeout), cfg)


if __name__ == "__main__":
    sys.exit(main())
