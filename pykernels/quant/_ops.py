"""torch.ops.pykernels.qmatmul: the op schema (once), its fake implementation, and the backends.

Backends: "cpu" (csrc/qgemm/qgemm_cpu.cpp), "triton" (pykernels/quant/_triton.py), "cuda"
(csrc/qgemm/qgemm.cu). On CUDA tensors "auto" prefers the native tensor-core kernel for weight-only
fp16/bf16 x codes of <= 4 bits up to 16 tokens (_gpu_preference: measured faster there), Triton
otherwise, unless a tuned entry says which.
  cuda, weight-only: {"kernel": "mma" (tensor cores; the default where it applies) | "simt", "rg": 1 | 2 | 4
                      (16-row groups per CTA of the mma kernel), "pipe": bool (its loads an iteration
                      ahead)}; bit-serial: {"mma": bool}; {} = the kernel's own choice
Config (pykernels._backend.dispatch, tuned by pykernels.autotune):
  cpu, weight-only: {"impl": "native" | "dequant_mm", "threads": 0 (= torch's), "m_block", "n_block",
                     "isa": 2 AVX-512 VNNI | 1 AVX2 (highest allowed tier, capped by the CPU)}
                    | {"impl": "amx" | "bf16dot", "threads", "min_m" (fewer tokens: the VNNI kernels)}
                    | {"impl": "sgemm" (AVX2), "threads", "kc", "mc", "nc" (its blocking)}
  cpu, bit-serial:  {"mode": 0 portable | 1 POPCNT | 2 AVX2 vpshufb | 3 AVX-512 VPOPCNTDQ, "threads": 0}
"""
from __future__ import annotations

import functools
import math
import operator
from typing import Optional

import torch

from .. import _memory, autotune
from .._backend import (_traced_or_transformed, dispatch, eager_autograd, eager_autograd_function, eager_direct,
                       fake_on_one_device, functorch_autograd, vmapped_first)
from .._native import (cpu_module, cuda_module, cuda_stream_handle, dtype_code, env_reader, getenv,
                       torch_bf16_gemm_native)
from . import _format as F

_ROWS_PER_DEQUANT_CHUNK = 1024


def _key(M: int, N: int, K: int, bits: int, group_size: int, act_bits: int, dtype) -> dict:
    return {"M": autotune.bucket(M), "N": N, "K": K, "bits": bits, "group": group_size, "act_bits": act_bits,
            "dtype": str(dtype).replace("torch.", "")}


def _has_avx512() -> bool:
    return getenv("PYKERNELS_DISABLE_AVX512") != "1" and bool(cpu_module("qgemm").cpu_has_avx512())


def _has_avx2() -> bool:
    """AVX2 + FMA usable by our kernels (PYKERNELS_DISABLE_AVX2=1, read on every call, turns it off)."""
    return getenv("PYKERNELS_DISABLE_AVX2") != "1" and bool(cpu_module("qgemm").cpu_has_avx2())


def _has_amx() -> bool:
    """AMX-BF16 usable in this process (CPU, OS, permission; PYKERNELS_DISABLE_AMX=1 turns it off)."""
    return (getenv("PYKERNELS_DISABLE_AMX") != "1" and _has_avx512()
            and bool(cpu_module("qgemm").cpu_has_amx_bf16()))


def _has_bf16dot() -> bool:
    """Our AVX-512 BF16 kernels usable (PYKERNELS_DISABLE_AVX512=1 or PYKERNELS_DISABLE_AVX2=1 turn them off)."""
    return (getenv("PYKERNELS_DISABLE_AVX512") != "1" and _has_avx2()
            and bool(cpu_module("qgemm").cpu_has_avx512bf16()))


def _amx_fits(key: dict) -> bool:
    """bf16 activations and codes of <= 4 bits: what the bf16 product kernels ("amx", "bf16dot") take."""
    return key.get("dtype") == "bfloat16" and key.get("bits", 8) <= 4 and not key.get("act_bits")


# From this M bucket (M >= 9) bf16 activations take the AMX kernel where there is one. Measured on a
# 2-core Xeon (Emerald Rapids), K=N=4096, group 128, 4 bits, same-run medians: M=16 1.4-2.2 ms vs
# 2.6-4.0 ms for the VNNI kernels (torch's bf16 matmul of the dense weight: 2.5 ms), M=64 4.9-5.8 vs
# 10.4 ms (torch 4.8-5.9), M=128 5.6-8.1 vs 13.5-14.8 ms (torch 6.7-7.6); below M=8 the VNNI GEMV
# kernels stream the weights faster (M=1: 0.52 vs 2.3 ms; AMX's decode and per-group rescaling of
# each 16-row panel cost ~1.8 ms whatever M).
AMX_MIN_M_BUCKET = 16
# From this M bucket (and from min_m tokens in it) bf16 activations take the AVX-512 BF16 kernel
# (wo_gemm_bf16dot: AMX's data and math with VDPBF16PS vector loops) on CPUs with AVX-512 BF16 and no AMX.
# Measured on a 2-core Zen 4, K=N=4096, 4 bits, group 128, best of 5 interleaved calls, ms (bf16dot / the
# VNNI kernels / torch's bf16 matmul of the dense weight): M=8 1.78 / 1.39 (GEMV) / 2.13, M=12 1.80 / 1.91 /
# 2.44, M=16 1.81 / 2.10 / 2.56, M=32 3.07 / 3.29 / 3.84, M=128 10.7 / 12.1 / 10.9 (1 thread, M=512: 208 /
# 183 / 216 GFLOP/s); group 32 M=128 12.0 / 15.4, 2 bits group 64 11.3 / 13.5. Below 12 tokens (one token
# tile: its cost is that of 16) the GEMV kernel streams the weights faster.
BF16DOT_MIN_M_BUCKET = 16
BF16DOT_MIN_M = 12


def _vnni_config() -> dict:
    """The AVX-512 VNNI kernels (measured on Zen 4, K=N=4096, 1 thread, same-run ratios): the per-token GEMV
    kernel up to M=11 (M=8: 3.1 ms vs the panel's 8.0 ms), the panel GEMM from M=12 (where its 16 token
    lanes fill up), one pass over the weights for all tokens (M=128: 50 ms in one pass vs 67 ms in 8 passes
    of 16); bf16 too (M=64: 30 ms vs 37 ms for dequantize + torch's bf16 GEMM)."""
    return {"impl": "native", "threads": 0, "m_block": 4096, "n_block": 8, "isa": 2, "gemm_min_m": 12}


