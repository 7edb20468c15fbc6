"""numba.cuda device functions over a table's arrays: WarpCore's device-side operations, for Python.

A user's own `@numba.cuda.jit` kernel can insert into, look up in and count with a table that the host
API (`pykernels.HashMap`, `CountingTable`, `HashSet`, `MultiValueHashMap`) built or will read: the
functions below walk the very same layout (csrc/hash/hash_layout.h) -- same hash, same windows, same
double hashing, same EMPTY/TOMBSTONE patterns, the same overflow filter and the same out-of-band store
for keys equal to those patterns.

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

Which functions fit a table is decided by its slot layout (hash_layout.h: a slot is {key} or {key, value}
with natural alignment; _layout.slot_bytes). `DeviceView.layout` names it and `DeviceView.functions`
maps the table's operations to the functions for it (see DeviceView):

    layout    key/value bytes  tables                                        functions
    pair64    8 / 8  (16 B)    HashMap, MultiValueHashMap: 8-byte keys and   map_insert, map_find, counting_add,
                               values; CountingTable: 8-byte keys            multi_insert, multi_count, multi_find
    k8v4      8 / 4  (16 B)    HashMap, MultiValueHashMap: 8-byte keys,      map_k8v4_insert, map_k8v4_find,
                               1-4 byte values                               multi_k8v4_insert/_count/_find
    k4v8      4 / 8  (16 B)    HashMap, MultiValueHashMap: 4-byte keys,      map_k4v8_insert, map_k4v8_find,
                               8-byte values; CountingTable: 4-byte keys     counting_k4v8_add,
                                                                             multi_k4v8_insert/_count/_find
    packed32  4 / 4  (8 B)     HashMap, MultiValueHashMap: 4-byte keys,      packed_insert, packed_find,
                               1-4 byte values                               packed_multi_insert/_count/_find
    set64     8 / -  (8 B)     HashSet: 8-byte keys                          set_insert, set_contains
    set32     4 / -  (4 B)     HashSet: 4-byte keys                          set32_insert, set32_contains

Keys and values are passed as their bit patterns in uint64 (view an int64 tensor as uint64; a float64
value as its bits). 4-byte keys and values use the low 32 bits (the high ones are ignored, so an int32
key may come sign-extended); 1-2 byte values are widened to 4 bytes as the host widens them
(`pykernels.hashing._layout.value_bits`). One thread handles one key and scans a window in slot order,
which is what a cooperative group's ballot (lowest lane first) decides, so host, CUDA kernels and these
functions agree on where every key lives.

Inserts return NEW (1), EXISTED (0: a map's value was updated, a counting table's count added to) or
FULL (-1): they never grow the table, so a key that would take it past its max load factor is refused,
as the host's growable=False tables do. Keys equal to the reserved patterns (EMPTY = all ones,
TOMBSTONE = all ones - 1 of the key's width: -1 and -2 of a signed key) live out of band in `special`,
on the device as on the host -- except in a MultiValueHashMap, which keeps their values host-side in
Python lists (_tables.py) that device code cannot reach: its device functions return RESERVED (-2) for
such keys and store nothing; insert and read them with the host API. Under the CUDA simulator
(NUMBA_ENABLE_CUDASIM=1) NumPy warns about the (intended) wrap-around of 64-bit multiplications: filter
RuntimeWarning.
"""
from __future__ import annotations

import weakref

import numba
import numpy as np
import torch
from numba import cuda

from ._tables import normal_tensors

__all__ = ["map_insert", "map_find", "counting_add", "set_insert", "set_contains", "packed_insert",
           "packed_find", "set32_insert", "set32_contains", "map_k8v4_insert", "map_k8v4_find",
           "map_k4v8_insert", "map_k4v8_find", "counting_k4v8_add", "multi_insert", "multi_count",
           "multi_find", "multi_k8v4_insert", "multi_k8v4_count", "multi_k8v4_find", "multi_k4v8_insert",
           "multi_k4v8_count", "multi_k4v8_find", "packed_multi_insert", "packed_multi_count",
           "packed_multi_find", "NEW", "EXISTED", "FULL", "RESERVED", "DeviceView"]

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

# Status values returned by inserts. RESERVED: a MultiValueHashMap key equal to the EMPTY/TOMBSTONE
# pattern, whose values the host keeps in Python lists (see the module docstring); nothing was stored.
NEW, EXISTED, FULL, RESERVED = 1, 0, -1, -2

