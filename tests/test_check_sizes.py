"""Every experiment's ``--check`` size: the flag is there, its CHECK flags parse with the script's own
parser, its outputs go to results/check, and the block it prints computes the claims row from the CSV
it is given (experiments/harness/check.py)."""

from __future__ import annotations

import csv
import importlib
import json
from pathlib import Path

import pytest

from experiments.harness import check
from experiments.harness.common import FIELDS, RESULTS_DIR, Results, output_dir

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "experiments").glob("*.py")
                 if "add_common_args(" in p.read_text() and p.stem != "__init__")


class Parsed(Exception):
    def __init__(self, parser, args):
        super().__init__("parsed")
        self.parser, self.namespace = parser, args


def parsed(monkeypatch, script, argv):
    """(parser, args) of ``script``'s main(argv), stopped right after its arguments are parsed."""
    real = check.parse

    def stop(parser, argv=None):
        raise Parsed(parser, real(parser, argv))

    monkeypatch.setattr(check, "parse", stop)
    module = importlib.import_module(f"experiments.{script}")
    with pytest.raises(Parsed) as caught:
        module.main(argv)
    return caught.value.parser, caught.value.namespace


def test_every_experiment_script_takes_the_common_flags():
    assert {"correctness", "dsa_throughput", "convergence", "gefen_ablation", "hessian_alignment"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_check_flags_parse_with_the_scripts_parser_and_write_results_check(monkeypatch, script):
    parser, args = parsed(monkeypatch, script, ["--check"])
    assert "--check" in parser.format_help()
    spec, _ = parser.check_size
    overrides = spec(args) if callable(spec) else spec
    # every CHECK flag is one of this parser's and its value is what the run got
    known = {s for a in parser._actions for s in a.option_strings}
    assert set(overrides) <= known, f"{script}: CHECK names flags its parser lacks: {set(overrides) - known}"
    full = parser.parse_args([])
    for flag, value in overrides.items():
        dest = next(a.dest for a in parser._actions if flag in a.option_strings)
        assert getattr(args, dest) == parser.parse_args(check.flags({flag: value})).__dict__[dest], (script, flag)
        assert getattr(args, dest) != getattr(full, dest) or value is True, f"{script}: CHECK {flag} is the full run's"
    assert args.check and not args.quick
    assert output_dir(args) == RESULTS_DIR / "check"


def test_a_flag_given_by_hand_wins_over_the_check_size(monkeypatch):
    _, args = parsed(monkeypatch, "dsa_throughput", ["--check", "--reps", "2"])
    assert (args.reps, args.fresh_reps) == (2, 3)


def test_check_with_quick_is_refused(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parsed(monkeypatch, "correctness", ["--check", "--quick"])
    assert "--check with --quick" in capsys.readouterr().err


def test_a_check_run_is_refused_the_committed_results(tmp_path):
    class Args:
        check, quick, results_dir, wandb = True, False, RESULTS_DIR, "disabled"

    with pytest.raises(ValueError, match="a check run tests a claim"):
        Results("correctness", Args())
    with pytest.raises(ValueError, match="results/check"):
        Results("correctness", type("A", (Args,), {"results_dir": RESULTS_DIR / "quick"})())


def write_results(folder, experiment, rows, config):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{experiment}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for variant, metric, x_value, value in rows:
            w.writerow(dict(experiment=experiment, variant=variant, metric=metric, unit="", x_name="step",
                            x_value=x_value, value=value, seed=0, device="cpu", torch_version="", git_commit="abc",
                            timestamp=""))
    (folder / f"{experiment}.config.json").write_text(json.dumps({"config": config, "git_commit": "abc"}))


def correctness_rows(numba_err):
    return [("DiskSparseAdam[numba] vs SparseAdam", "max_abs_err", 7, numba_err),
            ("DiskSparseAdam[torch] vs SparseAdam", "max_abs_err", 7, 0.0),
            ("DiskSparseAdam[triton] vs SparseAdam", "max_abs_err", 7, 1e-7),
            ("DiskSparseAdam[numba,bitwise=False] vs SparseAdam", "max_abs_err", 7, 2e-7)]


def test_the_printed_block_computes_the_row_from_the_csv_it_is_given(tmp_path):
    committed = tmp_path / "committed"
    write_results(committed, "correctness", correctness_rows(0.0), {})
    write_results(tmp_path / "check", "correctness", correctness_rows(0.5), {"check": True})
    text = check.report("correctness", tmp_path / "check", "a tiny size", committed=committed)
    lines = text.splitlines()
    assert "DSA matches `torch.optim.SparseAdam`" in lines[1]
    assert lines[2].split(":", 1)[1].strip() == ("max abs error 0.5 after 7 steps (numba and torch backends): "
                                                 "not met: differs from SparseAdam")
    assert lines[3].split(":", 1)[1].strip() == ("max abs error 0 after 7 steps (numba and torch backends): "
                                                 "reproduced, bit for bit")
    assert lines[-1] == "  check size: a tiny size"


def test_the_printed_block_says_when_the_check_csv_cannot_give_the_row(tmp_path):
    committed = tmp_path / "committed"
    write_results(committed, "correctness", correctness_rows(0.0), {})
    write_results(tmp_path / "check", "correctness", correctness_rows(0.0)[:1], {"check": True})
    text = check.report("correctness", tmp_path / "check", committed=committed)
    assert f"check:                not computable here (ResultsError: {tmp_path / 'check' / 'correctness'}.csv" in text
    assert "committed (full run): max abs error 0 after 7 steps" in text


@pytest.mark.parametrize("command, experiment", [
    ("`python experiments/dsa_throughput.py`", "dsa_throughput"),
    ("`python experiments/convergence.py --experiment convergence_encoder`", "convergence_encoder"),
    ("`python experiments/gefen_ablation.py --ablation gefen_ablation_layout`", "gefen_ablation_layout"),
    ("`bash experiments/gpu_checks.sh`", None),
])
def test_a_claims_row_names_the_experiment_its_command_runs(command, experiment):
    assert check._experiment_of(command) == experiment


def test_a_check_runs_wandb_runs_are_tagged_check_not_full(tmp_path):
    from experiments.harness import tracking

    class Args:
        check, quick, wandb = True, False, "disabled"

    t = tracking.Tracking.from_args("correctness", Args(), root=tmp_path, env={}, config={})
    assert t.scale == "check"
    Args.check = False
    assert tracking.Tracking.from_args("correctness", Args(), root=tmp_path, env={}, config={}).scale == "full"


def test_a_check_run_prints_its_rows_verdict_beside_the_committed_one_at_its_exit(tmp_path, capsys):
    class Args:
        check, quick, results_dir, wandb, check_note = True, False, tmp_path, "disabled", "a tiny size"

    with Results("correctness", Args()) as res:
        for variant, metric, x_value, value in correctness_rows(0.5):
            res.add(variant, metric, "", value, x_name="step", x_value=x_value)
    out = capsys.readouterr().out
    assert "check:                max abs error 0.5 after 7 steps (numba and torch backends): not met" in out
    assert "committed (full run): max abs error 0 after " in out  # the committed results/correctness.csv
    assert out.rstrip().endswith("check size: a tiny size")
