"""Config space of the Triton flash-attention kernels (no triton import here, so the autotuner can list it
anywhere). Every config listed is compiled for sm_90 by tests/test_gpu_build.py through `_triton.AOT_SPECS`
(no register spills, shared memory within the H100/H200 limit), so the tuner never picks one that does not fit.

Forward: BLOCK_M query rows x BLOCK_N keys per step (FlashAttention-2's tiling: one program per query
tile, K/V streamed through shared memory with `num_stages` pipelining). Larger head dims need smaller
tiles: the fp32 accumulator is BLOCK_M x D registers spread over num_warps*32 threads.
Backward: kernel 1 (dK, dV) holds BLOCK_N1 keys and streams BLOCK_M1 query rows; kernel 2 (dQ) holds
BLOCK_M2 query rows and streams BLOCK_N2 keys (the split of the Triton fused-attention tutorial).
"""
from __future__ import annotations


def block_d(d: int) -> int:
    """Head dim padded to a power of two, at least 16 (tl.dot's minimum)."""
    p = 16
    while p < d:
        p *= 2
    return p


def _f(bm, bn, w, s):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}


def _b(bm1, bn1, bm2, bn2, w, s, w_dq=None):
    c = {"BLOCK_M1": bm1, "BLOCK_N1": bn1, "BLOCK_M2": bm2, "BLOCK_N2": bn2, "num_warps": w, "num_stages": s}
    if w_dq is not None:  # the dQ kernel's own warp count (num_warps is then the dK/dV kernel's)
        c["num_warps_dq"] = w_dq
    return c


# Keyed by (padded head dim, 16-bit or fp32); head dims 16 and 32 share the 64 list. The first entry is
# the default. Every entry was compiled for sm_90 with Triton 3.9 (tests/test_gpu_build.py): the tiles of
# the Triton tutorial (fwd 128x64 with 4 warps, bwd 32x128/128x32) spill here, hence 8 warps or smaller
# tiles. fp32 uses IEEE-precision dots (FMA, not tensor cores), which need small tiles to fit.
_FWD = {
    (64, 16): [_f(128, 64, 8, 3), _f(64, 64, 4, 3), _f(128, 128, 8, 3)],
    (128, 16): [_f(128, 64, 8, 3), _f(64, 64, 8, 3)],
    (256, 16): [_f(64, 32, 8, 2), _f(64, 32, 8, 1)],
    (64, 32): [_f(64, 32, 8, 2), _f(32, 32, 4, 2)],
    (128, 32): [_f(32, 32, 8, 2)],
    (256, 32): [_f(16, 32, 8, 1), _f(16, 16, 4, 1)],
}
_BWD = {
    (64, 16): [_b(32, 64, 64, 32, 4, 3), _b(32, 128, 128, 32, 8, 3)],
    # 32-row / 32-key streamed tiles: 8 warps fit the dK/dV kernel and 4 the dQ kernel without spills
    # (candidates; the 16-row default was the only shape with one warp count for both)
    (128, 16): [_b(16, 64, 64, 16, 8, 2), _b(16, 64, 64, 16, 8, 3), _b(32, 64, 64, 32, 8, 2, 4),
                _b(32, 64, 64, 32, 8, 3, 4)],
    (256, 16): [_b(16, 32, 32, 16, 8, 1)],
    (64, 32): [_b(16, 32, 32, 16, 4, 2)],
    (128, 32): [_b(16, 32, 32, 16, 4, 1), _b(16, 32, 32, 16, 8, 1)],
    (256, 32): [_b(16, 16, 16, 16, 4, 1)],
}

# Small tiles for TRITON_INTERPRET=1 on CPU tensors: the interpreter's cost grows with tile size, and
# small tiles exercise the multi-block and masked-edge paths on small test shapes.
INTERPRET_FWD = _f(16, 16, 1, 1)
INTERPRET_BWD = _b(16, 16, 16, 16, 1, 1)


def _width(dtype: str) -> int:
    return 32 if dtype in ("float32", "torch.float32") else 16


def _bucket(d: int) -> int:
    return max(64, block_d(d))


def fwd_configs(d: int, dtype: str) -> list:
    return [dict(c) for c in _FWD[(_bucket(d), _width(dtype))]]


def bwd_configs(d: int, dtype: str) -> list:
    return [dict(c) for c in _BWD[(_bucket(d), _width(dtype))]]


def default_fwd(d: int, dtype: str) -> dict:
    return fwd_configs(d, dtype)[0]


def default_bwd(d: int, dtype: str) -> dict:
    return bwd_configs(d, dtype)[0]
