"""Autotuning of the sort family (pykernels.autotune Tunables).

CPU config space (csrc/sort/sort_cpu.cpp):
  digit_bits  8 or 11: 11-bit digits make 3 passes for 32-bit keys (6 for 64-bit) instead of 4 (8), but
              their 2048 write-combining lines and counters need more cache; which wins depends on the
              cache sizes and n.
  wc          1: software write-combining lines (flushed whole, streaming stores if nt); 0: plain
              scattered stores (wins while the data fits the caches and the open lines fit L1).
  threads     0 = torch.get_num_threads(), or a fixed count (a shared machine may do better with fewer).
  nt          streaming (non-temporal) stores for full write-combining lines: skips the read-for-ownership
              of the destination; pays off once the arrays exceed the caches. True / False everywhere,
              -1 (default) where they paid on the 2-core Zen 4: the LSD engine, the MSD split into 2048
              buckets (not into 256: plain stores there).
  grain       the tile: at least this many keys per thread (smaller inputs use fewer threads).
  msd         32- and 64-bit keys (whole width, no bit range): split by the top byte of the span into 256
              buckets, then LSD inside each bucket in cache (digit_bits/wc do not apply there; nt: the
              split's records go through write-combining lines flushed with streaming stores once they
              pass 8 MiB, else plain stores; -1: streaming only into 2048 buckets); 64-bit
              keys spanning 2^32 or more take 16-byte records and a second split inside each bucket.
              -1 (default): from 32K keys where threads of 16K keys each (whatever the grain) make
              two or more, else from 256K (below 256K not keys spanning at most 16 bits),
              where a sample and the top-byte counts say the split spreads the keys (no bucket past
              L2 size with more than 1/8 of them all one value; at most 4 MiB, 8 MiB wide); 1: the same check at
              any size (so a choice tuned on random keys still leaves skewed keys to the LSD engine);
              0: the LSD engine only; 2: always (tests).
              8- and 16-bit keys with indices or a 4/8-byte payload (whole width, 2K-4M 8-bit / 24K-16M
              16-bit keys; 16-bit keys' payloads up to 4 MiB) take their own path unless msd is 0 or
              digit_bits is set: a counting scatter (8-bit), a split by the top byte then a counting sort
              of each bucket (16-bit; integers of a span of up to 11 bits take the LSD engine's one pass
              over key - min).
  msd_bits    the split's digit for 32-bit keys: 8 (256 buckets; 2048 where a sample shows the top byte
              clusters the keys) or 11 (2048 buckets, each then sorted by two passes of ~11 bits inside
              L1/L2); 0 (default): 8 (with the split's plain stores 256 buckets won at 4M-64M keys
              on the 2-core Zen 4; on a Zen 2, streaming both, 2048 won from 8M).
`python -m pykernels.autotune generate --ops sort [--sizes 65536,1e6]` tunes sort_keys/sort/argsort/
sort_pairs on random uint32/int32/float32/int64 keys of those sizes.

CUDA config space (csrc/sort/sort.cu, "Tuning parameters"; pykernels/sort/_cuda.py lists the compiled ones):
  bin_items            keys per thread of the Onesweep binning kernel (tile = 256 * bin_items keys; the
                       block stays at 256 threads, one per digit in the look-back): 8, 11, 15, 19, or 8,
                       11, 15 when a key or payload is 8 bytes. Longer tiles mean fewer look-back steps and
                       status words, shorter ones more resident blocks (fewer registers, less shared memory).
  hist_threads,        the histogram kernel's block shape: 256/512/1024 threads reading 16 or 64 keys
  hist_keys_per_block  each; small inputs want more, smaller blocks to fill the GPU.
  rank                 0: 8 ballots per key find the lanes of a warp with the same digit; 1: each lane ORs
                       its bit into its digit's word in shared memory (CUB's match-atomic-or, fewer
                       instructions per key; NVIDIA only). Not yet measured on a GPU: 0 stays the default.
The default is the kernels' old constants (15; 512 threads x 64 keys; ballots), except 8 keys per thread
where keys carry a payload (_cuda_default_for, measured on an H200).
Keys are the ones dispatch builds (dtype, size bucket, payload bytes / rows / segments), shared with the
CPU tunables; the candidates of a key are the configs valid for every Onesweep call that key can make.
On a GPU, `generate --ops sort` also tunes these on uint32/uint64/float32 keys (default sizes 2^20, 2^24).
"""
from __future__ import annotations

