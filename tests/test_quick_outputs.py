"""Quick results stay quick: a quick run never writes the committed ``results/`` (by any name: ``..``,
a symlink, a hard link); an analysis of results other than the committed ones writes its figure and
section beside them, never into ``paper_figs/`` or ``results/README.md`` (by any name either); a quick
run's section, README and figure title carry the banner and no verdict, and the claims refuse it.

The fixtures are the committed results themselves, relabelled as a quick run's: every analysis
script's real input, with every verdict the full run's section has.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from analysis import claims_common, claims_dsa, common
from experiments.harness import common as experiments_common
from experiments import reproduce

REPO = Path(__file__).resolve().parents[1]
ANALYSES = sorted(a for figs in reproduce.EXPERIMENTS.values() for a in figs)
VERDICT = re.compile(r"\b(not met|met|missed|not reproduced|reproduced)\b", re.I)


def _quick_copy(experiment: str, dest: Path, quick=True) -> Path:
    """The committed CSV of ``experiment`` (and those its report reads) in ``dest``, its config
    marked as a ``--quick`` run's."""
    (dest / experiment).parent.mkdir(parents=True, exist_ok=True)  # an experiment of a subfolder: gpu/...
    shutil.copy(REPO / "results" / f"{experiment}.csv", dest / f"{experiment}.csv")
    meta = json.loads((REPO / "results" / f"{experiment}.config.json").read_text())
    meta["config"]["quick"] = quick
    (dest / f"{experiment}.config.json").write_text(json.dumps(meta))
    return dest


@pytest.fixture
def fake_repo(tmp_path, monkeypatch):
    """A stand-in for the repository's committed ``results/`` and ``paper_figs/`` (a figure and a
    README in each), so that a script that writes there writes here; returns (results, figs)."""
    results, figs = tmp_path / "repo" / "results", tmp_path / "repo" / "paper_figs"
    results.mkdir(parents=True)
    figs.mkdir(parents=True)
    (results / "README.md").write_text("# Results\n")
    (figs / "dsa_throughput.png").write_bytes(b"committed")
    for module in (common, experiments_common):
        monkeypatch.setattr(module, "RESULTS_DIR", results)
        monkeypatch.setattr(module, "FIGS_DIR", figs)
    return results, figs


def _files(root: Path) -> dict:
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full-run-elsewhere"])
def test_an_analysis_of_other_results_leaves_paper_figs_and_results_readme_untouched(tmp_path, fake_repo, quick):
    results, figs = fake_repo
    before = _files(results.parent)
    elsewhere = _quick_copy("dsa_throughput", tmp_path / "elsewhere", quick=quick)
    readme = common.main(importlib.import_module("analysis.dsa_throughput").REPORT, ["--results-dir", str(elsewhere)])
    assert _files(results.parent) == before, "paper_figs/ or results/README.md was written"
    assert readme == elsewhere / "README.md"
    assert (elsewhere / "dsa_throughput.png").read_bytes()[:4] == b"\x89PNG"
    assert "![dsa_throughput](dsa_throughput.png)" in common.read_section(readme, "dsa_throughput")


def test_an_analysis_of_other_results_refuses_paper_figs(tmp_path, fake_repo):
    _, figs = fake_repo
    quick = _quick_copy("poincare", tmp_path / "quick")
    with pytest.raises(common.ResultsError, match="paper_figs/ holds the figures of the committed results/ only"):
        common.main(importlib.import_module("analysis.poincare").REPORT,
                    ["--results-dir", str(quick), "--out", str(figs / "poincare.png")])
    assert not (figs / "poincare.png").exists()


def test_a_quick_run_in_the_committed_results_is_refused(fake_repo):
    results, _ = fake_repo
    _quick_copy("correctness", results)
    with pytest.raises(common.ResultsError, match="a quick run's results in the committed results/"):
        common.main(importlib.import_module("analysis.correctness").REPORT, ["--results-dir", str(results)])
    assert (results / "README.md").read_text() == "# Results\n"


def _quick_args(results_dir):
    parser = experiments_common.add_common_args(argparse.ArgumentParser())
    return parser.parse_args(["--quick", "--wandb", "disabled", "--results-dir", str(results_dir)])


