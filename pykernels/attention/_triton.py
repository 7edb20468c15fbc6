"""Triton FlashAttention-2 kernels: forward (online softmax, LSE output) and backward (dK/dV, dQ).

FlashAttention-2 (Dao 2023), Algorithms 1 and 2, with the Triton fused-attention tutorial's split of the
backward into a dK/dV kernel (a program owns BLOCK_N1 keys and streams the query rows) and a dQ kernel
(a program owns BLOCK_M2 query rows and streams the keys), so no atomics are needed.

  - Softmax through exp2: s = (q . k) * scale, p = exp2((s - m) * log2(e)), lse = m + log2(l) * ln(2).
    Scores and maxima stay in natural units, log2(e) applied after the subtraction: scaled by it up front
    (the tutorial's s * scale * log2(e)), finite scores above FLT_MAX / log2(e) ~ 2.4e38 (or such scales)
    became inf and the row NaN with lse +inf, where the CPU paths give the exact answer (audit finding).
    A row with a +inf score subtracts FLT_MAX instead of its max: lse +inf, or NaN beside a NaN score.
  - Causal is aligned bottom-right: row i sees key j iff j <= i + (S_k - S_q). A query tile stops at its
    last visible key; a key tile starts at its first query row that can see it (backward).
  - Rows that see no key keep l = 0: out 0 and lse -inf (the backward maps lse -inf to +inf, so p = 0).
    The backward is given the rows that see keys only (attention._backward_impl slices off the first
    S_q - S_k of a causal call): a dK/dV tile starts at a multiple of BLOCK_M, and a NaN in a dead row's
    q or dO reached dK/dV through 0 * NaN (audit finding; masking those rows here spilled d=128 fp32).
  - GQA/MQA: query head h reads KV head h // GROUPS. The dK/dV program of a KV head loops over the GROUPS
    query heads that share it, so dK/dV are summed in registers (no atomics, no extra reduction pass).
  - Backward: D = rowsum(dO * O) - dlse is computed by torch (an elementwise pass) before the kernels;
    dS = P * (dP - D). All accumulators are fp32; dots on fp32 inputs use IEEE precision (no TF32).
  - Any strides (no copies for transposed views); offsets in int64.

The kernels are plain functions made into Triton kernels when called (`_kernel`), so the same module
runs compiled on a GPU and under TRITON_INTERPRET=1 on CPU tensors even if the variable is set after
import; `AOT_SPECS` compiles every config the autotuner may pick for sm_90 (tests/test_gpu_build.py).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from .._triton_util import ADD as _ADD, MAX as _MAX, interpreting as _interpreting, kernel as _kernel
from .._triton_util import launches_on_input_device
from ..triton_aot import AotSpec
from . import _cpu, _triton_configs as cfgs



# ----------------------------------------------------------------------------------------------
# Kernels. They call only Triton builtins (tl.full, tl.reduce with our own combine functions) and no
# @triton.jit helpers of triton.language.standard (tl.zeros, tl.max, tl.sum): those become interpretable
# only if TRITON_INTERPRET=1 was set before triton was imported, which a test session cannot promise.
# ----------------------------------------------------------------------------------------------
# Combine functions: _MAX / _ADD from pykernels/_triton_util.py (tl.reduce(x, 1, _ADD) is tl.sum).


def _attn_fwd(Q, K, V, O, L,
              sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod, slb, slh, slm,
              H, GROUPS, SQ, SK, sm_scale,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              IS_CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    hk = (h // GROUPS).to(tl.int64)
    h = h.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < SQ
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b * skb + hk * skh + offs_d[:, None] * skd      # K^T tile: [BLOCK_D, BLOCK_N]
    v_base = V + b * svb + hk * svh + offs_d[None, :] * svd      # V tile:   [BLOCK_N, BLOCK_D]
    diag = SK - SQ
    hi = SK
    if IS_CAUSAL:
        hi = tl.minimum(SK, tl.maximum((pid_m + 1) * BLOCK_M + diag, 0))
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < SK
        kt = tl.load(k_base + cols[None, :] * skn, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=DOT_PREC) * sm_scale
        ok = n_ok[None, :]
        if IS_CAUSAL:
            ok = ok & (cols[None, :] <= offs_m[:, None] + diag)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        # a row with no key yet: keep p = 0. A row with a +inf score: subtract FLT_MAX instead, so that p is
        # +inf at the +inf scores (not inf - inf = NaN) and 0 elsewhere; the row's sum is then +inf, and
        # its log-sum-exp +inf as on the CPU paths, unless a score is NaN: NaN (max ignores NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, tl.where(m_new == float("inf"), 3.4028234663852886e38, m_new))
        p = tl.math.exp2((s - m_safe[:, None]) * 1.4426950408889634)
        alpha = tl.math.exp2((m_i - m_safe) * 1.4426950408889634)
        l_i = l_i * alpha + tl.reduce(p, 1, _ADD)
        vt = tl.load(v_base + cols[:, None] * svn, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            vt = vt.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
        m_i = m_new
    empty = l_i == 0.0
    # a row that sees no key is 0 even when some v holds NaN/inf (its p is 0, but 0 * NaN is NaN)
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
    lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)) * 0.6931471805599453)
    tl.store(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod, out.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
    tl.store(L + b * slb + h * slh + offs_m * slm, lse, mask=m_ok)


def _attn_bwd_dkdv(Q, K, V, DO, L, DELTA, DK, DV,
                   sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
                   slb, slh, slm, skgb, skgh, skgn, skgd,
                   HKV, GROUPS, SQ, SK, sm_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   IS_CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    n_ok = offs_n < SK
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    diag = SK - SQ
    lo = 0
    if IS_CAUSAL:
        # the first query row that sees key pid_n * BLOCK_N is that key - diag
        lo = tl.maximum(pid_n * BLOCK_N - diag, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    for g in range(0, GROUPS):
        h = hk * GROUPS + g
        for start_m in range(lo, SQ, BLOCK_M):
            offs_m = start_m + offs_m0
            m_ok = offs_m < SQ
            qt = tl.load(Q + b * sqb + h * sqh + offs_m[None, :] * sqm + offs_d[:, None] * sqd,
                         mask=d_ok[:, None] & m_ok[None, :], other=0.0)            # Q^T [BLOCK_D, BLOCK_M]
            if UPCAST:
                qt = qt.to(tl.float32)
            lse = tl.load(L + b * slb + h * slh + offs_m * slm, mask=m_ok, other=float("inf"))
            lse = tl.where(lse == float("-inf"), float("inf"), lse)              # a row with no key: p = 0
            st = tl.dot(k, qt, input_precision=DOT_PREC) * sm_scale                 # S^T [BLOCK_N, BLOCK_M]
            pt = tl.math.exp2((st - lse[None, :]) * 1.4426950408889634)
            ok = n_ok[:, None] & m_ok[None, :]
            if IS_CAUSAL:
                ok = ok & (offs_n[:, None] <= offs_m[None, :] + diag)
            pt = tl.where(ok, pt, 0.0)
            do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :] * sdd,
                         mask=m_ok[:, None] & d_ok[None, :], other=0.0)            # dO [BLOCK_M, BLOCK_D]
            if UPCAST:
                do = do.to(tl.float32)
            dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PREC)
            delta = tl.load(DELTA + b * slb + h * slh + offs_m * slm, mask=m_ok, other=0.0)
            dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)                # dP^T [BLOCK_N, BLOCK_M]
            dst = tl.where(pt == 0.0, 0.0, pt * (dpt - delta[None, :]))   # 0 where p is, even if dP is NaN
            dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=DOT_PREC)
    dk = dk * sm_scale
    tl.store(DK + b * skgb + hk * skgh + offs_n[:, None] * skgn + offs_d[None, :] * skgd,
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * skgb + hk * skgh + offs_n[:, None] * skgn + offs_d[None, :] * skgd,
             dv.to(DV.dtype.element_ty), mask=kv_mask)


def _attn_bwd_dq(Q, K, V, DO, L, DELTA, DQ,
                 sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdb, sdh, sdm, sdd,
                 slb, slh, slm, sgb, sgh, sgm, sgd,
                 H, GROUPS, SQ, SK, sm_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 IS_CAUSAL: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    hk = (h // GROUPS).to(tl.int64)
    h = h.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < SQ
    row_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask=row_mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :] * sdd, mask=row_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(L + b * slb + h * slh + offs_m * slm, mask=m_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)                          # a row with no key: p = 0
    delta = tl.load(DELTA + b * slb + h * slh + offs_m * slm, mask=m_ok, other=0.0)
    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    diag = SK - SQ
    hi = SK
    if IS_CAUSAL:
        hi = tl.minimum(SK, tl.maximum((pid_m + 1) * BLOCK_M + diag, 0))
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < SK
        kt = tl.load(K + b * skb + hk * skh + offs_n[None, :] * skn + offs_d[:, None] * skd,
                     mask=d_ok[:, None] & n_ok[None, :], other=0.0)                # K^T [BLOCK_D, BLOCK_N]
        vt = tl.load(V + b * svb + hk * svh + offs_n[None, :] * svn + offs_d[:, None] * svd,
                     mask=d_ok[:, None] & n_ok[None, :], other=0.0)                # V^T [BLOCK_D, BLOCK_N]
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=DOT_PREC) * sm_scale
        p = tl.math.exp2((s - lse[:, None]) * 1.4426950408889634)
        ok = m_ok[:, None] & n_ok[None, :]
        if IS_CAUSAL:
            ok = ok & (offs_n[None, :] <= offs_m[:, None] + diag)
        p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, vt, input_precision=DOT_PREC)
        ds = tl.where(p == 0.0, 0.0, p * (dp - delta[:, None]))   # 0 where p is, even if dP is NaN
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=DOT_PREC)
    dq = dq * sm_scale
    tl.store(DQ + b * sgb + h * sgh + offs_m[:, None] * sgm + offs_d[None, :] * sgd, dq.to(DQ.dtype.element_ty),
             mask=row_mask)


# ----------------------------------------------------------------------------------------------
# Compiled or interpreted, decided at call time
# ----------------------------------------------------------------------------------------------
# _kernel(fn): pykernels/_triton_util.kernel (InterpretedFunction under TRITON_INTERPRET=1, else JITFunction).


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(q, k):
    if q.dtype not in _DTYPES:
        raise TypeError(f"pykernels.flash_attention: backend 'triton' supports float16, bfloat16 and float32, "
                        f"got {str(q.dtype).replace('torch.', '')}")
    if q.shape[-1] > 256:
        raise ValueError(f"pykernels.flash_attention: backend 'triton' supports head dims up to 256, got "
                         f"{q.shape[-1]}")
    if q.shape[1] > 65535 or q.shape[0] > 65535:
        raise ValueError(f"pykernels.flash_attention: backend 'triton' supports B, H <= 65535, got "
                         f"{tuple(q.shape)}")


def _i32_offsets(t: torch.Tensor) -> torch.Tensor:
    """The kernels add int64 (batch, head) offsets to 32-bit in-head offsets (row * stride + col): give
    them a tensor whose in-head offsets fit in int32 (a copy only for huge strided views)."""
    def span(x):
        return sum((n - 1) * st for n, st in zip(x.shape[2:], x.stride()[2:]) if n > 0)

    if span(t) < 2 ** 31:
        return t
    t = t.contiguous()
    if span(t) >= 2 ** 31:
        raise ValueError(f"pykernels.flash_attention: backend 'triton' needs S*D < 2**31 per head, got shape "
                         f"{tuple(t.shape)}")
    return t


def _dot_prec(dtype):
    return "ieee" if dtype == torch.float32 or _upcast(dtype) else "tf32"  # 16-bit inputs ignore it


def _upcast(dtype) -> bool:
    """Triton 3.9's interpreter computes tl.dot on bfloat16 operands wrongly (it multiplies the raw
    bits), so under TRITON_INTERPRET=1 bf16 tiles are converted to fp32 right after loading. Compiled
    kernels never upcast (UPCAST=False)."""
    return _interpreting() and dtype == torch.bfloat16


def _launch_opts(cfg, kernel: str = ""):
    """num_warps/num_stages of a launch; the backward's dQ kernel takes "num_warps_dq" where a config
    names it (its tiles fit other warp counts than the dK/dV kernel's)."""
    if _interpreting():
        return {}
    warps = cfg.get("num_warps_dq", cfg["num_warps"]) if kernel == "dq" else cfg["num_warps"]
    return {"num_warps": int(warps), "num_stages": int(cfg["num_stages"])}


@launches_on_input_device
def forward(q, k, v, causal: bool, scale: float, cfg: dict):
    _check(q, k)
    B, H, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    out = torch.zeros((B, H, SQ, D), dtype=q.dtype, device=q.device)
    lse = torch.full((B, H, SQ), float("-inf"), dtype=torch.float32, device=q.device)
    if out.numel() == 0 or SK == 0:
        return out, lse
    q, k, v = _i32_offsets(q), _i32_offsets(k), _i32_offsets(v)
    cfg = {**cfgs.default_fwd(D, str(q.dtype)), **(cfg or {})}
    bm, bn = int(cfg["BLOCK_M"]), int(cfg["BLOCK_N"])
    grid = (triton.cdiv(SQ, bm), H, B)
    _kernel(_attn_fwd)[grid](
        q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
        H, H // HKV, SQ, SK, float(scale),
        HEAD_DIM=D, BLOCK_D=cfgs.block_d(D), BLOCK_M=bm, BLOCK_N=bn, IS_CAUSAL=bool(causal),
        DOT_PREC=_dot_prec(q.dtype), UPCAST=_upcast(q.dtype), **_launch_opts(cfg))
    return out, lse


@launches_on_input_device
def backward(dout, dlse, q, k, v, out, lse, causal: bool, scale: float, cfg: dict):
    _check(q, k)
    B, H, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    dq, dk, dv = _cpu.zero_grads(q, k, v)
    if q.numel() == 0 or k.numel() == 0:
        return dq, dk, dv
    q, k, v, dout = _i32_offsets(q), _i32_offsets(k), _i32_offsets(v), _i32_offsets(dout)
    cfg = {**cfgs.default_bwd(D, str(q.dtype)), **(cfg or {})}
    # D_i = rowsum(dO * O) - dlse_i (FlashAttention-2's preprocessing step, with the LSE gradient folded in).
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    lse = lse.float().contiguous()
    delta = delta.contiguous()
    common = dict(HEAD_DIM=D, BLOCK_D=cfgs.block_d(D), IS_CAUSAL=bool(causal), DOT_PREC=_dot_prec(q.dtype),
                  UPCAST=_upcast(q.dtype))
    sm_scale = float(scale)
    bm1, bn1 = int(cfg["BLOCK_M1"]), int(cfg["BLOCK_N1"])
    _kernel(_attn_bwd_dkdv)[(triton.cdiv(SK, bn1), HKV, B)](
        q, k, v, dout, lse, delta, dk, dv, *q.stride(), *k.stride(), *v.stride(), *dout.stride(),
        *lse.stride(), *dk.stride(), HKV, H // HKV, SQ, SK, sm_scale,
        BLOCK_M=bm1, BLOCK_N=bn1, **common, **_launch_opts(cfg, "dkdv"))
    bm2, bn2 = int(cfg["BLOCK_M2"]), int(cfg["BLOCK_N2"])
    _kernel(_attn_bwd_dq)[(triton.cdiv(SQ, bm2), H, B)](
        q, k, v, dout, lse, delta, dq, *q.stride(), *k.stride(), *v.stride(), *dout.stride(),
        *lse.stride(), *dq.stride(), H, H // HKV, SQ, SK, sm_scale,
        BLOCK_M=bm2, BLOCK_N=bn2, **common, **_launch_opts(cfg, "dq"))
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# Ahead-of-time specs: every config the autotuner may pick, for the head dims and dtypes that matter
# ----------------------------------------------------------------------------------------------
_TY = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def _fwd_spec(d, dtype, cfg, causal=True):
    from triton.runtime.jit import JITFunction

    t = _TY[dtype]
    sig = {"Q": f"*{t}", "K": f"*{t}", "V": f"*{t}", "O": f"*{t}", "L": "*fp32"}
    for n in ("sqb sqh sqm sqd skb skh skn skd svb svh svn svd sob soh som sod slb slh slm H GROUPS SQ SK").split():
        sig[n] = "i32"
    sig["sm_scale"] = "fp32"
    const = {"HEAD_DIM": d, "BLOCK_D": cfgs.block_d(d), "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"],
             "IS_CAUSAL": causal, "DOT_PREC": "ieee" if dtype == "float32" else "tf32", "UPCAST": False}
    for n in const:
        sig[n] = "constexpr"
    return AotSpec(f"attention.fwd[d={d},{dtype}]", JITFunction(_attn_fwd), sig, const,
                   num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _bwd_specs(d, dtype, cfg, causal=True):
    from triton.runtime.jit import JITFunction

    t = _TY[dtype]
    out = []
    for name, fn, ptrs, strides, hname, bm, bn in (
        ("dkdv", _attn_bwd_dkdv, ("Q", "K", "V", "DO", "L", "DELTA", "DK", "DV"),
         "skgb skgh skgn skgd", "HKV", cfg["BLOCK_M1"], cfg["BLOCK_N1"]),
        ("dq", _attn_bwd_dq, ("Q", "K", "V", "DO", "L", "DELTA", "DQ"),
         "sgb sgh sgm sgd", "H", cfg["BLOCK_M2"], cfg["BLOCK_N2"]),
    ):
        sig = {p: ("*fp32" if p in ("L", "DELTA") else f"*{t}") for p in ptrs}
        for n in ("sqb sqh sqm sqd skb skh skn skd svb svh svn svd sdb sdh sdm sdd slb slh slm "
                  + strides + f" {hname} GROUPS SQ SK").split():
            sig[n] = "i32"
        sig["sm_scale"] = "fp32"
        const = {"HEAD_DIM": d, "BLOCK_D": cfgs.block_d(d), "BLOCK_M": bm, "BLOCK_N": bn, "IS_CAUSAL": causal,
                 "DOT_PREC": "ieee" if dtype == "float32" else "tf32", "UPCAST": False}
        for n in const:
            sig[n] = "constexpr"
        warps = cfg.get("num_warps_dq", cfg["num_warps"]) if name == "dq" else cfg["num_warps"]
        out.append(AotSpec(f"attention.bwd_{name}[d={d},{dtype}]", JITFunction(fn), sig, const,
                           num_warps=warps, num_stages=cfg["num_stages"]))
    return out


def _aot_specs():
    specs = []
    for d in (64, 128, 256):
        for dtype in ("bfloat16", "float32"):
            for c in cfgs.fwd_configs(d, dtype):
                specs.append(_fwd_spec(d, dtype, c))
            for c in cfgs.bwd_configs(d, dtype):
                specs.extend(_bwd_specs(d, dtype, c))
    # The causal variant is the superset (it adds the diagonal mask); the non-causal one of the default
    # configs is compiled too, for the common head dims.
    for d in (64, 128):
        specs.append(_fwd_spec(d, "bfloat16", cfgs.default_fwd(d, "bfloat16"), causal=False))
        specs.extend(_bwd_specs(d, "bfloat16", cfgs.default_bwd(d, "bfloat16"), causal=False))
    return specs


AOT_SPECS = _aot_specs()
