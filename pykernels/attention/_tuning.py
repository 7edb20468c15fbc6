"""Autotune declarations of flash_attention (see pykernels.autotune).

CPU: which implementation ("flash" = aten's CPU flash kernels, wrapped; "blocked" = BLAS-tiled) and,
for "blocked", how many score elements one row chunk holds. Measured on a 2-core Zen 3 (fp32/bf16,
S = 256..2048, D = 64/128), aten's kernels won the forward by 1.9-3x and the backward by 1.2-2.6x over
"blocked", which stays a candidate (and is the backward whenever an input holds NaN/inf, which aten's
kernels turn into zeros for a query row, and, but for "bf16dot" and "fma", whenever the LSE output has a
gradient, which aten's backward cannot take). Native: "decode" (forward only, a few query rows against a
KV cache, where no backward follows), "bf16dot" (forward and backward, bfloat16 on CPUs with AVX-512 BF16)
and "fma" (fp32 FMAs on AVX2 or AVX-512, forward and backward) are candidates and the defaults of their
problems (see _cpu_fwd_default, _cpu_bwd_default); "flash" is the default elsewhere.

Triton: BLOCK_M x BLOCK_N tiles, warps and pipeline stages per head-dim bucket; the candidate lists are
`_triton_configs.fwd_configs(d, dtype)` / `bwd_configs(d, dtype)`, every one of which is compiled for sm_90 by
tests/test_gpu_build.py (AOT_SPECS) and must fit without spills.

`python -m pykernels.autotune generate --ops attention [--sizes 1024,4096]` tunes forward and backward
for the example shapes below (B=1, H=8, S=size, D=64/128, causal and not, the dtype of the device).
"""
from __future__ import annotations

import math

import torch

from .. import autotune
from . import _cpu, problem_key, _forward_impl, _backward_impl, OP, OP_BWD

_CPU_DEFAULT = {"impl": "flash"}
_CPU_CANDIDATES = [{"impl": "flash"}, {"impl": "blocked", "chunk_elems": 1 << 18},
                   {"impl": "blocked", "chunk_elems": 1 << 22}]
# the native decode kernel (forward only): multiply-adds per thread before a second thread joins. 2^15:
# on the 2-core EPYC (2026-12-04), steps of 2^17-2^18 multiply-adds (8 heads x 256-512 keys x D=64; 32/8
# heads x 64 keys x D=128; one head x 2048 keys x D=128) took 1.1-1.9x less time on two threads than
# on one (2^18 kept them on one); 2026-12-05, steps of 2^15-2^16 (8 heads x 96-128 keys x D=64, 32/8
# heads x 16 keys x D=128, fp32 and bf16) 1.13-1.37x less, in cache (the same tensors again) and out of
# it (160 caches in turn), than on one (2^16 kept them there); 2^15-work steps stay on one thread, where
# the second's wake-up cost more in cache (13.0 vs 15.9 us for 4 heads x 128 keys x D=64)
_DECODE_DEFAULT = {"impl": "decode", "grain": _cpu.DECODE_GRAIN}
_DECODE_DEFAULT_ROWS = 32
_DECODE_CANDIDATES = [{"impl": "decode", "grain": g} for g in (_cpu.DECODE_GRAIN, 1 << 16, 1 << 18, 1 << 20)]


# bfloat16 on a CPU with AVX-512 BF16 (csrc/attention/attention_cpu.cpp's prefill kernel)
_BF16DOT = {"impl": "bf16dot"}
# ... the default from this much work (buckets of B*H, S_q, S_k times D): 2-core EPYC (Zen 4), 2026-12-05, 8
# heads x D=64, causal, kernel / SDPA time: S=16 1.37, 32 1.21, 48 0.80, 64 0.77, 128 0.60 (S=33..64 are the
# bucket 64: 8 * 64 * 64 * 64 = 2^21)
_BF16DOT_DEFAULT_WORK = 1 << 21


# fp32 FMAs on AVX2 or AVX-512 (csrc/attention/attention_cpu.cpp's fma kernel): forward and backward
_FMA = {"impl": "fma"}


