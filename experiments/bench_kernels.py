"""Gefen's fused Triton step against fused AdamW, upstream gefen's CUDA kernels and the 8-bit peers, on one GPU.

    python experiments/bench_kernels.py                  # 125M and 1.5B, fp32 and bf16 -> results/gefen_kernels.csv
    python experiments/bench_kernels.py --quick          # 10M elements, fp32 only -> results/quick/
    python experiments/bench_kernels.py --skip-upstream  # without upstream gefen
    python experiments/bench_kernels.py --dry-run        # tiny CPU tensors under TRITON_INTERPRET=1

Without CUDA (and without ``--dry-run``) it prints a message and exits 0; it is not part of
experiments/reproduce.py. Upstream ``gefen`` may be missing on a lent GPU machine: carry it, e.g.::

    mkdir -p .carry && cp -r "$(python -c 'import gefen, os; print(os.path.dirname(gefen.__file__))')" .carry/
    echo /.carry/ >> .git/info/exclude
    # device run, carry [".carry"]:  PYTHONPATH=.carry python experiments/bench_kernels.py --wandb disabled

Parameter sets shaped like GPT-2 small (124 M elements) and GPT-2 XL (1.56 B), fp32 and bf16,
gradients with a different scale per matrix row (the structure Gefen's block rule finds; P = row
length capped at 1024, P = 1 for vectors). For each optimizer, in one run, interleaved:

* ``step_time`` (ms): median over ``--reps`` of CUDA-event timings of ``optimizer.step()``;
* ``floor_bytes`` (B/param): the bytes a step must move at least: every parameter and state tensor
  read and written once, every gradient read once; ``floor_time`` (ms): those bytes at the measured
  device-to-device copy bandwidth; ``bandwidth`` (GB/s) and ``frac_of_copy``: floor bytes / step
  time, and its ratio to the copy's bandwidth (target >= 0.7);
* ``state_bytes`` (B/param) and ``step_peak_memory`` (MiB allocated by a step beyond what was
  allocated before it);
* ``speedup_vs_*``: the other optimizer's time / Gefen's (target > 1 against both);
* ``agree_*``: Gefen(backend="triton") against Gefen(backend="torch") on the device over 5 steps
  (max |Δp|, relative RMS, fraction of equal codes).

Variants (experiments/harness/registry.py's names): ``Gefen-8bit`` and ``Gefen-4bit`` (``backend="triton"``),
``Gefen-8bit/kernel`` (``triton_ops.gefen_step_`` on the same state without the optimizer's Python
work: the kernels' own time; ``/kernel-t{TILE}w{WARPS}`` at other tile sizes and warp counts),
``AdamW`` (fused), ``gefen-upstream`` (its CUDA extension, built with nvcc on first use) and the
8-bit peers of ``registry.GPU_PEERS``: FlashOptim's ``FlashAdamW`` (8-bit moments, fused Triton),
bitsandbytes' ``AdamW8bit``, torchao's ``AdamW8bit`` and gefen-x's fused step (its CUDA extension,
built on first use). A peer that cannot be built or run is skipped and its reason recorded under
``unavailable`` in the run's config. Rows are written after each (size, dtype) set, so a run
stopped by a time limit keeps what it measured.
"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import statistics
import sys
import time

from experiments.harness import check
from experiments.harness.common import Results, add_common_args
from experiments.harness.gpu import Timer, copy_bandwidth, quick_shapes, script_device, tensor_bytes
from experiments.harness.models import GPT2_SIZES, gpt2_shapes, make_param_set as make_set
from experiments.harness.registry import GPU_PEERS, make_optimizer

SIZES = GPT2_SIZES
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


# the --check size: the full run's flags it overrides (experiments/harness/check.py)
CHECK = {"--sizes": "125M", "--reps": 10}
CHECK_NOTE = ("a GPU benchmark: the 124M model only, 10 repeats; on a CPU it runs nothing (use --dry-run)")


def state_tensors(opt):
    import torch

    out = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    cb = getattr(opt, "codebook", None)
    return out + ([cb] if torch.is_tensor(cb) else [])


def build(name, params):
    options = {"backend": "triton"} if name.startswith("Gefen") else {}
    return make_optimizer(name, params, LR, WD, betas=BETAS, eps=EPS, **options)


def kernel_only_step(opt, tile=None, num_warps=None):
    """A closure running triton_ops.gefen_step_ over opt's state, grouped as the optimizer groups it."""
    from collections import defaultdict

    from optim.gefen import state as K
    from optim.gefen import triton_ops
    from optim.gefen.plan import Hyper, Tile

    groups = defaultdict(list)
    for p, st in opt.state.items():
        groups[st[K.BLOCK]].append((p, st))
    tiles_of = {block: [Tile(p, st[K.V], st[K.SCALES], st[K.CODES]) for p, st in items]
                for block, items in groups.items()}
    counter = {"t": max(st[K.STEP] for st in opt.state.values())}
    knobs = {} if tile is None else {"tile": tile, "num_warps": num_warps}

    def step():
        counter["t"] += 1
        for block, tiles in tiles_of.items():
            triton_ops.gefen_step_(tiles, [t.p.grad for t in tiles], opt.codebook,
                                   Hyper(counter["t"], LR, BETAS[0], BETAS[1], EPS, WD), block=block, bits=opt.bits,
                                   **knobs)
    return step


