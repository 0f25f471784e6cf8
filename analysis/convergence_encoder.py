"""The encoder's run of convergence.py (``--experiment convergence_encoder``): analysis/convergence.py's
figure, tables and verdicts under both protocols.  ``python analysis/convergence_encoder.py``"""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

from analysis.convergence import arch_main, arch_report

REPORT = arch_report("encoder")

if __name__ == "__main__":
    arch_main(REPORT, __doc__)
