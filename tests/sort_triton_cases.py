"""Interpreter cases of the Triton sort pipeline. Not collected by default (the file name does not start
with test_): tests/test_sort_triton.py runs this file in a fresh process with TRITON_INTERPRET=1 set
before triton is imported. (triton.jit decides at decoration time whether a function is interpreted,
and triton's own standard library - tl.zeros, tl.sum, tl.cumsum - is decorated when triton is first
imported; in one pytest process another test may import triton first, without the variable.)"""
import os

import numpy as np
import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_sort_triton.py"

import pykernels  # noqa: E402
from tests.test_sort import assert_same, encode, make_keys, ref_argsort_1d, ref_segmented, ref_sort, take  # noqa: E402


@pytest.fixture
def triton_interpret():
    from pykernels import _backend

    _backend._triton_status.cache_clear()
    yield


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint32, torch.float32, torch.int64, torch.float64, torch.uint8,
                                   torch.int16, torch.float16, torch.bfloat16, torch.bool])
def test_triton_sort_matches_oracle(triton_interpret, dtype):
    for n, kind in ((0, "random"), (1, "random"), (2, "reversed"), (255, "special"), (257, "few"), (1100, "random"),
                    (700, "equal"), (600, "sorted")):
        x = make_keys(dtype, n, kind, seed=n)
        before = x.clone()
        for desc in (False, True):
            v, i = pykernels.sort(x, descending=desc, backend="triton")
            rv, ri = ref_sort(x, descending=desc)
            assert_same(i, ri, f"{dtype} {n} {kind} desc={desc}")
            assert_same(v, rv)
        assert_same(x, before)


def test_triton_bit_ranges_pairs_keys(triton_interpret):
    x = make_keys(torch.int32, 900, "random", seed=4)
    enc = encode(x)
    for b, e in ((0, 32), (4, 13), (31, 32), (8, 8)):
        sub = (enc >> np.uint64(b)) & np.uint64((1 << (e - b)) - 1)
        k, v = pykernels.sort_pairs(x, torch.arange(900.0), begin_bit=b, end_bit=e, backend="triton")
        order = np.argsort(sub, kind="stable")
        assert np.array_equal(v.numpy(), order.astype(np.float32))
        assert_same(k, take(x, torch.from_numpy(order)))
    k = pykernels.sort_keys(x, descending=True, backend="triton")
    assert_same(k, x[ref_argsort_1d(x, True)])
    assert_same(pykernels.argsort(x, backend="triton"), ref_argsort_1d(x))


def test_triton_rows_and_segments(triton_interpret):
    x = torch.randint(0, 20, (6, 50)).to(torch.float32)
    for dim in (0, 1):
        v, i = pykernels.sort(x, dim=dim, backend="triton")
        rv, ri = torch.sort(x, dim=dim, stable=True)
        assert_same(v, rv)
        assert_same(i, ri)
    keys = make_keys(torch.int32, 400, "few", seed=2)
    off = torch.tensor([3, 3, 4, 20, 150, 390])
    vals = torch.arange(400)
    k, v = pykernels.segmented_sort(keys, off, vals, descending=True, backend="triton")
    rk, rv = ref_segmented(keys, off, vals, True)
    assert_same(k, rk)
    assert torch.equal(v, rv)


def test_triton_look_back_with_many_tiles(triton_interpret):
    """Many tiles per pass (tile ids from the atomic counter, look-back over aggregates) and a
    trivial pass (top byte constant) that the pipeline must skip."""
    from pykernels.sort import _triton as T

    x = torch.randint(0, 1 << 24, (5000,), dtype=torch.int32)
    enc, _ = T.encode(x, False)
    k, i = T.radix_sort_encoded(enc, torch.arange(5000, dtype=torch.int32), 0, 32, block=64)
    assert torch.equal(i.long(), torch.sort(x, stable=True).indices)


def test_triton_size_limit_is_a_clear_error():
    from pykernels.sort import _triton as T

    with pytest.raises(ValueError, match="at most 2\\^28"):
        T._check_n((1 << 28) + 1)