# A key's width is given to the shared helpers as `kmask`, its all-ones pattern: _EMPTY64 for 8-byte
# keys, _LO32 for 4-byte ones. It is the key's EMPTY pattern, kmask - 1 its TOMBSTONE (hash_layout.h
# Sentinel<K>), and `word & kmask` the key bits of a slot word that may also hold padding (k4v8) or the
# value (packed32). `vmask` likewise cuts a value to its slot width.


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


# Probing shared by every layout. `stride` is the slot's word count in `slots` as a uint64 (_TWO for
# the 16-byte slots, key word first; _ONE for set64/set32/packed32), so index arithmetic stays in
# uint64; the key bits of slot s are slots[stride * s] & kmask.
_RETRY = 2  # _claim: the free slot was taken meanwhile; rescan (the winner may hold this very key)


@cuda.jit(device=True, inline=True)
def _scan_for_insert(slots, stride, kmask, special, nw, window, key, seed):
    """One probe sequence of an insert: (hit, free). hit is the slot holding `key` (_EMPTY64 if absent);
    free is the first EMPTY/TOMBSTONE slot met where the key belongs (_EMPTY64: every slot is live).
    Windows passed without a free slot get the key's overflow bit (the key will live beyond them)."""
    W = _U(window)
    tomb = kmask - _ONE
    w, step, tag = _probe_start(key, seed, nw)
    free = _EMPTY64
    t = _ZERO
    while t < _U(nw):
        base = w * W
        for j in range(window):
            s = base + _U(j)
            sk = slots[stride * s] & kmask
            if sk == key:
                return s, _EMPTY64
            if sk == kmask:  # EMPTY: beyond the first EMPTY the key cannot be
                if free == _EMPTY64:
                    free = s
                return _EMPTY64, free
            if sk == tomb and free == _EMPTY64:
                free = s
        if free == _EMPTY64:
            _ovf_mark(special, w, tag)
        elif not _ovf_has(special, w, tag):
            return _EMPTY64, free  # nor is it beyond: take the free slot met
        w = _next(w, step, nw)
        t += _ONE
    return _EMPTY64, free


@cuda.jit(device=True, inline=True)
def _scan_for_append(slots, stride, kmask, special, nw, window, key, seed):
    """The first EMPTY/TOMBSTONE slot on the key's probe sequence, _EMPTY64 if every slot is live. A
    multi-value map keeps every pair in its own slot, so an append does not look for the key
    (hash_cpu.cpp ins_step / hash.cu group_insert with M_APPEND); windows passed get its overflow bit."""
    W = _U(window)
    tomb = kmask - _ONE
    w, step, tag = _probe_start(key, seed, nw)
    t = _ZERO
    while t < _U(nw):
        base = w * W
        for j in range(window):
            s = base + _U(j)
            sk = slots[stride * s] & kmask
            if sk == kmask or sk == tomb:
                return s
        _ovf_mark(special, w, tag)
        w = _next(w, step, nw)
        t += _ONE
    return _EMPTY64


@cuda.jit(device=True, inline=True)
def _claim(slots, idx, kmask, counters, keep, bits):
    """CAS word `idx`, whose key bits must be EMPTY or TOMBSTONE, to (word & keep) | bits: NEW when
    claimed, _RETRY when it was taken meanwhile, FULL when an EMPTY slot would pass the load limit.
    keep = ~kmask keeps what is not the key (k4v8: the padding after the key, never written); packed32
    passes keep = 0 and bits = key and value, claimed together by one 64-bit CAS."""
    word = slots[idx]
    sk = word & kmask
    if sk != kmask and sk != kmask - _ONE:
        return _RETRY
    from_empty = sk == kmask
    if from_empty and not _reserve(counters):
        # Past the load limit, or other threads' reservations are in flight: duplicates of one new key
        # all reserve before one of them stores it (a warp's lanes in lockstep), so most of them were
        # refused although room was left once the losers undid theirs (review finding). Room now: try
        # again (the caller rescans, and finds the key if a sibling stored it); else FULL, which the
        # upserts still turn into EXISTED when the key has been stored meanwhile (_stored_meanwhile).
        return _RETRY if counters[0] < counters[1] else FULL
    if cuda.atomic.cas(slots, idx, word, (word & keep) | bits) == word:
        cuda.atomic.add(counters, 2, 1)
        return NEW
    if from_empty:
        cuda.atomic.sub(counters, 0, 1)
    return _RETRY


