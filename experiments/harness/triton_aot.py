"""Ahead-of-time compilation of the Triton kernels for NVIDIA targets, on a machine without a GPU.

A tool built on Triton's internals, outside the library's import path: the launchers only describe
their configurations (``launch_configs``), this module compiles and reports them.

A launch is described by ``optim._triton_common.KernelLaunch``: the kernel, the arguments its
launcher passes (small CPU stand-ins for the tensors: their dtypes and 16-byte alignment are what the
compiler sees) and the constexprs and options. ``compile_launch`` specialises it exactly as ``kernel[grid](...)`` would (the
JIT's own binder: pointer types, integer arguments equal to 1 or divisible by 16, alignment) and
compiles it for a given ``GPUTarget``; ``resources`` reads registers, spills and shared memory from
``ptxas -v`` and the cubin (``cuobjdump --dump-resource-usage``; both ship with Triton);
``occupancy`` turns them into the resident warps per SM of the target.

Kernels are ``JITFunction`` objects only when ``TRITON_INTERPRET`` is unset, so ``reports`` compiles
in a subprocess without it (used by ``tests/test_triton_aot.py`` and
``experiments/kernel_resources.py``).
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parent / "install_check.py"))

import contextlib
import io
import os
import re
import subprocess
import tempfile

import triton

from optim._triton_common import KernelLaunch, axis_each, axis_pairs, axis_product

# Targets: compute capability -> per-SM limits (CUDA programming guide, "Compute capabilities").
# regs: 32-bit registers per SM; threads / warps: resident per SM; blocks: resident blocks per SM;
# smem: shared memory one block may use (opt-in maximum), bytes; reg_unit: registers are allocated
# per warp in units of this many (per-thread count rounded up to a multiple of 8, times 32 lanes).
ARCHS = {
    80: dict(name="sm_80", regs=65536, threads=2048, warps=64, blocks=32, smem=163 * 1024, reg_unit=256),
    90: dict(name="sm_90", regs=65536, threads=2048, warps=64, blocks=32, smem=227 * 1024, reg_unit=256),
    100: dict(name="sm_100", regs=65536, threads=2048, warps=64, blocks=32, smem=227 * 1024, reg_unit=256),
}
MAX_REGS_PER_THREAD = 255


def supported_archs() -> list:
    """Capabilities of ARCHS this Triton can compile for (sm_100 needs its Blackwell ptxas)."""
    from triton.backends.nvidia.compiler import get_ptxas

    out = []
    for cap in ARCHS:
        try:
            if os.path.exists(get_ptxas(cap).path):
                out.append(cap)
        except Exception:  # noqa: BLE001 -- a missing tool means the target is not supported here
            pass
    return out


def _specialise(launch: KernelLaunch, cap: int):
    """(target, ASTSource, options, key) of ``launch`` as the JIT's binder specialises it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    if not hasattr(fn, "params"):
        raise RuntimeError("kernels are interpreted (TRITON_INTERPRET=1): compile in a process without it")
    target = GPUTarget("cuda", cap, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.kwargs)
    kwargs.setdefault("debug", False)
    bound, specialization, options = binder(*launch.args, **kwargs)
    key = (fn.__name__, cap, str(specialization), str(sorted(kwargs.items())))
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return target, ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), options, key


def spec_key(launch: KernelLaunch, cap: int) -> tuple:
    """What the compiled kernel depends on: two launches with one key compile to one kernel."""
    return _specialise(launch, cap)[3]


def compile_launch(launch: KernelLaunch, cap: int):
    """Compile ``launch`` for ``sm_<cap>`` as its JIT launch would; returns (Triton's CompiledKernel,
    the ``ptxas -v`` log of its cubin)."""
    from triton import knobs
    from triton.compiler import make_backend

    target, src, options, _ = _specialise(launch, cap)
    log = io.StringIO()
    saved, knobs.nvidia.dump_ptxas_log = knobs.nvidia.dump_ptxas_log, True
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=target, options=options.__dict__)
            if "registers" not in log.getvalue():  # from Triton's cache: assemble again for the log
                make_backend(target).make_cubin(compiled.asm["ptx"], {}, options, cap)
    finally:
        knobs.nvidia.dump_ptxas_log = saved
    return compiled, log.getvalue()


def _cuobjdump():
    from triton import knobs

    return os.path.join(os.path.dirname(knobs.nvidia.ptxas.path), "cuobjdump")


