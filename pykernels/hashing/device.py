"""numba.cuda device functions over a table's arrays: WarpCore's device-side operations, for Python.

A user's own `@numba.cuda.jit` kernel can insert into, look up in and count with a table that the host
API (`pykernels.HashMap`, `CountingTable`, `HashSet`) built or will read: the functions below walk the
very same layout (csrc/hash/hash_layout.h) -- same hash, same windows, same double hashing, same
EMPTY/TOMBSTONE patterns and the same out-of-band store for keys equal to them.

    from numba import cuda
    from pykernels.hashing import device as hd

    @cuda.jit
    def kernel(slots, special, counters, nw, window, seed, keys, out):
        i = cuda.grid(1)
        if i < keys.size:
            out[i] = hd.map_insert(slots, special, counters, nw, window, seed, keys[i], keys[i] * 2)

    t = pykernels.HashMap(1 << 20, device="cuda")
    with t.device_view() as v:                  # hands out the arrays, then updates len(t)
        kernel[blocks, 256](*v.args, keys_u64, out)

Keys and values are passed as their bit patterns in uint64 (view an int64 tensor as uint64; a float64
value as its bits). Layouts supported here: 8-byte keys with 8-byte values (HashMap int64/uint64 ->
8-byte values, CountingTable) or without values (HashSet), and 4-byte keys with 4-byte values (packed
into one 64-bit word: a single 64-bit CAS claims key and value together). One thread handles one key
and scans a window in slot order, which is what a cooperative group's ballot (lowest lane first)
decides, so host, CUDA kernels and these functions agree on where every key lives.

Inserts never grow the table: a key that would take the table past its max load factor is refused
(return -1), as the host's growable=False tables do. Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)
NumPy warns about the (intended) wrap-around of 64-bit multiplications: filter RuntimeWarning.
"""
from __future__ import annotations

import numba
import numpy as np
import torch
from numba import cuda

__all__ = ["map_insert", "map_find", "counting_add", "set_insert", "set_contains", "packed_insert",
           "packed_find", "DeviceView"]

_U = numba.uint64
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_S32 = np.uint64(32)
_LO32 = np.uint64(0xFFFFFFFF)
_EMPTY64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_TOMB64 = np.uint64(0xFFFFFFFFFFFFFFFE)
_EMPTY32 = np.uint64(0xFFFFFFFF)
_TOMB32 = np.uint64(0xFFFFFFFE)
_ZERO = np.uint64(0)
_ONE = np.uint64(1)
_TWO = np.uint64(2)
_THREE = np.uint64(3)
_FOUR = np.uint64(4)
_SEVEN = np.uint64(7)

# status values returned by inserts
NEW, EXISTED, FULL = 1, 0, -1


@cuda.jit(device=True, inline=True)
def _fmix64(k):
    k ^= k >> _S33
    k *= _M1
    k ^= k >> _S33
    k *= _M2
    k ^= k >> _S33
    return k


@cuda.jit(device=True, inline=True)
def _probe_start(key, seed, nw):
    h = _fmix64(_U(key) ^ _U(seed))
    n = _U(nw)
    w = ((h >> _S32) * n) >> _S32
    step = _ONE + (((h & _LO32) * (n - _ONE)) >> _S32)
    return w, step, _ONE << (h & _SEVEN)


# The overflow filter (hash_layout.h): byte w of special's words after the first 4. Inserts that leave a
# window without having met a free slot set the key's tag bit there; lookups stop at a full window
# whose byte lacks it.
@cuda.jit(device=True, inline=True)
def _ovf_has(special, w, tag):
    return ((special[_FOUR + (w >> _THREE)] >> ((w & _SEVEN) * _U(8))) & tag) != _ZERO


@cuda.jit(device=True, inline=True)
def _ovf_mark(special, w, tag):
    word = _FOUR + (w >> _THREE)
    bit = tag << ((w & _SEVEN) * _U(8))
    if (special[word] & bit) == _ZERO:
        cuda.atomic.or_(special, word, bit)


@cuda.jit(device=True, inline=True)
def _next(w, step, nw):
    w += step
    if w >= _U(nw):
        w -= _U(nw)
    return w