@cuda.jit(device=True, inline=True)
def _find_slot(slots, stride, kmask, special, nw, window, seed, key):
    """The slot holding `key`, or _EMPTY64."""
    W = _U(window)
    w, step, tag = _probe_start(key, seed, nw)
    t = _ZERO
    while t < _U(nw):
        base = w * W
        for j in range(window):
            s = base + _U(j)
            sk = slots[stride * s] & kmask
            if sk == key:
                return s
            if sk == kmask:
                return _EMPTY64
        if not _ovf_has(special, w, tag):
            return _EMPTY64
        w = _next(w, step, nw)
        t += _ONE
    return _EMPTY64


@cuda.jit(device=True, inline=True)
def _multi_walk(slots, stride, voff, vshift, kmask, vmask, special, nw, window, seed, key, out, start, cap):
    """Number of slots holding `key` (hash_cpu.cpp multi_walk_impl: every slot on the probe sequence up
    to the first EMPTY, or a full window whose filter byte lacks the key's tag). The first `cap` values,
    in probe order, go to out[start], out[start + 1], ...; cap 0 only counts (`out` is not touched).
    The value of slot s is (slots[stride * s + voff] >> vshift) & vmask."""
    W = _U(window)
    w, step, tag = _probe_start(key, seed, nw)
    n = 0
    t = _ZERO
    while t < _U(nw):
        base = w * W
        for j in range(window):
            i = stride * (base + _U(j))
            sk = slots[i] & kmask
            if sk == key:
                if n < cap:
                    out[start + n] = (slots[i + voff] >> vshift) & vmask
                n += 1
            if sk == kmask:
                return n
        if not _ovf_has(special, w, tag):
            return n
        w = _next(w, step, nw)
        t += _ONE
    return n


# ------------------------------------------------------------------------------------------------
# 16-byte slots {key, value}: slots is uint64[2 * capacity], the key word at 2s, the value word at
# 2s + 1 (Slot<K, V> with natural alignment, hash_layout.h). pair64: both 8 bytes. k8v4: the value is
# the low half of word 2s + 1 (its high half is padding, zero). k4v8: the key is the low half of word
# 2s (its high half is padding, zero, and kept by the key's CAS).
# ------------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def _pair_upsert(slots, special, counters, nw, window, seed, key, value, add, kmask, vmask):
    key = _U(key) & kmask
    value = _U(value) & vmask
    if key >= kmask - _ONE:  # reserved patterns live out of band
        s = 0 if key == kmask else 1
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
        hit, free = _scan_for_insert(slots, _TWO, kmask, special, nw, window, key, seed)
        if hit != _EMPTY64:
            if add:
                cuda.atomic.add(slots, _TWO * hit + _ONE, value)
            else:
                slots[_TWO * hit + _ONE] = value
            return EXISTED
        if free == _EMPTY64:
            return FULL
        st = _claim(slots, _TWO * free, kmask, counters, kmask ^ _EMPTY64, key)
        if st == FULL:
            free = _find_slot(slots, _TWO, kmask, special, nw, window, seed, key)  # stored meanwhile?
            if free == _EMPTY64:
                return FULL
            st = EXISTED
        if st != _RETRY:
            # Counting: a free slot's value is 0 and other threads may add once the key is visible.
            if add:
                cuda.atomic.add(slots, _TWO * free + _ONE, value)
            else:
                slots[_TWO * free + _ONE] = value
            return st


@cuda.jit(device=True)
def _pair_find(slots, special, nw, window, seed, key, kmask, vmask):
    key = _U(key) & kmask
    if key >= kmask - _ONE:
        s = 0 if key == kmask else 1
        if special[2 * s] != _ZERO:
            return special[2 * s + 1] & vmask, True
        return _ZERO, False
    s = _find_slot(slots, _TWO, kmask, special, nw, window, seed, key)
    if s == _EMPTY64:
        return _ZERO, False
    return slots[_TWO * s + _ONE] & vmask, True


@cuda.jit(device=True)
def map_insert(slots, special, counters, nw, window, seed, key, value):
    """pair64: upsert key -> value (uint64 bit patterns). Returns 1 new, 0 updated, -1 table full."""
    return _pair_upsert(slots, special, counters, nw, window, seed, key, value, False, _EMPTY64, _EMPTY64)


