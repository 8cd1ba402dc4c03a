#!/usr/bin/env bash
# The GPU proof of posenc_fast: everything that needs a GPU, in one script.  On a machine with an NVIDIA GPU,
# torch (CUDA), Triton, nvcc, pybind11, ninja, pytest and pytest-benchmark installed, from the repository root:
#
#   bash bench/gpu_proof.sh [STEP...]       (default: install backward tests sanitizer bench host-time sparse
#                                            dropout concat)
#
#   install     pip install --no-build-isolation --no-deps -e .  (the CUDA extension for this GPU's arch)
#   backward    bench/backward_cost.py: the weight gradient's parts and chunk lengths,
#               bench/results/backward-cost-<gpu>.json (about a minute)
#   tests       the whole suite, slow tests included, on the GPU (spread over the cores with pytest-xdist
#               where it is installed)
#   sanitizer   compute-sanitizer on bench/sanitizer_driver.py, limited to this package's kernels: memcheck
#               of both backends, racecheck of triton's (the CUDA kernels use no shared memory)
#   bench       python -m posenc_fast bench: bench/results/<gpu>.json and .png, the default cases
#   host-time   bench/host_overhead.py --real cuda --entry-points: bench/results/host-overhead-<gpu>.json
#   sparse      bench/sparse_gradient_cost.py at 4K, 16K and 64K tokens: bench/results/sparse-gradient-<gpu>.json
#   dropout     bench/dropout_cost.py: bench/results/dropout-cost-<gpu>.json
#   concat      bench/cuda_forward_ab.py: the CUDA concat forward with one warp of units per block
#               (-DPOSENC_CONCAT_UNITS_X=32) against the installed build and Triton's,
#               bench/results/cuda-forward-ab-concat-<gpu>.json
#
# Logs go to $OUT (default: a new temporary folder), one per step; the summary comes last.  A step that fails
# is reported and the next one runs.  Each step runs under `timeout` for the seconds in TIMEOUT_<STEP>
# (TIMEOUT_TESTS, TIMEOUT_HOST_TIME, ...; 0: no limit).  PYTHON picks the interpreter (default python3);
# POSENC_FAST_CUDA_ARCHS the build's archs (default: this GPU's).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
OUT="${OUT:-$(mktemp -d /tmp/posenc_fast_gpu_proof.XXXXXX)}"
mkdir -p "$OUT"
SUMMARY=()

# step NAME COMMAND...: run it under its timeout, its output to $OUT/NAME.log and its last lines to stdout.
step() {
    local name=$1 variable limit rc
    shift
    variable="TIMEOUT_$(echo "$name" | tr 'a-z-' 'A-Z_')"
    limit="${!variable:-0}"
    echo "== $name (timeout ${limit}s): $* -> $OUT/$name.log"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    tail -n 15 "$OUT/$name.log"
    case $rc in
        0) SUMMARY+=("$name: ok") ;;
        124 | 137) SUMMARY+=("$name: TIMED OUT after ${limit}s (partial log)") ;;
        *) SUMMARY+=("$name: FAILED (exit $rc)") ;;
    esac
    return $rc
}

slug=""
gpu_slug() {  # bench/results' name for this GPU
    [[ -n "$slug" ]] || slug=$("$PY" -c "import torch; from posenc_fast.benchmark import device_name, device_slug; \
print(device_slug(device_name(torch.device('cuda'))))")
    echo "$slug"
}

run_install() {
    if [[ -z "${POSENC_FAST_CUDA_ARCHS:-}" ]]; then
        POSENC_FAST_CUDA_ARCHS=$("$PY" -c "import torch; major, minor = torch.cuda.get_device_capability(); \
print(f'{major}{minor}')")
        export POSENC_FAST_CUDA_ARCHS
    fi
    step install "$PY" -m pip install --no-build-isolation --no-deps -e .
}

run_tests() {
    local workers=()
    "$PY" -c "import xdist" 2>/dev/null && workers=(-n auto)
    step tests "$PY" -m pytest tests -m "" -q -p no:cacheprovider ${workers[@]+"${workers[@]}"}
}

run_sanitizer() {
    local filter=(--kernel-name "kns=_kernel" --error-exitcode 99 --print-limit 30)
    # Every tensor its own allocation: memcheck then sees an access past a tensor's end.
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 step memcheck compute-sanitizer --tool memcheck "${filter[@]}" \
        "$PY" bench/sanitizer_driver.py cuda triton
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 step racecheck compute-sanitizer --tool racecheck "${filter[@]}" \
        "$PY" bench/sanitizer_driver.py triton
}

run_bench() {
    step bench "$PY" -m posenc_fast bench --out bench/results
}

run_host_time() {
    step host-time "$PY" bench/host_overhead.py --real cuda --entry-points --calls 1000 \
        --json "bench/results/host-overhead-$(gpu_slug).json"
}

# The cost scripts write a fixed file name into --out: a folder of their own, then renamed per GPU.
run_backward() {
    step backward "$PY" bench/backward_cost.py --out "$OUT/backward" \
        && cp "$OUT/backward/backward_cost.json" "bench/results/backward-cost-$(gpu_slug).json"
}

run_sparse() {
    step sparse "$PY" bench/sparse_gradient_cost.py --device cuda --tokens 4096,16384,65536 --out "$OUT/sparse" \
        && cp "$OUT/sparse/sparse_gradient_cost.json" "bench/results/sparse-gradient-$(gpu_slug).json"
}

run_concat() {
    step concat "$PY" bench/cuda_forward_ab.py --define POSENC_CONCAT_UNITS_X=32 \
        --cases headline-concat,headline-fp32-concat --json "bench/results/cuda-forward-ab-concat-$(gpu_slug).json"
}

run_dropout() {
    step dropout "$PY" bench/dropout_cost.py --out "$OUT/dropout" \
        && cp "$OUT/dropout/dropout_cost.json" "bench/results/dropout-cost-$(gpu_slug).json"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  "$PY" -c "import sys, torch, triton; print(f'python {sys.version.split()[0]}; torch {torch.__version__}; \
triton {triton.__version__}')"; } 2>&1 | tee "$OUT/env.txt"
for name in "${@:-install backward tests sanitizer bench host-time sparse dropout concat}"; do
    for one in $name; do
        case "$one" in
            install) run_install ;;
            backward) run_backward ;;
            tests) run_tests ;;
            sanitizer) run_sanitizer ;;
            bench) run_bench ;;
            host-time) run_host_time ;;
            sparse) run_sparse ;;
            dropout) run_dropout ;;
            concat) run_concat ;;
            *) echo "unknown step '$one'; expected install backward tests sanitizer bench host-time sparse dropout concat" >&2; exit 2 ;;
        esac
    done
done
echo
echo "== gpu_proof.sh summary ($SECONDS s; logs in $OUT)"
for line in ${SUMMARY[@]+"${SUMMARY[@]}"}; do echo "  $line"; done
