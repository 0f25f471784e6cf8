"""``python analysis/convergence_llama.py``: figure, tables and verdicts of the Llama-style model's
run (``python experiments/convergence.py --experiment convergence_llama``), as analysis/convergence.py's."""

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

from analysis.convergence import arch_main, arch_report

REPORT = arch_report("llama")

if __name__ == "__main__":
    arch_main(REPORT, __doc__)