@cuda.jit(device=True)
def counting_add(slots, special, counters, nw, window, seed, key, inc):
    """pair64: count[key] += inc (CountingTable). Returns 1 if the key was new, 0 if not, -1 table full."""
    return _pair_upsert(slots, special, counters, nw, window, seed, key, inc, True, _EMPTY64, _EMPTY64)


@cuda.jit(device=True)
def map_find(slots, special, nw, window, seed, key):
    """pair64: (value bits, found) of a key (CountingTable: its count)."""
    return _pair_find(slots, special, nw, window, seed, key, _EMPTY64, _EMPTY64)


@cuda.jit(device=True)
def map_k8v4_insert(slots, special, counters, nw, window, seed, key, value):
    """k8v4: upsert of an 8-byte key -> 4-byte value bits (the low 32 of `value`). 1 new, 0 updated, -1 full."""
    return _pair_upsert(slots, special, counters, nw, window, seed, key, value, False, _EMPTY64, _LO32)


@cuda.jit(device=True)
def map_k8v4_find(slots, special, nw, window, seed, key):
    """k8v4: (value bits in the low 32, found) of an 8-byte key."""
    return _pair_find(slots, special, nw, window, seed, key, _EMPTY64, _LO32)


@cuda.jit(device=True)
def map_k4v8_insert(slots, special, counters, nw, window, seed, key, value):
    """k4v8: upsert of a 4-byte key (the low 32 bits of `key`) -> 8-byte value bits. 1 new, 0 updated, -1 full."""
    return _pair_upsert(slots, special, counters, nw, window, seed, key, value, False, _LO32, _EMPTY64)


@cuda.jit(device=True)
def counting_k4v8_add(slots, special, counters, nw, window, seed, key, inc):
    """k4v8: count[key] += inc for a CountingTable with 4-byte keys. 1 new key, 0 not, -1 full."""
    return _pair_upsert(slots, special, counters, nw, window, seed, key, inc, True, _LO32, _EMPTY64)


@cuda.jit(device=True)
def map_k4v8_find(slots, special, nw, window, seed, key):
    """k4v8: (value bits, found) of a 4-byte key (CountingTable: its count)."""
    return _pair_find(slots, special, nw, window, seed, key, _LO32, _EMPTY64)


# ---- MultiValueHashMap over 16-byte slots: every pair in its own slot ----
@cuda.jit(device=True)
def _pair_append(slots, special, counters, nw, window, seed, key, value, kmask, vmask):
    key = _U(key) & kmask
    value = _U(value) & vmask
    if key >= kmask - _ONE:
        return RESERVED  # kept host-side (MultiValueHashMap._special_multi)
    while True:
        free = _scan_for_append(slots, _TWO, kmask, special, nw, window, key, seed)
        if free == _EMPTY64:
            return FULL
        st = _claim(slots, _TWO * free, kmask, counters, kmask ^ _EMPTY64, key)
        if st == NEW:
            slots[_TWO * free + _ONE] = value
        if st != _RETRY:
            return st


@cuda.jit(device=True)
def _pair_multi_find(slots, special, nw, window, seed, key, out, start, cap, kmask, vmask):
    key = _U(key) & kmask
    if key >= kmask - _ONE:
        return RESERVED
    return _multi_walk(slots, _TWO, _ONE, _ZERO, kmask, vmask, special, nw, window, seed, key, out, start, cap)


@cuda.jit(device=True)
def multi_insert(slots, special, counters, nw, window, seed, key, value):
    """pair64 MultiValueHashMap: adds the pair (key, value), even when the key already has values.
    Returns 1 (stored), -1 table full, -2 RESERVED (key bits equal to EMPTY/TOMBSTONE: insert on the host)."""
    return _pair_append(slots, special, counters, nw, window, seed, key, value, _EMPTY64, _EMPTY64)


@cuda.jit(device=True)
def multi_count(slots, special, nw, window, seed, key):
    """pair64 MultiValueHashMap: the number of values of `key`; -2 RESERVED for a reserved key pattern."""
    return _pair_multi_find(slots, special, nw, window, seed, key, special, 0, 0, _EMPTY64, _EMPTY64)


@cuda.jit(device=True)
def multi_find(slots, special, nw, window, seed, key, out, start, cap):
    """pair64 MultiValueHashMap: writes the key's first `cap` value bits (probe order, as the host's
    find) to out[start:] (a uint64 array) and returns its number of values (-2 RESERVED as multi_count)."""
    return _pair_multi_find(slots, special, nw, window, seed, key, out, start, cap, _EMPTY64, _EMPTY64)


