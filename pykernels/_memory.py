"""Large CPU buffers: huge-page-advised allocation, and a cache of the ops' output buffers.

Why a cache. An op's fresh output of n bytes is not free before the op writes a byte of it: the
kernel maps and zeroes every page on first touch. Measured on the 2-core dev VM (huge pages, so one
fault per 2 MiB): ~4-5 GB/s, so the 48 MiB of a 4M-key sort's values and int64 indices cost ~10 ms of
a ~20 ms sort, and a 4M-key hash lookup's 36 MiB of values and flags ~8 ms of ~30 ms. Memory a caller
has dropped is still mapped: handing it out again costs nothing. This is what PyTorch's CUDA caching
allocator does for GPU memory, here only for the large CPU outputs of pykernels' own ops.

How. Each cached buffer is a uint8 tensor whose storage the cache keeps; an output is a view of it.
A buffer is handed out again only when nothing but the cache refers to its storage (the storage's
strong use count and its Python object's reference count are back to what they were when the buffer
was made): a view, a slice, a numpy array, a saved autograd tensor or the UntypedStorage of a result
keeps the buffer out of use. Buffers match by size class
(sizes rounded up by at most 1/16), so a result's storage is never much larger than the result.

Bounds. PYKERNELS_OUTPUT_CACHE_MB (default 1024; 0 turns the cache off) caps the bytes of all cached
buffers; past it the least recently used are dropped from the cache (a buffer still in use lives on
with its tensors and is freed with them). `pykernels.empty_cache()` drops every buffer not in use.
Where torch lacks the use-count query the cache stays off and outputs are plain allocations.
"""
from __future__ import annotations

import os
import sys
import threading

import torch

from . import _native

HUGE_PAGE = 2 << 20
_MIN_CACHED_BYTES = 1 << 20  # smaller outputs come from malloc's heap, whose pages are already mapped
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _advise_huge(t: torch.Tensor, nbytes: int):
    try:
        _native.cpu_module("runtime").advise_hugepages(t.data_ptr(), nbytes)
    except RuntimeError:  # no native runtime: the advice is only a hint
        pass


def huge_buffer(nbytes: int) -> torch.Tensor:
    """A fresh uint8 CPU tensor of nbytes. From 4 MiB on it starts on a 2 MiB boundary and is advised to
    use huge pages before anything touches it (a view of a buffer 2 MiB larger)."""
    if nbytes < 2 * HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    off = -raw.data_ptr() % HUGE_PAGE
    out = raw[off: off + nbytes]
    _advise_huge(out, nbytes)
    return out


def _size_class(nbytes: int) -> int:
    """nbytes rounded up to a multiple of max(64 KiB, 1/16 of its power of two)."""
    g = max(64 << 10, 1 << max(0, nbytes.bit_length() - 5))
    return -(-nbytes // g) * g


def _storage_refs(t: torch.Tensor) -> tuple:
    """(strong C++ references to t's storage, Python references to its storage object). Tensors and
    views count in the first; a Python UntypedStorage object a caller holds only in the second (torch
    keeps one such object per storage, owned by the storage, so holding it adds no C++ reference)."""
    s = t.untyped_storage()
    return _use_count(s._cdata), sys.getrefcount(s)


class _Buffer:
    __slots__ = ("view", "ptr", "idle_refs", "size_class", "tick")

    def __init__(self, size_class: int, tick: int):
        self.size_class = size_class
        self.view = huge_buffer(size_class)
        self.ptr = self.view.data_ptr()
        # the references with only this object referring to the storage (measured the same way later)
        self.idle_refs = _storage_refs(self.view)
        self.tick = tick

    def idle(self) -> bool:
        """No tensor but ours refers to the storage, and nobody resized or moved it."""
        return (_storage_refs(self.view) == self.idle_refs and self.view.data_ptr() == self.ptr
                and self.view.untyped_storage().nbytes() >= self.size_class)


class OutputCache:
    """See the module docstring. Thread-safe: choosing an idle buffer and taking a view of it (which
    makes it busy) happen under one lock."""

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes if _use_count is not None else 0
        self._lock = threading.Lock()
        self._buffers: list[_Buffer] = []
        self._tick = 0
        self.hits = 0
        self.misses = 0

    def cached_bytes(self) -> int:
        with self._lock:
            return sum(b.size_class for b in self._buffers)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 CPU tensor of nbytes (contents undefined): an idle cached buffer of its size class, a
        new cached one, or (small, or past the cap) a plain allocation."""
        if nbytes < _MIN_CACHED_BYTES or nbytes > self.limit:
            return huge_buffer(nbytes)
        cls = _size_class(nbytes)
        with self._lock:
            self._tick += 1
            for b in self._buffers:
                if b.size_class == cls and b.idle():
                    b.tick = self._tick
                    self.hits += 1
                    return b.view[:nbytes]
            self.misses += 1
            self._make_room(cls)
            b = _Buffer(cls, self._tick)
            self._buffers.append(b)
            return b.view[:nbytes]

    def _make_room(self, cls: int):
        """Drop least recently used buffers, idle ones first, until cls more bytes fit under the cap."""
        total = sum(b.size_class for b in self._buffers) + cls
        if total <= self.limit:
            return
        for b in sorted(self._buffers, key=lambda b: (not b.idle(), b.tick)):
            if total <= self.limit:
                break
            self._buffers.remove(b)
            total -= b.size_class

    def empty(self):
        """Drop every idle buffer (its memory goes back to the system)."""
        with self._lock:
            self._buffers = [b for b in self._buffers if not b.idle()]


def _limit_from_env() -> int:
    text = os.environ.get("PYKERNELS_OUTPUT_CACHE_MB", "1024")
    try:
        mb = float(text)
    except ValueError:
        raise ValueError(f"pykernels: PYKERNELS_OUTPUT_CACHE_MB must be a number of MiB, got {text!r}") from None
    return max(0, int(mb * (1 << 20)))


OUTPUTS = OutputCache(_limit_from_env())


def empty_output(shape, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of `shape` and `dtype` (contents undefined) for an op's result, from the
    output cache when large."""
    shape = tuple(shape)
    n = 1
    for s in shape:
        n *= s
    nbytes = n * dtype.itemsize
    if nbytes < _MIN_CACHED_BYTES:
        return torch.empty(shape, dtype=dtype)
    return OUTPUTS.take(nbytes).view(dtype).view(shape)


def empty_cache():
    """Release the cached output buffers of pykernels' CPU ops that no tensor uses (as
    torch.cuda.empty_cache does for GPU memory). Set PYKERNELS_OUTPUT_CACHE_MB=0 to turn the cache off."""
    OUTPUTS.empty()
