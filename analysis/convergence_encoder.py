"""Figure and README section: the encoder architecture's run of experiments/convergence.py.

    python analysis/convergence_encoder.py [--results-dir results] [--out paper_figs/convergence_encoder.png]

Reads ``convergence_encoder.csv`` (``python experiments/convergence.py --experiment convergence_encoder``),
in convergence.csv's format: the figure, tables and verdicts are analysis/convergence.py's, under
both protocols (each optimizer at its best lr, every one at AdamW's).
"""

from analysis.common import main
from analysis.convergence import arch_report

REPORT = arch_report("encoder")

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
