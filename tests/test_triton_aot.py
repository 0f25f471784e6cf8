"""Every Triton kernel compiled ahead of time for NVIDIA GPUs, without a GPU.

The interpreter (TRITON_INTERPRET=1) checks the kernels' arithmetic, not what the compiler sees:
compiled-mode typing, register spills, shared memory, occupancy. Each launcher's planning code lists
what it can choose as axes (``PLAN_AXES`` and ``launch_configs`` in each ``triton_ops.py``: tile
shapes, dtypes of weights, gradients and state, bits, flags); their product is the configuration
space (hundreds to thousands of kernels), too many to compile here, so a subprocess without the
interpreter compiles a covering set in which every value of every axis occurs (``axis_each``) for
sm_80 and sm_90, and every fourth of it for sm_100 (where this Triton ships the Blackwell ptxas),
each specialised exactly as ``kernel[grid](...)`` would be, then reads ``ptxas -v`` and the cubin
(``experiments/harness/triton_aot.py``). ``experiments/kernel_resources.py`` compiles every pair of axis values.

Asserted: every configuration compiles for every target; no register spills and shared memory
within the target's limit; the memory-bound kernels (DSA's Adam rows, Gefen's step and its factor's
statistics) keep at least half the warps of an sm_90 SM resident (their latency hiding); every
``*_kernel`` of the kernel modules is among the compiled ones; and a real (interpreted) launch of
each launcher uses constexprs that its enumeration lists, so the enumeration cannot drift from the
launchers.
"""

import pytest
import torch

from experiments.harness.triton_aot import reports
from optim._cache import BoundedCache
from optim._triton_common import axis_product

pytestmark = pytest.mark.slow  # ahead-of-time compiles for every target: minutes on 2 cores

MEMORY_BOUND = {"_adam_rows_kernel", "_gefen_step_kernel", "_gefen_step4_kernel", "_factor_stats_kernel"}


@pytest.fixture(scope="module")
def compiled():
    # sm_80 and sm_90: every configuration; sm_100 every fourth (each kernel), for the time budget
    return reports({80: ("each", 1), 90: ("each", 1), 100: ("each", 4)}, workers=2, timeout=900)


def test_every_configuration_compiles_for_every_target(compiled):
    assert {80, 90} <= set(compiled["caps"])
    errors = [f"{r['arch']} {r['config']}: {r['error'][-500:]}" for r in compiled["rows"] if "error" in r]
    assert not errors, "\n".join(errors)
    seen = {(r["kernel"], r["arch"]) for r in compiled["rows"]}
    want = {(k, f"sm_{c}") for k in compiled["kernels"] for c in compiled["caps"]}
    assert want <= seen, f"kernels never compiled: {sorted(want - seen)}"


def test_no_spills_and_shared_memory_within_limits(compiled):
    bad = [f"{r['arch']} {r['config']}: {r['spill_stores']} B spilled, {r['shared']} B shared "
           f"(limit {r['smem_limit']})" for r in compiled["rows"]
           if "error" not in r and (r["spill_stores"] or r["spill_loads"] or r["shared"] > r["smem_limit"])]
    assert not bad, "\n".join(bad)


def test_memory_bound_kernels_keep_half_an_sm90_resident(compiled):
    rows = [r for r in compiled["rows"] if r.get("arch") == "sm_90" and r["kernel"] in MEMORY_BOUND]
    assert {r["kernel"] for r in rows} == MEMORY_BOUND
    low = [f"{r['config']}: {r['regs']} registers x {r['num_warps']} warps -> {r['occupancy']:.2f} "
           f"({r['limiter']})" for r in rows if r["occupancy"] < 0.5]
    assert not low, "\n".join(low)


