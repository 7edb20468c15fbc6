"""Large CPU buffers: huge-page-advised allocation, and a cache of the ops' output buffers (and of large
hash tables' slot arrays: huge_aligned_output).

Why a cache. An op's fresh output of n bytes is not free before the op writes a byte of it: the
kernel maps and zeroes every page on first touch. Measured on the 2-core dev VM (huge pages, so one
fault per 2 MiB): ~4-5 GB/s, so the 48 MiB of a 4M-key sort's values and int64 indices cost ~6 ms of
a ~27 ms sort (~1/5; measured 27 vs 21 ms with the cache off and on), and a 4M-key hash lookup's 36 MiB of values and flags ~8 ms of ~30 ms. Memory a caller
has dropped is still mapped: handing it out again costs nothing. This is what PyTorch's CUDA caching
allocator does for GPU memory, here only for the large CPU outputs of pykernels' own ops.

How. The cache keeps the storages of the outputs it made (exactly the output's size: a result saved,
pickled or shared carries no padding). An output is a plain tensor on such a storage (not a view, so
autograd lets callers modify it in place, as torch.sort's results). A storage is handed out again only
when nothing but the cache refers to it (its strong use count and its Python object's reference count
are the cache's own), so a tensor, view, numpy array, saved autograd
tensor or UntypedStorage of a result keeps it out of use. A storage that moved (share_memory_(), a
growing resize_) or became non-resizable (numpy export) leaves the cache: its tensors own it.

Bounds. PYKERNELS_OUTPUT_CACHE_MB (default 1024; 0 turns the cache off) caps the bytes of all cached
storages; past it the least recently used are dropped from the cache (one still in use lives on with
its tensors and is freed with them). At most MAX_PER_SIZE storages of one size are kept, so a caller
holding many results does not make each call scan them. `pykernels.empty_cache()` drops every storage
not in use. Where torch lacks the use-count query the cache stays off and outputs are plain allocations.
"""
from __future__ import annotations

import math
import os
import sys
import threading
import weakref

import torch

from . import _native

# Every buffer here is a CPU one whatever torch's default device is (under torch.device("meta") a
# table's slots were made on meta and the native code wrote through their pointer; review finding).
_CPU = torch.device("cpu")

HUGE_PAGE = 2 << 20
MAX_PER_SIZE = 4
_MIN_CACHED_BYTES = 1 << 20  # smaller outputs come from malloc's heap, whose pages are already mapped
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def advise_huge(t: torch.Tensor, nbytes: int):
    """Huge pages for the whole 2 MiB pages inside t's first nbytes (before anything touches them)."""
    try:
        _native.cpu_module("runtime").advise_hugepages(t.data_ptr(), nbytes)
    except RuntimeError:  # no native runtime: the advice is only a hint
        pass


def _fresh_storage(nbytes: int) -> torch.UntypedStorage:
    """nbytes of new memory; from 4 MiB on its whole huge pages advised (one page fault per 2 MiB on
    first touch instead of 512)."""
    raw = torch.empty(nbytes, dtype=torch.uint8, device=_CPU)
    if nbytes >= 2 * HUGE_PAGE:
        advise_huge(raw, nbytes)
    return raw.untyped_storage()


class _Cached:
    __slots__ = ("storage", "ptr", "nbytes", "tick")

    def __init__(self, nbytes: int, tick: int):
        self.storage = _fresh_storage(nbytes)
        self.ptr = self.storage.data_ptr()
        self.nbytes = nbytes
        self.tick = tick

    def moved(self) -> bool:
        """A caller moved or resized the storage (share_memory_(), resize_), or exported it to numpy
        (which leaves it non-resizable for good, unlike a fresh result): no longer ours to reuse."""
        s = self.storage
        return s.data_ptr() != self.ptr or s.nbytes() != self.nbytes or not s.resizable()

    def idle(self) -> bool:
        """Only the cache refers to the storage: one strong C++ reference (the cache's UntypedStorage
        object; tensors and views add theirs) and two Python references to that object (the slot and
        getrefcount's argument; a caller holding the UntypedStorage adds one, since torch keeps one
        such object per storage, owned by the storage, so holding it adds no C++ reference). Fixed
        values, not ones measured when the storage was made: a tracer or debugger holding a frame's
        locals then could have inflated them, and a storage held by a caller would have looked idle."""
        return _use_count(self.storage._cdata) == 1 and sys.getrefcount(self.storage) == 2


def _counts_work() -> bool:
    """This torch counts references as idle() expects (else the cache stays off)."""
    if _use_count is None:
        return False
    c = _Cached(64, 0)
    if not c.idle():
        return False
    held = torch.empty(0, dtype=torch.uint8, device=_CPU).set_(c.storage, 0, (64,))
    busy = not c.idle()
    del held
    return busy and c.idle()


def _new_lock(cache):
    if cache is not None:
        cache._lock = threading.Lock()


