"""The factored 8-bit with its first moment in fp32 on gefen_ablation_seeds' runs (``python
experiments/gefen_ablation.py --experiment gefen_ablation_seeds_fp32m``): analysis/gefen_ablation.py's
figure and table on the encoder and the 116k GPT at their steps and AdamW's best lr there, 15 seeds,
the findings by the median over seeds, the factored 8-bit's +0.3% target dashed.
``python analysis/gefen_ablation_seeds_fp32m.py``"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    import _install_check  # noqa: F401

from analysis.common import main
from analysis.gefen_ablation import factored_report

REPORT = factored_report("gefen_ablation_seeds_fp32m",
                         "Gefen: the factored 8-bit's first moment in fp32 on many seeds (ablation)",
                         "Gefen 8-bit factored: its first moment in fp32")

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
