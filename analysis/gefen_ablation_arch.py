"""The ablation on the architectures Gefen was not developed on (``python experiments/gefen_ablation.py
--experiment gefen_ablation_arch``): analysis/gefen_ablation.py's figure and table, the findings by
the median over seeds (as the issue's targets), the factored 8-bit's +0.3% target dashed.
``python analysis/gefen_ablation_arch.py``"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    import _install_check  # noqa: F401

from analysis.common import main
from analysis.gefen_ablation import factored_report

REPORT = factored_report("gefen_ablation_arch",
                         "Gefen: what the factored second moment leaves on the encoder and Llama-style models (ablation)",
                         "Gefen 8-bit factored: v per element on one kind of tensor")

if __name__ == "__main__":
    main(REPORT, doc=__doc__)
