"""What every claim row uses: the results a row reads (``Results``), its cells (``Row``), loss ratios
paired by seed across runs, test reports and the formatting of figures in them."""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from analysis.common import ResultsError, is_quick, load_config, load_rows, select, value
from experiments.harness.common import RESULTS_DIR


@dataclass(frozen=True)
class Row:
    claim: str
    verdict: str
    headline: str
    figure: str
    command: str
    detail: str = ""  # the conditions and caveats behind the headline, formatted from the same data


class Results:
    """The CSVs of one results folder, each read once; ``need`` is a value that must be there.
    ``read`` lists the experiments read since it was last emptied (the detail names their runs)."""

    def __init__(self, results_dir=RESULTS_DIR):
        self.dir = Path(results_dir)
        self._rows = {}
        self.read = []

    def rows(self, experiment, *metrics):
        if experiment not in self._rows:
            if is_quick(self.run(experiment), self.dir):  # a smoke test's rows are no evidence for a claim
                raise ResultsError(f"{self.dir / experiment}.csv: a quick run's results, a smoke test and no evidence; "
                                   f"the claims read full runs only: rerun experiments/{experiment.split('/')[-1]}.py "
                                   "without --quick")
            self._rows[experiment] = load_rows(experiment, self.dir)
        if experiment not in self.read:
            self.read.append(experiment)
        rows = self._rows[experiment]
        load_rows_check(rows, experiment, self.dir, metrics)
        return rows

    def config(self, experiment) -> dict:
        """The run's settings (the config's ``config``), {} without a config file."""
        return self.run(experiment).get("config") or {}

    def run(self, experiment) -> dict:
        """The run's whole config file (commit, device, command, settings), {} without one."""
        path = self.dir / experiment
        return load_config(path.name, path.parent)

    def values(self, experiment, metric, variant, **where) -> list:
        """Every value of (metric, variant[, columns]), one per seed or x; at least one."""
        vals = [r["value"] for r in select(self.rows(experiment, metric), metric, variant, **where)]
        if not vals:
            raise ResultsError(f"{self.dir / experiment}.csv: no value of {metric} for {variant}; "
                               f"rerun experiments/{experiment.split('/')[-1]}.py")
        return vals

    def at_end(self, experiment, metric, variant, pick=max) -> dict:
        """The row of (metric, variant) at its largest x (``pick=min``: its smallest): the last step,
        the most ranks; at least one."""
        rows = select(self.rows(experiment, metric), metric, variant)
        if not rows:
            raise ResultsError(f"{self.dir / experiment}.csv: no value of {metric} for {variant}; "
                               f"rerun experiments/{experiment.split('/')[-1]}.py")
        return pick(rows, key=lambda r: float(r["x_value"]))

    def variants(self, experiment, metric) -> list:
        """The variants that have ``metric``, in the run's order."""
        return list(dict.fromkeys(r["variant"] for r in select(self.rows(experiment, metric), metric)))

    def median(self, experiment, metric, variant, **where) -> float:
        return statistics.median(self.values(experiment, metric, variant, **where))

    def need(self, experiment, metric, variant, **where) -> float:
        x = value(self.rows(experiment, metric), metric, variant, **where)
        if not math.isfinite(x):
            detail = ", ".join(f"{k}={v}" for k, v in where.items())
            raise ResultsError(f"{self.dir / experiment}.csv: no value of {metric} for {variant}"
                               + (f" ({detail})" if detail else "") + f"; rerun experiments/{experiment.split('/')[-1]}.py")
        return x


def load_rows_check(rows, experiment, results_dir, metrics):
    missing = sorted(set(metrics) - {r["metric"] for r in rows})
    if missing:
        raise ResultsError(f"{Path(results_dir) / experiment}.csv: no rows of metric(s) {missing}; "
                           f"rerun experiments/{experiment.split('/')[-1]}.py")


# --------------------------------------------------------------------- loss ratios paired by seed
def seed_change(R, e, short, variant, seeds):
    """(mean, standard error) in points of ``variant``'s loss ratio in ``e`` less its ratio in
    ``short``, paired by seed over ``seeds``."""
    ratio = [{r["seed"]: r["value"] for r in select(R.rows(x, "val_loss_vs_adamw"), "val_loss_vs_adamw", variant)}
             for x in (e, short)]
    d = [(ratio[0][k] - ratio[1][k]) * 100 for k in sorted(seeds) if k in ratio[0] and k in ratio[1]]
    if len(d) < 2:
        raise ResultsError(f"{R.dir / e}.csv, {R.dir / short}.csv: fewer than two seeds of {variant} in both")
    return statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d))


