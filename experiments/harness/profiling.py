"""Where a step's time goes, from ``torch.profiler``: host operations, device kernels and copies,
launches and the host's waits, per step.

    prof = profile_steps(lambda: opt.step(), steps=5, device=torch.device("cuda"))
    print(format_profile("Gefen-8bit fp32 124M", prof, kernel_bytes={"_gefen_step": 1.7e9}))

``profile_steps`` runs ``step`` a few times under the profiler (CPU activity, and CUDA's where the
device is a GPU) and reduces the events to per-step figures:

* host operations by self time (aten operators, the CUDA runtime and driver calls, Python-side
  ``record_function`` ranges), with calls per step;
* device operations by time (kernels, copies, fills), with calls per step, and the device's busy
  time per step (the union of their intervals, so overlapping streams count once);
* launches per step (kernels seen on the device) and copies per step by direction;
* waits: the runtime calls that block the host until the device catches up
  (``*Synchronize``, blocking ``cudaMemcpy``), their count and time per step.

``format_profile`` writes a short text report; with ``kernel_bytes`` ({substring of kernel names:
bytes their calls move in one step}) it adds each kernel family's achieved bandwidth. On a CPU the device part
is empty: the script that calls it still runs end to end (``--dry-run``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

# runtime and driver calls during which the host waits for the device
WAIT_CALLS = ("Synchronize",)
BLOCKING_COPIES = ("cudaMemcpy", "cuMemcpy", "cuMemcpyDtoH", "cuMemcpyHtoD")
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cudaLaunchCooperativeKernel")


@dataclass
class Op:
    """One operation name's totals per profiled step."""
    name: str
    ms: float
    calls: float


@dataclass
class StepProfile:
    steps: int
    host_ms: float                     # host wall time per step (no synchronisation added)
    host_ops: list[Op] = field(default_factory=list)
    device_ops: list[Op] = field(default_factory=list)
    waits: list[Op] = field(default_factory=list)
    copies: dict[str, Op] = field(default_factory=dict)
    launches: float = 0.0              # device kernels per step
    launch_calls: float = 0.0          # host launch calls per step (runtime, driver, graph)
    device_busy_ms: float = 0.0        # union of device intervals per step

    @property
    def wait_ms(self) -> float:
        return sum(op.ms for op in self.waits)

    @property
    def wait_calls(self) -> float:
        return sum(op.calls for op in self.waits)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_wait(name: str) -> bool:
    return any(w in name for w in WAIT_CALLS) or name in BLOCKING_COPIES


def _copy_kind(name: str) -> str | None:
    """"HtoD", "DtoH", "DtoD", "Memset" for the device's copy and fill records, else None."""
    if name.startswith("Memset"):
        return "Memset"
    if name.startswith("Memcpy"):
        for kind in ("HtoD", "DtoH", "DtoD", "PtoP", "HtoH"):
            if kind in name:
                return kind
        return "Memcpy"
    return None


def _union_us(intervals) -> float:
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _ops(totals: dict[str, list[float]], steps: int) -> list[Op]:
    ops = [Op(name, us / 1e3 / steps, n / steps) for name, (us, n) in totals.items()]
    return sorted(ops, key=lambda op: op.ms, reverse=True)


