"""The Triton pipeline (histogram + chained-scan binning with decoupled look-back) under
TRITON_INTERPRET=1 on small shapes, against the same oracles as the CPU backend (in this process: the
kernels are wrapped at launch time, so setting the variable after triton was imported works); and the GPU
tests (@pytest.mark.gpu) that run the CUDA and Triton backends on a real GPU."""
import numpy as np
import pytest
import torch

import pykernels
from tests.test_sort import assert_same, encode, make_keys, ref_argsort_1d, ref_segmented, ref_sort, take


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint32, torch.float32, torch.int64, torch.float64, torch.uint8,
                                   torch.int16, torch.float16, torch.bfloat16, torch.bool, torch.int8, torch.uint16,
                                   torch.uint64])
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


def test_triton_non_contiguous_inputs(triton_interpret):
    base = make_keys(torch.float32, 1200, "special", seed=7)
    x = base[::3]  # a strided 1-D view
    v, i = pykernels.sort(x, backend="triton")
    rv, ri = ref_sort(x.contiguous())
    assert_same(v, rv)
    assert_same(i, ri)
    m = make_keys(torch.int32, 600, "few", seed=3).view(20, 30).t()  # rows of a transposed matrix
    v, i = pykernels.sort(m, dim=-1, backend="triton")
    rv, ri = torch.sort(m, dim=-1, stable=True)
    assert_same(v, rv)
    assert_same(i, ri)


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

    T._check_n((1 << 28) + 1)  # past the old 29-bit status counts: fine with 64-bit status words
    with pytest.raises(ValueError, match="at most 2\\^31 - 1"):
        T._check_n(1 << 31)


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


def test_triton_refuses_too_many_keys_naming_the_op_before_allocating(triton_interpret, monkeypatch):
    """The 32-bit index limit is checked first, naming the caller's op: before, the widened keys and int32
    indices (~8 bytes a key) were made first and the message always said 'sort' (audit finding)."""
    from pykernels.sort import _triton
    monkeypatch.setattr(_triton, "MAX_TRITON_KEYS", 99)

    def no_alloc(*a, **k):
        raise AssertionError("allocated before the size check")

    monkeypatch.setattr(_triton, "_argsort_1d", no_alloc)
    x = torch.arange(100, dtype=torch.int32)
    for op, call in (("argsort", lambda: pykernels.argsort(x, backend="triton")),
                     ("sort", lambda: pykernels.sort(x, backend="triton")),
                     ("sort_keys", lambda: pykernels.sort_keys(x, backend="triton")),
                     ("sort_pairs", lambda: pykernels.sort_pairs(x, x, backend="triton")),
                     ("sort", lambda: pykernels.sort(x.view(4, 25), backend="triton")),
                     ("segmented_sort", lambda: pykernels.segmented_sort(x, torch.tensor([0, 50, 100]),
                                                                         backend="triton"))):
        with pytest.raises(ValueError, match=rf"^pykernels\.{op}: the triton backend sorts at most"):
            call()