@cuda.jit(device=True)
def multi_k8v4_insert(slots, special, counters, nw, window, seed, key, value):
    """k8v4 MultiValueHashMap: multi_insert of an 8-byte key and 4-byte value bits."""
    return _pair_append(slots, special, counters, nw, window, seed, key, value, _EMPTY64, _LO32)


@cuda.jit(device=True)
def multi_k8v4_count(slots, special, nw, window, seed, key):
    """k8v4 MultiValueHashMap: multi_count."""
    return _pair_multi_find(slots, special, nw, window, seed, key, special, 0, 0, _EMPTY64, _LO32)


@cuda.jit(device=True)
def multi_k8v4_find(slots, special, nw, window, seed, key, out, start, cap):
    """k8v4 MultiValueHashMap: multi_find (value bits in the low 32 of each out word)."""
    return _pair_multi_find(slots, special, nw, window, seed, key, out, start, cap, _EMPTY64, _LO32)


@cuda.jit(device=True)
def multi_k4v8_insert(slots, special, counters, nw, window, seed, key, value):
    """k4v8 MultiValueHashMap: multi_insert of a 4-byte key and 8-byte value bits."""
    return _pair_append(slots, special, counters, nw, window, seed, key, value, _LO32, _EMPTY64)


@cuda.jit(device=True)
def multi_k4v8_count(slots, special, nw, window, seed, key):
    """k4v8 MultiValueHashMap: multi_count."""
    return _pair_multi_find(slots, special, nw, window, seed, key, special, 0, 0, _LO32, _EMPTY64)


@cuda.jit(device=True)
def multi_k4v8_find(slots, special, nw, window, seed, key, out, start, cap):
    """k4v8 MultiValueHashMap: multi_find."""
    return _pair_multi_find(slots, special, nw, window, seed, key, out, start, cap, _LO32, _EMPTY64)


# ------------------------------------------------------------------------------------------------
# Key-only slots (HashSet). set64: slots is uint64[capacity]. set32: slots is uint32[capacity] (4-byte
# slots, hash_layout.h Slot<K, NoVal>; an odd capacity has no uint64 view), claimed by a 32-bit CAS.
# ------------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def _set_insert(slots, special, counters, nw, window, seed, key, kmask):
    key = _U(key) & kmask
    if key >= kmask - _ONE:
        s = 0 if key == kmask else 1
        if cuda.atomic.cas(special, 2 * s, _ZERO, _ONE) == _ZERO:
            cuda.atomic.add(counters, 2, 1)
            return NEW
        return EXISTED
    while True:
        hit, free = _scan_for_insert(slots, _ONE, kmask, special, nw, window, key, seed)
        if hit != _EMPTY64:
            return EXISTED
        if free == _EMPTY64:
            return FULL
        st = _claim(slots, free, kmask, counters, kmask ^ _EMPTY64, key)
        if st == FULL and _find_slot(slots, _ONE, kmask, special, nw, window, seed, key) != _EMPTY64:
            return EXISTED  # stored meanwhile by another thread (see _claim)
        if st != _RETRY:
            return st


@cuda.jit(device=True)
def _set_contains(slots, special, nw, window, seed, key, kmask):
    key = _U(key) & kmask
    if key >= kmask - _ONE:
        return special[2 * (0 if key == kmask else 1)] != _ZERO
    return _find_slot(slots, _ONE, kmask, special, nw, window, seed, key) != _EMPTY64


@cuda.jit(device=True)
def set_insert(slots, special, counters, nw, window, seed, key):
    """set64: adds a key. Returns 1 new, 0 present, -1 table full."""
    return _set_insert(slots, special, counters, nw, window, seed, key, _EMPTY64)


@cuda.jit(device=True)
def set_contains(slots, special, nw, window, seed, key):
    """set64: whether the key is in the set."""
    return _set_contains(slots, special, nw, window, seed, key, _EMPTY64)


@cuda.jit(device=True)
def set32_insert(slots, special, counters, nw, window, seed, key):
    """set32 (`slots` uint32): adds a 4-byte key (the low 32 bits of `key`). 1 new, 0 present, -1 full."""
    return _set_insert(slots, special, counters, nw, window, seed, key, _LO32)


