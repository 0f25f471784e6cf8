"""``python analysis/convergence_long_lr.py``: the encoder trained 3,000 steps at the 1,000-step run's
drop-in lr held fixed (``python experiments/convergence.py --experiment convergence_long_lr``).

The body of analysis/convergence_long.py: with the lr the same at both lengths, a gap that grows
from 1,000 to 3,000 steps is the training length's."""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import dataclasses

from analysis.convergence import arch_main
from analysis.convergence_long import REPORT as LONG

REPORT = dataclasses.replace(LONG, name="convergence_long_lr", experiment="convergence_long_lr",
                             title=LONG.title + " at the 1,000-step lr")

if __name__ == "__main__":
    arch_main(REPORT, __doc__)
