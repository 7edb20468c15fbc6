"""The CUDA/HIP backend of the sort family: csrc/sort/sort.cu (Onesweep) through pykernels._cuda_sort.

The kernels sort unsigned 32/64-bit keys ascending on a bit range, carrying a 4- or 8-byte payload.
uint32/uint64 keys sorted ascending go straight in (keys only, or with their payload): the fast path
benchmarked against torch.sort/CUB. Every other case encodes the keys with the order-preserving
transform (pykernels/sort/_encode.py), sorts (encoded key, int32 index) pairs and gathers the outputs
through the index, so keys come back with their exact input bits. Rows and segments sort by
(segment, key): a stable sort by key, then a stable sort of the segment ids on just their bits.
"""
from __future__ import annotations

import torch

from .. import _native
from ._encode import encode, take


def _mod():
    return _native.cuda_module("sort")


def _onesweep(keys: torch.Tensor, vals, begin_bit: int, end_bit: int):
    """keys: contiguous 4/8-byte tensor of unsigned bit patterns; vals: None or a 4/8-byte tensor."""
    m = _mod()
    n = keys.numel()
    kb = keys.element_size()
    vb = vals.element_size() if vals is not None else 0
    out_k = torch.empty_like(keys)
    out_v = torch.empty_like(vals) if vals is not None else None
    if n == 0:
        return out_k, out_v
    tmp = torch.empty(m.temp_bytes(n, kb, vb, begin_bit, end_bit), dtype=torch.uint8, device=keys.device)
    m.onesweep(keys.data_ptr(), out_k.data_ptr(), vals.data_ptr() if vals is not None else 0,
               out_v.data_ptr() if vals is not None else 0, n, kb, vb, begin_bit, end_bit, tmp.data_ptr(),
               tmp.numel(), _native.cuda_stream_handle(keys.device))
    return out_k, out_v


def _argsort(x: torch.Tensor, descending: bool, begin_bit: int = 0, end_bit=None) -> torch.Tensor:
    enc, bits = encode(x.reshape(-1), descending)
    if enc.numel() >= (1 << 31):
        idx = torch.arange(enc.numel(), dtype=torch.int64, device=x.device)
    else:
        idx = torch.arange(enc.numel(), dtype=torch.int32, device=x.device)
    _, perm = _onesweep(enc, idx, begin_bit, bits if end_bit is None else end_bit)
    return perm.to(torch.int64)


def sort_1d(keys: torch.Tensor, values, descending: bool, begin_bit: int, end_bit):
    bits = 8 * keys.element_size()
    end = bits if end_bit is None else end_bit
    direct = keys.dtype in (torch.uint32, torch.uint64) and not descending and \
        (values is None or values.element_size() in (4, 8))
    if direct:
        iv = torch.int32 if keys.element_size() == 4 else torch.int64
        vv = None
        if values is not None:
            vv = values.view(torch.int32 if values.element_size() == 4 else torch.int64)
        k, v = _onesweep(keys.view(iv), vv, begin_bit, end)
        return k.view(keys.dtype), (v.view(values.dtype) if values is not None else None)
    perm = _argsort(keys, descending, begin_bit, end_bit)
    return take(keys, perm), (take(values, perm) if values is not None else None)


def _by_segment(x: torch.Tensor, seg_id: torch.Tensor, nseg: int, descending: bool) -> torch.Tensor:
    perm = _argsort(x, descending)
    seg_sorted = seg_id[perm].to(torch.int32).contiguous()
    bits = max(1, int(nseg - 1).bit_length())
    _, p2 = _onesweep(seg_sorted, torch.arange(perm.numel(), dtype=torch.int32, device=x.device), 0, bits)
    return perm[p2.to(torch.int64)]


def sort_rows(x2d: torch.Tensor, descending: bool, want_keys: bool):
    rows, n = x2d.shape
    flat = x2d.reshape(-1)
    if rows == 1:
        perm = _argsort(flat, descending)
    else:
        perm = _by_segment(flat, torch.arange(rows, device=x2d.device).repeat_interleave(n), rows, descending)
    return (take(flat, perm) if want_keys else None), perm - (perm // n) * n


def segmented(keys: torch.Tensor, offsets: torch.Tensor, values, descending: bool):
    n = keys.numel()
    off = offsets.to(device=keys.device, dtype=torch.int64)
    pos = torch.arange(n, device=keys.device)
    nseg = off.numel() - 1
    seg = (torch.searchsorted(off, pos, right=True) - 1).clamp(-1, nseg) + 1
    perm = _by_segment(keys, seg, nseg + 2, descending)
    perm = torch.where((pos >= off[0]) & (pos < off[-1]), perm, pos)
    return take(keys, perm), (take(values, perm) if values is not None else None)
