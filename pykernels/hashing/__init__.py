"""WarpCore-style hash tables (issue #4): HashMap, HashSet, CountingTable, MultiValueHashMap, BloomFilter.

All tables share one layout (csrc/hash/hash_layout.h; Juenger et al., "WarpCore: A Library for fast
Hash Tables on GPUs", HiPC 2020): open addressing over a prime number of windows of W slots, double
hashing between windows, CAS inserts, tombstones for erase. The same memory is probed by the native
CPU module (prefetching pipeline, threads + CAS), the CUDA/HIP module (cooperative probing groups with
a ballot over a window) and numba.cuda device functions in a user's kernel (`pykernels.hashing.device`).

    >>> t = pykernels.HashMap(1 << 20, key_dtype=torch.int64, value_dtype=torch.float32)
    >>> t.insert(torch.tensor([3, 5, 3]), torch.tensor([1.0, 2.0, 4.0]))
    tensor([ True,  True, False])
    >>> t.find(torch.tensor([5, 7]), default=-1.0)
    (tensor([ 2., -1.]), tensor([ True, False]))

Every key value is valid: the two bit patterns used internally as EMPTY/TOMBSTONE are stored out of
band. `capacity` is the number of slots (rounded up to a prime number of windows); a table holds at
most `max_load_factor * capacity` keys in its slots, then grows (`growable=True`) or raises TableFullError.
The (at most two) keys equal to those patterns take no slot, so they never fill a table: len() and
`load_factor` count them, and a small full table's `load_factor` may read above `max_load_factor`.
`max_load_factor` may be 1.0, but a table that full has no EMPTY slot left to end a probe: every
lookup or insert of an absent key then reads every window (O(capacity) each), as in any open-addressing
table; up to load 0.95 a miss reads 1-2 windows on average (the per-window overflow filter).
"""
from __future__ import annotations

import math
import numbers

import torch

from . import _layout as L
from . import _ops
from ._tables import (M_ADD, M_APPEND, M_UPSERT, _OpenTable, _TableState, _device, _eager_only, new_keys_mask,
                      normal_tensors)
from .. import _backend, _native
from ..errors import TableFullError  # noqa: F401  (re-exported for convenience)

__all__ = ["HashMap", "HashSet", "CountingTable", "MultiValueHashMap", "BloomFilter"]


class HashMap(_OpenTable):
    """Key -> value map (one value per key; insert is an upsert)."""

    _op = "HashMap"

    def __init__(self, capacity, key_dtype=torch.int64, value_dtype=torch.int64, device="cpu", *,
                 max_load_factor=0.9, growable=True, window=None, backend="auto"):
        if value_dtype is None:
            raise TypeError("pykernels.HashMap: expected a 'value_dtype', got None (use HashSet for keys only)")
        super().__init__(capacity, key_dtype, value_dtype, device, max_load_factor=max_load_factor,
                         growable=growable, window=window, backend=backend)

    def insert(self, keys, values) -> torch.Tensor:
        """Upserts; returns a bool tensor, True where the key was new. Among duplicates of a new key in
        one call exactly one is True, and one of their values is kept."""
        keys = self._keys("insert", keys)
        values = self._values("insert", values, keys)
        with self._locked(mutating=True):
            status = self._insert_bits(f"{self._op}.insert", L.key_bits(keys), L.value_bits(values), M_UPSERT)
        return L.shaped_like(new_keys_mask(status), keys)

    def find(self, keys, default=0):
        """(values, found): the value of each key, `default` where the key is absent."""
        keys = self._keys("find", keys)
        if torch.compiler.is_compiling() and not (type(default) is int and default == 0):
            return self._find_symbolic_default(keys, default)
        dbits = L.scalar_bits(f"{self._op}.find", default, self.value_dtype)
        with self._locked():
            vals, found = self._find_bits(L.key_bits(keys), True, dbits)
        return L.shaped_like(L.bits_to_values(vals, self.value_dtype), keys), L.shaped_like(found, keys)

    def _find_symbolic_default(self, keys, default):
        """find under torch.compile with a default other than 0: one that is an argument of the compiled
        function is symbolic and its bits cannot be taken while tracing (a data-dependent guard broke
        fullgraph on its second value; review finding), so the lookup runs with 0 and the default is
        filled in where no key was found."""
        floating = self.value_dtype.is_floating_point
        if isinstance(default, torch.SymFloat) and not floating:
            raise TypeError(f"pykernels.{self._op}.find: expected an int 'default' for {self.value_dtype} values, "
                            f"got a float")
        if isinstance(default, torch.SymInt):
            if self.value_dtype in L._INT_RANGE:  # a runtime check in the compiled code, not a wrap
                lo, hi = L._INT_RANGE[self.value_dtype]
                torch._check(default >= lo, lambda: "pykernels.find: 'default' below the value dtype's range")
                torch._check(default <= hi, lambda: "pykernels.find: 'default' above the value dtype's range")
        elif not isinstance(default, torch.SymFloat):
            default = L.check_constant_default(f"{self._op}.find", default, self.value_dtype)
        with self._locked():
            vals, found = self._find_bits(L.key_bits(keys), True, 0)
        values = L.shaped_like(L.bits_to_values(vals, self.value_dtype), keys)
        found = L.shaped_like(found, keys)
        return torch.where(found, values, torch.full_like(values, default)), found

