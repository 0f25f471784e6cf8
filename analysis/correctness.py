"""README section (no figure): how far each optimizer is from its independent reference.

    python analysis/correctness.py [--results-dir results]

Reads ``correctness.csv``: one variant per comparison (``"<ours> vs <reference>"``), metrics
``max_abs_err`` and ``rel_rms_err`` of the weights after ``x_value`` steps from the same start on
the same random batches. The section is one table of both errors per comparison.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

from analysis.common import Report, fmt, main, md_table, select, value, variants


def body(rows, config):
    on_gpu = any(r["device"].startswith("cuda") for r in rows)
    table = []
    for v in variants(rows, "max_abs_err"):
        steps = select(rows, "max_abs_err", v)[0]["x_value"]
        mx, rr = value(rows, "max_abs_err", v), value(rows, "rel_rms_err", v)
        table.append([v, fmt(steps), fmt(mx, 2), fmt(rr, 2), "yes" if mx == 0 else ""])
    exact = sum(1 for row in table if row[-1])
    return "\n\n".join([
        "Each comparison runs ours and the reference from the same start on the same random batches and "
        "compares the weights at the end. DiskSparseAdam is compared with `torch.optim.SparseAdam`, "
        "DiskSparseRiemannianAdam with geoopt's `SparseRiemannianAdam` (float64), Gefen with both "
        "switches off with `torch.optim.AdamW`, and each Triton backend with the torch backend"
        + ("." if on_gpu else " (under `TRITON_INTERPRET=1` on CPU)."),
        md_table(["comparison", "steps", "max abs error", "rel. RMS", "bitwise equal"], table),
        f"{exact} of {len(table)} comparisons are bitwise equal. The test suite holds the same "
        "comparisons to fixed tolerances on fresh random problems.",
        "Gefen's backends give the reference's scales and codes exactly for one step from the same "
        "state (tests/test_gefen_first_moment.py). Over many steps p and v drift apart by float "
        "rounding (the order of the block sums of g², and torch's CPU `sqrt`, which is not always "
        "correctly rounded); once a first-moment value crosses a code boundary the runs differ by one "
        "codebook gap times the scale. The 8-bit codebook's gaps are 16 times narrower than the "
        "4-bit one's, which is why its Triton-vs-torch error is the larger.",
    ])


REPORT = Report("correctness", "correctness", "Correctness against independent references", body,
                metrics=("max_abs_err", "rel_rms_err"))

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
