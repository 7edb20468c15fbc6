"""flash_attention vs torch.nn.functional.scaled_dot_product_attention (what a user would call), forward
and forward+backward, same process, interleaved (bench.common.time_pair).

Work is counted in FLOP as FlashAttention's papers count it: forward = 4*B*H*S_q*S_k*D (QK^T and PV),
halved for causal square masks; backward = 2.5x forward (five GEMMs against two), so
forward+backward = 3.5x forward. Attention is compute-bound, so there is no %-of-bandwidth column.

CPU: default sizes S = 1024/2048 (about a minute in all), quick S = 256. GPU (`python -m bench --gpu`):
S = 4k..32k, bf16, D = 128, against SDPA restricted to its flash backend.
"""
from __future__ import annotations

import torch

from bench.common import Case

GROUP = "attention"


def _flops(B, H, Sq, Sk, D, causal, backward):
    f = 4.0 * B * H * Sq * Sk * D
    if causal:
        f /= 2
    return f * (3.5 if backward else 1.0)


def _make(B, H, Hkv, S, D, causal, dtype, device, backward):
    def make():
        import pykernels
        import torch.nn.functional as F

        g = torch.Generator(device="cpu").manual_seed(0)
        q = torch.randn(B, H, S, D, generator=g).to(device=device, dtype=dtype)
        k = torch.randn(B, Hkv, S, D, generator=g).to(device=device, dtype=dtype)
        v = torch.randn(B, Hkv, S, D, generator=g).to(device=device, dtype=dtype)
        gqa = H != Hkv

        def sdpa(q_, k_, v_):
            if device == "cuda":
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, enable_gqa=gqa)
            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, enable_gqa=gqa)

        def ours_fn(q_, k_, v_):
            return pykernels.flash_attention(q_, k_, v_, causal=causal)

        if not backward:
            return (lambda: ours_fn(q, k, v)), (lambda: sdpa(q, k, v))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        dout = torch.randn(B, H, S, D, generator=g).to(device=device, dtype=dtype)

        def fwd_bwd(fn):
            def run():
                for t in (qg, kg, vg):
                    t.grad = None
                fn(qg, kg, vg).backward(dout)
            return run

        return fwd_bwd(ours_fn), fwd_bwd(sdpa)

    return make


def cases(quick: bool, device: str = "cpu"):
    if device == "cuda":
        if not torch.cuda.is_available():
            return
        seqs = [4096, 16384] if quick else [4096, 8192, 16384, 32768]
        shapes = [(1, 16, 16, s, 128, c, torch.bfloat16) for s in seqs for c in (False, True)]
        shapes += [(1, 32, 8, 8192, 128, True, torch.bfloat16)]  # GQA 4:1
    else:
        s = 256 if quick else 1024
        shapes = [(1, 8, 8, s, 64, False, torch.float32), (1, 8, 8, s, 64, True, torch.float32),
                  (1, 8, 2, s, 64, True, torch.float32),             # GQA 4:1
                  (1, 8, 8, 2 * s, 128, True, torch.bfloat16)]
    for B, H, Hkv, S, D, causal, dtype in shapes:
        for backward in (False, True):
            dt = str(dtype).replace("torch.", "")
            label = (f"{dt} B={B} H={H}" + (f"/{Hkv}" if Hkv != H else "") + f" S={S} D={D}"
                     + (" causal" if causal else ""))
            yield Case(
                group=GROUP, op="flash_attention" + (" fwd+bwd" if backward else " fwd"), label=label,
                size=float(S), make=_make(B, H, Hkv, S, D, causal, dtype, device, backward),
                baseline_name="F.scaled_dot_product_attention" + (" (flash)" if device == "cuda" else ""),
                work=_flops(B, H, S, S, D, causal, backward), unit="FLOP", device=device,
                notes="CPU path: aten CPU flash kernels wrapped (bottom-right causal, GQA)" if device == "cpu"
                else "Triton FlashAttention-2 kernels",
            )
