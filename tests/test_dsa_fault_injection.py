"""The fault-injection experiment, small: DiskSparseAdam trials SIGKILLed or interrupted (SIGINT) all
recover exactly."""

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
    out = subprocess.run([sys.executable, str(REPO / "experiments/dsa_fault_injection.py"), "--trials", "8",
                          "--results-dir", str(tmp_path)], capture_output=True, text=True, timeout=55, env=env, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    with open(tmp_path / "dsa_fault_injection.csv") as f:
        rows = {(r["variant"], r["metric"], r["x_value"]): float(r["value"]) for r in csv.DictReader(f)}
    total = "DiskSparseAdam"
    assert rows[(total, "trials", "all")] == 8
    assert rows[(total, "failures", "all")] == 0
    # every trial resolved: signalled in a phase (or finished) and reopened refused or accepted, then continued exactly
    assert rows[(total, "refused_dirty", "all")] + rows[(total, "accepted_clean", "all")] == 8
    assert rows[(total, "bitwise_continuations", "all")] == 8
    for sig in ("SIGKILL", "SIGINT"):
        assert rows[(f"{total}/{sig}", "trials", "all")] == 4
    phases = {p for (v, m, p) in rows if m == "trials"} - {"all"}
    assert phases <= {"restore", "create", "load", "step", "save", "flush", "close", "done"}
