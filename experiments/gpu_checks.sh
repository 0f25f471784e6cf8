#!/usr/bin/env bash
# Every GPU check in one command, each step time-limited (about 9 minutes in all on one H200).
# Run from the repository root on a CUDA machine:
#
#     bash experiments/gpu_checks.sh [RESULTS_DIR]      # Default: results/gpu ("$OUT" on a lent machine)
#
# Steps (each runs even if an earlier one failed; the summary lists every status):
#   1. the Triton kernel tests without the interpreter: tests/test_dsa_kernels.py and
#      tests/test_gefen_kernels.py with the kernels compiled and run on the GPU
#      (tests/_device_launchers.py) -> kernel_tests.xml
#   1b. tests/test_device_moves.py: parameters moved to the GPU after the optimizer was built
#   1c. tests/test_gefen_capturable.py's CUDA-graph tests: Gefen(capturable=True) steps captured in a
#      CUDA graph and replayed, against eager steps -> capturable.xml
#   2. experiments/bench_dsa_gpu.py at the seed's configuration -> dsa_gpu.csv
#   3. experiments/bench_kernels.py at 125M and 1.5B, fp32 and bf16, with the device's copy
#      bandwidth -> gefen_kernels.csv (upstream gefen left out: it needs nvcc and its own build)
#   4. experiments/kernel_resources.py with predicted times at that measured copy bandwidth, and its
#      README section -> kernel_resources.csv, README.md
#   5. experiments/gefen_speed.py's GPU part: Gefen's whole fp32 step (Triton) against fused AdamW's at
#      GPT-2 small's shapes, factored against unfactored, and the torch ops and launches per step on
#      CUDA tensors; its figure and README section -> gefen_speed.csv, gefen_speed.png, README.md
# plus gpu_checks.log (everything printed) and environment.txt (nvidia-smi, versions).
set -u
cd "$(dirname "$0")/.."
R="${1:-results/gpu}"
mkdir -p "$R"
# A lent machine may have python3 only; PYTHON overrides.
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=disabled PYTHONUNBUFFERED=1
exec > >(tee "$R/gpu_checks.log") 2>&1
{ nvidia-smi; "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"; "$PY" -m pip list 2>/dev/null | grep -iE '^(numba|numpy|geoopt|gefen|torchao|wandb|matplotlib|pytest) '; } \
    > "$R/environment.txt" 2>&1
declare -a SUMMARY
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    timeout "$limit" "$@"
    local rc=$?
    SUMMARY+=("$(printf '%-22s exit %-4s %5ss' "$name" "$rc" "$((SECONDS - start))")")
}
step kernel-tests 100 env TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider -p tests._device_launchers \
    tests/test_dsa_kernels.py tests/test_gefen_kernels.py \
    -k "(triton or gefen_kernels) and not bad_inputs and not optimizer" --junitxml="$R/kernel_tests.xml"
step device-moves 60 env TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider tests/test_device_moves.py --junitxml="$R/device_moves.xml"
step capturable 90 env TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider tests/test_gefen_capturable.py \
    -k cuda_graph --junitxml="$R/capturable.xml"
step bench_dsa_gpu 120 "$PY" experiments/bench_dsa_gpu.py --results-dir "$R" --repeats 3 --steps 50
step bench_kernels 200 "$PY" experiments/bench_kernels.py --results-dir "$R" --skip-upstream --reps 10 \
    --kernel-tiles 1024x4,4096x16
step kernel_resources 50 "$PY" experiments/kernel_resources.py --results-dir "$R" --workers 12 \
    --bandwidth-from "$R/gefen_kernels.csv"
step analysis 20 "$PY" analysis/kernel_resources.py --results-dir "$R"
step gefen_speed 180 "$PY" experiments/gefen_speed.py --results-dir "$R" --parts gpu --gpu-reps 20
step analysis-speed 30 "$PY" analysis/gefen_speed.py --results-dir "$R" --out "$R/gefen_speed.png"
echo "=== summary (results in $R)"
printf '%s\n' "${SUMMARY[@]}"
