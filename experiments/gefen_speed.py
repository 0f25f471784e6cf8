"""Gefen's step time against fused AdamW's: CPU steps in cache, on many small tensors and at offload
scale, the Triton path's work per step, GPU steps.

    python experiments/gefen_speed.py              # full run -> results/gefen_speed.csv (GPU part where CUDA is)
    python experiments/gefen_speed.py --quick      # smaller models, 7 repeats -> results/quick/
    python analysis/gefen_speed.py                 # paper_figs/gefen_speed.png and its results/README.md section
    python experiments/gefen_speed.py --parts gpu --results-dir results/gpu   # the GPU part (experiments/gpu_checks.sh)
    python experiments/gefen_speed.py --parts gpu --dry-run --results-dir /tmp/x   # its code on tiny CPU tensors

Targets judged (analysis/gefen_speed.py): at 1 CPU thread every Gefen variant's step at most 1.0x
fused AdamW's on the transformer and the MLP (stretch 0.7x), the 4-bit factored step at most 1.1x
the 4-bit unfactored one, at most 2x AdamW's on the model of 160 small tensors; the Triton path at
most 8 device operations and 8 kernel launches per step after the first, the same at 40 and 160
tensors, factored included; on a GPU the whole fp32 step at most 1.0x AdamW's at 124 M parameters
(0.7x at 1.5 B, ``--gpu-sizes 125M 1.5B``) and the factored step at most 1.15x the unfactored.

CPU (``--parts cpu``): the transformer and MLP of experiments/gefen_memory.py (``models.MODELS``: 3.4 M
and 1.9 M parameters) and ``models.small_tensor_stack(160)`` (40 x (Linear(64, 64) + LayerNorm(64)): 160
tensors, 171,520 parameters), each optimizer on its own copy of the model with fixed gradients (one
backward) after its first step (blocks, codebook, compilation). Per model, one interleaved run per
``--threads`` count (experiments/harness/train.py's ``interleaved``: every optimizer stepped once per
repeat, in a shuffled order; ours runs its numba kernels on as many threads), after two untimed rounds.
Optimizers (registry names): AdamW (fused: the baseline), Gefen-8bit, Gefen-4bit, Gefen-8bit-factored,
Gefen-4bit-factored, Gefen-8bit-compact, Gefen-4bit-compact (the factored state at Gefen-X's bytes), and
the peers DeepSpeed's CPU-Adam, bitsandbytes' AdamW8bit (``registry.CPU_PEERS``: ``python -m pip install
--no-build-isolation deepspeed==0.19.8 bitsandbytes==0.50.2``; DeepSpeed compiles its op on first use),
torchao-AdamW8bit and gefen-x; a peer that is missing or fails is left out with a ``skipped`` row (its
reason in the unit column). ``--quick``: a d=64 two-layer transformer, a 256-wide MLP, the same 160
small tensors, torchao left out (it compiles on first use).

Offload scale (``--parts offload``): the regime of CPU-offloaded training (FSDP2's
``CPUOffloadPolicy``, ZeRO-Offload), GPT-2 shapes of 124 M and 539 M parameters (``OFFLOAD_SIZES``),
one fp32 parameter set shared by every optimizer (each with its own state), gradients in fp32 and
in bf16 (AdamW, which refuses bf16 gradients on fp32 weights, is timed casting them into an fp32
buffer first). Per thread count the STREAM triad's bandwidth (``harness.traffic``), then
``--offload-repeats`` interleaved steps. gefen-x and torchao are left out here (``OFFLOAD_LEFT_OUT``).

Triton path (``--parts count``): experiments/harness/op_count.py's counts in a child process with
TRITON_INTERPRET=1, on CPU tensors of ``small_tensor_stack(n)`` for n in ``--count-tensors``, each
Gefen variant with ``backend="triton"`` (fused AdamW beside it as the reference), the largest over
``--count-steps`` steps after the first.

GPU (``--parts gpu``, only where CUDA exists, or ``--dry-run``): parameter sets of GPT-2's shapes
(``models.gpt2_shapes``, fp32, gradients scaled per row: ``models.make_param_set``), every optimizer
on its own copy after ``--gpu-warmup`` steps, whole ``step()`` timed with CUDA events in interleaved
repeats; the host time of each call (wall clock, no synchronisation) beside it; and the counts of
``--parts count`` on CUDA tensors (variants ``cuda/<optimizer>``).

Rows (long format, experiments/harness/common.py):

* CPU, variant ``<model>/<optimizer>``, x = ``threads``: ``step_time_median`` (s),
  ``step_time_vs_adamw`` (ratio to AdamW's median of the same interleaved run),
  ``step_time_vs_unfactored`` (factored variants: ratio to the same bits unfactored), ``threads``
  (torch's thread count in force), ``ns_per_param``, ``bytes_floor`` (B/param one pass over weights,
  gradient and state moves: ``harness.traffic.bytes_floor``), ``gbps_effective`` (the floor's bytes
  over the step's time), and on the small tensors ``host_us_per_tensor`` (µs: the step's median over
  its tensors, almost all host work at these sizes).
* Offload, variant ``offload-<size>-<fp32|bf16>/<optimizer>``, x = ``threads``: the CPU rows' metrics
  and ``floor_ns_per_param`` (the floor's time at the triad's bandwidth), ``params``; without x,
  ``transient_bytes`` (tensor bytes one untimed step allocates beyond weights, gradients and state:
  ``harness.peak.PeakMemory``). Variant ``memory/triad``: ``bandwidth`` (GB/s) per thread count.
* ``skipped`` (value NaN): an optimizer left out, the reason in the unit column.
* Triton path, variant ``<optimizer>``, x = ``tensors``: ``device_ops_per_step``,
  ``launches_per_step``, ``aten_ops_per_step`` (views and markers too), ``host_syncs_per_step``.
* GPU, variant ``gpt2-<size>/<optimizer>``, x = ``params``: ``step_time_median`` (s, CUDA events),
  ``step_time_vs_adamw``, ``step_time_vs_unfactored``, ``host_time_median`` (s) and
  ``host_us_per_tensor``; the device column names the GPU.
"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import contextlib
import functools
import math
import os
import statistics
import sys

import torch

from experiments.harness import check
from experiments.harness.common import Results, add_common_args, device_name
from experiments.harness.models import (GPT2_SIZES, MODELS, Encoder, gpt2_shapes, make_mlp, make_param_set, model_loss,
                                small_tensor_stack)
from experiments.harness.op_count import count_in_child, count_optimizer, optimizer_options
from experiments.harness.peak import PeakMemory
from experiments.harness.registry import CPU_PEERS, CPU_PEERS_INSTALL, DENSE, make_optimizer, state_bytes
from experiments.harness.traffic import bytes_floor, triad_gbps
from experiments.harness.train import WEIGHT_DECAY, interleaved, median

OPTIMIZERS = ["AdamW", "Gefen-8bit", "Gefen-4bit", "Gefen-8bit-factored", "Gefen-4bit-factored", "Gefen-8bit-compact",
              "Gefen-4bit-compact", *CPU_PEERS, "torchao-AdamW8bit", "gefen-x"]
GEFEN = [n for n in OPTIMIZERS if n.startswith("Gefen")]
SMALL_TENSORS = 160
LR = 1e-3
# offload scale: GPT-2 shapes with tied embeddings (models.gpt2_shapes), 124 M and 539 M parameters
OFFLOAD_SIZES = {"128M": (768, 12), "512M": (1280, 24)}
# left out at offload scale, with the reason its rows carry
OFFLOAD_LEFT_OUT = {"gefen-x": "no CPU kernel: its CPU step is decomposed torch with whole-tensor temporaries "
                               "(timed in cache, not at offload scale)",
                    "torchao-AdamW8bit": "its CPU step is a torch.compile'd elementwise graph, the slowest 8-bit "
                                         "step in cache by an order of magnitude (timed there, not at offload scale)"}
OFFLOAD_OPTIMIZERS = [n for n in OPTIMIZERS if n not in OFFLOAD_LEFT_OUT]
# optimizers that take no bf16 gradients of fp32 weights (fused AdamW refuses them; DeepSpeed's CPU-Adam
# would read them as fp32, past their end: the registry's wrapper refuses them): their bf16 rows time a
# cast into an fp32 buffer and the step, what a user of them does (ZeRO-Offload keeps fp32 gradients)
CAST_FIRST = ("AdamW", "deepspeed-CPUAdam")


# the --check size: the full run's flags it overrides (experiments/harness/check.py)
CHECK = {"--repeats": 21, "--parts": ["cpu", "offload", "count"], "--threads": 1, "--offload-sizes": ["128M"],
         "--offload-repeats": 5}
CHECK_NOTE = ("the CPU, offload (128M only) and launch-count parts, one thread, 21 timed steps where the full run "
              "has 61 (offload 5 of 11): ratios of step times, which a machine shared with other jobs moves")


def cpu_models(quick: bool) -> dict:
    """name -> (make model, make input batch)."""
    small = (lambda: small_tensor_stack(SMALL_TENSORS), lambda: torch.randn(16, 64))
    if quick:
        return {"transformer": (lambda: Encoder(vocab=256, d=64, layers=2, heads=4, ff=256),
                                lambda: torch.randint(0, 256, (8, 64))),
                "mlp": (lambda: make_mlp(256), lambda: torch.randn(64, 784)),
                "small-tensors": small}
    return {name: (make, data) for name, (make, data, _) in MODELS.items()} | {"small-tensors": small}


def build(names, make_model, make_input, seed, label, res):
    """{name: optimizer} each on its own model copy with fixed gradients, after its first step;
    returns (optimizers, tensors in the model, its parameters). A peer that cannot run here is
    left out with a ``skipped`` row."""
    torch.manual_seed(seed)
    x = make_input()
    opts, tensors, params = {}, 0, 0
    for name in names:
        torch.manual_seed(seed)
        model = make_model()
        tensors = sum(1 for _ in model.parameters())
        params = sum(p.numel() for p in model.parameters())
        try:
            opt = make_optimizer(name, model, LR, WEIGHT_DECAY)
            model_loss(model, x).backward()
            opt.step()
        except Exception as exc:
            skipped(res, f"{label}/{name}", exc)
            continue
        opts[name] = opt
    return opts, tensors, params


def skipped(res, variant, why):
    """A ``skipped`` row: value NaN, the reason (an exception or a sentence) in its unit column."""
    reason = why if isinstance(why, str) else f"{type(why).__name__}: {str(why).splitlines()[0][:200]}"
    if isinstance(why, ModuleNotFoundError) and variant.rsplit("/", 1)[-1] in CPU_PEERS:
        reason += f" (install: {CPU_PEERS_INSTALL})"
    print(f"[{variant}] skipped ({reason})", file=sys.stderr, flush=True)
    res.add(variant, "skipped", reason, math.nan)


def traffic_rows(res, prefix, med, states, n, g_bytes, x_, bandwidth=None, extra_bytes=None):
    """ns_per_param, bytes_floor (``traffic.bytes_floor``: fp32 weights, ``g_bytes`` gradients, each
    optimizer's state bytes in ``states``, plus its ``extra_bytes`` per parameter) and gbps_effective
    of one interleaved run of ``n`` parameters; with the triad's ``bandwidth`` (GB/s) also
    floor_ns_per_param, the floor's time at that bandwidth."""
    for name, t in med.items():
        floor = bytes_floor(n, 4, g_bytes, states[name]) + (extra_bytes or {}).get(name, 0.0)
        res.add(f"{prefix}/{name}", "ns_per_param", "ns", t / n * 1e9, **x_)
        res.add(f"{prefix}/{name}", "bytes_floor", "B/param", floor, **x_)
        res.add(f"{prefix}/{name}", "gbps_effective", "GB/s", floor * n / t / 1e9, **x_)
        if bandwidth:
            res.add(f"{prefix}/{name}", "floor_ns_per_param", "ns", floor / bandwidth, **x_)


def ratio_rows(res, prefix, med, x_, unit_scale=1e3, unit="ms"):
    """step_time_median, step_time_vs_adamw and step_time_vs_unfactored of one interleaved run."""
    base = med.get("AdamW", math.nan)
    for name, t in med.items():
        res.add(f"{prefix}/{name}", "step_time_median", "s", t, **x_)
        res.add(f"{prefix}/{name}", "step_time_vs_adamw", "ratio", t / base, **x_)
        plain = name.removesuffix("-factored").removesuffix("-compact")
        note = ""
        if plain != name and plain in med:
            res.add(f"{prefix}/{name}", "step_time_vs_unfactored", "ratio", t / med[plain], **x_)
            note = f", {t / med[plain]:.3f}x {plain}"
        print(f"[{prefix} {x_['x_name']}={x_['x_value']}] {name:22s} {t * unit_scale:9.3f} {unit} = "
              f"{t / base:5.2f}x AdamW{note}", flush=True)


def cpu_part(res, args):
    for model_name, (make_model, make_input) in cpu_models(args.quick).items():
        if model_name not in args.models:
            continue
        opts, tensors, params = build(args.optimizers, make_model, make_input, args.seed, model_name, res)
        steps = {n: o.step for n, o in opts.items()}
        for threads in args.threads:
            torch.set_num_threads(threads)
            interleaved(steps, 2)  # thread pools and caches at this thread count
            med = median(interleaved(steps, args.repeats, shuffle=True, progress=True,
                                     desc=f"{model_name} at {threads} thread(s)"))
            x_ = dict(x_name="threads", x_value=threads)
            ratio_rows(res, model_name, med, x_)
            traffic_rows(res, model_name, med, {k: state_bytes(o) for k, o in opts.items()}, params, 4, x_)
            for name, t in med.items():
                res.add(f"{model_name}/{name}", "threads", "count", torch.get_num_threads(), **x_)
                if model_name == "small-tensors":
                    res.add(f"{model_name}/{name}", "host_us_per_tensor", "us", t / tensors * 1e6, **x_)
            res.flush()
        del opts, steps


def offload_sets(args) -> dict:
    """label -> parameter shapes of the offload part."""
    if args.dry_run or args.quick:
        return {"gpt2-d64": gpt2_shapes(64, 2, vocab=512, ctx=64)}
    return {size: gpt2_shapes(*OFFLOAD_SIZES[size]) for size in args.offload_sizes}


def offload_part(res, args):
    """Offload scale: one fp32 parameter set shared by every optimizer (each with its own state),
    gradients of rows of different scale in fp32 and in bf16; per thread count the triad's
    bandwidth, then each optimizer's interleaved steps, and the tensor bytes beyond weights,
    gradients and state that one step allocates (``transient_bytes``, one untimed step)."""
    bandwidth = {}
    for threads in args.threads:
        bandwidth[threads] = triad_gbps(threads, elements=1 << (20 if args.dry_run or args.quick else 26))
        res.add("memory/triad", "bandwidth", "GB/s", bandwidth[threads], x_name="threads", x_value=threads)
        print(f"[offload] STREAM triad at {threads} thread(s): {bandwidth[threads]:.1f} GB/s", flush=True)
    for label, shapes in offload_sets(args).items():
        for name in (n for n in OFFLOAD_LEFT_OUT if n in args.optimizers):
            skipped(res, f"offload-{label}/{name}", OFFLOAD_LEFT_OUT[name])
        values, grads = make_param_set(shapes, torch.float32, torch.device("cpu"), args.seed)
        params = [torch.nn.Parameter(v) for v in values]
        del values
        for p in params:
            p.grad_dtype = None  # bf16 gradients on fp32 weights, as mixed-precision training leaves them
        n = sum(p.numel() for p in params)
        opts = {}
        for name in args.offload_optimizers:
            for p, g in zip(params, grads):
                p.grad = g
            try:
                opts[name] = make_optimizer(name, params, LR, WEIGHT_DECAY)
                opts[name].step()  # blocks, codebook, state, compilation
            except Exception as exc:
                skipped(res, f"offload-{label}/{name}", exc)
                opts.pop(name, None)
        states = {name: state_bytes(o) for name, o in opts.items()}
        for gdtype in args.offload_grads:
            half = [g.to(torch.bfloat16) for g in grads] if gdtype == "bf16" else None
            prefix = f"offload-{label}-{gdtype}"
            fns, given = {}, {}
            for name, opt in opts.items():
                cast = half is not None and name in CAST_FIRST
                given[name] = grads if half is None or cast else half
                fns[name] = _cast_then(opt.step, half, grads) if cast else opt.step
            set_grads = functools.partial(_set_grads, params, given)
            for name in fns:  # what one step allocates beyond its data, untimed
                set_grads(name)
                with PeakMemory(params, opts[name]) as peak:
                    fns[name]()
                res.add(f"{prefix}/{name}", "transient_bytes", "B", peak.transient)
            # the cast's bytes beyond the bf16 read: the fp32 copy written, then read by the step
            extra = {name: 8.0 for name in fns if half is not None and name in CAST_FIRST}
            for threads in args.threads:
                torch.set_num_threads(threads)
                interleaved(fns, 2, before=set_grads)
                med = median(interleaved(fns, args.offload_repeats, shuffle=True, before=set_grads, progress=True,
                                         desc=f"{prefix} at {threads} thread(s)"))
                x_ = dict(x_name="threads", x_value=threads)
                ratio_rows(res, prefix, med, x_)
                traffic_rows(res, prefix, med, states, n, 2 if half is not None else 4, x_, bandwidth[threads],
                             extra)
                for name in med:
                    res.add(f"{prefix}/{name}", "params", "count", n, **x_)
                res.flush()
            del half
        del opts, params, grads


def _set_grads(params, given, name):
    """Point the shared parameters' gradients at ``given[name]``, the ones that optimizer steps on."""
    for p, g in zip(params, given[name]):
        p.grad = g


def _cast_then(step, half, grads):
    """``step`` after casting the bf16 gradients ``half`` into the fp32 buffers ``grads``."""
    def run():
        for g, h in zip(grads, half):
            g.copy_(h)
        step()
    return run


def count_rows(res, records, prefix=""):
    """The largest count over the steps after the first of each (optimizer, tensors) record."""
    for rec in records:
        name, n = rec["optimizer"], rec["tensors"]
        if "error" in rec:
            print(f"[count {n} tensors] {prefix}{name}: skipped ({rec['error'][:300]})", file=sys.stderr)
            continue
        x_ = dict(x_name="tensors", x_value=n)
        for key in ("device_ops", "launches", "aten_ops", "host_syncs"):
            res.add(f"{prefix}{name}", f"{key}_per_step", "count", max(s[key] for s in rec["steps"]), **x_)
        last = rec["steps"][-1]
        print(f"[count {n} tensors] {prefix}{name:22s} device ops {last['device_ops']:6d}  launches "
              f"{last['launches']:3d}  host syncs {last['host_syncs']}  top: "
              + ", ".join(f"{op} {k}" for op, k in last["top_ops"][:4]), flush=True)


def count_part(res, args):
    records = count_in_child(args.count_optimizers, args.count_tensors, args.count_steps, args.seed)
    count_rows(res, records)


@contextlib.contextmanager
def rows_of_device(res, device):
    """Rows added inside carry ``device``'s name in their device column."""
    before = res.device
    res.device = device_name(device)
    try:
        yield
    finally:
        res.device = before


def gpu_sets(args) -> dict:
    """label -> parameter shapes of the GPU part."""
    if args.dry_run:
        return {"gpt2-tiny": gpt2_shapes(16, 1, vocab=64, ctx=16)}
    if args.quick:
        return {"gpt2-d256": gpt2_shapes(256, 4)}
    return {f"gpt2-{s}": gpt2_shapes(*GPT2_SIZES[s]) for s in args.gpu_sizes}


def timed(step, device, events):
    """``step`` wrapped to record CUDA events around it into ``events`` (on a GPU)."""
    if device.type != "cuda":
        return step

    def run():
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        events.append((a, b))
    return run


def gpu_part(res, args):
    if not torch.cuda.is_available() and not args.dry_run:
        print("[gpu] no CUDA device: the GPU part is skipped (nothing measured)", flush=True)
        return
    device = torch.device("cpu" if args.dry_run else "cuda")
    with rows_of_device(res, device):
        for label, shapes in gpu_sets(args).items():
            n = sum(torch.Size(s).numel() for s in shapes)
            _, grads = make_param_set(shapes, torch.float32, device, args.seed)
            opts = {}
            for name in args.gpu_optimizers:
                params = [torch.nn.Parameter(p) for p in make_param_set(shapes, torch.float32, device, args.seed)[0]]
                for p, g in zip(params, grads):
                    p.grad = g
                try:
                    opts[name] = make_optimizer(name, params, LR, WEIGHT_DECAY, **optimizer_options(name))
                    for _ in range(args.gpu_warmup):
                        opts[name].step()
                except Exception as exc:  # a peer missing on the GPU machine is reported, not fatal
                    print(f"[{label}] {name}: skipped ({type(exc).__name__}: {str(exc)[:300]})", file=sys.stderr)
                    opts.pop(name, None)
            if device.type == "cuda":
                torch.cuda.synchronize()
            events = {name: [] for name in opts}
            host = median(interleaved({name: timed(o.step, device, events[name]) for name, o in opts.items()},
                                      args.gpu_reps, shuffle=True))
            if device.type == "cuda":
                torch.cuda.synchronize()
                med = {name: statistics.median(a.elapsed_time(b) for a, b in ev) / 1e3 for name, ev in events.items()}
            else:
                med = host
            x_ = dict(x_name="params", x_value=n)
            ratio_rows(res, label, med, x_)
            for name, t in host.items():
                res.add(f"{label}/{name}", "host_time_median", "s", t, **x_)
                res.add(f"{label}/{name}", "host_us_per_tensor", "us", t / len(shapes) * 1e6, **x_)
            res.flush()
            del opts, grads
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if device.type == "cuda" or args.dry_run:
            records = []
            for n in args.count_tensors:
                for name in args.count_optimizers:
                    rec = {"optimizer": name, "tensors": n}
                    try:
                        rec["steps"] = count_optimizer(name, n, args.count_steps, args.seed, device)
                    except Exception as exc:
                        rec["error"] = f"{type(exc).__name__}: {exc}"
                    records.append(rec)
            count_rows(res, records, prefix=f"{device.type}/")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    parser.add_argument("--parts", nargs="+", default=["cpu", "offload", "count", "gpu"],
                        choices=["cpu", "offload", "count", "gpu"])
    parser.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")], default=[1, 2],
                        help="comma list of torch thread counts (Default: 1,2)")
    parser.add_argument("--repeats", type=int, default=None, help="timed CPU steps per optimizer (Default: 61, quick 7)")
    parser.add_argument("--optimizers", nargs="+", default=None, choices=DENSE + CPU_PEERS,
                        help="CPU part (Default: all of OPTIMIZERS; quick: all but torchao's)")
    parser.add_argument("--models", nargs="+", default=["transformer", "mlp", "small-tensors"],
                        choices=["transformer", "mlp", "small-tensors"])
    parser.add_argument("--offload-sizes", nargs="+", default=list(OFFLOAD_SIZES), choices=list(OFFLOAD_SIZES))
    parser.add_argument("--offload-grads", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                        help="gradient dtypes of the offload part (weights fp32)")
    parser.add_argument("--offload-optimizers", nargs="+", default=OFFLOAD_OPTIMIZERS, choices=DENSE + CPU_PEERS)
    parser.add_argument("--offload-repeats", type=int, default=None,
                        help="timed steps per optimizer in the offload part (Default: 11, quick 3)")
    parser.add_argument("--count-tensors", nargs="+", type=int, default=None,
                        help="tensor counts of the Triton path's counts, multiples of 4 (Default: 40 160; quick 8 32: "
                             "the interpreter runs every program)")
    parser.add_argument("--count-steps", type=int, default=None, help="counted steps after the first (Default: 3, quick 1)")
    parser.add_argument("--count-optimizers", nargs="+", default=["AdamW"] + GEFEN, choices=DENSE)
    parser.add_argument("--gpu-sizes", nargs="+", default=["125M"], choices=list(GPT2_SIZES))
    parser.add_argument("--gpu-optimizers", nargs="+", default=["AdamW"] + GEFEN + ["gefen-x"], choices=DENSE)
    parser.add_argument("--gpu-reps", type=int, default=None, help="timed GPU steps per optimizer (Default: 30, quick 10)")
    parser.add_argument("--gpu-warmup", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true",
                        help="the GPU part on tiny CPU tensors under TRITON_INTERPRET=1 (its code, no measurement)")
    args = check.parse(parser, argv)
    if args.dry_run:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--dry-run needs TRITON_INTERPRET=1 before Triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
        args.gpu_reps, args.gpu_warmup, args.count_tensors, args.count_steps = 2, 1, [8], 2
        args.offload_repeats = 2
    args.repeats = args.repeats or (7 if args.quick else 61)  # millisecond steps: many, to resolve a 10% ratio
    args.gpu_reps = args.gpu_reps or (10 if args.quick else 30)
    args.offload_repeats = args.offload_repeats or (3 if args.quick else 11)
    args.optimizers = args.optimizers or [n for n in OPTIMIZERS if not (args.quick and n.startswith("torchao"))]
    args.count_tensors = args.count_tensors or ([8, 32] if args.quick else [40, SMALL_TENSORS])
    args.count_steps = args.count_steps or (1 if args.quick else 3)
    threads = torch.get_num_threads()
    with Results("gefen_speed", args, config=vars(args)) as res:
        try:
            for part in ("cpu", "offload", "count", "gpu"):
                if part in args.parts:
                    {"cpu": cpu_part, "offload": offload_part, "count": count_part, "gpu": gpu_part}[part](res, args)
                    res.flush()
        finally:
            torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
