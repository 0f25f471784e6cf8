"""The Disk Sparse Adam seed's own benchmark, end to end: 1,000,000 entities x 128 on the Poincaré ball.

    python experiments/dsa_seed_benchmark.py            # full run -> results/dsa_seed_benchmark.csv
    python experiments/dsa_seed_benchmark.py --quick    # 100,000 entities, 3 epochs -> results/quick/
    python analysis/dsa_seed_benchmark.py               # paper_figs/dsa_seed_benchmark.png

The seed trains ``nn.Embedding(1_000_000, 128, sparse=True)`` with ``DiskSparseRiemannianAdam``,
batch 2048, 20 epochs, and reports the loss at epochs 1 and 20 (0.000100, 0.000028), 134,212
samples/s on a Kaggle GPU and 0.00 MB of GPU memory over the weights. Its loss is not given; here
it is ``emb(idx).pow(2).sum(-1).mean()`` from weights drawn N(0, 1e-3²) (the seed's first loss is
1.28e-4 for that draw), lr 1e-3. An epoch is one random permutation of the entities in batches of
2048. Each optimizer trains in its own process, one after another (their peak RSS are their own):

- ``DiskSparseRiemannianAdam``: moments in files (a private state_dir), backend "auto";
- ``geoopt-SparseRiemannianAdam``: geoopt's sparse Riemannian Adam, moments in RAM (the reference);
- ``SparseAdam``: torch's Euclidean sparse Adam, moments in RAM (the baseline the seed replaces).

Rows per optimizer (variant) and epoch (``x_name="epoch"``): ``loss`` (mean over the epoch's
batches), ``throughput`` (samples/s, wall clock), ``peak_rss`` (MiB, the process's high-water mark
so far), ``bytes_on_disk`` (the state files) and ``accelerator_memory`` (MiB over the weights; 0 on
CPU, ``torch.cuda.max_memory_allocated`` on CUDA).
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from experiments.harness.child import child_env, module_cmd
from experiments.harness import check
from experiments.harness.common import REPO_ROOT, Results, add_common_args
from experiments.harness.peak import peak_rss_bytes

OPTIMIZERS = ("DiskSparseRiemannianAdam", "geoopt-SparseRiemannianAdam", "SparseAdam")
SEED_LOSS = {1: 0.000100, 20: 0.000028}  # the seed's reported losses by epoch
SEED_THROUGHPUT = 134_212  # samples/s, the seed's Kaggle GPU


# the --check size: the full run's flags it overrides (experiments/harness/check.py)
CHECK = {"--epochs": 5}
CHECK_NOTE = ("the seed's table (1M × 128, batch 2,048), 5 of its 20 epochs: the throughput of a warm state, a loss not yet at "
              "its 20-epoch value")


def train(name: str, rows: int, dim: int, batch: int, epochs: int, lr: float, seed: int, device: str):
    """Train one optimizer; yields (epoch, loss, samples/s, peak RSS MiB, bytes on disk, accelerator MiB)."""
    torch.manual_seed(seed)
    emb = torch.nn.Embedding(rows, dim, sparse=True, device=device)
    with torch.no_grad():
        emb.weight.normal_(0.0, 1e-3)
    state_dir = tempfile.mkdtemp(prefix="dsa-seed-")
    if name == "DiskSparseRiemannianAdam":
        from optim import DiskSparseRiemannianAdam

        opt = DiskSparseRiemannianAdam(emb.parameters(), lr=lr, state_dir=state_dir)
    elif name == "geoopt-SparseRiemannianAdam":
        import geoopt

        emb.weight = geoopt.ManifoldParameter(emb.weight.data, manifold=geoopt.PoincareBall(c=1.0))
        opt = geoopt.optim.SparseRiemannianAdam([emb.weight], lr=lr)
    else:
        opt = torch.optim.SparseAdam(emb.parameters(), lr=lr)
    weights = torch.cuda.memory_allocated() if device == "cuda" else 0
    gen = torch.Generator().manual_seed(seed + 1)
    try:
        for epoch in range(1, epochs + 1):
            order = torch.randperm(rows, generator=gen).to(device)
            total, n = 0.0, 0
            t = time.perf_counter()
            for start in range(0, rows, batch):
                opt.zero_grad()
                loss = emb(order[start:start + batch]).pow(2).sum(-1).mean()
                loss.backward()
                opt.step()
                total += float(loss)
                n += 1
            wall = time.perf_counter() - t
            disk = sum(os.stat(os.path.join(state_dir, f)).st_blocks * 512 for f in os.listdir(state_dir))
            peak = peak_rss_bytes() / 2**20
            acc = (torch.cuda.max_memory_allocated() - weights) / 2**20 if device == "cuda" else 0.0
            yield epoch, total / n, rows / wall, peak, disk, acc
    finally:
        if hasattr(opt, "close"):
            opt.close()
        shutil.rmtree(state_dir, ignore_errors=True)


def worker(args):
    """One optimizer's run in this process, one line per epoch on stdout."""
    torch.set_num_threads(args.threads)
    for row in train(args.worker, args.rows, args.dim, args.batch, args.epochs, args.lr, args.seed, args.device):
        print("epoch", *row, flush=True)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--rows", type=int, default=None, help="entities (default 1,000,000; --quick 100,000)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=None, help="default 20, --quick 3")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1, help="torch (and numba) threads of every run")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one optimizer's process
    args = check.parse(parser, argv)
    args.rows = args.rows or (100_000 if args.quick else 1_000_000)
    args.epochs = args.epochs or (3 if args.quick else 20)
    if args.worker:
        return worker(args)
    env = child_env()
    config = {**vars(args), "seed_loss": SEED_LOSS, "seed_throughput": SEED_THROUGHPUT}
    with Results("dsa_seed_benchmark", args, config=config, wandb_rows=False) as res:
        for name in args.optimizers.split(","):
            cmd = module_cmd("experiments.dsa_seed_benchmark", "--worker", name, "--rows", args.rows, "--dim", args.dim,
                             "--batch", args.batch, "--epochs", args.epochs, "--lr", args.lr, "--seed", args.seed,
                             "--threads", args.threads, "--device", args.device)
            steps_per_epoch = -(-args.rows // args.batch)
            run = res.tracking.train_run(model=f"emb{args.rows}x{args.dim}", optimizer=name, lr=args.lr, seed=args.seed,
                                         config=dict(steps_per_epoch=steps_per_epoch))
            with run, tempfile.TemporaryFile("w+") as err:
                # the worker's lines are read as it prints them, so each epoch reaches W&B live; W&B stays
                # in this process, out of the worker whose memory is measured
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=REPO_ROOT)
                lines = []
                for line in proc.stdout:
                    lines.append(line)
                    if line.startswith("epoch "):
                        epoch, loss, rate, peak, disk, acc = map(float, line.split()[1:])
                        run.log({"train/loss": loss, "train/samples_per_s": rate, "sys/peak_rss_mib": peak,
                                 "state/bytes_on_disk": disk, "sys/accelerator_mib": acc, "train/epoch": epoch},
                                step=int(epoch) * steps_per_epoch)
                if proc.wait() != 0:
                    err.seek(0)
                    raise RuntimeError(f"{name} failed:\n{err.read()[-3000:]}")
                epochs = [line.split()[1:] for line in lines if line.startswith("epoch ")]
                if epochs:
                    last = [float(v) for v in epochs[-1]]
                    run.summary({"final/loss": last[1], "final/epoch": last[0], "max/peak_rss_mib": last[3],
                                 "mean/samples_per_s": sum(float(e[2]) for e in epochs) / len(epochs),
                                 "final/bytes_on_disk": last[4]})
            for line in lines:
                if not line.startswith("epoch "):
                    continue
                epoch, loss, rate, peak, disk, acc = line.split()[1:]
                x = dict(x_name="epoch", x_value=int(epoch))
                res.add(name, "loss", "mean", float(loss), **x)
                res.add(name, "throughput", "samples/s", float(rate), **x)
                res.add(name, "peak_rss", "MiB", float(peak), **x)
                res.add(name, "bytes_on_disk", "bytes", float(disk), **x)
                res.add(name, "accelerator_memory", "MiB", float(acc), **x)
                print(f"[{name}] epoch {int(epoch):2d}: loss {float(loss):.6f}, {float(rate):,.0f} samples/s, "
                      f"peak RSS {float(peak):,.0f} MiB, {float(disk) / 2**20:,.0f} MiB on disk", flush=True)
            res.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
