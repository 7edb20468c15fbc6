"""The CUDA/HIP backend of the sort family: csrc/sort/sort.cu (Onesweep) through pykernels._cuda_sort.

The kernels sort unsigned 32/64-bit keys ascending on a bit range, carrying a 4- or 8-byte payload.
uint32/uint64 keys sorted ascending go straight in (keys only, or with their payload): the fast path
benchmarked against torch.sort/CUB. Every other case encodes the keys with the order-preserving
transform (pykernels/sort/_encode.py), sorts (encoded key, int32 index) pairs and gathers the outputs
through the index, so keys come back with their exact input bits. Rows and segments sort by
(segment, key): a stable sort by key, then a stable sort of the segment ids on just their bits.

Every entry point takes `config` (None: the defaults), a dict of the kernels' tuning parameters
(csrc/sort/sort.cu, "Tuning parameters"; pykernels/sort/_tune.py measures them):
    bin_items            keys per thread of the binning kernel (its tile is 256 * bin_items keys)
    hist_threads         threads per block of the histogram kernel
    hist_keys_per_block  keys each histogram block reads
    rank                 how a warp ranks its keys: 0 = 8 ballots per key, 1 = shared-memory atomic OR
                         (CUB's match-atomic-or; NVIDIA only, AMD runs the ballots either way)
One config serves every Onesweep call an op makes (the argsort of encoded keys, then the segment-id
sort of rows and segments).
"""
from __future__ import annotations

import torch

from .. import _native
from ._encode import encode, take

# The configs csrc/sort/sort.cu compiles (SortConfig, BIN_ITEMS_CHOICES, ...; a test cross-checks them
# against the native module). The binning kernel keeps 256 threads: its look-back runs one per digit.
BIN_THREADS = 256
BIN_ITEMS = (8, 11, 15, 19)        # 4-byte keys and payloads
BIN_ITEMS_WIDE = (8, 11, 15)       # an 8-byte key or payload: a 19-item tile needs 55 KB of shared memory
HIST_THREADS = (256, 512, 1024)
HIST_KEYS_PER_BLOCK_RANGE = (1 << 10, 1 << 20)
RANKS = (0, 1)
DEFAULT_CONFIG = {"bin_items": 15, "hist_threads": 512, "hist_keys_per_block": 1 << 15, "rank": 0}  # the old constants


def bin_items_choices(key_bytes: int, val_bytes: int) -> tuple:
    """The compiled bin_items for Onesweep calls on key_bytes-byte keys with val_bytes-byte payloads."""
    return BIN_ITEMS_WIDE if max(key_bytes, val_bytes) > 4 else BIN_ITEMS


def check_config(op: str, config, key_bytes: int, val_bytes: int) -> dict:
    """The full config (defaults filled in) for an Onesweep call, or ValueError/TypeError naming the op
    and the config entry. Runs before any allocation or launch (the native side checks again)."""
    if config is None:
        return dict(DEFAULT_CONFIG)
    if not isinstance(config, dict):
        raise TypeError(f"pykernels.{op}: expected a dict for the CUDA sort config, got {type(config).__name__}")
    unknown = sorted(set(config) - set(DEFAULT_CONFIG))
    if unknown:
        raise ValueError(f"pykernels.{op}: unknown CUDA sort config entr{'y' if len(unknown) == 1 else 'ies'} "
                         f"{', '.join(map(repr, unknown))} (expected {', '.join(map(repr, DEFAULT_CONFIG))})")
    cfg = dict(DEFAULT_CONFIG, **config)
    for name, v in cfg.items():
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"pykernels.{op}: expected an int for config '{name}', got {type(v).__name__}")
    items = bin_items_choices(key_bytes, val_bytes)
    if cfg["bin_items"] not in items:
        payload = f"{val_bytes}-byte payloads" if val_bytes else "no payload"
        raise ValueError(f"pykernels.{op}: expected config 'bin_items' in {{{', '.join(map(str, items))}}} for "
                         f"{key_bytes}-byte keys and {payload}, got {cfg['bin_items']}")
    if cfg["hist_threads"] not in HIST_THREADS:
        raise ValueError(f"pykernels.{op}: expected config 'hist_threads' in {{{', '.join(map(str, HIST_THREADS))}}}, "
                         f"got {cfg['hist_threads']}")
    lo, hi = HIST_KEYS_PER_BLOCK_RANGE
    if not lo <= cfg["hist_keys_per_block"] <= hi:
        raise ValueError(f"pykernels.{op}: expected config 'hist_keys_per_block' in [{lo}, {hi}], "
                         f"got {cfg['hist_keys_per_block']}")
    if cfg["rank"] not in RANKS:
        raise ValueError(f"pykernels.{op}: expected config 'rank' in {{0, 1}}, got {cfg['rank']}")
    return cfg


