"""Does the factored 8-bit Gefen's gap at AdamW's best 3,000-step lr come from one difference from
Gefen-X's state (``python experiments/gefen_ablation.py --experiment gefen_ablation_long_best``):
analysis/gefen_ablation.py's figure and table on the encoder at 3,000 steps and lr 8e-3, the code
rounding and each layout option alone on top of the factor, the whole layout, gefen-x beside them;
the findings by the median over seeds, the factored 8-bit's +0.3% target dashed.
``python analysis/gefen_ablation_long_best.py``"""

from analysis.common import main
from analysis.gefen_ablation import factored_report

REPORT = factored_report("gefen_ablation_long_best",
                         "Gefen: each difference from Gefen-X at AdamW's best 3,000-step lr (encoder, ablation)",
                         "Gefen 8-bit factored at 3,000 steps, AdamW's best lr: one change each")

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
