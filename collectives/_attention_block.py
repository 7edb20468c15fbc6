"""Per-block attention for the sequence-parallel schedules (ring / TokenRing).

One call computes the attention of a block of queries against a block of keys/values and returns the
*partial* result (out, lse) of those queries, to be merged with the other blocks' partials; the
backward takes the *global* out and lse of the queries (saved by the forward after all merges), which is
what makes a blockwise backward exact (FlashAttention-2 backward: P = exp(S - lse), D = rowsum(dO * O),
dS = P * (dP - D)).

Backends, picked per call by `_fwd_impl` / `_bwd_impl` (the one place to switch):
  - CPU: pykernels' own attention op (`torch.ops.pykernels.flash_attention` and
    `flash_attention_backward`, backend "cpu", called directly when nothing is traced: `_attention_ops`),
    which returns the LSE, takes the global out/lse in the
    backward, handles GQA/MQA heads and bottom-right causal masks itself, and turns NaN/inf inputs into
    NaN outputs exactly like `pykernels.flash_attention` (aten's fused CPU kernels alone would zero
    such rows: a silent wrong answer).
  - GPU: the same op with backend "triton" (issue #6's FlashAttention-2 kernels) when this build can
    run it and the block is inside the kernels' documented limits (`_triton_takes`), else the exact
    fp32 math below (query-chunked so memory stays bounded).
The math path is also the oracle-grade fallback for anything the fused kernels do not take.

Accumulators: the merge of partials and the LSE are kept in fp32 (fp64 for fp64 inputs), whatever the
input dtype (the anchors' users report bf16 error growing with world size otherwise).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of LSEs, merged outputs and gradient accumulators for inputs of `dtype`."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    # [B, Hkv, S, D] -> [B, Hkv*groups, S, D]; query head h uses kv head h // groups (GQA convention).
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _reduce_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    # Gradient of _expand_kv: sum over the query heads that shared one kv head.
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(dim=2)


# Dtypes for which the CPU path uses pykernels' attention op (every one it takes; the tests empty this
# tuple to exercise the math path that GPUs fall back to).
_CPU_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _math_forward(q, k, v, scale, causal, chunk: int = 1024):
    """Exact attention in fp32 (fp64 for fp64), queries in chunks of `chunk` rows. NaN/inf inputs give
    NaN rows (logsumexp and exp propagate them), as flash_attention does."""
    acc = acc_dtype(q.dtype)
    qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
    sq, sk = q.shape[2], k.shape[2]
    outs, lses = [], []
    for i0 in range(0, sq, chunk):
        i1 = min(sq, i0 + chunk)
        s = torch.matmul(qa[:, :, i0:i1], ka.transpose(-1, -2)) * scale
        if causal:
            # bottom-right alignment (flash-attn convention); blocks here are square anyway
            rows = torch.arange(i0, i1, device=q.device).unsqueeze(1) + (sk - sq)
            s = s.masked_fill(torch.arange(sk, device=q.device).unsqueeze(0) > rows, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        outs.append(torch.matmul(p, va))
        lses.append(lse)
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)


def _math_backward(do, q, k, v, out, lse, scale, causal, chunk: int = 1024, delta=None):
    acc = acc_dtype(q.dtype)
    qa, ka, va, doa = q.to(acc), k.to(acc), v.to(acc), do.to(acc)
    if delta is None:
        delta = row_delta(do, out)
    delta = delta.to(acc)
    sq, sk = q.shape[2], k.shape[2]
    dq = torch.empty_like(qa)
    dk = torch.zeros_like(ka)
    dv = torch.zeros_like(va)
    for i0 in range(0, sq, chunk):
        i1 = min(sq, i0 + chunk)
        s = torch.matmul(qa[:, :, i0:i1], ka.transpose(-1, -2)) * scale
        if causal:
            rows = torch.arange(i0, i1, device=q.device).unsqueeze(1) + (sk - sq)
            s = s.masked_fill(torch.arange(sk, device=q.device).unsqueeze(0) > rows, float("-inf"))
        p = torch.exp(s - lse[:, :, i0:i1].to(acc).unsqueeze(-1))  # P of the global softmax
        dov = doa[:, :, i0:i1]
        dv += torch.matmul(p.transpose(-1, -2), dov)
        dp = torch.matmul(dov, va.transpose(-1, -2))
        ds = p * (dp - delta[:, :, i0:i1].unsqueeze(-1))
        dq[:, :, i0:i1] = torch.matmul(ds, ka) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qa[:, :, i0:i1]) * scale
    return dq, dk, dv


def _attention_ops():
    """pykernels' attention entries (forward, backward): the registered ops, or their implementation
    directly where nothing is traced or differentiated (pykernels.attention.forward_op / backward_op)."""
    import pykernels.attention as pa

    return pa.forward_op, pa.backward_op


_triton_state: dict = {}  # "fwd"/"bwd" -> False once the op said NotImplementedError


def _triton_takes(which: str, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the block is inside the Triton kernels' documented limits (pykernels/attention/_triton.py
    `_check`: float16/bfloat16/float32, head dim <= 256, B and H <= 65535, S*D < 2**31 per head) and
    this machine can run Triton. Checked up front, so that any error the kernels do raise is a real
    one and propagates (a CUDA OOM must not turn into an O(S^2) fallback)."""
    if _triton_state.get(which) is False or q.dtype not in _TRITON_DTYPES:
        return False
    b, h, sq, d = q.shape
    if d > 256 or b > 65535 or h > 65535 or max(sq, k.shape[2]) * d >= 2 ** 31:
        return False
    from pykernels import backends

    return bool(backends()["triton"])