class HashSet(_OpenTable):
    """A set of keys (slots hold keys only: 4- or 8-byte slots, 16 or 8 per cache line)."""

    _op = "HashSet"

    def __init__(self, capacity, key_dtype=torch.int64, device="cpu", *, max_load_factor=0.9, growable=True,
                 window=None, backend="auto"):
        super().__init__(capacity, key_dtype, None, device, max_load_factor=max_load_factor, growable=growable,
                         window=window, backend=backend)

    def insert(self, keys) -> torch.Tensor:
        keys = self._keys("insert", keys)
        with self._locked(mutating=True):
            status = self._insert_bits(f"{self._op}.insert", L.key_bits(keys), None, M_UPSERT)
        return L.shaped_like(new_keys_mask(status), keys)


class CountingTable(_OpenTable):
    """Key -> int64 count; `add` increments atomically (every duplicate counts)."""

    _op = "CountingTable"
    _counting = True

    def __init__(self, capacity, key_dtype=torch.int64, device="cpu", *, max_load_factor=0.9, growable=True,
                 window=None, backend="auto"):
        super().__init__(capacity, key_dtype, torch.int64, device, max_load_factor=max_load_factor,
                         growable=growable, window=window, backend=backend)

    def add(self, keys, counts=None) -> torch.Tensor:
        """Adds 1 (or `counts[i]`, int64, negative allowed) to each key's count; returns True where a key
        was new. Counts add as torch's int64 tensors do: a total past 2**63 - 1 wraps (two's complement)."""
        keys = self._keys("add", keys)
        vbits = None
        if counts is not None:
            counts = L.check_values(f"{self._op}.add", counts, torch.int64, keys, arg="counts")
            vbits = L.value_bits(counts)
        with self._locked(mutating=True):
            status = self._insert_bits(f"{self._op}.add", L.key_bits(keys), vbits, M_ADD)
        return L.shaped_like(new_keys_mask(status), keys)

    insert = add

    def counts(self, keys) -> torch.Tensor:
        """int64 count of each key (0 when absent)."""
        keys = self._keys("counts", keys)
        with self._locked():
            vals, _ = self._find_bits(L.key_bits(keys), True, 0)
        return L.shaped_like(vals, keys)