def agreement(shapes, dtype, device, seed, steps=5):
    """Gefen(backend='triton') vs Gefen(backend='torch') on the device: max|Δp|, rel RMS, codes."""

    from optim import Gefen
    from optim.gefen import state as K

    ps, gs = make_set(shapes, dtype, device, seed)
    qs = [p.clone() for p in ps]
    a = Gefen(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, layout="published", backend="triton")
    b = Gefen(qs, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, layout="published", backend="torch")
    for t in range(steps):
        for p, q, g in zip(ps, qs, gs):
            p.grad = g * (1 + 0.1 * t)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    num = den = 0.0
    maxd, eq, tot = 0.0, 0, 0
    for p, q in zip(ps, qs):
        d = (p.float() - q.float())
        maxd = max(maxd, d.abs().max().item())
        num += d.square().sum().item()
        den += q.float().square().sum().item()
        eq += (a.state[p][K.CODES] == b.state[q][K.CODES]).sum().item()
        tot += a.state[p][K.CODES].numel()
    return maxd, (num / max(den, 1e-300)) ** 0.5, eq / tot


def build_variants(label, dname, shapes, dtype, device, args, grads, unavailable):
    """{variant: (optimizer, step function)}: each optimizer built on a fresh parameter set holding
    ``grads`` and warmed up; Gefen-8bit also as its kernels alone at each ``--kernel-tiles``."""
    import torch

    names = args.variants.split(",")
    if args.skip_upstream and "gefen-upstream" in names:
        names.remove("gefen-upstream")
    out = {}
    for name in names:
        params = [torch.nn.Parameter(p) for p in make_set(shapes, dtype, device, args.seed)[0]]
        for p, g in zip(params, grads):
            p.grad = g
        try:
            t0 = time.perf_counter()
            opt = build(name, params)
            for _ in range(args.warmup):
                opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            print(f"  {label}/{dname} {name}: built and warmed up in {time.perf_counter() - t0:.1f} s",
                  flush=True)
        except Exception as exc:  # a peer missing, or needing nvcc and its own build; never lose the others
            reason = f"{type(exc).__name__}: {str(exc)[:300]}"
            unavailable[f"{name}/{dname}"] = reason
            print(f"  {label}/{dname} {name}: unavailable ({reason})", flush=True)
            params = opt = None  # free what a failed build allocated before the next variant
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        out[name] = (opt, opt.step)
        if name == "Gefen-8bit":
            out["Gefen-8bit/kernel"] = (opt, kernel_only_step(opt))
            for tw in filter(None, args.kernel_tiles.split(",")):
                tile, warps = (int(x) for x in tw.split("x"))
                out[f"Gefen-8bit/kernel-t{tile}w{warps}"] = (opt, kernel_only_step(opt, tile, warps))
    return out


def floor_rows(res, dname, variants, grads, n, copy_bw):
    """State bytes and floor bytes (every parameter and state tensor read and written once, every
    gradient read once) per parameter, and the floor's time at copy speed; returns {variant: bytes}."""
    floor = {}
    for name, (opt, _) in variants.items():
        params = [p for g in opt.param_groups for p in g["params"]]
        st = state_tensors(opt)
        floor[name] = 2 * tensor_bytes(params) + tensor_bytes(grads) + 2 * tensor_bytes(st)
        res.add(f"{name}/{dname}", "state_bytes", "B/param", tensor_bytes(st) / n, "params", n)
        res.add(f"{name}/{dname}", "floor_bytes", "B/param", floor[name] / n, "params", n)
        res.add(f"{name}/{dname}", "floor_time", "ms", floor[name] / copy_bw * 1e3, "params", n)
    return floor


def peak_memory_rows(res, dname, variants, n, device):
    """Device memory one step allocates beyond what was allocated before it (each alone; CUDA only)."""
    import torch

    if device.type != "cuda":
        return
    for name, (_, step) in variants.items():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        res.add(f"{name}/{dname}", "step_peak_memory", "MiB",
                (torch.cuda.max_memory_allocated() - base) / 2**20, "params", n)


