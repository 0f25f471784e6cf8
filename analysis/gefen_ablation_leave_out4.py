"""Which options of the 4-bit compact layout together carry its gap over the factor
(``python experiments/gefen_ablation.py --experiment gefen_ablation_leave_out4``):
analysis/gefen_ablation.py's figure and table on the encoder at 1,000 steps, 4-bit codes, the factor,
Gefen-4bit-compact's layout and that layout with each of its four options left out, the findings by
the median over seeds, the factored 4-bit's +0.6% target dashed. ``python analysis/gefen_ablation_leave_out4.py``"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    import _install_check  # noqa: F401

from analysis.common import main
from analysis.gefen_ablation import factored_report

REPORT = factored_report("gefen_ablation_leave_out4",
                         "Gefen: the 4-bit compact layout with one option left out (encoder, ablation)",
                         "Gefen 4-bit: the compact layout less one option", target=1.006)

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