class MultiValueHashMap(_OpenTable):
    """Key -> every value inserted for it (duplicates live in their own slots, in probe order).
    `find` returns CSR: values of keys[i] are values[offsets[i]:offsets[i+1]]."""

    _op = "MultiValueHashMap"
    _multi = True

    def __init__(self, capacity, key_dtype=torch.int64, value_dtype=torch.int64, device="cpu", *,
                 max_load_factor=0.9, growable=True, window=None, backend="auto"):
        if value_dtype is None:
            raise TypeError("pykernels.MultiValueHashMap: expected a 'value_dtype', got None")
        super().__init__(capacity, key_dtype, value_dtype, device, max_load_factor=max_load_factor,
                         growable=growable, window=window, backend=backend)

    def _special_masks(self, kbits):
        out = []
        if self.device.type == "cpu" and kbits.numel() > 4096:
            # one native read of the keys; the masks only where those patterns occur
            if not self._mod.reserved_count(kbits.data_ptr(), kbits.numel(), self._kb, torch.get_num_threads()):
                return out
        for bits in (L.EMPTY_BITS, L.TOMB_BITS):
            m = kbits == bits
            if bool(m.any()):
                out.append((bits, m))
        return out

    def insert(self, keys, values) -> None:
        """Adds every (key, value) pair (a key inserted k times has k values)."""
        keys = self._keys("insert", keys)
        values = self._values("insert", values, keys)
        kbits, vbits = L.key_bits(keys), L.value_bits(values)
        _eager_only()  # before the reserved keys' data-dependent masks, as every table's insert (audit)
        with self._locked(mutating=True):
            # The reserved patterns live out of band and never need room: store them first, so a full
            # non-growable table (TableFullError from _insert_bits) still keeps them.
            reserved = None
            for bits, m in self._special_masks(kbits):
                reserved = m if reserved is None else reserved | m
                lst = self._special_multi.setdefault(bits, [])
                lst.append(vbits[m].clone())
                # the last two merged while the older is at most twice the newer, so each piece is more
                # than twice the next: at most log2(n) + 1 pieces for lookups to concatenate, whatever the
                # batch sizes (one piece per insert call cost ~700 bytes each and a lookup time growing with
                # the calls: 100K inserts of a -1 padding id, 55 ms a count; audit and review findings)
                while len(lst) > 1 and lst[-2].numel() <= 2 * lst[-1].numel():
                    lst[-2:] = [torch.cat(lst[-2:])]
                self._size += int(m.sum())
            if reserved is not None:  # only the others take slots (sized by every row, 1M -1 paddings grew 27 MB)
                kbits, vbits = kbits[~reserved], vbits[~reserved]
            self._insert_bits(f"{self._op}.insert", kbits, vbits, M_APPEND)

    def _native_counts(self, kbits):
        cfg = self._config("hash_find")
        return _ops.hash_multi_count(self._slots, self._special, kbits, self._nw, self.window, self.seed, self._kb,
                                     self._vb, int(cfg.get("threads", 0) or 0), int(cfg.get("prefetch", 16)))

    def _special_values(self, bits):
        lst = self._special_multi.get(bits, [])
        if not lst:
            return None
        return torch.cat(lst)

    def count(self, keys) -> torch.Tensor:
        """int64 number of values of each key."""
        keys = self._keys("count", keys)
        kbits = L.key_bits(keys)
        with self._locked():
            counts = self._native_counts(kbits)
            # every reserved pattern that has values, by mask: no data-dependent branch, so it also traces
            # under torch.compile(fullgraph=True)
            for bits in (L.EMPTY_BITS, L.TOMB_BITS):
                sv = self._special_values(bits)
                if sv is not None:
                    counts = torch.where(kbits == bits, sv.numel(), counts)
        return L.shaped_like(counts, keys)

    def contains(self, keys) -> torch.Tensor:
        return self.count(keys) > 0

    def find(self, keys):
        """(offsets int64 [n + 1], values): CSR over the flattened keys."""
        keys = self._keys("find", keys)
        kbits = L.key_bits(keys)
        vdt = L._BITS[self._vb]
        with self._locked():
            # the reserved patterns' values (out of band) as tensors, empty when none: the op's inputs
            reserved = []
            for bits in (L.EMPTY_BITS, L.TOMB_BITS):
                sv = self._special_values(bits)
                reserved.append(sv if sv is not None else torch.empty(0, dtype=vdt, device=self.device))
            cfg = self._config("hash_find")
            offsets, vals = _ops.hash_multi_find(self._slots, self._special, kbits, *reserved, self._nw, self.window,
                                                 self.seed, self._kb, self._vb, int(cfg.get("threads", 0) or 0),
                                                 int(cfg.get("prefetch", 16)))
        return offsets, L.bits_to_values(vals, self.value_dtype)

    def erase(self, keys) -> torch.Tensor:
        """Removes every value of each key; int64 number of values removed per key position."""
        keys = self._keys("erase", keys)
        kbits = L.key_bits(keys)
        with self._locked(mutating=True):
            out = self._erase_bits(kbits)
            for bits, m in self._special_masks(kbits):
                sv = self._special_values(bits)
                if sv is not None:
                    first = int(torch.nonzero(m)[0])
                    out[first] = sv.numel()
                    self._size -= sv.numel()
                    del self._special_multi[bits]
        return L.shaped_like(out, keys)


