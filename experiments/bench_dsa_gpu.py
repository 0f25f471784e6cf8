"""GPU check of Disk Sparse Adam: throughput, device memory, and Triton vs torch paths on CUDA.

    python experiments/bench_dsa_gpu.py            # writes results/dsa_gpu.csv
    python experiments/bench_dsa_gpu.py --quick    # 100k rows, fewer steps -> results/quick/
    # on a lent machine whose files come back through $OUT:
    python experiments/bench_dsa_gpu.py --results-dir "$OUT" --wandb disabled
    # every code path on CPU at tiny sizes, Triton under TRITON_INTERPRET=1 (checks the script):
    python experiments/bench_dsa_gpu.py --dry-run --results-dir /tmp/dry

A GPU is needed; without CUDA (and without ``--dry-run``) the script says so and exits with status
0. Not part of experiments/reproduce.py.

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

Reported: samples/s; per training iteration the host's time (the calls' wall time, no
synchronisation added), the device's busy time and the time the host waits for the device
(synchronisations and blocking copies, from a short torch.profiler window), and launches; peak device memory the optimizer step adds above the weights (MiB; the
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

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import statistics
import sys
import tempfile
import time

import torch

from experiments.harness import check
from experiments.harness.common import Results, add_common_args
from experiments.harness.gpu import batches, make_table, script_device, sync
from experiments.harness.registry import make_optimizer

MiB = 2**20
DRY_RUN = dict(rows=400, dim=8, batch=64, steps=2, repeats=2, warmup=2, check_steps=2, profile_steps=2)


# the --check size: the full run's flags it overrides (experiments/harness/check.py)
CHECK = {"--steps": 50, "--repeats": 3}
CHECK_NOTE = ("a GPU benchmark: the seed's table, 3 repeats of 50 steps; on a CPU it runs nothing (use --dry-run)")


def allocated(dev, peak=False):
    """Bytes of device memory allocated now (or at the peak since ``reset_peak``); 0 on the CPU."""
    if dev.type != "cuda":
        return 0
    return torch.cuda.max_memory_allocated(dev) if peak else torch.cuda.memory_allocated(dev)


def reset_peak(dev):
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def free(dev):
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def train_steps(emb, opt, idx_list):
    for i, idx in enumerate(idx_list):
        if opt is not None and hasattr(opt, "prefetch") and i + 1 < len(idx_list):
            opt.prefetch(idx_list[i + 1])  # announce the next batch: its rows are read during this step
        emb.weight.grad = None
        emb(idx).float().pow(2).mean().backward()
        if opt is not None:
            opt.step()


def optimizers(args, tmp):
    """variant -> constructor(params) (None: the no-optimizer ceiling); names as experiments/harness/registry.py."""
    def dsa(name, **kw):  # Triton and staging: what "auto" and None choose for CUDA weights
        return lambda p: make_optimizer(name, p, args.lr, state_dir=tempfile.mkdtemp(dir=tmp),
                                        backend="triton", **kw)

    return {"ceiling": None,
            "SparseAdam": lambda p: make_optimizer("SparseAdam", p, args.lr),
            "DiskSparseAdam": dsa("DiskSparseAdam", staging=True),
            "DiskSparseAdam/direct": dsa("DiskSparseAdam", staging=False),
            "DiskSparseRiemannianAdam": dsa("DiskSparseRiemannianAdam", c=1.0, staging=True)}


def memory(args, res, dev, tmp):
    """Per variant, the peak device memory its optimizer's warm-up steps add above what was allocated
    before it was built; returns the tables and optimizers, warmed up."""
    variants = optimizers(args, tmp)
    embs, opts = {}, {}
    warm = batches(args.rows, args.batch, args.warmup, dev, args.seed + 1)
    for name, make in variants.items():
        embs[name] = make_table(args.rows, args.dim, torch.float32, dev, args.seed,
                                1e-3 if "Riemannian" in name else 1.0)
        sync(dev)
        base = allocated(dev)
        reset_peak(dev)
        opts[name] = make([embs[name].weight]) if make else None
        train_steps(embs[name], opts[name], warm)
        sync(dev)
        extra = (allocated(dev, peak=True) - base) / MiB
        res.add(name, "device_memory_over_weights", "MiB", extra, "rows", args.rows)
        print(f"{name:28s} peak device memory above the weights: {extra:9.1f} MiB")
        if hasattr(opts[name], "staging_stats"):
            staging_rows(args, res, name, opts[name].staging_stats())
    return embs, opts


def staging_rows(args, res, name, st):
    res.add(name, "device_staging_buffers", "MiB", st["device_bytes"] / MiB, "batch", args.batch)
    res.add(name, "pinned_staging_buffers", "MiB", st["pinned_bytes"] / MiB, "batch", args.batch)
    res.add(name, "prefetch_hit_rate", "fraction", st["hits"] / max(1, st["hits"] + st["misses"]),
            "steps", args.warmup)
    print(f"{name:28s} staging buffers: device {st['device_bytes'] / MiB:.1f} MiB, pinned "
          f"{st['pinned_bytes'] / MiB:.1f} MiB; announced rows used in {st['hits']} of "
          f"{st['hits'] + st['misses']} steps ({st['patched_rows']} rows refreshed)")


def throughput(args, res, dev, embs, opts):
    """Samples/s per variant: interleaved repeats, medians."""
    times = {n: [] for n in embs}
    for r in range(args.repeats):
        idx = batches(args.rows, args.batch, args.steps, dev, args.seed + 100 + r)
        for name in embs:
            sync(dev)
            t0 = time.perf_counter()
            train_steps(embs[name], opts[name], idx)
            sync(dev)
            times[name].append(time.perf_counter() - t0)
    sps = {n: args.batch * args.steps / statistics.median(t) for n, t in times.items()}
    for name in embs:
        res.add(name, "throughput", "samples/s", sps[name], "batch", args.batch)
        res.add(name, "throughput_vs_SparseAdam", "ratio", sps[name] / sps["SparseAdam"], "batch", args.batch)
        print(f"{name:28s} {sps[name]:12,.0f} samples/s  ({sps[name] / sps['SparseAdam']:.2f}x SparseAdam)")


def where_time_goes(args, res, dev, embs, opts):
    """Per variant and training iteration: the host's time (the calls' wall time, no synchronisation
    added; median), the device's busy time, the host's waits and the launches (a short profiled
    window, experiments/harness/profiling.py)."""
    from experiments.harness.profiling import profile_steps

    idx = batches(args.rows, args.batch, args.steps + args.profile_steps + 1, dev, args.seed + 50)
    for name in embs:
        emb, opt = embs[name], opts[name]
        pos = iter(range(len(idx) - 1))

        def iteration():
            i = next(pos)
            if hasattr(opt, "prefetch"):
                opt.prefetch(idx[i + 1])
            emb.weight.grad = None
            emb(idx[i]).float().pow(2).mean().backward()
            if opt is not None:
                opt.step()

        sync(dev)
        host = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            iteration()
            host.append(time.perf_counter() - t0)
        sync(dev)
        prof = profile_steps(iteration, args.profile_steps, dev, warmup=0)
        host_ms = 1e3 * statistics.median(host)
        for metric, unit, v in (("host_time_per_step", "ms", host_ms),
                                ("device_time_per_step", "ms", prof.device_busy_ms),
                                ("host_wait_per_step", "ms", prof.wait_ms),
                                ("waits_per_step", "count", prof.wait_calls),
                                ("launches_per_step", "count", prof.launches)):
            res.add(name, metric, unit, v, "batch", args.batch)
        print(f"{name:28s} per step: host {host_ms:7.3f} ms, device busy {prof.device_busy_ms:7.3f} ms, "
              f"host waiting {prof.wait_ms:7.3f} ms in {prof.wait_calls:g} call(s), {prof.launches:g} launches")


def measure(args, res, dev, tmp):
    embs, opts = memory(args, res, dev, tmp)
    throughput(args, res, dev, embs, opts)
    where_time_goes(args, res, dev, embs, opts)
    for opt in opts.values():
        if hasattr(opt, "close"):
            opt.close()
    del embs, opts
    free(dev)


def final_state(opt):
    st = opt.state_dict()["state"][0]
    return torch.cat([st["exp_avg"].reshape(st["exp_avg"].shape[0], -1).float().cpu(),
                      st["exp_avg_sq"].reshape(st["exp_avg_sq"].shape[0], -1).float().cpu()], dim=1)


def max_diffs(a, b):
    """max |Δ| of weights and of state records between two (weights, state) pairs."""
    return float((a[0] - b[0]).abs().max()), float((a[1] - b[1]).abs().max())


def run_paths(args, dev, tmp, name, extra, dtype, rows, scale, idx):
    """{path: (weights, state)} after the same steps through the torch path, the staged Triton path
    and the direct Triton path, from identical tables."""
    out = {}
    for path in ("torch", "triton", "triton-direct"):
        emb = make_table(rows, args.dim, dtype, dev, args.seed, scale / args.dim**0.5)
        opt = make_optimizer(name, [emb.weight], args.lr * 10, backend=path.split("-")[0],
                             staging=not path.endswith("direct"), state_dir=tempfile.mkdtemp(dir=tmp), **extra)
        train_steps(emb, opt, idx)
        out[path] = (emb.weight.detach().float().cpu(), final_state(opt))
        opt.close()
    return out


def versus_sparse_adam(args, dev, rows, dtype, idx, triton_out):
    """max |Δ| of the Triton path's weights and state against torch.optim.SparseAdam's."""
    emb = make_table(rows, args.dim, dtype, dev, args.seed, 1.0 / args.dim**0.5)
    ref = make_optimizer("SparseAdam", [emb.weight], args.lr * 10)
    train_steps(emb, ref, idx)
    st = ref.state[emb.weight]
    ref_state = torch.cat([st["exp_avg"], st["exp_avg_sq"]], dim=1).cpu()
    return max_diffs(triton_out, (emb.weight.detach().float().cpu(), ref_state))


def agreement(args, res, dev, tmp):
    """A few steps through each path from identical tables and batches; max |Δ| of weights and states."""
    classes = {"DiskSparseAdam": ({}, 1.0), "DiskSparseRiemannianAdam": (dict(c=1.0), 0.5)}
    for dtype, rows in ((torch.float32, args.rows), (torch.bfloat16, min(args.rows, 100_000))):
        idx = batches(rows, args.batch, args.check_steps, dev, args.seed + 7)
        tname = str(dtype).replace("torch.", "")
        for name, (extra, scale) in classes.items():
            out = run_paths(args, dev, tmp, name, extra, dtype, rows, scale, idx)
            pairs = [("staged_vs_direct", "triton-direct", "staged vs direct Triton (expected 0)"),
                     ("triton_vs_torch", "torch", f"Triton vs torch after {args.check_steps} steps")]
            for key, other, label in pairs:
                dw, ds = max_diffs(out["triton"], out[other])
                res.add(f"{name}/{tname}", f"max_abs_diff_weights_{key}", "abs", dw, "steps", args.check_steps)
                res.add(f"{name}/{tname}", f"max_abs_diff_state_{key}", "abs", ds, "steps", args.check_steps)
                print(f"{name}/{tname:8s} {label}: max|Δw| {dw:.3e}  max|Δstate| {ds:.3e}")
            if name == "DiskSparseAdam" and dtype == torch.float32:
                dw, ds = versus_sparse_adam(args, dev, rows, dtype, idx, out["triton"])
                res.add(f"{name}/{tname}", "max_abs_diff_weights_triton_vs_SparseAdam", "abs", dw, "steps", args.check_steps)
                res.add(f"{name}/{tname}", "max_abs_diff_state_triton_vs_SparseAdam", "abs", ds, "steps", args.check_steps)
                print(f"{name}/{tname:8s} Triton vs torch.optim.SparseAdam: max|Δw| {dw:.3e}  max|Δstate| {ds:.3e}")
            free(dev)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--rows", type=int, default=None, help="(Default: 1,000,000; 100,000 with --quick)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=None, help="steps per timed repeat (Default: 100; 30 quick)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--check-steps", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=10,
                        help="profiled iterations per variant for the device time and the host's waits")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes on the CPU, Triton under TRITON_INTERPRET=1: runs every code path of "
                             "the script and writes its CSV (no measurement)")
    args = check.parse(parser, argv)
    if args.dry_run:
        vars(args).update(DRY_RUN)
    args.rows = args.rows or (100_000 if args.quick else 1_000_000)
    args.steps = args.steps or (30 if args.quick else 100)
    return args


def main(argv=None):
    args = parse_args(argv)
    dev = script_device(args.dry_run, "bench_dsa_gpu")
    if dev is None:
        return 0
    if args.dry_run:
        from optim.disk_sparse import _triton_kernels

        if hasattr(_triton_kernels._adam_rows_kernel, "params"):  # a JITFunction: compiled, not interpreted
            raise SystemExit("--dry-run: the Triton kernels were imported before TRITON_INTERPRET=1 was set")
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="dsa-gpu-") as tmp, \
            Results("dsa_gpu", args, config=vars(args), device=dev) as res:
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU dry run"
        print(f"[bench_dsa_gpu] {name}, {args.rows:,} x {args.dim}, batch {args.batch}")
        measure(args, res, dev, tmp)
        agreement(args, res, dev, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
