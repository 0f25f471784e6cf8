"""What sharing v where the factor keeps it per element costs in loss
(``python experiments/gefen_ablation.py --experiment gefen_ablation_vectors``): analysis/gefen_ablation.py's
figure and table on the encoder at 3,000 steps, the vectors' v shared and v over whole rows of the
matrices the published rule finds no block in, each alone on top of the factor, the findings by the
median over seeds, the factored 8-bit's +0.3% target dashed. ``python analysis/gefen_ablation_vectors.py``"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    import _install_check  # noqa: F401

from analysis.common import main
from analysis.gefen_ablation import factored_report

REPORT = factored_report("gefen_ablation_vectors",
                         "Gefen: v shared on vectors and over whole rows (encoder, 3,000 steps, ablation)",
                         "Gefen 8-bit factored at 3,000 steps: v shared where the factor keeps it per element")

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