class BloomFilter(_TableState):
    """Blocked Bloom filter (Putze, Sanders, Singler 2007): the `num_hashes` bits of a key all lie in one
    512-bit block (a cache line), so add/contains cost one memory access per key. No false negatives;
    false positives at about `false_positive_rate(n)` after n distinct keys.

    Keys: int32, int64, uint32 or uint64; a key is its integer value (int32 5 and int64 5 are the same key),
    except that a uint64 key of 2^63 or more is the same key as the int64 of its bits (2^64 - 1 and -1).
    """

    BLOCK_BITS = 512
    _locked = _OpenTable._locked  # the lock, skipped while torch.compile traces

    def __init__(self, num_bits, num_hashes, device="cpu", *, seed=L.DEFAULT_SEED, backend="auto"):
        op = "BloomFilter"
        for name, v in (("num_bits", num_bits), ("num_hashes", num_hashes)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):  # numpy ints too
                raise TypeError(f"pykernels.{op}: expected an int for '{name}', got {type(v).__name__}")
        num_bits, num_hashes = int(num_bits), int(num_hashes)
        if num_bits < 1:
            raise ValueError(f"pykernels.{op}: expected 'num_bits' >= 1, got {num_bits}")
        if not 1 <= num_hashes <= 64:
            raise ValueError(f"pykernels.{op}: expected 'num_hashes' in 1..64, got {num_hashes}")
        self.device = _device(op, device)
        self.backend = _backend.select_backend(op, self.device, backend, supported=("cpu", "cuda"),
                                               preference=("cuda",))
        self._mod = _native.cpu_module("hash") if self.backend == "cpu" else _native.cuda_module("hash")
        self.num_blocks = -(-num_bits // self.BLOCK_BITS)
        if self.num_blocks >= 1 << 32:
            raise ValueError(f"pykernels.{op}: 'num_bits' {num_bits} is too large")
        self.num_hashes = num_hashes
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"pykernels.{op}: expected an int for 'seed', got {type(seed).__name__}")
        self.seed = int(seed) & L.M64
        try:
            with normal_tensors():  # updated in place by add and clear, in or out of inference mode
                self._words = _native.zeros(self.num_blocks * 8, torch.int64, self.device)
        except (RuntimeError, MemoryError) as exc:  # torch's bare allocator message names no op (review)
            raise type(exc)(f"pykernels.{op}: cannot allocate {self.num_blocks * 64} bytes for {num_bits} bits on "
                            f"{self.device}: {str(exc)[:200]}") from exc
        import threading

        from ._tables import _track_lock_across_fork

        self._lock = threading.RLock()
        _track_lock_across_fork(self)

    @property
    def num_bits(self) -> int:
        return self.num_blocks * self.BLOCK_BITS

    def _keys(self, op, keys):
        keys = _native.as_tensor(keys, f"BloomFilter.{op}", "keys")
        if keys.dtype not in L.KEY_DTYPES:
            raise TypeError(f"pykernels.BloomFilter.{op}: expected 'keys' of dtype int32, int64, uint32 or "
                            f"uint64, got {L.dtype_name(keys.dtype)}")
        if not L.same_device(keys.device, self.device):
            raise RuntimeError(f"pykernels.BloomFilter.{op}: expected 'keys' on {self.device}, got {keys.device}")
        flat = keys.reshape(-1)
        if keys.dtype == torch.uint64:
            bits = flat.contiguous().view(torch.int64)
        elif keys.dtype == torch.int64:
            bits = flat.contiguous()
        elif keys.dtype == torch.uint32:
            bits = flat.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        else:
            bits = flat.to(torch.int64)
        return keys, bits

    def _seed64(self) -> int:
        """The seed as the signed int64 the op schemas take (the native code reads its 64 bits)."""
        return self.seed - (1 << 64) if self.seed >= (1 << 63) else self.seed

    def add(self, keys) -> None:
        keys, bits = self._keys("add", keys)
        with self._locked():
            _ops.bloom_add_(self._words, bits, self.num_blocks, self.num_hashes, self._seed64())

    def contains(self, keys) -> torch.Tensor:
        keys, bits = self._keys("contains", keys)
        with self._locked():
            out = _ops.bloom_contains(self._words, bits, self.num_blocks, self.num_hashes, self._seed64())
        return L.shaped_like(out, keys)

    def clear(self) -> None:
        with self._locked():
            _native.zero_(self._words)

    def false_positive_rate(self, n: int) -> float:
        """Expected FPR after n distinct keys for this blocked layout (Putze et al. 2007, eq. 3):
        the number of keys in a block is Poisson(n * B / m); within a block, the classic formula."""
        op = "BloomFilter.false_positive_rate"
        if isinstance(n, bool) or not isinstance(n, numbers.Real):
            raise TypeError(f"pykernels.{op}: expected a number of keys for 'n', got {type(n).__name__}")
        if isinstance(n, numbers.Integral):  # any Python int: past float's range the rate is 1
            if n < 0:
                raise ValueError(f"pykernels.{op}: expected a finite 'n' >= 0, got {n}")
            n = float(n) if n < 10 ** 300 else math.inf
        elif not (math.isfinite(n) and n >= 0):
            raise ValueError(f"pykernels.{op}: expected a finite 'n' >= 0, got {n}")
        return blocked_bloom_fpr(self.num_bits, n, self.num_hashes, self.BLOCK_BITS)

    def __repr__(self):
        return (f"pykernels.BloomFilter(num_bits={self.num_bits}, num_hashes={self.num_hashes}, "
                f"device={self.device})")


