"""The ablation on the architectures Gefen was not developed on (``python experiments/gefen_ablation.py
--experiment gefen_ablation_arch``): analysis/gefen_ablation.py's figure and table, the findings by
the median over seeds (as the issue's targets), the factored 8-bit's +0.3% target dashed.
``python analysis/gefen_ablation_arch.py``"""

import functools

from analysis.common import Report, main
from analysis.gefen_ablation import body, draw

REPORT = Report("gefen_ablation_arch", "gefen_ablation_arch",
                "Gefen: what the factored second moment leaves on the encoder and Llama-style models (ablation)",
                functools.partial(body, center="median"),
                functools.partial(draw, target=1.003, title="Gefen 8-bit factored: v per element on one kind of tensor"),
                metrics=("val_loss_vs_adamw",))

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