import torch

from .. import autotune

_OPS_1D = ("sort_keys", "sort_pairs")
_OPS_ROWS = ("sort", "argsort")


def _candidates(key: dict) -> list:
    from . import _default_config

    base = _default_config(key)
    out = [dict(base, grain=g) for g in (1 << 14, 1 << 17)]  # the heuristic with more or fewer threads
    # the split's digit: 8 or 11 bits for 32-bit keys (others ignore msd_bits)
    split_bits = (8, 11) if key.get("dtype") in ("int32", "uint32", "float32") else (0,)
    for threads in (0, 1):
        for grain in (16384, 1 << 17):
            # the MSD split + in-cache sort wherever it applies (8/16-bit keys with indices: their own path)
            for nt in (True, False):
                for msd_bits in split_bits:
                    cfg = dict(base, msd=1, threads=threads, grain=grain, nt=nt, msd_bits=msd_bits)
                    if cfg not in out and cfg != base:
                        out.append(cfg)
    for bits in (8, 11):
        for wc in (0, 1):
            for nt in ((True, False) if wc else (True,)):  # nt only matters with write-combining
                for threads in (0, 1):
                    for grain in (16384, 1 << 17):
                        cfg = dict(base, digit_bits=bits, wc=wc, nt=nt, threads=threads, grain=grain, msd=0)
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


# keyword arguments of each op that tune() accepts with its examples (the others are an error, not
# silently dropped): sort/argsort sort along `dim`, which dispatch moves last before keying; sort's `out`
# is only written (by the check's run of the op), never read
_OP_KWARGS = {"sort_keys": {"descending", "begin_bit", "end_bit"},
              "sort_pairs": {"descending", "begin_bit", "end_bit"},
              "sort": {"dim", "descending", "stable", "out"}, "argsort": {"dim", "descending", "stable"}}


def _example_keys(op: str, keys, kw: dict):
    """The example's keys as dispatch sees them: checked kwargs, and for sort/argsort `dim` moved last."""
    unknown = set(kw) - _OP_KWARGS[op]
    if unknown:
        raise TypeError(f"{op} takes no argument(s) {', '.join(sorted(unknown))}")
    if not isinstance(keys, torch.Tensor):
        raise TypeError(f"expected a tensor of keys, got {type(keys).__name__}")
    if op in _OPS_ROWS:
        from . import _norm_dim  # the op's own check (numpy ints, 0-d tensors), as torch.sort

        dim = _norm_dim(op, keys, kw.get("dim", -1))
        if keys.dim() > 1:
            keys = keys.movedim(dim, -1)
    return keys


def _run(op: str):
    from . import _cpu_segmented, _cpu_sort_1d, _cpu_strided_rows, _norm_dim, _strided_rows_apply

    def run(config, keys, values=None, **kw):
        desc = bool(kw.get("descending", False))
        moved = _example_keys(op, keys, kw)
        if op in _OPS_ROWS and keys.dim() > 1:
            dim = _norm_dim(op, keys, kw.get("dim", -1))
            if _strided_rows_apply(keys, dim):  # short rows along an inner dim: sorted where they lie, as the op does
                return _cpu_strided_rows(op, keys.contiguous(), dim, desc, op == "sort", config)
        # contiguous, as the op makes them (_sort_1d_any): an expanded example reached the kernel as is
        keys = moved.contiguous()
        values = values.contiguous() if values is not None else None
        if op in _OPS_1D:
            bits = {"begin_bit": kw.get("begin_bit", 0), "end_bit": kw.get("end_bit")}
            return _cpu_sort_1d(keys.reshape(-1), payload=values if op == "sort_pairs" else None, descending=desc,
                                config=config, **bits)
        if keys.dim() <= 1:
            return _cpu_sort_1d(keys.reshape(-1), want_keys=(op == "sort"), want_idx=True, descending=desc,
                                config=config)
        n = keys.shape[-1]
        return _cpu_segmented(keys.reshape(-1), None, keys.numel() // n, n, want_keys=(op == "sort"),
                              want_idx=True, descending=desc, config=config)
    return run


