"""The host-side table objects: argument checks, growth, the out-of-band store of reserved keys for
multi-value maps, and the calls into the native CPU (csrc/hash/hash_cpu.cpp) or CUDA/HIP
(csrc/hash/hash.cu) module. Both modules implement the same functions on the same layout
(csrc/hash/hash_layout.h), so everything here is device-independent.

Thread safety: every public method holds the table's lock, so several Python threads may share a
table (the native bulk operations release the GIL and are themselves multi-threaded with CAS).
"""
from __future__ import annotations

import contextlib
import math
import numbers
import os
import threading
import weakref

import torch

from .. import _backend, _memory, _native, autotune
from ..errors import TableFullError
from . import _layout as L
from . import _ops

# insert status codes (hash_cpu.cpp)
ST_EXISTED, ST_NEW, ST_PENDING, ST_SKIPPED = 0, 1, 2, 3
# insert modes
M_UPSERT, M_ADD, M_APPEND = 0, 1, 2


def new_keys_mask(status: torch.Tensor) -> torch.Tensor:
    """An upsert's or add's result, True where the key was new, from the status _insert_bits returns:
    every byte is then ST_EXISTED (0) or ST_NEW (1) (left-out keys were inserted after growth or
    raised TableFullError; only append mode skips), so the bytes are the bools themselves. A view, not
    a compare: 2 ms of a 50 ms insert of 4M keys."""
    return status.view(torch.bool)

_SUPPORTED = ("cpu", "cuda")
_TUNED_OPS = ("hash_find", "hash_insert")  # the autotuned ops of a table (_tune.py)

# Inserts, erases and items() keep the table's size and its growth in Python, decided by what the kernels
# return: dynamo cannot trace that (a data-dependent branch). They graph-break at once, saying why: without
# fullgraph the call runs eagerly, and with fullgraph=True the error names the reason instead of a
# GuardOnDataDependentSymNode from deep inside the growth loop (review finding). A check, not
# torch.compiler.disable: that would import torch._dynamo (~1.2 s) with pykernels.
_EAGER_ONLY_REASON = ("pykernels hash tables: insert, add, erase and items() keep the table's size and growth in "
                      "Python and do not trace under torch.compile(fullgraph=True); call them outside the compiled "
                      "function (lookups -- find, contains, counts -- do trace)")


def normal_tensors():
    """The context a table's state (slots, `special`, a Bloom filter's words) is made in: never inference
    tensors. A table built under torch.inference_mode() is updated in place afterwards, outside it too
    (clear, inserts through the registered ops), which torch refuses for inference tensors; its refusal
    came after clear() had wiped the slots, leaving a table whose length said 4 and whose items() failed
    (audit finding). Tensors made here are ordinary ones in or out of inference mode. Outside inference mode
    no context is needed: entering and leaving inference_mode(False) cost ~2 us, twice in a constructor."""
    if not torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    return torch.inference_mode(False)


def _eager_only():
    if torch.compiler.is_compiling():
        from torch._dynamo import graph_break  # (imported only while dynamo runs)

        graph_break(msg=_EAGER_ONLY_REASON)
_GPU_WINDOWS = (1, 2, 4, 8, 16, 32)  # group sizes hash.cu is instantiated for
_SHARED_CONFIGS = {}  # (device, backend, slot bytes, table-size bucket, autotune state) -> {op: config}
_HUGE_MIN_BYTES = 8 << 20


