"""experiments/gefen_budgets.py and its analysis, small: a worker trains a small MLP's steps (and, where
memory cgroups can be made, is killed for memory in a budget too small for it), the searches start
where the peaks' CSV predicts, and the analysis turns a synthetic CSV into its figure and section
with the verdict that CSV implies. (The search itself: tests/test_harness.py.)"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.harness import budget
from experiments.harness.measured_step import LEAN
from experiments.harness.memcg import cgroups_usable
from tests.utils import write_results

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(kind="mlp", width=128, depth=3)


@pytest.mark.timeout(120)
def test_one_worker_trains_the_fit_steps():
    spec = dict(task="fit", config="AdamW", model=SMALL, micro_batch=8, seed=0)
    out = subprocess.run([sys.executable, "-m", "experiments.gefen_budgets", "--worker", json.dumps(spec)],
                         capture_output=True, text=True, timeout=110, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    assert json.loads(line[len("RESULT "):]) == {"ok": True}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not cgroups_usable(), reason="memory cgroups need root and the cgroup v1 memory controller")
def test_a_trial_fits_a_large_budget_and_is_killed_in_a_small_one():
    from experiments.harness.measured_step import fit_trial

    code, peak, why = fit_trial("experiments.gefen_budgets", "AdamW", SMALL, 8, 1.0, 0, 110)
    assert (code, why) == (1, None) and peak > 0
    wide = dict(kind="mlp", width=1024, depth=4)  # 16 MiB of weights, 64 MiB with gradients and AdamW's state
    code, peak, why = fit_trial("experiments.gefen_budgets", "AdamW", wide, 8, 32 / 1024, 0, 110)
    assert (code, why) == (0, None)


def test_searches_start_where_the_peaks_csv_predicts(tmp_path):
    assert budget.read_peaks(tmp_path) == {}
    assert budget.micro_batch_start({}, "gpt-1.0M", "AdamW", 0.5) == budget.GUESS["micro_batch"]
    assert budget.width_start({}, "AdamW", 0.5, 12) == budget.GUESS["width"]
    rows = []
    for mb, peak in ((4, 20.0), (16, 32.0)):  # 1e6 parameters: 20 MB at 4, 32 MB at 16 -> 1 MB a sample
        rows += [(f"gpt-1.0M/mb{mb}/AdamW", "tensor_peak_per_param", p, "step", s) for s, p in enumerate((peak, 1.0))]
        rows.append((f"gpt-1.0M/mb{mb}/AdamW", "params", 1e6, "steps", 2))
    for name, params, bpp in (("mlp-1.0M", 1e6, 99.0), ("mlp-2.0M", 2e6, 16.0)):  # the largest MLP counts
        rows += [(f"{name}/mb8/AdamW", "rss_total_per_param", bpp, "step", 0), (f"{name}/mb8/AdamW", "params", params,
                                                                                 "steps", 1)]
    write_results(tmp_path, "gefen_peak_memory", rows, {})
    peaks = budget.read_peaks(tmp_path)
    assert peaks[("gpt-1.0M", 16, "AdamW")] == dict(params=1_000_000, tensor_peak=[32.0, 1.0], rss_total=[])
    assert budget.micro_batch_start(peaks, "gpt-1.0M", "AdamW", 0.5) == pytest.approx(0.85 * (2**29 - 16e6) / 1e6)
    assert budget.width_start(peaks, "AdamW", 0.5, 12) == pytest.approx(math.sqrt(2**29 / 16.0 / 12))
    assert budget.micro_batch_start(peaks, "gpt-1.0M", "Gefen-8bit", 0.5) == budget.GUESS["micro_batch"]


def budget_rows(lean_params=3e8):
    rows = []
    for name, params, mb in (("AdamW", 3e7, 30), ("Gefen-8bit", 6e7, 40), (LEAN, lean_params, 55)):
        rows += [(f"model/{name}", "largest_model_params", params, "budget_GiB", 0.5),
                 (f"micro_batch/{name}", "largest_micro_batch", mb, "budget_GiB", 0.5),
                 (f"model@0.5GiB/{name}", "fits", 1, "params", params)]
    return rows


@pytest.mark.parametrize("lean_params, met", [(3e8, True), (6e7, False)])
def test_analysis_writes_figure_and_verdicts(tmp_path, lean_params, met):
    from analysis.common import main, read_section
    from analysis.gefen_budgets import REPORT

    config = {"config": {"notes": ["a budget note"]}, "git_commit": "abc1234",
              "command": "python experiments/gefen_budgets.py --quick", "wall_seconds": 60.0}
    write_results(tmp_path, "gefen_budgets", budget_rows(lean_params), config)
    out = tmp_path / "fig.png"
    main(REPORT, ["--results-dir", str(tmp_path), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    section = read_section(tmp_path / "README.md", "gefen_budgets")
    word = "**met**" if met else "**missed**"
    ratio = [ln for ln in section.splitlines() if ln.startswith(f"- (iii) {LEAN}")]
    assert ratio and word in ratio[0] and f"{lean_params / 3e7:.3g}×" in ratio[0]
    assert "a budget note" in section and "55 (1.83×)" in section
