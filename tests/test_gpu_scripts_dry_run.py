"""The GPU scripts run end to end on the CPU (``--dry-run``: tiny sizes, Triton under
TRITON_INTERPRET=1), so a first run on a lent GPU cannot fail on the scripts' own code.

Each writes its CSV under ``--results-dir`` in docs/DESIGN.md's columns with every variant and metric of a
real run (device memory, which only CUDA reports, aside), and the agreements it measures hold: the
staged and direct DSA paths equal bit for bit, DSA's Triton path within fp32 rounding of its torch
path and of ``torch.optim.SparseAdam``, Gefen's Triton codes equal to its torch backend's.
"""

import importlib.util
import json
import math

import pytest

from experiments.harness.common import FIELDS, read_results


def _rows(path):
    rows = read_results(path)
    assert rows and set(FIELDS) <= set(rows[0])
    assert all(math.isfinite(r["value"]) for r in rows)
    return rows


def _get(rows, variant, metric):
    hit = [r["value"] for r in rows if r["variant"] == variant and r["metric"] == metric]
    assert len(hit) == 1, (variant, metric, hit)
    return hit[0]


@pytest.mark.timeout(300)
def test_bench_dsa_gpu_dry_run(tmp_path):
    from experiments import bench_dsa_gpu

    assert bench_dsa_gpu.main(["--dry-run", "--wandb", "disabled", "--results-dir", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "dsa_gpu.csv")
    names = ["ceiling", "SparseAdam", "DiskSparseAdam", "DiskSparseAdam/direct", "DiskSparseRiemannianAdam"]
    for name in names:
        assert _get(rows, name, "throughput") > 0
        _get(rows, name, "device_memory_over_weights")
    for name in ("DiskSparseAdam", "DiskSparseRiemannianAdam"):
        assert _get(rows, name, "prefetch_hit_rate") > 0  # the staged path used announced rows
        for dtype in ("float32", "bfloat16"):
            v = f"{name}/{dtype}"
            assert _get(rows, v, "max_abs_diff_weights_staged_vs_direct") == 0
            assert _get(rows, v, "max_abs_diff_state_staged_vs_direct") == 0
            assert _get(rows, v, "max_abs_diff_weights_triton_vs_torch") <= 1e-6
            assert _get(rows, v, "max_abs_diff_state_triton_vs_torch") <= 1e-6
    assert _get(rows, "DiskSparseAdam/float32", "max_abs_diff_weights_triton_vs_SparseAdam") <= 1e-6
    assert _get(rows, "DiskSparseAdam/float32", "max_abs_diff_state_triton_vs_SparseAdam") <= 1e-6
    for name in names:  # where the time goes: on a CPU the host does everything and never waits
        assert _get(rows, name, "host_time_per_step") > 0
        assert _get(rows, name, "device_time_per_step") == 0
        assert _get(rows, name, "host_wait_per_step") == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_kernels_dry_run(tmp_path):
    from experiments import bench_kernels

    assert bench_kernels.main(["--dry-run", "--wandb", "disabled", "--results-dir", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "gefen_kernels.csv")
    assert _get(rows, "copy", "bandwidth") > 0
    for dtype in ("fp32", "bf16"):
        for name in ("Gefen-8bit", "Gefen-8bit/kernel", "Gefen-8bit/kernel-t4096w8", "Gefen-4bit", "AdamW"):
            for metric in ("state_bytes", "floor_bytes", "floor_time", "step_time", "bandwidth", "frac_of_copy"):
                assert _get(rows, f"{name}/{dtype}", metric) >= 0
        assert _get(rows, f"AdamW/{dtype}", "state_bytes") == (8 if dtype == "fp32" else 4)
        _get(rows, f"Gefen-8bit/{dtype}", "speedup_vs_AdamW")
        assert _get(rows, f"triton-vs-torch/{dtype}", "agree_codes_equal") == 1
        assert _get(rows, f"triton-vs-torch/{dtype}", "agree_rel_rms_p") <= 1e-6
    config = json.loads((tmp_path / "gefen_kernels.config.json").read_text())["config"]
    if importlib.util.find_spec("flashoptim") is None:  # a peer that cannot run is reported with its reason
        assert "flashoptim" in config["unavailable"]["flashoptim-AdamW/fp32"]
        assert not any(r["variant"].startswith("flashoptim") for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_profile_step_dry_run(tmp_path):
    from experiments import profile_step

    assert profile_step.main(["--dry-run", "--results-dir", str(tmp_path)]) == 0
    dsa = (tmp_path / "dsa_profile.txt").read_text()
    for name in profile_step.DSA_VARIANTS:
        assert f"## {name}\n" in dsa
    assert "Optimizer.step#DiskSparseAdam.step" in dsa and "Optimizer.step#SparseAdam.step" in dsa
    gefen = (tmp_path / "gefen_profile.txt").read_text()
    for name in profile_step.GEFEN_VARIANTS:
        for dtype in ("fp32", "bf16"):
            assert f"## {name} {dtype}\n" in gefen


@pytest.mark.parametrize("bits", [8, 4])
def test_traffic_model_counts_the_state_gefen_keeps(bits):
    """kernel_resources' Gefen bytes restated from a real optimizer: on gradients whose scale
    differs per row (as bench_kernels makes them) Gefen chooses the block lengths the model assumes,
    and the state it keeps (v, scales, codes) is the model's state traffic each way."""
    import torch

    from experiments.kernel_resources import gefen_block, gefen_traffic
    from optim import Gefen
    from optim.gefen import state as K

    shapes = [(64, 96), (96,), (96, 288), (384, 96), (2304, 2048)]
    params = [torch.nn.Parameter(torch.randn(sh) * 0.02) for sh in shapes]
    for p in params:
        g = torch.randn(p.shape)
        p.grad = g * torch.randn(p.shape[0], 1).mul(0.7).exp() if p.dim() == 2 else g
    opt = Gefen(params, lr=1e-3, bits=bits, layout="published", backend="torch")
    opt.step()
    assert [opt.state[p][K.BLOCK] for p in params] == [gefen_block(sh) for sh in shapes]
    state = sum(opt.state[p][k].numel() * opt.state[p][k].element_size()
                for p in params for k in (K.V, K.SCALES, K.CODES))
    n = sum(p.numel() for p in params)
    model = gefen_traffic(shapes, 4, bits)
    assert model["written"] == 4 * n + state and model["read"] == 8 * n + state
