"""Flash attention returning the log-sum-exp (issue #6).

    out = pykernels.flash_attention(q, k, v, causal=False, scale=None)
    out, lse = pykernels.flash_attention(q, k, v, causal=True, return_lse=True)

Math (FlashAttention, Dao et al. 2022; FlashAttention-2, Dao 2023), per batch b and query head h:
    S = scale * Q K^T                       [S_q, S_k], scale defaults to 1/sqrt(D)
    causal: S_ij = -inf where j > i + (S_k - S_q)   (aligned bottom-right, as flash-attn)
    lse_i = log sum_j exp(S_ij)             (natural log, float32; float64 for float64 inputs)
    out   = exp(S - lse) V
Backward from the saved out and lse: P = exp(S - lse), dV = P^T dO, dP = dO V^T,
D_i = rowsum(dO * O)_i - dlse_i, dS = P * (dP - D), dQ = scale dS K, dK = scale dS^T Q.

Layout [B, H, S, D]; k and v may have Hkv heads with H % Hkv == 0 (GQA/MQA: query head h reads KV head
h // (H // Hkv)); their gradients sum over the query heads of each group.
Rows that see no key at all (causal with S_q > S_k: the first S_q - S_k rows; or S_k == 0) have
output 0, lse -inf and zero gradient (flash-attn leaves such rows undefined; SDPA gives NaN).

Backends: "cpu" (aten's CPU flash kernels wrapped for bottom-right causal and GQA, or a BLAS-blocked
implementation, the autotuner picks; for a few query rows against a KV cache, up to 32 per KV head, the
native flash-decoding kernel (forward only, where no backward follows), and for bfloat16 on CPUs with
AVX-512 BF16 native forward and backward kernels on bf16 dot products), "triton" (FlashAttention-2
forward and backward kernels in `_triton.py`; CUDA tensors, or CPU tensors under TRITON_INTERPRET=1). The
op is registered as `torch.ops.pykernels.flash_attention` (+ `flash_attention_backward`) with fake
implementations and autograd, so it works under torch.compile(fullgraph=True).

`flash_attention_backward(dout, q, k, v, out, lse, ...)` (this module) is the backward on its own: given
the global out/lse of the queries it returns one key block's dk/dv and partial dq, the building block
of ring / context-parallel attention.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import os
import threading
from typing import Optional

import numpy as np
import torch

from .. import _memory, _native, autotune
from .._backend import (_CPU, _traced_or_transformed, autocast_floats, autocast_off_if, dispatch, eager_autograd,
                        eager_autograd_function, eager_direct,
                        fake_on_one_device, functorch_autograd, vmapped_first)
from ..errors import check_same_device
from . import _cpu

__all__ = ["flash_attention", "flash_attention_backward"]

OP = "flash_attention"
OP_BWD = "flash_attention_backward"
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # float64: CPU backend only
SUPPORTED = ("cpu", "triton")


_DTYPE_NAMES = {d: str(d).replace("torch.", "") for d in DTYPES}


def problem_key(q, k, v=None, causal=False, **_) -> dict:
    """The autotune key: dtypes and static dims, power-of-two buckets of the dynamic ones."""
    B, H, Sq, D = q.shape
    bucket = autotune.bucket
    return {"dtype": _DTYPE_NAMES.get(q.dtype) or str(q.dtype).replace("torch.", ""), "d": int(D),
            "causal": bool(causal), "gqa": int(H // max(1, k.shape[1])), "bh": bucket(B * H), "sq": bucket(Sq),
            "sk": bucket(k.shape[2])}


# ----------------------------------------------------------------------------------------------
# Backend implementations (called inside the custom ops, so dynamo never traces them)
# ----------------------------------------------------------------------------------------------
_NATIVE_FINITE_MAX = 1 << 20  # (the native scan holds the GIL: larger tensors take numpy's)


def _all_finite(*tensors) -> bool:
    """False if any element is NaN or +-inf (or, harmlessly, if a sum overflows): one read of each tensor.

    CPU tensors are checked with numpy on the calling thread: a torch reduction right after aten's
    attention kernel paid ~10 ms waking torch's thread pool on a busy 2-core machine (numpy: 0.15 ms
    for 2 MB)."""
    float_flags = _native.cpu_module("runtime").float_flags
    for t in tensors:
        if not t.is_cpu:
            if not bool(torch.isfinite(t.sum().float())):
                return False
            continue
        if (t.dtype is torch.float32 or t.dtype is torch.float64) and t.numel() <= _NATIVE_FINITE_MAX:
            # one native scan (numpy's conversions and calls cost ~10 us a tensor: a third of a 16-token
            # backward's Python; checked with the fewest calls: a 16-token fwd+bwd checks three tensors);
            # a dense tensor, or one value expanded (the dout of out.sum())
            n = t.numel() if t.is_contiguous() else 1 if not any(t.stride()) else -1
            if n >= 0:
                if n and float_flags(t.data_ptr(), n, t.dtype is torch.float64) & 1:
                    return False
                continue
        a = t.detach()
        import numpy as np

        if a.dtype == torch.bfloat16:  # no numpy bf16: all exponent bits set <=> inf or NaN
            bits = a.view(torch.int16).numpy()
            if bits.size and int(np.max(bits & 0x7F80)) == 0x7F80:
                return False
            continue
        arr = a.numpy()
        if not np.isfinite(arr.sum(dtype=np.float64 if arr.dtype == np.float64 else np.float32)):
            return False
    return True


def _forward_impl(q, k, v, causal: bool, scale: float, backend: str, config: Optional[dict] = None,
                  inference: bool = False):
    """(out, lse) by the chosen backend and config. `inference`: no backward can follow this call (an eager
    call that records no autograd graph), so the CPU decode kernel may run: aten's backward recomputes
    P = exp(S - lse) with its own S, and with logits in the 1e4 range an lse from another kernel differs in
    its last bits (ulp(1e4) ~ 1e-3), so P and the gradients by ~1e-3 relative. Where a backward may
    follow (autograd, torch.func; see _flash_attention_op) the decode impl runs as aten's kernels."""
    key = problem_key(q, k, causal=causal)
    chosen, cfg = dispatch(OP, q.device, backend, key, supported=SUPPORTED, preference=("triton",))
    if config is not None:
        cfg = dict(config)
    if chosen == "triton":
        from . import _triton

        return _triton.forward(q, k, v, causal, scale, cfg)
    impl = cfg.get("impl", "flash")
    if impl == "decode" and inference and q.dtype in _cpu.DECODE_TORCH_DTYPES:  # float64: aten's kernels
        result = _decode(q, k, v, causal, scale, cfg)
        if result is not None:
            return result
    elif impl == "bf16dot" and _cpu.bf16dot_takes(q):  # (where a backward follows too: see _cpu.py)
        result = _bf16dot(q, k, v, causal, scale, cfg)
        if result is not None:
            return result
    elif impl == "fma" and _cpu.fma_takes(q):
        # (where a backward may follow too: the default backward of such calls is the kernel's own, which
        # recomputes P from the same score tiles; the other pairings a tuner may make, bf16dot's or aten's
        # backward, were as accurate against float64 as aten's own pair: test_fma_forward_and_backward_as_
        # accurate_as_aten)
        result = _fma(q, k, v, causal, scale, cfg)
        if result is not None:
            return result
    elif impl != "blocked":
        out, lse = _cpu.flash_forward(q, k, v, causal, scale)
        if _flash_result_stands(q, k, v, causal, scale, out, lse):
            return out, lse
    return _blocked(q, k, v, causal, scale, cfg)


