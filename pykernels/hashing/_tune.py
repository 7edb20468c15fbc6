"""Autotuning of the hash tables (group "hash" of `python -m pykernels.autotune generate --ops hash`).

CPU: the prefetch distance D of the software pipeline (how many DRAM misses are in flight per thread)
and the thread count. A table that fits in cache wants D = 0 (prefetches only cost instructions); a
table far larger than the last-level cache wants D around the number of line-fill buffers (10-20 on
x86). Keyed by slot bytes and the table's size in bytes (power-of-two bucket).

GPU: the window (= probing-group size, WarpCore section III) is a property of a table's layout, so it
is chosen when a table is created ("hash_table"). The block size is fixed (256 threads, hash.cu kBlock):
the kernels are grid-stride loops over probing groups, so the block size only sets how groups are
packed, and the H200 runs met the issue's rates with it; it is not a tuning knob yet.
"""
from __future__ import annotations

import weakref

import torch

from .. import autotune

_PREFETCH = (1, 4, 8, 16, 32, 48)
_CPU_CACHE_BYTES = 8 << 20  # tables up to about this size are mostly cache resident


def _key(table, keys=None, **kw):
    _check_table(table)  # tune() makes the key before the op's check runs (an AttributeError before)
    return {"slot_bytes": table._sb, "table_bytes": autotune.bucket(table.capacity * table._sb)}


def _check_table(table):
    from ._tables import _OpenTable

    if not isinstance(table, _OpenTable):
        raise TypeError(f"pykernels.autotune.tune: expected a hash table (HashMap, HashSet, CountingTable, "
                        f"MultiValueHashMap) as the first argument, got {type(table).__name__}")