def _linked(link, target: Path, name: Path) -> Path:
    """``name`` made a link (os.link or os.symlink) to ``target``."""
    name.parent.mkdir(exist_ok=True)
    link(target, name)
    return name


# --results-dir FOLDER (made from the fake repository's results/ and tmp_path) that lands on committed files
ROUTES_TO_COMMITTED = {
    "the-folder": lambda results, tmp: results,
    "dot-dot": lambda results, tmp: results / "quick" / "..",
    "a-subfolder": lambda results, tmp: results / "gpu",
    "a-symlinked-folder": lambda results, tmp: _linked(os.symlink, results, tmp / "link"),
    "a-hard-linked-csv": lambda results, tmp: _linked(os.link, results / "demo.csv", tmp / "hard" / "demo.csv").parent,
    "a-symlinked-csv": lambda results, tmp: _linked(os.symlink, results / "demo.csv", tmp / "soft" / "demo.csv").parent,
}


@pytest.mark.parametrize("route", ROUTES_TO_COMMITTED)
def test_a_quick_run_never_writes_the_committed_results(tmp_path, fake_repo, monkeypatch, route):
    results, _ = fake_repo
    calls = []
    monkeypatch.setattr(reproduce.subprocess, "run", lambda cmd, cwd=None, timeout=None: calls.append(cmd))
    (results / "quick").mkdir()
    (results / "gpu").mkdir()
    for name in ("demo.csv", "demo.config.json", "gpu/demo.csv"):
        (results / name).write_text("committed")
    before = _files(results)
    folder = ROUTES_TO_COMMITTED[route](results, tmp_path)
    with pytest.raises(ValueError, match="--results-dir .*a quick run is a smoke test and never writes the committed"):
        with experiments_common.Results("demo", _quick_args(folder)) as res:
            res.add("a", "loss", "nats", 1.0)
    assert _files(results) == before
    with pytest.raises(ValueError, match="never writes the committed"):
        reproduce.main(["--quick", "--only", "correctness", "--results-dir", str(folder)])
    assert not calls, "reproduce --quick started a step"


def test_a_quick_run_writes_results_quick_and_a_folder_of_its_own(tmp_path, fake_repo):
    results, _ = fake_repo
    for folder in (results / "quick", tmp_path / "own"):
        args = _quick_args(folder)
        with experiments_common.Results("demo", args, config=vars(args)) as res:
            res.add("a", "loss", "nats", 1.0)
        assert json.loads((folder / "demo.config.json").read_text())["config"]["quick"] is True


def test_the_claims_refuse_a_quick_run_as_evidence(tmp_path):
    quick = _quick_copy("dsa_fault_injection", tmp_path)
    with pytest.raises(common.ResultsError, match="dsa_fault_injection.csv: a quick run's results, a smoke test"):
        claims_dsa.dsa_fault_injection(claims_common.Results(quick))
    full = _quick_copy("dsa_fault_injection", tmp_path / "full", quick=False)
    assert claims_dsa.dsa_fault_injection(claims_common.Results(full)).verdict


def test_a_section_that_compares_with_a_quick_run_has_the_banner_and_no_verdict(tmp_path):
    """convergence_long's verdict compares with convergence_encoder: a full run of the first beside a
    quick run of the second is judged as quick."""
    report = importlib.import_module("analysis.convergence_long").REPORT
    folder = _quick_copy(report.experiment, tmp_path, quick=False)
    _quick_copy(report.reads[0], folder)
    common.main(dataclasses.replace(report, draw=None), ["--results-dir", str(folder)])
    section = common.read_section(folder / "README.md", report.name)
    assert common.QUICK_BANNER in section and not VERDICT.findall(section), section[:2000]


@pytest.mark.parametrize("link", [os.link, os.symlink], ids=["hard-link", "symlink"])
def test_an_analysis_of_other_results_refuses_a_link_to_a_paper_figs_figure(tmp_path, fake_repo, link):
    _, figs = fake_repo
    quick = _quick_copy("dsa_throughput", tmp_path / "quick")
    link(figs / "dsa_throughput.png", tmp_path / "figure.png")
    with pytest.raises(common.ResultsError, match="paper_figs/ holds the figures of the committed results/ only"):
        common.main(importlib.import_module("analysis.dsa_throughput").REPORT,
                    ["--results-dir", str(quick), "--out", str(tmp_path / "figure.png")])
    assert (figs / "dsa_throughput.png").read_bytes() == b"committed"