@cuda.jit(device=True, inline=True)
def _reserve(counters):
    """One more slot leaves EMPTY; False (and undone) when that passes the load limit."""
    used = cuda.atomic.add(counters, 0, 1)
    if used + 1 > counters[1]:
        cuda.atomic.sub(counters, 0, 1)
        return False
    return True


# Probing shared by the pair (2 words per slot, key first) and set (1 word) layouts; `stride` is the
# slot's word count as a uint64 (_TWO or _ONE), so index arithmetic stays in uint64.
_RETRY = 2  # _claim: the free slot was taken meanwhile; rescan (the winner may hold this very key)


@cuda.jit(device=True, inline=True)
def _scan_for_insert(slots, stride, special, nw, window, key, seed):
    """One probe sequence of an insert: (hit, free). hit is the slot holding `key` (_EMPTY64 if absent);
    free is the first EMPTY/TOMBSTONE slot met where the key belongs (_EMPTY64: every slot is live).
    Windows passed without a free slot get the key's overflow bit (the key will live beyond them)."""
    W = _U(window)
    w, step, tag = _probe_start(key, seed, nw)
    free = _EMPTY64
    t = _ZERO
    while t < _U(nw):
        base = w * W
        for j in range(window):
            s = base + _U(j)
            sk = slots[stride * s]
            if sk == key:
                return s, _EMPTY64
            if sk == _EMPTY64:  # beyond the first EMPTY the key cannot be
                if free == _EMPTY64:
                    free = s
                return _EMPTY64, free
            if sk == _TOMB64 and free == _EMPTY64:
                free = s
        if free == _EMPTY64:
            _ovf_mark(special, w, tag)
        elif not _ovf_has(special, w, tag):
            return _EMPTY64, free  # nor is it beyond: take the free slot met
        w = _next(w, step, nw)
        t += _ONE
    return _EMPTY64, free


@cuda.jit(device=True, inline=True)
def _claim(slots, stride, counters, free, key):
    """CAS `key` into slot `free`: NEW when claimed, _RETRY when it was taken meanwhile, FULL when an
    EMPTY slot would pass the load limit."""
    expect = slots[stride * free]
    if expect != _EMPTY64 and expect != _TOMB64:
        return _RETRY
    from_empty = expect == _EMPTY64
    if from_empty and not _reserve(counters):
        return FULL
    if cuda.atomic.cas(slots, stride * free, expect, key) == expect:
        cuda.atomic.add(counters, 2, 1)
        return NEW
    if from_empty:
        cuda.atomic.sub(counters, 0, 1)
    return _RETRY


@cuda.jit(device=True, inline=True)
def _find_slot(slots, stride, special, nw, window, seed, key):
    """The slot holding `key`, or _EMPTY64."""
    W = _U(window)
    w, step, tag = _probe_start(key, seed, nw)
    t = _ZERO
    while t < _U(nw):
        base = w * W
        for j in range(window):
            s = base + _U(j)
            sk = slots[stride * s]
            if sk == key:
                return s
            if sk == _EMPTY64:
                return _EMPTY64
        if not _ovf_has(special, w, tag):
            return _EMPTY64
        w = _next(w, step, nw)
        t += _ONE
    return _EMPTY64


# ------------------------------------------------------------------------------------------------
# 8-byte keys, 8-byte values: slots is uint64[2 * capacity], key at 2s, value at 2s + 1
# ------------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def _pair_upsert(slots, special, counters, nw, window, seed, key, value, add):
    key = _U(key)
    value = _U(value)
    if key >= _TOMB64:  # reserved patterns live out of band
        s = 0 if key == _EMPTY64 else 1
        fresh = cuda.atomic.cas(special, 2 * s, _ZERO, _ONE) == _ZERO
        if add:
            cuda.atomic.add(special, 2 * s + 1, value)
        else:
            special[2 * s + 1] = value
        if fresh:
            cuda.atomic.add(counters, 2, 1)
            return NEW
        return EXISTED
    while True:
        hit, free = _scan_for_insert(slots, _TWO, special, nw, window, key, seed)
        if hit != _EMPTY64:
            if add:
                cuda.atomic.add(slots, _TWO * hit + _ONE, value)
            else:
                slots[_TWO * hit + _ONE] = value
            return EXISTED
        if free == _EMPTY64:
            return FULL
        st = _claim(slots, _TWO, counters, free, key)
        if st == NEW:
            # Counting: a free slot's value is 0 and other threads may add once the key is visible.
            if add:
                cuda.atomic.add(slots, _TWO * free + _ONE, value)
            else:
                slots[_TWO * free + _ONE] = value
        if st != _RETRY:
            return st


