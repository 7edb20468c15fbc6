"""flash_attention vs torch.nn.functional.scaled_dot_product_attention (what a user would call), forward
and forward+backward, same process, interleaved (bench.common.time_pair).

Work is counted in FLOP as FlashAttention's papers count it: forward = 4*B*H*S_q*S_k*D (QK^T and PV),
halved for causal square masks; backward = 2.5x forward (five GEMMs against two), so
forward+backward = 3.5x forward. Attention is compute-bound, so there is no %-of-bandwidth column.

CPU: default sizes S = 1024/2048 (about a minute in all), quick S = 256. GPU (`python -m bench --gpu`):
S = 4k..32k, bf16, D = 128, against SDPA restricted to its flash backend.

Every case first checks ours against SDPA: the output (and dq, dk, dv for fwd+bwd) elementwise within
TOLERANCE of its dtype, |ours - sdpa| <= atol * max|sdpa| + rtol * |sdpa| (the absolute part scaled to
the tensor, as gradients' magnitudes vary with the shape).
"""
from __future__ import annotations

import torch

from bench.common import Case, ResultMismatch, assert_close

GROUP = "attention"
# The checks' (atol as a fraction of the baseline's max |element|, rtol) per dtype. On the CPU ours runs
# aten's flash kernels (bit-identical to SDPA) but in the decode steps, whose worst element needed an atol
# of 3e-7 (float32, with rtol 1e-4) and 1.2e-3 (bfloat16, with rtol 2e-2), in bfloat16 forwards (the
# bf16dot kernel: the same precision choices as aten's, its own order of summation, so a few bf16
# roundings apart) and in float16 (computed in float32: ours is the more accurate, a few fp16 roundings).
# The GPU's bf16 Triton kernels against SDPA's flash backend: a few bf16 roundings apart.
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 2e-2), torch.float16: (1e-2, 2e-2)}
_PARTS = ("out", "dq", "dk", "dv")


def _check_close(ours, baseline, inputs=None):
    """ours against the baseline within TOLERANCE; where a 16-bit case differs beyond it, both against the
    float64 answer (`inputs`: what the case's make() drew), accepting ours when it is at least as close as
    the baseline: aten's bf16 CPU backward rounds P and dS to bf16 and was the one off (MQA 16/1 x 1024 x
    128 causal: dk max error 0.125 against float64, ours through fp32 0.031)."""
    if not isinstance(ours, tuple):
        ours, baseline = (ours,), (baseline,)
    if len(ours) != len(baseline):
        raise ResultMismatch(f"{len(ours)} outputs, baseline {len(baseline)}")
    try:
        for name, y, y_base in zip(_PARTS, ours, baseline):
            atol, rtol = TOLERANCE[y_base.dtype]
            scale = float(y_base.detach().abs().max())
            assert_close(name, y, y_base, atol=atol * scale, rtol=rtol)
    except ResultMismatch as mismatch:
        if not inputs or ours[0].dtype == torch.float32:
            raise
        exact = _float64_answer(len(ours) > 1, **inputs)
        for name, y, y_base, want in zip(_PARTS, ours, baseline, exact):
            err, err_base = ((t.detach().cpu().double() - want).abs().max().item() for t in (y, y_base))
            if not err <= err_base + 1e-6 * float(want.abs().max()):
                raise ResultMismatch(f"{mismatch}; and {name} is further from the float64 answer than the "
                                     f"baseline's: max abs error {err:.4g} vs {err_base:.4g}") from mismatch


def _checker(inputs: dict):
    def check(ours, baseline):
        try:
            _check_close(ours, baseline, inputs)
        finally:
            inputs.clear()  # (the case's tensors are not kept past its check)
    return check


