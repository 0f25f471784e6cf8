"""Billions of parameters on one small machine: a table larger than RAM trained with Disk Sparse Adam.

    python experiments/dsa_billions.py            # 32M x 64 = 2.05e9 parameters, both state formats
    python experiments/dsa_billions.py --quick    # 1M x 64 -> results/quick/
    python analysis/dsa_billions.py               # its section of results/README.md

The weights live in a memory-mapped file (``optim.mapped_embedding``), the moments in state files
(``state_format`` "exact": 8 B a parameter; "compact": 8-bit m and one v per row, D + 8 B a row).
Batches of 8192 uniform row indices, loss ``emb(idx).pow(2).sum(-1).mean()``, one torch thread,
``opt.prefetch`` of the next batch. Per format: samples/s and unique rows/s over the first 10 steps
(cold: the table was just written, little of it is cached) and over the last half of the steps,
the process's peak RSS, bytes on disk, bytes written to the disk during the steps and the final
``flush()`` per step (the block device's sectors-written counter: writeback of a mapped file is not
the process's own I/O), that over the touched rows' own bytes (write amplification: the kernel
writes whole 4 KiB pages), and ``flush()`` MiB/s. Then the scaling curve: rows/s at 1e6, 1e7 and 1e8 rows of 16 values (compact state).
The run trains in a memory cgroup (``--memory-limit-gib``, page cache included, when it may create
one, as root), so the table and its state stay out of core. ``torch.optim.SparseAdam`` on the main
table needs its weights and both moments in RAM: the experiment runs it in a cgroup of the same
size (half the machine's memory when none is given) and reports how it ends, else the bytes it needs. The script checks the free disk space
first, refuses if it is short, and removes every file it made.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

from experiments.harness import check
from experiments.harness.common import Results, add_common_args
from experiments.harness.child import run_child
from experiments.harness.memcg import cgroups_usable, enter_memory_cgroup, leave_memory_cgroup
from experiments.harness.peak import peak_rss_bytes
from experiments.harness.registry import dsa_state_bytes_per_row

DIM, BATCH, SCALE_DIM = 64, 8192, 16


# the --check size: the full run's flags it overrides (experiments/harness/check.py)
CHECK = {"--rows": 4_000_000, "--scale-rows": "1e6", "--memory-limit-gib": 1.5}
CHECK_NOTE = ("4M rows × 64 (2.6e8 parameters) in a 1.5 GiB cgroup where the claim is about 2e9 in 4 GiB: it shows the "
              "mechanism (DSA trains where SparseAdam is killed), not the claim; the cgroup needs root")


def device_written(path) -> int:
    """Bytes written to the block device that holds ``path`` so far (its sectors-written counter:
    writes to a mapped file reach the disk through the kernel's writeback, which the process's own
    I/O counters do not see). 0 where the counter cannot be read."""
    dev = os.stat(path).st_dev
    try:
        with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat") as f:
            return int(f.read().split()[6]) * 512
    except (OSError, IndexError, ValueError):
        return 0


def row_bytes(dim, fmt) -> int:
    """Bytes a row takes on disk: float32 weights and its state record."""
    return dim * 4 + dsa_state_bytes_per_row(dim, fmt)


def needed_bytes(rows, dim, formats) -> int:
    return rows * max(row_bytes(dim, f) for f in formats)


def train(rows, dim, fmt, steps, seed, root):
    """One table and optimizer; returns a dict of measurements."""
    from optim import DiskSparseAdam, mapped_embedding
    from optim.disk_sparse.weights import close_mapped

    os.makedirs(root, exist_ok=True)
    t = time.perf_counter()
    emb = mapped_embedding(os.path.join(root, "weights.dsa"), rows, dim, init_std=0.01, seed=seed)
    create = time.perf_counter() - t
    opt = DiskSparseAdam(emb.parameters(), lr=1e-3, state_dir=os.path.join(root, "state"), state_format=fmt)
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, rows, (BATCH,), generator=gen) for _ in range(steps + 1)]
    walls, uniq = [], []
    w0 = device_written(root)
    for k in range(steps):
        t0 = time.perf_counter()
        opt.prefetch(batches[k + 1])
        opt.zero_grad()
        emb(batches[k]).pow(2).sum(-1).mean().backward()
        opt.step()
        walls.append(time.perf_counter() - t0)
        uniq.append(int(torch.unique(batches[k]).numel()))
    t, w1 = time.perf_counter(), device_written(root)
    opt.flush()
    flush_s, w2 = time.perf_counter() - t, device_written(root)
    disk = sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(root) for f in fs)
    opt.close()
    close_mapped(emb)
    half = steps // 2
    touched = sum(uniq) * row_bytes(dim, fmt)  # the rows' own bytes: weights and state records
    return {
        "params": rows * dim, "create_s": create,
        "cold_samples_per_s": BATCH * 10 / sum(walls[:10]),
        "steady_samples_per_s": BATCH * (steps - half) / sum(walls[half:]),
        "steady_rows_per_s": sum(uniq[half:]) / sum(walls[half:]),
        "write_bytes_per_step": (w2 - w0) / steps,
        "write_amplification": (w2 - w0) / touched,
        "flush_mib_per_s": (w2 - w1) / 2**20 / flush_s if flush_s > 0 else 0.0,
        "flush_mib": (w2 - w1) / 2**20, "written_during_steps_mib": (w1 - w0) / 2**20,
        "peak_rss_mib": peak_rss_bytes() / 2**20, "bytes_on_disk": disk,
    }


def sparse_adam_outcome(rows, dim, limit_bytes):
    """How torch.optim.SparseAdam ends on the main table in a memory cgroup of ``limit_bytes``."""
    need = rows * dim * 4 * 3
    if not cgroups_usable():
        return {"outcome": "not run (needs root for a memory cgroup)", "needed_bytes": need, "exit": 0}
    code = ("import torch; e = torch.nn.Embedding(%d, %d, sparse=True); o = torch.optim.SparseAdam(e.parameters());"
            "e(torch.randint(0, %d, (8192,))).pow(2).sum().backward(); o.step(); print('stepped')") % (rows, dim, rows)
    run = run_child([sys.executable, "-c", code], memory=("dsa-billions-sparse-adam", limit_bytes), timeout=600)
    if run.returncode == 0 and "stepped" in run.stdout:
        outcome = "stepped"
    elif run.oom_killed or run.returncode in (-9, 137):
        outcome = "killed for memory (SIGKILL from the cgroup's OOM killer)"
    else:
        err = run.stderr.strip()
        outcome = f"failed: {err.splitlines()[-1] if err else run.outcome}"
    return {"outcome": outcome, "needed_bytes": need, "exit": -1 if run.returncode is None else run.returncode}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--rows", type=int, default=None, help="main table rows (default 32M, --quick 1M)")
    parser.add_argument("--steps", type=int, default=None, help="steps per format (default 100, --quick 20)")
    parser.add_argument("--formats", default="exact,compact")
    parser.add_argument("--scale-rows", default=None, help="rows of the scaling curve (default 1e6,1e7,1e8; "
                                                           "--quick 1e5,1e6)")
    parser.add_argument("--dir", default=None, help="where the files go (default: a temporary directory)")
    parser.add_argument("--skip-sparse-adam", action="store_true")
    parser.add_argument("--memory-limit-gib", type=float, default=None,
                        help="run in a memory cgroup of this size, page cache included, SparseAdam too "
                             "(as root; default 4, --quick none)")
    args = check.parse(parser, argv)
    args.rows = args.rows or (1_000_000 if args.quick else 32_000_000)
    args.steps = args.steps or (20 if args.quick else 100)
    scale = [int(float(x)) for x in (args.scale_rows or ("1e5,1e6" if args.quick else "1e6,1e7,1e8")).split(",")]
    formats = args.formats.split(",")
    if args.memory_limit_gib is None and not args.quick:
        args.memory_limit_gib = 4.0
    if args.memory_limit_gib is not None and args.memory_limit_gib < 1.5:
        parser.error("--memory-limit-gib must be >= 1.5: the process itself (torch, numba) takes about 1 GiB")
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="dsa-billions-", dir=args.dir)
    need = max(needed_bytes(args.rows, DIM, formats), max(needed_bytes(r, SCALE_DIM, ["compact"]) for r in scale))
    free = shutil.disk_usage(root).free
    if free < 1.1 * need:
        shutil.rmtree(root, ignore_errors=True)
        raise SystemExit(f"dsa_billions: {root} has {free / 2**30:.1f} GiB free, the largest table needs "
                         f"{need / 2**30:.1f} GiB (+10%); give --dir on a larger disk or fewer --rows")
    config = {**vars(args), "dim": DIM, "batch": BATCH, "scale_dim": SCALE_DIM, "scale_rows": scale}
    limit = int(args.memory_limit_gib * 2**30) if args.memory_limit_gib else None
    cgroup = enter_memory_cgroup("dsa-billions", limit) if limit else None
    config["memory_cgroup"] = cgroup is not None
    try:
        with Results("dsa_billions", args, config=config) as res:
            x = dict(x_name="parameters", x_value=args.rows * DIM)
            for fmt in formats:
                m = train(args.rows, DIM, fmt, args.steps, args.seed, os.path.join(root, fmt))
                shutil.rmtree(os.path.join(root, fmt), ignore_errors=True)
                units = {"create_s": "s", "bytes_on_disk": "bytes", "write_bytes_per_step": "bytes",
                         "write_amplification": "x", "peak_rss_mib": "MiB", "flush_mib_per_s": "MiB/s",
                         "flush_mib": "MiB", "written_during_steps_mib": "MiB", "params": "count"}
                for key, val in m.items():
                    res.add(f"DiskSparseAdam/{fmt}", key, units.get(key, "per s"), val, **x)
                print(f"[dsa_billions] {fmt}: {m['params']:.3g} params, cold {m['cold_samples_per_s']:,.0f} -> steady "
                      f"{m['steady_samples_per_s']:,.0f} samples/s ({m['steady_rows_per_s']:,.0f} rows/s), peak RSS "
                      f"{m['peak_rss_mib']:,.0f} MiB, {m['bytes_on_disk'] / 2**30:.1f} GiB on disk, "
                      f"{m['write_amplification']:.2f}x written per row byte, flush {m['flush_mib_per_s']:,.0f} MiB/s",
                      flush=True)
                res.flush()
            for rows in scale:
                m = train(rows, SCALE_DIM, "compact", max(20, args.steps // 2), args.seed, os.path.join(root, "scale"))
                shutil.rmtree(os.path.join(root, "scale"), ignore_errors=True)
                res.add("DiskSparseAdam/compact/scaling", "steady_rows_per_s", "rows/s", m["steady_rows_per_s"],
                        x_name="rows", x_value=rows)
                res.add("DiskSparseAdam/compact/scaling", "cold_samples_per_s", "samples/s", m["cold_samples_per_s"],
                        x_name="rows", x_value=rows)
                print(f"[dsa_billions] scaling {rows:.0e} rows x {SCALE_DIM}: {m['steady_rows_per_s']:,.0f} rows/s",
                      flush=True)
                res.flush()
            if not args.skip_sparse_adam:
                leave_memory_cgroup(cgroup)
                cgroup = None
                limit = limit or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
                out = sparse_adam_outcome(args.rows, DIM, limit)
                res.add("SparseAdam", "needed_bytes", "bytes", out["needed_bytes"], **x)
                res.add("SparseAdam", "exit_status", "code", out["exit"], **x)
                res.add("SparseAdam", "memory_limit", "bytes", limit, **x)
                res.config["sparse_adam_outcome"] = out["outcome"]
                print(f"[dsa_billions] SparseAdam on the same table in {limit / 2**30:.1f} GiB: {out['outcome']}",
                      flush=True)
    finally:
        leave_memory_cgroup(cgroup)
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
