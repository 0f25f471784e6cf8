"""What learning the codebook again every 100 steps does for 4-bit codes
(``python experiments/gefen_ablation.py --experiment gefen_ablation_refresh``): analysis/gefen_ablation.py's
figure and table on the encoder at 1,000 steps, 4-bit codes, the factor and Gefen-4bit-compact's
layout each without and with ``codebook_refresh_every=100``, the findings by the median over seeds,
the factored 4-bit's +0.6% target dashed. ``python analysis/gefen_ablation_refresh.py``"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    import _install_check  # noqa: F401

from analysis.common import main
from analysis.gefen_ablation import factored_report

REPORT = factored_report("gefen_ablation_refresh",
                         "Gefen: the codebook learned again under 4-bit codes (encoder, ablation)",
                         "Gefen 4-bit factored: the codebook learned again every 100 steps", target=1.006)

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
