"""What the GPU scripts share (bench_dsa_gpu, bench_kernels, profile_step): device timing, the
device's copy bandwidth, the seed's embedding table and batches, GPT-style parameter sets for tests
of the step alone. Everything also runs on CPU tensors, for the scripts' ``--dry-run``."""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn as nn


def sync(dev):
    """Wait for the device (nothing on the CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def make_table(rows, dim, dtype, device, seed, scale):
    """A fresh table, identical for equal (rows, dim, seed, scale): uniform in ±scale."""
    g = torch.Generator(device=device).manual_seed(seed)
    emb = nn.Embedding(rows, dim, sparse=True, device=device, dtype=dtype)
    with torch.no_grad():
        emb.weight.copy_(((torch.rand(rows, dim, generator=g, device=device) * 2 - 1) * scale).to(dtype))
    return emb


def batches(rows, batch, n, device, seed):
    """``n`` batches of ``batch`` uniform random row indices, identical for equal arguments."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randint(0, rows, (batch,), generator=g).to(device) for _ in range(n)]


def quick_shapes(total):
    """~total elements in 16 matrices of 1024 columns plus vectors."""
    rows = max(1, total // (16 * 1024))
    return [(rows, 1024)] * 16 + [(1024,)] * 4


class Timer:
    """CUDA events on a GPU (device time of the enqueued work), wall clock on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def time(self, fn):
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            return (a, b)
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def ms(self, h):
        if self.cuda:
            torch.cuda.synchronize()
            return h[0].elapsed_time(h[1])
        return h * 1e3


def copy_bandwidth(device, timer, nbytes, reps):
    """Bytes read + written per second by a device-to-device copy (median of reps)."""
    n = nbytes // 4
    src = torch.empty(n, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    ts = [timer.ms(timer.time(lambda: dst.copy_(src))) for _ in range(reps)]
    return 2 * n * 4 / (statistics.median(ts) / 1e3)


def tensor_bytes(ts):
    """Bytes of the given tensors' elements."""
    return sum(t.numel() * t.element_size() for t in ts)


def script_device(dry_run: bool, script: str):
    """The device a GPU script runs on: the CPU for ``--dry-run`` (Triton interpreted: the variable is
    set here, before any kernel is imported), else CUDA; None, after saying so, where there is none."""
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print(f"[{script}] no CUDA device: this is a GPU check, nothing to measure here; exiting.")
        return None
    return torch.device("cuda")