def _blocked(q, k, v, causal: bool, scale: float, cfg: dict):
    """The exact path: the "blocked" impl, and where another one's result does not stand (NaN/inf inputs)."""
    return _cpu.blocked_forward(q, k, v, causal, scale, chunk_elems=int(cfg.get("chunk_elems", 1 << 22)))


def _threads(cfg: dict) -> int:
    """A native CPU kernel's thread count: the config's, else torch's."""
    return int(cfg.get("threads", 0) or 0) or torch.get_num_threads()


def _decode(q, k, v, causal: bool, scale: float, cfg: dict):
    return _cpu.decode_forward(q, k, v, causal, scale, _threads(cfg), int(cfg.get("grain", _cpu.DECODE_GRAIN)))


def _bf16dot(q, k, v, causal: bool, scale: float, cfg: dict):
    return _cpu.bf16dot_forward(q, k, v, causal, scale, _threads(cfg))


def _fma(q, k, v, causal: bool, scale: float, cfg: dict):
    return _cpu.fma_forward(q, k, v, causal, scale, _threads(cfg))


_NATIVE_FORWARDS = {"decode": _decode, "bf16dot": _bf16dot, "fma": _fma}


def _flash_result_stands(q, k, v, causal: bool, scale: float, out, lse) -> bool:
    """Whether aten's flash result (_cpu.flash_forward) is, after patching, the attention of these inputs;
    else the blocked path recomputes the call. aten's kernels give a row whose scores are all -inf (NaN
    in q; -inf in k; fp32 scores that overflow) zeros and an lse of exactly 0 where the math says -inf
    or NaN (an lse of 0 would weigh that row into any LSE merge: ring attention, split-K decoding), and
    an inf score a NaN lse; flash_forward marks the rows of its split + merge regime the same way. So
    the rows whose lse is exactly 0 (finite inputs rarely give one) or not finite are recomputed exactly
    (_cpu.patch_rows); only where there are many does the whole call go to the blocked path. (Checked
    after the kernel, while the thread pool is still awake: before it, waking the pool cost ~10 ms on a
    busy machine.)"""
    if k.shape[2] == 0:
        return True
    # the rows that see keys
    nonfinite, zero = _cpu.lse_flags(lse, max(0, q.shape[2] - k.shape[2]) if causal else 0)
    return not (nonfinite or zero) or _cpu.patch_rows(q, k, v, causal, scale, out, lse)


