"""The table kernels as torch.library ops (namespace `pykernels`), over a table's tensors.

The table classes are Python objects holding state (sizes, growth, a lock), like cuCollections'
containers; their bulk kernels are these functional ops, so code that holds a table's tensors can call
`torch.ops.pykernels.hash_find` / `hash_insert_` inside `torch.compile(fullgraph=True)` (fake
implementations included). The classes call `hash_find` / `hash_insert_` below, which run the same
implementation directly in plain eager code (see `eager_direct`): through the registered op, the first
call of a process imported torch._dynamo (~1.1-1.4 s, every table's first insert or lookup) and every
call paid ~0.3-0.5 ms of dispatch (a 10-key lookup took 0.4 ms).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _memory, _native
from .._backend import eager_direct, fake_on_one_device, on_cpu
from ..errors import check_same_device
from ._layout import slot_bytes

_M64 = (1 << 64) - 1
_BITS = {4: torch.int32, 8: torch.int64}


def _mod(t: torch.Tensor):
    return _native.cpu_module("hash") if t.is_cpu else _native.cuda_module("hash")


def stream_args(device: torch.device) -> tuple:
    """The trailing stream argument of a native CUDA call (torch's current stream on `device`); none on
    the CPU. The one helper every table call into the native modules uses."""
    if on_cpu(device):  # (device.type costs ~0.5 us: the common case first)
        return ()
    return (_native.cuda_stream_handle(device),) if device.type == "cuda" else ()


def _nthreads(threads: int) -> int:
    """`threads` <= 0: torch's intra-op thread count, read when the kernel runs (not baked into a
    compiled graph)."""
    return threads if threads > 0 else torch.get_num_threads()


def out_buffer(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer: large CPU outputs come from the output cache (pykernels/_memory.py: the first
    touch of fresh pages was ~25% of a 4M-key lookup's time)."""
    if not on_cpu(device):
        return torch.empty(n, dtype=dtype, device=device)
    return _memory.empty_output((n,), dtype)


def _check_mode(op: str, mode: int):
    if mode not in (0, 1, 2):
        raise ValueError(f"pykernels.{op}: expected mode 0 (upsert), 1 (add) or 2 (append), got {mode}")


def _check_special(op: str, special: torch.Tensor, nw: int):
    """`special` must hold the reserved-key words and the overflow filter of an `nw`-window table
    (the native code reads and writes that many words)."""
    need = 4 + (nw + 7) // 8
    if special.dtype != torch.int64 or not special.is_contiguous() or special.numel() < need:
        raise ValueError(f"pykernels.{op}: expected 'special' a contiguous int64 tensor of at least {need} words "
                         f"(4 + one overflow-filter byte per window) for nw={nw}, got {special.dtype} of "
                         f"{special.numel()} words")


def _check_table_args(op: str, slots: torch.Tensor, keys: torch.Tensor, values: Optional[torch.Tensor], nw: int,
                      window: int, kb: int, vb: int):
    """The raw ops hand data pointers to native code: the arrays must be what the layout says (contiguous
    key bits of kb bytes, value bits of vb bytes, a slot array of nw * window slots), else they would be
    read (or written) out of bounds."""
    if kb not in (4, 8) or vb not in (0, 1, 2, 4, 8):
        raise ValueError(f"pykernels.{op}: expected key bytes 4 or 8 and value bytes 0/1/2/4/8, got kb={kb}, vb={vb}")
    if nw < 1 or window < 1:
        raise ValueError(f"pykernels.{op}: expected nw >= 1 and window >= 1, got nw={nw}, window={window}")
    need = nw * window * slot_bytes(kb, vb)
    if not slots.is_contiguous() or slots.numel() * slots.element_size() < need:
        raise ValueError(f"pykernels.{op}: expected 'slots' a contiguous tensor of at least {need} bytes for "
                         f"nw={nw}, window={window}, got {slots.numel() * slots.element_size()} bytes")
    # slots are read and CAS'd as whole aligned words (8-byte atomics on the GPU: a misaligned one is a
    # sticky error that ends the CUDA context; audit): a view at an odd offset is refused
    align = min(8, slot_bytes(kb, vb))
    if slots.numel() and slots.data_ptr() % align:
        raise ValueError(f"pykernels.{op}: expected 'slots' aligned to {align} bytes (the slot's words), got an "
                         f"address {slots.data_ptr() % align} bytes past it (a view at an offset?)")
    for name, t, size in (("keys", keys, kb), ("values", values, vb)):
        if t is None or t.numel() == 0:
            continue
        if t.dim() != 1 or not t.is_contiguous() or t.element_size() != size:
            raise ValueError(f"pykernels.{op}: expected '{name}' a contiguous 1-D tensor of {size}-byte elements "
                             f"(the table's layout), got shape {tuple(t.shape)}, strides {t.stride()}, "
                             f"{t.element_size()}-byte {str(t.dtype).replace('torch.', '')}")
    if values is not None and values.numel() != keys.numel():
        raise ValueError(f"pykernels.{op}: expected as many values as keys, got {values.numel()} and {keys.numel()}")