def timing_rows(res, label, dname, variants, floor, n, args, copy_bw, timer):
    """Interleaved timings, medians: step time, bandwidth of the floor bytes; returns {variant: ms}."""
    times = {name: [] for name in variants}
    for _ in range(args.reps):
        handles = {name: timer.time(step) for name, (_, step) in variants.items()}
        for name, h in handles.items():
            times[name].append(timer.ms(h))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, t in med.items():
        bw = floor[name] / (t / 1e3)
        res.add(f"{name}/{dname}", "step_time", "ms", t, "params", n)
        res.add(f"{name}/{dname}", "bandwidth", "GB/s", bw / 1e9, "params", n)
        res.add(f"{name}/{dname}", "frac_of_copy", "ratio", bw / copy_bw, "params", n)
        print(f"  {label}/{dname} {name:24s} {t:8.3f} ms  floor {floor[name] / n:5.2f} B/param "
              f"= {floor[name] / copy_bw * 1e3:7.3f} ms at copy speed  {bw / 1e9:7.1f} GB/s "
              f"({bw / copy_bw:4.0%} of copy)", flush=True)
    return med


def bench_set(res, label, shapes, dtype, device, args, copy_bw, timer):
    import torch

    dname = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    n = sum(torch.Size(s).numel() for s in shapes)
    _, grads = make_set(shapes, dtype, device, args.seed)
    variants = build_variants(label, dname, shapes, dtype, device, args, grads, res.config.setdefault("unavailable", {}))
    floor = floor_rows(res, dname, variants, grads, n, copy_bw)
    peak_memory_rows(res, dname, variants, n, device)
    med = timing_rows(res, label, dname, variants, floor, n, args, copy_bw, timer)
    for ours in ("Gefen-8bit", "Gefen-8bit/kernel"):
        for other in ["AdamW", "gefen-upstream"] + GPU_PEERS:
            if ours in med and other in med:
                res.add(f"{ours}/{dname}", f"speedup_vs_{other}", "x", med[other] / med[ours],
                        "params", n)
                print(f"  {label}/{dname} {ours} is {med[other] / med[ours]:.2f}x faster than {other}")
    del variants
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--sizes", default="125M,1.5B", help="comma list of " + ",".join(SIZES))
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--skip-upstream", action="store_true")
    parser.add_argument("--variants", default=",".join(["Gefen-8bit", "Gefen-4bit", "AdamW", "gefen-upstream"] + GPU_PEERS),
                        help="comma list of registry names; Gefen-8bit/kernel is timed whenever Gefen-8bit is")
    parser.add_argument("--kernel-tiles", default="1024x4,4096x8,4096x16,8192x16",
                        help="extra Gefen-8bit/kernel timings at TILExNUM_WARPS")
    parser.add_argument("--dry-run", "--cpu-smoke", dest="dry_run", action="store_true",
                        help="tiny CPU run under TRITON_INTERPRET=1: every code path of the script and its "
                             "CSV (no measurement)")
    args = check.parse(parser, argv)

    import torch

    device = script_device(args.dry_run, "bench_kernels")
    if device is None:
        return 0
    timer = Timer(device)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if args.dry_run:
        sets = {"smoke": quick_shapes(2**12)}
        args.dtypes, args.reps, args.warmup, args.kernel_tiles = "fp32,bf16", 1, 1, "4096x8"
        args.skip_upstream = True
        # one peer that runs on a CPU and one that needs CUDA (its skip is recorded), no compiles
        args.variants = "Gefen-8bit,Gefen-4bit,AdamW,gefen-x,flashoptim-AdamW"
    elif args.quick:
        sets = {"10M": quick_shapes(10_000_000)}
        args.dtypes = "fp32"
    else:
        sets = {s: gpt2_shapes(*SIZES[s]) for s in args.sizes.split(",")}
    copy_bytes = 2**20 if args.dry_run else 2**31
    with Results("gefen_kernels", args, config=vars(args), device=device) as res:
        copy_bw = copy_bandwidth(device, timer, copy_bytes, 10)
        res.add("copy", "bandwidth", "GB/s", copy_bw / 1e9, "bytes", copy_bytes)
        print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)", flush=True)
        agree_shapes = next(iter(sets.values()))
        for label, shapes in sets.items():
            for dn in args.dtypes.split(","):
                bench_set(res, label, shapes, dtypes[dn], device, args, copy_bw, timer)
                res.flush()
        for dn in args.dtypes.split(","):
            maxd, rr, codes = agreement(agree_shapes, dtypes[dn], device, args.seed)
            n = sum(torch.Size(s).numel() for s in agree_shapes)
            res.add(f"triton-vs-torch/{dn}", "agree_max_abs_p", "abs", maxd, "params", n)
            res.add(f"triton-vs-torch/{dn}", "agree_rel_rms_p", "ratio", rr, "params", n)
            res.add(f"triton-vs-torch/{dn}", "agree_codes_equal", "fraction", codes, "params", n)
            print(f"  Triton vs torch backend ({dn}, 5 steps): max|Δp| {maxd:.2e}, rel RMS {rr:.2e}, "
                  f"codes equal {codes:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
