"""``python analysis/convergence_long.py``: the encoder trained 3,000 steps (``python
experiments/convergence.py --experiment convergence_long``): does the gap to AdamW grow with training?"""

from analysis.convergence import arch_main, arch_report

REPORT = arch_report("encoder", "convergence_long", ", 3,000 steps")

if __name__ == "__main__":
    arch_main(REPORT, __doc__)
