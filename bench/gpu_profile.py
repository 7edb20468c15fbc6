"""Kernels worth a hardware profile, each launched a few times at a benchmark's shape, for Nsight Compute:

    ncu --kernel-name regex:'onesweep|global_hist|wo_gemm|w4a16|attn' --launch-count 12 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy python -m bench.gpu_profile

One process, no timing of its own: ncu replays each profiled launch and reports throughput and stall
reasons (bench/gpu_runs keeps what the GPU runs found)."""
from __future__ import annotations

import sys

import torch

import pykernels


def main(which: str = "sort,qgemm,attention") -> None:
    which = which.split(",")
    dev = "cuda"
    if "sort" in which:
        x = torch.randint(0, 2**31 - 1, (1 << 26,), device=dev, dtype=torch.int64).to(torch.uint32)
        pykernels.sort_keys(x, backend="cuda")
        torch.cuda.synchronize()
    if "qgemm" in which:
        w = torch.randn(8192, 8192, device=dev)
        qw = pykernels.quantize(w, 4, 128, "asym")
        for m in (1, 16):
            x = torch.randn(m, 8192, device=dev, dtype=torch.float16)
            for backend in ("cuda", "triton"):
                pykernels.qmatmul(x, qw, backend=backend)
        torch.cuda.synchronize()
    if "attention" in which:
        q, k, v = (torch.randn(1, 16, 8192, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
        pykernels.flash_attention(q, k, v, causal=True)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main(*sys.argv[1:])
