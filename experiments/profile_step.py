"""Profiles of one training step on a GPU: where Disk Sparse Adam's and Gefen's time goes.

    python experiments/profile_step.py --results-dir results/gpu             # both, on CUDA
    python experiments/profile_step.py --results-dir results/gpu --parts dsa
    python experiments/profile_step.py --dry-run --results-dir /tmp/dry      # tiny, on the CPU

Writes short text reports (experiments/harness/profiling.py's format) into the results folder:

* ``dsa_profile.txt``: one training iteration (embedding forward, backward, optimizer step, the next
  batch announced through ``prefetch``) at the seed's configuration (nn.Embedding(1,000,000 x 128,
  sparse=True), batches of 2048 uniform rows, loss mean(x^2)) for torch.optim.SparseAdam with its
  moments in device memory, DiskSparseAdam (staged and direct) and DiskSparseRiemannianAdam;
* ``gefen_profile.txt``: one ``optimizer.step()`` on fixed gradients of GPT-2 small's parameter
  shapes (124 M elements) in fp32 and bf16, for Gefen 8-bit and 8-bit factored (Triton) and fused
  AdamW, with each kernel family's achieved bandwidth: the bytes of every operand it reads or
  writes, once, over its device time, and that as a fraction of the device-to-device copy's.

Each report gives, per step: host time, device busy time, the host's waits (synchronisations and
blocking copies), launches, copies by direction, and the top host and device operations. Without
CUDA (and without ``--dry-run``) it says so and exits 0. Not part of experiments/reproduce.py: it is
one of experiments/gpu_checks.sh's steps.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from experiments.harness.gpu import script_device
from experiments.harness.profiling import format_profile, profile_steps

DSA_VARIANTS = ("SparseAdam", "DiskSparseAdam", "DiskSparseAdam/direct", "DiskSparseRiemannianAdam")
GEFEN_VARIANTS = ("AdamW", "Gefen-8bit", "Gefen-8bit-factored")


def _header(args, device) -> str:
    from experiments.harness.common import device_name, git_commit

    import triton  # noqa: F401  (its version belongs in the header where it is installed)

    return (f"# commit {git_commit()}, {device_name(device)}, torch {torch.__version__}, "
            f"triton {sys.modules['triton'].__version__}, {args.steps} profiled steps after "
            f"{args.warmup} warm-up step(s)\n\n")


def dsa_profiles(args, device, tmp) -> str:
    from experiments.harness.gpu import batches, make_table
    from experiments.harness.registry import make_optimizer

    out = [f"# Disk Sparse Adam: one training iteration, {args.rows:,} x {args.dim}, batch {args.batch}\n"]
    n = args.warmup + args.steps + 1
    for name in DSA_VARIANTS:
        riemannian = "Riemannian" in name
        emb = make_table(args.rows, args.dim, torch.float32, device, args.seed, 1e-3 if riemannian else 1.0)
        if name == "SparseAdam":
            opt = make_optimizer("SparseAdam", [emb.weight], 1e-3)
        else:
            extra = {"c": 1.0} if riemannian else {}
            opt = make_optimizer(name.split("/")[0], [emb.weight], 1e-3, backend="triton",
                                 staging=not name.endswith("direct"), state_dir=tempfile.mkdtemp(dir=tmp), **extra)
        idx = batches(args.rows, args.batch, n, device, args.seed + 1)
        pos = {"i": 0}

        def iteration():
            i = pos["i"]
            pos["i"] += 1
            if hasattr(opt, "prefetch"):
                opt.prefetch(idx[i + 1])
            emb.weight.grad = None
            emb(idx[i]).float().pow(2).mean().backward()
            opt.step()

        prof = profile_steps(iteration, args.steps, device, warmup=args.warmup)
        out.append(format_profile(name, prof, top=args.top))
        if hasattr(opt, "close"):
            opt.close()
        del emb, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return "\n".join(out)


def gefen_kernel_bytes(opt, params, grads) -> dict[str, float]:
    """{kernel-name substring: bytes all of that kernel's calls in one step read or write, each once}."""
    from experiments.harness.gpu import tensor_bytes
    from optim.gefen import state as K

    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    step = 2 * tensor_bytes(params) + tensor_bytes(grads) + 2 * tensor_bytes(state)
    if not hasattr(opt, "codebook"):  # fused AdamW: torch's multi-tensor kernel
        return {"multi_tensor_apply_kernel": step}
    factored = [p.grad for p in params if K.W in opt.state.get(p, {})]
    out = {"_gefen_step": step}
    if factored:
        out["_factor_stats_kernel"] = tensor_bytes(factored)
    return out


def gefen_profiles(args, device) -> str:
    from experiments.harness.gpu import Timer, copy_bandwidth, quick_shapes
    from experiments.harness.models import GPT2_SIZES, gpt2_shapes, make_param_set
    from experiments.harness.registry import make_optimizer

    shapes = quick_shapes(2**12) if args.dry_run else gpt2_shapes(*GPT2_SIZES["125M"])
    n = sum(torch.Size(s).numel() for s in shapes)
    copy_bw = copy_bandwidth(device, Timer(device), 2**20 if args.dry_run else 2**31, 10)
    out = [f"# Gefen: one optimizer.step(), GPT-2 small's shapes ({n:,} elements); device-to-device "
           f"copy {copy_bw / 1e9:.0f} GB/s (read + write)\n"]
    for dname, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for name in args.gefen_variants:
            ps, gs = make_param_set(shapes, dtype, device, args.seed)
            params = [torch.nn.Parameter(p) for p in ps]
            for p, g in zip(params, gs):
                p.grad = g
            options = {"backend": "triton"} if name.startswith("Gefen") else {}
            opt = make_optimizer(name, params, 1e-3, 0.01, **options)
            prof = profile_steps(opt.step, args.steps, device, warmup=args.warmup)
            out.append(format_profile(f"{name} {dname}", prof, kernel_bytes=gefen_kernel_bytes(opt, params, gs),
                                      top=args.top, copy_bandwidth=copy_bw))
            del opt, params, ps, gs
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", type=Path, default=Path("results/gpu"))
    parser.add_argument("--parts", nargs="+", choices=["dsa", "gefen"], default=["dsa", "gefen"])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5, help="profiled steps (Default: 5)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--top", type=int, default=10, help="operations listed per table")
    parser.add_argument("--gefen-variants", nargs="+", default=list(GEFEN_VARIANTS), choices=GEFEN_VARIANTS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes on the CPU, Triton under TRITON_INTERPRET=1 (checks the script)")
    args = parser.parse_args(argv)
    device = script_device(args.dry_run, "profile_step")
    if device is None:
        return 0
    if args.dry_run:
        args.rows, args.dim, args.batch, args.steps, args.warmup = 400, 8, 64, 2, 1
    args.results_dir.mkdir(parents=True, exist_ok=True)
    header = _header(args, device)
    with tempfile.TemporaryDirectory(prefix="dsa-profile-") as tmp:
        for part in args.parts:
            text = header + (dsa_profiles(args, device, tmp) if part == "dsa" else gefen_profiles(args, device))
            path = args.results_dir / f"{part}_profile.txt"
            path.write_text(text)
            print(text, flush=True)
            print(f"[profile_step] wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
