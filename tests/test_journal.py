"""The journal of finished runs (experiments/harness/journal.py): an experiment stopped part way and
started again with the same code and configuration reuses what it finished, and nothing else."""

import csv
import subprocess

import pytest

from experiments.harness import journal as J


def _git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    (root / "code").mkdir(parents=True)
    (root / "code" / "a.py").write_text("x = 1\n")
    _git(root, "init", "-q")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "x", "--allow-empty")
    _git(root, "add", ".")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "code")
    return root


def test_code_fingerprint_is_the_tree_hash_and_none_while_the_code_is_edited(repo):
    first = J.code_fingerprint(["code"], root=repo)
    tree = subprocess.run(["git", "rev-parse", "HEAD:code"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert first == {"code": tree}
    (repo / "code" / "a.py").write_text("x = 2\n")
    assert J.code_fingerprint(["code"], root=repo) is None  # uncommitted: cannot be vouched for
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "edit")
    assert J.code_fingerprint(["code"], root=repo) not in (None, first)


def test_finished_runs_are_read_back_exactly_and_another_fingerprint_starts_afresh(tmp_path, monkeypatch):
    code = {"optim": "a" * 40}
    monkeypatch.setattr(J, "code_fingerprint", lambda paths, root=None: dict(code))
    path = tmp_path / "partial" / "x.jsonl"
    jr = J.Journal.open(path, {"seeds": [0, 1]}, ["optim"])
    assert len(jr) == 0 and jr.get(("m", "v", 0)) is None
    value = [1.2345678901234567, 0.1 + 0.2, float("nan")]
    jr.add(("m", "v", 0), value)
    with open(path, "a") as f:
        f.write('{"key": ["m", "v", 1], "val')  # a line cut short by a stop mid-write
    again = J.Journal.open(path, {"seeds": [0, 1]}, ["optim"])
    got = again.get(("m", "v", 0))
    assert got[:2] == value[:2] and got[2] != got[2]  # floats bit for bit, NaN kept
    assert len(again) == 1  # the cut line's run is redone
    # another configuration, or other code: the old journal is set aside, nothing is reused
    other = J.Journal.open(path, {"seeds": [0, 1, 2]}, ["optim"])
    assert len(other) == 0 and path.with_name("x.jsonl.stale").exists()
    code["optim"] = "b" * 40
    assert len(J.Journal.open(path, {"seeds": [0, 1, 2]}, ["optim"])) == 0
    monkeypatch.setattr(J, "code_fingerprint", lambda paths, root=None: None)
    assert J.Journal.open(path, {"seeds": [0, 1, 2]}, ["optim"]) is None


def _losses(path):
    with open(path, newline="") as f:
        return {(r["variant"], r["seed"]): float(r["value"]) for r in csv.DictReader(f) if r["metric"] == "val_loss"}


@pytest.mark.timeout(300)
def test_an_ablation_started_again_reuses_its_finished_runs_and_removes_the_journal(tmp_path, monkeypatch):
    """A journal holding one finished run (a loss no run would give) of the same code and
    configuration: the CSV carries that value for that run, every other run is computed, and the
    journal is gone once the CSV is written."""
    from experiments import gefen_ablation as A

    monkeypatch.setattr(J, "code_fingerprint", lambda paths, root=None: {p: "0" * 40 for p in paths})
    argv = ["--tiny", "--variants", "factored", "--seeds", "2", "--results-dir", str(tmp_path), "--wandb", "disabled"]
    A.main(argv)
    first = _losses(tmp_path / "gefen_ablation.csv")
    journal = tmp_path / "partial" / "gefen_ablation.jsonl"
    assert not journal.exists()  # removed once the CSV was written
    real_open = J.Journal.open

    def left_by_a_stopped_run(path, config, code_paths):
        jr = real_open(path, config, code_paths)
        jr.add((config["configs"][0]["label"], "factored", 1), [9.875, 1.0])
        return jr
    monkeypatch.setattr(A.Journal, "open", left_by_a_stopped_run)
    A.main(argv)
    again = _losses(tmp_path / "gefen_ablation.csv")
    assert again[("factored", "1")] == 9.875  # reused, not recomputed
    assert {k: v for k, v in again.items() if k != ("factored", "1")} == \
        {k: v for k, v in first.items() if k != ("factored", "1")}  # the others computed again, the same
    assert not journal.exists()


@pytest.mark.timeout(300)
def test_a_convergence_run_started_again_reuses_its_finished_runs(tmp_path, monkeypatch):
    """convergence.py journals every finished run: a run kept from an earlier process (its final loss
    edited to a value no run gives) is reused as it stands, the others, reused too, give the rows
    the first process wrote (a JSON round trip loses nothing), and the journal goes with the CSV."""
    import json

    from experiments import convergence as C

    monkeypatch.setattr(J, "code_fingerprint", lambda paths, root=None: {p: "0" * 40 for p in paths})
    argv = ["--tiny", "--optimizers", "AdamW", "Gefen-8bit-factored", "--seeds", "2", "--protocol", "dropin",
            "--no-progress", "--results-dir", str(tmp_path), "--wandb", "disabled"]
    monkeypatch.setattr(J.Journal, "remove", lambda self: None)  # keep the first process's journal
    C.main(argv)
    journal = tmp_path / "partial" / "convergence.jsonl"
    lines = journal.read_text().splitlines()
    recs = [json.loads(line) for line in lines[1:]]
    assert {tuple(r["key"][1:2] + r["key"][3:]) for r in recs} >= {("AdamW", 0), ("AdamW", 1),
                                                                    ("Gefen-8bit-factored", 0), ("Gefen-8bit-factored", 1)}
    with open(tmp_path / "convergence.csv", newline="") as f:
        first = [r for r in csv.DictReader(f)]
    edited = next(r for r in recs if r["key"][1] == "Gefen-8bit-factored" and r["key"][3] == 1)
    edited["value"]["final"] = 9.875
    journal.write_text("\n".join([lines[0]] + [json.dumps(r) for r in recs]) + "\n")
    monkeypatch.undo()
    monkeypatch.setattr(J, "code_fingerprint", lambda paths, root=None: {p: "0" * 40 for p in paths})
    monkeypatch.setattr(C, "_job", lambda *a, **k: pytest.fail("a journaled run was trained again"))
    C.main(argv)
    with open(tmp_path / "convergence.csv", newline="") as f:
        again = [r for r in csv.DictReader(f)]
    finals = {(r["variant"], r["seed"]): float(r["value"]) for r in again if r["metric"] == "final_val_loss"}
    assert finals[("dropin/Gefen-8bit-factored", "1")] == 9.875

    def key(r):
        return r["variant"], r["metric"], r["x_value"], r["seed"]
    touched = {"final_val_loss", "val_loss_vs_adamw"}
    assert {key(r): r["value"] for r in again if not (r["seed"] == "1" and r["metric"] in touched)
            and not r["metric"].startswith("val_loss_vs_adamw_")} == \
        {key(r): r["value"] for r in first if not (r["seed"] == "1" and r["metric"] in touched)
         and not r["metric"].startswith("val_loss_vs_adamw_")}
    assert not journal.exists()