@cuda.jit(device=True)
def set32_contains(slots, special, nw, window, seed, key):
    """set32 (`slots` uint32): whether the 4-byte key is in the set."""
    return _set_contains(slots, special, nw, window, seed, key, _LO32)


# ------------------------------------------------------------------------------------------------
# packed32: 4-byte keys with 4-byte values packed in one uint64 word (key in the low half): slots is
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
            if counters[0] < counters[1]:
                continue  # reservations in flight were undone: room again (see _claim)
            # stored meanwhile by another thread: the next scan finds it and replaces its value
            if packed_find(slots, special, nw, window, seed, key)[1]:
                continue
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


@cuda.jit(device=True)
def packed_multi_insert(slots, special, counters, nw, window, seed, key, value):
    """packed32 MultiValueHashMap: adds the pair (4-byte key, 4-byte value bits), claimed with its value by
    one 64-bit CAS (hash.cu group_insert, kPacked). Returns 1 (stored), -1 table full, -2 RESERVED."""
    key = _U(key) & _LO32
    value = _U(value) & _LO32
    if key >= _TOMB32:
        return RESERVED  # kept host-side (MultiValueHashMap._special_multi)
    while True:
        free = _scan_for_append(slots, _ONE, _LO32, special, nw, window, key, seed)
        if free == _EMPTY64:
            return FULL
        st = _claim(slots, free, _LO32, counters, _ZERO, key | (value << _S32))
        if st != _RETRY:
            return st


@cuda.jit(device=True)
def packed_multi_count(slots, special, nw, window, seed, key):
    """packed32 MultiValueHashMap: multi_count."""
    key = _U(key) & _LO32
    if key >= _TOMB32:
        return RESERVED
    return _multi_walk(slots, _ONE, _ZERO, _S32, _LO32, _LO32, special, nw, window, seed, key, special, 0, 0)


@cuda.jit(device=True)
def packed_multi_find(slots, special, nw, window, seed, key, out, start, cap):
    """packed32 MultiValueHashMap: multi_find (value bits in the low 32 of each out word)."""
    key = _U(key) & _LO32
    if key >= _TOMB32:
        return RESERVED
    return _multi_walk(slots, _ONE, _ZERO, _S32, _LO32, _LO32, special, nw, window, seed, key, out, start, cap)


# ------------------------------------------------------------------------------------------------
# Handing a table's arrays to a kernel
# ------------------------------------------------------------------------------------------------
def _as_u64_array(t: torch.Tensor):
    t = t.view(torch.int64)
    if t.device.type == "cuda":
        return cuda.as_cuda_array(t).view(np.uint64)
    return t.numpy().view(np.uint64)  # the CUDA simulator works on host arrays (shared memory)


def _as_u32_array(t: torch.Tensor):
    t = t.view(torch.int32)
    if t.device.type == "cuda":
        return cuda.as_cuda_array(t).view(np.uint32)
    return t.numpy().view(np.uint32)


def _as_counters(t: torch.Tensor):
    if t.device.type == "cuda":
        return cuda.as_cuda_array(t)
    return t.numpy()


# (key bytes, value-slot bytes) -> layout name (_layout.value_slot_bytes: 1-4 byte values take 4).
_LAYOUTS = {(8, 8): "pair64", (8, 4): "k8v4", (4, 8): "k4v8", (4, 4): "packed32", (8, 0): "set64",
            (4, 0): "set32"}

# (table kind, layout) -> the table's operations and the device functions doing them. Insert-type
# functions take DeviceView.args, the others DeviceView.read_args, then their own arguments.
_FUNCTIONS = {
    ("map", "pair64"): {"insert": map_insert, "find": map_find},
    ("map", "k8v4"): {"insert": map_k8v4_insert, "find": map_k8v4_find},
    ("map", "k4v8"): {"insert": map_k4v8_insert, "find": map_k4v8_find},
    ("map", "packed32"): {"insert": packed_insert, "find": packed_find},
    ("counting", "pair64"): {"add": counting_add, "find": map_find},
    ("counting", "k4v8"): {"add": counting_k4v8_add, "find": map_k4v8_find},
    ("set", "set64"): {"insert": set_insert, "contains": set_contains},
    ("set", "set32"): {"insert": set32_insert, "contains": set32_contains},
    ("multi", "pair64"): {"insert": multi_insert, "count": multi_count, "find": multi_find},
    ("multi", "k8v4"): {"insert": multi_k8v4_insert, "count": multi_k8v4_count, "find": multi_k8v4_find},
    ("multi", "k4v8"): {"insert": multi_k4v8_insert, "count": multi_k4v8_count, "find": multi_k4v8_find},
    ("multi", "packed32"): {"insert": packed_multi_insert, "count": packed_multi_count,
                            "find": packed_multi_find},
}