def _device(op, device) -> torch.device:
    """The table's device in one canonical spelling: "cuda" gets the current device's index (the one
    torch would allocate on), and "cpu:0" is "cpu" (tensors report their CPU device without an index)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise RuntimeError(f"pykernels.{op}: expected a torch device for 'device', got {device!r} ({exc})") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device  # no GPU: backend selection raises the error naming the op



def default_window(slot_bytes: int, device: torch.device) -> int:
    """Slots per window. CPU: one 64-byte cache line. GPU: the probing-group size (autotuned,
    WarpCore's default 8 lanes; cuCollections uses 4) -- one slot per lane."""
    if device.type == "cuda":
        cfg = autotune.config_for("hash_table", "cuda", {"slot_bytes": slot_bytes}, device)
        return int(cfg.get("window", 8))
    return max(1, 64 // slot_bytes)


class _ForkedInUse:
    """The lock of a table that another thread was using when this process forked: the child has no such
    thread, so the inherited lock stayed locked and the child's first call on the table hung forever
    (audit finding: DataLoader / multiprocessing "fork" workers while a parent thread inserts). The table
    may be half-updated in the child, so its methods raise instead of answering from it."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        raise RuntimeError(f"pykernels.{self.what}: this process was forked while another thread was using this "
                           f"table, so here it may be half-updated; build it again in this process (or fork "
                           f"before other threads use it)")

    def __exit__(self, *exc):
        return False


class _Recount:
    """A table's lock that recounts the table when a KeyboardInterrupt (or another BaseException that is
    not an Exception: a signal's) leaves the call. Python raises it at the first bytecode after a native
    kernel returns, which may be before the call's bookkeeping of what the kernel did: Ctrl-C during an
    insert of 3M keys left len() 0 with every key findable, and later inserts checked against a table
    they thought empty (review finding)."""

    __slots__ = ("table", "lock")

    def __init__(self, table, lock):
        self.table, self.lock = table, lock

    def __enter__(self):
        self.lock.__enter__()
        return self

    def __exit__(self, kind, exc, tb):
        try:
            if kind is not None and not issubclass(kind, Exception):
                for _ in range(100):  # a second Ctrl-C inside the recount: counted again
                    try:
                        self.table._recount()
                        break
                    except KeyboardInterrupt:
                        continue
        finally:
            self.lock.__exit__(kind, exc, tb)
        return False


class _LockWithDeviceCounters:
    """A table's lock that also brings the counters of its numba device views in step with the host call
    it guards (pykernels.hashing.device._SharedCounters)."""

    __slots__ = ("table", "lock", "shared")

    def __init__(self, table, lock, shared):
        self.table, self.lock, self.shared = table, lock, shared

    def __enter__(self):
        self.lock.acquire()
        try:
            self.shared.host_call_begins(self.table)
        except BaseException:
            self.lock.release()
            raise
        return self

    def __exit__(self, *exc):
        try:
            self.shared.host_call_ends(self.table)
        finally:
            self.lock.release()
        return False


_FORK_TRACKED = weakref.WeakSet()  # the tables and Bloom filters whose lock a forked child must replace


def _track_lock_across_fork(obj) -> None:
    """obj._lock (an RLock) is replaced in a forked child: a fresh one when no thread held it at the fork,
    else _ForkedInUse."""
    _FORK_TRACKED.add(obj)


def _relock_after_fork() -> None:
    for obj in list(_FORK_TRACKED):
        lock = obj._lock
        free = not isinstance(lock, _ForkedInUse) and lock.acquire(blocking=False)
        if free:
            lock.release()
        obj._lock = threading.RLock() if free else _ForkedInUse(type(obj).__name__)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_relock_after_fork)


class _TableState:
    """Copies and pickling of a table or Bloom filter (review finding: none could be pickled, torch.saved,
    deep-copied or passed to a spawned process -- "cannot pickle 'module' object" -- and copy.copy shared
    the slots but not the size bookkeeping, so inserting into or clearing the copy corrupted the original).

    The state is the attributes but the native module, the lock and the config memo. A copy (copy.copy
    too) and a loaded table are independent: the loader clones the tensors it is given. The pickler is
    handed the live tensors, not clones: a spawned process receives them through shared memory, which a
    temporary clone would have closed before the child opened it. So pickle a table no other thread is
    inserting into. Loaded with tensors on another device (torch.load's map_location), the table lives
    there: the layout is the same on every backend."""

    _TRANSIENT = ("_mod", "_lock", "_config_cache", "_device_counters")

    def __getstate__(self):
        with self._locked():
            return {k: v for k, v in self.__dict__.items() if k not in self._TRANSIENT}

    def __setstate__(self, state):
        state = dict(state)
        with normal_tensors():  # (loaded under inference_mode: still a table that clear() can update)
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    state[k] = v.clone()  # its own memory (not a parent's shared segment, not a huge-page view)
                elif k == "_special_multi":  # multi-value maps: the values of the reserved key patterns
                    state[k] = {bits: [t.clone() for t in lst] for bits, lst in v.items()}
        self.__dict__.update(state)
        storage = state.get("_slots", state.get("_words"))
        if storage is not None and storage.device != self.device:
            self.device = storage.device
            self.backend = _backend.select_backend(type(self).__name__, self.device, "auto",
                                                   supported=("cpu", "cuda"), preference=("cuda",))
        self._mod = _native.cpu_module("hash") if self.backend == "cpu" else _native.cuda_module("hash")
        self._lock = threading.RLock()
        _track_lock_across_fork(self)
        if "_nw" in state:  # open tables: configs are looked up again in this process
            self._config_cache = {}

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(self.__getstate__())
        return new

    def __copy__(self):
        return self.__deepcopy__({})


class _OpenTable(_TableState):
    """Open addressing over nw (prime) windows of W slots; see csrc/hash/hash_layout.h."""

    _op = "HashMap"
    _multi = False      # duplicates kept (multi-value map)
    _counting = False   # values are counts (erase zeroes them)

    def __init__(self, capacity, key_dtype, value_dtype, device, *, max_load_factor=0.9, growable=True,
                 window=None, seed=L.DEFAULT_SEED, backend="auto"):
        op = self._op
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral):  # numpy ints too
            raise TypeError(f"pykernels.{op}: expected an int for 'capacity', got {type(capacity).__name__}")
        capacity = int(capacity)
        if capacity < 1:
            raise ValueError(f"pykernels.{op}: expected 'capacity' >= 1, got {capacity}")
        key_dtype = L.as_dtype(op, "key_dtype", key_dtype)
        if key_dtype not in L.KEY_DTYPES:
            raise TypeError(f"pykernels.{op}: expected 'key_dtype' int32, int64, uint32 or uint64, got "
                            f"{L.dtype_name(key_dtype)}")
        if value_dtype is not None:
            value_dtype = L.as_dtype(op, "value_dtype", value_dtype)
            if value_dtype not in L.VALUE_DTYPES:
                raise TypeError(f"pykernels.{op}: expected 'value_dtype' of 1 to 8 bytes (bool, (u)int8..64, "
                                f"float8/16/32/64, bfloat16, complex32/64), got {L.dtype_name(value_dtype)}")
        # any real number (numpy floats too: np.float32(0.5) was refused as "not in (0, 1]"), never a bool
        if isinstance(max_load_factor, bool) or not isinstance(max_load_factor, numbers.Real):
            raise TypeError(f"pykernels.{op}: expected a number for 'max_load_factor', got "
                            f"{type(max_load_factor).__name__}")
        max_load_factor = float(max_load_factor)
        if not 0.0 < max_load_factor <= 1.0:
            raise ValueError(f"pykernels.{op}: expected 'max_load_factor' in (0, 1], got {max_load_factor!r}")
        self.device = _device(op, device)
        self.backend = _backend.select_backend(op, self.device, backend, supported=_SUPPORTED, preference=("cuda",))
        self._mod = _native.cpu_module("hash") if self.backend == "cpu" else _native.cuda_module("hash")
        self.key_dtype = key_dtype
        self.value_dtype = value_dtype
        self.max_load_factor = float(max_load_factor)
        if not isinstance(growable, bool):  # "no" and None were taken as True and False (audit finding)
            raise TypeError(f"pykernels.{op}: expected a bool for 'growable', got {_native.type_name(growable)}")
        self.growable = growable
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):  # numpy ints too
            raise TypeError(f"pykernels.{op}: expected an int for 'seed', got {type(seed).__name__}")
        self.seed = int(seed) & ((1 << 63) - 1)  # an int64 in the op schemas
        self._kb = L.key_bytes(key_dtype)
        self._vb = self._slot_value_bytes()
        self._sb = L.slot_bytes(self._kb, self._vb)
        if window is not None and (isinstance(window, bool) or not isinstance(window, numbers.Integral)):
            raise TypeError(f"pykernels.{op}: expected an int for 'window', got {type(window).__name__}")  # 2.5 became 2
        self.window = int(window) if window is not None else default_window(self._sb, self.device)
        if not 1 <= self.window <= 32:
            raise ValueError(f"pykernels.{op}: expected 'window' in 1..32, got {self.window}")
        if self.device.type == "cuda" and self.window not in _GPU_WINDOWS:
            raise ValueError(f"pykernels.{op}: expected 'window' (the probing-group size) in {_GPU_WINDOWS} on "
                             f"the GPU, got {self.window}")
        self._lock = threading.RLock()
        _track_lock_across_fork(self)
        self._config_cache = {}  # op -> (_tune_state() when computed, config)
        self._alloc(capacity)
        self._initial_configs()

    def _locked(self, mutating: bool = False):
        """The table's lock; none while torch.compile traces a method (dynamo cannot trace an RLock, and
        the traced kernels are the functional torch.ops.pykernels ops, whose ordering the graph keeps).
        Once numba device views of the table were taken, the lock also keeps their counters in step with
        the host call (pykernels.hashing.device._SharedCounters). `mutating`: a KeyboardInterrupt
        (any signal's exception) inside recounts the table (see _Recount)."""
        if torch.compiler.is_compiling():
            return contextlib.nullcontext()
        shared = self.__dict__.get("_device_counters")
        lock = _LockWithDeviceCounters(self, self._lock, shared) if shared is not None else self._lock
        return _Recount(self, lock) if mutating else lock

    def _recount(self):
        """The key and slot counts again from the slots' keys (one read; nothing rebuilt or allocated
        beyond the masks): used = not EMPTY, live = neither EMPTY nor TOMBSTONE, plus the out-of-band keys."""
        words = self._slots.view(-1, self._sb // 4)
        lo = words[:, 0]
        if self._kb == 8:  # (little-endian: the low word first; the high word of both patterns is all ones)
            high_ones = words[:, 1] == -1
            empty, tomb = (lo == L.EMPTY_BITS) & high_ones, (lo == L.TOMB_BITS) & high_ones
        else:
            empty, tomb = lo == L.EMPTY_BITS, lo == L.TOMB_BITS
        used = int(empty.numel() - empty.sum())
        self._used = used
        self._size = used - int(tomb.sum()) + self._n_special()

    # -- storage ---------------------------------------------------------------------------------
    def _slot_value_bytes(self):
        return L.value_slot_bytes(self.value_dtype)

    def _new_slots(self, nw):
        """Uninitialized slot storage. Large CPU tables are aligned to 2 MiB and advised to use huge
        pages before the first touch: random probes then rarely miss the TLB. Their memory comes from
        the output cache (pykernels/_memory.py): a dropped table's slots, once nothing refers to them,
        serve the next table of the same size without the page faults and the kernel's zeroing of
        every page (~11% of building a 4M-key table at load 0.9; the slots are initialized anyway)."""
        words = nw * self.window * self._sb // 4
        try:
            with normal_tensors():
                if self.device.type != "cpu" or words * 4 < _HUGE_MIN_BYTES:
                    return torch.empty(words, dtype=torch.int32, device=self.device)
                return _memory.huge_aligned_output(words * 4).view(torch.int32)
        except (RuntimeError, MemoryError) as exc:  # torch's bare allocator message names no op (review)
            raise type(exc)(f"pykernels.{self._op}: cannot allocate {words * 4} bytes for {nw * self.window} slots "
                            f"on {self.device} (capacity / max_load_factor too large?): {str(exc)[:200]}") from exc

    def _alloc(self, capacity):
        self._nw = L.windows_for(capacity, self.window, self._op)
        self._slots = self._new_slots(self._nw)
        self._special = self._new_special(self._nw)
        self._init_slots(self._slots)
        self._size = 0   # live keys (multi: live pairs), the out-of-band ones included
        self._used = 0   # slots that are not EMPTY (live + tombstones)
        self._special_multi = {}  # multi-value maps: reserved key bits -> list of value-bit tensors

    def _new_special(self, nw):
        """Zeroed `special`: 4 words for the reserved key patterns (flags and values), then the overflow
        filter, one byte per window (csrc/hash/hash_layout.h)."""
        with normal_tensors():
            return _native.zeros(L.special_words(nw), torch.int64, self.device)

    def _init_slots(self, slots):
        """Keys EMPTY (all ones), values zero: counting tables add into a fresh slot's value."""
        if self.device.type == "cpu":
            self._mod.init_slots(slots.data_ptr(), slots.numel() * 4 // self._sb, self._kb, self._vb,
                                 torch.get_num_threads())
            return
        self._init_slots_torch(slots)

    def _init_slots_torch(self, slots):
        """The same initialization with torch ops (GPU tables)."""
        rows = slots.view(-1, self._sb // 4)
        rows.zero_()
        rows[:, : self._kb // 4].fill_(-1)

    @property
    def capacity(self) -> int:
        """Number of slots (a prime number of windows of `window` slots)."""
        return self._nw * self.window

    @property
    def load_factor(self) -> float:
        """len(self) / capacity: the keys stored out of band (equal to the EMPTY/TOMBSTONE patterns) count
        here but take no slot, so a small full table may read above max_load_factor."""
        return len(self) / self.capacity

    def __len__(self):
        if "_device_counters" in self.__dict__:  # numba kernels may have inserted: count them in first
            with self._locked():
                pass
        return self._size

    def _limit(self):
        return int(math.floor(self.max_load_factor * self.capacity))

    def __repr__(self):
        vd = f", value_dtype={L.dtype_name(self.value_dtype)}" if self.value_dtype is not None else ""
        return (f"pykernels.{self._op}(len={len(self)}, capacity={self.capacity}, key_dtype="
                f"{L.dtype_name(self.key_dtype)}{vd}, device={self.device}, window={self.window})")

    # -- native calls ----------------------------------------------------------------------------
    def _tune_state(self):
        """What a cached config depends on besides the op: the table's size (its key) and the autotune
        cache (its generation moves on every tune() store, also of an existing key, and every
        clear_memory_cache(); PYKERNELS_AUTOTUNE=0 ignores it)."""
        return self._nw, autotune._enabled(), autotune.generation()

    def _config(self, op):
        """The autotuned (or default) config of `op` for this table. Cached on the table: the lookup
        (a JSON key, the cache's lock) cost ~20 us, as much as a small find; recomputed after a rehash
        changes the capacity or when the autotune cache changes (see _tune_state)."""
        if torch.compiler.is_compiling():
            # No cache files under dynamo: use what the last eager call (or __init__) computed; the
            # graph's guards on the table's size and this config recompile it when either changes.
            return self._config_cache[op][1]
        state = self._tune_state()
        hit = self._config_cache.get(op)
        if hit is not None and hit[0] == state:
            return hit[1]
        key = {"slot_bytes": self._sb, "table_bytes": autotune.bucket(self.capacity * self._sb)}
        for name in _TUNED_OPS:  # both at once, so a traced call finds either
            _, cfg = _backend.dispatch(name, self.device, self.backend, key, supported=_SUPPORTED,
                                       preference=("cuda",))
            # memoized under the state read BEFORE dispatch: a config stored while dispatch ran then makes
            # the next call look again (under the state after it, this table kept the older config until
            # the next store; review finding). Dispatch's first load of the cache file bumps the state too:
            # one more lookup on the next call.
            self._config_cache[name] = (state, cfg)
        return self._config_cache[op][1]

    def _initial_configs(self):
        """The constructor's configs (computed there so a traced call finds them): shared by the tables of
        one device, layout and size bucket, memoized under the autotune state they were looked up in (what
        _config would memoize). Looking them up for every new table cost ~4 us of a small table's ~30 us
        constructor (2-core Zen 4); a later store or cache reload moves the state, and the next table looks
        them up again."""
        state = self._tune_state()
        memo_key = (self.device, self.backend, self._sb, autotune.bucket(self.capacity * self._sb), state[1:])
        shared = _SHARED_CONFIGS.get(memo_key)
        if shared is not None:
            for name in _TUNED_OPS:
                self._config_cache[name] = (state, shared[name])
            return
        self._config("hash_find")
        if all(self._config_cache[name][0] == state for name in _TUNED_OPS):  # (as this table memoized them)
            if len(_SHARED_CONFIGS) > 256:  # stale generations are never asked for again
                _SHARED_CONFIGS.clear()
            _SHARED_CONFIGS[memo_key] = {name: self._config_cache[name][1] for name in _TUNED_OPS}

    def _threads(self, cfg):
        t = int(cfg.get("threads", 0) or 0)
        return t if t > 0 else torch.get_num_threads()

    def _mutating_threads(self, threads: int) -> int:
        """Threads for an insert, erase or rehash: they race (CAS), so which of a key's duplicates is kept
        (or reported erased) and the order of a multi-value key's values and of items() follow the timing. Under
        torch.use_deterministic_algorithms(True) the CPU runs them on one thread (audit finding: identical
        runs gave different results); a GPU raises torch's alert, as torch's own nondeterministic CUDA ops
        do (an error, or a warning with warn_only=True)."""
        if torch.are_deterministic_algorithms_enabled():
            if self.device.type == "cpu":
                return 1
            torch._C._alert_not_deterministic(f"pykernels.{self._op} inserts on a GPU")
        return threads

    def _geo(self):
        return (self._slots.data_ptr(), self._special.data_ptr(), self._nw, self.window, self.seed, self._kb, self._vb)

    def _cpu_direct(self, kbits, vbits=None):
        """Whether a call may go straight to the native CPU module with the table's own arrays: a CPU
        table in plain eager code (eager_direct's conditions: nothing traced or transformed, plain tensors,
        no values needing autograd). The checks of the raw ops (_ops: devices, layouts, sizes) then hold by
        construction: the slots and `special` are the table's, and check_keys / check_values, key_bits and
        value_bits gave contiguous 1-D bits of the table's key and value widths on its device. Through
        _ops a 10-key find() took 12.4 us, add() 14.8; directly 8.8 and 11.2 (2-core Zen 4)."""
        if not (self.backend == "cpu" and type(kbits) is torch.Tensor) or _backend._traced_or_transformed():
            return False
        return vbits is None or (type(vbits) is torch.Tensor
                                 and not (vbits.requires_grad and torch.is_grad_enabled()))

    def _native_insert(self, kbits, vbits, mode, cfg):
        """One bulk insert (_ops.hash_insert_: the kernel directly in eager code, else the registered op):
        (status, (new, new_empty, pending))."""
        if self._cpu_direct(kbits, vbits):
            n = kbits.numel()
            status = _ops.out_buffer(n, torch.uint8, self.device)
            if not n:
                return status, (0, 0, 0)
            counts = self._mod.insert(self._slots.data_ptr(), self._special.data_ptr(), self._nw, self.window,
                                      self.seed, self._kb, self._vb, kbits.data_ptr(),
                                      vbits.data_ptr() if vbits is not None else 0, n, status.data_ptr(), mode,
                                      self._used, self._limit(), self._mutating_threads(self._threads(cfg)),
                                      int(cfg.get("prefetch", 32)))
            torch.autograd.graph.increment_version((self._slots, self._special))  # as _ops.hash_insert_ records
            return status, tuple(counts)
        status, counts = _ops.hash_insert_(self._slots, self._special, kbits, vbits, self._nw, self.window, self.seed,
                                           self._kb, self._vb, mode, self._used, self._limit(),
                                           self._mutating_threads(int(cfg.get("threads", 0) or 0)),
                                           int(cfg.get("prefetch", 32)))
        return status, counts if type(counts) is tuple else tuple(int(c) for c in counts.tolist())

    def _insert_bits(self, op, kbits, vbits, mode):
        """Inserts, making room (tombstone purge / growth) for keys left out by a full table.
        Returns the per-key status (uint8)."""
        _eager_only()
        n = kbits.numel()
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        cfg = self._config("hash_insert")
        capacity_before = self.capacity
        grew_ahead = self._grow_ahead(n, kbits)
        status, (new, new_empty, pending) = self._native_insert(kbits, vbits, mode, cfg)
        self._size += new
        self._used += new_empty
        if grew_ahead:
            self._shrink_after_growing_ahead(capacity_before)
        purged = False
        while pending:
            idx = torch.nonzero(status == ST_PENDING).reshape(-1)
            # the slots the left-out keys need: one per occurrence in a multi-value table, else one per
            # distinct key (sizing by occurrences grew a set to 666K slots for 20 keys repeated 2M times)
            left_out = kbits[idx]
            room = pending if self._multi else self._distinct_keys(left_out)
            in_slots = self._size - self._n_special()  # reserved keys' entries live out of band
            fits_after_purge = in_slots + room <= self._limit()
            tombstones = self._used > in_slots
            # Reclaim tombstones (same size) when that makes room for every pending key; a table that
            # cannot grow reclaims them in any case, inserts what then fits and reports only the rest.
            if tombstones and not purged and (fits_after_purge or not self.growable):
                self._rehash(self.capacity)
                purged = True
            elif self.growable:
                self._rehash(max(2 * self.capacity, self._grown_capacity(in_slots + room)))
            else:
                # distinct keys (entries of a multi-value table), not occurrences (review finding: 50 keys
                # given 3 times each were reported as 150 not inserted)
                raise TableFullError(op, room if self._multi else self._distinct_keys(left_out, exact=True),
                                     self.capacity, self.max_load_factor)
            sub_v = vbits[idx] if vbits is not None else None
            sub_status, (new, new_empty, pending2) = self._native_insert(left_out, sub_v, mode, cfg)
            self._size += new
            self._used += new_empty
            status[idx] = sub_status
            pending = pending2  # after a purge, the next round grows or raises: no endless loop
        return status

    def _distinct_keys(self, kbits, exact=False):
        """How many distinct keys kbits holds: counted (a sort) where small or where `exact`, else (CPU) the
        HyperLogLog estimate plus 5% (its error is ~1.6%; an undercount only means one more growth). Sizing
        a growth after an insert by torch.unique of the 2.2M keys it left out took 104 ms, as long as the
        insert."""
        n = kbits.numel()
        if exact or n <= self.EXACT_NEW_KEYS or self.device.type != "cpu":
            return int(torch.unique(kbits).numel())
        return min(n, int(self._distinct_estimate(kbits) * 1.05) + 1)

    def _distinct_estimate(self, kbits):
        """The HyperLogLog count of kbits' distinct keys (CPU, contiguous; ~1.6% error, one read)."""
        return self._mod.distinct_estimate(kbits.data_ptr(), kbits.numel(), self._kb,
                                           self._threads(self._config("hash_insert")))

    # A table grows to hold its entries at 2/3 of max_load_factor (what doubling gives on average, as
    # power-of-two tables such as hashbrown's): grown to max_load_factor itself (as before), a table filled
    # by one large insert sat at load 0.9, where lookups are ~1.4x slower than at 0.6 (a multi-value
    # map's walks ~2x longer), and its next insert of any size rehashed it again.
    GROWTH_LOAD = 2 / 3

    def _grown_capacity(self, entries):
        """The capacity a table grows to for `entries` entries (or shrinks to after growing ahead)."""
        return math.ceil(entries / (self.max_load_factor * self.GROWTH_LOAD)) + 1

    def _grow_ahead(self, n, kbits=None):
        """A growable table without room for a bulk insert (on the GPU: room for a quarter of it) grows once,
        before it, to hold every key (pandas' factorize sizes its table by the input the same way). Inserting into the
        small table instead fills it, refuses every other key, counts the refused keys' distinct values
        with a sort and inserts them again after growing: 4M distinct int64 keys into HashMap(1024) took
        ~440 ms that way, ~90 ms this way (into a table sized beforehand: ~60 ms). Keys that may repeat are
        counted first (distinct_estimate, HyperLogLog): a table with room for the input's distinct keys does
        not grow, and one without grows for them, not for every key (4M keys, 4096 distinct, into a
        CountingTable sized for 4096: 45 -> 35 ms, no 112 MiB table built and dropped); an input whose sampled
        keys are all in the table already does not grow ahead (_sample_all_present), nor one whose samples
        show a few categories that fit (_few_distinct_fit), both without that count, and a small one into a
        table holding keys is bounded by a lookup (its rows not found) and counted exactly only past the
        room. Returns whether it grew."""
        room = self._limit() - self._used
        # On the CPU an insert that may not fit is sized up front: one larger than the room but within 4x
        # of it filled the table, was refused the rest (each refused key walking on to prove it absent) and
        # grew after: 4M distinct keys into HashMap(2M) 548 ms, into HashMap(1M) (grown ahead) 68 ms. The
        # GPU tables keep the 4x margin (their growth there is sized by occurrences, not distinct keys).
        fits = room if self.device.type == "cpu" else 4 * room
        if not self.growable or n <= max(fits, 0):
            return False
        counted = False  # n counts the input's distinct keys (exactly or by HyperLogLog), not its rows
        if not self._multi and kbits is not None and self.device.type == "cpu":
            counted = True
            if n <= self.EXACT_NEW_KEYS and self._used:
                # A small insert into a table holding keys: one lookup of its rows bounds its new keys (the
                # rows not found), and only when that bound passes the room are the distinct keys among
                # those rows counted (torch.unique of them alone). Counting first (torch.unique of every row,
                # then a lookup of the distinct keys) cost every call on a table at its limit, whether any
                # key was new or not: CountingTable(1024) holding 900 keys, add() of 1000 rows of them 75 ->
                # 48 us, of 1000 new ones 151 -> 109 us, of 4000 new ones 774 -> 217 us (2-core Zen 4). Not
                # left to the insert to refuse and grow after: the refused keys of a table at its limit set
                # overflow bits as they walk, each walk lengthening the next (4000 new keys: 21 ms).
                _, found = self._find_bits(kbits, False)
                absent = n - int(found.sum())
                if absent <= room:
                    return False
                n = int(torch.unique(kbits[~found]).numel())  # (exact: repeated new keys grow it once each)
            else:
                # (also a small insert into an empty table: nothing to look up, and the HyperLogLog's one
                # native read, not torch.unique and a lookup: 1000 distinct keys into a new
                # CountingTable(1024) 120 -> 85 us, 4000 311 -> 135 us)
                # keys the table holds already (a sample of them all present), or a few categories (a
                # sample with no key met once): no growth, and no pass over every key to count them
                if self._size > 0 and self._sample_all_present(kbits):
                    return False
                if self._few_distinct_fit(kbits, room):
                    return False
                # keys may repeat: size by how many distinct ones the input holds (HyperLogLog, ~1.6% error;
                # an underestimate only means one growth after the insert, as without growing ahead), +5%:
                # an estimate just under the room while the keys are not would fill the table, refuse the
                # rest and double it after (review finding); a table grown for n keys has room for 1.5n
                n = min(n, int(self._distinct_estimate(kbits) * 1.05) + 1)
            if n <= room:
                return False
        target = self._grown_capacity(self._size - self._n_special() + n)
        # Every copy is an entry of a multi-value map, and a CPU table counted the input's distinct keys: the
        # target is what the entries need (never below the capacity, which tombstones may fill; with the
        # headroom of GROWTH_LOAD, so the HyperLogLog's ~1.6% undercount still fits), and
        # _shrink_after_growing_ahead would rebuild a doubled table at it again: a second rehash of every
        # entry (2M Zipf rows grown into in 8 inserts, ~40% of the time; 1000 new keys into HashMap(1000):
        # 188 -> 139 us). Tables sized by rows (GPU) may meet repeated keys: at least double.
        self._rehash(max(self.capacity, target) if self._multi or counted else max(2 * self.capacity, target))
        return True

    EXACT_NEW_KEYS = 4096
    PRESENT_SAMPLE = 1024

    def _new_keys(self, distinct_kbits):
        """How many of these distinct keys are not in the table (one lookup)."""
        _, found = self._find_bits(distinct_kbits, False)
        return int(distinct_kbits.numel() - int(found.sum()))

    def _sample_all_present(self, kbits):
        """Whether every key of a sample of PRESENT_SAMPLE rows taken evenly through the input is in the table
        already (one lookup). Then the insert does not grow ahead: counting batch after batch of the keys a
        table holds grew it ahead for all of them and rebuilt it at its size after (two rehashes: 4M adds of
        1M keys present into a CountingTable of 2M slots took 87 ms instead of 25). Otherwise the input's
        distinct keys size the growth as before: the sample is of rows and favours frequent keys, so the
        share of absent keys in it is no estimate of the share of new distinct keys (scaled by it, 200K rare
        new keys among 1.8M rows of 1000 known ones were taken for ~25K: the table filled and grew after,
        10x slower; review finding). New keys too rare to show in the sample make the insert grow after it
        if they do not fit, as without growing ahead."""
        n = kbits.numel()
        m = min(n, self.PRESENT_SAMPLE)
        pick = torch.arange(m, device=kbits.device) * n // m  # integer positions (float32 ones overran 2^24)
        return self._new_keys(torch.unique(kbits[pick])) == 0

    FEW_DISTINCT_SAMPLES = (1024, 16384)

    def _few_distinct_fit(self, kbits, room):
        """Whether the input is a few categories that fit the room, judged from samples (CPU, native
        sample_distinct: one key from each of `count` strides, at a pseudo-random offset in it, so tiled
        keys are not taken for a few categories): 1024 with no key met once, then 16384 with none met once
        either means the keys the samples missed make up under 3/16384 of the rows (the rule of three, at
        95%), so the distinct keys are at most those seen plus 3n/16384. Counting 4M rows of 64 categories
        spent half its time in the HyperLogLog pass this skips. New keys the samples missed that do not fit
        make the insert fill the table and grow after it (each refused key walking the full table first:
        slow, as without growing ahead)."""
        n = kbits.numel()
        for count in self.FEW_DISTINCT_SAMPLES:
            if n < 4 * count:
                return False
            distinct, once = self._mod.sample_distinct(kbits.data_ptr(), n, self._kb, count)
            if once:
                return False
        return distinct + 3 * n // count + 1 <= room

    def _shrink_after_growing_ahead(self, capacity_before):
        """_grow_ahead sized for every key new; keys repeated in the input (or already present) leave the
        table larger than growing on demand would have made it: it is then rebuilt at the size the keys
        need (never below its size before the call), so memory follows the distinct keys. (Rebuilding only
        when 2x too large left tables of keys repeated 1-2x up to 1.9x larger than before: review finding.)
        Up to 10% larger is kept: the distinct-key estimate that sized the growth is within ~5%, and
        rebuilding for that rehashed every entry a second time."""
        need = max(capacity_before, self._grown_capacity(self._size - self._n_special()))
        if 10 * self._nw > 11 * L.windows_for(need, self.window, self._op):
            self._rehash(need)

    def _n_special(self):
        if self._multi:
            return sum(int(v.numel()) for lst in self._special_multi.values() for v in lst)
        return self._n_special_in(self._special[:4].tolist())

    @staticmethod
    def _n_special_in(flags):
        """The reserved keys present, from `special`'s first 4 words as a list (one tolist, ~1.5 us: the
        ne().sum() of a strided view it replaces took ~6 us, a third of a small table's items())."""
        return int(flags[0] != 0) + int(flags[2] != 0)

    def _rehash(self, capacity):
        old_slots, old_nw = self._slots, self._nw
        new_nw = L.windows_for(capacity, self.window, self._op)
        new_slots = self._new_slots(new_nw)
        self._init_slots(new_slots)
        new_special = self._new_special(new_nw)  # the reserved keys carry over; the filter is rebuilt
        new_special[:4] = self._special[:4]
        cfg = self._config("hash_insert")
        moved = self._mod.rehash(old_slots.data_ptr(), old_nw, new_slots.data_ptr(), new_special.data_ptr(), new_nw,
                                 self.window, self.seed, self._kb, self._vb, self._mutating_threads(self._threads(cfg)),
                                 int(cfg.get("prefetch", 32)), *_ops.stream_args(self.device))
        self._slots, self._nw, self._special = new_slots, new_nw, new_special
        self._used = moved
        if old_slots.device.type == "cpu":
            _memory.OUTPUTS.forget(old_slots)  # a size the table has left: freed now, not kept in the cache

    def _find_bits(self, kbits, want_values, default_bits=0):
        cfg = self._config("hash_find") if kbits.numel() else {}
        if self._cpu_direct(kbits):  # (see _cpu_direct: what _ops.hash_find runs, without its checks)
            n = kbits.numel()
            nv = n if (want_values and self._vb) else 0
            found = _ops.out_buffer(n, torch.uint8, self.device)
            vals = _ops.out_buffer(nv, _ops._BITS.get(self._vb, torch.int64), self.device)
            if n:
                self._mod.find(self._slots.data_ptr(), self._special.data_ptr(), self._nw, self.window, self.seed,
                               self._kb, self._vb, kbits.data_ptr(), n, vals.data_ptr() if nv else 0,
                               found.data_ptr(), default_bits & L.M64, self._threads(cfg),
                               int(cfg.get("prefetch", 32)))
            return (vals if want_values and self._vb else None), found.view(torch.bool)
        signed_default = default_bits - (1 << 64) if default_bits >= 1 << 63 else default_bits
        vals, found = _ops.hash_find(self._slots, self._special, kbits, self._nw, self.window, self.seed, self._kb,
                                     self._vb, signed_default, bool(want_values), int(cfg.get("threads", 0) or 0),
                                     int(cfg.get("prefetch", 32)))
        return (vals if want_values and self._vb else None), found

    def _erase_bits(self, kbits):
        _eager_only()
        n = kbits.numel()
        out = _native.zeros(n, torch.int64, self.device)
        if n:
            cfg = self._config("hash_find")
            total = self._mod.erase(*self._geo(), kbits.data_ptr(), n, out.data_ptr(), self._multi, self._counting,
                                    self._mutating_threads(self._threads(cfg)), int(cfg.get("prefetch", 32)),
                                    *_ops.stream_args(self.device))
            self._size -= total
            # Many tombstones: rebuild in place. Inserts reuse tombstones, so a table churned by inserts
            # and erases at a high max_load_factor would otherwise keep no EMPTY slot, every window's
            # overflow-filter bit set, and every miss would walk all windows. A purge every nw*W/8
            # erases costs O(1) per erase, amortized.
            tomb = self._used - (self._size - self._n_special())
            if tomb > 0 and 8 * tomb >= self._nw * self.window:
                self._rehash(self.capacity)
        return out

    def _items_bits(self):
        _eager_only()
        flags = None if self._multi else self._special[:4].tolist()  # (read once: counted and stored below)
        n_slots_live = self._size - (self._n_special() if self._multi else self._n_special_in(flags))
        kb = _ops.out_buffer(max(n_slots_live, 0), L._BITS[self._kb], self.device)
        vb = _ops.out_buffer(max(n_slots_live, 0), L._BITS[self._vb], self.device) if self._vb else None
        if n_slots_live > 0:
            cfg = self._config("hash_find")
            got = self._mod.items(self._slots.data_ptr(), self._nw, self.window, self._kb, self._vb, kb.data_ptr(),
                                  vb.data_ptr() if vb is not None else 0, n_slots_live, self._threads(cfg),
                                  *_ops.stream_args(self.device))
            if got != n_slots_live:
                raise RuntimeError(f"pykernels.{self._op}.items: internal error: {got} live slots, expected "
                                   f"{n_slots_live}")
        # reserved key patterns live out of band
        sk, sv = [], []
        if self._multi:
            for bits, lst in self._special_multi.items():
                for v in lst:
                    sk.append(torch.full((v.numel(),), bits, dtype=kb.dtype, device=self.device))
                    sv.append(v)
        else:
            for s, bits in enumerate((L.EMPTY_BITS, L.TOMB_BITS)):
                if flags[2 * s]:
                    sk.append(torch.tensor([bits], dtype=kb.dtype, device=self.device))
                    if vb is not None:
                        v = flags[2 * s + 1]
                        if self._vb == 4:
                            v = (v & 0xFFFFFFFF) - ((v & 0x80000000) << 1)
                        elif v >= 1 << 63:
                            v -= 1 << 64
                        sv.append(torch.tensor([v], dtype=vb.dtype, device=self.device))
        if sk:
            kb = torch.cat([kb, *sk])
            if vb is not None:
                vb = torch.cat([vb, *sv])
        return kb, vb

    def device_view(self):
        """The table's arrays for numba.cuda device functions (pykernels.hashing.device); use as a
        context manager around the kernel launch so len() takes in what the kernel inserted."""
        from .device import DeviceView

        return DeviceView(self)

    # -- the methods every table shares -------------------------------------------------------
    def contains(self, keys) -> torch.Tensor:
        """bool, True where the key is in the table."""
        keys = self._keys("contains", keys)
        with self._locked():
            _, found = self._find_bits(L.key_bits(keys), False)
        return L.shaped_like(found, keys)

    def erase(self, keys) -> torch.Tensor:
        """Removes keys; True where a key was removed (once per key among duplicates)."""
        keys = self._keys("erase", keys)
        with self._locked(mutating=True):
            out = self._erase_bits(L.key_bits(keys))
        return L.shaped_like(out, keys).bool()

    def items(self):
        """Every entry, in no particular order: the keys (sets), or (keys, values) (maps; a counting
        table's values are its counts, a multi-value map has one pair per value)."""
        with self._locked():
            keys, vb = self._key_values_out()
        if self.value_dtype is None:
            return keys
        return keys, L.bits_to_values(vb, self.value_dtype)

    def clear(self):
        """Removes every key; keeps the capacity."""
        with self._locked(mutating=True):
            self._init_slots(self._slots)
            _native.zero_(self._special)
            self._special_multi = {}
            self._size = 0
            self._used = 0

    # -- helpers for subclasses --------------------------------------------------------------------
    def _keys(self, op, keys):
        return L.check_keys(f"{self._op}.{op}", keys, self.key_dtype, self.device)

    def _values(self, op, values, keys):
        return L.check_values(f"{self._op}.{op}", values, self.value_dtype, keys)

    def _key_values_out(self):
        kb, vb = self._items_bits()
        keys = L.bits_to_keys(kb, self.key_dtype)
        return keys, vb
