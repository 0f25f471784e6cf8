"""W&B runs as a researcher compares them: an experiment run offline into a temporary folder, its
records read back from the offline ``.wandb`` files (a leveldb-style log of ``Record`` protobufs).

Checked against what the experiment itself wrote (its CSV and config.json): one run per trained
configuration, named, grouped and tagged; the full config; numeric histories logged at every
evaluation against ``train/step``; summaries that equal the CSV's final numbers; the results run
holding the CSV as an artifact. Then a benchmark's rows, W&B failures, and ``--wandb disabled``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb", reason="wandb is not installed: no W&B runs to check")
pb = pytest.importorskip("wandb.proto.wandb_internal_pb2", reason="this wandb has no record protobufs")

REPO = Path(__file__).resolve().parents[1]

_BLOCK, _HEADER = 32768, 7  # the log's block size and record header (crc32, length, type)


def records(path: Path):
    """The ``Record`` messages of one offline run file, in order."""
    buf = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", buf[:_HEADER])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path}: not a W&B run file"
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(buf):
        left = _BLOCK - pos % _BLOCK
        _, length, kind = struct.unpack("<IHB", buf[pos:pos + _HEADER]) if left >= _HEADER else (0, 0, 0)
        if left < _HEADER or (kind == 0 and length == 0):  # block padding
            pos += left
            continue
        pending += buf[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (1, 4):  # a full record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            yield rec


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_runs(wandb_dir: Path) -> dict:
    """Shut this process's W&B service down (it writes the offline files asynchronously), then
    {display name: {"run", "config", "history" (list of {key: value}), "summary", "artifacts"}}."""
    wandb.teardown()
    runs = {}
    for path in sorted(Path(wandb_dir, "wandb").glob("offline-run-*/run-*.wandb")):
        out = {"config": {}, "history": [], "summary": {}, "artifacts": []}
        for rec in records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                out["run"] = rec.run
                out["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
            elif kind == "config":
                out["config"].update({i.key: json.loads(i.value_json) for i in rec.config.update})
            elif kind == "history":
                out["history"].append({_key(i): json.loads(i.value_json) for i in rec.history.item})
            elif kind == "summary":
                out["summary"].update({_key(i): json.loads(i.value_json) for i in rec.summary.update})
            elif kind == "artifact":
                out["artifacts"].append((rec.artifact.type, sorted(m.path for m in rec.artifact.manifest.contents)))
        runs[out["run"].display_name] = out
    return runs


def _user_keys(d: dict) -> set:
    return {k for k in d if not k.startswith("_")}


@pytest.fixture(scope="module")
def convergence_runs(tmp_path_factory):
    """The tiny convergence experiment, two optimizers x two seeds, offline into a temporary folder."""
    from experiments import convergence

    tmp = tmp_path_factory.mktemp("wandb")
    convergence.main(["--tiny", "--optimizers", "AdamW", "Gefen-8bit", "--protocol", "best", "--seeds", "2",
                      "--no-progress", "--wandb", "offline", "--wandb-dir", str(tmp), "--results-dir", str(tmp)])
    from experiments.harness.common import read_results
    from experiments.harness.train import CHAR_LM, char_lm_label

    return read_runs(tmp), read_results(tmp / "convergence.csv"), json.loads(
        (tmp / "convergence.config.json").read_text()), char_lm_label(CHAR_LM["tiny"])


def test_one_named_grouped_tagged_run_per_trained_configuration(convergence_runs):
    runs, rows, _, model = convergence_runs
    train = {n: r for n, r in runs.items() if r["run"].job_type == "train"}
    assert sorted(train) == sorted(f"convergence/{model}/{opt}/lr0.003/s{s}"
                                   for opt in ("AdamW", "Gefen-8bit") for s in (0, 1))
    assert [r["run"].job_type for n, r in runs.items() if n not in train] == ["results"]
    for name, r in runs.items():
        assert r["run"].run_group == "convergence", name
        assert {"convergence", "quick"} <= set(r["run"].tags), (name, list(r["run"].tags))
    for name, r in train.items():
        opt, seed = name.split("/")[2], int(name.rsplit("/s", 1)[1])
        assert opt in r["run"].tags
        cfg = r["config"]
        assert (cfg["optimizer"], cfg["seed"], cfg["lr"], cfg["model_label"]) == (opt, seed, 0.003, model)
        missing = {"git_commit", "device", "versions", "weight_decay", "grad_clip", "steps", "batch", "block",
                   "n_layer", "n_embd", "eval_every", "schedule", "params", "command"} - set(cfg)
        assert not missing, f"{name}: config lacks {sorted(missing)}"
        assert cfg["git_commit"] == rows[0]["git_commit"] and cfg["device"] == rows[0]["device"]
        assert cfg["versions"]["torch"] == rows[0]["torch_version"] and "gefen" in cfg["versions"]


def test_training_history_is_numeric_and_logged_at_every_evaluation(convergence_runs):
    runs, rows, _, _ = convergence_runs
    for name, r in runs.items():
        if r["run"].job_type != "train":
            continue
        hist = [h for h in r["history"] if "train/loss" in h]
        steps = [h["train/step"] for h in hist]
        assert steps == [3, 6], f"{name}: loss logged at steps {steps}, want every evaluation (3, 6)"
        for h in r["history"]:
            bad = {k: v for k, v in h.items() if not isinstance(v, (int, float))}
            assert not bad, f"{name}: non-numeric history entries {bad}"
        want = {"train/loss", "val/loss", "train/lr", "train/step_time_ms", "train/tokens_per_s"}
        assert want <= set(hist[0]) and "state/bytes" in hist[0], sorted(hist[0])
        opt, seed = name.split("/")[2], name.rsplit("/s", 1)[1]
        csv_val = {int(x["x_value"]): x["value"] for x in rows
                   if x["variant"] == opt and x["metric"] == "val_loss" and x["seed"] == seed}
        assert [h["val/loss"] for h in hist] == pytest.approx([csv_val[s] for s in steps], rel=1e-6)


def test_summaries_are_set_explicitly_from_the_run(convergence_runs):
    runs, rows, _, _ = convergence_runs
    for name, r in runs.items():
        if r["run"].job_type != "train":
            continue
        s = r["summary"]
        opt, seed = name.split("/")[2], name.rsplit("/s", 1)[1]
        final = next(x["value"] for x in rows if (x["variant"], x["metric"], x["seed"]) == (opt, "final_val_loss", seed))
        vals = [x["value"] for x in rows if (x["variant"], x["metric"], x["seed"]) == (opt, "val_loss", seed)]
        assert s["final/val_loss"] == pytest.approx(final, rel=1e-6)
        assert s["best/val_loss"] == pytest.approx(min(vals), rel=1e-6)
        assert s["median/step_time_ms"] > 0 and s["final/state_bytes"] > 0
        # history keys do not leak into the summary as "the last logged value"
        assert not {"val/loss", "train/loss", "train/lr"} & set(s), sorted(_user_keys(s))


def test_results_run_holds_the_csv_as_an_artifact(convergence_runs):
    runs, _, meta, _ = convergence_runs
    res = runs["convergence/results"]
    assert ("results", ["convergence.config.json", "convergence.csv"]) in res["artifacts"]
    assert meta["wandb"]["results_run_id"] == res["run"].run_id
    assert meta["wandb"]["mode"] == "offline" and meta["wandb"]["group"] == "convergence"
    assert not res["history"], "a training experiment's results run repeats no curves"


def test_benchmark_rows_go_against_their_numeric_x_and_strings_to_the_summary(tmp_path):
    from experiments.harness.common import Results

    args = argparse.Namespace(wandb="offline", wandb_dir=tmp_path, results_dir=tmp_path, quick=True, seed=0)
    with Results("bench_probe", args, config={"rows": 3}) as res:
        for n in (10, 100, 1000):
            res.add("DSA", "throughput", "rows/s", 2.0 * n, x_name="rows", x_value=n)
            res.add("DSA", "throughput", "rows/s", 3.0 * n, x_name="rows", x_value=n, seed=1)
        res.add("DSA", "speedup", "x", 1.5, x_name="config", x_value="cold")
        res.add("DSA", "params", "count", 7)
    (run,) = read_runs(tmp_path).values()
    assert run["run"].display_name == "bench_probe/results" and run["run"].job_type == "results"
    hist = [h for h in run["history"] if "rows" in h]
    assert [(h["rows"], h.get("DSA/throughput"), h.get("DSA/throughput/seed1")) for h in hist] == [
        (10, 20.0, None), (10, None, 30.0), (100, 200.0, None), (100, None, 300.0),
        (1000, 2000.0, None), (1000, None, 3000.0)]
    assert run["summary"]["DSA/speedup/config=cold"] == 1.5 and run["summary"]["DSA/params"] == 7
    assert ("results", ["bench_probe.config.json", "bench_probe.csv"]) in run["artifacts"]
    assert all(isinstance(v, (int, float)) for h in run["history"] for v in h.values())


def test_the_figure_is_logged_as_an_image_in_the_experiments_group(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.harness.tracking import log_figure

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    fig.savefig(tmp_path / "probe.png")
    plt.close(fig)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    recorded = {"wandb": {"mode": "offline", "project": "p", "entity": None, "dir": ".", "group": "probe",
                          "results_run_id": "abc"}}
    log_figure(recorded, tmp_path / "probe.png", "probe", root=tmp_path)
    (run,) = read_runs(tmp_path).values()
    assert (run["run"].display_name, run["run"].run_group, run["run"].job_type) == ("probe/figure/probe", "probe", "figure")
    assert run["config"]["results_run_id"] == "abc"
    (img,) = [h for h in run["history"] if "figure/probe/_type" in h]
    assert img["figure/probe/_type"] == "image-file" and img["figure/probe/path"].endswith(".png")
    log_figure({"wandb": dict(recorded["wandb"], mode="disabled")}, tmp_path / "probe.png", "probe", root=tmp_path)
    log_figure({}, tmp_path / "probe.png", "probe", root=tmp_path)
    assert len(read_runs(tmp_path)) == 1, "a disabled or unrecorded experiment got a figure run"


def test_a_failing_wandb_costs_no_measurement(tmp_path, monkeypatch, capsys):
    from experiments.harness.common import Results, read_results

    def broken(*a, **k):
        raise RuntimeError("no W&B service")

    monkeypatch.setattr(wandb, "init", broken)
    args = argparse.Namespace(wandb="offline", wandb_dir=tmp_path, results_dir=tmp_path, quick=True, seed=0)
    with Results("bench_probe", args) as res:
        res.add("DSA", "throughput", "rows/s", 5.0, x_name="rows", x_value=1)
    assert [r["value"] for r in read_results(tmp_path / "bench_probe.csv")] == [5.0]
    assert "no W&B service" in capsys.readouterr().err


def test_wandb_disabled_imports_nothing_of_wandb(tmp_path):
    code = ("import argparse, sys\nfrom pathlib import Path\nfrom experiments.harness.common import Results\n"
            "from experiments.harness.tracking import Tracking\n"
            f"args = argparse.Namespace(wandb='disabled', results_dir=Path({str(tmp_path)!r}), quick=True, seed=0)\n"
            "with Results('bench_probe', args) as res:\n"
            "    res.add('DSA', 'throughput', 'rows/s', 1.0, x_name='rows', x_value=1)\n"
            "    with res.tracking.train_run(model='m', optimizer='o', lr=1e-3, seed=0) as run:\n"
            "        run.log({'train/loss': 1.0}, step=1); run.summary({'final/val_loss': 1.0})\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'wandb'))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
    assert not (tmp_path / "wandb").exists()


def test_numbers_only_keeps_numbers_and_drops_strings():
    import torch

    from experiments.harness.tracking import numbers_only

    got = numbers_only({"a": 1, "b": 2.5, "c": "x", "d": True, "e": torch.tensor(3.0), "f": None,
                        "g": float("nan"), "h": [1, 2]})
    assert set(got) == {"a", "b", "d", "e", "g"} and got["d"] == 1 and got["e"] == 3.0 and math.isnan(got["g"])
