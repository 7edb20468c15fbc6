#!/usr/bin/env bash
# The whole GPU check in one go, for a machine with an NVIDIA GPU (GPU time is scarce: one shot).
#   bash bench/gpu_suite.sh [OUT_DIR]
# Builds the CUDA modules for the local GPU, runs the test suite with the GPU tests enabled, then the
# GPU benchmarks, and writes everything under OUT_DIR (default bench/results/gpu-<timestamp>).
# Budget: about 8 minutes in all (build ~2, tests ~3, benchmarks ~3).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
arch=$($PY -c "import torch; M,m=torch.cuda.get_device_capability(); print(f'{M}{m}')" 2>/dev/null || echo 90)
echo "== build for sm_$arch" | tee "$OUT/build.log"
PYKERNELS_BUILD_CUDA=1 PYKERNELS_CUDA_ARCHS=$arch timeout 240 $PY setup.py -q build_ext --inplace -j 8 >> "$OUT/build.log" 2>&1
echo "build rc=$?" | tee -a "$OUT/build.log"
echo "== tests (GPU tests enabled)"
timeout 240 $PY -m pytest tests --maxfail=30 -q -m "gpu or not slow" -p no:cacheprovider --deselect tests/test_gpu_build.py \
  --junitxml="$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log" | tail -30
echo "== GPU benchmarks"
timeout 200 $PY -m bench --gpu --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -40
echo "results in $OUT"
