"""Figure and README section: the llama architecture's run of experiments/convergence.py.

    python analysis/convergence_llama.py [--results-dir results] [--out paper_figs/convergence_llama.png]

Reads ``convergence_llama.csv`` (``python experiments/convergence.py --experiment convergence_llama``),
in convergence.csv's format: the figure, tables and verdicts are analysis/convergence.py's, under
both protocols (each optimizer at its best lr, every one at AdamW's).
"""

from analysis.common import main
from analysis.convergence import arch_report

REPORT = arch_report("llama")

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
