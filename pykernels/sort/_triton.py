"""The Onesweep pipeline in Triton (runs on a GPU, and on CPU tensors under TRITON_INTERPRET=1).

1. `_hist_kernel`: one read of the keys builds the 256-bin histograms of every 8-bit digit at once
   (tl.histogram per tile, atomics into the global table) - Onesweep's upfront histogram kernel.
2. Per non-trivial digit, `_bin_kernel` (one launch): each program takes its tile number from an atomic
   counter (not program_id: a tile only ever waits for tiles that already started, which is what makes
   the spin safe), publishes its per-digit counts as AGGREGATE in a packed 64-bit status word
   (flag in bits 32-33 + 32-bit count, so one store publishes both), walks back over predecessor tiles with one
   lane per digit (decoupled look-back: sum AGGREGATEs until an INCLUSIVE), publishes INCLUSIVE, then
   ranks its keys by digit (a stable in-tile sort of (digit, position) words stands in for the warp
   multisplit + shared-memory staging of the CUDA version) and writes them out in per-digit runs.
   Digit offsets from the histogram are added as Onesweep's "tile -1" prefix.
3. A pass whose digit is the same for every key is skipped.

Keys of every dtype are first made order-preserving unsigned integers (int32 bit patterns for keys of
up to 32 bits, int64 for 64-bit keys) with the same transform as the CPU backend; the pipeline carries
the 32-bit index of every key, and the outputs are gathered through it (exact input bits back).
Batched rows and segments sort by (segment, key): a stable sort by key, then a stable sort by segment id.
Under the interpreter programs run in launch order, so the look-back always finds its predecessors done.
Indices, digit counts and offsets are 32-bit, so one call sorts at most 2^31 - 1 keys (larger inputs:
ValueError naming the limit; the CUDA backend chunks them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .._triton_util import ADD, MIN, interpreting, kernel, launches_on_input_device
from ..triton_aot import AotSpec
from ._encode import encode, take as _take

RADIX = 256
# Status word (int64): bits 32-33 flag (0 not ready, 1 aggregate, 2 inclusive), bits 0-31 the count. A 32-bit
# word (2 flag bits + 29-bit count) would cap a sort at 2^28 keys; the 32-bit indices cap it at 2^31 - 1.
FLAG_AGG = tl.constexpr(1 << 32)
FLAG_INC = tl.constexpr(2 << 32)
COUNT_MASK = tl.constexpr((1 << 32) - 1)
MAX_TRITON_KEYS = (1 << 31) - 1
BLOCK_DEFAULT = 1024  # keys per tile on a GPU (4 warps, no spills on sm_90)
BLOCK_INTERPRET = 256  # under TRITON_INTERPRET=1 (same code, smaller tiles run faster on the CPU)


def _tile_keys() -> int:
    return BLOCK_INTERPRET if interpreting() else BLOCK_DEFAULT


# The kernels are plain functions launched through kernel() and use only Triton builtins (tl.full, tl.reduce,
# tl.associative_scan with our combine functions), so they run under TRITON_INTERPRET=1 even when it was set
# after triton was imported (pykernels/_triton_util.py).
def _hist_kernel(keys_ptr, hist_ptr, shifts_ptr, masks_ptr, n, NPASS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    k = tl.load(keys_ptr + offs, mask=m, other=0)
    bins = tl.arange(0, 256)
    for p in tl.static_range(NPASS):
        sh = tl.load(shifts_ptr + p)
        dm = tl.load(masks_ptr + p)
        d = ((k >> sh) & dm).to(tl.int32)
        h = tl.histogram(d, 256, mask=m)
        tl.atomic_add(hist_ptr + p * 256 + bins, h, sem="relaxed")


def _bin_kernel(keys_in, keys_out, idx_in, idx_out, status_ptr, counter_ptr, goff_ptr, base_ptr, stage_ptr, n, shift,
                dmask,
                BLOCK: tl.constexpr, LOG_BLOCK: tl.constexpr):
    # Tile id in start order (Onesweep), so a tile only waits on tiles that are already running.
    tile = tl.atomic_add(counter_ptr, 1)
    base = tile.to(tl.int64) * BLOCK
    lane = tl.arange(0, BLOCK)
    offs = base + lane
    m = offs < n
    k = tl.load(keys_in + offs, mask=m, other=0)
    d = ((k >> shift) & dmask).to(tl.int32)
    bins = tl.arange(0, 256)
    local = tl.histogram(d, 256, mask=m)
    # Publish this tile's counts as AGGREGATE: one store per digit carries flag and count.
    st_row = status_ptr + tile.to(tl.int64) * 256 + bins
    tl.atomic_xchg(st_row, local.to(tl.int64) | FLAG_AGG, sem="release")
    # Decoupled look-back, one lane per digit: sum AGGREGATEs until an INCLUSIVE (or tile -1).
    excl = tl.full([256], 0, tl.int32)
    pred = tl.full([256], 0, tl.int32) + (tile - 1)
    done = pred < 0
    while tl.reduce(done.to(tl.int32), 0, MIN) == 0:
        s = tl.atomic_add(status_ptr + pred.to(tl.int64) * 256 + bins, 0, mask=~done, sem="acquire")
        flag = (s >> 32) & 3
        take = (~done) & (flag != 0)
        excl += tl.where(take, (s & COUNT_MASK).to(tl.int32), 0)
        inclusive = take & (flag == 2)
        pred = tl.where(take & (flag == 1), pred - 1, pred)
        done = done | inclusive | (pred < 0)
    tl.atomic_xchg(st_row, (excl + local).to(tl.int64) | FLAG_INC, sem="release")
    # Rank inside the tile: a stable in-tile counting sort by the digit, as two 4-bit sub-passes
    # (one-hot [BLOCK, 16] prefix sums give each key its rank among equal nibbles), staged through
    # this tile's scratch row - Triton's stand-in for warp multisplit + shared-memory staging. Keys then
    # leave in per-digit runs: out[goff[d] + excl[d] + (j - local_start[d])].
    lstart = tl.associative_scan(local, 0, ADD) - local
    goff = tl.load(goff_ptr + bins)
    tl.store(base_ptr + tile.to(tl.int64) * 256 + bins, goff + excl - lstart)
    word = tl.where(m, d, 255) * BLOCK + lane  # lanes past n take digit 255: stable, they stay last
    row = stage_ptr + base
    nib = tl.arange(0, 16)
    for sub in tl.static_range(2):
        dig = (word >> (LOG_BLOCK + 4 * sub)) & 15
        onehot = (dig[:, None] == nib[None, :]).to(tl.int32)
        rank = tl.reduce(tl.associative_scan(onehot, 0, ADD) * onehot, 1, ADD) - 1
        cnt = tl.reduce(onehot, 0, ADD)
        start = tl.reduce(onehot * (tl.associative_scan(cnt, 0, ADD) - cnt)[None, :], 1, ADD)
        tl.debug_barrier()
        tl.store(row + start + rank, word)
        tl.debug_barrier()
        word = tl.load(row + lane)
    sd = word >> LOG_BLOCK
    si = word & (BLOCK - 1)
    valid = lane < tl.minimum(n - base, BLOCK)
    dst_base = tl.load(base_ptr + tile.to(tl.int64) * 256 + sd, mask=valid, other=0)
    dst = dst_base.to(tl.int64) + lane
    ks = tl.load(keys_in + base + si, mask=valid)
    tl.store(keys_out + dst, ks, mask=valid)
    ix = tl.load(idx_in + base + si, mask=valid)
    tl.store(idx_out + dst, ix, mask=valid)


def _check_n(n: int, op: str = "sort"):
    if n > MAX_TRITON_KEYS:
        raise ValueError(f"pykernels.{op}: the triton backend sorts at most 2^31 - 1 keys per call (32-bit "
                         f"indices), got {n}; use backend='cuda' (chunks larger inputs) or 'cpu'")


@launches_on_input_device
def radix_sort_encoded(enc: torch.Tensor, idx: torch.Tensor, begin_bit: int, end_bit: int, block: int = 0):
    """Stable LSD sort of encoded keys `enc` (int32/int64 bit patterns) carrying int32 `idx`, on bits
    [begin_bit, end_bit). Returns (keys, idx) sorted."""
    n = enc.numel()
    _check_n(n)
    block = block or _tile_keys()
    if n <= 1 or begin_bit >= end_bit:
        return enc.clone(), idx.clone()
    dev = enc.device
    shifts = list(range(begin_bit, end_bit, 8))
    masks = [(1 << min(8, end_bit - s)) - 1 for s in shifts]
    npass = len(shifts)
    hist = torch.zeros(npass * RADIX, dtype=torch.int32, device=dev)
    sh_t = torch.tensor(shifts, dtype=torch.int32, device=dev)
    mk_t = torch.tensor(masks, dtype=enc.dtype, device=dev)
    tiles = triton.cdiv(n, block)
    kernel(_hist_kernel)[(tiles,)](enc, hist, sh_t, mk_t, n, NPASS=npass, BLOCK=block)
    hist = hist.view(npass, RADIX).to(torch.int64)
    live = [p for p in range(npass) if int(hist[p].max()) != n]  # trivial passes skipped
    src_k, src_i = enc, idx
    tmp_k, tmp_i = torch.empty_like(enc), torch.empty_like(idx)
    out_k, out_i = torch.empty_like(enc), torch.empty_like(idx)
    status = torch.empty(tiles * RADIX, dtype=torch.int64, device=dev)
    scratch = torch.empty(tiles * RADIX, dtype=torch.int32, device=dev)
    stage = torch.empty(tiles * block, dtype=torch.int32, device=dev)
    counter = torch.empty(1, dtype=torch.int32, device=dev)
    for q, p in enumerate(live):
        goff = (torch.cumsum(hist[p], 0) - hist[p]).to(torch.int32)
        status.zero_()
        counter.zero_()
        dk, di = (out_k, out_i) if (len(live) - 1 - q) % 2 == 0 else (tmp_k, tmp_i)
        kernel(_bin_kernel)[(tiles,)](src_k, dk, src_i, di, status, counter, goff, scratch, stage, n, shifts[p], masks[p],
                              BLOCK=block, LOG_BLOCK=block.bit_length() - 1)
        src_k, src_i = dk, di
    if not live:
        return enc.clone(), idx.clone()
    return src_k, src_i


def _argsort_1d(x: torch.Tensor, descending: bool, begin_bit: int = 0, end_bit=None):
    enc, bits = encode(x.reshape(-1), descending)
    end = bits if end_bit is None else end_bit
    idx = torch.arange(enc.numel(), dtype=torch.int32, device=x.device)
    _, perm = radix_sort_encoded(enc, idx, begin_bit, end)
    return perm.to(torch.int64)


def sort_1d(keys: torch.Tensor, values, descending: bool, begin_bit: int, end_bit, op: str = "sort"):
    _check_n(keys.numel(), op)  # before the widened keys and indices are made (audit finding)
    perm = _argsort_1d(keys, descending, begin_bit, end_bit)
    return _take(keys, perm), (_take(values, perm) if values is not None else None)


def _by_segment(x: torch.Tensor, seg_id: torch.Tensor, nseg: int, descending: bool):
    """Stable sort by (segment, key): by key first, then stably by segment id."""
    perm = _argsort_1d(x, descending)
    seg_sorted = seg_id[perm].to(torch.int32)
    bits = max(1, int(nseg - 1).bit_length())
    idx = torch.arange(perm.numel(), dtype=torch.int32, device=x.device)
    _, p2 = radix_sort_encoded(seg_sorted.contiguous(), idx, 0, bits)
    return perm[p2.to(torch.int64)]


def sort_rows(x2d: torch.Tensor, descending: bool, want_keys: bool, op: str = "sort"):
    rows, n = x2d.shape
    _check_n(rows * n, op)
    flat = x2d.reshape(-1)
    if rows == 1:
        perm = _argsort_1d(flat, descending)
    else:
        seg = torch.arange(rows, device=x2d.device).repeat_interleave(n)
        perm = _by_segment(flat, seg, rows, descending)
    vals = _take(flat, perm) if want_keys else None
    starts = (perm // n) * n
    return vals, perm - starts


def segmented(keys: torch.Tensor, offsets: torch.Tensor, values, descending: bool):
    n = keys.numel()
    _check_n(n, "segmented_sort")
    off = offsets.to(device=keys.device, dtype=torch.int64)
    pos = torch.arange(n, device=keys.device)
    seg = torch.searchsorted(off, pos, right=True) - 1  # segment of each position (-1 / nseg: outside)
    nseg = off.numel() - 1
    seg = seg.clamp(-1, nseg) + 1  # outside keys form their own leading/trailing groups, order kept
    perm = _by_segment(keys, seg, nseg + 2, descending)
    inside = (pos >= off[0]) & (pos < off[-1])
    perm = torch.where(inside, perm, pos)
    return _take(keys, perm), (_take(values, perm) if values is not None else None)


# Configs the autotuner may pick on a GPU, compiled ahead of time for sm_90 by tests/test_gpu_build.py.
# BLOCK 2048/4096 binning tiles spill on sm_90 (measured with ptxas -v: 36 and ~1.6K bytes): pruned.
AOT_SPECS = []
for _kt, _block, _warps in (("*i32", 512, 4), ("*i32", 1024, 4), ("*i64", 1024, 4)):
    AOT_SPECS.append(AotSpec(
        name=f"sort.bin[{_kt[1:]},BLOCK={_block}]", fn=JITFunction(_bin_kernel),
        signature={"keys_in": _kt, "keys_out": _kt, "idx_in": "*i32", "idx_out": "*i32", "status_ptr": "*i64",
                   "counter_ptr": "*i32", "goff_ptr": "*i32", "base_ptr": "*i32", "stage_ptr": "*i32", "n": "i64",
                   "shift": "i32", "dmask": "i32" if _kt == "*i32" else "i64", "BLOCK": "constexpr",
                   "LOG_BLOCK": "constexpr"},
        constexprs={"BLOCK": _block, "LOG_BLOCK": _block.bit_length() - 1}, num_warps=_warps, num_stages=1))
for _kt in ("*i32", "*i64"):
    AOT_SPECS.append(AotSpec(
        name=f"sort.hist[{_kt[1:]},BLOCK=1024]", fn=JITFunction(_hist_kernel),
        signature={"keys_ptr": _kt, "hist_ptr": "*i32", "shifts_ptr": "*i32", "masks_ptr": _kt, "n": "i64",
                   "NPASS": "constexpr", "BLOCK": "constexpr"},
        constexprs={"NPASS": 4 if _kt == "*i32" else 8, "BLOCK": 1024}, num_warps=4, num_stages=1))
