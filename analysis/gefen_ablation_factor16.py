"""The column factor per square tile under 4-bit codes, in fp32 and in bf16
(``python experiments/gefen_ablation.py --experiment gefen_ablation_factor16``): analysis/gefen_ablation.py's
figure and table on the encoder at 1,000 steps, 4-bit codes: the factor with fp32 and bf16 column
factors, and Gefen-4bit-compact's layout with one column factor a matrix, one per square tile, and one
per square tile in bf16, the findings by the median over seeds, the factored 4-bit's +0.6% target
dashed. ``python analysis/gefen_ablation_factor16.py``"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    import _install_check  # noqa: F401

from analysis.common import main
from analysis.gefen_ablation import factored_report

REPORT = factored_report("gefen_ablation_factor16",
                         "Gefen: column factors per tile in bf16 under 4-bit codes (encoder, ablation)",
                         "Gefen 4-bit factored: the column factor per tile, fp32 and bf16", target=1.006)

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