def test_an_analysis_of_other_results_refuses_a_hard_link_to_results_readme(tmp_path, fake_repo):
    results, _ = fake_repo
    quick = _quick_copy("correctness", tmp_path / "quick")
    os.link(results / "README.md", quick / "README.md")
    with pytest.raises(common.ResultsError, match="results/README.md under another name"):
        common.main(importlib.import_module("analysis.correctness").REPORT, ["--results-dir", str(quick)])
    assert (results / "README.md").read_text() == "# Results\n"


@pytest.mark.parametrize("name", ANALYSES)
def test_a_quick_section_has_the_banner_and_no_verdict(tmp_path, name):
    """Every analysis script on the committed results relabelled quick (the figure is drawn by the
    next test; here only the section, whose full-run text has the verdicts)."""
    report = importlib.import_module(f"analysis.{name}").REPORT
    quick = tmp_path / "quick"
    for experiment in (report.experiment, *report.reads):
        if (REPO / "results" / f"{experiment}.csv").exists():
            _quick_copy(experiment, quick)
    common.main(dataclasses.replace(report, draw=None), ["--results-dir", str(quick)])
    section = common.read_section(quick / "README.md", report.name)
    assert common.QUICK_BANNER in section
    assert not VERDICT.findall(section), f"verdicts in a quick section: {VERDICT.findall(section)}"
    head = (quick / "README.md").read_text().split("<!--")[0]
    assert common.QUICK_BANNER in head and "# Results (quick)" in head


@pytest.mark.parametrize("name", ["dsa_throughput", "gefen_speed"])  # save_figure's title, and a draw's own
def test_a_quick_figure_carries_the_banner_in_its_title(tmp_path, monkeypatch, name):
    import matplotlib.figure

    titles = []
    savefig = matplotlib.figure.Figure.savefig

    def recording_savefig(fig, *args, **kwargs):
        titles.append(fig._suptitle.get_text() if fig._suptitle is not None else "")
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", recording_savefig)
    report = importlib.import_module(f"analysis.{name}").REPORT
    quick = _quick_copy(report.experiment, tmp_path / "quick")
    common.main(report, ["--results-dir", str(quick)])
    assert len(titles) == 1 and titles[0].startswith(common.QUICK_BANNER), titles
    full = _quick_copy(report.experiment, tmp_path / "full", quick=False)
    common.main(report, ["--results-dir", str(full)])
    assert common.QUICK_BANNER not in titles[1], titles


def test_reproduce_quick_routes_figures_beside_the_results(tmp_path, monkeypatch):
    import subprocess

    calls = []
    monkeypatch.setattr(reproduce.subprocess, "run",
                        lambda cmd, cwd=None, timeout=None: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    assert reproduce.main(["--quick", "--only", "dsa_throughput", "--results-dir", str(tmp_path)]) == 0
    analysis = [c for c in calls if "analysis" in c[1]]
    assert analysis == [[reproduce.sys.executable, str(REPO / "analysis" / "dsa_throughput.py"),
                         "--results-dir", str(tmp_path)]], "an analysis was told to draw elsewhere than its default"


def test_reproduce_quick_runs_every_experiment_at_its_quick_size(tmp_path, monkeypatch):
    """A quick reproduction passes no full run's size (convergence_bf16's full run is ``--size large``)."""
    import subprocess

    calls = []
    monkeypatch.setattr(reproduce.subprocess, "run",
                        lambda cmd, cwd=None, timeout=None: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    reproduce.main(["--quick", "--only", "convergence", "--results-dir", str(tmp_path)])
    runs = [c for c in calls if "experiments" in c[1]]
    assert len(runs) == 1 + len(reproduce.MORE_RUNS["convergence"])
    assert all("--quick" in c and "--size" not in c for c in runs), runs
    calls.clear()
    reproduce.main(["--only", "convergence", "--results-dir", str(tmp_path)])
    assert any(c[c.index("--size") + 1] == "large" for c in calls if "--size" in c)
