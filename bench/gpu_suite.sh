#!/usr/bin/env bash
# The whole GPU check in one go, for a machine with an NVIDIA GPU (GPU time is scarce: one shot).
#   bash bench/gpu_suite.sh [OUT_DIR]
# Builds the CUDA modules for the local GPU, runs the GPU tests (the CPU suite is CI's job), then the
# GPU benchmarks. OUT_DIR (default bench/results/gpu-<timestamp>) gets at most eight files: build.log,
# tests.log, failures.log, bench.log, results.md, results.json, nvidia-smi.txt (and tune.log, see TUNE_OPS).
# Budget: at most 9.7 minutes (build 2, tests 3, benchmarks 4.7: the device tool allows 10 a call); each stage has its own timeout
# so that a hang in one still leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
command -v nvcc >/dev/null || export PATH=$PATH:/usr/local/cuda/bin
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
arch=$($PY -c "import torch; M,m=torch.cuda.get_device_capability(); print(f'{M}{m}')" 2>/dev/null || echo 90)
jobs=$(nproc)
echo "== build for sm_$arch" | tee "$OUT/build.log"
PYKERNELS_BUILD_CUDA=1 PYKERNELS_CUDA_ARCHS=$arch timeout ${BUILD_TIMEOUT:-120} \
  $PY setup.py -q build_ext --inplace -j "$jobs" >> "$OUT/build.log" 2>&1
echo "build rc=$?" | tee -a "$OUT/build.log"

echo "== GPU tests"
par=""
$PY -c "import xdist" 2>/dev/null && par="-n $(( jobs < 12 ? jobs : 12 ))"
$PY -c "import pytest_timeout" 2>/dev/null && par="$par --timeout ${TEST_CASE_TIMEOUT:-180}"
PK_FAILURE_LOG="$OUT/failures.log" timeout ${TEST_TIMEOUT:-180} $PY -m pytest tests -m gpu $par -q -rfE --tb=short \
  -p no:cacheprovider -p no:benchmark --durations=12 --deselect tests/test_gpu_build.py 2>&1 | tee "$OUT/tests.log" | tail -40

# Optional: tune before measuring (TUNE_OPS=sort TUNE_SIZES=268435456 TUNE_TIMEOUT=90), so the benchmarks
# run the configs measured on this GPU (the sort's Onesweep tile is a tunable); off by default, as the
# stages above and below already fill the 9.7 minutes. Writes tune.log (the eighth file).
if [ -n "${TUNE_OPS:-}" ]; then
  echo "== autotune $TUNE_OPS ${TUNE_SIZES:-}"
  timeout ${TUNE_TIMEOUT:-90} $PY -m pykernels.autotune generate --ops "$TUNE_OPS" ${TUNE_SIZES:+--sizes "$TUNE_SIZES"} \
    --backends "${TUNE_BACKENDS:-cuda}" --budget "${TUNE_BUDGET:-0.2}" \
    2>&1 | tee "$OUT/tune.log" | tail -20
fi

echo "== GPU benchmarks"
tmp=$(mktemp -d)
timeout ${BENCH_TIMEOUT:-280} $PY -m bench --gpu --ops "${BENCH_OPS:-qgemm,attention,sort,hash,ring_attention}" --budget "${BENCH_BUDGET:-1}" --out "$tmp" 2>&1 \
  | tee "$OUT/bench.log" | tail -60
cp "$tmp"/results.md "$tmp"/results.json "$OUT"/ 2>/dev/null
echo "results in $OUT"
