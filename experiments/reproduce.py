"""Run every experiment, then every analysis script: the repository's main job.

    # the full CPU run whose CSVs and figures are committed (results/*.csv, paper_figs/*.png)
    python experiments/reproduce.py

    # small sizes, a smoke test: writes results/quick/ (CSVs, figures and a README without verdicts)
    python experiments/reproduce.py --quick

    # one or a few experiments only
    python experiments/reproduce.py --quick --only dsa_throughput codebook_dp

Experiments run one after another, each in its own process (a crash or an out-of-memory in one
does not take the others down, and no two measurements share the CPU); then each analysis script
draws its figure and writes its README section: into paper_figs/ and results/README.md for the
committed results/ only; any other results folder, the quick one included, gets them beside its CSVs
(see analysis/common.py); a run into the committed results/ ends with analysis/claims.py, which
rewrites the README's claims table from the CSVs. The exit status is non-zero if any step failed; a
summary lists each step's status and time, and the total. GPU-only scripts (bench_dsa_gpu,
bench_kernels, profile_step) are not part of this run: they are the prepared checks for a GPU.
"""

from __future__ import annotations

if not __package__:  # run as a file: stop with the install command if the repository is not installed
    from pathlib import Path as _Path
    from runpy import run_path as _run_path

    _run_path(str(_Path(__file__).resolve().parents[1] / "experiments" / "harness" / "install_check.py"))

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from experiments.harness.common import FIGS_DIR, REPO_ROOT, RESULTS_DIR, refuse_committed_outputs, results_dir

# experiment script -> the analysis scripts that read its CSV, in the order results/README.md shows their
# sections (Disk Sparse Adam, Gefen, the Triton kernels); a script runs after those whose CSVs it reads
EXPERIMENTS = {
    "correctness": ["correctness"],
    "dsa_throughput": ["dsa_throughput"],
    "dsa_seed_benchmark": ["dsa_seed_benchmark"],
    "dsa_billions": ["dsa_billions"],
    "dsa_out_of_core": ["dsa_out_of_core"],
    "dsa_fault_injection": ["dsa_fault_injection"],
    "dsa_distributed": ["dsa_distributed"],
    "poincare": ["poincare"],
    "gefen_memory": ["gefen_memory"],
    "convergence": ["convergence", "convergence_encoder", "convergence_llama", "convergence_long",
                    "convergence_long_lr", "convergence_bf16"],
    "gefen_ablation": ["gefen_ablation"],  # one page of every ablation's CSV
    "hessian_alignment": ["hessian_alignment"],
    "codebook_dp": ["codebook"],
    "gefen_speed": ["gefen_speed"],
    "gefen_peak_memory": ["gefen_peak_memory"],
    "gefen_budgets": ["gefen_budgets"],  # starts its searches from the peaks' CSV
    "gefen_distributed": ["gefen_distributed"],  # reads the budgets' largest micro-batches
    "kernel_resources": ["kernel_resources"],
}
# experiment script -> more runs of it with these arguments (each its own results file)
MORE_RUNS = {
    "convergence": [["--experiment", "convergence_bf16", "--size", "large", "--extra", "none", "--optimizers",
                     "AdamW", "AdamW+bf16", "Gefen-8bit-factored", "Gefen-8bit+bf16-sr", "Gefen-8bit-factored+bf16-sr"],
                    ["--experiment", "convergence_encoder"], ["--experiment", "convergence_llama"],
                    ["--experiment", "convergence_long"], ["--experiment", "convergence_long_lr"]],
    "gefen_ablation": [["--ablation", name] for name in (
        "gefen_ablation_arch", "gefen_ablation_long", "gefen_ablation_layout", "gefen_ablation_column",
        "gefen_ablation_vectors", "gefen_ablation_4bit", "gefen_ablation_refresh", "gefen_ablation_factor16",
        "gefen_ablation_vectors4", "gefen_ablation_scales4", "gefen_ablation_long_best",
        "gefen_ablation_refresh_models", "gefen_ablation_leave_out4", "gefen_ablation_seeds",
        "gefen_ablation_seeds_fp32m", "gefen_ablation_where", "gefen_ablation_leave_out",
        "gefen_ablation_candidates", "gefen_ablation_candidates_models", "gefen_ablation_bound",
        "gefen_ablation_candidates_long")],
    # experiments/gefen_ablation.py's ABLATIONS after the first (named here: importing it imports torch)
}
# arguments of MORE_RUNS that set a full run's size: a quick run leaves them out and gets its quick size
FULL_SIZE_FLAGS = ("--size",)


