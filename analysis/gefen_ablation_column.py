"""What one column factor a matrix, instead of one per square tile of rows, costs in loss
(``python experiments/gefen_ablation.py --experiment gefen_ablation_column``): analysis/gefen_ablation.py's
figure and table on the encoder at 3,000 steps, the option on top of the factor, the findings by
the median over seeds, the factored 8-bit's +0.3% target dashed. ``python analysis/gefen_ablation_column.py``"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    import _install_check  # noqa: F401

from analysis.common import main
from analysis.gefen_ablation import factored_report

REPORT = factored_report("gefen_ablation_column",
                         "Gefen: one column factor a matrix against one per tile (encoder, 3,000 steps, ablation)",
                         "Gefen 8-bit factored at 3,000 steps: one column factor a matrix")

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