def _cpu_fwd_default(key):
    """"decode" up to 32 query rows per KV head; "bf16dot" for bfloat16 from 2^21 of work where the CPU has
    AVX-512 BF16; "fma" where the CPU has AVX2 (whose backward is the default too); else aten's kernels.
    "decode" measured on a 2-core EPYC VM (an AVX-512 CPU, the kernel's AVX2 tier; H=32, D=128, one
    process, decode kernel / SDPA time): S_q=1 with 8 KV heads over 1K-8K keys 0.31-0.45 (fp32) and
    0.06-0.11 (bf16); 32 KV heads 0.62 / 0.18; S_q=4 with 8 KV heads (16 rows) 0.87 / 0.69; S_q=16 (64
    rows) 0.77 fp32 but 1.10 bf16, so from 33 rows it is only a candidate."""
    if _cpu.decode_applies(key) and key["gqa"] * key["sq"] <= _DECODE_DEFAULT_ROWS:
        return dict(_DECODE_DEFAULT)
    if _cpu.bf16dot_applies(key) and key["bh"] * key["sq"] * key["sk"] * key["d"] >= _BF16DOT_DEFAULT_WORK:
        return dict(_BF16DOT)
    if _cpu.fma_applies(key):
        # Measured on a 2-core EPYC (Zen 2, AVX2 only; aten's blocks run through its BLAS there), 2026-12-06,
        # B=1, H=8, one process, SDPA / kernel time, fp32 (bf16): S=128 D=64 1.07 (1.05); S=256 D=64
        # causal 1.72 (1.72); S=512 D=64 1.13 (1.15); S=512 D=128 causal 1.75 (1.68); S=1024 D=64 0.95
        # (0.94), causal 1.67 (1.29); S=1024 D=128 1.16 (0.93); S=2048 D=128 causal 1.13 (1.16); S=4096
        # D=64 causal 1.10 (1.16); B=4 S=512 D=64 1.39 (1.05); GQA 32/8 S=1024 D=128 causal 1.34, MQA
        # 16/1 1.54 (1.37). On a 2-core EPYC (Zen 4, the kernel's AVX-512 tier), 2026-12-07, aten's / the
        # kernel's time, fp32 (fp16): S=16 D=64 causal 0.99 (1.34); S=64 1.36 (1.38); S=128 causal 1.80
        # (1.57); S=256 D=128 1.27 (1.19); S=1024 D=64 1.30, causal 1.55; S=1024 D=128 1.34 (1.28); S=2048
        # D=128 causal 1.52; S=4096 D=64 causal 1.27 (1.56); B=4 S=512 causal 2.03 (2.14); GQA 32/8 S=1024
        # D=128 1.29 (1.34), causal 1.77; S_q=100 S_k=300 causal 1.54 (1.51); S=1000 D=80 1.18 (1.50).
        return dict(_FMA)
    return dict(_CPU_DEFAULT)


def _cpu_fwd_candidates(key):
    extra = _DECODE_CANDIDATES if _cpu.decode_applies(key) else []
    extra = extra + ([_BF16DOT] if _cpu.bf16dot_applies(key) else [])
    extra = extra + ([_FMA] if _cpu.fma_applies(key) else [])
    return [dict(c) for c in _CPU_CANDIDATES + extra]


def _cpu_bwd_default(key):
    """"bf16dot" where it applies: its backward took 0.2-0.7x aten's time on a 2-core EPYC (Zen 4),
    2026-12-05, over 8-32 heads x S = 16..2048 x D = 64/128, causal or not, GQA; with fewer (batch, KV head)
    groups than threads (MQA with B = 1) the threads share a group (2026-12-05, H = 4..32 over one KV head,
    S = 256..2048: 0.15-0.45x aten's time on 2 threads). "fma" where it applies (bfloat16 that bf16dot does not
    take, float16, float32), on either tier: float32 on a 2-core EPYC (Zen 4), 2026-12-07, aten's / its
    time, AVX-512 tier (AVX2 tier, PYKERNELS_DISABLE_AVX512=1, against the same aten), B=1, H=8, D=64:
    S=1024 1.40 (1.24), causal 1.86-1.99 (1.48); GQA 8/2 causal 1.78-1.87 (1.62); S_q=256 S_k=2048 causal
    1.52-1.59 (1.39); S=128 causal 1.51-1.57 (1.50); S=2048 D=128 causal 1.57-1.60 (1.15); MQA 16/1 S=1024
    D=128 causal 1.44-2.07 (1.28; its (head, query block) pairs split over the threads). Else aten's
    kernels."""
    if _cpu.bf16dot_applies(key):
        return dict(_BF16DOT)
    if _cpu.fma_applies(key):
        return dict(_FMA)
    return dict(_CPU_DEFAULT)


def _cpu_bwd_candidates(key):
    extra = ([_BF16DOT] if _cpu.bf16dot_applies(key) else []) + ([_FMA] if _cpu.fma_applies(key) else [])
    return [dict(c) for c in _CPU_CANDIDATES + extra]


