"""``python analysis/convergence_long.py``: the encoder trained 3,000 steps (``python
experiments/convergence.py --experiment convergence_long``): does the gap to AdamW grow with training?

analysis/convergence.py's figure and tables, then each optimizer's median ratio to AdamW at 3,000
steps against the same seeds' at 1,000 steps in the drop-in protocol of ``convergence_encoder.csv``
(where that file is in the results folder): the target is a gap no larger at 3,000 steps."""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import dataclasses
import math
import statistics

import functools

from analysis.claims_common import median_over_seeds, pct
from analysis.common import md_table, select, value
from analysis.convergence import DROPIN, arch_main, arch_report, body, draw

SHORT = "convergence_encoder"


def long_body(rows, config):
    short = config.get("other_rows", {}).get(SHORT)
    growth = gap_growth(rows, short) if short else f"`{SHORT}.csv` is not in the results folder: no comparison."
    return body(rows, config) + "\n\n" + growth


def _per_seed(rows):
    """{variant: {seed: final loss / AdamW's}} of the drop-in protocol."""
    out = {}
    for r in rows:
        if r["metric"] == "val_loss_vs_adamw" and r["variant"].startswith(DROPIN):
            out.setdefault(r["variant"].removeprefix(DROPIN), {})[str(r["seed"])] = r["value"]
    return out


def _lr_of(rows, name):
    """The drop-in lr of ``name`` (the x value of its final losses)."""
    return next((float(r["x_value"]) for r in rows if r["metric"] == "final_val_loss" and r["x_name"] == "lr"
                 and r["variant"] == DROPIN + name), math.nan)


def gap_growth(rows, short_rows):
    """The table and verdict: per optimizer the median over the long run's seeds of its ratio at
    1,000 steps (``short_rows``, same seeds) and at 3,000."""
    long, short = _per_seed(rows), _per_seed(short_rows)
    table = []
    for name, per in long.items():
        if name == "AdamW" or name not in short:
            continue
        seeds = sorted(set(per) & set(short[name]))
        if not seeds:
            continue
        at_long = statistics.median(per[s] for s in seeds)
        at_short = statistics.median(short[name][s] for s in seeds)
        ok = at_long <= at_short
        table.append([name, f"{at_short - 1:+.2%}", f"{at_long - 1:+.2%}", f"{at_long - at_short:+.2%}",
                      "**met**" if ok else "**not met**"])
    if not table:
        return ""
    head = ["optimizer", "median vs AdamW, 1,000 steps", "3,000 steps", "change", "gap no larger"]
    return (f"Does the gap grow with training? The drop-in protocol at 1,000 steps (`{SHORT}`, AdamW's best lr "
            f"{_lr_of(short_rows, 'AdamW'):g}) and at 3,000 steps (this run, AdamW's best lr "
            f"{_lr_of(rows, 'AdamW'):g}), medians over the seeds both ran (paired by seed):\n\n"
            + md_table(head, table))


def _steps(rows) -> str:
    """The run's training length, "1,000 steps" (the last step it evaluated); "the run" where it
    logged no evaluations."""
    steps = [float(r["x_value"]) for r in select(rows, "val_loss")]
    return f"{int(max(steps)):,} steps" if steps else "the run"


def long_headline(rows, config) -> str:
    """The factored 8-bit and 4-bit at this run's length and at the short run's on the same seeds,
    drop-in medians over seeds (the claims table's "… and after 3,000 steps")."""
    names = [DROPIN + f"Gefen-{b}-factored" for b in ("8bit", "4bit")]
    long = [value(rows, "val_loss_vs_adamw_median", n) for n in names]
    short = config.get("other_rows", {}).get(SHORT)
    if not short:
        return f"Gefen factored (ours), drop-in: 8-bit {pct(long[0])}, 4-bit {pct(long[1])} vs AdamW's loss (median of seeds)"
    seeds = {r["seed"] for r in select(rows, "val_loss_vs_adamw")}
    before = [median_over_seeds(short, "val_loss_vs_adamw", n, seeds) for n in names]
    return (f"Gefen factored (ours), drop-in: 8-bit {pct(long[0])} ({_steps(short)}: {pct(before[0])}), 4-bit "
            f"{pct(long[1])} ({pct(before[1])}) vs AdamW's loss at {_steps(rows)} (median of the same seeds)")


REPORT = dataclasses.replace(arch_report("encoder", "convergence_long", ", 3,000 steps"), body=long_body,
                             draw=functools.partial(draw, headline=long_headline), reads=(SHORT,))

if __name__ == "__main__":
    arch_main(REPORT, __doc__)
