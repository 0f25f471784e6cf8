#!/usr/bin/env bash
# Rehearse experiments/gpu_checks.sh on a CPU with the lent GPU machine's software, so that its first
# minute on a GPU cannot fail on a version difference: Python 3.12, torch 2.11, Triton 3.6, numba,
# and none of the peers (geoopt, gefen, torchao, adam-mini) nor wandb. Triton runs under
# TRITON_INTERPRET=1 and every GPU step in its --dry-run form.
#
#     bash experiments/gpu_checks_rehearsal.sh [VENV] [RESULTS_DIR]   # Default: /tmp/gpu-rehearsal, $VENV/results
#
# The first run makes VENV (PyPI's torch 2.11 wheel brings its CUDA libraries: several GB that run on
# the CPU all the same); later runs reuse it. PYTHON312 names the interpreter (Default: python3.12).
#
# Not part of the verdict here, run and listed as information: the kernels' bitwise tests (Triton
# 3.6's interpreter rounds some of Gefen's kernel arithmetic otherwise than its compiled kernels and
# than newer interpreters; the same tests pass compiled on the GPU with Triton 3.6,
# results/gpu/kernel_tests.xml), and the kernels whose loop bounds are scalars known only at run
# time (Gefen's factored statistics, `range(row0, row1, R)` over loaded rows, and the capturable
# step's hyper-parameter kernel): 3.6's interpreter takes such a bound as a one-element array and
# fails on `int()` of it, where compiled kernels and newer interpreters take it. The scripts'
# dry runs in the verdict use the variants that avoid those kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-/tmp/gpu-rehearsal}"
R="${2:-$VENV/results}"
if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON312:-python3.12}" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q torch==2.11.0 triton==3.6.0 numba numpy pytest pytest-timeout matplotlib tqdm
fi
PY="$VENV/bin/python"
mkdir -p "$R"
export PYTHONPATH="$PWD" TRITON_INTERPRET=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
"$PY" -c "import sys, torch, triton, numba; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'numba', numba.__version__)"
"$PY" - <<'PEERS'
import importlib.util
present = [m for m in ("geoopt", "gefen", "torchao", "adam_mini", "wandb") if importlib.util.find_spec(m)]
assert not present, f"the rehearsal must run without the peers, found {present}"
PEERS
declare -a SUMMARY
step() {  # step NAME COMMAND...: runs every step, lists every status
    local name=$1 start=$SECONDS rc=0
    shift
    echo "=== $name: $*"
    "$@" || rc=$?
    SUMMARY+=("$(printf '%-18s exit %-4s %5ss' "$name" "$rc" "$((SECONDS - start))")")
}
step scripts-dry-run "$PY" -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/test_gpu_scripts_dry_run.py tests/test_profiling.py \
    -k "not profile_step"
step launcher-plugin env LAUNCHER_DEVICE=cpu "$PY" -m pytest -q -p no:cacheprovider -m "slow or not slow" -p tests._device_launchers \
    tests/test_dsa_kernels.py -k "triton and not bad_inputs and not optimizer"
step bench_dsa_gpu "$PY" experiments/bench_dsa_gpu.py --dry-run --results-dir "$R"
step bench_kernels "$PY" experiments/bench_kernels.py --dry-run --skip-upstream --results-dir "$R"
step profile_step "$PY" experiments/profile_step.py --dry-run --results-dir "$R" --gefen-variants AdamW Gefen-8bit
step kernel_resources "$PY" experiments/kernel_resources.py --quick --results-dir "$R" --workers 2
step analysis "$PY" analysis/kernel_resources.py --results-dir "$R"
step gefen_speed "$PY" experiments/gefen_speed.py --parts gpu --dry-run --results-dir "$R"
step analysis-speed "$PY" analysis/gefen_speed.py --results-dir "$R" --out "$R/gefen_speed.png"
VERDICT=("${SUMMARY[@]}")
step capturable-info "$PY" -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/test_gefen_capturable.py -k "cuda_graph or no_host"
step kernel-tests-info "$PY" -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/test_dsa_kernels.py tests/test_gefen_kernels.py \
    -k "triton or gefen_kernels"
echo "=== summary (results in $R; the last line is information only)"
printf '%s\n' "${SUMMARY[@]}"
for s in "${VERDICT[@]}"; do [[ "$s" == *"exit 0 "* ]] || exit 1; done