def _backward_impl(dout, dlse, q, k, v, out, lse, causal: bool, scale: float, backend: str,
                   config: Optional[dict] = None):
    dead = q.shape[2] - k.shape[2] if causal else 0
    if dead > 0 and k.shape[2] > 0:
        # Rows that see no key (bottom-right causal, S_q > S_k) have zero gradient and give none: the backward
        # runs on the others (live row i sees keys j <= i, as row dead + i did), so a NaN in such a row's q or
        # dO cannot reach dK/dV through P = 0 (0 * NaN inside the products; audit finding)
        live = lambda t: None if t is None else t[:, :, dead:]  # noqa: E731
        dq_live, dk, dv = _backward_impl(live(dout), live(dlse), live(q), k, v, live(out), live(lse), causal, scale,
                                         backend, config)
        dq = torch.zeros(q.shape, dtype=dq_live.dtype, device=dq_live.device)
        dq[:, :, dead:] = dq_live
        return dq, dk, dv
    key = problem_key(q, k, causal=causal)
    chosen, cfg = dispatch(OP_BWD, q.device, backend, key, supported=SUPPORTED, preference=("triton",))
    if config is not None:
        cfg = dict(config)
    if dlse is not None and not bool(dlse.any()):
        dlse = None  # autograd materializes an unused LSE gradient as zeros
    if chosen == "triton":
        from . import _triton

        return _triton.backward(dout, dlse, q, k, v, out, lse, causal, scale, cfg)
    impl = cfg.get("impl", "flash")
    # rows that see no key (causal, S_q > S_k) have lse -inf by contract: only the others must be finite
    live = lse[:, :, q.shape[2] - k.shape[2]:] if causal and q.shape[2] > k.shape[2] else lse
    finite = _all_finite(dout, out, live)  # (one read of them, whichever path follows)
    if impl == "bf16dot" and finite and _cpu.bf16dot_takes(q):  # (takes an LSE gradient)
        grads = _cpu.bf16dot_backward(dout, q, k, v, out, lse, causal, scale, dlse, _threads(cfg))
        if grads is not None:  # (None: a tiny input or a huge scale, which aten's exact arithmetic takes below)
            return grads
        impl = "flash"
    if impl == "fma" and finite and _cpu.fma_takes(q):  # (takes an LSE gradient)
        return _cpu.fma_backward(dout, q, k, v, out, lse, causal, scale, dlse, _threads(cfg))
    if dlse is not None or impl == "blocked" or not finite:
        # aten's backward derives D = rowsum(dO * O) itself, so it cannot take an LSE gradient.
        return _cpu.blocked_backward(dout, q, k, v, out, lse, causal, scale, dlse=dlse,
                                     chunk_elems=int(cfg.get("chunk_elems", 1 << 22)))
    return _cpu.flash_backward(dout, q, k, v, out, lse, causal, scale)


# ----------------------------------------------------------------------------------------------
# torch.library registration: forward, backward, fakes, autograd
# ----------------------------------------------------------------------------------------------
def _forward_laid_out(q, k, v, causal: bool, scale: float, backend: str, inference: bool = False):
    """_forward_impl with the layouts the op promises (its fake below reports them)."""
    out, lse = _forward_impl(q, k, v, causal, scale, backend, inference=inference)
    if q.is_cpu and backend != "triton":
        out, lse = _cpu.like_q(out, q), _cpu.to_bshd(lse)
    else:
        out, lse = out.contiguous(), lse.contiguous()
    # aten's outputs come as transposed views: autograd would refuse in-place ops on them (SDPA's allow them)
    return _memory.not_a_view(out), _memory.not_a_view(lse)


@torch.library.custom_op("pykernels::flash_attention", mutates_args=())
def _flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                        backend: str, inference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    # the public function's checks, for the op called directly (torch.ops.pykernels.flash_attention):
    # the kernels trust the shapes (review finding: H not a multiple of Hkv was a SIGFPE)
    _check(q, k, v, scale, backend)
    check_same_device(OP, q=q, k=k, v=v)
    # `inference`: the caller's word that no backward will use this (out, lse) (forward_op decides it
    # where the autograd state is visible). The op itself cannot tell: inside a torch.compile'd training
    # step its inputs come in without requires_grad although the compiled backward follows (review
    # finding: q computed inside the compiled function took the decode kernel and its gradients were
    # off by ~1e-3 relative at logits ~1e3). Where an input requires grad or the call came through a
    # functorch transform (tensors unwrapped; forward_op marks it) a backward may follow regardless.
    inference = inference and not (q.requires_grad or k.requires_grad or v.requires_grad
                                   or getattr(_IN_TRANSFORM, "on", False))
    return _forward_laid_out(q, k, v, causal, scale, backend, inference=inference)


