"""Analysis: one script per figure, reading the results CSVs (``analysis/common.py``)."""

from experiments.harness.checkout import use_own_checkout

use_own_checkout(__file__)
