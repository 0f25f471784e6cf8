"""GPU check of Disk Sparse Adam: throughput, device memory, and Triton vs torch paths on CUDA.

    python experiments/bench_dsa_gpu.py            # writes results/dsa_gpu.csv
    python experiments/bench_dsa_gpu.py --quick    # 100k rows, fewer steps -> results/quick/
    # on a lent machine whose files come back through $OUT:
    python experiments/bench_dsa_gpu.py --results-dir "$OUT" --wandb disabled

A GPU is needed; without CUDA the script says so and exits with status 0. Not part of
experiments/reproduce.py.

The seed's configuration: an nn.Embedding(1,000,000 x 128, sparse=True) on the GPU, batches of 2048
uniform random rows, loss mean(x^2), lr 1e-3. Measured side by side in one run, interleaved,
medians over repeats:

  ceiling                      embedding forward + backward only, no optimizer
  SparseAdam                   torch.optim.SparseAdam: moments in device memory (2 x the table)
  DiskSparseAdam               moments in a memory-mapped file, Triton row kernel on the GPU, staged
                               through persistent pinned/device buffers with the next batch announced
                               by opt.prefetch (optim/disk_sparse/pipeline.py)
  DiskSparseAdam/direct        the same without the staging pipeline (per-step pinned copies)
  DiskSparseRiemannianAdam     the same on the Poincaré ball (c = 1), record D+1 per row

Reported: samples/s, peak device memory the optimizer step adds above the weights (MiB; the
optimizer is created after the baseline is read, so its state and staging buffers count), the
optimizer's persistent device staging buffers (opt.device_staging_bytes(), MiB) and how many steps
used announced rows (opt.staging_stats()), and agreement after a few steps on the GPU:
DiskSparseAdam's Triton path vs its torch path, vs SparseAdam and vs the unstaged direct
path, DiskSparseRiemannianAdam's Triton path vs its torch path (max |Δ| of weights and state
records; float32, and bfloat16 weights on a smaller table).
Targets: >= 1,000,000 samples/s on one H200 with optimizer device memory < 64 MiB;
the published DSA claims 134,212 samples/s on a Kaggle GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn

from experiments.common import Results, add_common_args
from experiments.registry import make_optimizer

MiB = 2**20


def make_table(rows, dim, dtype, device, seed, scale):
    """A fresh table, identical for equal (rows, dim, seed, scale): uniform in ±scale."""
    g = torch.Generator(device=device).manual_seed(seed)
    emb = nn.Embedding(rows, dim, sparse=True, device=device, dtype=dtype)
    with torch.no_grad():
        emb.weight.copy_(((torch.rand(rows, dim, generator=g, device=device) * 2 - 1) * scale).to(dtype))
    return emb


def batches(rows, batch, n, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randint(0, rows, (batch,), generator=g).to(device) for _ in range(n)]


def train_steps(emb, opt, idx_list):
    for i, idx in enumerate(idx_list):
        if opt is not None and hasattr(opt, "prefetch") and i + 1 < len(idx_list):
            opt.prefetch(idx_list[i + 1])  # announce the next batch: its rows are read during this step
        emb.weight.grad = None
        emb(idx).float().pow(2).mean().backward()
        if opt is not None:
            opt.step()


def optimizers(args, tmp):
    """variant -> constructor(params) (None: the no-optimizer ceiling); names as experiments/registry.py."""
    def dsa(name, **kw):
        return lambda p: make_optimizer(name, p, args.lr, state_dir=tempfile.mkdtemp(dir=tmp), **kw)

    return {"ceiling": None,
            "SparseAdam": lambda p: make_optimizer("SparseAdam", p, args.lr),
            "DiskSparseAdam": dsa("DiskSparseAdam"),
            "DiskSparseAdam/direct": dsa("DiskSparseAdam", staging=False),
            "DiskSparseRiemannianAdam": dsa("DiskSparseRiemannianAdam", c=1.0)}


def measure(args, res, dev, tmp):
    variants = optimizers(args, tmp)
    names = list(variants)
    embs, opts = {}, {}
    warm = batches(args.rows, args.batch, args.warmup, dev, args.seed + 1)
    # Memory: per variant, the peak the optimizer's steps add above what was allocated before it.
    for name in names:
        embs[name] = make_table(args.rows, args.dim, torch.float32, dev, args.seed,
                                1e-3 if "Riemannian" in name else 1.0)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        opts[name] = variants[name]([embs[name].weight]) if variants[name] else None
        train_steps(embs[name], opts[name], warm)
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated(dev) - base) / MiB
        res.add(name, "device_memory_over_weights", "MiB", extra, "rows", args.rows)
        print(f"{name:28s} peak device memory above the weights: {extra:9.1f} MiB")
        if hasattr(opts[name], "staging_stats"):
            st = opts[name].staging_stats()
            res.add(name, "device_staging_buffers", "MiB", st["device_bytes"] / MiB, "batch", args.batch)
            res.add(name, "pinned_staging_buffers", "MiB", st["pinned_bytes"] / MiB, "batch", args.batch)
            res.add(name, "prefetch_hit_rate", "fraction", st["hits"] / max(1, st["hits"] + st["misses"]),
                    "steps", args.warmup)
            print(f"{name:28s} staging buffers: device {st['device_bytes'] / MiB:.1f} MiB, pinned "
                  f"{st['pinned_bytes'] / MiB:.1f} MiB; announced rows used in {st['hits']} of "
                  f"{st['hits'] + st['misses']} steps ({st['patched_rows']} rows refreshed)")
    # Throughput: interleaved repeats, medians.
    times = {n: [] for n in names}
    for r in range(args.repeats):
        idx = batches(args.rows, args.batch, args.steps, dev, args.seed + 100 + r)
        for name in names:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            train_steps(embs[name], opts[name], idx)
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    sps = {n: args.batch * args.steps / statistics.median(t) for n, t in times.items()}
    for name in names:
        res.add(name, "throughput", "samples/s", sps[name], "batch", args.batch)
        res.add(name, "throughput_vs_SparseAdam", "ratio", sps[name] / sps["SparseAdam"], "batch", args.batch)
        print(f"{name:28s} {sps[name]:12,.0f} samples/s  ({sps[name] / sps['SparseAdam']:.2f}x SparseAdam)")
    for name in names:
        if hasattr(opts[name], "close"):
            opts[name].close()
    del embs, opts
    torch.cuda.empty_cache()


def final_state(opt):
    st = opt.state_dict()["state"][0]
    return torch.cat([st["exp_avg"].reshape(st["exp_avg"].shape[0], -1).float().cpu(),
                      st["exp_avg_sq"].reshape(st["exp_avg_sq"].shape[0], -1).float().cpu()], dim=1)


def agreement(args, res, dev, tmp):
    """A few steps through each path from identical tables and batches; max |Δ| of weights and states."""
    classes = {"DiskSparseAdam": ({}, 1.0), "DiskSparseRiemannianAdam": (dict(c=1.0), 0.5)}
    for dtype, rows in ((torch.float32, args.rows), (torch.bfloat16, min(args.rows, 100_000))):
        idx = batches(rows, args.batch, args.check_steps, dev, args.seed + 7)
        tname = str(dtype).replace("torch.", "")
        for name, (extra, scale) in classes.items():
            out = {}
            for backend in ("torch", "triton", "triton-direct"):
                emb = make_table(rows, args.dim, dtype, dev, args.seed, scale / args.dim**0.5)
                opt = make_optimizer(name, [emb.weight], args.lr * 10, backend=backend.split("-")[0],
                                     staging=not backend.endswith("direct"), state_dir=tempfile.mkdtemp(dir=tmp),
                                     **extra)
                train_steps(emb, opt, idx)
                out[backend] = (emb.weight.detach().float().cpu(), final_state(opt))
                opt.close()
            dw = float((out["triton"][0] - out["triton-direct"][0]).abs().max())
            ds = float((out["triton"][1] - out["triton-direct"][1]).abs().max())
            for what, val in (("weights", dw), ("state", ds)):
                res.add(f"{name}/{tname}", f"max_abs_diff_{what}_staged_vs_direct", "abs", val,
                        "steps", args.check_steps)
            print(f"{name}/{tname:8s} staged vs direct Triton (expected 0): max|Δw| {dw:.3e}  "
                  f"max|Δstate| {ds:.3e}")
            dw = float((out["triton"][0] - out["torch"][0]).abs().max())
            ds = float((out["triton"][1] - out["torch"][1]).abs().max())
            res.add(f"{name}/{tname}", "max_abs_diff_weights_triton_vs_torch", "abs", dw, "steps", args.check_steps)
            res.add(f"{name}/{tname}", "max_abs_diff_state_triton_vs_torch", "abs", ds, "steps", args.check_steps)
            print(f"{name}/{tname:8s} Triton vs torch after {args.check_steps} steps: max|Δw| {dw:.3e}  max|Δstate| {ds:.3e}")
            if name == "DiskSparseAdam" and dtype == torch.float32:
                emb = make_table(rows, args.dim, dtype, dev, args.seed, scale / args.dim**0.5)
                ref = make_optimizer("SparseAdam", [emb.weight], args.lr * 10)
                train_steps(emb, ref, idx)
                st = ref.state[emb.weight]
                ref_state = torch.cat([st["exp_avg"], st["exp_avg_sq"]], dim=1).cpu()
                dw = float((out["triton"][0] - emb.weight.detach().cpu()).abs().max())
                ds = float((out["triton"][1] - ref_state).abs().max())
                res.add(f"{name}/{tname}", "max_abs_diff_weights_triton_vs_SparseAdam", "abs", dw, "steps", args.check_steps)
                res.add(f"{name}/{tname}", "max_abs_diff_state_triton_vs_SparseAdam", "abs", ds, "steps", args.check_steps)
                print(f"{name}/{tname:8s} Triton vs torch.optim.SparseAdam: max|Δw| {dw:.3e}  max|Δstate| {ds:.3e}")
                del ref, st, ref_state
            del emb
            torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--rows", type=int, default=None, help="(Default: 1,000,000; 100,000 with --quick)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=None, help="steps per timed repeat (Default: 100; 30 quick)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--check-steps", type=int, default=10)
    args = parser.parse_args()
    args.rows = args.rows or (100_000 if args.quick else 1_000_000)
    args.steps = args.steps or (30 if args.quick else 100)
    if not torch.cuda.is_available():
        print("[bench_dsa_gpu] no CUDA device: this is the GPU check, nothing to measure here; exiting.")
        return 0
    dev = torch.device("cuda")
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="dsa-gpu-") as tmp, \
            Results("dsa_gpu", args, config=vars(args), device=dev) as res:
        print(f"[bench_dsa_gpu] {torch.cuda.get_device_name(dev)}, {args.rows:,} x {args.dim}, batch {args.batch}")
        measure(args, res, dev, tmp)
        agreement(args, res, dev, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
