"""The long results format of DESIGN.md: every experiment writes through experiments.common."""

import argparse
import csv

import pytest

from experiments.common import FIELDS, Results, add_common_args, read_results


def _args(tmp_path):
    p = add_common_args(argparse.ArgumentParser())
    return p.parse_args(["--wandb", "disabled", "--results-dir", str(tmp_path), "--seed", "7"])


def test_rows_append_in_long_format(tmp_path):
    args = _args(tmp_path)
    with Results("demo", args, config=vars(args)) as res:
        res.add("a", "loss", "nats", 1.25, x_name="step", x_value=10)
    with Results("demo", args) as res:
        res.add("b", "loss", "nats", 2.5, x_name="step", x_value=20, seed=3)
    with open(tmp_path / "demo.csv", newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        body = list(reader)
    assert header == FIELDS
    assert len(body) == 2  # appended, header written once
    rows = read_results("demo", tmp_path)
    assert [r["variant"] for r in rows] == ["a", "b"]
    assert [r["value"] for r in rows] == [1.25, 2.5]
    assert [r["x_value"] for r in rows] == [10.0, 20.0]
    assert [r["seed"] for r in rows] == ["7", "3"]
    assert (tmp_path / "demo.config.json").exists()


def test_rows_survive_an_exception(tmp_path):
    args = _args(tmp_path)
    with pytest.raises(RuntimeError):
        with Results("crashy", args) as res:
            res.add("a", "t", "s", 1.0)
            raise RuntimeError("late failure")
    assert len(read_results("crashy", tmp_path)) == 1


def test_read_results_names_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.csv"):
        read_results("nothing", tmp_path)