@cuda.jit(device=True)
def map_insert(slots, special, counters, nw, window, seed, key, value):
    """Upsert key -> value (uint64 bit patterns). Returns 1 new, 0 updated, -1 table full."""
    return _pair_upsert(slots, special, counters, nw, window, seed, key, value, False)


@cuda.jit(device=True)
def counting_add(slots, special, counters, nw, window, seed, key, inc):
    """count[key] += inc (CountingTable). Returns 1 if the key was new, 0 if not, -1 table full."""
    return _pair_upsert(slots, special, counters, nw, window, seed, key, inc, True)


@cuda.jit(device=True)
def map_find(slots, special, nw, window, seed, key):
    """(value bits, found) of a key (CountingTable: its count)."""
    key = _U(key)
    if key >= _TOMB64:
        s = 0 if key == _EMPTY64 else 1
        if special[2 * s] != _ZERO:
            return special[2 * s + 1], True
        return _ZERO, False
    s = _find_slot(slots, _TWO, special, nw, window, seed, key)
    if s == _EMPTY64:
        return _ZERO, False
    return slots[_TWO * s + _ONE], True


# ------------------------------------------------------------------------------------------------
# 8-byte keys, no values (HashSet): slots is uint64[capacity]
# ------------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def set_insert(slots, special, counters, nw, window, seed, key):
    """Adds a key. Returns 1 new, 0 present, -1 table full."""
    key = _U(key)
    if key >= _TOMB64:
        s = 0 if key == _EMPTY64 else 1
        if cuda.atomic.cas(special, 2 * s, _ZERO, _ONE) == _ZERO:
            cuda.atomic.add(counters, 2, 1)
            return NEW
        return EXISTED
    while True:
        hit, free = _scan_for_insert(slots, _ONE, special, nw, window, key, seed)
        if hit != _EMPTY64:
            return EXISTED
        if free == _EMPTY64:
            return FULL
        st = _claim(slots, _ONE, counters, free, key)
        if st != _RETRY:
            return st


@cuda.jit(device=True)
def set_contains(slots, special, nw, window, seed, key):
    key = _U(key)
    if key >= _TOMB64:
        return special[2 * (0 if key == _EMPTY64 else 1)] != _ZERO
    return _find_slot(slots, _ONE, special, nw, window, seed, key) != _EMPTY64


# ------------------------------------------------------------------------------------------------
# 4-byte keys with 4-byte values packed in one uint64 word (key in the low half): slots is
# uint64[capacity]; one 64-bit CAS claims key and value together (WarpCore's packed pairs).
# ------------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def packed_insert(slots, special, counters, nw, window, seed, key, value):
    """Upsert of a 4-byte key (bits in the low 32 of `key`) -> 4-byte value bits. 1 new, 0 updated, -1 full."""
    key = _U(key) & _LO32
    value = _U(value) & _LO32
    if key >= _TOMB32:
        s = 0 if key == _EMPTY32 else 1
        fresh = cuda.atomic.cas(special, 2 * s, _ZERO, _ONE) == _ZERO
        special[2 * s + 1] = value
        if fresh:
            cuda.atomic.add(counters, 2, 1)
            return NEW
        return EXISTED
    W = _U(window)
    packed = key | (value << _S32)
    while True:
        w, step, tag = _probe_start(key, seed, nw)
        free = _EMPTY64
        t = _ZERO
        stop = False
        while t < _U(nw) and not stop:
            base = w * W
            for j in range(window):
                s = base + _U(j)
                word = slots[s]
                sk = word & _LO32
                if sk == key:
                    while True:  # replace the value half, keep the key half
                        old = cuda.atomic.cas(slots, s, word, packed)
                        if old == word:
                            return EXISTED
                        word = old
                if sk == _EMPTY32:
                    if free == _EMPTY64:
                        free = s
                    stop = True
                    break
                if sk == _TOMB32 and free == _EMPTY64:
                    free = s
            if not stop:
                if free == _EMPTY64:
                    _ovf_mark(special, w, tag)  # the key will live beyond this window
                elif not _ovf_has(special, w, tag):
                    break  # nor is it beyond: take the free slot met
                w = _next(w, step, nw)
                t += _ONE
        if free == _EMPTY64:
            return FULL
        word = slots[free]
        sk = word & _LO32
        if sk != _EMPTY32 and sk != _TOMB32:
            continue
        from_empty = sk == _EMPTY32
        if from_empty and not _reserve(counters):
            return FULL
        if cuda.atomic.cas(slots, free, word, packed) == word:
            cuda.atomic.add(counters, 2, 1)
            return NEW
        if from_empty:
            cuda.atomic.sub(counters, 0, 1)


