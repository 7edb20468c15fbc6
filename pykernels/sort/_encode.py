"""Order-preserving key transforms for the GPU backends (torch ops, so they run on any device).

The same transform as the CPU backend (csrc/sort/sort_cpu.cpp): integers become unsigned by flipping the
sign bit; floats by flipping the sign bit of positives and every bit of negatives after canonicalising
NaN (one value, after +inf) and -0.0 (== +0.0), which is what makes stable indices match torch.sort.
Keys of up to 32 bits come out as int32 bit patterns, 64-bit keys as int64.
"""
from __future__ import annotations

import torch


def encode(x: torch.Tensor, descending: bool):
    """Order-preserving transform to unsigned bit patterns held in int32 (keys <= 32 bits) or int64.
    Returns (encoded, key_bits)."""
    dt = x.dtype
    if dt == torch.bool:
        e, bits = x.to(torch.int32), 8
    elif dt in (torch.uint8, torch.uint16):
        bits = 8 * x.element_size()
        e = x.to(torch.int32) if dt == torch.uint8 else x.view(torch.int16).to(torch.int32) & 0xFFFF
    elif dt in (torch.int8, torch.int16):
        bits = 8 * x.element_size()
        e = x.to(torch.int32) + (1 << (bits - 1))
    elif dt in (torch.int32, torch.uint32):
        bits = 32
        e = x.view(torch.int32) ^ (-(1 << 31)) if dt == torch.int32 else x.view(torch.int32).clone()
    elif dt in (torch.int64, torch.uint64):
        bits = 64
        e = x.view(torch.int64) ^ (-(1 << 63)) if dt == torch.int64 else x.view(torch.int64).clone()
    else:  # floats: canonical NaN after +inf, -0.0 == +0.0, then sign-magnitude to unsigned order
        bits = 8 * x.element_size()
        iv = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        wide = torch.int64 if bits == 64 else torch.int32
        u = x.view(iv).to(wide)
        if bits == 16:
            u = u & 0xFFFF
        qnan = {torch.float16: 0x7E00, torch.bfloat16: 0x7FC0, torch.float32: 0x7FC00000,
                torch.float64: 0x7FF8000000000000}[dt]
        sign = 1 << (bits - 1)
        if bits == 64:
            sign = -(1 << 63)
        elif bits == 32:
            sign = -(1 << 31)
        u = torch.where(torch.isnan(x), torch.tensor(qnan, dtype=wide, device=x.device), u)
        u = torch.where(x == 0, torch.zeros((), dtype=wide, device=x.device), u)
        neg = (u & sign) != 0
        allm = -1 if bits >= 32 else (1 << bits) - 1
        e = torch.where(neg, u ^ allm, u | sign)
    if descending:
        e = ~e if bits >= 32 else e ^ ((1 << bits) - 1)
    return e.contiguous(), bits


def take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    # gather through a same-width integer view (torch cannot index every unsigned dtype)
    if x.dtype in (torch.uint16, torch.uint32, torch.uint64, torch.bool):
        iv = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        return x.view(iv)[idx].view(x.dtype)
    return x[idx]