@_flash_attention_op.register_fake
@fake_on_one_device(_flash_attention_op)
def _(q, k, v, causal, scale, backend, inference=False):
    # Strides as the real op returns them: on CPU out in q's memory order (as aten's kernels and SDPA
    # give it: a copy of out is ~4% of a 1024-token forward) and lse in [B, S, H] order (the layout
    # aten writes); contiguous from the Triton kernels.
    B, H, Sq, _ = q.shape
    lse = q.new_empty((B, H, Sq), dtype=_cpu.acc_dtype(q.dtype))
    if q.device.type == "cpu" and backend != "triton":
        out = q.new_empty_strided((B, H, Sq, v.shape[-1]), _cpu.out_strides(q, v.shape[-1]))
        return out, _cpu.to_bshd(lse)
    return q.new_empty((B, H, Sq, v.shape[-1])), lse


@torch.library.custom_op("pykernels::flash_attention_backward", mutates_args=())
def _flash_attention_backward_op(dout: torch.Tensor, dlse: Optional[torch.Tensor], q: torch.Tensor,
                                 k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                 causal: bool, scale: float,
                                 backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(q, k, v, scale, backend, OP_BWD)  # as the forward op: the kernels trust the shapes (an lse too short was read past its end)
    _check_backward(dout, dlse, q, k, v, out, lse)
    dq, dk, dv = _backward_impl(dout, dlse, q, k, v, out, lse, causal, scale, backend)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_flash_attention_backward_op.register_fake
@fake_on_one_device(_flash_attention_backward_op)
def _(dout, dlse, q, k, v, out, lse, causal, scale, backend):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, backend = inputs[:6]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale, ctx.backend = causal, scale, backend


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.is_neg():  # a lazily negated gradient: the finiteness check reads raw bf16/fp16 bits (audit finding)
        dout = dout.resolve_neg()
    # backward_op: in a plain eager backward (no transform, no trace, no create_graph) the implementation
    # directly, not through the registered op's dispatch (~100 us of a 16-token call's ~270 us backward);
    # a backward inside autocast runs with it off, as the forward did
    with autocast_off_if(torch._C._is_any_autocast_enabled() and not torch.compiler.is_compiling()):
        dq, dk, dv = backward_op(dout, dlse, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.backend,
                                 contiguous=False)
    return (dq, dk, dv) + (None,) * (len(ctx.needs_input_grad) - 3)  # causal, scale, backend[, inference]


def _no_second_derivative(ctx, *grads):
    raise NotImplementedError("pykernels.flash_attention: a second derivative (a backward through its backward, "
                              "after torch.autograd.grad(..., create_graph=True)) is not implemented")


def _fold_vmapped(t, dim, n: int):
    """A vmapped tensor as one batch, [n * B, ...]: its vmapped dim folded into its batch dim."""
    return None if t is None else vmapped_first(t, dim, n).flatten(0, 1)


# Batching rules (torch.vmap, also of grad: per-sample gradients): the vmapped dim folds into the batch
# dim, so the batch is one call of the kernels, not torch's per-sample fallback (one call per sample, and
# refused for a batch of 0). Every sample is an independent attention problem, as every batch row is.
@_flash_attention_op.register_vmap
def _(info, in_dims, q, k, v, causal, scale, backend, inference=False):
    n, b = info.batch_size, vmapped_first(q, in_dims[0], info.batch_size).shape[1]
    q, k, v = (_fold_vmapped(t, d, n) for t, d in zip((q, k, v), in_dims[:3]))
    out, lse = _flash_attention_op(q, k, v, causal, scale, backend, inference)
    return (out.unflatten(0, (n, b)), lse.unflatten(0, (n, b))), (0, 0)


@_flash_attention_backward_op.register_vmap
def _(info, in_dims, dout, dlse, q, k, v, out, lse, causal, scale, backend):
    n, b = info.batch_size, vmapped_first(q, in_dims[2], info.batch_size).shape[1]
    dout, dlse, q, k, v, out, lse = (_fold_vmapped(t, d, n) for t, d in
                                     zip((dout, dlse, q, k, v, out, lse), in_dims[:7]))
    grads = _flash_attention_backward_op(dout, dlse, q, k, v, out, lse, causal, scale, backend)
    return tuple(g.unflatten(0, (n, b)) for g in grads), (0, 0, 0)


_flash_attention_op.register_autograd(_backward, setup_context=_setup_context)
# the backward op's own "derivative": a clear error (torch's default told users to register one)
_flash_attention_backward_op.register_autograd(_no_second_derivative)
_flash_attention_call = functorch_autograd("flash_attention", _setup_context, _backward)
_flash_attention_backward_call = functorch_autograd("flash_attention_backward", None, None)


# ----------------------------------------------------------------------------------------------
# Public entry
# ----------------------------------------------------------------------------------------------
def _check(q, k, v, scale, backend, op: str = OP):
    """q, k, v, scale and backend as both ops take them; errors name `op` (the forward or the backward)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in DTYPES:
            raise TypeError(f"pykernels.{op}: expected '{name}' of dtype float32, bfloat16, "
                            f"float16 (or float64 on CPU), got {str(t.dtype).replace('torch.', '')}")
        if t.dim() != 4:
            raise ValueError(f"pykernels.{op}: expected '{name}' with 4 dimensions [B, H, S, D], "
                             f"got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"pykernels.{op}: expected q, k, v of one dtype, got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")
    B, H, Sq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"pykernels.{op}: expected the same batch size B in q, k, v, got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"pykernels.{op}: expected 'k' and 'v' with the same [B, Hkv, S_k], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[3] != D or v.shape[3] != D:
        raise ValueError(f"pykernels.{op}: expected q, k, v with the same head dim D (the last), got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if D == 0:
        raise ValueError(f"pykernels.{op}: expected head dim D >= 1, got 0")
    Hkv = k.shape[1]
    if (Hkv == 0 and H != 0) or (Hkv != 0 and H % Hkv != 0):
        raise ValueError(f"pykernels.{op}: expected the query heads H={H} to be a multiple of the "
                         f"key/value heads Hkv={Hkv} (GQA/MQA)")
    if backend not in ("auto", "cpu", "cuda", "triton"):
        raise ValueError(f"pykernels.{op}: expected backend 'auto', 'cpu', 'cuda' or 'triton', "
                         f"got {backend!r}")
    if isinstance(scale, np.ndarray) and torch.compiler.is_compiling():
        # dynamo traces a numpy scalar argument as a 0-d array, whose float() is a symbolic float that the
        # op's schema refuses (a RuntimeError of the fake kernel that named nothing of ours), and whose
        # dtype it cannot read
        raise TypeError(f"pykernels.{op}: under torch.compile, expected 'scale' as a Python float or "
                        "None, got a numpy scalar (traced as an array): pass float(scale) from outside the "
                        "compiled function")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"pykernels.{op}: expected 'scale' to be a real number or None, got "
                        f"{type(scale).__name__}")
    if scale is None or torch.compiler.is_compiling():
        # a scale that is an argument of a compiled function is symbolic: these value checks would make
        # dynamo specialize on it, and math.isfinite broke the fullgraph trace on its second value
        # (review finding); the eager call of the same code checks it
        return
    if not _native.finite_real(scale):
        raise ValueError(f"pykernels.{op}: expected 'scale' to be a finite float or None, got {scale!r}")
    if q.dtype != torch.float64 and abs(float(scale)) > torch.finfo(torch.float32).max:
        raise ValueError(f"pykernels.{op}: expected 'scale' within float32's range for "
                         f"{str(q.dtype).replace('torch.', '')} inputs (scores are computed in float32), got {scale!r}")


def _check_backward(dout, dlse, q, k, v, out, lse):
    """The shapes, dtypes and devices of flash_attention_backward's other tensors (q, k, v checked)."""
    B, H, Sq, D = q.shape
    for name, t, shape in (("dout", dout, (B, H, Sq, D)), ("out", out, (B, H, Sq, D)), ("lse", lse, (B, H, Sq)),
                           ("dlse", dlse, (B, H, Sq))):
        if t is None and name == "dlse":
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"pykernels.flash_attention_backward: expected '{name}' of shape {shape}, got {got}")
    if dout.dtype != q.dtype or out.dtype != q.dtype:
        raise TypeError(f"pykernels.flash_attention_backward: expected 'dout' and 'out' of dtype {q.dtype}, "
                        f"got {dout.dtype} and {out.dtype}")
    if lse.dtype not in (torch.float32, torch.float64):  # a float16 lse (3 decimal digits) was taken as is
        raise TypeError(f"pykernels.flash_attention_backward: expected a float32 'lse' (float64 allowed), got "
                        f"{lse.dtype}")
    if dlse is not None and not dlse.is_floating_point():
        raise TypeError(f"pykernels.flash_attention_backward: expected a floating 'dlse', got {dlse.dtype}")
    check_same_device(OP_BWD, q=q, k=k, v=v, dout=dout, out=out, lse=lse, dlse=dlse)


