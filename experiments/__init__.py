"""Experiments: one script per claim on one shared harness (``experiments/harness/common.py``)."""

from experiments.harness.checkout import use_own_checkout

use_own_checkout(__file__)