class OutputCache:
    """See the module docstring. Thread-safe: choosing an idle storage and wrapping it in the caller's
    tensor (which makes it busy) happen under one lock."""

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes if _counts_work() else 0
        self._lock = threading.Lock()
        self._by_size: dict[int, list[_Cached]] = {}
        self._tick = 0
        self.hits = 0
        self.misses = 0
        if hasattr(os, "register_at_fork"):  # a child must not inherit a lock held by a parent's thread
            ref = weakref.ref(self)  # the handler must not keep a dropped cache (and its memory) alive
            os.register_at_fork(after_in_child=lambda: _new_lock(ref()))

    def cached_bytes(self) -> int:
        with self._lock:
            return sum(c.nbytes for lst in self._by_size.values() for c in lst)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU tensor (contents undefined) on a cached storage of exactly its size when one
        is idle, else on a new one (cached while under the cap)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < _MIN_CACHED_BYTES:  # small: plain torch.empty (a storage of exactly its size)
            # sizes as separate arguments: torch parses them in ~2 us, a tuple in ~3, a torch.Size in ~4
            return torch.empty(*shape, dtype=dtype, device=_CPU) if shape else torch.empty((), dtype=dtype, device=_CPU)
        if nbytes > self.limit:
            return torch.empty(0, dtype=dtype, device=_CPU).set_(_fresh_storage(nbytes), 0, shape)
        with self._lock:
            self._tick += 1
            same = self._by_size.setdefault(nbytes, [])
            same[:] = [c for c in same if not c.moved()]
            for c in same:
                if c.idle():
                    c.tick = self._tick
                    self.hits += 1
                    return torch.empty(0, dtype=dtype, device=_CPU).set_(c.storage, 0, shape)
            self.misses += 1
            c = _Cached(nbytes, self._tick)
            out = torch.empty(0, dtype=dtype, device=_CPU).set_(c.storage, 0, shape)
            if len(same) >= MAX_PER_SIZE:  # the oldest of this size makes way
                same.remove(min(same, key=lambda b: b.tick))
            same.append(c)
            self._make_room()
            return out

    def _make_room(self):
        """Drop every moved storage (shared, grown or exported: its tensors own it now; kept, a result moved
        to shared memory held its segment and a file descriptor until evicted, and a grown one counted at
        its old size: audit finding), then least recently used ones, idle first, until all fit under the
        cap. (On misses only, whose new pages cost far more than this walk.)"""
        for n, lst in list(self._by_size.items()):
            keep = [c for c in lst if not c.moved()]
            if len(keep) != len(lst):
                if keep:
                    lst[:] = keep
                else:
                    del self._by_size[n]
        entries = [c for lst in self._by_size.values() for c in lst]
        total = sum(c.nbytes for c in entries)
        if total <= self.limit:
            return
        for c in sorted(entries, key=lambda c: (not (c.moved() or c.idle()), c.tick)):
            if total <= self.limit:
                break
            same = self._by_size[c.nbytes]
            same.remove(c)
            if not same:  # (a size's emptied list kept, every miss walked one more per size ever seen: audit)
                del self._by_size[c.nbytes]
            total -= c.nbytes

    def forget(self, t: torch.Tensor):
        """Drop t's storage from the cache (its tensors keep it; it is freed with them): for memory that
        will not be asked for again, e.g. a grown hash table's old slots, whose size no later table is
        likely to have (kept, each growth step's old slots stayed resident; review finding)."""
        ptr = t.untyped_storage().data_ptr()
        with self._lock:
            for n, lst in list(self._by_size.items()):
                lst[:] = [c for c in lst if c.ptr != ptr]
                if not lst:
                    del self._by_size[n]

    def release_idle(self):
        """Drop every idle or moved storage (its memory goes back to the system)."""
        with self._lock:
            for n, lst in list(self._by_size.items()):
                lst[:] = [c for c in lst if not (c.moved() or c.idle())]
                if not lst:
                    del self._by_size[n]


def _limit_from_env() -> int:
    text = os.environ.get("PYKERNELS_OUTPUT_CACHE_MB", "").strip() or "1024"  # set but empty: the default
    try:
        mb = float(text)
    except ValueError:
        mb = float("nan")
    if not math.isfinite(mb) or mb < 0:
        raise ValueError(f"pykernels: PYKERNELS_OUTPUT_CACHE_MB must be a finite number of MiB >= 0, got {text!r}")
    return int(mb * (1 << 20))


OUTPUTS = OutputCache(_limit_from_env())


def not_a_view(t: torch.Tensor, shape=None) -> torch.Tensor:
    """t's memory, in `shape` (t contiguous) or else in t's own sizes and strides, as a tensor that is not a
    view: autograd lets callers modify a custom op's outputs in place (as torch.sort's, F.linear's and
    SDPA's) only when they are not views, and a reshape or transpose of a fresh result is one."""
    if shape is None:
        if not t._is_view():
            return t
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(),
                                                                    t.size(), t.stride())
    if not t.is_contiguous():
        t = t.contiguous()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), shape)


def empty_output(shape, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of `shape` and `dtype` (contents undefined) for an op's result: large ones
    from the output cache."""
    if len(shape) == 1 and shape[0] * dtype.itemsize < _MIN_CACHED_BYTES:  # a small call's output, ~1 us sooner
        return torch.empty(shape[0], dtype=dtype, device=_CPU)
    return OUTPUTS.empty(tuple(shape), dtype)


def huge_aligned_output(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of nbytes starting on a 2 MiB boundary, on a storage of the output cache
    (2 MiB larger; huge pages advised when the storage was made): a hash table's slots, reused once a
    dropped table's are idle."""
    raw = OUTPUTS.empty((nbytes + HUGE_PAGE,), torch.uint8)
    off = -raw.data_ptr() % HUGE_PAGE
    return raw[off: off + nbytes]


def empty_cache():
    """Release the cached output buffers of pykernels' CPU ops (and the slot arrays of dropped hash
    tables) that no tensor uses (as torch.cuda.empty_cache does for GPU memory). Set
    PYKERNELS_OUTPUT_CACHE_MB=0 to turn the cache off."""
    OUTPUTS.release_idle()
    # The freed buffers (1-32 MiB each) stayed in the C heap, fragmented: 359 MiB of RSS was kept after
    # the cache had released 1 GiB (review finding); malloc_trim gives the free pages back.
    from . import _native

    rt, _ = _native._load("_cpu_runtime")
    if rt is not None and hasattr(rt, "trim_heap"):
        rt.trim_heap()