def resources(compiled, ptxas_log: str) -> dict:
    """regs (per thread), spill_stores / spill_loads / stack (bytes per thread, from ``ptxas -v``),
    shared (bytes per block: Triton's dynamic shared memory plus any static, from the cubin)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True, timeout=60).stdout
    fields = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_log)
    regs = re.search(r"Used (\d+) registers", ptxas_log)
    if spill is None or regs is None or int(regs.group(1)) != fields["REG"]:
        raise RuntimeError(f"cannot read ptxas' resource report:\n{ptxas_log}")
    return dict(regs=fields["REG"], spill_stores=int(spill.group(2)), spill_loads=int(spill.group(3)),
                stack=int(spill.group(1)), shared=int(compiled.metadata.shared) + fields["SHARED"])


def occupancy(regs: int, shared: int, num_warps: int, cap: int) -> dict:
    """Resident blocks and warps per SM that registers, shared memory and the thread limit allow,
    and the theoretical occupancy (resident warps / maximum warps)."""
    a = ARCHS[cap]
    regs_per_warp = -(-max(regs, 1) * 32 // a["reg_unit"]) * a["reg_unit"]
    by_regs = a["regs"] // (regs_per_warp * num_warps)
    by_threads = a["threads"] // (32 * num_warps)
    by_smem = a["smem"] // shared if shared else a["blocks"]
    blocks = min(by_regs, by_threads, by_smem, a["blocks"])
    warps = blocks * num_warps
    limiter = min((by_regs, "registers"), (by_threads, "threads"), (by_smem, "shared memory"),
                  (a["blocks"], "blocks"))[1]
    return dict(blocks=blocks, warps=warps, occupancy=warps / a["warps"], limiter=limiter)


def report(launch: KernelLaunch, cap: int) -> dict:
    """Compile ``launch`` for ``sm_<cap>``: its resources and occupancy in one dict."""
    res = resources(*compile_launch(launch, cap))
    occ = occupancy(res["regs"], res["shared"], launch.num_warps, cap)
    return dict(kernel=launch.kernel.__name__, config=launch.name, arch=ARCHS[cap]["name"],
                num_warps=launch.num_warps, smem_limit=ARCHS[cap]["smem"], **res, **occ)


_POOL_LAUNCHES: list = []


def _report_or_error(job):
    i, cap = job
    try:
        return report(_POOL_LAUNCHES[i], cap)
    except Exception as exc:  # noqa: BLE001 -- a kernel that does not compile is a result
        launch = _POOL_LAUNCHES[i]
        return dict(kernel=launch.kernel.__name__, config=launch.name, arch=ARCHS[cap]["name"],
                    error=f"{type(exc).__name__}: {str(exc)[-2000:]}")


def report_all(launches: list, caps: list, workers: int = 2) -> list:
    """``report`` of every launch for every capability, each distinct kernel compiled once (launches
    with one ``spec_key`` share the first one's report, under their own name), in ``workers``
    forked processes. A launch that fails to compile gets a row with ``error``."""
    import multiprocessing as mp

    global _POOL_LAUNCHES
    _POOL_LAUNCHES = list(launches)
    first, jobs, owner = {}, [], []
    for cap in caps:
        for i, launch in enumerate(launches):
            key = spec_key(launch, cap)
            if key not in first:
                first[key] = len(jobs)
                jobs.append((i, cap))
            owner.append((i, cap, first[key]))
    if workers > 1:
        with mp.get_context("fork").Pool(workers) as pool:
            done = pool.map(_report_or_error, jobs, chunksize=1)
    else:
        done = [_report_or_error(j) for j in jobs]
    return [dict(done[j], config=launches[i].name) for i, cap, j in owner]


# Modules whose ``launch_configs(cover)`` enumerate their launchers' configurations.
LAUNCH_MODULES = ("optim.disk_sparse.triton_ops", "optim.gefen.triton_ops")
KERNEL_MODULES = ("optim.disk_sparse._triton_kernels", "optim.gefen._triton_kernels")


def all_launches(cover=None) -> list:
    """Every launcher's configurations under ``cover`` (Default: ``_triton_common.axis_each``)."""
    import importlib

    return [launch for mod in LAUNCH_MODULES
            for launch in importlib.import_module(mod).launch_configs(cover or axis_each)]


def kernel_names() -> set:
    """Names of the ``@triton.jit`` kernels (``*_kernel``) of KERNEL_MODULES: each must be launched."""
    import importlib

    return {name for mod in KERNEL_MODULES for name, obj in vars(importlib.import_module(mod)).items()
            if name.endswith("_kernel") and hasattr(obj, "fn")}


def _cover(name):
    return {"each": axis_each, "pairs": axis_pairs, "all": axis_product}[name]


def reports(plan: dict, workers: int = 2, timeout: float = 3600) -> dict:
    """Compile in a subprocess without ``TRITON_INTERPRET``; ``plan``: {capability: (cover, stride)},
    cover one of "each" / "pairs" / "all" (``_triton_common.axis_*``), every ``stride``-th launch.
    Capabilities this Triton cannot target are left out. Returns {caps, kernels, rows}."""
    import json

    from experiments.harness.child import child_env, module_cmd, run_child
    from experiments.harness.common import REPO_ROOT

    env = child_env({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (silences its warning)
    arg = json.dumps({"plan": {str(k): list(v) for k, v in plan.items()}, "workers": workers})
    run = run_child(module_cmd("experiments.harness.triton_aot", arg), env=env, cwd=REPO_ROOT, timeout=timeout)
    return run.check("ahead-of-time compilation").result


def _main(arg: str) -> dict:
    import json

    spec = json.loads(arg)
    caps = [c for c in map(int, spec["plan"]) if c in supported_archs()]
    rows = []
    for cap in caps:
        cover, stride = spec["plan"][str(cap)]
        rows += report_all(all_launches(_cover(cover))[::stride], [cap], workers=spec["workers"])
    return dict(caps=caps, kernels=sorted(kernel_names()), rows=rows)


if __name__ == "__main__":
    import sys

    from experiments.harness.child import emit_result

    emit_result(_main(sys.argv[1]))
