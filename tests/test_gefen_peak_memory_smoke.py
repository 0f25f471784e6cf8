"""experiments/gefen_peak_memory.py and its analysis, small: one worker process measures AdamW's peaks
as the tracker's split says they must be, the analysis turns a synthetic CSV into its figure and
section with the verdicts that CSV implies, and gefen-x (where it is installed) loads beside upstream
gefen without replacing it. (The budget search: tests/test_harness.py; the budgets and the ranks:
tests/test_gefen_budgets_smoke.py, tests/test_gefen_distributed_smoke.py.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.harness.measured_step import LEAN
from experiments.harness.registry import GEFEN_X_DIR
from tests.utils import write_results

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_one_worker_measures_adamw_peaks():
    """AdamW on a 3-layer MLP: 4 B of weights, 4 of gradients and 8 of state a parameter at the peak."""
    spec = dict(task="peaks", config="AdamW", seed=0,
                jobs=[dict(model=dict(kind="mlp", width=128, depth=3), micro_batch=8, name="mlp")])
    out = subprocess.run([sys.executable, "-m", "experiments.gefen_peak_memory", "--worker", json.dumps(spec)],
                         capture_output=True, text=True, timeout=110, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    (res,) = json.loads(line[len("RESULT "):])["results"]
    assert res["params"] == 3 * (128 * 128 + 128)
    later = res["steps"][-1]
    assert later["weights_per_param"] == pytest.approx(4.0)
    assert later["state_per_param"] == pytest.approx(8.0, rel=1e-3)
    assert later["tensor_peak_per_param"] >= 16.0
    assert res["state_bytes_per_param"] == pytest.approx(8.0, rel=1e-3)


def peak_rows(lean_peak=4.0):
    """Peaks of five optimizers on two models (the lean mode's first step 0.25 above its later ones)."""
    rows = []
    peaks = {"AdamW": (16.0, 16.1), "AdamW+bf16": (8.0, 8.1), "torchao-AdamW8bit": (10.0, 10.1),
             "Gefen-8bit": (9.0, 9.05), LEAN: (lean_peak + 0.25, lean_peak)}
    for model, mb in (("mlp-50.4M", 8), ("gpt-12.7M", 4)):
        for name, (first, later) in peaks.items():
            v = f"{model}/mb{mb}/{name}"
            for step in range(4):
                total = first if step == 0 else later
                split = dict(weights=4.0 if "bf16" not in name else 2.0, gradients=2.0, state=1.0)
                split["rest"] = total - sum(split.values())
                for part, x in split.items():
                    rows.append((v, f"{part}_per_param", x, "step", step))
                rows += [(v, "tensor_peak_per_param", total, "step", step),
                         (v, "transient_per_param", split["rest"], "step", step),
                         (v, "rss_peak_per_param", total + 1, "step", step),
                         (v, "rss_total_per_param", total + 2, "step", step)]
            rows += [(v, "state_bytes_per_param", 1.0, "steps", 4), (v, "params", 5e7, "steps", 4),
                     (v, "largest_tensor_bytes", 1.6e7, "steps", 4), (v, "baseline_rss_bytes", 4e8, "steps", 4)]
    return rows


CONFIG = {"config": {"target_model": "mlp-50.4M", "notes": ["a note"]}, "git_commit": "abc1234",
          "command": "python experiments/gefen_peak_memory.py --quick", "wall_seconds": 60.0}


@pytest.mark.parametrize("lean_peak, met", [(4.0, True), (6.0, False)])
def test_analysis_writes_figure_and_verdicts(tmp_path, lean_peak, met):
    from analysis.common import main, read_section
    from analysis.gefen_peak_memory import REPORT

    write_results(tmp_path, "gefen_peak_memory", peak_rows(lean_peak), CONFIG)
    out = tmp_path / "fig.png"
    main(REPORT, ["--results-dir", str(tmp_path), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    section = read_section(tmp_path / "README.md", "gefen_peak_memory")
    lines = {ln.split(" ", 2)[1]: ln for ln in section.splitlines() if ln.startswith("- (")}
    word = "**met**" if met else "**missed**"
    assert f"tensor peak {lean_peak + 0.25:.2f} B/param" in lines["(ii)"] and word in lines["(ii)"]
    # Gefen-8bit (9.05 later) is above no fp32 peer but torchao's 10: lowest among fp32 peers
    gefen = next(ln for ln in section.splitlines() if ln.startswith("- (i) Gefen-8bit "))
    assert "lowest peak at every step **met**" in gefen
    assert "a note" in section


@pytest.mark.skipif(not (GEFEN_X_DIR / "gefen").is_dir(), reason="gefen-x is not installed in third_party/gefen_x")
def test_gefen_x_loads_beside_upstream_gefen():
    code = ("import gefen, sys; from experiments.harness.registry import gefen_x, make_optimizer; import torch;"
            "gx = gefen_x(); assert sys.modules['gefen'] is gefen and gx is not gefen;"
            "assert gx.Gefen.__module__ == 'gefen_x.gefen';"
            "assert not any(m.startswith('gefen.') and 'gefen_x' in (getattr(sys.modules[m], '__file__', '') or '')"
            " for m in sys.modules);"
            "opt = make_optimizer('gefen-x', torch.nn.Linear(8, 8), 1e-3); print(type(opt).__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("gefen_x.gefen")
