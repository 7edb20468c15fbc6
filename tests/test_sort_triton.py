"""The Triton pipeline (histogram + chained-scan binning with decoupled look-back) under
TRITON_INTERPRET=1 on small shapes, against the same oracles as the CPU backend (the cases live in
tests/sort_triton_cases.py and run in a fresh process, so triton is imported with the interpreter on);
and the GPU tests (@pytest.mark.gpu) that run the CUDA and Triton backends on a real GPU."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import pykernels
from tests.test_sort import assert_same, encode, make_keys, ref_argsort_1d, ref_segmented, take

ROOT = Path(__file__).resolve().parent.parent


def test_triton_pipeline_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/sort_triton_cases.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert " passed" in res.stdout and "failed" not in res.stdout, res.stdout[-2000:]


GPU_DTYPES = [torch.uint32, torch.int32, torch.float32, torch.int64, torch.float64, torch.float16, torch.uint8]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_backends_match_the_cpu_oracle(backend, dtype):
    for n in (1, 1000, 7777, 1 << 20, (1 << 22) + 13):
        for kind in ("random", "special", "few", "equal"):
            x = make_keys(dtype, n, kind, seed=n)
            for desc in (False, True):
                ri = ref_argsort_1d(x, desc)
                v, i = pykernels.sort(x.cuda(), descending=desc, backend=backend)
                assert_same(i.cpu(), ri, f"{backend} {dtype} {n} {kind}")
                assert_same(v.cpu(), take(x, ri))
                k = pykernels.sort_keys(x.cuda(), descending=desc, backend=backend)
                assert_same(k.cpu(), take(x, ri))
                kk, vv = pykernels.sort_pairs(x.cuda(), torch.arange(n, device="cuda"), descending=desc,
                                              backend=backend)
                assert torch.equal(vv.cpu(), ri)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_rows_segments_and_bits(backend):
    x = torch.randn(300, 1000)
    v, i = pykernels.sort(x.cuda(), dim=-1, backend=backend)
    rv, ri = torch.sort(x, dim=-1, stable=True)
    assert torch.equal(v.cpu(), rv) and torch.equal(i.cpu(), ri)
    keys = make_keys(torch.int32, 100000, "few", seed=3)
    off = torch.tensor([0, 0, 1, 17, 5000, 99999, 100000])
    k, vv = pykernels.segmented_sort(keys.cuda(), off.cuda(), torch.arange(100000, device="cuda"), backend=backend)
    rk, rvv = ref_segmented(keys, off, torch.arange(100000), False)
    assert torch.equal(k.cpu(), rk) and torch.equal(vv.cpu(), rvv)
    y = make_keys(torch.uint32, 1 << 20, "random", seed=8)
    enc = encode(y)
    sub = (enc >> np.uint64(5)) & np.uint64((1 << 14) - 1)
    _, p = pykernels.sort_pairs(y.cuda(), torch.arange(1 << 20, device="cuda"), begin_bit=5, end_bit=19,
                                backend=backend)
    assert np.array_equal(p.cpu().numpy(), np.argsort(sub, kind="stable"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_cuda_module_imports_without_a_driver_and_fails_cleanly():
    mod = pytest.importorskip("pykernels._cuda_sort", reason="built without nvcc")
    n, why = mod.device_count()
    assert n == 0 and why
    assert mod.tile_keys() > 0 and mod.temp_bytes(1 << 20, 4, 4, 0, 32) > (1 << 20) * 8
    with pytest.raises(RuntimeError, match="pykernels.sort: no CUDA device"):
        mod.onesweep(0, 0, 0, 0, 10, 4, 0, 0, 32, 0, 0, 0)