def run_arguments(extra, quick):
    """``extra`` (one of MORE_RUNS), less its FULL_SIZE_FLAGS and their values for a quick or check run
    (``quick`` true), which gets its own size."""
    if not quick:
        return list(extra)
    out, skip = [], False
    for arg in extra:
        if skip:
            skip = False
        elif arg in FULL_SIZE_FLAGS:
            skip = True
        else:
            out.append(arg)
    return out


# analysis script -> the figure it draws (None: a results/README.md section only)
FIGURE_OF = {"correctness": None, "dsa_fault_injection": None, "dsa_throughput": "dsa_throughput", "dsa_seed_benchmark": "dsa_seed_benchmark", "dsa_billions": None, "dsa_out_of_core": "dsa_out_of_core", "dsa_distributed": "dsa_distributed", "poincare": "poincare", "codebook": "codebook",
             "gefen_memory": "gefen_memory", "gefen_speed": "gefen_speed", "gefen_peak_memory": "gefen_peak_memory",
             "gefen_budgets": "gefen_budgets", "gefen_distributed": "gefen_distributed", "gefen_ablation": "gefen_ablation", "hessian_alignment": "hessian_alignment",
             "convergence": "convergence", "convergence_bf16": "convergence_bf16",
             "convergence_encoder": "convergence_encoder", "convergence_llama": "convergence_llama",
             "convergence_long": "convergence_long",
             "convergence_long_lr": "convergence_long_lr", "kernel_resources": None}


def _run(cmd, log, timeout):
    start = time.perf_counter()
    print(f"\n$ {' '.join(map(str, cmd))}", flush=True)
    try:
        proc = subprocess.run(list(map(str, cmd)), cwd=REPO_ROOT, timeout=timeout)
        ok = proc.returncode == 0
        status = "ok" if ok else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        ok, status = False, f"timeout after {timeout}s"
    script = Path(cmd[1])
    log.append((f"{script.parent.name}/{script.stem}", status, time.perf_counter() - start))
    return ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="small sizes, a smoke test: CSVs, figures and README into results/quick")
    parser.add_argument("--check", action="store_true",
                        help="each experiment at its check size (its claim in minutes), then its analysis, into "
                             "results/check; each prints its verdict beside the committed run's")
    parser.add_argument("--only", nargs="+", choices=sorted(EXPERIMENTS), help="run just these experiments")
    parser.add_argument("--wandb", choices=["offline", "online", "disabled"], default=None)
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="default: results/quick for --quick, results/check for --check, else results")
    parser.add_argument("--figs-dir", type=Path, default=None,
                        help="default: paper_figs for the committed results/, else beside the results")
    parser.add_argument("--timeout", type=int, default=None, help="seconds per step (default 900 quick, none full)")
    args = parser.parse_args(argv)
    if args.quick and args.check:
        parser.error("--quick and --check are two sizes: pass one")
    size = "quick" if args.quick else "check" if args.check else None

    results = args.results_dir or results_dir(args.quick, args.check)
    if size:  # before any step: each experiment would refuse it too
        refuse_committed_outputs(results, [p.name for p in results.glob("*")], kind=size)
    results.mkdir(parents=True, exist_ok=True)
    if args.figs_dir:
        args.figs_dir.mkdir(parents=True, exist_ok=True)
    timeout = args.timeout or (900 if size else None)
    names = args.only or list(EXPERIMENTS)
    env_py = sys.executable
    start = time.perf_counter()
    log: list[tuple[str, str, float]] = []
    for name in names:
        for extra in [[]] + MORE_RUNS.get(name, []):
            cmd = [env_py, REPO_ROOT / "experiments" / f"{name}.py", "--results-dir", results,
                   *run_arguments(extra, size is not None)]
            if size:
                cmd.append(f"--{size}")
            if args.wandb:
                cmd += ["--wandb", args.wandb]
            _run(cmd, log, timeout)
    for name in names:
        for fig in EXPERIMENTS[name]:
            cmd = [env_py, REPO_ROOT / "analysis" / f"{fig}.py", "--results-dir", results]
            if args.figs_dir and FIGURE_OF[fig] is not None:
                cmd += ["--out", args.figs_dir / f"{FIGURE_OF[fig]}.png"]
            _run(cmd, log, timeout)
    committed = size is None and results.resolve() == RESULTS_DIR.resolve()
    if committed:  # the README's claims table is read from the committed CSVs
        _run([env_py, REPO_ROOT / "analysis" / "claims.py"], log, timeout)

    print("\nstep                                             status          seconds")
    for step, status, secs in log:
        print(f"{step[-48:]:<48} {status:<15} {secs:8.1f}")
    failed = [s for s in log if s[1] != "ok"]
    print(f"{'total':<48} {'':<15} {time.perf_counter() - start:8.1f}")
    figs = args.figs_dir or (FIGS_DIR if committed else results)
    print(f"\n{len(log) - len(failed)}/{len(log)} steps ok; results in {results}, figures in {figs}")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
