"""CPU backend of flash_attention: five interchangeable implementations, chosen by the autotuner.

"flash"   - aten's CPU flash-attention kernels (`_scaled_dot_product_flash_attention_for_cpu` and its
            `_backward`), which return the LSE and accept the global (out, lse) in the backward. Two of
            their properties do not match our contract, so this module wraps them:
              * their causal mask is top-left aligned when S_q != S_k, ours is bottom-right (flash-attn's):
                row i sees key j iff j <= i + (S_k - S_q). We never ask aten for a rectangular causal
                mask. With S_q < S_k we pass an explicit additive bottom-right mask (up to MASK_BYTES);
                for larger problems the keys split into a prefix [0, S_k - S_q) that every row sees
                (non-causal) and a square block where top-left == bottom-right; the two partial results
                are merged with the numerically stable LSE form (as in ring attention):
                    out = out_a - sigmoid(lse_b - lse_a) * (out_a - out_b)
                    lse = lse_a - logsigmoid(lse_a - lse_b)
                The backward of each part uses the *global* out and lse (P = exp(S - lse),
                D = rowsum(dO * O)), so the parts' dq add up and their dk/dv concatenate.
                With S_q > S_k the first S_q - S_k rows see no key at all; the rest form a square.
              * they accept fewer K/V heads without checking; `aten_handles_gqa()` probes once that they
                group heads as we do (torch 2.13 does, and sums dk/dv per group), else GQA/MQA heads are
                expanded explicitly and the expanded dk/dv reduced over each group.
"decode"  - csrc/attention/attention_cpu.cpp: flash-decoding for a few query rows against a long KV cache
            (decode steps, speculative verification): per (batch, KV head) every query row of the group in
            one pass over K and V (GQA reads the cache once, not once per query head), split over the keys
            when there are fewer than two groups per thread, bfloat16/float16 widened block by block into
            a scratch buffer. Forward only, and only for calls no backward can follow (see
            _forward_impl's `inference`); float32, bfloat16, float16.
"bf16dot" - csrc/attention/attention_cpu.cpp: FlashAttention-2's forward for bfloat16 inputs with AVX-512 BF16 dot
            products (vdpbf16ps, twice the fp32 FMA rate; aten's kernel computes bf16 at the fp32 rate), with
            aten's precision choices for reduced types (scores and softmax in fp32, P rounded to bf16 for
            P V, fp32 accumulation); K and V packed once per call into the instruction's operand order.
            Its backward (FlashAttention-2's, same dot products, P and dS rounded to bf16, one thread per
            (batch, KV head) group so dK/dV/dQ need no atomics; with fewer groups than threads, threads
            share a group's query blocks and their dK/dV are added up) takes an LSE gradient too. Head dims that
            are multiples of 64, on CPUs with AVX-512 BF16 (elsewhere aten's kernels). Forward and
            backward are tuned apart, so either may meet aten's other half: the two compute scores in
            fp32 in different orders, which differ in fp32's last bits, below what bfloat16 gradients
            resolve (against a float64 oracle at logits up to ~1e4: the same dq/dk/dv errors with either
            forward's lse).
"fma"     - csrc/attention/attention_cpu.cpp: FlashAttention-2's forward in fp32 FMAs, AVX2 (register tiles of
            6 query rows x 16 keys and 6 rows x 16 output columns) or, where the CPU has AVX-512 BF16 as
            bf16dot wants, AVX-512 (6 rows x 64 keys, 6 rows x 64 columns), float32 inputs and bfloat16 /
            float16 ones widened as K and V are packed once per call; everything in fp32 (P too). Head dims that are
            multiples of 16 (up to 512). Its backward is FlashAttention-2's in fp32 on the same score tiles, on
            either tier: one thread per (batch, KV head) group, or a group's (head, query block) pairs split
            over threads; gradients rounded once to the inputs' dtype; it takes an LSE gradient.
"blocked" - FlashAttention's tiling done with BLAS: the query rows are cut into chunks; per chunk the
            scores against the (causally) visible keys are one batched GEMM, a masked softmax in fp32 (or
            fp64), and one GEMM with V. GQA is a reshape (the query heads of a group share one GEMM), the
            causal mask is bottom-right by construction, and keys no row of the chunk can see are not
            touched. The backward recomputes P from the saved LSE and uses D = rowsum(dO * O) - dlse, so
            a gradient flowing into the LSE output (ring-attention merges) is exact.

Rows that see no key (causal with S_q > S_k, or S_k == 0): output 0 and lse -inf, and no gradient.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from .. import _native

_ATEN_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_ATEN_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation (and LSE) dtype: float64 inputs stay float64, every other dtype computes in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _acc(lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """lse in the accumulation dtype of `dtype` inputs (no call when it already is: ~2 us a .to())."""
    acc = acc_dtype(dtype)
    return lse if lse.dtype == acc else lse.to(acc)


def to_bshd(x: torch.Tensor) -> torch.Tensor:
    """x ([B, H, S, D] or [B, H, S]) laid out in memory as [B, S, H, (D)]: the layout in which aten's CPU
    flash kernels write the LSE, so the CPU backend returns it without a copy. No-op when x is already
    laid out so."""
    if x.dim() == 4:  # the strides of that layout, without allocating to compare
        _, H, S, D = x.shape
        st = (S * H * D, D, H * D, 1)
    else:
        _, H, S = x.shape
        st = (H * S, 1, H)
    if x.stride() == st:
        return x
    return torch.empty_strided(x.shape, st, dtype=x.dtype, device=x.device).copy_(x)


def out_strides(q: torch.Tensor, dv: int) -> tuple:
    """Strides of out [B, H, S_q, dv] in q's memory order, D innermost: what aten's CPU flash kernels
    return (empty_like(q)), so neither a contiguous q nor one laid out as [B, S, H, D] (a model's
    usual q = x.view(B, S, H, D).transpose(1, 2)) costs a copy of out. Also the fake op's strides."""
    B, H, Sq, _ = q.shape
    s0, s1, s2, _ = q.stride()
    if s0 >= s1 >= s2:  # q's dims outermost first in their order (a contiguous q): what the sort below gives
        return (H * Sq * dv, Sq * dv, dv, 1)
    shape = (B, H, Sq, dv)
    order = sorted(range(3), key=lambda d: (-q.stride(d), d)) + [3]  # outermost first, ties by dim
    st, acc = [0] * 4, 1
    for d in reversed(order):
        st[d] = acc
        acc *= shape[d]
    return tuple(st)


