"""Quantized GEMM benchmarks: ours vs what a user would otherwise call, in one process, interleaved.

CPU (K = N = 4096, group 128; quick: 1024):
  - M=1 W4 GEMV, fp32 activations vs fp32 torch.matmul (goal 3x) and vs
    torch.ops.aten._weight_int4pack_mm_for_cpu with bf16 activations (goal 2x). The single-layer rows
    carry no bytes_moved: their 4096 x 4096 W4 weight (8.4 MB) sits in L3 between calls and read as
    132-141% of DRAM bandwidth; the "x8 layers" rows cycle through 8 weights (past L3) and carry it, so
    their "% of limit" says how close the GEMV runs to streaming the weights from DRAM.
  - M=16 and M=128 vs torch fp32 and bf16 matmul; compute-bound on AVX2 CPUs (our fp32 GEMM, "sgemm"),
    so these rows say what % of the fp32 FMA peak (measured: FMA chains on every thread) ours reaches.
  - bit-serial W2A2 and W1A1 GEMV vs fp32 torch.matmul and vs our own W4 GEMV.
GPU (device "cuda", 8192 x 8192): W4A16 vs cuBLAS fp16 at M = 1, 16, 64 (goal 3x at M <= 16);
  bipolar W2A2 / W1A1 vs cuBLAS fp16.

Every case first checks ours against the baseline's output. W4 by relative error (||ours - baseline|| /
||baseline||, Frobenius, per layer): with the same quantized weights as int4pack's they agree to bf16
rounding (SAME_WEIGHTS_TOL); against the float weights the quantization error itself is the difference,
so the tolerance is that error's size with a margin (W4_TOL): loose, but a transposed, scrambled or zero
product is off by ~1.4, ~1.4 or 1.0. The bit-serial products by direction only (BIT_SERIAL_MIN_COS).
"""
from __future__ import annotations

import itertools

import torch

from bench.common import Case, ResultMismatch, assert_cosine, assert_relative_error

GROUP = 128
# The checks' bounds, measured on these randn weights and activations (K = 1024 and 4096):
SAME_WEIGHTS_TOL = 0.02  # relative error vs int4pack: 0.0024-0.0029 (its bf16 activations and scales)
W4_TOL = 0.15            # vs the float weights: 0.098-0.104, the int4 g128 quantization error itself
# Bit-serial (bipolar weights and activations, each fitted for least squared error per group / token,
# a relative error of ~0.60 at 1 bit and ~0.35 at 2 on randn): the product's cosine similarity to the
# baseline, float or W4, is about the product of the two operands' (1 - err^2)^0.5: W2A2 0.87-0.88,
# W1A1 0.61-0.64 (unrelated outputs ~0). (With the tokens' range for the activations: 0.78 and 0.64.)
BIT_SERIAL_MIN_COS = {2: 0.75, 1: 0.5}


def _within(tol: float):
    """A check: ours within relative error `tol` of the baseline, layer by layer for a list of layers."""
    def check(ours, baseline):
        if not isinstance(ours, list):
            ours, baseline = [ours], [baseline]
        if len(ours) != len(baseline):
            raise ResultMismatch(f"{len(ours)} outputs, baseline {len(baseline)}")
        for i, (y, y_base) in enumerate(zip(ours, baseline)):
            assert_relative_error(f"layer {i}" if len(ours) > 1 else "y", y, y_base, tol=tol)
    return check


def _aligned(min_cos: float):
    """A check: ours pointing the baseline's way, cosine similarity at least `min_cos`."""
    return lambda ours, baseline: assert_cosine("y", ours, baseline, at_least=min_cos)
LAYERS = 8  # weight copies the decode-step GEMV cases rotate through (76 MiB packed)


_CACHE: dict = {}