def _triton_call(which: str, fn, *args):
    try:
        return fn(*args)
    except NotImplementedError:  # an op (or this build) without the kernel: math path for good
        _triton_state[which] = False
        return None


def _fwd_impl(q, k, v, scale, causal):
    """(out, lse) of q against k, v; k/v may have fewer (GQA) heads."""
    if q.device.type == "cpu" and q.dtype in _CPU_FUSED_DTYPES:
        fwd, _ = _attention_ops()
        return fwd(q, k, v, causal, scale, "cpu")
    if q.device.type == "cuda" and _triton_takes("fwd", q, k):
        fwd, _ = _attention_ops()
        res = _triton_call("fwd", fwd, q, k, v, causal, scale, "triton")
        if res is not None:
            return res
    return None


def row_delta(do: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dO * O) [B, H, S] in acc dtype (FlashAttention-2 backward), O the *global* output."""
    acc = acc_dtype(do.dtype)
    return (do.to(acc) * out.to(acc)).sum(-1)


def out_standin(do: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A tensor O' (do's dtype) with rowsum(dO * O') = D, for kernels that take O only to form D.

    O' = u * (D / m) / sum(u^2) with u = dO / m, m = max|dO| of the row: then rowsum(dO * O') =
    m * sum(u^2) * (D/m) / sum(u^2) = D, with sum(u^2) in [1, head_dim] (no overflow or underflow).
    Rounding O' to do's dtype perturbs each term by a relative eps, so D comes back within about
    eps * sum|dO||O'|. For float32 that is harmless; for fp16/bf16 it is not: in a peaked row dP - D
    cancels almost entirely, and a rounded O' left dQ 3-5x noisier than Ring's (whose rounded O is
    nearly exactly a row of V there), and ~1e-3 where the true dQ was ~1e-9 (audit finding), so
    _bwd_impl uses it for float32/64 only. Rows with dO = 0 get O' = 0, right only where D is 0 there
    (_bwd_impl checks). Lets the TokenRing backward send D (one number per row) instead of O (head_dim
    numbers per row)."""
    acc = acc_dtype(do.dtype)
    doa = do.to(acc)
    m = doa.abs().amax(-1, keepdim=True)
    safe = torch.where(m > 0, m, torch.ones_like(m))
    u = doa / safe
    alpha = (delta.to(acc).unsqueeze(-1) / safe) / (u * u).sum(-1, keepdim=True).clamp_min(1.0)
    return torch.where(m > 0, u * alpha, torch.zeros_like(u)).to(do.dtype)


