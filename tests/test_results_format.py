"""The results format of docs/DESIGN.md that analysis relies on: one CSV per run, its config beside it."""

import argparse
import csv
import json

import pytest

from experiments.harness.common import FIELDS, Results, add_common_args, read_results

CONFIG_KEYS = {"config", "git_commit", "device", "torch_version", "command", "wall_seconds", "timestamp"}


def _args(tmp_path):
    p = add_common_args(argparse.ArgumentParser())
    return p.parse_args(["--wandb", "disabled", "--results-dir", str(tmp_path), "--seed", "7"])


def test_a_run_replaces_the_csv_and_writes_its_config(tmp_path):
    args = _args(tmp_path)
    with Results("demo", args, config=vars(args)) as res:
        res.add("a", "loss", "nats", 1.25, x_name="step", x_value=10)
    with Results("demo", args, config=vars(args)) as res:
        res.add("b", "loss", "nats", 2.5, x_name="step", x_value=20, seed=3)
    with open(tmp_path / "demo.csv", newline="") as f:
        header, *body = list(csv.reader(f))
    assert header == FIELDS and len(body) == 1
    rows = read_results("demo", tmp_path)
    assert [(r["variant"], r["value"], r["x_value"], r["seed"]) for r in rows] == [("b", 2.5, 20.0, "3")]
    config = json.loads((tmp_path / "demo.config.json").read_text())
    assert CONFIG_KEYS <= set(config)
    assert config["timestamp"] == rows[0]["timestamp"] and config["git_commit"] == rows[0]["git_commit"]
    assert config["wall_seconds"] >= 0


def test_rows_survive_an_exception(tmp_path):
    with pytest.raises(RuntimeError):
        with Results("crashy", _args(tmp_path)) as res:
            res.add("a", "t", "s", 1.0)
            raise RuntimeError("late failure")
    assert len(read_results("crashy", tmp_path)) == 1


def test_read_results_names_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.csv"):
        read_results("nothing", tmp_path)