def _float64_answer(backward, q, k, v, dout, mask, causal):
    """out (and dq, dk, dv) in float64 on the CPU: SDPA's math on float64 copies of the case's inputs, one
    (batch, head) at a time on the inputs' device. (All heads at once on the CPU, a GPU case of S = 32768
    and 16 heads would have built 128 GiB of scores, the GPU machine's whole memory; review finding.)"""
    import torch.nn.functional as F

    B, H, Hkv = q.shape[0], q.shape[1], k.shape[1]
    kw = dict(attn_mask=mask) if mask is not None else dict(is_causal=causal)
    outs = [torch.empty(t.shape, dtype=torch.float64) for t in ((q, q, k, v) if backward else (q,))]
    for b in range(B):
        for h in range(H):
            hk = h // (H // Hkv)
            leaves = [t[b, i].detach().double().requires_grad_(backward) for t, i in ((q, h), (k, hk), (v, hk))]
            out = F.scaled_dot_product_attention(*leaves, **kw)
            outs[0][b, h] = out.detach().cpu()
            if backward:
                dq, dk, dv = torch.autograd.grad(out, leaves, dout[b, h].double())
                outs[1][b, h] = dq.cpu()
                if h % (H // Hkv) == 0:
                    outs[2][b, hk], outs[3][b, hk] = 0, 0
                outs[2][b, hk] += dk.cpu()
                outs[3][b, hk] += dv.cpu()
    return tuple(outs)


def _flops(B, H, Sq, Sk, D, causal, backward):
    """Multiply-adds x 2 of QK^T and PV over the pairs the mask keeps: with the bottom-right causal mask,
    query i sees Sk - Sq + i + 1 keys (a rectangle counted for Sq < Sk overstated the chunked prefill
    by 6.6%; audit finding)."""
    pairs = Sq * Sk - Sq * (Sq - 1) / 2 if causal else Sq * Sk
    return 4.0 * B * H * D * pairs * (3.5 if backward else 1.0)


# A decode step's "layers" case cycles through this many bytes of KV caches (4x the 32 MiB L3 of the dev VM):
# each call reads a cache the previous calls have pushed out of the CPU caches, as a model's layers do.
LAYERS_BYTES = 128 << 20  # (ours and the baseline: each its own)


def _make(B, H, Hkv, S, D, causal, dtype, device, backward, Sk=None, inputs=None, cache=None, layers=False):
    """The case's make(); `inputs` (a dict), when given, receives what it draws for the check's float64
    answer. `cache`: k and v are the first Sk positions of a preallocated cache of that many (a decode
    loop's usual tensors: k_cache[:, :, :n], not contiguous). `layers`: q, k, v of L layers (LAYERS_BYTES
    of K/V in all), one after the other call by call, ours and the baseline each from the first layer and
    each over its own copies (so neither finds in the L3 a cache the other just read)."""
    Sk = S if Sk is None else Sk

    def make():
        import pykernels
        import torch.nn.functional as F

        g = torch.Generator(device="cpu").manual_seed(0)
        q = torch.randn(B, H, S, D, generator=g).to(device=device, dtype=dtype)
        k = torch.randn(B, Hkv, Sk, D, generator=g).to(device=device, dtype=dtype)
        v = torch.randn(B, Hkv, Sk, D, generator=g).to(device=device, dtype=dtype)
        if layers:
            n_layers = max(2, LAYERS_BYTES // (2 * k.numel() * k.element_size()))
            stack = [(q, k, v)] + [tuple(torch.randn(t.shape, generator=g).to(device=device, dtype=dtype)
                                         for t in (q, k, v)) for _ in range(n_layers - 1)]
        if cache is not None:
            k_cache, v_cache = (torch.zeros(B, Hkv, cache, D, device=device, dtype=dtype) for _ in range(2))
            k_cache[:, :, :Sk], v_cache[:, :, :Sk] = k, v
            k, v = k_cache[:, :, :Sk], v_cache[:, :, :Sk]
        gqa = H != Hkv
        # SDPA's is_causal is top-left aligned when S_q != S_k; a user wanting flash-attn's bottom-right
        # mask (chunked prefill against a KV cache) passes it explicitly.
        mask = (torch.ones(S, Sk, dtype=torch.bool, device=device).tril(Sk - S)
                if causal and S != Sk else None)

        def sdpa(q_, k_, v_):
            kw = dict(attn_mask=mask) if mask is not None else dict(is_causal=causal)
            if device == "cuda" and mask is None:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q_, k_, v_, enable_gqa=gqa, **kw)
            return F.scaled_dot_product_attention(q_, k_, v_, enable_gqa=gqa, **kw)

        def ours_fn(q_, k_, v_):
            return pykernels.flash_attention(q_, k_, v_, causal=causal)

        if inputs is not None:
            inputs.update(q=q, k=k, v=v, dout=None, mask=mask, causal=causal)
        if layers:
            def in_turn(fn, layers_):
                at = [-1]

                def run():
                    at[0] = (at[0] + 1) % len(layers_)
                    return fn(*layers_[at[0]])
                return run
            theirs = [tuple(t.clone() for t in layer) for layer in stack]
            return in_turn(ours_fn, stack), in_turn(sdpa, theirs)
        if not backward:
            return (lambda: ours_fn(q, k, v)), (lambda: sdpa(q, k, v))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        dout = torch.randn(B, H, S, D, generator=g).to(device=device, dtype=dtype)
        if inputs is not None:
            inputs["dout"] = dout

        def fwd_bwd(fn):
            def run():
                for t in (qg, kg, vg):
                    t.grad = None
                out = fn(qg, kg, vg)
                out.backward(dout)
                return out, qg.grad, kg.grad, vg.grad  # for the check (no work: the tensors exist)
            return run

        return fwd_bwd(ours_fn), fwd_bwd(sdpa)

    return make


def _cpu_notes(S: int, dtype) -> str:
    if S == 1:
        return "CPU path: the native flash-decoding kernel (one pass over K/V per KV head)"
    return ("CPU path: " + ("the bf16dot kernels (AVX-512 BF16) where the CPU has them, else " if
                            dtype == torch.bfloat16 else "")
            + "aten CPU flash kernels wrapped (bottom-right causal, GQA"
            + ("; float16 through their float32 kernels" if dtype == torch.float16 else "") + ")")


def cases(quick: bool, device: str = "cpu"):
    if device == "cuda":
        if not torch.cuda.is_available():
            return
        seqs = [4096, 16384] if quick else [4096, 8192, 16384, 32768]
        shapes = [(1, 16, 16, s, 128, c, torch.bfloat16, None) for s in seqs for c in (False, True)]
        shapes += [(1, 32, 8, 8192, 128, True, torch.bfloat16, None)]  # GQA 4:1
    else:
        s = 256 if quick else 1024
        shapes = [(1, 8, 8, s, 64, False, torch.float32, None), (1, 8, 8, s, 64, True, torch.float32, None),
                  (1, 8, 2, s, 64, True, torch.float32, None),             # GQA 4:1
                  (1, 8, 8, 2 * s, 128, True, torch.bfloat16, None),
                  (1, 8, 8, s, 64, False, torch.bfloat16, None), (1, 32, 8, s, 128, True, torch.bfloat16, None),
                  (1, 16, 1, s, 128, True, torch.bfloat16, None),          # MQA: one KV head, fewer than threads
                  (1, 8, 8, s, 64, True, torch.float16, None),
                  (1, 8, 8, s // 4, 64, True, torch.float32, 2 * s)]      # chunked prefill, bottom-right
    if device == "cpu":
        # decode steps: one query token against a KV cache (causal then sees every key; SDPA without a
        # mask), where a call's fixed cost is a large part of its time
        shapes += [(1, 8, 8, 1, 64, False, torch.float32, 128), (1, 8, 2, 1, 128, False, torch.float32, 256),
                   (1, 32, 8, 1, 128, False, torch.float32, 1024),
                   (1, 32, 8, 1, 128, False, torch.bfloat16, 1024)]
    for B, H, Hkv, S, D, causal, dtype, Sk in shapes:
        Sk_ = S if Sk is None else Sk
        # decode steps are also measured as a decode loop calls them: K/V a slice of a preallocated cache, and
        # as a model's layers do, each step reading a cache out of the CPU's caches (fp32)
        variants = [(False, None, False), (True, None, False)]
        if S == 1:
            variants = [(False, None, False), (False, 4096, False)] + ([(False, None, True)]
                                                                        if dtype == torch.float32 else [])
        for backward, cache, layers in variants:
            dt = str(dtype).replace("torch.", "")
            label = ("decode step " if S == 1 else "") + (f"{dt} B={B} H={H}" + (f"/{Hkv}" if Hkv != H else "")
                     + (f" S={S}" if Sk is None else f" Sq={S} Sk={Sk}") + f" D={D}" + (" causal" if causal else "")
                     + (f" (K/V: [:, :, :{Sk}] of a {cache}-key cache)" if cache else "")
                     + (f" (KV caches of {LAYERS_BYTES >> 20} MiB in turn: a model's layers)" if layers else ""))
            inputs = {}  # (filled by make(), read by the check)
            yield Case(
                group=GROUP, op="flash_attention" + (" fwd+bwd" if backward else " fwd"), label=label,
                size=float(S), make=_make(B, H, Hkv, S, D, causal, dtype, device, backward, Sk, inputs, cache, layers),
                baseline_name="F.scaled_dot_product_attention" + (" (flash)" if device == "cuda" else "")
                + (" + bottom-right mask" if Sk is not None and causal else ""),
                work=_flops(B, H, S, Sk_, D, causal, backward), unit="FLOP", device=device,
                notes=_cpu_notes(S, dtype) if device == "cpu"
                else "Triton FlashAttention-2 kernels",
                check=_checker(inputs),
                # fp32 forwards on the CPU: fp32 FMAs whichever kernel runs (aten's, or ours where the CPU has
                # AVX2 and not AVX-512): % of the FMA peak (the S = 1 steps stream the KV cache instead)
                fma_bound=device == "cpu" and dtype == torch.float32 and not backward and S > 1,
                # out of cache (a model's layers): the step streams its K and V from DRAM (% of the copy bandwidth)
                bytes_moved=(2.0 * B * Hkv * Sk_ * D * torch.finfo(dtype).bits / 8) if layers else None,
            )