def _kind(table) -> str:
    if table._multi:
        return "multi"
    if table._counting:
        return "counting"
    return "set" if table._vb == 0 else "map"


def _binding(table):
    return table._slots.data_ptr(), table._special.data_ptr(), table._nw


class _SharedCounters:
    """The device counters [used slots, load limit, new keys] of a table's current arrays, shared by every
    DeviceView of them and held by the table (table._device_counters) until it is rehashed.

    One tensor for all views, owned by the table: with one tensor per view, two live views each let the
    device fill the table to its load limit, a view garbage-collected before commit() (a temporary
    `t.device_view().args`) lost its kernels' inserts from len() for good (items() then raised), and
    `with view:` after a kernel through the same view dropped that kernel's count (review findings).
    Every host call under the table's lock folds the counters in first (host_call_begins) and restarts
    them from the table's state after (host_call_ends), so the device sees the slots the host took or
    freed and the limit they leave. A rehash (growth, tombstone purge) happens inside a host call, after
    the fold: the table then drops these counters, and views bound to the old arrays are detached."""

    __slots__ = ("bound", "tensor", "used0", "limit0", "handles", "pinned")

    def __init__(self, table):
        self.bound = _binding(table)
        with normal_tensors():  # copied into in place (refused for an inference tensor outside inference mode)
            self.tensor = torch.zeros(3, dtype=torch.int64, device=table.device)
        self.handles = []  # weak references to the arrays over `tensor` handed to views (unhashable: no WeakSet)
        self.pinned = False  # a handle that cannot be tracked weakly: kept for good
        self.snapshot(table)

    def handle(self):
        """The counters as an array for a view's args, tracked: while none is alive, no kernel can add to
        them, and the table drops them after its next fold (a host call then costs no fold: after one
        device_view() every len() had read the tensor, 35x its cost; review finding)."""
        arr = _as_counters(self.tensor)
        try:
            self.handles.append(weakref.ref(arr))
        except TypeError:
            self.pinned = True
        return arr

    def in_use(self) -> bool:
        self.handles = [r for r in self.handles if r() is not None]
        return self.pinned or bool(self.handles)

    @staticmethod
    def of(table) -> "_SharedCounters":
        shared = table.__dict__.get("_device_counters")
        if shared is None or shared.bound != _binding(table):
            shared = table._device_counters = _SharedCounters(table)
        return shared

    def snapshot(self, table):
        self.used0, self.limit0 = table._used, table._limit()
        self.tensor.copy_(torch.tensor([self.used0, self.limit0, 0], dtype=torch.int64))

    def fold(self, table):
        """What kernels did since the last snapshot, into the table's counts."""
        if table.device.type == "cuda":
            torch.cuda.synchronize(table.device)
        used, _, new = (int(x) for x in self.tensor.cpu().tolist())
        if used != self.used0 or new:
            table._used += used - self.used0
            table._size += new
            self.snapshot(table)

    def host_call_begins(self, table):
        if self.bound == _binding(table):
            self.fold(table)

    def host_call_ends(self, table):
        if self.bound != _binding(table) or not self.in_use():
            # rehashed (the next view binds the new arrays), or folded with no view or args left to add more
            if table.__dict__.get("_device_counters") is self:
                del table._device_counters
        elif table._used != self.used0 or table._limit() != self.limit0:
            self.snapshot(table)


def _purge_blocking_tombstones(table):
    """Device inserts cannot purge tombstones (they count as used slots against the load limit), so a
    view purges them first where they take at least half the room left below the limit: a growable=False
    table with erased keys refused device inserts the host accepted (review finding). Not while another
    view of the arrays lives: a purge rehashes, and a kernel through that view would report NEW for keys
    that never reach the table (review finding)."""
    shared = table.__dict__.get("_device_counters")
    if shared is not None and shared.bound == _binding(table) and shared.in_use():
        return
    live = table._size - table._n_special()
    tombstones = table._used - live
    if tombstones > 0 and 2 * tombstones >= table._limit() - live:
        table._rehash(table.capacity)