@cuda.jit(device=True)
def packed_find(slots, special, nw, window, seed, key):
    """(value bits, found) for a 4-byte key."""
    key = _U(key) & _LO32
    if key >= _TOMB32:
        s = 0 if key == _EMPTY32 else 1
        if special[2 * s] != _ZERO:
            return special[2 * s + 1] & _LO32, True
        return _ZERO, False
    W = _U(window)
    w, step, tag = _probe_start(key, seed, nw)
    t = _ZERO
    while t < _U(nw):
        base = w * W
        for j in range(window):
            word = slots[base + _U(j)]
            sk = word & _LO32
            if sk == key:
                return word >> _S32, True
            if sk == _EMPTY32:
                return _ZERO, False
        if not _ovf_has(special, w, tag):
            return _ZERO, False
        w = _next(w, step, nw)
        t += _ONE
    return _ZERO, False


# ------------------------------------------------------------------------------------------------
# Handing a table's arrays to a kernel
# ------------------------------------------------------------------------------------------------
def _as_u64_array(t: torch.Tensor):
    t = t.view(torch.int64)
    if t.device.type == "cuda":
        return cuda.as_cuda_array(t).view(np.uint64)
    return t.numpy().view(np.uint64)  # the CUDA simulator works on host arrays (shared memory)


class DeviceView:
    """The arrays and scalars device functions take, as `args`:
    (slots uint64[], special uint64[4 + overflow filter], counters int64[3] = [used slots, load limit, new keys], nw,
    window, seed). A context manager: on exit, the host table's len() and load accounting take in
    what the kernel inserted."""

    def __init__(self, table):
        layouts = {(8, 8): "pair64", (8, 0): "set64", (4, 4): "packed32"}
        self.layout = layouts.get((table._kb, table._vb))
        if self.layout is None:
            raise NotImplementedError(
                f"pykernels.hashing.device: no device functions for {table._kb}-byte keys with "
                f"{table._vb}-byte value slots (supported: 8/8 HashMap and CountingTable, 8/- HashSet, "
                "4/4 HashMap)")
        if table._multi:
            raise NotImplementedError("pykernels.hashing.device: MultiValueHashMap has no device functions yet")
        self.table = table
        self._counters = torch.tensor([table._used, table._limit(), 0], dtype=torch.int64, device=table.device)
        self.args = (_as_u64_array(table._slots), _as_u64_array(table._special), _as_counters(self._counters),
                     table._nw, table.window, table.seed)

    def commit(self):
        used, _, new = (int(x) for x in self._counters.cpu().tolist())
        self.table._used = used
        self.table._size += new
        self._counters[2] = 0

    def __enter__(self):
        self.table._lock.acquire()
        return self

    def __exit__(self, *exc):
        try:
            if self.table.device.type == "cuda":
                torch.cuda.synchronize(self.table.device)
            self.commit()
        finally:
            self.table._lock.release()
        return False


def _as_counters(t: torch.Tensor):
    if t.device.type == "cuda":
        return cuda.as_cuda_array(t)
    return t.numpy()