def _examples(device: str, sizes, with_backward: bool):
    # CPU: float32 and bfloat16 (whose candidates include the bf16dot kernels where the CPU has them)
    dtypes = (torch.float32, torch.bfloat16) if device == "cpu" else (torch.bfloat16,)
    out = []
    for s in sizes or ([1024] if device == "cpu" else [4096, 16384]):
        for dtype in dtypes:
            for d in (64, 128):
                for causal in (False, True):
                    g = torch.Generator().manual_seed(s + d)
                    q, k, v = (torch.randn(1, 8, int(s), d, generator=g).to(device=device, dtype=dtype)
                               for _ in range(3))
                    scale = 1.0 / math.sqrt(d)
                    if not with_backward:
                        out.append(((q, k, v), {"causal": causal, "scale": scale}))
                        continue
                    o, lse = _forward_impl(q, k, v, causal, scale, "auto")
                    out.append(((torch.randn_like(o), q, k, v, o, lse), {"causal": causal, "scale": scale}))
        if device == "cpu" and not with_backward:
            # a decode step of a GQA model (32 query heads, 8 KV heads, D=128) against s cached keys: the
            # decode kernel's thread grain, or aten's kernels, for this machine
            g = torch.Generator().manual_seed(s)
            q = torch.randn(1, 32, 1, 128, generator=g)
            k, v = (torch.randn(1, 8, int(s), 128, generator=g) for _ in range(2))
            out.append(((q, k, v), {"causal": True, "scale": 128 ** -0.5}))
    return out


def _bwd_key(dout, q, k, v, out, lse, causal=False, **_):
    # the problem _backward_impl looks up: a causal call with S_q > S_k runs on its rows that see keys
    dead = q.shape[2] - k.shape[2] if causal and k.shape[2] > 0 else 0
    return problem_key(q[:, :, dead:] if dead > 0 else q, k, causal=causal)


def _run_fwd(backend):
    def run(config, q, k, v, causal=False, scale=None, return_lse=False):
        # return_lse only selects what the op returns: _forward_impl computes lse either way
        scale_ = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale  # (0.0 is a scale)
        return _forward_impl(q, k, v, causal, scale_, backend, config, inference=True)
    return run


def _run_bwd(backend):
    def run(config, dout, q, k, v, out, lse, causal=False, scale=None, dlse=None):
        # dlse as given: a nonzero one sends the CPU backward but bf16dot's down its blocked path, timed so
        scale_ = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        return _backward_impl(dout, dlse, q, k, v, out, lse, causal, scale_, backend, config)
    return run


def _check_fwd(q, k, v, causal=False, scale=None, return_lse=False, backend="auto"):
    """The public op on the example (tune() runs it first): its argument checks, and one warm-up run.
    Every keyword the op takes is taken here and by run (return_lse, and dlse for the backward, made
    tune() raise a TypeError; review finding)."""
    from . import flash_attention

    flash_attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse, backend=backend)


def _check_bwd(dout, q, k, v, out, lse, causal=False, scale=None, dlse=None, backend="auto"):
    from . import flash_attention_backward

    flash_attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, dlse=dlse, backend=backend)


autotune.register(autotune.Tunable(
    op=OP, group="attention", backend="cpu", make_key=problem_key, check=_check_fwd,
    default=_cpu_fwd_default, candidates=_cpu_fwd_candidates,
    run=_run_fwd("cpu"),
    examples=lambda sizes: _examples("cpu", sizes, False),
))
autotune.register(autotune.Tunable(
    op=OP_BWD, group="attention", backend="cpu", make_key=_bwd_key, check=_check_bwd,
    default=_cpu_bwd_default,
    candidates=_cpu_bwd_candidates,
    run=_run_bwd("cpu"),
    examples=lambda sizes: _examples("cpu", sizes, True),
))


def _register_triton():
    from . import _triton_configs as tc

    import os

    # Under TRITON_INTERPRET=1 (CPU tensors) small tiles: the interpreter's cost grows with the tile.
    def fwd_default(key):
        if os.environ.get("TRITON_INTERPRET") == "1":
            return dict(tc.INTERPRET_FWD)
        return dict(tc.default_fwd(key["d"], key["dtype"]))

    def bwd_default(key):
        if os.environ.get("TRITON_INTERPRET") == "1":
            return dict(tc.INTERPRET_BWD)
        return dict(tc.default_bwd(key["d"], key["dtype"]))

    def device_examples(with_backward):
        def ex(sizes):
            if not torch.cuda.is_available():
                return []
            return _examples("cuda", sizes, with_backward)
        return ex

    autotune.register(autotune.Tunable(
        op=OP, group="attention", backend="triton", make_key=problem_key, default=fwd_default, check=_check_fwd,
        candidates=lambda key: [dict(c) for c in tc.fwd_configs(key["d"], key["dtype"])],
        run=_run_fwd("triton"), examples=device_examples(False),
    ))
    autotune.register(autotune.Tunable(
        op=OP_BWD, group="attention", backend="triton", make_key=_bwd_key, default=bwd_default, check=_check_bwd,
        candidates=lambda key: [dict(c) for c in tc.bwd_configs(key["d"], key["dtype"])],
        run=_run_bwd("triton"), examples=device_examples(True),
    ))


_register_triton()
