"""Autotuning of the sort family (pykernels.autotune Tunables).

CPU config space (csrc/sort/sort_cpu.cpp):
  digit_bits  8 or 11: 11-bit digits make 3 passes for 32-bit keys (6 for 64-bit) instead of 4 (8), but
              their 2048 write-combining lines and counters need more cache; which wins depends on the
              cache sizes and n.
  wc          1: software write-combining lines (flushed whole, streaming stores if nt); 0: plain
              scattered stores (wins while the data fits the caches and the open lines fit L1).
  threads     0 = torch.get_num_threads(), or a fixed count (a shared machine may do better with fewer).
  nt          streaming (non-temporal) stores for full write-combining lines: skips the read-for-ownership
              of the destination; pays off once the arrays exceed the caches.
  grain       the tile: at least this many keys per thread (smaller inputs use fewer threads).
`python -m pykernels.autotune generate --ops sort [--sizes 65536,1e6]` tunes sort_keys/sort/argsort/
sort_pairs on random uint32/int32/float32/int64 keys of those sizes.
"""
from __future__ import annotations

import torch

from .. import autotune

_OPS_1D = ("sort_keys", "sort_pairs")
_OPS_ROWS = ("sort", "argsort")


def _candidates(key: dict) -> list:
    from . import _default_config

    base = _default_config(key)
    out = []
    for bits in (8, 11):
        for wc in (0, 1):
            for nt in ((True, False) if wc else (True,)):  # nt only matters with write-combining
                for threads in (0, 1):
                    for grain in (16384, 1 << 17):
                        cfg = dict(base, digit_bits=bits, wc=wc, nt=nt, threads=threads, grain=grain)
                        if cfg not in out and cfg != base:
                            out.append(cfg)
    return out


def _examples(op: str, dtypes):
    def make(sizes):
        sizes = sizes or [1 << 16, 1 << 20]
        ex = []
        g = torch.Generator().manual_seed(0)
        for n in sizes:
            for dt in dtypes:
                if dt.is_floating_point:
                    k = torch.randn(n, generator=g).to(dt)
                else:
                    k = torch.randint(0, 1 << 31, (n,), generator=g, dtype=torch.int64).to(dt)
                if op == "sort_pairs":
                    ex.append(((k, torch.arange(n, dtype=torch.int32)), {}))
                else:
                    ex.append(((k,), {}))
        return ex
    return make


def _run(op: str):
    from . import _cpu_sort_1d, _cpu_segmented

    def run(config, keys, values=None, **kw):
        if op == "sort_keys":
            return _cpu_sort_1d(keys, config=config)
        if op == "sort_pairs":
            return _cpu_sort_1d(keys, payload=values, config=config)
        if keys.dim() <= 1:
            return _cpu_sort_1d(keys.reshape(-1), want_keys=(op == "sort"), want_idx=True, config=config)
        n = keys.shape[-1]
        return _cpu_segmented(keys.reshape(-1), None, keys.numel() // n, n, want_keys=(op == "sort"),
                              want_idx=True, config=config)
    return run


def _make_key(op: str):
    from . import _key

    def make_key(keys, values=None, **kw):
        if op == "sort_pairs":
            return _key(op, keys, value_bytes=values.element_size())
        if op in _OPS_ROWS:
            rows = keys.numel() // max(keys.shape[-1], 1) if keys.dim() else 1
            flat = keys.reshape(-1, keys.shape[-1]) if keys.dim() else keys.reshape(1, 1)
            return _key(op, flat, rows=autotune.bucket(rows))
        return _key(op, keys)
    return make_key


def _register():
    from . import _default_config

    dtypes = {"sort_keys": (torch.uint32, torch.float32, torch.int64), "sort_pairs": (torch.int32,),
              "sort": (torch.int32, torch.float32), "argsort": (torch.int32,)}
    for op in _OPS_1D + _OPS_ROWS:
        autotune.register(autotune.Tunable(
            op=op, backend="cpu", group="sort", make_key=_make_key(op), default=_default_config,
            candidates=_candidates, run=_run(op), examples=_examples(op, dtypes[op])))


_register()
