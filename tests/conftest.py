"""Shared test fixtures. GPU tests carry @pytest.mark.gpu and skip, with the reason, without a GPU."""
import os

# Small CPU sorts with backend="auto" are torch.sort itself (pykernels.sort.TORCH_BELOW): the suite
# checks the native small paths everywhere, and that route in its own test.
os.environ.setdefault("PYKERNELS_SORT_TORCH_BELOW", "0")

# The suite never writes the user's autotune cache (~/.cache/pykernels): tests that tune, and the
# subprocesses they start, use a private dir unless the run names one (review finding: the README's
# autotuning example, run by a test, wrote the user's cache file).
if not os.environ.get("PYKERNELS_CACHE_DIR"):
    import atexit
    import shutil
    import tempfile

    os.environ["PYKERNELS_CACHE_DIR"] = _SUITE_CACHE = tempfile.mkdtemp(prefix="pykernels-test-cache-")
    atexit.register(shutil.rmtree, _SUITE_CACHE, True)

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def _latch_cpu_tiers() -> None:
    """The native modules read the PYKERNELS_DISABLE_* switches once, at their first SIMD check, and the
    autotune device id (cache file names) is computed once from them; tests switch the flags at run time
    (the `simd` fixtures, which Python re-reads on every call). Latched here, before any test runs, they
    hold the process's own flags: a worker whose first check ran inside a test's PYKERNELS_DISABLE_AVX2=1
    had kept "portable" for its later tests (found when a cache test's subprocess, on "avx2", looked for
    another file)."""
    from pykernels import _native, autotune

    for family in ("runtime", "qgemm", "sort", "hash", "attention"):
        try:
            mod = _native.cpu_module(family)
        except RuntimeError:  # no native build: those tests say so themselves
            continue
        for name in ("cpu_has_avx2", "cpu_has_avx512"):
            if hasattr(mod, name):
                getattr(mod, name)()
    autotune.device_id()


_latch_cpu_tiers()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU (torch {torch.__version__} sees none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """After each GPU test, its worker hands the cached CUDA memory back: xdist runs a dozen workers on
    one GPU, and a worker that kept a big test's cache (several tests sort 2^28 keys) left the others
    out of memory (the 2026-12-04 H200 run: one worker held 65 GiB)."""
    yield
    if HAS_CUDA and "gpu" in request.keywords and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def pytest_runtest_logreport(report):
    """PK_FAILURE_LOG=<file>: each failure's traceback is appended as it happens (the one-shot GPU run
    may be cut off by its time limit before pytest prints its summary). Written by the controlling
    process only, under xdist."""
    path = os.environ.get("PK_FAILURE_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """A private autotune cache dir for one test (memory cache cleared before and after)."""
    import pykernels.autotune as at

    monkeypatch.setenv("PYKERNELS_CACHE_DIR", str(tmp_path / "cache"))
    at.clear_memory_cache()
    yield tmp_path / "cache"
    at.clear_memory_cache()


@pytest.fixture
def triton_interpret(monkeypatch):
    """Run Triton kernels on CPU tensors (TRITON_INTERPRET=1 must be set before triton is used)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from pykernels import _backend

    _backend._triton_status.cache_clear()
    yield
    _backend._triton_status.cache_clear()