class _Recorder:
    """Stands in for a kernel: records the constexprs and options of each launch."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(kwargs)


def _listed(kernel, kwargs, launches):
    return any(la.kernel is kernel and la.kwargs == kwargs for la in launches)


def test_real_launches_use_enumerated_configurations(monkeypatch):
    """Widths, block lengths and dtypes other than the enumeration's representatives: what the
    launchers pass is in their enumeration (full product; for Gefen up to the block length and the
    codebook table, which are data), so the compiled set cannot drift from the launchers."""
    from optim.disk_sparse import triton_ops as dsa
    from optim.gefen import triton_ops as gefen
    from optim.gefen.codebook import code_table
    from optim.gefen.plan import Hyper, Tile

    hyper = Hyper(1, 1e-3, 0.9, 0.999, 1e-8, 0.0)
    dsa_all = dsa.launch_configs(axis_product)
    for name in ("_adam_rows_kernel", "_riemannian_adam_rows_kernel"):
        monkeypatch.setattr(dsa, name, _Recorder(getattr(dsa, name)))
    w, g, s = torch.zeros(5, 100, dtype=torch.bfloat16), torch.zeros(5, 100), torch.zeros(5, 200)
    dsa.adam_rows_(w, g, s, 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, maximize=True)
    dsa.riemannian_adam_rows_(w, g, torch.zeros(5, 101), 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                              c=1.0, exact=True)
    for name in ("_adam_rows_kernel", "_riemannian_adam_rows_kernel"):
        rec = getattr(dsa, name)
        assert len(rec.calls) == 1 and _listed(rec.kernel, rec.calls[0], dsa_all), (name, rec.calls)

    gefen_all = gefen.launch_configs(axis_product)
    monkeypatch.setattr(gefen, "_PLAN_CACHE", BoundedCache(1))  # a cached plan would hold the real kernels
    for name in ("_gefen_step_kernel", "_gefen_step4_kernel"):
        monkeypatch.setattr(gefen, name, _Recorder(getattr(gefen, name)))
    cb = torch.linspace(-1, 1, 16)
    for bits, block in ((8, 96), (4, 45)):
        n = block * 8
        p, gr = torch.zeros(n, dtype=torch.float16), torch.zeros(n)
        v, sc = torch.zeros(n // block), torch.zeros(n // block)
        codes = torch.zeros(n if bits == 8 else n // 2, dtype=torch.uint8)
        gefen.gefen_step_([Tile(p, v, sc, codes)], [gr], cb, hyper, block=block, bits=bits, tables=code_table(cb))
    for name in ("_factor_stats_kernel", "_factor_finalize_kernel"):
        monkeypatch.setattr(gefen, name, _Recorder(getattr(gefen, name)))
    block, n = 96, 96 * 8  # the factor's kernels: a block of masked lanes, bf16 gradients
    tile = Tile(torch.zeros(n), torch.zeros(n // block), torch.zeros(n // block), torch.zeros(n, dtype=torch.uint8),
                torch.zeros(block))
    gefen.gefen_step_([tile], [torch.zeros(n, dtype=torch.bfloat16)], cb, hyper, block=block, bits=8,
                      tables=code_table(cb))
    # capturable: the step scalars' kernel (a tensor lr read on the device, seeds), then a step reading them
    monkeypatch.setattr(gefen, "_gefen_hyper_kernel", _Recorder(gefen._gefen_hyper_kernel))
    sc = gefen.StepScalars([torch.zeros(())], [5], [None], "cpu")
    gefen.advance_(sc, lr=torch.tensor(1e-3), beta1=0.9, beta2=0.999, weight_decay=0.1)
    tile = Tile(torch.zeros(n), torch.zeros(n // block), torch.zeros(n // block), torch.zeros(n, dtype=torch.uint8))
    gefen.gefen_step_([tile], [torch.zeros(n)], cb, hyper._replace(step=None, lr=None), block=block, bits=8,
                      tables=code_table(cb), rows=sc.rows)
    # capturable with a bf16 factor: the step seeds of the factor written on the device, read at addresses
    sc = gefen.StepScalars([torch.zeros(())], [None], [None], "cpu", [7])
    gefen.advance_(sc, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.1)
    tile = Tile(torch.zeros(n), torch.zeros(n // block), torch.zeros(n // block), torch.zeros(n, dtype=torch.uint8),
                torch.zeros(block, dtype=torch.bfloat16))
    gefen.gefen_step_([tile], [torch.zeros(n)], cb, hyper._replace(step=None, lr=None), block=block, bits=8,
                      tables=code_table(cb), rows=sc.rows, factor_rows=sc.factor_rows)
    data = ("S", "BLOCK_V", "NLUT", "NCMP", "HAS_DUP")  # block length and codebook table: data
    listed = [(la.kernel, _without(la.kwargs, data)) for la in gefen_all]
    for name, calls in (("_gefen_step_kernel", 4), ("_gefen_step4_kernel", 1), ("_factor_stats_kernel", 2),
                        ("_factor_finalize_kernel", 2), ("_gefen_hyper_kernel", 2)):
        rec = getattr(gefen, name)
        assert len(rec.calls) == calls and all((rec.kernel, _without(c, data)) in listed for c in rec.calls), \
            (name, rec.calls)


def _without(kwargs, keys):
    return {k: v for k, v in kwargs.items() if k not in keys}