def _find_impl(slots: torch.Tensor, special: torch.Tensor, keys: torch.Tensor, nw: int, window: int, seed: int,
               kb: int, vb: int, default_bits: int, with_values: bool, threads: int,
               prefetch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(value bits [n] (int32/int64; empty for sets or without `with_values`), found [n] bool) of
    key bits `keys` (1-D). `kb`/`vb`: the table's key and value-slot bytes (its layout); `threads` <= 0:
    torch.get_num_threads()."""
    check_same_device("hash_find", slots=slots, special=special, keys=keys)
    n = keys.numel()
    nv = n if (vb and with_values) else 0
    found = out_buffer(n, torch.uint8, keys.device)
    vals = out_buffer(nv, _BITS.get(vb, torch.int64), keys.device)
    if n:
        _check_special("hash_find", special, nw)
        _check_table_args("hash_find", slots, keys, None, nw, window, kb, vb)
        _mod(slots).find(slots.data_ptr(), special.data_ptr(), nw, window, seed & _M64, kb, vb, keys.data_ptr(), n,
                         vals.data_ptr() if nv else 0, found.data_ptr(), default_bits & _M64, _nthreads(threads),
                         prefetch, *stream_args(slots.device))
    return vals, found.view(torch.bool)


@torch.library.custom_op("pykernels::hash_find", mutates_args=())
def _hash_find_op(slots: torch.Tensor, special: torch.Tensor, keys: torch.Tensor, nw: int, window: int, seed: int,
                  kb: int, vb: int, default_bits: int, with_values: bool, threads: int,
                  prefetch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _find_impl(slots, special, keys, nw, window, seed, kb, vb, default_bits, with_values, threads, prefetch)


def hash_find(slots, special, keys, nw, window, seed, kb, vb, default_bits, with_values, threads, prefetch):
    """pykernels::hash_find: directly in eager code, else through the registered op."""
    args = (slots, special, keys, nw, window, seed, kb, vb, default_bits, with_values, threads, prefetch)
    return _find_impl(*args) if eager_direct(slots, special, keys, op="HashMap.find") else _hash_find_op(*args)


@_hash_find_op.register_fake
@fake_on_one_device(_hash_find_op)
def _(slots, special, keys, nw, window, seed, kb, vb, default_bits, with_values, threads, prefetch):
    # checked here too: a meta tensor among real ones dispatches to this fake (it returned garbage)
    check_same_device("hash_find", slots=slots, special=special, keys=keys)
    # vb decides the values' dtype, which cannot be symbolic: under torch.compile a table's value width
    # that changed between calls came in as a SymInt (automatic dynamic) and the dict lookup raised
    # "unhashable type: SymInt" (review finding); int() specializes on it (a guard per width)
    vb = int(vb)
    n = keys.numel()
    nv = n if (vb and with_values) else 0
    return keys.new_empty(nv, dtype=_BITS.get(vb, torch.int64)), keys.new_empty(n, dtype=torch.bool)


def _insert_impl(slots: torch.Tensor, special: torch.Tensor, keys: torch.Tensor, values: Optional[torch.Tensor],
                 nw: int, window: int, seed: int, kb: int, vb: int, mode: int, used: int, limit: int, threads: int,
                 prefetch: int, counts_tuple: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Bulk insert (mode 0 upsert, 1 add, 2 append) in place. Returns (status [n] uint8:
    0 existed, 1 new, 2 left out (table full), 3 skipped; counts int64[3] on the CPU:
    new keys, new keys that took an EMPTY slot, keys left out). counts_tuple: the counts as a tuple of
    ints (eager callers, who read them at once: torch.tensor of three ints costs ~6 us)."""
    check_same_device("hash_insert_", slots=slots, special=special, keys=keys, values=values)
    _check_mode("hash_insert_", mode)
    n = keys.numel()
    status = out_buffer(n, torch.uint8, keys.device)
    counts = (0, 0, 0)
    if n:
        _check_special("hash_insert_", special, nw)
        _check_table_args("hash_insert_", slots, keys, values, nw, window, kb, vb)
        counts = _mod(slots).insert(slots.data_ptr(), special.data_ptr(), nw, window, seed & _M64, kb, vb,
                                    keys.data_ptr(), values.data_ptr() if values is not None else 0, n,
                                    status.data_ptr(), mode, used, limit, _nthreads(threads), prefetch,
                                    *stream_args(slots.device))
    if counts_tuple:
        return status, tuple(counts)
    return status, torch.tensor(list(counts), dtype=torch.int64, device="cpu")


# The mode argument is `insert_mode` in the schema: torch.compile wraps this in-place op in
# auto_functionalize, which passes arguments by keyword next to a `mode` of its own ("got multiple
# values for argument 'mode'" under aot_eager/inductor; review finding).
@torch.library.custom_op("pykernels::hash_insert_", mutates_args=("slots", "special"))
def _hash_insert_op(slots: torch.Tensor, special: torch.Tensor, keys: torch.Tensor, values: Optional[torch.Tensor],
                    nw: int, window: int, seed: int, kb: int, vb: int, insert_mode: int, used: int, limit: int,
                    threads: int, prefetch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _insert_impl(slots, special, keys, values, nw, window, seed, kb, vb, insert_mode, used, limit, threads,
                        prefetch)


def hash_insert_(slots, special, keys, values, nw, window, seed, kb, vb, mode, used, limit, threads, prefetch):
    """pykernels::hash_insert_: directly in eager code (counts: a tuple of 3 ints), else through the
    registered op (counts: an int64 tensor)."""
    args = (slots, special, keys, values, nw, window, seed, kb, vb, mode, used, limit, threads, prefetch)
    if not eager_direct(slots, special, keys, values, op="HashMap.insert"):
        return _hash_insert_op(*args)
    out = _insert_impl(*args, counts_tuple=True)
    torch.autograd.graph.increment_version((slots, special))  # written in place, as the op would record
    return out


@_hash_insert_op.register_fake
@fake_on_one_device(_hash_insert_op)
def _(slots, special, keys, values, nw, window, seed, kb, vb, insert_mode, used, limit, threads, prefetch):
    check_same_device("hash_insert_", slots=slots, special=special, keys=keys, values=values)
    _check_mode("hash_insert_", insert_mode)
    return keys.new_empty(keys.numel(), dtype=torch.uint8), torch.empty(3, dtype=torch.int64, device="cpu")


# ---- multi-value count and the Bloom filter: registered ops too, so those methods trace under
# torch.compile(fullgraph=True) as find does (they called the native module directly: a graph break
# that fullgraph refuses; review finding) ------------------------------------------------------
def _multi_count_impl(slots: torch.Tensor, special: torch.Tensor, keys: torch.Tensor, nw: int, window: int,
                      seed: int, kb: int, vb: int, threads: int, prefetch: int) -> torch.Tensor:
    """int64 number of values of each key bits in a multi-value table (the reserved patterns: 0)."""
    check_same_device("hash_multi_count", slots=slots, special=special, keys=keys)
    n = keys.numel()
    counts = _native.zeros(n, torch.int64, keys.device)
    if n:
        if vb == 0:
            raise ValueError("pykernels.hash_multi_count: multi-value tables need values (vb > 0)")
        _check_special("hash_multi_count", special, nw)
        _check_table_args("hash_multi_count", slots, keys, None, nw, window, kb, vb)
        _mod(slots).multi_walk(slots.data_ptr(), special.data_ptr(), nw, window, seed & _M64, kb, vb, keys.data_ptr(),
                               n, counts.data_ptr(), 0, 0, _nthreads(threads), prefetch, *stream_args(slots.device))
    return counts


@torch.library.custom_op("pykernels::hash_multi_count", mutates_args=())
def _multi_count_op(slots: torch.Tensor, special: torch.Tensor, keys: torch.Tensor, nw: int, window: int, seed: int,
                    kb: int, vb: int, threads: int, prefetch: int) -> torch.Tensor:
    return _multi_count_impl(slots, special, keys, nw, window, seed, kb, vb, threads, prefetch)


@_multi_count_op.register_fake
@fake_on_one_device(_multi_count_op)
def _(slots, special, keys, nw, window, seed, kb, vb, threads, prefetch):
    check_same_device("hash_multi_count", slots=slots, special=special, keys=keys)
    return keys.new_empty(keys.numel(), dtype=torch.int64)


def hash_multi_count(slots, special, keys, nw, window, seed, kb, vb, threads, prefetch):
    """pykernels::hash_multi_count: directly in eager code, else through the registered op."""
    args = (slots, special, keys, nw, window, seed, kb, vb, threads, prefetch)
    return (_multi_count_impl(*args) if eager_direct(slots, special, keys, op="MultiValueHashMap.count")
            else _multi_count_op(*args))


def _multi_find_impl(slots: torch.Tensor, special: torch.Tensor, keys: torch.Tensor, empty_vals: torch.Tensor,
                     tomb_vals: torch.Tensor, nw: int, window: int, seed: int, kb: int, vb: int, threads: int,
                     prefetch: int):
    """Every value of each key bits of a multi-value table as CSR: (offsets int64 [n + 1], value bits).
    The two reserved key patterns (EMPTY_BITS, TOMB_BITS) live out of band: their values (in insertion
    order) come in as empty_vals / tomb_vals (empty tensors when they have none)."""
    from ._layout import EMPTY_BITS, TOMB_BITS

    check_same_device("hash_multi_find", slots=slots, special=special, keys=keys, empty_vals=empty_vals,
                      tomb_vals=tomb_vals)
    if vb not in _BITS:  # (as the fake says; review finding: a bare KeyError for empty keys)
        raise ValueError("pykernels.hash_multi_find: multi-value tables need values (vb = 4 or 8)")
    for name, sv in (("empty_vals", empty_vals), ("tomb_vals", tomb_vals)):
        if sv.dtype != _BITS[vb] or sv.dim() != 1:  # (they are copied into the value bits)
            raise ValueError(f"pykernels.hash_multi_find: expected '{name}' a 1-D {_BITS[vb]} tensor (the value "
                             f"bits), got {sv.dtype} of shape {tuple(sv.shape)}")
    n = keys.numel()
    specials = []
    for bits, sv in ((EMPTY_BITS, empty_vals), (TOMB_BITS, tomb_vals)):
        if sv.numel():
            m = keys == bits
            if bool(m.any()):
                specials.append((m, sv))
    if n and keys.device.type == "cpu" and not specials:
        # one walk per key (the native side keeps the values it met), then one sequential copy
        _check_special("hash_multi_find", special, nw)
        _check_table_args("hash_multi_find", slots, keys, None, nw, window, kb, vb)
        counts = torch.empty(n, dtype=torch.int64, device="cpu")
        collected = _mod(slots).multi_collect(slots.data_ptr(), special.data_ptr(), nw, window, seed & _M64, kb, vb,
                                              keys.data_ptr(), n, counts.data_ptr(), _nthreads(threads), prefetch)
        offsets = _native.zeros(n + 1, torch.int64, "cpu")
        torch.cumsum(counts, 0, out=offsets[1:])
        vals = out_buffer(collected.total, _BITS[vb], keys.device)
        collected.copy_to(vals.data_ptr())
        return offsets, vals
    counts = _multi_count_impl(slots, special, keys, nw, window, seed, kb, vb, threads, prefetch)  # reserved: 0
    for m, sv in specials:
        counts[m] = sv.numel()
    offsets = _native.zeros(n + 1, torch.int64, keys.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    total = int(offsets[-1]) if n else 0
    vals = out_buffer(total, _BITS[vb], keys.device)
    if total:
        _mod(slots).multi_walk(slots.data_ptr(), special.data_ptr(), nw, window, seed & _M64, kb, vb, keys.data_ptr(),
                               n, 0, offsets.data_ptr(), vals.data_ptr(), _nthreads(threads), prefetch,
                               *stream_args(slots.device))
    for m, sv in specials:
        starts = offsets[:-1][m]
        idx = (starts[:, None] + torch.arange(sv.numel(), device=keys.device)[None, :]).reshape(-1)
        vals[idx] = sv.repeat(starts.numel())
    return offsets, vals


@torch.library.custom_op("pykernels::hash_multi_find", mutates_args=())
def _multi_find_op(slots: torch.Tensor, special: torch.Tensor, keys: torch.Tensor, empty_vals: torch.Tensor,
                   tomb_vals: torch.Tensor, nw: int, window: int, seed: int, kb: int, vb: int, threads: int,
                   prefetch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _multi_find_impl(slots, special, keys, empty_vals, tomb_vals, nw, window, seed, kb, vb, threads, prefetch)


@_multi_find_op.register_fake
@fake_on_one_device(_multi_find_op)
def _(slots, special, keys, empty_vals, tomb_vals, nw, window, seed, kb, vb, threads, prefetch):
    check_same_device("hash_multi_find", slots=slots, special=special, keys=keys)
    vb = int(vb)  # the values' dtype: specialized, as in hash_find's fake
    if vb not in _BITS:
        raise ValueError("pykernels.hash_multi_find: multi-value tables need values (vb = 4 or 8)")
    total = torch.library.get_ctx().new_dynamic_size()  # how many values the keys have: known once run
    return keys.new_empty(keys.numel() + 1, dtype=torch.int64), keys.new_empty(total, dtype=_BITS[vb])


def hash_multi_find(slots, special, keys, empty_vals, tomb_vals, nw, window, seed, kb, vb, threads, prefetch):
    """pykernels::hash_multi_find: directly in eager code, else through the registered op (so
    MultiValueHashMap.find traces under torch.compile(fullgraph=True), its output size unbacked)."""
    args = (slots, special, keys, empty_vals, tomb_vals, nw, window, seed, kb, vb, threads, prefetch)
    direct = eager_direct(slots, special, keys, empty_vals, tomb_vals, op="MultiValueHashMap.find")
    return _multi_find_impl(*args) if direct else _multi_find_op(*args)


def _check_bloom(op: str, words: torch.Tensor, keys: torch.Tensor, nblocks: int, k: int):
    """The native filter reads nblocks 512-bit blocks of `words` and the int64 key values."""
    check_same_device(op, words=words, keys=keys)
    if words.dtype != torch.int64 or not words.is_contiguous() or words.numel() < nblocks * 8 or nblocks < 1:
        raise ValueError(f"pykernels.{op}: expected 'words' a contiguous int64 tensor of at least {nblocks * 8} "
                         f"words for {nblocks} blocks, got {words.dtype} of {words.numel()} words")
    if keys.dtype != torch.int64 or keys.dim() != 1 or not keys.is_contiguous():
        raise ValueError(f"pykernels.{op}: expected 'keys' a contiguous 1-D int64 tensor, got {keys.dtype} of "
                         f"shape {tuple(keys.shape)}")
    if not 1 <= k <= 64:
        raise ValueError(f"pykernels.{op}: expected num_hashes in 1..64, got {k}")


def _bloom_contains_impl(words: torch.Tensor, keys: torch.Tensor, nblocks: int, k: int, seed: int) -> torch.Tensor:
    _check_bloom("bloom_contains", words, keys, nblocks, k)
    out = out_buffer(keys.numel(), torch.uint8, keys.device)
    if keys.numel():
        _mod(words).bloom_contains(words.data_ptr(), nblocks, k, seed & _M64, keys.data_ptr(), keys.numel(),
                                   out.data_ptr(), torch.get_num_threads(), *stream_args(words.device))
    return out.view(torch.bool)


@torch.library.custom_op("pykernels::bloom_contains", mutates_args=())
def _bloom_contains_op(words: torch.Tensor, keys: torch.Tensor, nblocks: int, k: int, seed: int) -> torch.Tensor:
    return _bloom_contains_impl(words, keys, nblocks, k, seed)


@_bloom_contains_op.register_fake
@fake_on_one_device(_bloom_contains_op)
def _(words, keys, nblocks, k, seed):
    check_same_device("bloom_contains", words=words, keys=keys)
    return keys.new_empty(keys.numel(), dtype=torch.bool)


def bloom_contains(words, keys, nblocks, k, seed):
    args = (words, keys, nblocks, k, seed)
    return (_bloom_contains_impl(*args) if eager_direct(words, keys, op="BloomFilter.contains")
            else _bloom_contains_op(*args))


def _bloom_add_impl(words: torch.Tensor, keys: torch.Tensor, nblocks: int, k: int, seed: int) -> None:
    _check_bloom("bloom_add_", words, keys, nblocks, k)
    if keys.numel():
        _mod(words).bloom_add(words.data_ptr(), nblocks, k, seed & _M64, keys.data_ptr(), keys.numel(),
                              torch.get_num_threads(), *stream_args(words.device))


@torch.library.custom_op("pykernels::bloom_add_", mutates_args=("words",))
def _bloom_add_op(words: torch.Tensor, keys: torch.Tensor, nblocks: int, k: int, seed: int) -> None:
    _bloom_add_impl(words, keys, nblocks, k, seed)


@_bloom_add_op.register_fake
@fake_on_one_device(_bloom_add_op)
def _(words, keys, nblocks, k, seed):
    check_same_device("bloom_add_", words=words, keys=keys)


def bloom_add_(words, keys, nblocks, k, seed):
    if eager_direct(words, keys, op="BloomFilter.add"):
        _bloom_add_impl(words, keys, nblocks, k, seed)
        torch.autograd.graph.increment_version((words,))  # written in place, as the op would record
    else:
        _bloom_add_op(words, keys, nblocks, k, seed)
