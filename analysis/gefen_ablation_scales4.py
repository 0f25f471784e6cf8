"""Row-group scales of 256 elements under 4-bit codes
(``python experiments/gefen_ablation.py --experiment gefen_ablation_scales4``): analysis/gefen_ablation.py's
figure and table on the encoder at 1,000 steps, 4-bit codes: the factor alone, the compact layout of
Gefen-4bit-compact (scale groups of at most 512 elements), scale groups of at most 256 elements alone
and in that layout, and the same layout with its column factor in bf16, the findings by the median
over seeds, the factored 4-bit's +0.6% target dashed. ``python analysis/gefen_ablation_scales4.py``"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    import _install_check  # noqa: F401

from analysis.common import main
from analysis.gefen_ablation import factored_report

REPORT = factored_report("gefen_ablation_scales4",
                         "Gefen: row-group scales of 256 elements under 4-bit codes (encoder, ablation)",
                         "Gefen 4-bit factored: row-group scales of 256 elements", target=1.006)

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
