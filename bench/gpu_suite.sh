#!/usr/bin/env bash
# The whole GPU check in one go, for a machine with an NVIDIA GPU (GPU time is scarce: one shot).
#   bash bench/gpu_suite.sh [OUT_DIR]
# Builds the CUDA modules for the local GPU, runs the GPU benchmarks, then the GPU tests (the CPU suite is
# CI's job), then (PROFILE=1) an Nsight Compute profile of the kernels of bench/gpu_profile.py.
# OUT_DIR (default bench/results/gpu-<timestamp>) gets at most eight files: build.log (nvidia-smi first),
# bench.log, results.md, results.json, tests.log, failures.log (and tune.log, see TUNE_OPS; ncu.txt).
# Budget: at most 9.7 minutes (build 2, benchmarks 4.7, tests 3: the device tool allows 10 a call); each
# stage has its own timeout so that a hang in one still leaves the others' results. STAGES picks and
# orders the stages (default "build bench tests"; add "profile" for ncu).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
command -v nvcc >/dev/null || export PATH=$PATH:/usr/local/cuda/bin
jobs=$(nproc)

build() {
  nvidia-smi > "$OUT/build.log" 2>&1 || true
  arch=$($PY -c "import torch; M,m=torch.cuda.get_device_capability(); print(f'{M}{m}')" 2>/dev/null || echo 90)
  echo "== build for sm_$arch" | tee -a "$OUT/build.log"
  PYKERNELS_BUILD_CUDA=1 PYKERNELS_CUDA_ARCHS=$arch timeout ${BUILD_TIMEOUT:-120} \
    $PY setup.py -q build_ext --inplace -j "$jobs" >> "$OUT/build.log" 2>&1
  echo "build rc=$?" | tee -a "$OUT/build.log"
}

tests() {
  echo "== GPU tests"
  par=""
  $PY -c "import xdist" 2>/dev/null && par="-n $(( jobs < 14 ? jobs : 14 ))"
  $PY -c "import pytest_timeout" 2>/dev/null && par="$par --timeout ${TEST_CASE_TIMEOUT:-180}"
  PK_FAILURE_LOG="$OUT/failures.log" timeout ${TEST_TIMEOUT:-180} $PY -m pytest ${TEST_PATHS:-tests} -m gpu $par -q -rfE --tb=short \
    -p no:cacheprovider -p no:benchmark --durations=12 --deselect tests/test_gpu_build.py 2>&1 | tee "$OUT/tests.log" | tail -40
}

# Optional: tune before measuring, so the benchmarks run the configs measured on this GPU (the sort's
# Onesweep tile is a tunable): TUNE_SCRIPT=sort_keys,sort_pairs,qmatmul (bench/gpu_tune.py, the goal
# shapes only), or TUNE_OPS=sort TUNE_SIZES=268435456 (the autotune CLI: every op of the group on all
# its examples, minutes). Writes tune.log.
tune() {
  if [ -n "${TUNE_SCRIPT:-}" ]; then  # the goal shapes only (bench/gpu_tune.py): fits a short lease
    echo "== tune ${TUNE_SCRIPT}"
    timeout ${TUNE_TIMEOUT:-90} $PY -m bench.gpu_tune "$TUNE_SCRIPT" 2>&1 | tee "$OUT/tune.log" | grep -v "^  " | tail -20
    return 0
  fi
  [ -n "${TUNE_OPS:-}" ] || return 0
  echo "== autotune $TUNE_OPS ${TUNE_SIZES:-}"
  timeout ${TUNE_TIMEOUT:-90} $PY -m pykernels.autotune generate --ops "$TUNE_OPS" ${TUNE_SIZES:+--sizes "$TUNE_SIZES"} \
    --backends "${TUNE_BACKENDS:-cuda}" --budget "${TUNE_BUDGET:-0.2}" \
    2>&1 | tee "$OUT/tune.log" | tail -20
}

bench() {
  tune
  echo "== GPU benchmarks"
  tmp=$(mktemp -d)
  timeout ${BENCH_TIMEOUT:-280} $PY -m bench --gpu --ops "${BENCH_OPS:-qgemm,attention,sort,hash,ring_attention}" --budget "${BENCH_BUDGET:-1}" --out "$tmp" 2>&1 \
    | tee "$OUT/bench.log" | tail -60
  cp "$tmp"/results.md "$tmp"/results.json "$OUT"/ 2>/dev/null
}

# Hardware counters of the kernels bench/gpu_profile.py launches (throughput, stalls, occupancy).
profile() {
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  [ -n "$ncu" ] || { echo "no ncu" > "$OUT/ncu.txt"; return 0; }
  echo "== ncu ($ncu) ${PROFILE_OPS:-sort,qgemm,attention}"
  timeout ${PROFILE_TIMEOUT:-90} "$ncu" --clock-control none --kernel-name "regex:${PROFILE_KERNELS:-onesweep|global_hist|wo_gemm|_wo_kernel|_attn_fwd}" \
    --launch-count ${PROFILE_COUNT:-12} --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats \
    $PY -m bench.gpu_profile "${PROFILE_OPS:-sort,qgemm,attention}" > "$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?" | tee -a "$OUT/ncu.txt"
}

for stage in ${STAGES:-build bench tests}; do "$stage"; done
echo "results in $OUT"