TAIL = 3  # evaluations at the end of a run whose loss ratios a tail mean averages


def tail_ratio(R, e, variant, seeds, base="dropin/AdamW"):
    """Median over ``seeds`` of ``variant``'s mean loss ratio to ``base`` over the run's last ``TAIL``
    evaluations, paired by seed and step: less sensitive than the final loss to one evaluation."""
    curves = {v: {} for v in (variant, base)}
    for v in curves:
        for r in select(R.rows(e, "val_loss"), "val_loss", v):
            if r["seed"] in seeds:
                curves[v].setdefault(r["seed"], {})[r["x_value"]] = r["value"]
    per_seed = []
    for k, own in curves[variant].items():
        steps = sorted(own)[-TAIL:]
        if len(steps) < TAIL or any(x not in curves[base].get(k, {}) for x in steps):
            raise ResultsError(f"{R.dir / e}.csv: no val_loss of {base} at {variant}'s last steps (seed {k})")
        per_seed.append(statistics.fmean(own[x] / curves[base][k][x] for x in steps))
    if not per_seed:
        raise ResultsError(f"{R.dir / e}.csv: no val_loss of {variant}")
    return statistics.median(per_seed)


# ------------------------------------------------------------------------------------ test reports
def junit_counts(path) -> dict:
    """Passed, failed and skipped counts of a pytest JUnit XML file."""
    import xml.etree.ElementTree as ET

    try:
        suites = ET.parse(path).getroot().iter("testsuite")
    except (OSError, ET.ParseError) as exc:
        raise ResultsError(f"{path}: not a test report ({exc})") from None
    n = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in n:
            n[k] += int(s.get(k, 0))
    return {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
            "failed": n["failures"] + n["errors"], "skipped": n["skipped"]}


# ------------------------------------------------------------------------------------- formatting
def pct(ratio) -> str:
    """A loss ratio to AdamW's as a signed percentage: 1.0028 -> "+0.28%"."""
    return f"{(ratio - 1) * 100:+.2f}%".replace("-", "−")


def times(x, digits=2) -> str:
    return f"{x:.{digits}f}×"


def span(xs, digits=2) -> str:
    """"a–b×" for the smallest and largest of ``xs``."""
    return f"{min(xs):.{digits}f}–{max(xs):.{digits}f}×"


def sci(x, digits=2) -> str:
    """A small number in short scientific notation: 1.3e-06 -> "1.3e-6"; 0 -> "0"."""
    return "0" if x == 0 else re.sub(r"e([+-])0*(\d)", r"e\1\2", f"{x:.{digits - 1}e}").replace("e+", "e")


def pct_range(ratios) -> str:
    """"a .. b" for the smallest and largest loss ratio, as signed percentages."""
    return f"{pct(min(ratios))} .. {pct(max(ratios))}"


def points(a, b) -> str:
    """The difference of two loss ratios in percentage points: "+0.26 points"."""
    return f"{(a - b) * 100:+.2f} points".replace("-", "−")


def signed(x, digits=2) -> str:
    """"+0.09" / "−0.41" (a typographic minus, as ``pct``)."""
    return f"{x:+.{digits}f}".replace("-", "−")


def mib(n_bytes, digits=1) -> str:
    return f"{n_bytes / 2 ** 20:,.{digits}f} MiB"


def gib(n_bytes, digits=1) -> str:
    return f"{n_bytes / 2 ** 30:,.{digits}f} GiB"


def listed(items) -> str:
    """"a", "a and b", "a, b and c"."""
    items = list(items)
    return " and ".join(items) if len(items) < 3 else ", ".join(items[:-1]) + " and " + items[-1]


def joined(xs, form) -> str:
    """"a / b / c", each formatted by ``form``."""
    return " / ".join(form(x) for x in xs)


def thousands(x) -> str:
    return f"{x:,.0f}"


def fig(name) -> str:
    return f"[{name}.png](paper_figs/{name}.png)"


def cmd(text) -> str:
    return f"`{text}`"


def median_over_seeds(rows, metric, variant, seeds=None, **where):
    vals = [r["value"] for r in select(rows, metric, variant, **where) if seeds is None or r["seed"] in seeds]
    return statistics.median(vals) if vals else math.nan
