"""experiments/gefen_distributed.py and its analysis, small: two gloo ranks train a tiny GPT under DDP
and agree, the budget's micro-batches are read from the budgets' CSV only where it searched the same
GPT, and the analysis turns a synthetic CSV into its figure and section (kills for memory listed)."""

import json

import pytest

from experiments import gefen_distributed
from experiments.harness.measured_step import LEAN, model_name
from tests.utils import write_results

TINY_GPT = dict(kind="gpt", n_embd=32, n_layer=1, n_head=2, block=16)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_train_and_agree(strategy):
    from experiments.harness.child import run_ranks
    from experiments.harness.measured_step import worker_cmd, worker_env

    spec = dict(task="dist", config="AdamW", model=TINY_GPT, micro_batch=2, strategy=strategy, steps=[1, 1], seed=0,
                timeout=200)
    ranks = run_ranks(worker_cmd("experiments.gefen_distributed", spec), 2, env=worker_env(), timeout=220)
    assert [r.outcome for r in ranks] == ["ok", "ok"], [r.stderr[-2000:] for r in ranks]
    outs = [r.result for r in ranks]
    assert [o["rank"] for o in outs] == [0, 1]
    assert all(o["tokens_per_s"] > 0 and o["ranks_agree"] for o in outs)


def test_budget_micro_batches_come_from_the_budgets_csv_of_the_same_gpt(tmp_path):
    read = gefen_distributed.searched_micro_batches
    assert read(tmp_path, TINY_GPT, 0.5) == {}
    rows = [("micro_batch/AdamW", "largest_micro_batch", 29, "budget_GiB", 0.5),
            ("micro_batch/AdamW", "largest_micro_batch", 60, "budget_GiB", 1.0),
            (f"micro_batch/{LEAN}", "largest_micro_batch", 80, "budget_GiB", 0.5),
            ("model/AdamW", "largest_model_params", 3e7, "budget_GiB", 0.5)]
    write_results(tmp_path, "gefen_budgets", rows, {"config": {"models": {model_name(TINY_GPT): TINY_GPT}}})
    assert read(tmp_path, TINY_GPT, 0.5) == {"AdamW": 29, LEAN: 80}
    assert read(tmp_path, TINY_GPT, 1.0) == {"AdamW": 60}
    assert read(tmp_path, dict(TINY_GPT, n_layer=2), 0.5) == {}  # another GPT: searched anew


def dist_rows():
    rows = []
    for name, mb in (("AdamW", 30), ("Gefen-8bit", 40), (LEAN, 55)):
        for strategy in ("ddp", "fsdp2"):
            rows += [(f"{strategy}/{name}", "outcome_equal_micro_batch", 0, "micro_batch", 8),
                     (f"{strategy}/{name}", "tokens_per_s_equal_micro_batch", 1000.0, "micro_batch", 8),
                     (f"{strategy}/{name}", "outcome_budget_micro_batch", 1, "micro_batch", mb)]
    return rows


def test_analysis_writes_figure_and_section(tmp_path):
    from analysis.common import main, read_section
    from analysis.gefen_distributed import REPORT

    config = {"config": {"notes": ["a rank note"], "size": {"dist_steps": [1, 3], "mb_budgets": [0.5]}},
              "git_commit": "abc1234", "command": "python experiments/gefen_distributed.py --quick",
              "wall_seconds": 60.0}
    write_results(tmp_path, "gefen_distributed", dist_rows(), config)
    out = tmp_path / "fig.png"
    main(REPORT, ["--results-dir", str(tmp_path), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    section = read_section(tmp_path / "README.md", "gefen_distributed")
    assert "a rank note" in section and "killed for memory at mb 55" in section
    assert "under 0.5 GiB a rank" in section and json.dumps(LEAN)[1:-1] in section