def _check_flag(name: str, value, op: str = OP) -> bool:
    # bool(value) would make causal="no" (any non-empty string) silently causal: only real booleans.
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"pykernels.{op}: expected '{name}' to be a bool, got "
                        f"{type(value).__name__} {value!r}")
    return bool(value)


def flash_attention(q, k, v, *, causal: bool = False, scale: Optional[float] = None, return_lse: bool = False,
                    backend: str = "auto"):
    """Scaled dot-product attention of q [B, H, S_q, D] over k, v [B, Hkv, S_k, D] (H % Hkv == 0).

    Returns `out` [B, H, S_q, D] in q's dtype, or `(out, lse)` with `return_lse=True`, lse [B, H, S_q]
    float32 (natural log; float64 for float64 inputs). `causal=True` aligns the mask bottom-right
    (row i sees keys j <= i + S_k - S_q); rows that see no key give out 0 and lse -inf (and zero
    gradient), even when some v is NaN/inf. As in torch's SDPA, a NaN/inf in a v that a row does not see
    but that shares a tile with keys it does (the masked probability is 0, and 0 * NaN is NaN) may still
    reach that row. Differentiable in q, k, v (and through lse). dtypes float32/bfloat16/float16
    (float64 on CPU). Under torch.autocast, q, k, v are cast to its dtype first, as SDPA's are.
    Layouts: on CPU, out comes in q's memory order and lse in [B, S_q, H] memory order (as aten's kernels
    write them, no copy; SDPA's out is not contiguous either): `lse.contiguous()` before a `view`.
    """
    if torch._C._is_any_autocast_enabled():
        q, k, v = autocast_floats(*(_native.as_tensor(t, OP, n) for t, n in ((q, "q"), (k, "k"), (v, "v"))))
        with autocast_off_if(not torch.compiler.is_compiling()):
            return _flash_attention(q, k, v, causal, scale, return_lse, backend)
    return _flash_attention(q, k, v, causal, scale, return_lse, backend)


