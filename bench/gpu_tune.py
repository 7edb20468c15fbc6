"""Tunes, on this GPU, the configs the GPU benchmarks' goal cases run, and prints every config's time:

    python -m bench.gpu_tune [sort_keys,sort_pairs,qmatmul,qmatmul_cuda,attention_bwd,hash_table]

The cache it writes (pykernels.autotune, per device and shape) is what `python -m bench --gpu` then
runs in the same machine session: bench/gpu_suite.sh runs it first when TUNE_SCRIPT names the ops
(a comma list, as above). Goal shapes only
(2^28 uint32 keys; 8192 x 8192 W4A16 at M = 1/16/64, Triton or CUDA; the attention backward at the
benchmark's S = 8192, bf16, 16 heads, D = 128, causal and not; the hash tables' window at 2^26 keys, where
the insert goal was missed: uint32 keys at load 0.95, uint64 at 0.9), so it fits a short GPU lease, unlike
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
    if "hash_table" in which:
        # the window (probing-group size) of a new GPU table, keyed by slot bytes: 8 for uint32 keys with
        # int32 values, 16 for uint64 with int64; each candidate builds a table of the example's capacity,
        # inserts the keys and finds them (pykernels/hashing/_tune.py)
        from bench.suite_hash import _keys

        n = 1 << 26
        for dtype, vdtype, load in ((torch.uint32, torch.int32, 0.95), (torch.uint64, torch.int64, 0.9)):
            keys = _keys(n, 1, dtype, "cuda")
            table = pykernels.HashMap(int(n / load) + 1, key_dtype=dtype, value_dtype=vdtype, device="cuda",
                                      max_load_factor=1.0, growable=False)
            t0 = time.perf_counter()
            cfg = at.tune("hash_table", table, keys, backend="cuda", budget_s=budget_s, verbose=True)
            print(f"hash_table {dtype} n=2^26 load={load}: {cfg} ({time.perf_counter() - t0:.1f} s)", flush=True)
            del keys, table
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:2], *[float(a) for a in sys.argv[2:3]])
