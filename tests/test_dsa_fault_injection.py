"""The fault-injection experiment, small: SIGKILLed DiskSparseAdam trials all recover exactly."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(60)
def test_fault_injection_trials_all_recover(tmp_path):
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, str(REPO / "experiments/dsa_fault_injection.py"), "--trials", "4",
                          "--results-dir", str(tmp_path)], capture_output=True, text=True, timeout=55, env=env, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    with open(tmp_path / "dsa_fault_injection.csv") as f:
        rows = {(r["metric"], r["x_value"]): float(r["value"]) for r in csv.DictReader(f)}
    assert rows[("trials", "all")] == 4
    assert rows[("failures", "all")] == 0
    # every trial resolved: killed in a phase (or finished) and reopened refused or accepted, then continued exactly
    assert rows[("refused_dirty", "all")] + rows[("accepted_clean", "all")] == 4
    assert rows[("bitwise_continuations", "all")] == 4
    phases = {p for (m, p) in rows if m == "trials"} - {"all"}
    assert phases <= {"restore", "step", "save", "flush", "close", "done"}