def _default_cpu_config(key: dict) -> dict:
    if key.get("act_bits"):
        return {"mode": 3 if _has_avx512() else 2, "threads": 0}
    if _amx_fits(key) and key.get("M", 0) >= AMX_MIN_M_BUCKET and _has_amx():
        return {"impl": "amx", "threads": 0}
    if _amx_fits(key) and key.get("M", 0) >= BF16DOT_MIN_M_BUCKET and _has_avx512() and _has_bf16dot():
        return {"impl": "bf16dot", "threads": 0, "min_m": BF16DOT_MIN_M}
    if _has_avx512():
        return _vnni_config()
    # The integer kernel (AVX2) streams the weights once per block of 16 tokens (decoding them once for
    # the 16: wo_tile_avx2_panel): ~7x fp32 torch.matmul at M=1, ~2.4x at M=16 (K=N=4096, 2 busy cores).
    # Where the op turns compute-bound, an fp32 GEMM wins: our own ("sgemm", below) from the M=16 bucket;
    # the dequantize + torch GEMM route ("dequant_mm") for bf16 activations from M=64 where the CPU
    # multiplies bf16 natively (AVX-512 turned off on Zen 4: M=128 ~100 ms vs ~225 ms for the int16
    # kernel), and from M=128 where our kernels may not use AVX2 (PYKERNELS_DISABLE_AVX2=1).
    if key.get("dtype") == "bfloat16" and key["M"] >= 64 and torch_bf16_gemm_native():
        return {"impl": "dequant_mm", "threads": 0, "m_block": 16, "n_block": 8}
    if key["M"] >= SGEMM_MIN_M_BUCKET and _has_avx2():
        return _sgemm_config()
    if key["M"] >= 128:
        return {"impl": "dequant_mm", "threads": 0, "m_block": 16, "n_block": 8}
    return {"impl": "native", "threads": 0, "m_block": 16, "n_block": 8}


# From this M bucket (M = 9..16 and up) AVX2 CPUs take the fp32 GEMM that dequantizes into its packed panels
# ("sgemm", wo_sgemm in qgemm_cpu.cpp). Measured on a 2-core Zen 2, K=N=4096 W4 g128 fp32 activations,
# best of 7 interleaved runs in one process, ms (int16 kernel / sgemm / torch's fp32 matmul of the dense
# weight): M=8 4.5 / 6.0 / 10.2, M=9 5.0 / 6.1, M=12 5.5 / 4.7, M=16 8.7 / 7.3 / 14.8, M=32 16.0 / 11.9 /
# 21.2, M=64 27.0 / 15.5 / 30.1, M=128 62.0 / 36.0 / 42.4 (dequantize + torch's GEMM 45.1), M=256 123 /
# 59.5 / 66.7 (70.3). A quieter run: M=128 26.5 ms, 166 GFLOP/s of the 200 an FMA loop reaches on the two
# cores (torch's GEMM ~100). With micro-kernels of 1-5 rows for the last sliver of x (no FMAs on padding
# rows), another run: M=8 3.4 / 3.7, M=9 3.8 / 3.9, M=10 4.3 / 3.8, M=12 4.6 / 3.9, M=16 5.8 / 4.6 / 9.6 (torch),
# M=128 44.7 / 24.8 / 31.0. So the bucket of M = 9..16 goes to sgemm (M=9 even); tuning decides per machine.
SGEMM_MIN_M_BUCKET = 16


def _sgemm_config() -> dict:
    """The sgemm kernel's blocking: a K block of 256 (its B sliver, 256 x 16 fp32, fills half of L1), x in
    blocks of 144 rows (144 KiB of L2), B panels of 256 columns (256 KiB: each sliver is used again by
    every x block before it leaves L2). Panels of 1024 measured the same from M=256 and up to 1.3x slower
    below."""
    return {"impl": "sgemm", "threads": 0, "kc": 256, "mc": 144, "nc": 256}


def _threads(cfg: dict) -> int:
    return int(cfg.get("threads") or 0) or torch.get_num_threads()


def _capped(level: int, avx2_level: int) -> int:
    """A kernel level capped by the PYKERNELS_DISABLE_* flags: 0 (portable) without AVX2, at most
    avx2_level without AVX-512. The native module also caps by the CPU (and by the flags it read at its
    first call); reading them here on every call lets a test switch tiers within one process (both in
    one read of os.environ: two getenv calls were ~0.4 us of every small qmatmul)."""
    no_avx2, no_avx512 = _tier_flags()
    if no_avx2 in _SET:
        return 0
    if no_avx512 in _SET:
        return min(level, avx2_level)
    return level


_tier_flags = env_reader(("PYKERNELS_DISABLE_AVX2", "PYKERNELS_DISABLE_AVX512"))
_SET = (b"1", "1")  # "1" as env_reader gives it (os.environ's encoded bytes on POSIX, str elsewhere)


def _isa(cfg: dict) -> int:
    """Weight-only kernel tier: 2 AVX-512 VNNI, 1 AVX2, 0 portable."""
    return _capped(int(cfg.get("isa", 2)), 1)


def _bs_mode(cfg: dict) -> int:
    """Bit-serial kernel: 3 AVX-512 VPOPCNTDQ, 2 AVX2 vpshufb, 1 scalar POPCNT, 0 portable."""
    return _capped(int(cfg.get("mode", 3)), 2)


def _bias_f32(bias):
    """The bias as the kernels read it (through its data pointer): contiguous float32. An fp32 bias that
    is already so comes back as it is (detach() alone was ~0.5 us of a small layer's call)."""
    if bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()):
        return bias
    return bias.detach().to(torch.float32).contiguous()