class DeviceView:
    """A table's arrays and scalars, as device functions take them.

    `args` = (slots, special, counters, nw, window, seed) for the functions that insert (*_insert,
    *_add); `read_args` = (slots, special, nw, window, seed) for the others (*_find, *_contains,
    *_count). slots: the slot array as uint64 words, except layout "set32": uint32 (4-byte slots);
    special: uint64[4 + overflow filter] (hash_layout.h); counters: int64[3] = [used slots, load limit,
    new keys], one tensor shared by every view of the table's current arrays; nw: windows; window: slots
    per window; seed: the hash seed.

    `layout` names the table's slot layout and `functions` maps its operations to the device functions
    written for that layout (the table in the module docstring):
      HashMap             {"insert", "find"}           CountingTable  {"add", "find"}
      HashSet             {"insert", "contains"}       MultiValueHashMap  {"insert", "count", "find"}
    so a kernel can be written once for a kind of table:

        v = table.device_view()
        insert = v.functions["insert"]

        @cuda.jit
        def kernel(slots, special, counters, nw, window, seed, keys, vals, status):
            i = cuda.grid(1)
            if i < keys.size:
                status[i] = insert(slots, special, counters, nw, window, seed, keys[i], vals[i])

        with v:
            kernel[blocks, 256](*v.args, keys_u64, vals_u64, status)

    A context manager: on exit, the host table's len() and load accounting take in what the kernel
    inserted (or call commit() after the kernel). Host calls on the table (len() included) keep it in
    step: they count the kernels' inserts first, and the next kernel sees the slots they took (or freed:
    clear()). A host insert that grows the table (or purges its tombstones) rehashes it into new arrays:
    a view bound before then is detached, and commit() / leaving `with` raise, so take a new view; a
    kernel run through the detached view wrote into the old arrays, and those inserts are lost.
    device_view() itself purges erased keys' tombstones where they fill half the room left below the load
    limit (device inserts count them as used slots), unless another view of the arrays lives. A function
    of another layout than the table's reads its memory wrongly: take them from `functions`, or check
    `layout`."""

    def __init__(self, table):
        self.layout = _LAYOUTS.get((table._kb, table._vb))
        self.kind = _kind(table)
        self.functions = _FUNCTIONS.get((self.kind, self.layout))
        if self.functions is None:
            # Every table the host can build has an entry; this guards a future layout.
            raise NotImplementedError(
                f"pykernels.hashing.device: DeviceView has no device functions for a {type(table).__name__} with "
                f"{table._kb}-byte keys and {table._vb}-byte value slots (layout {self.layout})")
        self.table = table
        # Under the table's lock: a growth on another thread replaces slots, special and nw one by one
        # (review finding: a view could bind new slots to the old special).
        with table._locked():
            _purge_blocking_tombstones(table)
            self._shared = _SharedCounters.of(table)
            self._bound = self._shared.bound
            slots = _as_u32_array(table._slots) if self.layout == "set32" else _as_u64_array(table._slots)
            special = _as_u64_array(table._special)
            self.args = (slots, special, self._shared.handle(), table._nw, table.window, table.seed)
            self.read_args = (slots, special, table._nw, table.window, table.seed)

    def _check_bound(self):
        if _binding(self.table) != self._bound:
            raise RuntimeError("pykernels.hashing.device: the table was rehashed (grown, or its tombstones "
                               "purged) after device_view() bound its arrays, so a kernel would use the old "
                               "ones: take a new device_view()")

    def commit(self):
        """Counts in the table what kernels inserted through any view of its current arrays so far (the
        counters are shared); leaving `with` and every host call on the table do it too."""
        with self.table._lock:
            self._check_bound()
            self._shared.fold(self.table)

    def __enter__(self):
        self.table._lock.acquire()
        try:
            self._check_bound()
            # what kernels did before this `with` counts first (a snapshot here dropped it: review finding)
            self._shared.fold(self.table)
        except BaseException:
            self.table._lock.release()
            raise
        return self

    def __exit__(self, *exc):
        try:
            # bound first: a kernel through a view detached inside the block wrote into the old arrays, and
            # its count must not reach the table's (review finding: len() and items() disagreed for good)
            self._check_bound()
            self._shared.fold(self.table)  # (synchronizes first on CUDA)
        finally:
            self.table._lock.release()
        return False
