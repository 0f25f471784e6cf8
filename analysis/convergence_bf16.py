"""Figure and README section: Gefen on bf16 weights with stochastic rounding against fp32 AdamW.

    python analysis/convergence_bf16.py [--results-dir results] [--out paper_figs/convergence_bf16.png]

Reads ``convergence_bf16.csv``, a run of experiments/convergence.py with ``--experiment
convergence_bf16`` (its module docstring has the command), in convergence.csv's format: the figure
and tables are analysis/convergence.py's, the verdict the bf16 target (within +0.5% of fp32 AdamW's
final validation loss, median over seeds paired by seed).
"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import functools

from analysis.common import Report, main
from analysis.convergence import bf16_headline, body, draw

REPORT = Report("convergence_bf16", "convergence_bf16", "Gefen on bf16 weights with stochastic rounding", body,
                functools.partial(draw, headline=bf16_headline),
                metrics=("final_val_loss", "val_loss", "best_lr"))

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
