"""Whether learning the codebook again every 100 steps helps 4-bit codes beyond the encoder
(``python experiments/gefen_ablation.py --experiment gefen_ablation_refresh_models``):
analysis/gefen_ablation.py's figure and table on each of the five convergence configurations at its
own steps and AdamW's best lr there, the factored 4-bit without and with ``codebook_refresh_every=100``,
the findings by the median over seeds, the factored 4-bit's +0.6% target dashed.
``python analysis/gefen_ablation_refresh_models.py``"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    import _install_check  # noqa: F401

from analysis.common import main
from analysis.gefen_ablation import factored_report

REPORT = factored_report("gefen_ablation_refresh_models",
                         "Gefen: the codebook learned again under 4-bit codes on five models (ablation)",
                         "Gefen 4-bit factored: the codebook learned again every 100 steps", target=1.006)

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