def _dequant_cpu(packed, scales, offsets, N, K, bits, group_size, rows=None, threads=None, dtype=torch.float32,
                 out=None) -> torch.Tensor:
    """fp32 (or bf16) weights [N, K] (or rows r0:r1) from the packed tile layout, natively."""
    mod = cpu_module("qgemm")
    r0, r1 = rows or (0, N)
    out = torch.empty(r1 - r0, K, dtype=dtype) if out is None else out[:r1 - r0]
    if out.numel():
        assert r0 % F.ROW_TILE == 0
        Kp = F.round_up(max(K, 1), F.K_BLOCK)
        tile_bytes = Kp // F.K_BLOCK * F.ROW_TILE * (16 if bits <= 4 else 32)
        G = scales.shape[1]
        mod.dequant_tiles(packed.data_ptr() + (r0 // F.ROW_TILE) * tile_bytes, bits,
                          scales.data_ptr() + r0 * G * 4, offsets.data_ptr() + r0 * G * 4, r1 - r0, K, group_size,
                          out.data_ptr(), dtype_code(out.dtype), threads or torch.get_num_threads())
    return out


_EXACT_COLUMNS = 64  # outliers per row multiplied exactly (at least; K / 64 for long rows)


def cpu_weight_only(x2, packed, scales, offsets, bias, N, K, bits, group_size, cfg) -> torch.Tensor:
    M = x2.shape[0]
    threads = _threads(cfg)
    if cfg.get("impl") in ("amx", "bf16dot"):
        fits = x2.dtype == torch.bfloat16 and bits <= 4
        if fits and cfg["impl"] == "amx" and _has_amx():
            return _cpu_bf16_product(x2, packed, scales, offsets, bias, N, K, bits, group_size, cfg, threads, True)
        # bf16dot (from its min_m tokens, if it says), or "amx" where the CPU has no AMX (PYKERNELS_DISABLE_AMX=1,
        # a cache tuned on another machine): the same product on AVX-512 BF16 from BF16DOT_MIN_M tokens
        min_m = int(cfg.get("min_m", 0)) if cfg["impl"] == "bf16dot" else BF16DOT_MIN_M
        if fits and M >= min_m and _has_avx512() and _has_bf16dot():
            return _cpu_bf16_product(x2, packed, scales, offsets, bias, N, K, bits, group_size, cfg, threads, False)
        # a cached choice this input cannot take (or too few tokens): the VNNI kernels where the CPU has
        # them (with the choice's threads), else its default (never "amx" or "bf16dot" here)
        cfg = ({**_vnni_config(), "threads": cfg.get("threads", 0)} if _has_avx512()
               else _default_cpu_config(_key(M, N, K, bits, group_size, 0, x2.dtype)))
    if cfg.get("impl") == "sgemm" and M > 0:
        if _has_avx2():
            y = torch.empty(M, N, dtype=torch.float32)
            b = _bias_f32(bias)
            cpu_module("qgemm").wo_sgemm(
                x2.data_ptr(), dtype_code(x2.dtype), M, K, packed.data_ptr(), bits, scales.data_ptr(),
                offsets.data_ptr(), N, group_size, b.data_ptr() if b is not None else 0, y.data_ptr(), threads,
                int(cfg.get("kc", 256)), int(cfg.get("mc", 144)), int(cfg.get("nc", 256)))
            return y.to(x2.dtype)  # one rounding of the fp32 sums (+ bias), as the dequantize route
        cfg = {**cfg, "impl": "dequant_mm"}  # a cached choice this CPU (or PYKERNELS_DISABLE_AVX2) cannot take
    if cfg.get("impl") == "dequant_mm" and M > 0:
        # Compute-bound sizes: dequantize a chunk of rows (AVX2) into one reused buffer and hand it to
        # torch's GEMM; bf16 activations multiply bf16 weights where the CPU multiplies bf16 natively
        # (oneDNN's bf16 GEMM ~2x its fp32 one there), everything else fp32 (without AVX512-BF16 oneDNN's
        # bf16 GEMM ran 5.7x slower than its fp32 one: Zen 2, M=128, K=N=4096).
        wdt = torch.bfloat16 if x2.dtype == torch.bfloat16 and torch_bf16_gemm_native() else torch.float32
        xw = x2.to(wdt)
        step = min(N, _ROWS_PER_DEQUANT_CHUNK)
        buf = torch.empty(step, K, dtype=wdt)
        # the bias goes into the GEMM (addmm): added to the fp32 sums before the one rounding to bf16,
        # not to the bf16 product afterwards (a second rounding, large where bias and product cancel)
        bw = bias.to(wdt) if bias is not None else None
        parts = []
        for r0 in range(0, N, step):
            r1 = min(N, r0 + step)
            w = _dequant_cpu(packed, scales, offsets, N, K, bits, group_size, (r0, r1), threads, out=buf)
            parts.append(torch.mm(xw, w.t()) if bw is None else torch.addmm(bw[r0:r1], xw, w.t()))
        # torch.cat, not slice assignment: a strided bf16 copy into y[:, r0:r1] takes ~1000x longer; one
        # chunk (N <= 1024) is y itself (the cat holds two outputs at once: 8.4 GiB for a 4.3 GiB y)
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return y.to(x2.dtype)
    mod = cpu_module("qgemm")
    # the kernel's blocking and tier, read once for the call (the first call below is the common case)
    blocking = (int(cfg.get("m_block", 16)), int(cfg.get("n_block", 8)), _isa(cfg), int(cfg.get("gemm_min_m", 12)))

    def native(xs, b, ydt, check_rows=False):
        """The int16 kernel's y for xs; with check_rows, None instead when some row needs another route
        (the kernel checks every row first, act_range_flags, and then computes nothing)."""
        y = torch.empty(xs.shape[0], N, dtype=ydt)
        flagged = mod.wo_gemm(xs.data_ptr(), dtype_code(xs.dtype), xs.shape[0], K, packed.data_ptr(), bits,
                              scales.data_ptr(), offsets.data_ptr(), N, group_size, b.data_ptr() if b is not None else 0,
                              y.data_ptr(), dtype_code(ydt), threads, *blocking, check_rows)
        return None if flagged else y

    b = _bias_f32(bias)
    # the common case in one native call (a flags tensor and a second call cost ~15 us of a 0.5 ms GEMV
    # once the GEMV has pushed the interpreter's data out of the caches)
    y = native(x2, b, x2.dtype, check_rows=True)
    if y is not None:
        return y
    y = torch.empty(M, N, dtype=x2.dtype)
    # Rows the int16 activations cannot carry (see act_range_flags in qgemm_cpu.cpp) take other routes
    flags = torch.empty(M, dtype=torch.uint8)
    mod.act_range_flags(x2.data_ptr(), dtype_code(x2.dtype), M, K, flags.data_ptr(), threads)
    ordinary = torch.nonzero(flags == 0).flatten()
    if ordinary.numel():
        y[ordinary] = native(x2[ordinary], b, x2.dtype)
    two_scales = torch.nonzero(flags == 1).flatten()
    if two_scales.numel():
        # Outliers (LLM.int8()'s decomposition, Dettmers et al. 2022; split_outliers in qgemm_cpu.cpp):
        # a row's elements above 8 times its mean |x| are multiplied exactly, in float64, by their columns
        # of the dequantized weight (a few columns cost next to nothing, and no fp32 sum of huge terms can
        # cancel); the rest goes through the int16 kernel. A row with more of them than that (heavy
        # tails) goes through the int16 kernel whole.
        whole = two_scales.numel() == M  # (a single token, say): no gather and scatter of rows
        xs = x2 if whole else x2[two_scales]
        R = xs.shape[0]
        rest = torch.empty(R, K, dtype=torch.float32)
        exact = torch.zeros(R, N, dtype=torch.float64)
        mod.split_outliers(xs.data_ptr(), dtype_code(xs.dtype), R, K, packed.data_ptr(), bits, scales.data_ptr(),
                           offsets.data_ptr(), N, group_size, 8.0, max(_EXACT_COLUMNS, K // 64), rest.data_ptr(),
                           exact.data_ptr())
        acc = native(rest, None, torch.float32)
        acc = exact.add_(acc).to(torch.float32)
        if b is not None:
            acc += b
        if whole:
            return acc.to(x2.dtype)
        y[two_scales] = acc.to(y.dtype)
    non_finite = torch.nonzero(flags == 2).flatten()
    if non_finite.numel():  # NaN/inf (inf * w comes out as torch's inf), or a max int16 scales cannot carry: exact fp32
        y[non_finite] = cpu_weight_only(x2[non_finite], packed, scales, offsets, bias, N, K, bits, group_size,
                                        {**cfg, "impl": "dequant_mm"}).to(y.dtype)
    return y


def _cpu_bf16_product(x2, packed, scales, offsets, bias, N, K, bits, group_size, cfg, threads,
                      amx: bool) -> torch.Tensor:
    """bf16 activations on the AMX kernel or its AVX-512 BF16 twin (wo_gemm_amx / wo_gemm_bf16dot in
    qgemm_cpu.cpp: exact products, fp32 sums). Rows that act_range_flags marks take the routes the VNNI
    path gives them: huge outliers next to ordinary values (an fp32 sum holding 1e8 * (u - c) keeps ~8 of
    absolute error, which the outlier split avoids by multiplying the outliers in float64; tested) and
    NaN/inf (so that inf * w comes out as torch's; the code-sum form would make inf * 0 codes NaN)."""
    mod = cpu_module("qgemm")
    kernel = mod.wo_gemm_amx if amx else mod.wo_gemm_bf16dot
    M = x2.shape[0]
    b = _bias_f32(bias)
    xc = x2.contiguous()

    def product(xs):
        y = torch.empty(xs.shape[0], N, dtype=torch.bfloat16)
        kernel(xs.data_ptr(), xs.shape[0], K, packed.data_ptr(), bits, scales.data_ptr(), offsets.data_ptr(),
               N, group_size, b.data_ptr() if b is not None else 0, y.data_ptr(), threads)
        return y

    flags = torch.empty(M, dtype=torch.uint8)
    if not (M and mod.act_range_flags(xc.data_ptr(), dtype_code(xc.dtype), M, K, flags.data_ptr(), threads)):
        return product(xc)
    y = torch.empty(M, N, dtype=torch.bfloat16)
    ordinary = torch.nonzero(flags == 0).flatten()
    if ordinary.numel():
        y[ordinary] = product(xc[ordinary].contiguous())
    special = torch.nonzero(flags != 0).flatten()
    other = _default_cpu_config(_key(special.numel(), N, K, bits, group_size, 0, torch.float32))
    y[special] = cpu_weight_only(xc[special], packed, scales, offsets, bias, N, K, bits, group_size,
                                 {**other, "threads": cfg.get("threads", 0)})
    return y


def cpu_bitserial(x2, planes, scales, offsets, wsum, bias, N, K, bits, group_size, act_bits, cfg,
                  int_out: Optional[torch.Tensor] = None, act_codes: Optional[torch.Tensor] = None):
    mod = cpu_module("qgemm")
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x2.dtype)
    b = _bias_f32(bias)
    mod.bitserial_gemm(x2.data_ptr(), dtype_code(x2.dtype), M, K, act_bits, planes.data_ptr(), bits,
                       scales.data_ptr(), offsets.data_ptr(), wsum.data_ptr(), N, group_size,
                       b.data_ptr() if b is not None else 0, y.data_ptr(), dtype_code(y.dtype),
                       int_out.data_ptr() if int_out is not None else 0,
                       act_codes.data_ptr() if act_codes is not None else 0, _threads(cfg), _bs_mode(cfg))
    return y


@functools.lru_cache(maxsize=None)
def _sm80_cuda(device_index: int) -> bool:
    """An NVIDIA device of compute capability 8.0 or more (asked once per device: a GEMV is ~40 us)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) >= (8, 0)


def cuda_wo_kernel(cfg, x_dtype, bits, dev) -> str:
    """The weight-only CUDA kernel of a call: "mma" (tensor cores, csrc/qgemm/qgemm.cu wo_mma_kernel) for
    fp16/bf16 activations and codes of at most 4 bits on sm_80+ CUDA, else "simt" (wo_gemm_kernel)."""
    mma_ok = (x_dtype in (torch.float16, torch.bfloat16) and bits <= 4
              and _sm80_cuda(dev.index if dev.index is not None else torch.cuda.current_device()))
    kernel = cfg.get("kernel", "mma" if mma_ok else "simt")
    if kernel not in ("mma", "simt"):
        raise ValueError(f"pykernels.qmatmul: expected config 'kernel' in ('mma', 'simt'), got {kernel!r}")
    if kernel == "mma" and not mma_ok:
        raise ValueError("pykernels.qmatmul: config kernel='mma' needs float16/bfloat16 activations, codes of at "
                         "most 4 bits and an sm_80+ CUDA device")
    return kernel


def cuda_qmatmul(x2, packed, scales, offsets, planes, wsum, bias, N, K, bits, group_size, act_bits, cfg):
    mod = cuda_module("qgemm")
    M = x2.shape[0]
    dev = x2.device
    if not act_bits and cuda_wo_kernel(cfg, x2.dtype, bits, dev) == "mma":
        # y in x's dtype, written whole by the kernel (bias added there): one launch, nothing else
        if packed.data_ptr() % 4:  # the kernel reads it in 32-bit words: a view at an odd offset
            packed = packed.clone()
        y = torch.empty(M, N, dtype=x2.dtype, device=dev)
        b = bias.to(torch.float32).contiguous() if bias is not None else None
        # 16-row groups per CTA: 2 reuses each token's x twice once there are enough rows to fill the GPU
        rg = int(cfg.get("rg", 2 if N >= 4096 else 1))
        # pipe: the variant whose loads run an iteration ahead (a tuning candidate; off by default until
        # a GPU run has measured it)
        mod.wo_mma(x2.data_ptr(), dtype_code(x2.dtype), M, K, packed.data_ptr(), bits, scales.data_ptr(),
                   offsets.data_ptr(), N, group_size, b.data_ptr() if b is not None else 0, y.data_ptr(), rg,
                   bool(cfg.get("pipe", False)), cuda_stream_handle(dev))
        return y
    if not act_bits and torch.are_deterministic_algorithms_enabled():
        torch._C._alert_not_deterministic("pykernels.qmatmul's CUDA 'simt' kernel (its K slices meet through "
                                          "float atomics; the 'mma' kernel, Triton's with SPLIT_K=1 and the CPU's "
                                          "are deterministic)")
    y = torch.zeros(M, N, dtype=torch.float32, device=dev)
    stream = cuda_stream_handle(dev)
    if act_bits:
        gsize, G, gw = F.plane_geometry(K, group_size)
        aplanes = torch.empty(M * G * act_bits * 2 * gw, dtype=torch.int32, device=dev)
        usum = torch.zeros(M * G, dtype=torch.int32, device=dev)
        sa = torch.empty(M, dtype=torch.float32, device=dev)
        ma = torch.empty(M, dtype=torch.float32, device=dev)
        use_mma = bool(cfg.get("mma", torch.version.hip is None and torch.cuda.get_device_capability(dev) >= (8, 0)))
        mod.bitserial(x2.data_ptr(), dtype_code(x2.dtype), M, K, act_bits, planes.data_ptr(), bits, scales.data_ptr(),
                      offsets.data_ptr(), wsum.data_ptr(), N, group_size, aplanes.data_ptr(), usum.data_ptr(),
                      sa.data_ptr(), ma.data_ptr(), y.data_ptr(), use_mma, stream)
    else:
        if packed.data_ptr() % 16:  # the kernel streams it with 16-byte cp.async: a view at an odd offset
            packed = packed.clone()
        mod.wo_gemm(x2.data_ptr(), dtype_code(x2.dtype), M, K, packed.data_ptr(), bits, scales.data_ptr(),
                    offsets.data_ptr(), N, group_size, y.data_ptr(), stream)
    if bias is not None:
        y += bias.to(torch.float32)
    return y.to(x2.dtype)


# dispatch()'s answer per call signature. dispatch builds and freezes a key dict and resolves the backend
# on every call: ~10 us, and ~40 us with the caches cold after the 9 MB of a 4096 x 4096 GEMV went
# through them (5-8% of that GEMV). The memo's key holds everything the answer depends on: the
# signature, the autotune generation (bumped by every stored config), PYKERNELS_AUTOTUNE and the
# switches the default configs read. Plans are never modified by their users (cfg is copied first).
_PLANS: dict = {}


def _gpu_preference(M: int, bits: int, act_bits: int, dtype) -> tuple:
    """Backend order on a GPU without a tuned entry. The CUDA tensor-core kernel (wo_mma_kernel) first for
    weight-only fp16/bf16 x codes of <= 4 bits up to 16 tokens; Triton otherwise. On an H200, 8192 x 8192
    W4A16 g128 (bench/gpu_runs/2026-12-04-h200.md): CUDA 37 / 66 / 258 us at M = 1 / 16 / 64, Triton
    115 / 111 / 163 us."""
    if (not act_bits and bits <= 4 and M <= 16 and dtype in (torch.float16, torch.bfloat16)
            and torch.version.hip is None):  # (the MMA kernel is CUDA's alone)
        return ("cuda", "triton")
    return ("triton", "cuda")


def _plan(device, backend: str, M: int, n: int, k: int, bits: int, group_size: int, act_bits: int, dtype):
    if not isinstance(backend, str):  # (before the memo: a numpy array's error was "unhashable type")
        raise TypeError(f"pykernels.qmatmul: expected a str for 'backend', got {type(backend).__name__}")
    # (_memo_env: PYKERNELS_AUTOTUNE and the switches in one read of os.environ, ~0.5 us less than
    # _enabled() and switches() apart)
    memo_key = (device, backend, M, n, k, bits, group_size, act_bits, dtype, autotune.generation(),
                autotune._memo_env())
    plan = _PLANS.get(memo_key)
    if plan is None:
        plan = dispatch("qmatmul", device, backend, _key(M, n, k, bits, group_size, act_bits, dtype),
                        supported=("cpu", "cuda", "triton"), preference=_gpu_preference(M, bits, act_bits, dtype))
        if len(_PLANS) >= 4096:  # many distinct shapes (say, a growing M): start over
            _PLANS.clear()
        _PLANS[memo_key] = plan
    return plan


def _impl(x, packed, scales, offsets, planes, wsum, bias, n, k, bits, group_size, act_bits, backend,
          config: Optional[dict] = None):
    if act_bits and (planes is None or wsum is None):  # (a direct torch.ops call; qmatmul builds them)
        raise ValueError("pykernels.qmatmul: act_bits needs the weight's bit planes and code sums "
                         "(QuantizedWeight.ensure_planes(), .code_sums)")
    flat = x.dim() == 2  # the usual [M, K]: no reshapes (each view op costs several us with cold caches)
    if flat:
        M = x.shape[0]
        x2 = x
    else:
        lead = x.shape[:-1]
        M = math.prod(lead)
        x2 = x.reshape(M, k)
    chosen, cfg = _plan(x.device, backend, M, n, k, bits, group_size, act_bits, x.dtype)
    if config is not None:
        cfg = dict(config)
    if M == 0 or n == 0 or k == 0:
        y = torch.zeros(M, n, dtype=torch.float32, device=x.device)
        if bias is not None:
            y += bias.to(torch.float32)
        return _memory.not_a_view(y.to(x.dtype), (*x.shape[:-1], n))
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    if chosen == "cuda":
        y = cuda_qmatmul(x2, packed, scales, offsets, planes, wsum, bias, n, k, bits, group_size, act_bits, cfg)
    elif chosen == "triton":
        from . import _triton

        y = _triton.qmatmul(x2, packed, scales, offsets, planes, wsum, bias, n, k, bits, group_size, act_bits, cfg)
    elif act_bits:
        y = cpu_bitserial(x2, planes, scales, offsets, wsum, bias, n, k, bits, group_size, act_bits, cfg)
    else:
        y = cpu_weight_only(x2, packed, scales, offsets, bias, n, k, bits, group_size, cfg)
    # not a view of the 2-D result: in-place ops on it (ReLU(inplace=True) after a layer) work as on F.linear's
    return y if flat else _memory.not_a_view(y, (*x.shape[:-1], n))


@torch.library.custom_op("pykernels::qmatmul", mutates_args=())
def _qmatmul_custom(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                    planes: Optional[torch.Tensor], wsum: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                    n: int, k: int, bits: int, group_size: int, act_bits: int, backend: str) -> torch.Tensor:
    _check_op_args(x, packed, scales, offsets, planes, wsum, bias, n, k, bits, group_size, act_bits)
    return _impl(x, packed, scales, offsets, planes, wsum, bias, n, k, bits, group_size, act_bits, backend)


def _check_op_args(x, packed, scales, offsets, planes, wsum, bias, n, k, bits, group_size, act_bits):
    """What qmatmul's QuantizedWeight guarantees, checked for the op called directly
    (torch.ops.pykernels.qmatmul): the kernels trust n, k, bits, group_size and the buffers' lengths
    (review finding: a 16-row weight passed with n=100000 read far past its end and returned garbage)."""
    op = "pykernels.qmatmul"
    want = _buffer_layout(n, k, bits, group_size, act_bits)  # (checks the ints themselves too)
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{op}: expected 'x' of shape [..., {k}], got {tuple(x.shape)}")
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"{op}: expected 'x' of dtype float32, float16 or bfloat16, got {x.dtype}")
    for (name, dtype, numel), t in zip(want, (packed, scales, offsets, planes, wsum)):
        if t is None:
            raise ValueError(f"{op}: act_bits needs the weight's bit planes and code sums ('{name}' is None)")
        if t.dtype != dtype or t.numel() != numel or not t.is_contiguous():
            raise ValueError(f"{op}: expected a contiguous '{name}' of {numel} {dtype} elements for n={n}, k={k}, "
                             f"bits={bits}, group_size={group_size}, got {t.numel()} {t.dtype}"
                             f"{'' if t.is_contiguous() else ', not contiguous'}")
    if bias is not None:
        # the bias is the user's own tensor, any layout (as F.linear's): _impl makes it contiguous (review
        # finding: a strided bias worked in eager code but not through the op: autograd, vmap, torch.compile)
        if bias.dim() != 1 or bias.numel() != n:
            raise ValueError(f"{op}: expected a 1-D 'bias' of {n} elements (the weight's output features), got "
                             f"shape {tuple(bias.shape)}")
        if not bias.is_floating_point():
            raise TypeError(f"{op}: expected a floating-point 'bias', got {bias.dtype}")
    dev = x.device
    for t in (packed, scales, offsets, planes, wsum, bias):
        if t is not None and t.device != dev:
            devices = {t.device for t in (x, packed, scales, offsets, planes, wsum, bias) if t is not None}
            raise RuntimeError(f"{op}: expected all tensors on one device, got {sorted(map(str, devices))}")


_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1024, typed=True)
def _buffer_layout(n, k, bits, group_size, act_bits) -> tuple:
    """_check_op_args's checks of the integer arguments, and ((name, dtype, numel), ...) of the buffers
    they call for (packed, scales, offsets; planes and wsum with act_bits): the same for every call of a
    layer, so worked out once per signature (~1.5 us a call, a tenth of a small layer's qmatmul). Errors
    are raised, never cached."""
    op = "pykernels.qmatmul"
    if not 1 <= bits <= 8:
        raise ValueError(f"{op}: expected bits in 1..8, got {bits}")
    if not F.valid_group_size(group_size):  # the rule quantize applies (review: 256 passed it, failed here)
        raise ValueError(f"{op}: expected group_size -1 or a positive multiple of 32, got {group_size}")
    if not 0 <= act_bits <= 8:
        raise ValueError(f"{op}: expected act_bits in 0..8 (0: none), got {act_bits}")
    if act_bits:
        F.check_bitserial_group(op, k, group_size)
    if n < 0 or k < 0:
        raise ValueError(f"{op}: expected n, k >= 0, got n={n}, k={k}")
    n4, kp = F.round_up(max(n, 1), F.ROW_TILE), F.round_up(max(k, 1), F.K_BLOCK)
    _, G, gw = F.plane_geometry(k, group_size)
    want = (("packed", torch.uint8, n4 * kp // (2 if F.layout_bits(bits) == 4 else 1)),
            ("scales", torch.float32, n * G), ("offsets", torch.float32, n * G))
    if act_bits:
        want += (("planes", torch.int64, n4 * G * bits * gw), ("wsum", torch.int32, n * G))
    return want


@_qmatmul_custom.register_fake
@fake_on_one_device(_qmatmul_custom)
def _(x, packed, scales, offsets, planes, wsum, bias, n, k, bits, group_size, act_bits, backend):
    return x.new_empty(*x.shape[:-1], n)


@_qmatmul_custom.register_vmap
def _(info, in_dims, x, packed, scales, offsets, planes, wsum, bias, n, k, bits, group_size, act_bits, backend):
    """torch.vmap over the activations (the common case: the same weight for every sample) is one call
    with the vmapped dim as one more leading dim of x (torch's fallback: one call per sample). A vmapped
    weight or bias: one call per sample here, each exact as the unvmapped op."""
    rest = (n, k, bits, group_size, act_bits, backend)
    if all(d is None for d in in_dims[1:7]):
        return _qmatmul_custom(vmapped_first(x, in_dims[0], info.batch_size), packed, scales, offsets, planes, wsum,
                               bias, *rest), 0
    tensors = (x, packed, scales, offsets, planes, wsum, bias)
    per_sample = [[t if t is None or d is None else t.select(d, i) for t, d in zip(tensors, in_dims[:7])]
                  for i in range(info.batch_size)]
    outs = [_qmatmul_custom(*ts, *rest) for ts in per_sample]
    if outs:
        return torch.stack(outs), 0
    return x.new_empty(vmapped_first(x, in_dims[0], 0).shape[:-1] + (n,)), 0


def _setup_context(ctx, inputs, output):
    x, packed, scales, offsets, planes, wsum, bias, n, k, bits, group_size, act_bits, backend = inputs
    # the weights only where dx is needed: a bias-only gradient needs none of them (and buffers made under
    # inference_mode cannot be saved)
    ctx.x_needs_grad = x.requires_grad
    ctx.save_for_backward(*((packed, scales, offsets) if x.requires_grad else ()))
    ctx.meta = (n, k, bits, group_size, x.dtype)
    ctx.bias_needs_grad = bias is not None and bias.requires_grad


_DX_ROWS = 256  # weight rows dequantized at a time in the backward (4 MiB of fp32 at K=4096: in L2/L3)


def _dx_cpu(grad, packed, scales, offsets, n, k, bits, group_size):
    """grad @ W (fp32) with W dequantized natively _DX_ROWS rows at a time into one buffer, each chunk
    multiplied while it is in cache (addmm into dx): the whole W written and read back from DRAM was
    ~15% of an M=128 4096 x 4096 fwd+bwd."""
    g2 = grad.reshape(-1, n).to(torch.float32)
    step = min(n, _DX_ROWS)
    buf = torch.empty(step, k, dtype=torch.float32)
    dx = None
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        w = _dequant_cpu(packed, scales, offsets, n, k, bits, group_size, (r0, r1), out=buf)
        dx = torch.mm(g2[:, r0:r1], w) if dx is None else dx.addmm_(g2[:, r0:r1], w)
    return dx.reshape(*grad.shape[:-1], k)


def _backward(ctx, grad):
    """d/dx of x @ W.T with W the dequantized weight (a straight-through estimator for act_bits);
    the bias gets the usual sum. The quantized weight itself has no gradient."""
    n, k, bits, group_size, dtype = ctx.meta
    gx = None
    if ctx.x_needs_grad:
        packed, scales, offsets = ctx.saved_tensors
        if packed.device.type == "cpu" and type(packed) is torch.Tensor and not _traced_or_transformed():
            # (traced, fake or under vmap the formulas: the native call needs real storage)
            # the native dequantizer (bit-identical to the formulas below, threaded): through torch's
            # unpack/index/mul ops the weight took ~17 ms of an M=16 1024x1024 layer's ~20 ms fwd+bwd
            # (nn.Linear's fwd+bwd, dW included: 3.7 ms; one thread, 2-core Zen 4)
            gx = _dx_cpu(grad, packed, scales, offsets, n, k, bits, group_size).to(dtype)
        else:
            W = F.dequantize_codes(F.unpack_tiles(packed, bits, n, k), scales, offsets, group_size, torch.float32)
            gx = (grad.to(torch.float32) @ W).to(dtype)
    gb = grad.reshape(-1, n).sum(0) if ctx.bias_needs_grad else None
    return gx, None, None, None, None, None, gb, None, None, None, None, None, None


_qmatmul_custom.register_autograd(_backward, setup_context=_setup_context)
_qmatmul_call = functorch_autograd("qmatmul", _setup_context, _backward)


# eager calls where x or the bias requires grad (eager_autograd): the op's autograd without its layers (~40 us
# a call, as much as a small layer's forward)
_EagerQmatmul = eager_autograd_function("_EagerQmatmul", _impl, _setup_context, _backward)


def qmatmul_op(x, packed, scales, offsets, planes, wsum, bias, n, k, bits, group_size, act_bits, backend):
    if act_bits and planes is None:
        raise ValueError("pykernels.qmatmul: act_bits needs the weight's bit planes")
    if eager_direct(x, packed, scales, offsets, planes, wsum, bias, op="qmatmul"):
        # Eager fast path (same implementation, minus the torch.library dispatch layers: ~10% of a
        # 4096x4096 GEMV). Tracing, fake tensors, vmap and autograd go through the registered op: the
        # one test every op's direct path uses (pykernels._backend.eager_direct). The op's checks of the
        # buffers run here too (~4 us): a QuantizedWeight's or QuantLinear's tensors can be reassigned
        # after they were checked (a 16-byte `packed` segfaulted, float16 scales of a bias-free layer
        # loaded with assign=True gave inf/NaN; review finding).
        _check_op_args(x, packed, scales, offsets, planes, wsum, bias, n, k, bits, group_size, act_bits)
        return _impl(x, packed, scales, offsets, planes, wsum, bias, n, k, bits, group_size, act_bits, backend)
    if eager_autograd(x, packed, scales, offsets, planes, wsum, bias):  # eager, x or bias requires grad
        _check_op_args(x, packed, scales, offsets, planes, wsum, bias, n, k, bits, group_size, act_bits)
        return _EagerQmatmul.apply(x, packed, scales, offsets, planes, wsum, bias, n, k, bits, group_size, act_bits,
                                   backend)
    return _qmatmul_call(x, packed, scales, offsets, planes, wsum, bias, n, k, bits, group_size, act_bits,
                         backend)


# ------------------------------------------------------------------------------------------------
# Autotuning (python -m pykernels.autotune generate --ops qgemm)
# ------------------------------------------------------------------------------------------------
def register_tunables(quantize):
    def as_act_bits(act_bits):  # as qmatmul takes it (numpy ints, 0-d integer tensors): keys must match
        return 0 if act_bits is None else operator.index(act_bits)

    def make_key(x, qw, bias=None, act_bits=None, **kw):
        N, K = qw.shape
        return _key(x.reshape(-1, K).shape[0], N, K, qw.bits, qw.group_size, as_act_bits(act_bits), x.dtype)

    def candidates(key):
        if key.get("act_bits"):
            return [{"mode": m, "threads": t} for m in ((0, 1, 2, 3) if _has_avx512() else (0, 1, 2)) for t in (0, 1)]
        out = []
        avx512 = _has_avx512()
        # with AVX-512 the AVX2 kernel only keeps its default blocking as a candidate
        m_blocks, n_blocks = ((16,), (8,)) if avx512 else ((4, 16, 64), (1, 8, 32))
        for threads in (0, 1):  # all of torch's threads, or one (shared/noisy machines, tiny shapes)
            for impl in ("native", "dequant_mm"):
                for m_block in (m_blocks if impl == "native" else (16,)):
                    for n_block in (n_blocks if impl == "native" else (8,)):
                        out.append({"impl": impl, "threads": threads, "m_block": m_block, "n_block": n_block,
                                    "isa": 1})
            if _has_avx2():
                for kc in (256, 512):
                    for nc in (256, 1024):
                        out.append({"impl": "sgemm", "threads": threads, "kc": kc, "mc": 144, "nc": nc})
            if _amx_fits(key) and _has_amx():
                out.append({"impl": "amx", "threads": threads})
            if _amx_fits(key) and avx512 and _has_bf16dot():
                out.append({"impl": "bf16dot", "threads": threads, "min_m": BF16DOT_MIN_M})
            if avx512:  # the VNNI tier: GEMV kernel or panel GEMM, weights in one or more passes
                for gemm_min_m in (2, 12, 1 << 30):
                    for m_block in (32, 4096):
                        for n_block in (1, 8):
                            out.append({"impl": "native", "threads": threads, "m_block": m_block,
                                        "n_block": n_block, "isa": 2, "gemm_min_m": gemm_min_m})
        return out

    def runner(backend):
        """The tunables' run: the op's implementation on that backend with the config given."""
        def run(config, x, qw, bias=None, act_bits=None):
            N, K = qw.shape
            act_bits = as_act_bits(act_bits)
            planes = qw.ensure_planes() if act_bits else None
            return _impl(x, qw.packed, qw.scales, qw.offsets, planes, qw.code_sums if act_bits else None, bias,
                         N, K, qw.bits, qw.group_size, act_bits, backend, config=config)
        return run


    def examples(sizes):
        g = torch.Generator().manual_seed(0)
        shapes = []
        for n in (sizes or [4096]):
            for M in (1, 16, 128):
                shapes.append((M, n, n, 4, 128, None, torch.float32))
            for M in (16, 128):  # bf16 activations (an LLM's usual): their own kernels ("amx", "bf16dot")
                shapes.append((M, n, n, 4, 128, None, torch.bfloat16))
            shapes.append((1, n, n, 2, 128, 2, torch.float32))
            shapes.append((1, n, n, 1, 128, 1, torch.float32))
        out = []
        for M, N, K, bits, gs, ab, dt in shapes:
            w = torch.randn(N, K, generator=g)
            scheme = "bipolar" if ab else "asym"
            qw = quantize(w, bits, gs, scheme)
            out.append(((torch.randn(M, K, generator=g).to(dt), qw), {"act_bits": ab}))
        return out

    def check(x, qw, bias=None, act_bits=None, backend="auto"):
        """The public op on the example (tune() runs it first): its argument checks, one warm-up run."""
        from . import qmatmul

        qmatmul(x, qw, bias, act_bits=act_bits, backend=backend)

    autotune.register(autotune.Tunable(op="qmatmul", group="qgemm", backend="cpu", make_key=make_key,
                                       default=_default_cpu_config, candidates=candidates, run=runner("cpu"),
                                       examples=examples, check=check))

    # GPU: Triton tiles (only those AOT_SPECS compiles for sm_90 without spills) and split-K.
    def triton_default(key):
        from ._triton import default_config

        if key.get("act_bits"):
            return {"BLOCK_M": 16, "BLOCK_N": 32}
        return default_config(key["M"], key["N"], key["K"], getattr(torch, key["dtype"]))

    def triton_candidates(key):
        if key.get("act_bits"):
            return [{"BLOCK_M": 16, "BLOCK_N": 32}, {"BLOCK_M": 32, "BLOCK_N": 64}]
        if key["dtype"] == "float32":
            tiles = [(16, 64, 32)]
        else:
            tiles = [(16, 64, 32), (16, 64, 64), (32, 128, 32), (64, 128, 32)]
        return [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": 4, "num_stages": 3}
                for bm, bn, bk in tiles for sk in (1, 2, 4, 8)]

    def gpu_examples(sizes):  # (the Triton and CUDA tunables: W4A16 fp16 at M = 1, 16, 64)
        if not torch.cuda.is_available():
            return []
        out = []
        for n in (sizes or [8192]):
            qw = quantize(torch.randn(n, n), 4, 128, "asym").to("cuda")
            for M in (1, 16, 64):
                out.append(((torch.randn(M, n, device="cuda", dtype=torch.float16), qw), {}))
        return out

    autotune.register(autotune.Tunable(op="qmatmul", group="qgemm", backend="triton", make_key=make_key,
                                       default=triton_default, candidates=triton_candidates, run=runner("triton"),
                                       examples=gpu_examples, check=check))

    # GPU: the native CUDA kernels. {} is the kernel's own choice (cuda_qmatmul: the tensor-core kernel
    # where it applies, 2 row groups per CTA from N = 4096, loads not pipelined; 1-bit MMA for bit-serial
    # on sm_80+), so the default needs no device to be named.
    def cuda_candidates(key):
        cuda_mma = torch.version.hip is None
        if key.get("act_bits"):
            return [{}, {"mma": False}] if cuda_mma else [{}]
        out = [{}, {"kernel": "simt"}]
        if cuda_mma and key["dtype"] in ("float16", "bfloat16") and key["bits"] <= 4:
            out += [{"kernel": "mma", "rg": rg, "pipe": pipe} for rg in (1, 2, 4) for pipe in (False, True)]
        return out

    autotune.register(autotune.Tunable(op="qmatmul", group="qgemm", backend="cuda", make_key=make_key,
                                       default=lambda key: {}, candidates=cuda_candidates, run=runner("cuda"),
                                       examples=gpu_examples, check=check))
