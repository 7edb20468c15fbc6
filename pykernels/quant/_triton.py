"""Triton kernels of qmatmul.

1. `_wo_kernel` — weight-only, Marlin-style: the packed codes (the same tile layout the CPU kernel
   reads, made once by quantize) are loaded as bytes and dequantized in registers
   (w = s * u + m, the group's scale/offset loaded once per K step), multiplied by tl.dot with fp32
   accumulation; for small M the K loop is split over SPLIT_K programs (Marlin's striped split) whose
   partial sums meet through fp32 atomics.
2. `_bs_kernel` — bit-serial bipolar-INT (act_bits): activations are quantized per token and packed
   into bit planes (torch ops, on device), each (i, j) pair of planes contributes
   popcount(a_i AND w_j) << (i + j) (an integer SWAR popcount on 32-bit halves, which also runs under
   the interpreter), and the affine recombination of ALGORITHMS.md turns the integer sums into floats.

The kernels are plain functions wrapped when used (triton.jit decides interpreter vs compiler when a
function is decorated, and the tests switch TRITON_INTERPRET=1 on after import); AOT_SPECS lists the
configs that tests/test_gpu_build.py compiles for sm_90.
"""
from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from .._triton_util import kernel as _kernel, launches_on_input_device
from ..triton_aot import AotSpec
from . import _format as F


