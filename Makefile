# pykernels: `make test` and `make bench` set up everything from nothing (a .venv, torch, the build).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU-only machines get the pinned CPU build of torch (plain `torch` would pull a multi-GB CUDA build).
# --no-cache-dir: where that file is missing, pip fetches torch from PyPI, and a cached copy of those
# wheels would double the disk the install needs (a CI run once ran out of disk there).
TORCH_SPEC ?= $(shell if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo torch; else echo torch==2.13.0; fi)
# numba-cuda asks NVRTC which GPU architectures it can target even when it only writes PTX (the sm_90 build
# check of the hash tables' device functions, tests/test_hash_device.py); a machine without CUDA's runtime
# libraries gets NVRTC's wheel (~90 MB). On a GPU machine torch's CUDA build brings its own.
NVRTC_SPEC ?= $(shell if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo; else echo nvidia-cuda-nvrtc-cu12==12.9.86; fi)
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: all venv build toolchains test test-fast bench gpu-suite clean

all: build

$(VENV)/.ready: requirements-dev.txt Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-cache-dir --upgrade pip
	$(PY) -m pip install -q --no-cache-dir "$(TORCH_SPEC)" $(NVRTC_SPEC) -r requirements-dev.txt
	touch $@

venv: $(VENV)/.ready

# In-place build of the native modules (pykernels/_cpu_*.so, and pykernels/_cuda_*.so when nvcc exists).
build: venv
	$(PY) setup.py -q build_ext --inplace -j 2

# GPU compilers for the build checks: nvcc is on the machine; Debian's hipcc compiles HIP for gfx90a.
toolchains:
	@if ! command -v hipcc >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing hipcc (Debian) for the gfx90a build check"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq hipcc >/dev/null; \
	  else echo "hipcc missing and not root: the HIP build check will fail"; fi; \
	fi

test: build toolchains
	$(PY) -m pytest $(PYTEST_ARGS)

# The tests without the GPU build checks (for quick local iteration).
test-fast: build
	$(PY) -m pytest -m "not slow" --deselect tests/test_gpu_build.py $(PYTEST_ARGS)

bench: build
	$(PY) -m bench $(BENCH_ARGS)

# On a machine with a GPU: build, GPU tests, GPU benchmarks, results in one folder (bench/gpu_suite.sh).
gpu-suite:
	bash bench/gpu_suite.sh

clean:
	rm -rf build pykernels/*.so