def _make_key(op: str):
    from . import _bit_range_key, _key

    def make_key(keys, values=None, **kw):
        keys = _example_keys(op, keys, kw)
        if keys.numel() == 0:
            raise ValueError("the keys are empty")
        if op in _OPS_1D:  # as the op keys them (_sort_1d_any): a partial bit range is its own key
            bits = _bit_range_key(keys, kw.get("begin_bit", 0), kw.get("end_bit"))
            if op == "sort_pairs":
                return _key(op, keys, value_bytes=values.element_size(), **bits)
            return _key(op, keys, **bits)
        if op in _OPS_ROWS:
            rows = keys.numel() // max(keys.shape[-1], 1) if keys.dim() else 1
            flat = keys.reshape(-1, keys.shape[-1]) if keys.dim() else keys.reshape(1, 1)
            return _key(op, flat, rows=autotune.bucket(rows))
        return _key(op, keys)
    return make_key


# ---------------------------------------------------------------------------------------------
# CUDA backend (csrc/sort/sort.cu through pykernels/sort/_cuda.py)
# ---------------------------------------------------------------------------------------------
_OPS_CUDA = _OPS_1D + _OPS_ROWS + ("segmented_sort",)
# (hist_threads, keys per histogram thread): hist_keys_per_block = the product.
_CUDA_HIST_SHAPES = ((512, 64), (256, 16), (256, 64), (512, 16), (1024, 16), (1024, 64))


def _cuda_widest_bytes(key: dict) -> int:
    """The widest key or payload (4 or 8 bytes) of any Onesweep call an op with this key can make, so that
    every candidate is valid for all of them: 64-bit keys sort as 8-byte keys; other keys, and every
    non-direct path (descending, signed/float keys, rows, segments), sort as (encoded key, index) pairs
    with int32 indices (int64 from 2^31 keys, i.e. size buckets >= 2^31); sort_pairs of uint32/uint64
    keys carries a 4- or 8-byte payload itself. Descending is not part of the key, so both paths count."""
    widest = 8 if getattr(torch, key["dtype"]).itemsize == 8 else 4
    if key.get("n", 0) >= (1 << 31):
        widest = 8
    if key.get("value_bytes") == 8:
        widest = 8
    return widest


def _cuda_default_for(op: str):
    """The untuned GPU config of an op: 15 keys per thread (3840-key tiles) for keys alone, 8 (2048-key
    tiles) where a payload travels with the keys (sort_pairs, and sort/argsort/segmented_sort, which sort
    (encoded key, index) pairs): on an H200 (bench/gpu_runs/2026-12-04-h200.md), 2^28 uint32 keys +
    int32 payloads took 15.2 ms with 8 against 17.8 ms with 15 (the pair tile's registers and shared
    memory cost occupancy), while keys alone took 10.4-10.5 ms with 11 or 15 and 11.4 ms with 8."""
    def default(key: dict) -> dict:
        from . import _cuda

        cfg = dict(_cuda.DEFAULT_CONFIG)
        if op != "sort_keys":
            cfg["bin_items"] = 8
        return cfg
    return default


def _cuda_candidates(key: dict) -> list:
    from . import _cuda

    wide = _cuda_widest_bytes(key)
    # rank 1 (the atomic-OR ranking) is NVIDIA's alone: ROCm builds run the ballots for either value
    ranks = _cuda.RANKS if torch.version.hip is None else (0,)
    out = []
    for items in _cuda.bin_items_choices(wide, wide):
        for threads, per_thread in _CUDA_HIST_SHAPES:
            for rank in ranks:
                out.append({"bin_items": items, "hist_threads": threads, "hist_keys_per_block": threads * per_thread,
                            "rank": rank})
    return out


