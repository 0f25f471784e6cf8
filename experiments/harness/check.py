"""The ``--check`` size: an experiment's claim tested in minutes, its verdict printed beside the committed one.

Three sizes of every experiment: ``--quick`` (a smoke test, no verdicts), ``--check`` (a size that
tests the claim in at most about ten minutes on two cores) and the full run (the committed results).
A script declares its check size in one place, as the full run's flags that it overrides, and hands
it to ``add_common_args``::

    CHECK = {"--steps": 100, "--seeds": 2}       # or a function of the parsed args returning such a dict
    CHECK_NOTE = "2 seeds where the claim has 5: a ratio, not its spread"
    add_common_args(parser, check=CHECK, check_note=CHECK_NOTE)
    args = check.parse(parser, argv)

``parse`` puts the CHECK flags before the command line's, so a flag given by hand still wins. A check
run writes under ``results/check/`` and, at its exit (``Results``), prints ``report``: each row of the
claims table that this experiment backs, its headline and verdict computed by ``analysis/claims*.py``
on the check CSV beside the same computed on the committed CSV (``results/<experiment>.csv``). A row
reads the check run's CSV for this experiment and the committed CSVs for any other it needs.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from experiments.harness.common import REPO_ROOT, RESULTS_DIR


def flags(overrides: dict) -> list:
    """Command-line tokens of ``{"--steps": 100, "--seeds": [0, 1], "--no-x": True}``: a value True is
    a switch given alone, a list or tuple a flag of several values."""
    out = []
    for flag, value in overrides.items():
        if not str(flag).startswith("--"):
            raise ValueError(f"CHECK: {flag!r} is no flag; write the full run's flag as on the command line, e.g. '--steps'")
        if value is False or value is None:
            continue
        out.append(flag)
        if value is not True:
            out += [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return out


def describe(check) -> str:
    """The check size in words for ``--help``: its flags, or that it is the full run's size."""
    if callable(check):
        return "flags chosen per " + " ".join((check.__doc__ or "configuration").split()).rstrip(".")
    return " ".join(flags(check or {})) or "the full run's size"


def parse(parser, argv=None):
    """``parser.parse_args(argv)``; with ``--check``, parsed again with the script's check flags
    (``add_common_args(check=...)``) before ``argv``, and ``args.check_note`` set."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if not getattr(args, "check", False):
        return args
    if getattr(args, "quick", False) or getattr(args, "tiny", False):
        parser.error("--check with --quick or --tiny: choose one size (--quick: a smoke test; --check: the claim "
                     "tested in minutes)")
    check, note = getattr(parser, "check_size", ({}, ""))
    overrides = check(args) if callable(check) else check
    args = parser.parse_args(flags(overrides) + argv)
    args.check_note = note
    return args


def _experiment_of(command: str):
    """The experiment a claims row's command runs: ``--experiment`` / ``--ablation`` NAME, else the
    script's name; None for a command that is no experiment script (the GPU checks)."""
    script = re.search(r"experiments/(\w+)\.py", command)
    if not script:
        return None
    named = re.search(r"--(?:experiment|ablation)\s+(\w+)", command[script.end():])
    return named.group(1) if named else script.group(1)


def _mine(name: str, experiment: str) -> bool:
    """Whether a results name the claims read ("dsa_throughput", "gpu/dsa_gpu") is ``experiment``."""
    return name.split("/")[-1] == experiment


def backed_rows(experiment: str, committed=RESULTS_DIR) -> list:
    """The claims rows (functions of ``analysis.claims.ROWS``) that ``experiment`` backs: those whose
    command runs it, else those that read its CSV."""
    from analysis.claims import ROWS
    from analysis.claims_common import Results

    R, runs, reads = Results(committed), [], []
    for row in ROWS:
        R.read = []
        try:
            command = row(R).command
        except Exception:  # a row these results cannot give: its command is unknown, what it read is known
            command = ""
        if _experiment_of(command) == experiment:
            runs.append(row)
        elif any(_mine(name, experiment) for name in R.read):
            reads.append(row)
    return runs or reads


def results_beside(folder, experiment: str, committed=RESULTS_DIR):
    """The claims' ``Results`` of ``committed``, except ``experiment``'s CSV and config, read from ``folder``."""
    from analysis.claims_common import Results, load_rows_check
    from analysis.common import ResultsError, is_quick, load_config, load_rows

    class Beside(Results):
        def run(self, name):
            return load_config(experiment, folder) if _mine(name, experiment) else super().run(name)

        def rows(self, name, *metrics):
            if not _mine(name, experiment):
                return super().rows(name, *metrics)
            if not hasattr(self, "_own"):
                if is_quick(self.run(name), folder):
                    raise ResultsError(f"{Path(folder) / experiment}.csv: a quick run's results, no evidence")
                self._own = load_rows(experiment, folder)
            if name not in self.read:
                self.read.append(name)
            load_rows_check(self._own, experiment, folder, metrics)
            return self._own

    return Beside(committed)


def _shown(path: Path) -> str:
    """``path`` relative to the repository where it lies inside it."""
    path = path.resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def _cells(row, R) -> tuple:
    """(headline: verdict, other experiments read) of one claims row on ``R``, or the reason it cannot be computed."""
    R.read = []
    try:
        r = row(R)
    except Exception as exc:  # a row the check's smaller run cannot give (a model, a variant it lacks) is said, not raised
        return f"not computable here ({type(exc).__name__}: {exc})", None, list(R.read)
    return f"{r.headline}: {r.verdict}", r.claim, list(R.read)


def report(experiment: str, folder, note: str = "", committed=RESULTS_DIR) -> str:
    """The block a check run prints: each claims row ``experiment`` backs, computed by analysis/claims*.py on
    ``folder``'s CSV of it (``check:``) and on the committed one (``committed (full run):``)."""
    from analysis.claims_common import Results

    folder = Path(folder)
    head = (f"[check] {experiment}: the claims on {_shown(folder / experiment)}.csv beside "
            f"{_shown(Path(committed) / experiment)}.csv")
    lines = [head]
    rows = backed_rows(experiment, committed)
    if not rows:
        lines.append("  no row of the claims table reads this experiment; its CSV is the check's whole result")
    checked, full = results_beside(folder, experiment, committed), Results(committed)
    for row in rows:
        mine, claim, read = _cells(row, checked)
        # claims_common names the committed folder in its messages; the check's own CSV is the one read
        mine = mine.replace(f"{Path(committed) / experiment}.csv", f"{_shown(folder / experiment)}.csv")
        theirs, claim_full, _ = _cells(row, full)
        lines.append(f"  {claim or claim_full or row.__name__}")
        lines.append(f"    check:                {mine}")
        lines.append(f"    committed (full run): {theirs}")
        others = [name for name in read if not _mine(name, experiment)]
        if others:
            lines.append(f"    (both read the committed {', '.join(others)} beside this experiment)")
    if note:
        lines.append(f"  check size: {note}")
    return "\n".join(lines)
