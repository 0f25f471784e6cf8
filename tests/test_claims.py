"""The README's claims table is what analysis/claims.py makes of the committed results."""

import csv
import re

import pytest

from analysis import claims
from analysis.common import ResultsError
from experiments.common import FIELDS, REPO_ROOT, RESULTS_DIR


class Recording(claims.Results):
    """Results that note which CSVs a row reads."""

    def __init__(self, results_dir=RESULTS_DIR):
        super().__init__(results_dir)
        self.read = set()

    def rows(self, experiment, *metrics):
        self.read.add(experiment)
        return super().rows(experiment, *metrics)


def _reads():
    rec, out = Recording(), []
    for f in claims.ROWS:
        rec.read = set()
        f(rec)
        out += [pytest.param(f, e, id=f"{f.__name__}-{e}") for e in sorted(rec.read)]
    return out


def _write_csv(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, FIELDS)
        w.writeheader()
        w.writerows(rows)


def _row(**kw):
    base = dict(experiment="x", variant="v", metric="m", unit="", x_name="", x_value="", value=0, seed=0,
                device="cpu", torch_version="2", git_commit="abc", timestamp="2026-01-01T00:00:00")
    return {**base, **kw}


def test_readme_block_is_generated_from_the_committed_results():
    doc = (REPO_ROOT / "README.md").read_text()
    m = re.search(re.escape(claims.BEGIN) + r"\n(.*?)\n" + re.escape(claims.END), doc, re.S)
    assert m, "README.md has no claims block"
    assert m.group(1) == claims.block(), "README's claims block differs from the results: run python analysis/claims.py"


def test_table_reads_one_way_and_stays_short():
    text = claims.block()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| claim")]
    assert 20 <= len(rows) <= 24
    for line in rows:
        cells = re.split(r"(?<!\\)\|", line)[1:-1]
        assert len(cells) == 5, line
        assert len(cells[2]) < 160, cells[2]
        assert not re.search(r"×\s*(less|more)|'s (step )?time", cells[2]), f"a ratio that is not a speed: {cells[2]}"


@pytest.mark.parametrize("row, experiment", _reads())
def test_row_names_the_csv_that_lacks_its_metric(tmp_path, row, experiment):
    """Every CSV but ``experiment`` is the committed one; ``experiment`` holds no metric the row needs."""
    for path in list(RESULTS_DIR.glob("*.csv")) + list(RESULTS_DIR.glob("gpu/*.csv")):
        dest = tmp_path / path.relative_to(RESULTS_DIR)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.symlink_to(path)
    target = tmp_path / f"{experiment}.csv"
    target.unlink()
    _write_csv(target, [_row(metric="unrelated")])
    with pytest.raises(ResultsError, match=re.escape(f"{experiment}.csv")):
        row(claims.Results(tmp_path))


@pytest.mark.parametrize("failures", [0, 3])
def test_headline_and_verdict_follow_the_data(tmp_path, failures):
    rows = [_row(variant="DiskSparseAdam", metric="failures", x_name="phase", x_value="all", value=failures),
            _row(variant="DiskSparseAdam", metric="trials", x_name="phase", x_value="all", value=120)]
    _write_csv(tmp_path / "dsa_fault_injection.csv", rows)
    row = claims.dsa_fault_injection(claims.Results(tmp_path))
    assert row.headline == f"{failures} failures in 120 SIGKILL and SIGINT trials"
    assert row.verdict == ("holds" if failures == 0 else "not met")


@pytest.mark.parametrize("step_ratio, speed", [(1.25, "0.80"), (0.5, "2.00")])
def test_step_time_ratios_are_written_as_speed(tmp_path, step_ratio, speed):
    """A step-time ratio to AdamW's is shown inverted: time 1.25× AdamW's is 0.80× its speed."""
    names = ("Gefen-8bit", "Gefen-4bit", "Gefen-8bit-factored", "Gefen-4bit-factored")
    rows = [_row(variant=f"{m}/{n}", metric="step_time_vs_adamw", x_name="threads", x_value=1, value=step_ratio)
            for m in ("transformer", "mlp", "small-tensors") for n in names]
    rows += [_row(variant=n, metric="launches_per_step", x_name="tensors", x_value=40, value=3) for n in names]
    _write_csv(tmp_path / "gefen_speed.csv", rows)
    row = claims.gefen_speed(claims.Results(tmp_path))
    assert f"{speed}–{speed}× fused AdamW" in row.headline
    assert row.verdict.startswith("met" if step_ratio < 1 else "not met")


def test_check_fails_on_a_hand_edit_and_passes_after_writing(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{claims.BEGIN}\n| hand | written |\n{claims.END}\n\nafter\n")
    assert claims.main(["--readme", str(readme), "--check"]) == 1
    assert claims.main(["--readme", str(readme)]) == 0
    assert claims.main(["--readme", str(readme), "--check"]) == 0
    text = readme.read_text()
    assert text.startswith("# x\n\n") and text.endswith("\n\nafter\n")
