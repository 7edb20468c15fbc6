"""Tunes, on this GPU, the configs the GPU benchmarks' goal cases run, and prints every config's time:

    python -m bench.gpu_tune [sort_keys,sort_pairs,qmatmul,qmatmul_cuda,attention_bwd]

The cache it writes (pykernels.autotune, per device and shape) is what `python -m bench --gpu` then
runs in the same machine session: bench/gpu_suite.sh runs it first when TUNE_SCRIPT=1. Goal shapes only
(2^28 uint32 keys; 8192 x 8192 W4A16 at M = 1/16/64, Triton or CUDA; the attention backward at the
benchmark's S = 8192, bf16, 16 heads, D = 128, causal and not), so it fits a short GPU lease, unlike
`python -m pykernels.autotune generate`, which tunes every op of a group on all its examples."""
from __future__ import annotations

import sys
import time

import torch

import pykernels
import pykernels.autotune as at


def main(which: str = "sort_keys,sort_pairs,qmatmul_cuda,qmatmul", budget_s: float = 0.2) -> None:
    which = which.split(",")
    n = 1 << 28
    if "sort_keys" in which or "sort_pairs" in which:
        keys = torch.randint(0, 2**31 - 1, (n,), device="cuda", dtype=torch.int64).to(torch.uint32)
        for op in ("sort_keys", "sort_pairs"):
            if op in which:
                args = (keys,) if op == "sort_keys" else (keys, torch.arange(n, dtype=torch.int32, device="cuda"))
                t0 = time.perf_counter()
                cfg = at.tune(op, *args, backend="cuda", budget_s=budget_s, verbose=True)
                print(f"{op} n=2^28 uint32: {cfg} ({time.perf_counter() - t0:.1f} s)", flush=True)
        del keys
        torch.cuda.empty_cache()
    backends = [b for b, name in (("cuda", "qmatmul_cuda"), ("triton", "qmatmul")) if name in which]
    if backends:
        qw = pykernels.quantize(torch.randn(8192, 8192, device="cuda"), 4, 128, "asym")
        for backend in backends:
            for M in (1, 16, 64):
                x = torch.randn(M, 8192, device="cuda", dtype=torch.float16)
                t0 = time.perf_counter()
                cfg = at.tune("qmatmul", x, qw, backend=backend, budget_s=budget_s, verbose=True)
                print(f"qmatmul {backend} M={M}: {cfg} ({time.perf_counter() - t0:.1f} s)", flush=True)
    if "attention_bwd" in which:
        from pykernels.attention import flash_attention

        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, 16, 8192, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
            t0 = time.perf_counter()
            cfg = at.tune("flash_attention_backward", torch.randn_like(out), q, k, v, out, lse, causal=causal,
                          scale=128 ** -0.5, backend="triton", budget_s=budget_s, verbose=True)
            print(f"flash_attention_backward S=8192 causal={causal}: {cfg} ({time.perf_counter() - t0:.1f} s)",
                  flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2], *[float(a) for a in sys.argv[2:3]])
