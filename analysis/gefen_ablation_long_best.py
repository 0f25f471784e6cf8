"""The factored 8-bit Gefen at 3,000 steps and AdamW's best lr there
(``python experiments/gefen_ablation.py --experiment gefen_ablation_long_best``): analysis/gefen_ablation.py's
figure and table on the encoder at 3,000 steps and lr 8e-3, gefen-x beside it: the factor alone, with
its first moment in fp32, with the codebook learned again every 100 steps and under the compact
layout, the findings by the median over seeds, the factored 8-bit's +0.3% target dashed.
``python analysis/gefen_ablation_long_best.py``"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    import _install_check  # noqa: F401

from analysis.common import main
from analysis.gefen_ablation import factored_report

REPORT = factored_report("gefen_ablation_long_best",
                         "Gefen: the factored 8-bit at 3,000 steps and AdamW's best lr there (encoder, ablation)",
                         "Gefen 8-bit factored at 3,000 steps, lr 8e-3: one change each")

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