def profile_steps(step, steps: int, device, warmup: int = 1) -> StepProfile:
    """Run ``step()`` ``warmup`` times, then ``steps`` times under ``torch.profiler``; per-step figures."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    for _ in range(warmup):
        step()
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    host = []
    with profile(activities=activities) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            host.append(time.perf_counter() - t0)
        _sync(device)
    host_totals, dev_totals, copy_totals = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0]), {}
    intervals, launch_calls = [], 0
    for ev in prof.events():
        if ev.device_type == DeviceType.CPU:
            t = host_totals[ev.name]
            t[0] += ev.self_cpu_time_total
            t[1] += 1
            launch_calls += ev.name in LAUNCH_CALLS
        else:
            us = ev.time_range.elapsed_us()
            intervals.append((ev.time_range.start, ev.time_range.end))
            t = dev_totals[ev.name]
            t[0] += us
            t[1] += 1
            kind = _copy_kind(ev.name)
            if kind is not None:
                c = copy_totals.setdefault(kind, [0.0, 0])
                c[0] += us
                c[1] += 1
    host_ops = _ops(host_totals, steps)
    device_ops = _ops(dev_totals, steps)
    kernels = sum(op.calls for op in device_ops if _copy_kind(op.name) is None)
    return StepProfile(
        steps=steps, host_ms=1e3 * sum(host) / steps, host_ops=host_ops, device_ops=device_ops,
        waits=[op for op in host_ops if _is_wait(op.name)],
        copies={k: Op(k, us / 1e3 / steps, n / steps) for k, (us, n) in copy_totals.items()},
        launches=kernels, launch_calls=launch_calls / steps,
        device_busy_ms=_union_us(intervals) / 1e3 / steps)


def kernel_bandwidth(prof: StepProfile, kernel_bytes: dict[str, float]) -> list[tuple[str, float, float, float]]:
    """(key, calls per step, ms per step, GB/s) for each key of ``kernel_bytes`` ({substring of kernel
    names: bytes all matching calls of one step read or write}) that matches a device kernel."""
    out = []
    for key, nbytes in kernel_bytes.items():
        ops = [op for op in prof.device_ops if key in op.name]
        ms = sum(op.ms for op in ops)
        if ops and ms > 0:
            out.append((key, sum(op.calls for op in ops), ms, nbytes / (ms / 1e3) / 1e9))
    return out


def _short(name: str, width: int = 64) -> str:
    return name if len(name) <= width else name[:width - 1] + "…"


def format_profile(title: str, prof: StepProfile, kernel_bytes: dict[str, float] | None = None,
                   top: int = 10, copy_bandwidth: float | None = None) -> str:
    """A short text report of one profile (see the module's docstring)."""
    lines = [f"## {title}",
             f"per step, mean of {prof.steps} profiled steps: host {prof.host_ms:.3f} ms "
             f"(under the profiler), device busy {prof.device_busy_ms:.3f} ms, host waiting "
             f"{prof.wait_ms:.3f} ms in {prof.wait_calls:g} call(s); {prof.launches:g} kernel(s) "
             f"launched ({prof.launch_calls:g} launch call(s) on the host)"]
    if prof.copies:
        lines.append("copies and fills per step: " + ", ".join(
            f"{k} {op.calls:g} ({op.ms:.3f} ms)" for k, op in sorted(prof.copies.items())))
    else:
        lines.append("copies and fills per step: none seen on a device")
    if prof.waits:
        lines.append("waits: " + ", ".join(f"{op.name} x{op.calls:g} {op.ms:.3f} ms" for op in prof.waits))
    lines.append("top host operations by self time (ms/step, calls/step):")
    lines += [f"  {op.ms:9.3f}  {op.calls:6g}  {_short(op.name)}" for op in prof.host_ops[:top]]
    if prof.device_ops:
        lines.append("top device operations by time (ms/step, calls/step):")
        lines += [f"  {op.ms:9.3f}  {op.calls:6g}  {_short(op.name)}" for op in prof.device_ops[:top]]
    if kernel_bytes:
        bw = kernel_bandwidth(prof, kernel_bytes)
        if bw:
            lines.append("achieved bandwidth per kernel family (each operand's bytes once, read + written):")
            for key, calls, ms, gbs in bw:
                frac = f" = {gbs * 1e9 / copy_bandwidth:.2f} of copy" if copy_bandwidth else ""
                lines.append(f"  {key:28s} {calls:4g} call(s) {ms:8.3f} ms/step {gbs:8.1f} GB/s{frac}")
    return "\n".join(lines) + "\n"