def like_q(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """out laid out as out_strides(q, ...): a no-op for what aten returned, a copy otherwise."""
    want = out_strides(q, out.shape[-1])
    if out.stride() == want:
        return out
    return torch.empty_strided(out.shape, want, dtype=out.dtype, device=out.device).copy_(out)


def lse_flags(lse: torch.Tensor, first_row: int) -> tuple:
    """(some value is NaN/inf, some value is exactly 0) over lse[:, :, first_row:], as flash_forward's
    callers check it after aten's kernel. One native call where those rows are the whole of a dense lse
    (aten writes it [B, S, H] in memory: the common case), else numpy; numpy's ~5 calls (and .numpy()),
    right after the kernel with the interpreter's data out of the caches, cost ~25 us of a ~150 us
    decode step (q of one token against 128 keys)."""
    if first_row == 0 and lse.dtype in (torch.float32, torch.float64) and (
            lse.is_contiguous() or lse.transpose(1, 2).is_contiguous()):
        flags = _native.cpu_module("runtime").float_flags(lse.data_ptr(), lse.numel(), lse.dtype == torch.float64)
        return bool(flags & 1), bool(flags & 2)
    live = lse.detach()[:, :, first_row:].numpy()
    return not np.isfinite(live.sum()), bool((live == 0).any())


def _dense_last(x: torch.Tensor) -> torch.Tensor:
    """aten's kernels take any strides with a unit-stride head dim, as long as rows do not overlap (they
    size out with empty_like(q) but write it as if the head dim were dense): copy only otherwise."""
    if x.is_contiguous():  # the common case, without the per-dimension walk below
        return x
    st, sh = x.stride(), x.shape
    if len(st) == 4:  # (a decode step's slice of a KV cache: the walk below took ~1.9 us a tensor, this ~0.4)
        d = sh[3]
        rows_apart = ((sh[0] == 1 or st[0] >= d) and (sh[1] == 1 or st[1] >= d) and (sh[2] == 1 or st[2] >= d))
    else:
        rows_apart = all(sh[i] == 1 or st[i] >= sh[-1] for i in range(len(st) - 1))
    return x if st[-1] == 1 and rows_apart else x.contiguous()


def _empty_result(q, v, sk):
    B, H, Sq, _ = q.shape
    out = q.new_zeros((B, H, Sq, v.shape[-1]))
    lse = torch.full((B, H, Sq), float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)
    return out, lse


# ----------------------------------------------------------------------------------------------
# "flash": aten's CPU flash kernels, wrapped
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def aten_handles_gqa() -> bool:
    """Whether this torch's CPU flash kernels read KV head h // (H // Hkv) for query head h (and sum dk/dv
    over each group) when given fewer K/V heads. torch 2.13 does; the kernels do not check the head
    counts, so rather than trust a version number this is probed once on a tiny case against explicit
    expansion. If it ever fails, the heads are expanded (a copy of K/V per call)."""
    g = torch.Generator().manual_seed(0)
    q, do = torch.randn(1, 4, 5, 8, generator=g), torch.randn(1, 4, 5, 8, generator=g)
    k, v = torch.randn(1, 2, 7, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g)
    try:
        o, lse = _ATEN_FWD(q, k, v, 0.0, True, scale=0.3)
        got = _ATEN_BWD(do, q, k, v, o, lse, 0.0, True, scale=0.3)
    except RuntimeError:
        return False
    ke, ve = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    o2, lse2 = _ATEN_FWD(q, ke, ve, 0.0, True, scale=0.3)
    dq2, dk2, dv2 = _ATEN_BWD(do, q, ke, ve, o2, lse2, 0.0, True, scale=0.3)
    want = (o2, lse2, dq2, dk2.view(1, 2, 2, 7, 8).sum(2), dv2.view(1, 2, 2, 7, 8).sum(2))
    return all(a.shape == b.shape and torch.allclose(a, b, atol=1e-5) for a, b in zip((o, lse, *got), want))


def _expand_kv(x, groups):
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce_kv(dx, groups):
    if groups == 1:
        return dx
    B, H, S, D = dx.shape
    return dx.view(B, H // groups, groups, S, D).sum(2, dtype=acc_dtype(dx.dtype)).to(dx.dtype)


def _merge(out_a, lse_a, out_b, lse_b, out_dtype):
    """Stable merge of two partial attentions of the same queries (fp32/fp64)."""
    acc = lse_a.dtype
    w = torch.sigmoid(lse_b - lse_a).unsqueeze(-1)
    oa = out_a.to(acc)
    out = oa - w * (oa - out_b.to(acc))
    lse = lse_a - F.logsigmoid(lse_a - lse_b)
    return out.to(out_dtype), lse


# Largest additive mask (bytes) built for a rectangular bottom-right causal problem (S_q < S_k). Up to
# this size one masked aten call was 1.3-3x faster than the two-call split + merge here (2-core Zen 3,
# S_q = 64..1024, S_k = 1024..2048); beyond it the split keeps memory at O(S).
# The last few masks are kept (at most 4 x MASK_BYTES): repeated calls of one shape reuse them.
MASK_BYTES = 16 << 20


def _bottom_right_mask(Sq: int, Sk: int, dtype):
    """Additive [S_q, S_k] mask (0 where key j <= i + S_k - S_q, -inf elsewhere) in the query dtype, as
    aten's kernels require; None when it would exceed MASK_BYTES."""
    if Sq * Sk * torch.finfo(dtype).bits // 8 > MASK_BYTES:
        return None
    return _mask_cached(Sq, Sk, dtype)


PATCH_MAX_ROWS = 256  # rows patch_rows recomputes one by one; more: the caller recomputes the whole call


def patch_rows(q, k, v, causal: bool, scale: float, out, lse):
    """Recomputes exactly the rows of flash_forward's (out, lse) whose lse is exactly 0 or not finite, in
    place (the blocked path's arithmetic: scores in the accumulation dtype, masked after the product,
    softmax as exp(s - rowmax) / rowsum); returns False (nothing changed) when there are more than
    PATCH_MAX_ROWS of them. aten gives a row of -inf or NaN scores (NaN in q, -inf in k, fp32 scores that
    overflow) out 0 and lse 0 where the math gives lse -inf or NaN, and an inf score a NaN lse; an lse
    of exactly 0 is otherwise rare (a zero q or k row at a causal row 0), so recomputing just those rows
    keeps an ordinary call fast (recomputing the whole call on the blocked path took 8x as long; review
    finding). One product per (batch, KV head) holding such rows: [rows, D] x [D, S_k]."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    first = max(0, Sq - Sk) if causal else 0
    live = lse[:, :, first:]
    rows = torch.nonzero((live == 0) | ~torch.isfinite(live))
    if rows.shape[0] > PATCH_MAX_ROWS:
        return False
    if rows.shape[0] == 0:
        return True
    g = H // Hkv
    acc = acc_dtype(q.dtype)
    rows[:, 2] += first
    for b, hk in torch.unique(torch.stack([rows[:, 0], rows[:, 1] // g], 1), dim=0).tolist():
        sel = rows[(rows[:, 0] == b) & (rows[:, 1] // g == hk)]
        hs, ii = sel[:, 1], sel[:, 2]
        s = torch.matmul(q[b, hs, ii].to(acc), k[b, hk].to(acc).T) * scale        # [r, Sk]
        if causal:
            s = s.masked_fill(torch.arange(Sk).unsqueeze(0) > (ii + (Sk - Sq)).unsqueeze(1), float("-inf"))
        o, m = _attend(s, v[b, hk].to(acc))
        out[b, hs, ii] = o.to(out.dtype)
        lse[b, hs, ii] = m.to(lse.dtype)
    return True


@functools.lru_cache(maxsize=4)
def _mask_cached(Sq: int, Sk: int, dtype):
    # -inf strictly above the diagonal j - i = S_k - S_q, 0 on and below it (never written to by aten)
    return torch.full((Sq, Sk), float("-inf"), dtype=dtype).triu_(Sk - Sq + 1)


# float16 goes through aten's float32 kernels: their float16 path ran 1.4-2x slower forward and ~10x slower
# backward than float32 (2-core Zen 4, torch 2.13: 8 heads x S=1024 x D=64 causal, backward 254 ms in
# float16, 26 ms through float32; torch's float16 GEMM on that CPU runs at 0.4 GFLOP/s), and float32
# arithmetic is also the more accurate; the conversions are O(S D).
def flash_forward(q, k, v, causal: bool, scale: float):
    if q.dtype == torch.float16:
        out, lse = flash_forward(q.float(), k.float(), v.float(), causal, scale)
        return out.to(torch.float16), lse
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    if q.numel() == 0 or Sq == 0:
        return _empty_result(q, v, Sk)
    if Sk == 0:
        return _empty_result(q, v, Sk)
    g = 1 if aten_handles_gqa() else H // k.shape[1]
    if scale < 0:  # aten scales after masking, so -inf * negative scale = +inf: fold the sign into q
        q, scale = -q, -scale
    q = _dense_last(q)
    k = _expand_kv(_dense_last(k), g)
    v = _expand_kv(_dense_last(v), g)
    if Sq == 1:  # one query row (a decode step): bottom-right causal sees every key
        causal = False
    if not causal or Sq == Sk:
        out, lse = _ATEN_FWD(q, k, v, 0.0, causal, scale=scale)
        return out, _acc(lse, q.dtype)
    if Sq < Sk:
        mask = _bottom_right_mask(Sq, Sk, q.dtype)
        if mask is not None:
            out, lse = _ATEN_FWD(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
            return out, _acc(lse, q.dtype)
        off = Sk - Sq
        out_a, lse_a = _ATEN_FWD(q, k[:, :, :off], v[:, :, :off], 0.0, False, scale=scale)
        out_b, lse_b = _ATEN_FWD(q, k[:, :, off:], v[:, :, off:], 0.0, True, scale=scale)
        out, lse = _merge(out_a, lse_a.to(acc_dtype(q.dtype)), out_b, lse_b.to(acc_dtype(q.dtype)), q.dtype)
        # a part's lse of exactly 0 may be aten's answer for a row of -inf or NaN scores (out 0, lse 0),
        # which the merge would hide (two zeros merge to log 2): such rows are marked with an lse of
        # exactly 0, so the caller recomputes them exactly (patch_rows)
        suspect = (lse_a == 0) | (lse_b == 0)
        return out, lse.masked_fill_(suspect.to(lse.device), 0.0) if bool(suspect.any()) else lse
    # Sq > Sk: rows [0, Sq - Sk) see nothing; the last Sk rows form a square causal block.
    dead = Sq - Sk
    out, lse = _empty_result(q, v, Sk)
    o_live, l_live = _ATEN_FWD(q[:, :, dead:], k, v, 0.0, True, scale=scale)
    out[:, :, dead:] = o_live
    lse[:, :, dead:] = l_live.to(lse.dtype)
    return out, lse


def flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """dq, dk, dv with aten's CPU flash backward (no LSE gradient: see `blocked_backward`)."""
    if q.dtype == torch.float16 or (q.dtype == torch.bfloat16 and _native.IS_X86
                                    and not _native.torch_bf16_gemm_native()):
        # through float32, as flash_forward does float16. bfloat16 too where the CPU has no bf16 dot product
        # (AVX512-BF16): aten's bf16 backward ran 6-13x slower than this there (2-core Zen 2 EPYC, AVX2:
        # 8 heads x S=2048 x D=128 causal 1548 -> 202 ms, 16 heads over 1 KV head x S=1024 1718 -> 129 ms),
        # while its bf16 forward runs at the fp32 rate (kept). Products of the same bf16 values, fp32 P and
        # dS where aten rounds them to bf16: closer to the exact gradient. (x86 only: unmeasured elsewhere. An
        # expanded dout becomes a dense fp32 copy here.)
        dtype = q.dtype
        grads = flash_backward(dout.float(), q.float(), k.float(), v.float(), out.float(), lse, causal, scale)
        return tuple(g.to(dtype) for g in grads)
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if causal and Sq > Sk:
        # Only the last Sk rows see keys; the others have no gradient.
        dead = Sq - Sk
        dq_l, dk, dv = flash_backward(dout[:, :, dead:], q[:, :, dead:], k, v, out[:, :, dead:],
                                      lse[:, :, dead:], True, scale)
        dq = torch.zeros_like(q)
        dq[:, :, dead:] = dq_l
        return dq, dk, dv
    if scale < 0:  # see flash_forward: S = (-q) k^T |scale|, so dq changes sign
        dq, dk, dv = flash_backward(dout, -q, k, v, out, lse, causal, -scale)
        return -dq, dk, dv
    g = 1 if aten_handles_gqa() else H // Hkv
    aten_lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    # aten's backward reads q and out as if the head dim were dense and rows did not overlap (as its
    # forward does q, see _dense_last); dout it takes with any strides (an expanded one from .sum() too, so
    # no copy of it in a call that arrives in its own dtype); out and lse usually arrive in the [B, S, H]
    # layout they wrote.
    q, out = _dense_last(q), _dense_last(out)
    lse = lse.to(aten_lse_dtype)
    ke, ve = _expand_kv(k.contiguous(), g), _expand_kv(v.contiguous(), g)
    if not causal or Sq == Sk:
        dq, dke, dve = _ATEN_BWD(dout, q, ke, ve, out, lse, 0.0, causal, scale=scale)
        return dq, _reduce_kv(dke, g), _reduce_kv(dve, g)
    mask = _bottom_right_mask(Sq, Sk, q.dtype)
    if mask is not None:
        dq, dke, dve = _ATEN_BWD(dout, q, ke, ve, out, lse, 0.0, False, attn_mask=mask, scale=scale)
        return dq, _reduce_kv(dke, g), _reduce_kv(dve, g)
    off = Sk - Sq  # Sq < Sk: prefix every row sees + square causal block, both with the global out/lse
    dq_a, dk_a, dv_a = _ATEN_BWD(dout, q, ke[:, :, :off].contiguous(), ve[:, :, :off].contiguous(),
                                 out, lse, 0.0, False, scale=scale)
    dq_b, dk_b, dv_b = _ATEN_BWD(dout, q, ke[:, :, off:].contiguous(), ve[:, :, off:].contiguous(),
                                 out, lse, 0.0, True, scale=scale)
    acc = acc_dtype(q.dtype)
    dq = (dq_a.to(acc) + dq_b.to(acc)).to(q.dtype)
    dke, dve = torch.cat([dk_a, dk_b], 2), torch.cat([dv_a, dv_b], 2)
    return dq, _reduce_kv(dke, g), _reduce_kv(dve, g)


# ----------------------------------------------------------------------------------------------
# "blocked": FlashAttention tiling over query rows, each tile a batched BLAS GEMM
# ----------------------------------------------------------------------------------------------
def _chunk_rows(B, H, Sk, chunk_elems: int) -> int:
    """Query rows per chunk so that one chunk's score matrix holds about `chunk_elems` elements."""
    return max(16, chunk_elems // max(1, B * H * max(Sk, 1)))


def _visible(i0, i1, Sq, Sk, causal):
    """Keys [0, hi) that any of rows [i0, i1) can see (bottom-right causal), and the row offset."""
    if not causal:
        return Sk
    return max(0, min(Sk, i1 + Sk - Sq))


def _scores(qc, kc, i0, Sq, Sk, causal, scale):
    """Scaled scores of a row chunk [B, Hkv, g, c, n] in the accumulation dtype, masked bottom-right."""
    s = torch.matmul(qc, kc.transpose(-1, -2).unsqueeze(2)) * scale
    if causal:
        c, n = s.shape[-2], s.shape[-1]
        rows = torch.arange(i0, i0 + c).unsqueeze(1) + (Sk - Sq)
        cols = torch.arange(n).unsqueeze(0)
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


# multiply-adds per thread before the decode kernel takes a second thread: the default "grain" (measured
# in attention/_tuning.py, where the tuner's candidates are)
DECODE_GRAIN = 1 << 15
DECODE_MAX_SQ = 16    # query rows per head up to which "decode" is a candidate (its work is GEMV-shaped)
DECODE_MAX_ROWS = 64  # and rows per KV head's group ((H / Hkv) * S_q): its running state (64 x D floats) in L1/L2
DECODE_DTYPES = ("float32", "bfloat16", "float16")
DECODE_TORCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def decode_applies(key: dict) -> bool:
    """Whether "decode" is a candidate for an autotune key (problem_key) of the forward."""
    return (key["dtype"] in DECODE_DTYPES and key["sq"] <= DECODE_MAX_SQ
            and key["gqa"] * key["sq"] <= DECODE_MAX_ROWS)


def _native_forward(kernel: str, q, k, v, causal: bool, scale: float, *tail):
    """(out, lse, rows with a non-finite lse) of a native kernel of csrc/attention/attention_cpu.cpp; out in
    q's memory order and lse laid out as [B, S, H] (the layouts the op returns, so no copy follows where
    q's head dim is dense). `tail`: the kernel's own last arguments. (Few Python steps on purpose: it runs
    on every decode step, whose kernel takes ~13 us at 8 heads x 128 keys.)"""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if B * H * Sq * D == 0 or Sk == 0:
        out, lse = _empty_result(q, v, Sk)
        return like_q(out, q), to_bshd(lse), 0
    q, k, v = _dense_last(q), _dense_last(k), _dense_last(v)
    ost = out_strides(q, D)
    lst = (H * Sq, 1, H)
    out = torch.empty_strided((B, H, Sq, D), ost, dtype=q.dtype)
    lse = torch.empty_strided((B, H, Sq), lst, dtype=torch.float32)
    bad = getattr(_native.cpu_module("attention"), kernel)(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), B, H, Hkv, Sq, Sk, D,
        q.stride()[:3], k.stride()[:3], v.stride()[:3], ost[:3], lst, float(scale), bool(causal),
        _native.dtype_code(q.dtype), *tail)
    return out, lse, bad


def decode_forward(q, k, v, causal: bool, scale: float, threads: int, grain: int):
    """(out, lse) of the native decode kernel (layouts: _native_forward), or None when a row that sees
    keys got a non-finite lse (NaN/inf in q or k): the caller recomputes on the exact path. `grain`:
    multiply-adds per thread (a small step runs on fewer threads than `threads`)."""
    out, lse, bad = _native_forward("decode_forward", q, k, v, causal, scale, int(threads), int(grain))
    return None if bad else (out, lse)


# "bf16dot": head dims the kernel takes (its P V tile is 64 columns wide)
BF16DOT_MAX_D = 512
# the native bf16dot kernels' answers besides a count of bad rows; _TINY_INPUT: an input holds a nonzero value
# below 2^-50 or |scale| * D > 2^80, whose terms vdpbf16ps would flush to 0 (csrc: tiny_bf16, kMaxScaledD)
_NOT_APPLICABLE, _TINY_INPUT = -1, -2


@functools.lru_cache(maxsize=None)
def bf16dot_available() -> bool:
    """Whether this CPU runs the bf16dot kernel (AVX-512 BF16; PYKERNELS_DISABLE_AVX512=1 turns it off)."""
    return bool(_native.cpu_module("attention").prefill_available())


def _bf16dot_ok(bf16: bool, d: int) -> bool:
    # (csrc/attention/attention_cpu.cpp's prefill_head_dim_ok: the kernels' P V tile is 64 columns wide)
    return bf16 and d % 64 == 0 and d <= BF16DOT_MAX_D and bf16dot_available()


def bf16dot_applies(key: dict) -> bool:
    """Whether "bf16dot" is a candidate for an autotune key (problem_key), forward or backward."""
    return _bf16dot_ok(key["dtype"] == "bfloat16", key["d"])


def bf16dot_takes(q: torch.Tensor) -> bool:
    """bf16dot_applies for the tensors of a call."""
    return _bf16dot_ok(q.dtype == torch.bfloat16, q.shape[-1])


def bf16dot_forward(q, k, v, causal: bool, scale: float, threads: int):
    """(out, lse) of the native bf16dot kernel (layouts: _native_forward), or None when a row that sees
    keys got a non-finite lse (NaN/inf in q or k), an input holds a tiny value or the scale is too large
    (_TINY_INPUT): the caller recomputes on the exact path. The caller checks bf16dot_takes(q) first."""
    out, lse, bad = _native_forward("prefill_forward", q, k, v, causal, scale, int(threads))
    if bad == _NOT_APPLICABLE:  # (bf16dot_takes said yes: only a CPU or build without the kernel gets here)
        raise RuntimeError("pykernels.flash_attention: internal error: the bf16dot kernel does not take this call")
    return None if bad else (out, lse)  # (_TINY_INPUT counts as bad)


# "fma": head dims the kernel takes (its P V tile is 16 columns wide; its scratch rows up to 512)
FMA_MAX_D = 512
_FMA_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.lru_cache(maxsize=None)
def fma_available() -> bool:
    """Whether this CPU runs the fma kernel (AVX2 + FMA, as the native module saw the CPU and the
    PYKERNELS_DISABLE_AVX2 switch at its first check)."""
    return bool(_native.cpu_module("attention").fma_available())


def _fma_ok(dtype: torch.dtype, d: int) -> bool:
    # (csrc/attention/attention_cpu.cpp's fma_head_dim_ok)
    return dtype in _FMA_DTYPES.values() and d % 16 == 0 and 0 < d <= FMA_MAX_D and fma_available()


def fma_applies(key: dict) -> bool:
    """Whether "fma" is a candidate for an autotune key (problem_key) of the forward."""
    return _fma_ok(_FMA_DTYPES.get(key["dtype"]), key["d"])


def fma_takes(q: torch.Tensor) -> bool:
    """fma_applies for the tensors of a call."""
    return _fma_ok(q.dtype, q.shape[-1])


def fma_forward(q, k, v, causal: bool, scale: float, threads: int):
    """(out, lse) of the native fma kernel (layouts: _native_forward), or None when a row that sees keys got
    a non-finite lse (NaN/inf in q or k): the caller recomputes on the exact path. The caller checks
    fma_takes(q) first."""
    out, lse, bad = _native_forward("fma_forward", q, k, v, causal, scale, int(threads))
    if bad == _NOT_APPLICABLE:  # (fma_takes said yes: only a CPU or build without the kernel gets here)
        raise RuntimeError("pykernels.flash_attention: internal error: the fma kernel does not take this call")
    return None if bad else (out, lse)


def zero_grads(q, k, v):
    """Contiguous zero dq, dk, dv (the native and Triton backwards write them; rows no query sees stay 0)."""
    return tuple(torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def bf16dot_backward(dout, q, k, v, out, lse, causal: bool, scale: float, dlse, threads: int):
    """dq, dk, dv of the native bf16dot backward (FlashAttention-2's, with bf16 dot products) from the global
    out and lse; dlse (optional) enters as D = rowsum(dO * O) - dlse. None where an input holds a tiny value
    or the scale is too large (_TINY_INPUT): the caller takes an exact path. The caller checks bf16dot_takes(q) and
    that dout, out and the lse of rows that see keys are finite."""
    return _native_backward("prefill_backward", "bf16dot", dout, q, k, v, out, lse, causal, scale, dlse, threads)


def fma_backward(dout, q, k, v, out, lse, causal: bool, scale: float, dlse, threads: int):
    """dq, dk, dv of the native fma backward (FlashAttention-2's in fp32, on the fma kernel's tiers and score
    tiles) from the global out and lse; dlse (optional) enters as D = rowsum(dO * O) - dlse. The
    caller checks fma_takes(q) (the forward's and the backward's calls are the same) and that dout, out and the
    lse of rows that see keys are finite."""
    return _native_backward("fma_backward", "fma", dout, q, k, v, out, lse, causal, scale, dlse, threads)


def _native_backward(name: str, impl: str, dout, q, k, v, out, lse, causal: bool, scale: float, dlse, threads: int):
    """The native backward `name` (of impl `impl`): zero gradients for empty problems; rows that see no key
    (causal, S_q > S_k) never reach the kernel."""
    Sq, Sk = q.shape[2], k.shape[2]
    if q.numel() == 0 or k.numel() == 0:
        return zero_grads(q, k, v)
    if causal and Sq > Sk:
        # the first Sq - Sk rows see no key: no gradient, and they never reach the kernel (a NaN in such a
        # row's q would meet p = 0 in dK += dS^T Q: review finding)
        dead = Sq - Sk
        grads = _native_backward_kernel(name, impl, dout[:, :, dead:], q[:, :, dead:], k, v, out[:, :, dead:],
                                        lse[:, :, dead:], True, scale, None if dlse is None else dlse[:, :, dead:],
                                        threads)
        if grads is None:
            return None
        dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
        dq[:, :, dead:] = grads[0]
        return dq, grads[1], grads[2]
    return _native_backward_kernel(name, impl, dout, q, k, v, out, lse, causal, scale, dlse, threads)


def _native_backward_kernel(name: str, impl: str, dout, q, k, v, out, lse, causal: bool, scale: float, dlse,
                            threads: int):
    """_native_backward for problems whose every query row sees keys."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    q, k, v, dout = _dense_last(q), _dense_last(k), _dense_last(v), _dense_last(dout)
    # (every element written by the kernel)
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    lse = lse.float()
    bad = getattr(_native.cpu_module("attention"), name)(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), lse.data_ptr(), delta.data_ptr(), dq.data_ptr(),
        dk.data_ptr(), dv.data_ptr(), B, H, Hkv, Sq, Sk, D, q.stride()[:3], k.stride()[:3], v.stride()[:3],
        dout.stride()[:3], lse.stride(), delta.stride(), dq.stride()[:3], dk.stride()[:3], dv.stride()[:3],
        float(scale), bool(causal), _native.dtype_code(q.dtype), int(threads))
    if bad == _NOT_APPLICABLE:  # (the caller's check said yes: only a CPU or build without the kernel gets here)
        raise RuntimeError(f"pykernels.flash_attention: internal error: the {impl} kernel does not take this call")
    return None if bad == _TINY_INPUT else (dq, dk, dv)


def _attend(s, v):
    """(out, lse) of masked scores s [..., n] (in the accumulation dtype) against v [..., n, D]: softmax as
    (exp(s - rowmax) @ v) / rowsum, not exp(s - lse) @ v (lse rounded to fp32 carries ~|lse| * 6e-8 into
    every weight: at logits of 1e4, 1.6e-4 relative error in out where SDPA has 4e-8; audit finding). A
    row that sees no key has lse -inf and out 0 even where v holds NaN/inf (its p is 0, but 0 * NaN is
    NaN); +inf scores give NaN, as SDPA."""
    m = torch.logsumexp(s, dim=-1)
    mx = torch.amax(s, dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isneginf(mx), 0.0, mx))
    o = torch.matmul(p, v) / p.sum(dim=-1, keepdim=True)
    return torch.where(torch.isneginf(m).unsqueeze(-1), 0.0, o), m


def blocked_forward(q, k, v, causal: bool, scale: float, chunk_elems: int = 1 << 22):
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    out, lse = _empty_result(q, v, Sk)
    if q.numel() == 0 or Sk == 0:
        return out, lse
    g = H // Hkv
    acc = acc_dtype(q.dtype)
    qa = q.to(acc).view(B, Hkv, g, Sq, D)
    ka, va = k.to(acc), v.to(acc)
    step = _chunk_rows(B, H, Sk, chunk_elems)
    for i0 in range(0, Sq, step):
        i1 = min(Sq, i0 + step)
        n = _visible(i0, i1, Sq, Sk, causal)
        if n == 0:
            continue
        s = _scores(qa[:, :, :, i0:i1], ka[:, :, :n], i0, Sq, Sk, causal, scale)
        o, m = _attend(s, va[:, :, :n].unsqueeze(2))        # [B, Hkv, g, c, D]
        out[:, :, i0:i1] = o.reshape(B, H, i1 - i0, -1).to(q.dtype)
        lse[:, :, i0:i1] = m.reshape(B, H, i1 - i0)
    return out, lse


def blocked_backward(dout, q, k, v, out, lse, causal: bool, scale: float, dlse=None,
                     chunk_elems: int = 1 << 22):
    """dq, dk, dv from the saved global out and lse; dlse (optional) is the gradient of the LSE output:
    d lse_i / d s_ij = p_ij, so it enters as D_i = rowsum(dO_i * O_i) - dlse_i."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc)
    dk = torch.zeros(k.shape, dtype=acc)
    dv = torch.zeros(v.shape, dtype=acc)
    if q.numel() == 0 or k.numel() == 0:
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    g = H // Hkv
    qa = q.to(acc).view(B, Hkv, g, Sq, D)
    ka, va = k.to(acc), v.to(acc)
    do = dout.to(acc).view(B, Hkv, g, Sq, -1)
    delta = (do * out.to(acc).view(B, Hkv, g, Sq, -1)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(acc).view(B, Hkv, g, Sq)
    lse_a = lse.to(acc).view(B, Hkv, g, Sq)
    lse_a = torch.where(torch.isneginf(lse_a), 0.0, lse_a)   # rows with no key: every p is 0 anyway
    # a NaN row's lse is NaN, and exp(-inf - NaN) is NaN at its masked keys: every dV row (and dK) went NaN,
    # not only the keys the row sees (SDPA's and the Triton kernels' answer; audit finding)
    nan_rows = bool(torch.isnan(lse_a).any())
    dqv = dq.view(B, Hkv, g, Sq, D)
    step = _chunk_rows(B, H, Sk, chunk_elems)
    for i0 in range(0, Sq, step):
        i1 = min(Sq, i0 + step)
        n = _visible(i0, i1, Sq, Sk, causal)
        if n == 0:
            continue
        qc, doc = qa[:, :, :, i0:i1], do[:, :, :, i0:i1]
        kc, vc = ka[:, :, :n], va[:, :, :n]
        s = _scores(qc, kc, i0, Sq, Sk, causal, scale)
        p = torch.exp(s - lse_a[:, :, :, i0:i1].unsqueeze(-1))
        if nan_rows:
            p.masked_fill_(torch.isneginf(s), 0.0)
        c = i1 - i0
        # dV = P^T dO, summed over the g query heads of each KV head and the chunk's rows.
        dv[:, :, :n] += torch.matmul(p.permute(0, 1, 4, 2, 3).reshape(B, Hkv, n, g * c),
                                     doc.reshape(B, Hkv, g * c, -1))
        dp = torch.matmul(doc, vc.transpose(-1, -2).unsqueeze(2))
        # p == 0 (a masked key, a row that sees none, an underflow): dS is 0 there even where dP is not
        # finite (NaN/inf in a v that the row cannot see), as the exact gradient is
        ds = (p * (dp - delta[:, :, :, i0:i1].unsqueeze(-1))).masked_fill_(p == 0, 0.0)
        dqv[:, :, :, i0:i1] = torch.matmul(ds, kc.unsqueeze(2)) * scale
        dk[:, :, :n] += torch.matmul(ds.permute(0, 1, 4, 2, 3).reshape(B, Hkv, n, g * c),
                                     qc.reshape(B, Hkv, g * c, D)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