def _flash_attention(q, k, v, causal, scale, return_lse, backend):
    lean = _lean_cpu_forward(q, k, v, causal, scale, backend)
    if lean is not None:
        if type(return_lse) is not bool:
            _check_flag("return_lse", return_lse)
        return lean if return_lse else lean[0]
    q = _native.as_tensor(q, OP, "q")
    k = _native.as_tensor(k, OP, "k")
    v = _native.as_tensor(v, OP, "v")
    _check(q, k, v, scale, backend)
    causal, return_lse = _check_flag("causal", causal), _check_flag("return_lse", return_lse)
    check_same_device(OP, q=q, k=k, v=v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out, lse = forward_op(q, k, v, bool(causal), scale, backend)
    return (out, lse) if return_lse else out


_LEAN_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))
_CPU_ONLY = ("cpu",)  # what the lean path accepts from dispatch (anything else: the general path)
_FLOAT32_MAX = torch.finfo(torch.float32).max
_STRIDED = torch.strided


_LEAN_PLANS: dict = {}


def _lean_cpu_forward(q, k, v, causal, scale, backend):
    """flash_attention's most common eager CPU call with the few checks it needs: plain CPU tensors of one
    float dtype (not float64), well-formed [B, H, S, D] shapes, arguments of the exact types the general
    path accepts, and a problem the chosen implementation runs in ONE kernel call (the native decode, bf16dot
    or fma kernel, which take any strides, so a slice of a preallocated KV cache is read where it lies; or,
    for contiguous tensors, aten's flash kernels when not causal, for one query row or a square causal
    mask). Returns (out, lse) as the general path does, or None for any other call, which takes the general
    path (its checks and errors, autograd, torch.compile, other layouts and backends). Same results: the
    same dispatch (key and config), the same kernel call (_cpu.decode_forward, _cpu.bf16dot_forward,
    _cpu.fma_forward or _cpu.flash_forward), the same check of its result, the same fallback and layouts.
    Why: a decode step (q of one token against 128 cached keys, 8 heads; SDPA ~18 us in all) spent ~20 us
    of Python around a ~13 us kernel here, and ~60 us on the general path when K/V were a slice of a
    cache (k_cache[:, :, :n], not contiguous): generic checks, as_tensor, dispatch, layout fix-ups that
    are no-ops here."""
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
            and type(causal) is bool and (scale is None or type(scale) is float)
            and type(backend) is str and (backend == "auto" or backend == "cpu")):
        return None
    if _traced_or_transformed() or getattr(_BACKWARD_FOLLOWS, "on", False):  # first: torch.compile must not
        return None  # trace the tests below; under backward_follows the general path keeps aten's forward
    if (q.layout is not _STRIDED or k.layout is not _STRIDED or v.layout is not _STRIDED
            or q.is_nested or k.is_nested or v.is_nested):
        return None  # sparse, nested, mkldnn (before anything reads their sizes, which a nested one
        # does not have: audit finding): the general path's errors
    dt = q.dtype
    if (dt not in _LEAN_DTYPES or k.dtype is not dt or v.dtype is not dt
            or not (q.is_cpu and k.is_cpu and v.is_cpu)
            or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            or q.dim() != 4 or k.dim() != 4 or k.shape != v.shape
            or q.is_neg() or k.is_neg() or v.is_neg()):
        return None
    q_contiguous = q.is_contiguous()
    contiguous = q_contiguous and k.is_contiguous() and v.is_contiguous()
    B, H, Sq, D = q.shape
    Bk, Hkv, Sk, Dk = k.shape
    if Bk != B or Dk != D or B == 0 or Sq == 0 or Sk == 0 or D == 0 or Hkv == 0 or H % Hkv:
        return None
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif not (0.0 < scale <= _FLOAT32_MAX):  # also NaN; negative and zero scales: the general path
        return None
    # dispatch's answer per call signature (key and dispatch: ~3 us of a ~25 us decode step); the memo's
    # key holds all it depends on: what problem_key reads (q's shape, the KV heads, S_k's power-of-two
    # bucket, so a decode loop's growing cache keeps hitting it; B and D are q's), the autotune
    # generation (bumped by every stored config), PYKERNELS_AUTOTUNE and the switches. The value: the
    # config and the native forward that runs it (None: aten's flash kernels, or the general path).
    memo_key = (q.shape, Hkv, (Sk - 1).bit_length(), dt, causal, backend, autotune.generation(),
                autotune._enabled(), autotune.switches())
    plan = _LEAN_PLANS.get(memo_key)
    if plan is None:
        _, cfg = dispatch(OP, _CPU, backend, problem_key(q, k, causal=causal), supported=_CPU_ONLY)
        impl = cfg.get("impl", "flash")
        native = (impl == "decode" or (impl == "bf16dot" and _cpu.bf16dot_takes(q))
                  or (impl == "fma" and _cpu.fma_takes(q)))
        plan = (cfg, _NATIVE_FORWARDS[impl] if native else None, impl == "flash")
        if len(_LEAN_PLANS) >= 4096:  # many distinct shapes (a growing KV cache): start over
            _LEAN_PLANS.clear()
        _LEAN_PLANS[memo_key] = plan  # (never modified by its users: the kernels and checks below read it)
    cfg, native, flash = plan
    if native is not None:  # (the general path's eager call: no backward can follow)
        result = native(q, k, v, causal, scale, cfg)
        if result is None:  # NaN/inf in q or k, a tiny input or a huge scale: the exact path (the general path's too)
            out, lse = _blocked(q, k, v, causal, scale, cfg)
            return _cpu.like_q(out, q), _cpu.to_bshd(lse)
        # out comes in the memory order of the q the kernel read: q's own unless its rows overlapped or its
        # head dim was not dense (then a dense copy's), which the general path lays out as q's afterwards
        return result if q_contiguous else (_cpu.like_q(result[0], q), result[1])
    if not flash or not contiguous or (causal and Sq != 1 and Sq != Sk):
        return None
    out, lse = _cpu.flash_forward(q, k, v, causal, scale)
    # _flash_result_stands for these problems (every row sees keys; one aten call, so a row of -inf or NaN
    # scores shows as an lse of exactly 0), without its general cases
    nonfinite, zero = _cpu.lse_flags(lse, 0)
    if (nonfinite or zero) and not _cpu.patch_rows(q, k, v, causal, scale, out, lse):
        return None  # many such rows: the general path recomputes the call exactly
    return _cpu.like_q(out, q), _cpu.to_bshd(lse)