def _wo_kernel(X, W, S, O, Bias, Y, M, N, K, G, GSIZE, NB, stride_xm,
               LB: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, UPCAST: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    tl.static_assert(BLOCK_N % 4 == 0)  # whole row tiles per block: the weight base below counts tiles
    # The block's first row/tile moves each base pointer in 64 bits; offsets inside the block stay 32-bit
    # (_check_sizes bounds them). Triton types these indices int32, so a whole row * N + col wrapped past
    # 2^31 (audit: a W4 LM head, N = 128256, from 16744 tokens on stored rows 8 GiB before the output);
    # all-int64 index tensors spilled registers in the larger tiles.
    m0 = pid_m * BLOCK_M
    lm = tl.arange(0, BLOCK_M)
    ln = tl.arange(0, BLOCK_N)
    rm = m0 + lm
    rn = pid_n * BLOCK_N + ln
    mask_m = rm < M
    mask_n = rn < N
    lt = ln // 4  # the row tile within the block's BLOCK_N / 4 tiles
    row = ln % 4
    X = X + m0.to(tl.int64) * stride_xm
    W = W + (pid_n * (BLOCK_N // 4)).to(tl.int64) * NB * (4 * 4 * LB)  # a tile: NB blocks of 4 rows x 4*LB bytes
    Y = Y + m0.to(tl.int64) * N
    # tl.zeros / tl.cdiv are themselves jit functions, which the interpreter cannot call when triton was
    # imported before TRITON_INTERPRET=1 was set: core builtins (tl.full, //) only.
    acc = tl.full((BLOCK_M, BLOCK_N), 0, tl.float32)
    steps = (K + BLOCK_K - 1) // BLOCK_K
    per_split = (steps + SPLIT_K - 1) // SPLIT_K
    s0 = pid_k * per_split
    s1 = tl.minimum(steps, s0 + per_split)
    for step in range(s0, s1):
        k0 = step * BLOCK_K
        rk = k0 + tl.arange(0, BLOCK_K)
        mask_k = rk < K
        x = tl.load(X + lm[:, None] * stride_xm + rk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        blk = rk // 32
        j = rk % 32
        wmask = mask_k[:, None] & mask_n[None, :]
        if LB == 4:
            addr = ((lt[None, :] * NB + blk[:, None]) * 4 + row[None, :]) * 16 + (j % 16)[:, None]
            byte = tl.load(W + addr, mask=wmask, other=0).to(tl.int32)
            u = (byte >> ((j // 16) * 4)[:, None]) & 0xF
        else:
            addr = ((lt[None, :] * NB + blk[:, None]) * 4 + row[None, :]) * 32 + j[:, None]
            u = tl.load(W + addr, mask=wmask, other=0).to(tl.int32)
        g = k0 // GSIZE  # BLOCK_K divides the group size (or there is one group): one scale per step
        s = tl.load(S + rn * G + g, mask=mask_n, other=0.0)
        m = tl.load(O + rn * G + g, mask=mask_n, other=0.0)
        w = u.to(tl.float32) * s[None, :] + m[None, :]
        w = tl.where(wmask, w, 0.0)
        if X.dtype.element_ty == tl.float32:
            acc += tl.dot(x, w, input_precision="ieee")
        elif UPCAST:  # the interpreter's bf16 tl.dot is wrong (numpy has no bf16): same math in fp32
            acc += tl.dot(x.to(tl.float32), w.to(X.dtype.element_ty).to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(X.dtype.element_ty))
    if HAS_BIAS:
        b = tl.load(Bias + rn, mask=mask_n, other=0.0)
        # added once, by the first K split: a select, not a product with 0 (inf * 0 made an inf bias NaN
        # in every other split; review finding)
        acc += tl.where(pid_k == 0, b, 0.0)[None, :]
    ptrs = Y + lm[:, None] * N + rn[None, :]
    omask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, acc, mask=omask)
    else:
        tl.atomic_add(ptrs, acc, mask=omask)


def _bs_kernel(A, Wp, S, O, WS, US, SA, MA, Bias, Y, M, N, K, G, GSIZE, GW2, P, Q,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    tl.static_assert(BLOCK_N % 4 == 0)  # as in _wo_kernel
    m0 = pid_m * BLOCK_M
    lm = tl.arange(0, BLOCK_M)
    ln = tl.arange(0, BLOCK_N)
    rm = m0 + lm
    rn = pid_n * BLOCK_N + ln
    mask_m = rm < M
    mask_n = rn < N
    lt = ln // 4
    row = ln % 4
    # 64-bit block bases, 32-bit offsets inside the block (as in _wo_kernel)
    A = A + m0.to(tl.int64) * G * P * GW2
    Wp = Wp + (pid_n * (BLOCK_N // 4)).to(tl.int64) * G * Q * GW2 * 4
    Y = Y + m0.to(tl.int64) * N
    sa = tl.load(SA + rm, mask=mask_m, other=1.0)
    ma = tl.load(MA + rm, mask=mask_m, other=0.0)
    acc = tl.full((BLOCK_M, BLOCK_N), 0, tl.float32)
    for g in range(G):
        # int64: a group's sum reaches (2^p - 1)(2^q - 1) * GSIZE, past 2^31 at 8 x 8 bits from K = 33k
        isum = tl.full((BLOCK_M, BLOCK_N), 0, tl.int64)
        for i in range(P):
            for jb in range(Q):
                cnt = tl.full((BLOCK_M, BLOCK_N), 0, tl.int32)
                for w in range(GW2):
                    a = tl.load(A + ((lm * G + g) * P + i) * GW2 + w, mask=mask_m, other=0).to(tl.uint32, bitcast=True)
                    waddr = ((((lt * G + g) * Q + jb) * (GW2 // 2) + w // 2) * 4 + row) * 2 + w % 2
                    wv = tl.load(Wp + waddr, mask=mask_n, other=0).to(tl.uint32, bitcast=True)
                    v = a[:, None] & wv[None, :]
                    # SWAR popcount of uint32 lanes (Hacker's Delight 5-2)
                    v = v - ((v >> 1) & 0x55555555)
                    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
                    v = (v + (v >> 4)) & 0x0F0F0F0F
                    cnt += ((v * 0x01010101) >> 24).to(tl.int32)
                isum += cnt.to(tl.int64) << (i + jb)
        length = (tl.minimum(K, (g + 1) * GSIZE) - g * GSIZE).to(tl.float32)
        s = tl.load(S + rn * G + g, mask=mask_n, other=0.0)
        m = tl.load(O + rn * G + g, mask=mask_n, other=0.0)
        uw = tl.load(WS + rn * G + g, mask=mask_n, other=0).to(tl.float32)
        ua = tl.load(US + rm * G + g, mask=mask_m, other=0).to(tl.float32)
        # sum_k A W = sa*s*I + sa*m*sum(u_a) + ma*s*sum(u_w) + ma*m*len   (A = sa*u_a + ma, W = s*u_w + m),
        # sa and ma factored out: (sa * u_a) alone overflowed for activations near FLT_MAX (audit finding)
        acc += sa[:, None] * (s[None, :] * isum.to(tl.float32) + ua[:, None] * m[None, :]) \
            + ma[:, None] * (s * uw + m * length)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=mask_n, other=0.0)[None, :]
    tl.store(Y + lm[:, None] * N + rn[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])


# ------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------
# _kernel(fn): pykernels/_triton_util.kernel (interpreted under TRITON_INTERPRET=1, else compiled).


def default_config(M: int, N: int, K: int, dtype=torch.float16) -> dict:
    """Heuristic: split K for small M so that every SM has work (Marlin's striped partition). Only
    tiles listed in AOT_SPECS (compiled for sm_90 without spills) are chosen."""
    block_m = 16 if M <= 16 else (32 if M <= 64 else 64)
    block_n = 64 if M <= 16 else 128
    if dtype == torch.float32:
        block_m, block_n = 16, 64
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    split = 1
    while tiles * split < 132 and split < 8 and K // (32 * split * 2) >= 4:
        split *= 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 32, "SPLIT_K": split, "num_warps": 4, "num_stages": 3}


def _act_planes(x2: torch.Tensor, p: int, group_size: int):
    """Per-token p-bit activation quantization (A = sa * u + ma, sa and ma fitted: F.act_fit) and bit planes
    [M, G, p, 2*gw] int32."""
    M, K = x2.shape
    gsize, G, gw = F.plane_geometry(K, group_size)
    xf = x2.to(torch.float64)
    bad = ~torch.isfinite(xf).all(1)
    sa, ma = F.act_fit(torch.where(bad[:, None], torch.zeros_like(xf), xf), p)  # (the CPU's rows: finite)
    u = torch.round(torch.clamp((xf - ma[:, None]) / sa[:, None], 0, (1 << p) - 1)).to(torch.int32)
    up = torch.zeros(M, G * gsize, dtype=torch.int32, device=x2.device)
    up[:, :K] = u
    up = up.reshape(M, G, gsize)
    usum = up.sum(-1, dtype=torch.int32)
    if gw * 64 != gsize:
        up = torch.cat([up, torch.zeros(M, G, gw * 64 - gsize, dtype=torch.int32, device=x2.device)], -1)
    weights = (1 << torch.arange(31, dtype=torch.int64, device=x2.device))
    planes = []
    for i in range(p):
        b = ((up >> i) & 1).to(torch.int64).reshape(M, G, gw * 2, 32)
        lowbits = (b[..., :31] * weights).sum(-1)
        word = lowbits - (b[..., 31] << 31)  # the top bit is the int32 sign bit
        planes.append(word.to(torch.int32))
    sa = torch.where(bad, torch.full_like(sa, float("nan")), sa)
    return torch.stack(planes, 2).contiguous(), usum.contiguous(), sa.to(torch.float32), ma.to(torch.float32)


def _check_spans(M: int, N: int, K: int, **spans: int):
    """The kernels move each base pointer by the block's first row/tile in 64 bits and index inside a
    block in 32 bits (and the scales by n * G + g, the token sums by m * G + g): each such span (the
    largest offset + 1) must fit."""
    too_big = [name for name, span in spans.items() if span >= 2 ** 31]
    if too_big:
        raise ValueError(f"pykernels.qmatmul: backend 'triton' indexes inside a block in 32 bits; M={M}, N={N}, "
                         f"K={K} exceed it ({', '.join(too_big)}): use backend='cuda' or 'cpu'")


# Whether a weight's dequantized values s * u + m (codes u in [0, 2^bits - 1]) pass float16's 65504, per
# scales tensor: id -> (weakref to it, weakref to the offsets, (both storages and versions, bits), the
# answer). Both tensors are held by weakref and compared by identity: a freed tensor's id and memory are
# reused, version 0 again (an offsets tensor matched by id, address and version got a freed one's answer;
# review finding). An entry goes when its scales tensor is freed (the weakref's callback), so the dict
# holds the live weights only. (It was cleared whole at 1024 entries: a model of more quantized layers
# than that, e.g. an MoE's experts, missed on every call, one reduction and one host-device sync each.)
_F16_RANGE: dict = {}
_F16_MAX = 65504.0


def _f16_forget(key: int):
    def drop(ref):
        entry = _F16_RANGE.get(key)
        if entry is not None and entry[0] is ref:  # not a newer entry of a reused id
            _F16_RANGE.pop(key, None)  # (pop: another thread may have dropped it between the two lines)
    return drop


def _past_float16(scales: torch.Tensor, offsets: torch.Tensor, bits: int) -> bool:
    """True when some dequantized weight exceeds float16's range: the weight-only kernel rounds the weights
    to x's dtype for tl.dot, where they would be inf (and inf - inf NaN rows; review finding), so fp16
    activations then take the fp32 kernel. One reduction per weight, remembered while it is unchanged: the
    same tensors, storage and version counters (writes that bypass autograd's version counter, through
    .data or a numpy / DLPack view, are not seen: quantize again, or change them in place as tensors)."""
    key = id(scales)
    hit = _F16_RANGE.get(key)
    state = (scales.data_ptr(), offsets.data_ptr(), scales._version, offsets._version, bits)
    mine = hit is not None and hit[0]() is scales
    if mine and hit[1]() is offsets and hit[2] == state:
        return hit[3]
    qmax = float((1 << bits) - 1)
    past = scales.numel() > 0 and bool(torch.maximum(offsets.abs(), (offsets + scales * qmax).abs()).max() > _F16_MAX)
    _F16_RANGE[key] = (hit[0] if mine else weakref.ref(scales, _f16_forget(key)), weakref.ref(offsets), state, past)
    return past


@launches_on_input_device
def qmatmul(x2, packed, scales, offsets, planes, wsum, bias, N, K, bits, group_size, act_bits, cfg):
    M = x2.shape[0]
    gsize, G = F.group_geometry(K, group_size)
    y = torch.zeros(M, N, dtype=torch.float32, device=x2.device)
    b = bias.to(torch.float32).contiguous() if bias is not None else y
    if act_bits:
        a_planes, usum, sa, ma = _act_planes(x2, act_bits, group_size)
        _, _, gw = F.plane_geometry(K, group_size)
        bm, bn = int(cfg.get("BLOCK_M", 16)), int(cfg.get("BLOCK_N", 32))
        grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
        _check_spans(M, N, K, y_block=(bm + 1) * N, scales=N * G, token_sums=M * G,
                     act_block=(bm + 1) * a_planes[:1].numel(), weight_tile=(bn // 4 + 1) * G * bits * 8 * gw)
        _kernel(_bs_kernel)[grid](a_planes, planes.view(torch.int32), scales, offsets, wsum, usum, sa, ma, b, y,
                                  M, N, K, G, gsize, 2 * gw, act_bits, bits, HAS_BIAS=bias is not None,
                                  BLOCK_M=bm, BLOCK_N=bn)
        return y.to(x2.dtype)
    out_dtype = x2.dtype
    if x2.dtype == torch.float16 and _past_float16(scales, offsets, bits):
        x2, cfg = x2.float(), {}  # (the fp32 kernel's own default tiles: fp16's tuned ones may not fit it)
    c = dict(default_config(M, N, K, x2.dtype))
    c.update({k: v for k, v in cfg.items() if k in c})
    if torch.are_deterministic_algorithms_enabled():
        c["SPLIT_K"] = 1  # split-K partial sums meet through fp32 atomics, in no fixed order (review finding)
    bk = c["BLOCK_K"]
    if G > 1 and gsize % bk:
        bk = 32
    NB = F.round_up(max(K, 1), F.K_BLOCK) // F.K_BLOCK
    _check_spans(M, N, K, y_block=(c["BLOCK_M"] + 1) * N, x_block=(c["BLOCK_M"] + 1) * max(x2.stride(0), K),
                 scales=N * G, weight_tile=(c["BLOCK_N"] // 4 + 1) * NB * 128)
    grid = (triton.cdiv(M, c["BLOCK_M"]), triton.cdiv(N, c["BLOCK_N"]), c["SPLIT_K"])
    kw = {} if x2.device.type == "cpu" else {"num_warps": c["num_warps"], "num_stages": c["num_stages"]}
    _kernel(_wo_kernel)[grid](x2, packed, scales, offsets, b, y, M, N, K, G, gsize, NB, x2.stride(0),
                              LB=F.layout_bits(bits), HAS_BIAS=bias is not None, SPLIT_K=c["SPLIT_K"],
                              UPCAST=x2.device.type == "cpu" and x2.dtype == torch.bfloat16,
                              BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=bk, **kw)
    return y.to(out_dtype)


# ------------------------------------------------------------------------------------------------
# Ahead-of-time configs (tests/test_gpu_build.py compiles each for sm_90 and rejects spills)
# ------------------------------------------------------------------------------------------------
def _aot_specs():
    from triton.runtime.jit import JITFunction

    wo, bs = JITFunction(_wo_kernel), JITFunction(_bs_kernel)
    specs = []
    half_tiles = ((16, 64, 32, 4), (16, 64, 64, 1), (32, 128, 32, 2), (64, 128, 32, 1))
    f32_tiles = ((16, 64, 32, 4), (16, 64, 32, 1))  # ieee fp32 dots spill beyond 16x64x32 at 4 warps
    for act in ("fp16", "bf16", "fp32"):
        for bm, bn, bk, split in (f32_tiles if act == "fp32" else half_tiles):
            for lb in (4, 8):
                sig = {"X": f"*{act}", "W": "*u8", "S": "*fp32", "O": "*fp32", "Bias": "*fp32", "Y": "*fp32",
                       "M": "i32", "N": "i32", "K": "i32", "G": "i32", "GSIZE": "i32", "NB": "i32", "stride_xm": "i32",
                       "LB": "constexpr", "HAS_BIAS": "constexpr", "SPLIT_K": "constexpr", "UPCAST": "constexpr", "BLOCK_M": "constexpr",
                       "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
                const = {"LB": lb, "HAS_BIAS": True, "SPLIT_K": split, "UPCAST": False, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
                specs.append(AotSpec(f"qgemm.wo[{act},LB={lb}]", wo, sig, const, num_warps=4, num_stages=3))
    for bm, bn in ((16, 32), (32, 64)):
        sig = {"A": "*i32", "Wp": "*i32", "S": "*fp32", "O": "*fp32", "WS": "*i32", "US": "*i32", "SA": "*fp32",
               "MA": "*fp32", "Bias": "*fp32", "Y": "*fp32", "M": "i32", "N": "i32", "K": "i32", "G": "i32",
               "GSIZE": "i32", "GW2": "i32", "P": "i32", "Q": "i32", "HAS_BIAS": "constexpr", "BLOCK_M": "constexpr",
               "BLOCK_N": "constexpr"}
        specs.append(AotSpec("qgemm.bitserial", bs, sig, {"HAS_BIAS": True, "BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4))
    return specs


AOT_SPECS = _aot_specs()