BLOOM_FPR_POINTS = 4096  # Poisson terms evaluated at most (a stride over the window beyond that)


def blocked_bloom_fpr(m: int, n: int, k: int, block_bits: int = 512) -> float:
    """sum_i Poisson(i; lam = n B / m) * (1 - (1 - 1/B)^(i k))^k over the keys i in a block: the terms
    within 12 standard deviations of the mean (the rest weigh < 1e-30), each Poisson weight from its
    logarithm (exp(-lam) alone underflows past lam ~ 745: a saturated filter came out as 0; audit
    finding), at most BLOOM_FPR_POINTS of them (a stride, the weights renormalized, where the window is
    wider: the summand is smooth there), so the cost does not grow with n."""
    lam = n * block_bits / m
    if lam == 0:
        return 0.0
    keep = 1.0 - 1.0 / block_bits
    if not math.isfinite(lam):
        return 1.0
    half = 12.0 * math.sqrt(lam) + 30
    if keep ** (max(0.0, lam - half) * k) == 0.0:
        # every block in the window holds so many keys that all its bits are set (in double precision):
        # the rate is exactly 1, and the log weights below would lose all precision (i log lam ~ 1e19
        # at n = 1e18: review finding)
        return 1.0
    lo, hi = max(0, math.floor(lam - half)), math.ceil(lam + half)
    step = max(1, -(-(hi - lo + 1) // BLOOM_FPR_POINTS))
    total = weight = 0.0
    log_lam = math.log(lam)
    for i in range(lo, hi + 1, step):
        p = math.exp(i * log_lam - lam - math.lgamma(i + 1))
        total += p * (1.0 - keep ** (i * k)) ** k
        weight += p
    return total / weight if step > 1 else total


def classic_bloom_fpr(m: int, n: int, k: int) -> float:
    return (1.0 - math.exp(-k * n / m)) ** k


from . import _tune  # noqa: E402,F401  (registers the autotuner's Tunables)

# torch.load(weights_only=True), its default, loads saved tables: their state is tensors, numbers, dtypes,
# devices and dicts (_TableState), which it allows; the classes themselves must be allowed by name
torch.serialization.add_safe_globals([HashMap, HashSet, CountingTable, MultiValueHashMap, BloomFilter])