# The entries the public functions and collectives' ring attention call: the implementation directly
# where there is nothing to trace or differentiate (eager_direct), else the registered op. Through the op
# the first call of a process imported torch._dynamo (~1.2 s) and every call paid its dispatch layers.
_IN_TRANSFORM = threading.local()  # .on: this thread's op call came through a functorch transform
_BACKWARD_FOLLOWS = threading.local()  # .on: a caller's own autograd.Function differentiates this forward
# How many backward_follows(True) blocks are open in any thread: what a call being traced by torch.compile
# reads instead (dynamo does not trace threading.local; it reads a module global as a constant and
# guards on it, so a change recompiles). Process-wide, so another thread's block also makes a traced
# call take aten's kernels: only slower, never wrong (review finding: inside torch.compile the flag was
# ignored and the decode kernel's lse gave gradients off by ~1e-1 at logits ~1e4).
_FOLLOWS_ANYWHERE = 0
_FOLLOWS_LOCK = threading.Lock()


def _new_follows_lock_after_fork():
    # another thread inside backward_follows when the process forked left the lock held in the child
    # (review finding); the count may keep that thread's blocks: only slower, never wrong (see above)
    global _FOLLOWS_LOCK
    _FOLLOWS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_follows_lock_after_fork)


@contextlib.contextmanager
def backward_follows(on: bool = True):
    """For callers that run the forward under no_grad inside their own autograd.Function and then call
    flash_attention_backward on its (out, lse) (collectives' ring attention): no autograd state says a
    backward follows there, so without this the CPU decode kernel could run, whose lse does not match
    aten's backward (see _forward_impl). Thread-local; nests."""
    global _FOLLOWS_ANYWHERE
    before = getattr(_BACKWARD_FOLLOWS, "on", False)
    _BACKWARD_FOLLOWS.on = bool(on)
    if on:
        with _FOLLOWS_LOCK:
            _FOLLOWS_ANYWHERE += 1
    try:
        yield
    finally:
        _BACKWARD_FOLLOWS.on = before
        if on:
            with _FOLLOWS_LOCK:
                _FOLLOWS_ANYWHERE -= 1