def _mod():
    return _native.cuda_module("sort")


def _onesweep(keys: torch.Tensor, vals, begin_bit: int, end_bit: int, config=None, op: str = "sort"):
    """keys: contiguous 4/8-byte tensor of unsigned bit patterns; vals: None or a 4/8-byte tensor."""
    n = keys.numel()
    kb = keys.element_size()
    vb = vals.element_size() if vals is not None else 0
    cfg = check_config(op, config, kb, vb)
    m = _mod()
    out_k = torch.empty_like(keys)
    out_v = torch.empty_like(vals) if vals is not None else None
    if n == 0:
        return out_k, out_v
    tmp = torch.empty(m.temp_bytes(n, kb, vb, begin_bit, end_bit, cfg["bin_items"], op), dtype=torch.uint8,
                      device=keys.device)
    m.onesweep(keys.data_ptr(), out_k.data_ptr(), vals.data_ptr() if vals is not None else 0,
               out_v.data_ptr() if vals is not None else 0, n, kb, vb, begin_bit, end_bit, tmp.data_ptr(),
               tmp.numel(), _native.cuda_stream_handle(keys.device), cfg["bin_items"], cfg["hist_threads"],
               cfg["hist_keys_per_block"], cfg["rank"], op)
    return out_k, out_v


def _positions(n: int, device) -> torch.Tensor:
    """0..n-1 as a sort payload: int32 (half the traffic) while they fit, int64 from 2^31 (int32 ones
    would wrap negative: wrong elements, no error)."""
    return torch.arange(n, dtype=torch.int64 if n >= (1 << 31) else torch.int32, device=device)


def _argsort(x: torch.Tensor, descending: bool, begin_bit: int = 0, end_bit=None, config=None,
             op: str = "argsort") -> torch.Tensor:
    enc, bits = encode(x.reshape(-1), descending)
    _, perm = _onesweep(enc, _positions(enc.numel(), x.device), begin_bit, bits if end_bit is None else end_bit,
                        config, op)
    return perm.to(torch.int64)


def sort_1d(keys: torch.Tensor, values, descending: bool, begin_bit: int, end_bit, config=None):
    op = "sort_keys" if values is None else "sort_pairs"
    bits = 8 * keys.element_size()
    end = bits if end_bit is None else end_bit
    direct = keys.dtype in (torch.uint32, torch.uint64) and not descending and \
        (values is None or values.element_size() in (4, 8))
    if direct:
        iv = torch.int32 if keys.element_size() == 4 else torch.int64
        vv = None
        if values is not None:
            vv = values.view(torch.int32 if values.element_size() == 4 else torch.int64)
        k, v = _onesweep(keys.view(iv), vv, begin_bit, end, config, op)
        return k.view(keys.dtype), (v.view(values.dtype) if values is not None else None)
    perm = _argsort(keys, descending, begin_bit, end_bit, config, op)
    return take(keys, perm), (take(values, perm) if values is not None else None)


def _by_segment(x: torch.Tensor, seg_id: torch.Tensor, nseg: int, descending: bool, config, op: str) -> torch.Tensor:
    perm = _argsort(x, descending, config=config, op=op)
    seg_sorted = seg_id[perm].to(torch.int32).contiguous()
    bits = max(1, int(nseg - 1).bit_length())
    _, p2 = _onesweep(seg_sorted, _positions(perm.numel(), x.device), 0, bits, config, op)
    return perm[p2.to(torch.int64)]


def sort_rows(x2d: torch.Tensor, descending: bool, want_keys: bool, config=None):
    op = "sort" if want_keys else "argsort"
    rows, n = x2d.shape
    flat = x2d.reshape(-1)
    if rows == 1:
        perm = _argsort(flat, descending, config=config, op=op)
    else:
        perm = _by_segment(flat, torch.arange(rows, device=x2d.device).repeat_interleave(n), rows, descending,
                           config, op)
    return (take(flat, perm) if want_keys else None), perm - (perm // n) * n


def segmented(keys: torch.Tensor, offsets: torch.Tensor, values, descending: bool, config=None):
    n = keys.numel()
    off = offsets.to(device=keys.device, dtype=torch.int64)
    pos = torch.arange(n, device=keys.device)
    nseg = off.numel() - 1
    seg = (torch.searchsorted(off, pos, right=True) - 1).clamp(-1, nseg) + 1
    perm = _by_segment(keys, seg, nseg + 2, descending, config, "segmented_sort")
    perm = torch.where((pos >= off[0]) & (pos < off[-1]), perm, pos)
    return take(keys, perm), (take(values, perm) if values is not None else None)
