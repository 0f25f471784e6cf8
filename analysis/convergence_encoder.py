"""The encoder's run of convergence.py (``--experiment convergence_encoder``): analysis/convergence.py's
figure, tables and verdicts under both protocols.  ``python analysis/convergence_encoder.py``"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    import _install_check  # noqa: F401

from analysis.convergence import arch_main, arch_report

REPORT = arch_report("encoder")

if __name__ == "__main__":
    arch_main(REPORT, __doc__)
