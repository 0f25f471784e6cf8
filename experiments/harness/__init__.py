"""The experiments' harness: command line, results files, children, memory limits, models, data and
the optimizer registry. The experiments themselves are the scripts in ``experiments/``."""