def _bwd_impl(do, q, k, v, out, lse, scale, causal, delta=None):
    """(dq, dk, dv) through pykernels' attention backward, or None where it does not apply."""
    if not ((q.device.type == "cpu" and q.dtype in _CPU_FUSED_DTYPES)
            or (q.device.type == "cuda" and _triton_takes("bwd", q, k))):
        return None
    _, bwd = _attention_ops()
    dlse = None
    if out is None:
        # D through a stand-in O where it can carry it (float32/64; see out_standin); fp16/bf16, a row with
        # dO = 0 but D != 0 (a loss on the LSE only) or with |D| / max|dO| near the dtype's range cannot:
        # then O = 0 and D goes in as the op's own LSE gradient (D = rowsum(dO * 0) - dlse), exact but off
        # the aten fast path.
        acc = acc_dtype(do.dtype)
        d = delta.to(acc)
        fits = None
        if do.dtype in (torch.float32, torch.float64):
            m = do.to(acc).abs().amax(-1)
            lim = torch.finfo(do.dtype).max / 16
            fits = torch.where(m > 0, d.abs() < lim * m, d == 0)
        if fits is not None and bool(fits.all()):
            out = out_standin(do, delta)
        else:
            out, dlse = torch.zeros_like(do), (-d).to(lse.dtype)
    if q.device.type == "cpu":
        return bwd(do, dlse, q, k, v, out, lse, causal, scale, "cpu")
    return _triton_call("bwd", bwd, do, dlse, q, k, v, out, lse, causal, scale, "triton")


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Partial attention of q [B,H,Sq,D] against k, v [B,Hkv,Sk,D].

    Returns (out [B,H,Sq,D] in q's dtype, lse [B,H,Sq] in acc_dtype). `causal` is only meaningful for
    a diagonal block (Sq == Sk, same positions)."""
    b, h, sq, d = q.shape
    if causal and sq != k.shape[2]:
        raise AssertionError("block_forward: causal blocks must be square")
    acc = acc_dtype(q.dtype)
    if sq == 0 or k.shape[2] == 0 or h == 0 or k.shape[1] == 0:  # (zero heads: h // 0 below; audit finding)
        return (torch.zeros(b, h, sq, v.shape[-1], dtype=q.dtype, device=q.device),
                torch.full((b, h, sq), float("-inf"), dtype=acc, device=q.device))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    res = _fwd_impl(q, k, v, scale, causal)
    if res is not None:
        out, lse = res
        return out, lse.to(acc).contiguous()
    groups = h // k.shape[1]
    if groups > 1 and not causal:
        # Math path, GQA without a mask: the g query heads of one kv head are just more rows against
        # the same keys, so fold them into the sequence dim (a view) instead of copying K/V g times.
        hkv = k.shape[1]
        out, lse = _math_forward(q.view(b, hkv, groups * sq, d), k, v, scale, False)
        return out.reshape(b, h, sq, -1), lse.reshape(b, h, sq).to(acc)
    out, lse = _math_forward(q, _expand_kv(k, groups), _expand_kv(v, groups), scale, causal)
    return out, lse.to(acc)


def block_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: Optional[torch.Tensor], lse: torch.Tensor, scale: float, causal: bool,
                   delta: Optional[torch.Tensor] = None):
    """Gradients of this block's share of attention, given the *global* out and lse of q's rows
    (or, with out=None, the global D = rowsum(dO * O) as `delta`, see row_delta / out_standin).

    Returns (dq [B,H,Sq,D], dk, dv [B,Hkv,Sk,D]) in acc_dtype (the caller accumulates them there)."""
    acc = acc_dtype(q.dtype)
    hkv = k.shape[1]
    if q.shape[2] == 0 or k.shape[2] == 0 or hkv == 0:
        return (torch.zeros(q.shape, dtype=acc, device=q.device),
                torch.zeros(k.shape, dtype=acc, device=q.device),
                torch.zeros(v.shape, dtype=acc, device=q.device))
    groups = q.shape[1] // hkv
    # The attention op wants out/lse in its own dtypes (out: q's dtype, lse: fp32, fp64 for fp64).
    lse = lse.to(acc).contiguous()
    do, q, k, v = do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous()
    out = None if out is None else out.to(q.dtype).contiguous()
    res = _bwd_impl(do, q, k, v, out, lse, scale, causal, delta=delta)
    if res is not None:
        dq, dk, dv = res
        return dq.to(acc), dk.to(acc), dv.to(acc)
    if groups > 1 and not causal:  # GQA fold, as in block_forward: dk/dv come out per kv head
        b, h, sq, d = q.shape
        fold = lambda t: None if t is None else t.contiguous().view(b, hkv, groups * sq, *t.shape[3:])  # noqa: E731
        dq, dk, dv = _math_backward(fold(do), fold(q), k, v, fold(out), fold(lse), scale, False,
                                    delta=fold(delta))
        return dq.reshape(b, h, sq, d).to(acc), dk.to(acc), dv.to(acc)
    dq, dk, dv = _math_backward(do, q, _expand_kv(k, groups), _expand_kv(v, groups), out, lse, scale, causal,
                                delta=delta)
    return dq.to(acc), _reduce_kv(dk.to(acc), groups), _reduce_kv(dv.to(acc), groups)


def merge(out_a: Optional[torch.Tensor], lse_a: Optional[torch.Tensor], out_b: torch.Tensor,
          lse_b: torch.Tensor):
    """Merge two partials of the same queries, in acc dtype, the numerically stable way:
    out = out_a - sigmoid(lse_b - lse_a) * (out_a - out_b); lse = lse_a - logsigmoid(lse_a - lse_b).
    (The naive log(exp(a) + exp(b)) overflows.) `out_a is None` means "nothing yet"."""
    acc = lse_b.dtype
    if out_a is None:
        return out_b.to(acc), lse_b
    ob = out_b.to(acc)
    w = torch.sigmoid(lse_b - lse_a).unsqueeze(-1)
    out = out_a - w * (out_a - ob)
    # An inf in V makes a partial inf, and out_a - w * (out_a - ob) inf - inf = NaN there, where
    # flash_attention gives the inf (review finding); the plain weighted sum keeps it (finite entries as
    # they were, bit for bit), with a's weight its own sigmoid: 1 - w is 0 in float32 once lse_b is ~17
    # above lse_a, and 0 * inf NaN again
    # (on the CPU only where some entry needs it: the where and its operands made merge ~30% slower;
    # a GPU takes it unconditionally rather than a host sync)
    finite = torch.isfinite(out)
    if out.device.type != "cpu" or not bool(finite.all()):
        wa = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)
        out = torch.where(finite, out, wa * out_a + w * ob)
    lse = lse_a - F.logsigmoid(lse_a - lse_b)
    # Rows that saw no key yet (lse_a = -inf) take b as is; -inf - (-inf) would be NaN. Branch-free
    # (no host sync on GPUs); our schedules never produce such rows after step 0, but stay safe.
    empty_a = torch.isneginf(lse_a)
    out = torch.where(empty_a.unsqueeze(-1), ob, out)
    lse = torch.where(empty_a, lse_b, lse)
    return out, lse


def merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor,
               lse_b: torch.Tensor, rows: slice):
    """merge() of a partial that covers only `rows` of the sequence dim, in place on the accumulators."""
    o, l = merge(out_acc[:, :, rows], lse_acc[:, :, rows], out_b, lse_b)
    out_acc[:, :, rows] = o
    lse_acc[:, :, rows] = l


def default_scale(d: int, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)