def _weights(N, K, bits=4, scheme="asym", device="cpu"):
    """(float weight, QuantizedWeight), made once per suite run (quantized on `device`: seconds on a
    CPU for 8192 x 8192, milliseconds on a GPU)."""
    import pykernels

    key = (N, K, bits, scheme, device)
    if key not in _CACHE:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(N, K, generator=g).to(device)
        _CACHE[key] = (w, pykernels.quantize(w, bits, GROUP, scheme))
    return _CACHE[key]


def _int4pack(qw):
    """torch's own CPU int4 format for the same weights: w = (q - 8) * scale + zero."""
    q = qw.codes().to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    sz = torch.stack([qw.scales.T, (qw.offsets + 8 * qw.scales).T], -1).to(torch.bfloat16).contiguous()
    return packed, sz


def _avx512_tier() -> bool:
    """Whether qmatmul's AVX-512 kernels (VNNI, BF16) run here: its compute-bound rows then do not run fp32 FMAs."""
    from pykernels.quant._ops import _has_avx512

    return _has_avx512()


def _cpu_cases(quick: bool):
    import pykernels

    n = 1024 if quick else 4096
    K = N = n
    cache = {}

    def weights(bits=4, scheme="asym"):
        if (bits, scheme) not in cache:
            cache[(bits, scheme)] = _weights(N, K, bits, scheme)
        return cache[(bits, scheme)]

    def w4_nbytes():
        return weights()[1].nbytes

    flop = lambda M: 2.0 * M * N * K  # noqa: E731
    cases = []

    def gemv_vs_fp32():
        w, qw = weights()
        x = torch.randn(1, K)
        return (lambda: pykernels.qmatmul(x, qw)), (lambda: torch.matmul(x, w.T))

    # One weight called again and again: its 9 MiB packed stay in L3 between calls, as int4pack's do, but
    # the fp32 baseline's 64 MiB do not. So no row here has a %-of-bandwidth figure (it read 132-141%;
    # review finding); the fp32 goal is judged on the x LAYERS row below (every call streams its weights),
    # the int4pack goal here (the issue's ~9 MB weight, both kernels reading it from L3: their compute).
    in_cache = "one weight, called again and again: in L3 for us (9 MiB), from DRAM for fp32; see the x8 layers rows"
    cases.append(Case("qgemm", "qmatmul W4 g128", f"M=1 K=N={n} fp32 act", 1, gemv_vs_fp32, "torch.matmul fp32",
                      flop(1), "FLOP", notes=in_cache, check=_within(W4_TOL)))

    def gemv_vs_int4pack(act=torch.float32, M=1):
        def make():
            w, qw = weights()
            packed, sz = _int4pack(qw)
            x = torch.randn(M, K)
            xb = x.to(torch.bfloat16)
            xa = x.to(act)
            return (lambda: pykernels.qmatmul(xa, qw)), \
                (lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, GROUP, sz))
        return make

    for act in (torch.float32, torch.bfloat16):
        name = str(act).replace("torch.", "")
        cases.append(Case("qgemm", "qmatmul W4 g128", f"M=1 K=N={n} {name} act", 1, gemv_vs_int4pack(act),
                          "aten._weight_int4pack_mm_for_cpu bf16", flop(1), "FLOP", goal=2.0,
                          notes="one weight, in L3 for both (9 MiB packed each)", check=_within(SAME_WEIGHTS_TOL)))

    # A model's decode step: GEMVs back to back, each on another layer's weights (LAYERS copies, 76 MiB
    # packed): on a machine whose L3 is smaller than that (the 2-core EPYC dev VM: 32 MiB) every call
    # streams its weights from DRAM, ours and int4pack's alike, and the fp32 baseline's 512 MiB too: the
    # fp32 goal (3x) is judged here; against int4pack both read the same bytes from DRAM, so the ratio
    # tends to 1 as both near the bandwidth (the "% of BW" column says how near ours is).
    def layers_vs(baseline):
        def make():
            from pykernels.quant import QuantizedWeight

            w, qw = weights()
            sd = qw.state_dict()
            qws = [QuantizedWeight.from_state_dict({k: v.clone() if torch.is_tensor(v) else v for k, v in sd.items()})
                   for _ in range(LAYERS)]
            x = torch.randn(1, K)
            if baseline == "int4pack":
                packed, sz = _int4pack(qw)
                base = [(packed.clone(), sz.clone()) for _ in range(LAYERS)]
                xb = x.to(torch.bfloat16)
                run_base = lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p, GROUP, s) for p, s in base]  # noqa: E731
            else:
                ws = [w.clone() for _ in range(LAYERS)]
                run_base = lambda: [torch.matmul(x, wi.T) for wi in ws]  # noqa: E731
            return (lambda: [pykernels.qmatmul(x, q) for q in qws]), run_base
        return make

    for baseline, name in (("int4pack", "aten._weight_int4pack_mm_for_cpu bf16"), ("fp32", "torch.matmul fp32")):
        cases.append(Case("qgemm", f"qmatmul W4 g128 x{LAYERS} layers", f"M=1 K=N={n} fp32 act, " + ("weights in cache (quick)" if quick else f"{LAYERS} weights in turn"),
                          1, layers_vs(baseline), name, LAYERS * flop(1), "FLOP",
                          bytes_moved=LAYERS * (N * K / 2 + 2 * 4 * N * (K // GROUP)),
                          goal=None if quick or baseline == "int4pack" else 3.0,
                          check=_within(SAME_WEIGHTS_TOL if baseline == "int4pack" else W4_TOL)))

    for M in (16, 128):
        for act in (torch.float32, torch.bfloat16):
            def make(M=M, act=act):
                w, qw = weights()
                wa = w.to(act)
                x = torch.randn(M, K).to(act)
                return (lambda: pykernels.qmatmul(x, qw)), (lambda: torch.matmul(x, wa.T))
            name = str(act).replace("torch.", "")
            # compute-bound from M=16 on AVX2 CPUs: our fp32 GEMM (sgemm) against the FMA peak. Not where the
            # AVX-512 tier runs: its int16 (vpdpbusd) and bf16 (vdpbf16ps) dot products are not fp32 FMAs
            # (on a Zen 4 both run at twice the fp32 FMA rate)
            cases.append(Case("qgemm", "qmatmul W4 g128", f"M={M} K=N={n} {name}", M, make,
                              f"torch.matmul {name}", flop(M), "FLOP", check=_within(W4_TOL),
                              fma_bound=not _avx512_tier()))
        # torch's own int4 CPU kernel on the same weights (bf16 activations, its only fast path)
        cases.append(Case("qgemm", "qmatmul W4 g128", f"M={M} K=N={n} bfloat16 act", M, gemv_vs_int4pack(torch.bfloat16, M),
                          "aten._weight_int4pack_mm_for_cpu bf16", flop(M), "FLOP", check=_within(SAME_WEIGHTS_TOL)))

    # Training through a frozen quantized weight (QLoRA-style): forward and the gradient w.r.t. x, against
    # the same through the fp32 weight (frozen: no dW). Ours dequantizes the weight in the backward.
    def fwd_bwd_vs_fp32(M=128):
        def make():
            w, qw = weights()
            g = torch.Generator().manual_seed(3)
            xs = [torch.randn(M, K, generator=g).requires_grad_() for _ in range(2)]
            dy = torch.randn(M, N, generator=g)

            def run(x, f):
                x.grad = None
                f(x).backward(dy)
                return x.grad
            return (lambda: run(xs[0], lambda x: pykernels.qmatmul(x, qw))), \
                (lambda: run(xs[1], lambda x: torch.matmul(x, w.T)))
        return make

    cases.append(Case("qgemm", "qmatmul W4 g128 fwd+bwd (dx)", f"M=128 K=N={n} fp32", 128, fwd_bwd_vs_fp32(),
                      "torch.matmul fp32 fwd+bwd (dx)", 2 * flop(128), "FLOP", check=_within(W4_TOL)))

    for bits, ab in ((2, 2), (1, 1)):
        def make_fp32(bits=bits, ab=ab):
            w, qw = weights(bits, "bipolar")
            x = torch.randn(1, K)
            return (lambda: pykernels.qmatmul(x, qw, act_bits=ab)), (lambda: torch.matmul(x, w.T))

        def make_w4(bits=bits, ab=ab):
            _, qw = weights(bits, "bipolar")
            _, q4 = weights()
            x = torch.randn(1, K)
            return (lambda: pykernels.qmatmul(x, qw, act_bits=ab)), (lambda: pykernels.qmatmul(x, q4))

        label = f"M=1 K=N={n} W{bits}A{ab}"
        wbytes = N * K * bits / 8 + 2 * 4 * N * (K // GROUP)
        cases.append(Case("qgemm", "qmatmul bit-serial", label, 1, make_fp32, "torch.matmul fp32", flop(1), "FLOP",
                          bytes_moved=wbytes, check=_aligned(BIT_SERIAL_MIN_COS[bits])))
        cases.append(Case("qgemm", "qmatmul bit-serial", label, 1, make_w4, "pykernels W4 GEMV", flop(1), "FLOP",
                          bytes_moved=wbytes, check=_aligned(BIT_SERIAL_MIN_COS[bits])))
    return cases


def _rotating(fns):
    """One function that calls each of fns in turn."""
    it = itertools.cycle(fns)
    return lambda: next(it)()


def _gpu_weight_sets(N, K, bits, scheme):
    """[(fp16 weight, QuantizedWeight)] copies enough that the quantized ones together are twice the
    GPU's L2 cache (60 MB on an H200; one 8192 x 8192 int4 weight is 32 MiB): the timed loop rotates
    through them, so each call streams its weights from HBM as in a model's forward pass, instead of
    finding them in L2 from the call before."""
    import pykernels

    w, _ = _weights(N, K, bits, scheme, "cuda")
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    copies = max(1, -(-2 * l2 // max(1, N * K * bits // 8)))
    return [(w.to(torch.float16), pykernels.quantize(w, bits, GROUP, scheme)) for _ in range(copies)]


def _gpu_cases(quick: bool):
    import pykernels

    n = 4096 if quick else 8192
    K = N = n
    cases = []
    for backend in ("triton", "cuda"):
        for M in (1, 16, 64):
            def make(M=M, backend=backend):
                sets = _gpu_weight_sets(N, K, 4, "asym")
                x = torch.randn(M, K, device="cuda", dtype=torch.float16)
                return (_rotating([lambda qw=qw: pykernels.qmatmul(x, qw, backend=backend) for _, qw in sets]),
                        _rotating([lambda wh=wh: torch.matmul(x, wh.T) for wh, _ in sets]))
            cases.append(Case("qgemm", f"qmatmul W4A16 g128 ({backend})", f"M={M} K=N={n}", M, make, "cuBLAS fp16",
                              2.0 * M * N * K, "FLOP", bytes_moved=N * K / 2 + 8 * N * (K // GROUP),
                              goal=3.0 if M <= 16 else None, device="cuda", check=_within(W4_TOL)))
    for bits in (2, 1):
        for M in (1, 16):
            def make_bs(M=M, bits=bits):
                sets = _gpu_weight_sets(N, K, bits, "bipolar")
                x = torch.randn(M, K, device="cuda", dtype=torch.float16)
                return (_rotating([lambda qw=qw: pykernels.qmatmul(x, qw, act_bits=bits) for _, qw in sets]),
                        _rotating([lambda wh=wh: torch.matmul(x, wh.T) for wh, _ in sets]))
            cases.append(Case("qgemm", "qmatmul bit-serial", f"M={M} K=N={n} W{bits}A{bits}", M, make_bs,
                              "cuBLAS fp16", 2.0 * M * N * K, "FLOP", device="cuda",
                              check=_aligned(BIT_SERIAL_MIN_COS[bits])))
    return cases


def cases(quick: bool, device: str = "cpu"):
    return _gpu_cases(quick) if device == "cuda" else _cpu_cases(quick)