# eager calls whose inputs require grad (eager_autograd): the op's autograd without its layers (~90 us of a
# 1x8x32x64 causal fwd+bwd: 568 -> 474 us, one thread, 2-core Zen 4; SDPA ~230 us, aten's two kernels alone
# ~170 us); an unused lse gets None in the backward, not zeros to allocate and scan
_EagerFlashAttention = eager_autograd_function(
    "_EagerFlashAttention", lambda q, k, v, causal, scale, backend: _forward_laid_out(q, k, v, causal, scale, backend,
                                                                                      inference=False),
    _setup_context, _backward, materialize_grads=False)


def forward_op(q, k, v, causal: bool, scale: float, backend: str):
    # Whether a backward can follow is decided here, where torch.compile traces the autograd state (an
    # input computed inside a compiled function requires grad at trace time, not inside the op at run
    # time); the thread-local is read only outside tracing (dynamo does not trace threading.local), the
    # process-wide count of backward_follows blocks while tracing.
    if torch.compiler.is_compiling():
        follows = _FOLLOWS_ANYWHERE > 0
    else:
        follows = getattr(_BACKWARD_FOLLOWS, "on", False)
    if eager_direct(q, k, v, op=OP):  # nothing traced nor differentiated: only a caller's own backward can follow
        return _forward_laid_out(q, k, v, causal, scale, backend, inference=not follows)
    if eager_autograd(q, k, v):  # eager, and an input requires grad: our autograd.Function, not the op's
        return _EagerFlashAttention.apply(q, k, v, causal, scale, backend)
    inference = not (follows or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)))
    if torch._C._get_tracing_state() is not None:
        # torch.jit.trace records the flag as a constant and checks its trace by running the function again
        # under no_grad: grad mode in it made "Graphs differed" for a model whose q/k/v come from parameters
        # (audit finding). Traced, it follows only backward_follows; the op itself refuses the decode kernel
        # where an input requires grad when the graph runs
        inference = not follows
    if torch._C._are_functorch_transforms_active() and not torch.compiler.is_compiling():
        _IN_TRANSFORM.on = True
        try:
            return _flash_attention_call(q, k, v, causal, scale, backend, inference)
        finally:
            _IN_TRANSFORM.on = False
    return _flash_attention_call(q, k, v, causal, scale, backend, inference)


def backward_op(dout, dlse, q, k, v, out, lse, causal: bool, scale: float, backend: str, contiguous: bool = True):
    """`contiguous=False` (autograd's own backward, which takes gradients in any layout): dq, dk, dv as the
    kernel wrote them (aten's come [B, S, H, D] in memory); three copies were ~5% of a 1024-token fp32
    backward, SDPA's gradients are not copied either. Else contiguous, as the registered op returns them."""
    if eager_direct(dout, dlse, q, k, v, out, lse, op=OP_BWD):
        dq, dk, dv = _backward_impl(dout, dlse, q, k, v, out, lse, causal, scale, backend)
        return (dq.contiguous(), dk.contiguous(), dv.contiguous()) if contiguous else (dq, dk, dv)
    return _flash_attention_backward_call(dout, dlse, q, k, v, out, lse, causal, scale, backend)


def flash_attention_backward(dout, q, k, v, out, lse, *, causal: bool = False, scale: Optional[float] = None,
                             dlse=None, backend: str = "auto"):
    """dq, dk, dv of attention of q over (k, v) given an `out` and `lse` computed elsewhere.

    The building block of ring/context-parallel attention (BurstAttention, ring-flash-attention): with
    the *global* out and lse of the queries (merged over every key block), P = exp(S - lse) is the
    block's exact share of the softmax, so calling this once per key block gives that block's dk/dv
    and a partial dq that sums to the full dq. `dlse` is the gradient flowing into lse, if any.
    Same layouts, dtypes and causal alignment as `flash_attention`; lse is float32 [B, H, S_q].
    An out/lse from a call that recorded no autograd graph may come from the CPU decode kernel (a few
    query rows per KV head): its lse differs from aten's in the last bits, which at logits in the 1e4
    range is ~1e-3 relative in P; compute them with grad enabled, or under no_grad inside
    `with pykernels.attention.backward_follows():` (as ring attention does), where that matters.
    """
    q, k, v, dout, out, lse = (_native.as_tensor(t, OP_BWD, name) for t, name in
                               ((q, "q"), (k, "k"), (v, "v"), (dout, "dout"), (out, "out"), (lse, "lse")))
    if dlse is not None:
        dlse = _native.as_tensor(dlse, OP_BWD, "dlse")  # numpy too, as q, k, v (review finding)
    _check(q, k, v, scale, backend, OP_BWD)
    causal = _check_flag("causal", causal, OP_BWD)
    _check_backward(dout, dlse, q, k, v, out, lse)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return backward_op(dout, dlse, q, k, v, out, lse, bool(causal), scale, backend)


from . import _tuning  # noqa: E402,F401  (registers the Tunables)
