"""The output cache (pykernels/_memory.py): a buffer goes back into use only when nothing refers to it,
results stay correct across reuse, size classes and the cap hold, and threads never share a buffer."""
import threading

import numpy as np
import pytest
import torch

import pykernels
from pykernels import _memory

MiB = 1 << 20
pytestmark = pytest.mark.skipif(_memory._use_count is None, reason="this torch has no storage use-count query")


def test_a_dropped_buffer_is_handed_out_again():
    cache = _memory.OutputCache(64 * MiB)
    a = cache.take(3 * MiB)
    ptr = a.data_ptr()
    del a
    b = cache.take(3 * MiB)
    assert b.data_ptr() == ptr and (cache.hits, cache.misses) == (1, 1)


@pytest.mark.parametrize("keep", ["tensor", "view", "dtype_view", "numpy", "storage", "view_of_view"])
def test_a_buffer_still_referred_to_is_never_handed_out(keep):
    cache = _memory.OutputCache(64 * MiB)
    a = cache.take(3 * MiB)
    a.fill_(7)
    ptr = a.data_ptr()
    holder = {
        "tensor": lambda: a,
        "view": lambda: a[5:9],
        "dtype_view": lambda: a.view(torch.int32)[10:],
        "numpy": lambda: a.numpy(),
        "storage": lambda: a.untyped_storage(),
        "view_of_view": lambda: a[1:].view(1, -1)[:, 3:],
    }[keep]()
    del a
    b = cache.take(3 * MiB)
    assert b.data_ptr() != ptr, f"a buffer held through a {keep} was handed out again"
    b.fill_(1)
    del holder


def test_results_stay_correct_while_earlier_ones_are_held_and_after_reuse():
    x = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 19,), dtype=torch.int32)
    y = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 19,), dtype=torch.int32)
    ref_x, ref_y = torch.sort(x, stable=True), torch.sort(y, stable=True)
    vx, ix = pykernels.sort(x)
    vy, iy = pykernels.sort(y)  # vx/ix held: must get other buffers
    assert vx.data_ptr() != vy.data_ptr() and ix.data_ptr() != iy.data_ptr()
    for (v, i), r in (((vx, ix), ref_x), ((vy, iy), ref_y)):
        assert torch.equal(v, r.values) and torch.equal(i, r.indices)
    ptrs = {vx.data_ptr(), ix.data_ptr()}
    del vx, ix
    vz, iz = pykernels.sort(x)  # reuses the dropped buffers, and overwrites them correctly
    assert {vz.data_ptr(), iz.data_ptr()} == ptrs
    assert torch.equal(vz, ref_x.values) and torch.equal(iz, ref_x.indices)
    assert torch.equal(vy, ref_y.values) and torch.equal(iy, ref_y.indices)


def test_hash_lookups_through_the_cache_stay_correct():
    t = pykernels.HashMap(1 << 19)
    keys = torch.randperm(1 << 20)[: 1 << 18].to(torch.int64)
    t.insert(keys, keys * 3)
    q = torch.cat([keys, keys + (1 << 40)])
    first, found1 = t.find(q, default=-1)
    second, found2 = t.find(q.flip(0), default=-1)  # `first` held: other buffers
    assert torch.equal(first[: len(keys)], keys * 3) and bool((first[len(keys):] == -1).all())
    assert torch.equal(second, first.flip(0)) and torch.equal(found2, found1.flip(0))
    assert int(found1.sum()) == len(keys)
    del first, found1
    third, found3 = t.find(q, default=-1)
    assert torch.equal(third, second.flip(0)) and torch.equal(found3, found2.flip(0))


def test_size_classes_keep_a_result_close_to_its_storage():
    cache = _memory.OutputCache(256 * MiB)
    big = cache.take(40 * MiB)
    del big
    small = cache.take(10 * MiB)  # the idle 40 MiB buffer is another size class
    assert small.untyped_storage().nbytes() <= 10 * MiB + 10 * MiB // 16 + 2 * _memory.HUGE_PAGE
    assert _memory._size_class(10 * MiB + 1) <= (10 * MiB + 1) * 17 // 16 + (64 << 10)


def test_the_cap_bounds_the_cached_bytes_and_evicts_the_least_recently_used():
    cache = _memory.OutputCache(10 * MiB)
    held = [cache.take(3 * MiB) for _ in range(5)]  # 15 MiB asked for, at most 10 cached
    assert cache.cached_bytes() <= 10 * MiB
    for t in held:
        t.fill_(3)  # evicted or not, every buffer is still the caller's memory
    assert all(bool((t == 3).all()) for t in held)
    del held
    assert cache.take(64 * MiB).numel() == 64 * MiB  # past the cap: a plain allocation
    assert cache.cached_bytes() <= 10 * MiB


def test_empty_cache_drops_idle_buffers_only():
    cache = _memory.OutputCache(64 * MiB)
    busy, idle = cache.take(2 * MiB), cache.take(2 * MiB)
    del idle
    cache.empty()
    assert cache.cached_bytes() == _memory._size_class(2 * MiB)
    busy.fill_(1)
    pykernels.empty_cache()  # the process-wide cache: callable any time


def test_a_resized_storage_is_not_reused():
    cache = _memory.OutputCache(64 * MiB)
    a = cache.take(3 * MiB)
    a.untyped_storage().resize_(0)  # a caller may do anything with a result's storage
    del a
    b = cache.take(3 * MiB)  # a new buffer (malloc may well hand out the freed address again)
    assert cache.misses == 2 and cache.hits == 0 and b.numel() == 3 * MiB
    b.fill_(2)


def test_off_and_small_requests_are_plain_allocations(monkeypatch):
    off = _memory.OutputCache(0)
    a = off.take(4 * MiB)
    assert a.numel() == 4 * MiB and off.cached_bytes() == 0
    on = _memory.OutputCache(64 * MiB)
    assert on.take(1000).numel() == 1000 and on.cached_bytes() == 0
    monkeypatch.setenv("PYKERNELS_OUTPUT_CACHE_MB", "0")
    assert _memory._limit_from_env() == 0
    monkeypatch.setenv("PYKERNELS_OUTPUT_CACHE_MB", "lots")
    with pytest.raises(ValueError, match="PYKERNELS_OUTPUT_CACHE_MB"):
        _memory._limit_from_env()


def test_empty_output_shapes_and_dtypes():
    for shape, dtype in [((1 << 18,), torch.int64), ((1 << 17, 3), torch.float32), ((7,), torch.float64),
                         ((1 << 19,), torch.bool), ((1 << 16, 2), torch.complex128)]:
        t = _memory.empty_output(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()


def test_threads_never_share_a_buffer():
    cache = _memory.OutputCache(256 * MiB)
    errors = []

    def work(k):
        try:
            kept = []
            for r in range(20):
                t = cache.take(2 * MiB)
                t.fill_(k)
                if not bool((t == k).all()):
                    errors.append(f"thread {k} saw another thread's writes at round {r}")
                if r % 3 == 0:
                    kept.append(t)  # held: must not be handed to anyone
            if not all(bool((t == k).all()) for t in kept):
                errors.append(f"a buffer thread {k} held was handed out again")
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert cache.hits > 0, "the cache never reused a buffer"


def test_numpy_round_trip_of_a_cached_result():
    x = torch.randn(1 << 19)
    v, _ = pykernels.sort(x)
    arr = v.numpy()
    del v
    w, _ = pykernels.sort(-x)  # arr still refers to the first buffer
    assert np.array_equal(arr, np.sort(x.numpy(), kind="stable"))
    assert torch.equal(w, torch.sort(-x, stable=True).values)