def _cpu_default(key):
    # measured on a 2-core EPYC (per-core CPU time, 4M keys, 128 MiB table): D=32 gives 3x over D=0;
    # small cache-resident tables gain little from more than a few lookups in flight.
    return {"prefetch": 32 if key["table_bytes"] > _CPU_CACHE_BYTES // 4 else 8, "threads": 0}


def _cpu_candidates(key):
    import os

    cores = len(os.sched_getaffinity(0))
    threads = sorted({0, 1, max(1, cores // 2)})
    return [{"prefetch": d, "threads": t} for d in _PREFETCH for t in threads]


def _example_table(n, load, device="cpu"):
    from . import HashMap

    t = HashMap(int(n / load), key_dtype=torch.int64, value_dtype=torch.int64, device=device)
    g = torch.Generator().manual_seed(n)
    keys = torch.randint(-(1 << 62), 1 << 62, (n,), dtype=torch.int64, generator=g).to(device)
    t.insert(keys, keys)
    return t, keys


def _examples(sizes):
    out = []
    for n in sizes or [1 << 16, 1 << 22]:
        t, keys = _example_table(n, 0.5)
        perm = keys[torch.randperm(n)]
        out.append(((t, perm), {}))
    return out


def _run_find(config, table, keys):
    with table._lock:
        return _find_with(table, keys, config)


def _find_with(table, keys, config):
    from . import _layout as L

    vals, _ = _find_cfg(table, L.key_bits(keys), config)
    return vals


def _find_cfg(table, kbits, config):
    from . import _ops

    return _ops.hash_find(table._slots, table._special, kbits, table._nw, table.window, table.seed, table._kb,
                          table._vb, 0, True, table._threads(config), int(config.get("prefetch", 32)))


_SCRATCH = weakref.WeakKeyDictionary()


def _empty_like(table, window):
    """An empty, non-growing table of the same class, capacity, dtypes and device as `table`, with this
    window. Only the classes with values take a value dtype (HashSet and CountingTable do not: building
    their scratch tables with one made every config of a tune on them fail; review finding)."""
    kw = {"key_dtype": table.key_dtype, "device": table.device, "window": window, "max_load_factor": 1.0,
          "growable": False}
    if table._vb and not table._counting:
        kw["value_dtype"] = table.value_dtype
    return type(table)(table.capacity, **kw)


def _insert_mode(table):
    """The insert kind the table's own insert runs: append (multi-value map), add (counting) or upsert."""
    from ._tables import M_ADD, M_APPEND, M_UPSERT

    return M_APPEND if table._multi else (M_ADD if table._counting else M_UPSERT)


def _scratch_for(table):
    """The empty scratch table of the example table's layout that inserts are timed into (the user's table
    is left untouched)."""
    scratch = _SCRATCH.get(table)
    if scratch is None or scratch.capacity != table.capacity or scratch.window != table.window:
        # the table's layout now (review finding: a table grown since its last tune kept being timed as
        # its old, far smaller scratch table, under the new size's key)
        scratch = _SCRATCH[table] = _empty_like(table, table.window)
    return scratch


def _empty_scratch(args, kwargs):
    """Tunable.setup of hash_insert, untimed before each timed insert: the scratch table emptied (its clear(),
    a memset of every slot, was timed with the insert: 15-35 ms of a 2^23-slot table against 1-12 ms of
    inserting 64K keys; audit finding)."""
    table = args[0] if args else kwargs["table"]
    scratch = _scratch_for(table)
    with scratch._lock:
        scratch.clear()
    return args, kwargs


def _drop_scratch(args, kwargs):
    """Tunable.teardown: the scratch table goes when tune() is done (it stayed as long as the table did)."""
    _SCRATCH.pop(args[0] if args else kwargs["table"], None)


def _run_insert(config, table, keys):
    """Times inserts into the emptied scratch table (_empty_scratch)."""
    from . import _layout as L

    scratch = _scratch_for(table)
    kbits = L.key_bits(keys)
    vbits = None
    if scratch._vb:
        vbits = kbits if scratch._vb == scratch._kb else torch.zeros(kbits.numel(), dtype=L._BITS[scratch._vb])
    with scratch._lock:
        scratch._native_insert(kbits, vbits, _insert_mode(scratch), config)


def _check(table, keys=None, backend="auto", **kw):
    """The table's own checks of the example (tune() runs them first): a table of this library, and keys
    its lookups and inserts accept (dtype, device), as they would be given to it."""
    _check_table(table)
    if kw:
        raise TypeError(f"pykernels.autotune.tune: the hash ops take (table, keys), not {', '.join(sorted(kw))}")
    table._keys("find", keys)


autotune.register(autotune.Tunable(
    op="hash_find", group="hash", backend="cpu", make_key=_key, default=_cpu_default,
    candidates=_cpu_candidates, run=_run_find, examples=_examples, check=_check))

def _check_insert(table, keys=None, backend="auto", **kw):
    """_check, and keys an empty table of this capacity can take: the insert is timed into one (keys it
    would leave out time nothing)."""
    _check(table, keys, backend, **kw)
    n = int(keys.numel())
    if n > table._limit() and not table._multi:  # repeats of a key take one slot (a multi-value map's each one)
        n = int(torch.unique(keys).numel())
    if n > table._limit():
        raise ValueError(f"pykernels.autotune.tune: hash_insert is timed inserting the {n} example keys into an "
                         f"empty table of this one's capacity ({table.capacity}, at most {table._limit()} keys at "
                         f"its max_load_factor); tune on a table sized for them")


autotune.register(autotune.Tunable(
    op="hash_insert", group="hash", backend="cpu", make_key=_key, default=_cpu_default,
    candidates=_cpu_candidates, run=_run_insert, examples=_examples, check=_check_insert, setup=_empty_scratch,
    teardown=_drop_scratch))


# ---- GPU: the probing-group size (= window) of a new table ------------------------------------
def _gpu_table_key(table, keys=None, **kw):
    return {"slot_bytes": table._sb}


def _gpu_table_default(key):
    return {"window": 8}  # WarpCore's default group size


def _gpu_table_candidates(key):
    # one group of G lanes loads G slots: keep a window within 2 x 128-byte lines
    return [{"window": w} for w in (2, 4, 8, 16, 32) if w * key["slot_bytes"] <= 256]


def _run_gpu_table(config, table, keys):
    """Build a table of this layout with the candidate window, insert the keys and find them (each
    class through its own API: values of the table's value dtype, counts for a counting table)."""
    t = _empty_like(table, config["window"])
    if table._counting:
        t.add(keys)
    elif table._vb:
        t.insert(keys, torch.zeros(keys.numel(), dtype=table.value_dtype, device=keys.device))
    else:
        t.insert(keys)
    return getattr(t, "find", t.contains)(keys)  # sets and counting tables have no find


def _gpu_examples(sizes):
    out = []
    for n in sizes or [1 << 22]:
        for load in (0.5, 0.9):
            from . import HashMap

            t = HashMap(int(n / load), key_dtype=torch.int64, value_dtype=torch.int64, device="cuda")
            keys = torch.randperm(4 * n, device="cuda")[:n]
            out.append(((t, keys), {}))
    return out


autotune.register(autotune.Tunable(
    op="hash_table", group="hash", backend="cuda", make_key=_gpu_table_key, default=_gpu_table_default,
    candidates=_gpu_table_candidates, run=_run_gpu_table, check=_check,
    examples=lambda sizes: _gpu_examples(sizes) if torch.cuda.is_available() else []))
