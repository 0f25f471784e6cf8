"""The drop-in protocol at 15 seeds (``python experiments/gefen_ablation.py --experiment
gefen_ablation_seeds``): analysis/gefen_ablation.py's figure and table on the encoder and the 116k
GPT at their steps and AdamW's best lr there, the factored 8-bit, Gefen-4bit-factored and gefen-x,
the findings by the median over seeds, the factored 8-bit's +0.3% target dashed.
``python analysis/gefen_ablation_seeds.py``"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    import _install_check  # noqa: F401

from analysis.common import main
from analysis.gefen_ablation import factored_report

REPORT = factored_report("gefen_ablation_seeds", "Gefen: the drop-in protocol on many seeds (ablation)",
                         "Gefen factored, 8-bit and 4-bit, against AdamW at its lr")

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