def _cuda_run(op: str):
    """A real sort on the device with this config (the CUDA path of the op, ascending)."""
    def run(config, keys, values=None, offsets=None, **kw):
        from . import _cuda

        if op == "sort_keys":
            return _cuda.sort_1d(keys, None, False, 0, None, config=config)
        if op == "sort_pairs":
            return _cuda.sort_1d(keys, values, False, 0, None, config=config)
        if op == "segmented_sort":
            return _cuda.segmented(keys, offsets, values, False, config=config)
        keys = _example_keys(op, keys, kw)  # the dim sorted along, moved last as dispatch does
        n = keys.shape[-1] if keys.dim() else 1
        return _cuda.sort_rows(keys.reshape(-1, n), False, op == "sort", config=config)
    return run


def _cuda_make_key(op: str):
    if op != "segmented_sort":
        return _make_key(op)
    from . import _key

    def make_key(keys, values=None, offsets=None, **kw):  # as pykernels.sort._segmented_impl builds it
        return _key(op, keys, segments=autotune.bucket(max(offsets.numel() - 1, 0)))
    return make_key


def _cuda_examples(op: str):
    """GPU examples: the direct Onesweep paths (uint32/uint64 keys, payloads of the key's width) and the
    (encoded key, index) path of float32 keys; rows of 1024 keys; 1024-key segments."""
    dtypes = {"sort_keys": (torch.uint32, torch.uint64, torch.float32), "sort_pairs": (torch.uint32, torch.uint64),
              "sort": (torch.float32,), "argsort": (torch.int32,), "segmented_sort": (torch.int32,)}[op]

    def make(sizes):
        from .._backend import backends

        if not backends()["cuda"]:
            return []
        ex = []
        g = torch.Generator().manual_seed(0)
        for n in sizes or [1 << 20, 1 << 24]:
            for dt in dtypes:
                if dt.is_floating_point:
                    k = torch.randn(n, generator=g).to(dt)
                else:
                    k = torch.randint(0, 1 << 62, (n,), generator=g, dtype=torch.int64).to(dt)
                k = k.cuda()
                if op == "sort_pairs":
                    vdt = torch.int32 if dt.itemsize == 4 else torch.int64
                    ex.append(((k, torch.arange(n, dtype=vdt, device="cuda")), {}))
                elif op in _OPS_ROWS:
                    ex.append(((k,), {}))
                    if n % 1024 == 0:
                        ex.append(((k.view(-1, 1024),), {}))
                elif op == "segmented_sort":
                    off = torch.arange(0, n + 1, 1024, device="cuda")
                    ex.append(((k,), {"offsets": off}))
                else:
                    ex.append(((k,), {}))
        return ex
    return make


def _check(op: str):
    """The public op on the example (tune() runs it first): its argument checks, and one warm-up run."""
    def check(keys, values=None, backend="auto", **kw):
        import pykernels

        fn = getattr(pykernels, op)
        if op == "sort_pairs":
            return fn(keys, values, backend=backend, **kw)
        if op == "segmented_sort":
            return fn(keys, kw.pop("offsets", None), values, backend=backend, **kw)
        return fn(keys, backend=backend, **kw)
    return check


def _register():
    from . import _default_config

    dtypes = {"sort_keys": (torch.uint32, torch.float32, torch.int64), "sort_pairs": (torch.int32,),
              "sort": (torch.int32, torch.float32), "argsort": (torch.int32,)}
    for op in _OPS_1D + _OPS_ROWS:
        autotune.register(autotune.Tunable(
            op=op, backend="cpu", group="sort", make_key=_make_key(op), default=_default_config,
            candidates=_candidates, run=_run(op), examples=_examples(op, dtypes[op]), check=_check(op)))
    # Registered whatever the build (as the hash tables' GPU tunable): tune() and dispatch only use them
    # where the CUDA backend runs, and their examples are empty elsewhere.
    for op in _OPS_CUDA:
        autotune.register(autotune.Tunable(
            op=op, backend="cuda", group="sort", make_key=_cuda_make_key(op), default=_cuda_default_for(op),
            candidates=_cuda_candidates, run=_cuda_run(op), examples=_cuda_examples(op), check=_check(op)))


_register()
