"""experiments/gefen_speed.py at its smallest and experiments/harness/op_count.py's counting.

The counter must see every torch operation issued outside a Triton launch (views apart from device
operations, host reads as syncs) and every launch once, none of the operations the interpreter runs
inside a launch, and leave Triton as it found it. The benchmark's CPU and count parts write
well-formed rows whose ratios restate its medians, and its GPU part runs end to end on CPU tensors
(``--dry-run``), as experiments/gpu_checks_rehearsal.sh runs it.
"""

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.harness.common import FIELDS, read_results

REPO = Path(__file__).resolve().parents[1]


def _rows(path):
    with open(path, newline="") as f:
        assert next(csv.reader(f)) == FIELDS
    rows = read_results(path)
    assert rows and all(r["experiment"] == "gefen_speed" and (math.isfinite(r["value"]) or r["metric"] == "skipped")
                        for r in rows)
    return rows


def _by(rows):
    out = {}
    for r in rows:
        key = (r["variant"], r["metric"], r["x_value"])
        assert key not in out, f"two rows for {key}"
        out[key] = r["value"]
    return out


def test_op_count_counts_ops_outside_launches_and_launches_once():
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    from experiments.harness.op_count import OpCount

    @triton.jit
    def _add_one_kernel(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)

    run_before = JITFunction.__dict__["run"]
    x = torch.zeros(10)
    with OpCount() as c:
        y = x * 2  # one device op
        _add_one_kernel[(1,)](x, 10, BLOCK=16)  # a launch: what the interpreter does inside is not counted
        _add_one_kernel[(1,)](x, 10, BLOCK=16)
        x.view(2, 5)  # a view: an aten op, no device op
        total = x.sum().item()  # a device op, then a host read (a device op and a sync)
    assert torch.equal(x, torch.full((10,), 2.0)) and total == 20.0 and torch.equal(y, torch.zeros(10))
    assert c.launches == 2 and dict(c.kernels) == {"_add_one_kernel": 2}
    assert c.device_ops == 3 and c.host_syncs == 1, c.ops
    assert c.ops["aten::view"] == 1 and c.aten_ops == 4
    assert JITFunction.__dict__["run"] is run_before, "OpCount left Triton patched"
    with OpCount() as d:
        pass
    assert d.summary()["launches"] == d.summary()["aten_ops"] == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gefen_speed_smallest_run_and_its_figure(tmp_path):
    from experiments import gefen_speed

    names = ["AdamW", "Gefen-8bit", "Gefen-8bit-factored"]
    threads = torch.get_num_threads()
    assert gefen_speed.main(["--quick", "--parts", "cpu", "count", "--models", "small-tensors", "--optimizers", *names,
                             "--threads", "1,2", "--repeats", "1", "--count-tensors", "8", "16", "--count-steps", "2",
                             "--count-optimizers", *names, "--wandb", "disabled", "--results-dir", str(tmp_path)]) == 0
    assert torch.get_num_threads() == threads
    rows = _rows(tmp_path / "gefen_speed.csv")
    by = _by(rows)
    cpu = [r for r in rows if r["x_name"] == "threads"]
    assert {r["variant"] for r in cpu} == {f"small-tensors/{n}" for n in names}
    assert {r["x_value"] for r in cpu} == {1, 2}
    assert {r["metric"] for r in cpu} == {"step_time_median", "step_time_vs_adamw", "step_time_vs_unfactored",
                                          "threads", "host_us_per_tensor", "ns_per_param", "bytes_floor",
                                          "gbps_effective"}
    # AdamW's floor: weights read and written, gradient read, two fp32 moments read and written
    # (its step counters, 4 bytes a tensor, besides)
    assert by[("small-tensors/AdamW", "bytes_floor", 1)] == pytest.approx(28, rel=1e-3)
    for t in (1, 2):
        adamw = by[("small-tensors/AdamW", "step_time_median", t)]
        assert by[("small-tensors/AdamW", "step_time_vs_adamw", t)] == 1.0
        assert by[("small-tensors/Gefen-8bit", "threads", t)] == t
        for n in names:
            med = by[(f"small-tensors/{n}", "step_time_median", t)]
            assert by[(f"small-tensors/{n}", "step_time_vs_adamw", t)] == pytest.approx(med / adamw)
            assert by[(f"small-tensors/{n}", "host_us_per_tensor", t)] == pytest.approx(med / 160 * 1e6)
            assert by[(f"small-tensors/{n}", "ns_per_param", t)] == pytest.approx(med / 171520 * 1e9)
            assert by[(f"small-tensors/{n}", "gbps_effective", t)] == pytest.approx(
                by[(f"small-tensors/{n}", "bytes_floor", t)] * 171520 / med / 1e9)
        assert by[("small-tensors/Gefen-8bit-factored", "step_time_vs_unfactored", t)] == pytest.approx(
            by[("small-tensors/Gefen-8bit-factored", "step_time_median", t)] / by[("small-tensors/Gefen-8bit", "step_time_median", t)])
    counts = [r for r in rows if r["x_name"] == "tensors"]
    assert {(r["variant"], r["x_value"]) for r in counts} == {(n, k) for n in names for k in (8, 16)}
    assert {r["metric"] for r in counts} == {"device_ops_per_step", "launches_per_step", "aten_ops_per_step",
                                             "host_syncs_per_step"}
    assert all(r["value"] >= 0 and r["value"] == int(r["value"]) for r in counts)
    for k in (8, 16):
        assert by[("AdamW", "launches_per_step", k)] == 0 and by[("AdamW", "device_ops_per_step", k)] >= 1
        assert by[("Gefen-8bit", "launches_per_step", k)] >= 1  # the Triton path launched its kernels
        assert by[("Gefen-8bit", "aten_ops_per_step", k)] >= by[("Gefen-8bit", "device_ops_per_step", k)]

    out = tmp_path / "gefen_speed.png"
    proc = subprocess.run([sys.executable, str(REPO / "analysis" / "gefen_speed.py"), "--results-dir", str(tmp_path),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    section = (tmp_path / "README.md").read_text()
    assert "no verdicts" in section and "(target" not in section  # a quick run judges nothing


@pytest.mark.timeout(300)
def test_gefen_speed_offload_part_at_its_smallest(tmp_path):
    """The offload part's rows on a tiny GPT-2 set: the triad's bandwidth, both gradient dtypes,
    AdamW's bf16 rows with the cast's bytes, gefen-x left out with its reason, and no tensor
    memory allocated by Gefen's step after the first with either gradient dtype."""
    from experiments import gefen_speed

    names = ["AdamW", "Gefen-8bit"]
    assert gefen_speed.main(["--quick", "--parts", "offload", "--offload-optimizers", *names, "--threads", "1",
                             "--offload-repeats", "1", "--wandb", "disabled", "--results-dir", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "gefen_speed.csv")
    by = _by(rows)
    assert by[("memory/triad", "bandwidth", 1)] > 0
    sets = {r["variant"].split("/")[0] for r in rows if r["metric"] == "step_time_median"}
    assert sets == {"offload-gpt2-d64-fp32", "offload-gpt2-d64-bf16"}
    n = by[("offload-gpt2-d64-fp32/AdamW", "params", 1)]
    assert n == sum(torch.Size(s).numel() for s in gefen_speed.gpt2_shapes(64, 2, vocab=512, ctx=64))
    for s in sets:
        for name in names:
            med = by[(f"{s}/{name}", "step_time_median", 1)]
            assert by[(f"{s}/{name}", "ns_per_param", 1)] == pytest.approx(med / n * 1e9)
            assert by[(f"{s}/{name}", "floor_ns_per_param", 1)] == pytest.approx(
                by[(f"{s}/{name}", "bytes_floor", 1)] / by[("memory/triad", "bandwidth", 1)])
    # fp32: 28 B; bf16: the gradient read as bf16 (2 B), plus the cast's fp32 write and read (8 B)
    assert by[("offload-gpt2-d64-fp32/AdamW", "bytes_floor", 1)] == pytest.approx(28, rel=1e-3)
    assert by[("offload-gpt2-d64-bf16/AdamW", "bytes_floor", 1)] == pytest.approx(34, rel=1e-3)
    assert by[("offload-gpt2-d64-bf16/Gefen-8bit", "transient_bytes", "")] == 0
    assert by[("offload-gpt2-d64-fp32/Gefen-8bit", "transient_bytes", "")] == 0
    reasons = {r["variant"]: r["unit"] for r in rows if r["metric"] == "skipped"}
    assert reasons == {"offload-gpt2-d64/gefen-x": gefen_speed.OFFLOAD_LEFT_OUT["gefen-x"]}


@pytest.mark.timeout(300)
def test_gefen_speed_gpu_part_dry_run(tmp_path):
    from experiments import gefen_speed

    names = ["AdamW", "Gefen-8bit", "Gefen-8bit-factored"]
    assert gefen_speed.main(["--parts", "gpu", "--dry-run", "--gpu-optimizers", *names, "--count-optimizers",
                             "Gefen-8bit", "--wandb", "disabled", "--results-dir", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "gefen_speed.csv")
    by = _by(rows)
    gpu = [r for r in rows if r["x_name"] == "params"]
    n = gpu[0]["x_value"]
    assert {r["variant"] for r in gpu} == {f"gpt2-tiny/{name}" for name in names}
    assert by[("gpt2-tiny/AdamW", "step_time_vs_adamw", n)] == 1.0
    for name in names:
        for metric in ("step_time_median", "host_time_median", "host_us_per_tensor"):
            assert by[(f"gpt2-tiny/{name}", metric, n)] > 0
    assert ("gpt2-tiny/Gefen-8bit-factored", "step_time_vs_unfactored", n) in by
    assert by[("cpu/Gefen-8bit", "launches_per_step", 8)] >= 1


def test_deepspeed_cpu_adam_refuses_gradients_of_another_dtype_and_steps_as_adamw():
    """DeepSpeed's CPU-Adam reads a gradient as its parameter's dtype: the registry's wrapper refuses a
    bf16 gradient of an fp32 parameter (untouched), and on fp32 gradients steps as torch's AdamW."""
    pytest.importorskip("deepspeed")
    from experiments.harness.registry import make_optimizer

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 48))
    q = torch.nn.Parameter(p.detach().clone())
    p.grad_dtype = None
    ours, ref = make_optimizer("deepspeed-CPUAdam", [p], 1e-2, 0.1), torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1)
    p.grad = torch.randn(64, 48).to(torch.bfloat16)
    before = p.detach().clone()
    with pytest.raises(TypeError, match="gradient of a torch.float32 parameter"):
        ours.step()
    assert torch.equal(p.detach(), before)
    for _ in range(5):
        g = torch.randn(64, 48)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
