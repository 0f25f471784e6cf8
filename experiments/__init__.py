"""Experiments: one script per claim on one shared harness (``experiments/common.py``)."""

from experiments.checkout import use_own_checkout

use_own_checkout(__file__)
