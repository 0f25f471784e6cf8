"""README section (no figure): DiskSparseAdam trials stopped by SIGKILL or SIGINT, and how each recovered.

    python analysis/dsa_fault_injection.py [--results-dir results]

Reads ``dsa_fault_injection.csv``: per signal (variant ``DiskSparseAdam/SIGKILL``, ``/SIGINT``; a
file from before SIGINT trials has only ``DiskSparseAdam``) and phase the process last reported
(x_value; "all" for totals), the counts ``trials``, ``refused_dirty``, ``accepted_clean``,
``bitwise_continuations`` and ``failures``. The section is one table of them per signal and phase
and the verdict.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

from analysis.common import Report, duration, fmt, main, md_table, select

METRICS = ("trials", "refused_dirty", "accepted_clean", "bitwise_continuations", "failures")


def body(rows, config):
    totals = {(r["metric"], r["x_value"]): r["value"] for r in select(rows, variant="DiskSparseAdam")}
    signals = sorted({r["variant"] for r in rows if r["variant"].startswith("DiskSparseAdam/")}) or ["DiskSparseAdam"]
    table = []
    for variant in signals:
        by = {(r["metric"], r["x_value"]): r["value"] for r in select(rows, variant=variant)}
        phases = [r["x_value"] for r in select(rows, "trials", variant) if r["x_value"] != "all"]
        sig = variant.partition("/")[2] or "SIGKILL"
        table += [[sig, p, *(fmt(by.get((m, p), 0)) for m in METRICS)] for p in [*phases, "all"]]
    total, failures = totals[("trials", "all")], totals[("failures", "all")]
    wall = totals.get(("wall_time", "all"))
    cfg = config.get("config", {})
    return "\n\n".join([
        (f"Each trial process restores a checkpoint into a fresh state_dir, trains a "
        f"{cfg.get('rows', '?')} x {cfg.get('dim', '?')} table (batches of {cfg.get('batch', '?')} indices "
        f"drawn from {cfg.get('hot_rows', '?')} rows) to step {cfg.get('total_steps', '?')}, and checkpoints "
        f"every {cfg.get('checkpoint_every', '?')} steps (torch.save of model and optimizer state, then "
        "`flush()`); at a random event of a target phase it gets SIGKILL or SIGINT (Ctrl-C: the optimizer's "
        "`with` block closes it, a step or load cut short must leave the files dirty, and the script saves its "
        "model weights at the step it reached). Reopening its state_dir with `resume=True` is either refused "
        "(StateFileError: then the newest checkpoint is restored into a new state_dir) or accepted (then the "
        "model weights saved at the files' step are loaded); training on must give weights bitwise equal to "
        "an uninterrupted `torch.optim.SparseAdam` run. The phase is the one the process reported last."),
        md_table(["signal", "phase", "trials", "refused (dirty)", "accepted (clean)", "bitwise continuations",
                  "failures"], table),
        (f"{fmt(failures)} failures in {fmt(total)} trials"
         + (f" ({duration(wall)} for all trials)." if wall is not None else ".")
         + (" Every signal left a state_dir that was either refused or, when accepted, continued exactly."
           if failures == 0 else " A failure is a state_dir accepted but continuing differently, a torn "
           "checkpoint, or an error other than StateFileError.")),
    ])


REPORT = Report("dsa_fault_injection", "dsa_fault_injection", "Disk Sparse Adam under SIGKILL and SIGINT", body,
                metrics=METRICS)

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
