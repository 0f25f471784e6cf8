"""experiments/harness/profiling.py reduces a torch.profiler trace to per-step figures: checked against what a
step is known to do (counted by hand in the test) and against brute force for the interval union."""

import random

import pytest
import torch

from experiments.harness.profiling import Op, StepProfile, _union_us, format_profile, kernel_bandwidth, profile_steps


def test_host_operations_are_counted_per_step():
    x = torch.randn(64, 64)

    def step():
        for _ in range(3):
            torch.add(x, 1.0)
        torch.mm(x, x)

    prof = profile_steps(step, steps=4, device="cpu", warmup=1)
    calls = {op.name: op.calls for op in prof.host_ops}
    assert calls["aten::add"] == 3 and calls["aten::mm"] == 1
    assert prof.host_ms > 0 and prof.steps == 4
    # a CPU run has no device part and no waits
    assert prof.device_ops == [] and prof.launches == 0 and prof.wait_ms == 0 and prof.device_busy_ms == 0
    text = format_profile("cpu", prof)
    assert "aten::add" in text and "none seen on a device" in text


@pytest.mark.parametrize("seed", range(5))
def test_union_of_intervals_matches_brute_force(seed):
    rng = random.Random(seed)
    ivs = []
    for _ in range(rng.randint(1, 30)):
        a = rng.randint(0, 200)
        ivs.append((a, a + rng.randint(0, 40)))
    covered = {t for a, b in ivs for t in range(a, b)}  # unit cells [t, t+1)
    assert _union_us(ivs) == len(covered)


def test_kernel_bandwidth_sums_each_family_over_its_calls():
    prof = StepProfile(steps=1, host_ms=1.0, device_ops=[
        Op("triton_poi__gefen_step_kernel_0", 2.0, 3), Op("_gefen_step4_kernel", 1.0, 1),
        Op("_factor_stats_kernel", 0.5, 2), Op("Memcpy HtoD", 0.1, 1)])
    bw = {k: (calls, ms, gbs) for k, calls, ms, gbs in
          kernel_bandwidth(prof, {"_gefen_step": 3e9, "_factor_stats_kernel": 1e9, "absent": 1.0})}
    assert bw["_gefen_step"] == (4, 3.0, pytest.approx(3e9 / 3e-3 / 1e9))
    assert bw["_factor_stats_kernel"] == (2, 0.5, pytest.approx(1e9 / 0.5e-3 / 1e9))
    assert "absent" not in bw
