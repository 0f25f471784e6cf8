#!/usr/bin/env bash
# Every GPU check, in three parts that each fit one call on a lent machine; each step time-limited.
# Run from the repository root on a CUDA machine:
#
#     bash experiments/gpu_checks.sh [RESULTS_DIR] [PART...]    # Default: results/gpu, all parts
#
# PART is one or more of (about the minutes each took or is sized to take on one H200):
#   dsa      (~3 min) Disk Sparse Adam:
#            experiments/bench_dsa_gpu.py at the seed's configuration (samples/s, device memory, the
#            host's time, the device's busy time and the host's waits per step) -> dsa_gpu.csv;
#            experiments/profile_step.py --parts dsa: one profiled iteration per optimizer -> dsa_profile.txt
#   kernels  (~6 min) Gefen's kernels against fused AdamW and the 8-bit peers:
#            experiments/bench_kernels.py at 125M and 1.5B, fp32 and bf16, with the device's copy
#            bandwidth, FlashOptim, bitsandbytes, torchao and gefen-x beside it -> gefen_kernels.csv;
#            experiments/profile_step.py --parts gefen: one profiled step per optimizer and dtype, each
#            kernel family's achieved bandwidth -> gefen_profile.txt
#   checks   (~6 min) correctness and the whole step:
#            the Triton kernel tests compiled on the GPU (tests/_device_launchers.py) -> kernel_tests.xml;
#            tests/test_device_moves.py -> device_moves.xml; tests/test_gefen_capturable.py's CUDA-graph
#            tests -> capturable.xml; experiments/kernel_resources.py with predicted times at the measured
#            copy bandwidth (needs kernels' CSV for that; else the default bandwidth) -> kernel_resources.csv,
#            README.md; experiments/gefen_speed.py's GPU part -> gefen_speed.csv, gefen_speed.png, README.md
# plus gpu_checks.log (everything printed) and environment.txt (nvidia-smi, versions).
#
# The peers are not installed on a lent machine and it reaches no package registry: download their
# wheels here first (.whl/ is ignored by git; carry it), and this script installs them there:
#
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform any -d .whl \
#         flashoptim==0.1.4 torchao==0.18.0 bitsandbytes==0.50.2 gefen-x==0.5.0
#
# A lent machine returns at most 8 files: pack the folder, e.g.
#     bash experiments/gpu_checks.sh /tmp/gpu dsa kernels; tar -C /tmp/gpu -czf "$OUT/gpu.tgz" .
set -u
cd "$(dirname "$0")/.."
R="${1:-results/gpu}"
shift || true
PARTS="${*:-dsa kernels checks}"
mkdir -p "$R"
# A lent machine may have python3 only; PYTHON overrides.
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=disabled PYTHONUNBUFFERED=1
exec > >(tee -a "$R/gpu_checks.log") 2>&1
echo "=== gpu_checks.sh parts: $PARTS"
if compgen -G ".whl/*.whl" > /dev/null; then  # the carried peers: gefen-x beside upstream, as registry.gefen_x reads it
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/peers \
        $(ls .whl/*.whl | grep -v gefen_x) && export PYTHONPATH="$PYTHONPATH:/tmp/peers"
    ls .whl/gefen_x-*.whl > /dev/null 2>&1 && "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target third_party/gefen_x .whl/gefen_x-*.whl
fi
{ nvidia-smi; "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"; "$PY" -m pip list 2>/dev/null | grep -iE '^(numba|numpy|geoopt|gefen|gefen-x|torchao|bitsandbytes|flashoptim|wandb|matplotlib|pytest) '; ls /tmp/peers third_party/gefen_x 2>/dev/null | grep dist-info; } \
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
has() { [[ " $PARTS " == *" $1 "* ]]; }
if has dsa; then
    step bench_dsa_gpu 150 "$PY" experiments/bench_dsa_gpu.py --results-dir "$R" --repeats 3 --steps 50
    step profile-dsa 60 "$PY" experiments/profile_step.py --results-dir "$R" --parts dsa
fi
if has kernels; then
    step bench_kernels 300 "$PY" experiments/bench_kernels.py --results-dir "$R" --skip-upstream --reps 10 \
        --kernel-tiles 1024x4,4096x16
    step profile-gefen 60 "$PY" experiments/profile_step.py --results-dir "$R" --parts gefen
fi
if has checks; then
    step kernel-tests 100 env TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider -m "slow or not slow" -p tests._device_launchers \
        tests/test_dsa_kernels.py tests/test_gefen_kernels.py \
        -k "(triton or gefen_kernels) and not bad_inputs and not optimizer" --junitxml="$R/kernel_tests.xml"
    step device-moves 60 env TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/test_device_moves.py --junitxml="$R/device_moves.xml"
    step capturable 90 env TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider -m "slow or not slow" tests/test_gefen_capturable.py \
        -k cuda_graph --junitxml="$R/capturable.xml"
    BW=()
    [ -f "$R/gefen_kernels.csv" ] && BW=(--bandwidth-from "$R/gefen_kernels.csv")
    step kernel_resources 50 "$PY" experiments/kernel_resources.py --results-dir "$R" --workers 12 "${BW[@]}"
    step analysis 20 "$PY" analysis/kernel_resources.py --results-dir "$R"
    step gefen_speed 150 "$PY" experiments/gefen_speed.py --results-dir "$R" --parts gpu --gpu-reps 20
    step analysis-speed 30 "$PY" analysis/gefen_speed.py --results-dir "$R" --out "$R/gefen_speed.png"
fi
echo "=== summary (results in $R)"
printf '%s\n' "${SUMMARY[@]}"
