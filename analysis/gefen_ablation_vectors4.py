"""The vectors' shared v and whole-row v under 4-bit codes
(``python experiments/gefen_ablation.py --experiment gefen_ablation_vectors4``): analysis/gefen_ablation.py's
figure and table on the encoder at 1,000 steps, 4-bit codes: the factor alone, with the vectors' v
shared (``share_vector_second_moment``) and with whole-row v where the rule finds no block
(``share_matrix_rows``), each alone, the findings by the median over seeds, the factored 4-bit's
+0.6% target dashed. ``python analysis/gefen_ablation_vectors4.py``"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    import _install_check  # noqa: F401

from analysis.common import main
from analysis.gefen_ablation import factored_report

REPORT = factored_report("gefen_ablation_vectors4",
                         "Gefen: v shared on vectors and over whole rows under 4-bit codes (encoder, ablation)",
                         "Gefen 4-bit factored: the vectors' v shared, whole-row v", target=1.006)

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
