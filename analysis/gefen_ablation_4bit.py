"""What one first-moment scale per group of rows costs 4-bit codes
(``python experiments/gefen_ablation.py --experiment gefen_ablation_4bit``): analysis/gefen_ablation.py's
figure and table on the encoder at 1,000 steps, 4-bit codes, the row-group scales of up to 2,048 and
of up to 512 elements, alone and in the whole layout, on top of the factor, the findings by the median
over seeds, the factored 4-bit's +0.6% target dashed. ``python analysis/gefen_ablation_4bit.py``"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    import _install_check  # noqa: F401

from analysis.common import main
from analysis.gefen_ablation import factored_report

REPORT = factored_report("gefen_ablation_4bit", "Gefen: row-group scales under 4-bit codes (encoder, ablation)",
                         "Gefen 4-bit factored: one first-moment scale per group of rows", target=1.006)

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
