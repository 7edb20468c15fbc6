"""Quantization formats and the packed layouts the kernels read (made once, at quantize time).

Every scheme is stored in one affine form per (output row n, group g):

    w[n, k] = scales[n, g] * u[n, k] + offsets[n, g],     u = unsigned code in [0, 2^bits - 1]

so one kernel serves all three schemes (y = s * sum(x*u) + m * sum(x) per group):

- "asym"    (bits 2/3/4/8): lo = min(w, 0), hi = max(w, 0), s = (hi - lo) / (2^b - 1),
            integer zero point zp = round(-lo / s), u = clamp(round(w / s) + zp), offset m = -s * zp.
- "sym"     (bits 2/3/4/8): s = max|w| / (2^(b-1) - 1), u = clamp(round(w / s) + 2^(b-1)), m = -s * 2^(b-1).
- "bipolar" (bits 1..8, bipolar-INT of the arbitrary-precision LLM accelerator paper): each bit plane
            reads as -1/+1, the word is W' = sum_i (2 b_i - 1) 2^i = 2u - (2^b - 1) (odd values, no sign
            bit); W = (s/2) W' + z, the affine form above with m = z - s (2^b - 1) / 2. s and m are
            fitted for least squared error (_bipolar_fit: the better of the range s = (max - min) / (2^b - 1),
            m = min and a Gaussian start, then Lloyd rounds on the uniform grid): at 1-3 bits the range alone spent the levels
            on the tails. See ALGORITHMS.md ("Bipolar-INT").

Round to nearest (ties to even, like torch.round). A group whose values are all equal (a pruned or
padded row of zeros, a constant) gets s = 0 and is reproduced exactly by its offset alone, in
dequantize and in every kernel. Not s = 1: the kernels take s * sum(x * (u - 2^(bits-1))) over
int16-rounded x plus (m + s * 2^(bits-1)) * sum(x), so s = 1 left 2^(bits-1) times the activations'
rounding error on the row (an all-zero 8-bit asym row gave 0.07-0.5 instead of 0).

Packed layouts (rows padded to a multiple of 4, K padded to a multiple of 32 with code 0):
- "nib" (bits <= 4): for each tile of 4 rows and each 32-element block, 4 x 16 bytes (one cache line);
  byte j of a row holds code k = 32b + j in its low nibble and k = 32b + 16 + j in its high nibble, so
  an AVX2 kernel widens 16 bytes to int16 lanes and gets both halves with one AND and one shift.
- "byte" (bits 5..8): the same tiling with one byte per code (4 x 32 bytes per block).
- bit planes (bit-serial, act_bits): for each tile of 4 rows, group g, plane j, word w: 4 uint64 (one
  per row), bit t of word w = bit j of the code at position 64 w + t of the group. Groups are padded
  to whole 64-bit words so per-group popcounts never straddle a group.
"""
from __future__ import annotations

import math

import torch

SCHEMES = ("asym", "sym", "bipolar")
ROW_TILE = 4     # rows interleaved per tile (one 64-byte line per 32-element block at 4 bits)
K_BLOCK = 32     # codes per block in the nib/byte layouts


def valid_group_size(group_size) -> bool:
    """-1 (one group per row) or a positive multiple of K_BLOCK: every kernel finds a code's group per
    32-code block (32, 64, 128 are the usual choices; 96, 256, 1024 work the same)."""
    return (isinstance(group_size, int) and not isinstance(group_size, bool)
            and (group_size == -1 or (group_size > 0 and group_size % K_BLOCK == 0)))


def allowed_bits(scheme: str):
    return tuple(range(1, 9)) if scheme == "bipolar" else (2, 3, 4, 8)


def layout_bits(bits: int) -> int:
    """4 -> the nibble layout (bits 1..4), 8 -> the byte layout (bits 5..8)."""
    return 4 if bits <= 4 else 8


def round_up(a: int, b: int) -> int:
    return (a + b - 1) // b * b


def group_geometry(K: int, group_size: int):
    """(gsize, G): the group length and the number of groups (the last one may be shorter)."""
    gsize = K if group_size == -1 else group_size
    gsize = max(gsize, 1)
    return gsize, max(1, math.ceil(K / gsize)) if K > 0 else 0


# The bit-serial kernels (act_bits) sum a group's weight codes (code_sums) and activation codes in 32 bits:
# at most 255 * MAX_BITSERIAL_GROUP < 2^31 for codes of up to 8 bits (review finding: K = 9M with
# group_size=-1 wrapped them, and the result was wrong with no error).
MAX_BITSERIAL_GROUP = (2 ** 31 - 1) // 255


def check_bitserial_group(op: str, K: int, group_size: int):
    gsize = min(group_geometry(K, group_size)[0], max(K, 1))
    if gsize > MAX_BITSERIAL_GROUP:
        raise ValueError(f"{op}: act_bits needs groups of at most {MAX_BITSERIAL_GROUP} inputs (the bit-serial "
                         f"kernels sum a group's codes in 32 bits), got group_size={group_size} with K={K}; "
                         f"quantize with a smaller group_size")


def quantize_codes(w: torch.Tensor, bits: int, group_size: int, scheme: str):
    """Round-to-nearest quantization of w [N, K] -> (codes uint8 [N, K], scales f32 [N, G], offsets f32 [N, G])."""
    N, K = w.shape
    gsize, G = group_geometry(K, group_size)
    qmax = (1 << bits) - 1
    w64 = w.detach().to(torch.float64)
    if K == 0 or N == 0:
        z = torch.zeros(N, G, dtype=torch.float32, device=w.device)
        return torch.zeros(N, K, dtype=torch.uint8, device=w.device), z + 1, z
    Kp = G * gsize
    if Kp != K:  # pad the last group with a copy of its last value: min/max/absmax are unchanged
        w64 = torch.cat([w64, w64[:, -1:].expand(N, Kp - K)], dim=1)
    wg = w64.reshape(N, G, gsize)
    if scheme == "asym":  # (safe: s with 1 for constant groups, for the divisions; they store s = 0 below)
        lo = wg.amin(-1).clamp(max=0.0)
        hi = wg.amax(-1).clamp(min=0.0)
        s = _f32((hi - lo) / qmax)  # tested after the rounding to float32: a subnormal group's scale
        underflow = s == 0           # rounds to 0 there (audit finding): stored as a zero group below
        s = torch.where(s > 0, s, torch.ones_like(s))
        zp = torch.clamp(torch.round(-lo / s), 0, qmax)
        u = torch.clamp(torch.round(wg / s[..., None]) + zp[..., None], 0, qmax)
        m = -s * zp
    elif scheme == "sym":
        half = 1 << (bits - 1)
        amax = wg.abs().amax(-1)
        s = _f32(amax / (half - 1))
        underflow = s == 0
        s = torch.where(s > 0, s, torch.ones_like(s))
        u = torch.clamp(torch.round(wg / s[..., None]) + half, 0, qmax)
        m = -s * half
    elif scheme == "bipolar":
        real = (torch.arange(Kp, device=w.device) < K).to(torch.float64).reshape(1, G, gsize)
        s, m, u = _bipolar_fit(wg, real, qmax)
    else:  # checked by the caller
        raise ValueError(scheme)
    codes = u.reshape(N, Kp)[:, :K].to(torch.uint8)
    # constant groups (the fallback s = 1 above kept their codes and offsets finite): w = m, s = 0 (see
    # the module notes). asym and sym made m = -1 * zp and -1 * 2^(bits-1) there: 0 for a zero group,
    # their only constant one; bipolar's m is the constant.
    # A group whose scale underflows float32 (|w| ~ 1e-44) is stored as zeros too: with the fallback
    # s = 1 its codes dequantized to 0, but the kernels' two cancelling terms s * sum((u - c) x) and the
    # offset term then cost the row ~1e-3 relative error (review finding)
    constant = (wg.amax(-1) == wg.amin(-1)) if scheme == "bipolar" else (wg.abs().amax(-1) == 0) | underflow
    s = torch.where(constant, torch.zeros_like(s), s)
    m = torch.where(constant, torch.zeros_like(m) if scheme != "bipolar" else m, m)
    return codes, s.to(torch.float32), m.to(torch.float32)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).to(torch.float64)  # what is stored: the codes are rounded against it


# Steps of the least-squares uniform quantizer of a unit Gaussian with 2^b levels (Max, "Quantizing for
# minimum distortion", IRE Trans. Inf. Theory 1960, Table II), b = 1..8: a start for weights near normal.
_GAUSS_STEP = (1.596, 0.9957, 0.5860, 0.3352, 0.1881, 0.1041, 0.0569, 0.0308)


def _bipolar_fit(wg: torch.Tensor, real: torch.Tensor, qmax: int, rounds: int = 2):
    """Scale s, offset m (float32 values) and codes u of each group for w ~ s u + m, least squared error.

    Two starts per group, the better one kept: the group's range (s = (max - min) / qmax, m = min: every
    value within half a step) and the Gaussian optimum for the group's mean and deviation; then rounds of
    Lloyd's algorithm on the uniform grid (the least-squares line s u + m through the current codes, then
    each value's nearest code). The range alone wasted the few levels of low bit widths on the tails:
    1 bit kept {min, max} of each group, a relative error of 2.1 on Gaussian weights (worse than zeros;
    audit); fitted, 0.60 (2-means). A step is kept per group only where it lowers the error, so the
    result is never worse than the range's. `real` (1/0) leaves the last group's padding out."""
    lo, hi = wg.amin(-1), wg.amax(-1)  # (the padding copies a real value: the range is unchanged)
    count = real.sum(-1).clamp(min=1.0)

    def codes_and_error(s, m):
        u = torch.clamp(torch.round((wg - m[..., None]) / s[..., None]), 0, qmax)
        return u, (((u * s[..., None] + m[..., None] - wg) ** 2) * real).sum(-1)

    def keep_better(state, s_new, m_new):
        s, m, u, err = state
        u_new, err_new = codes_and_error(s_new, m_new)
        better = err_new < err
        return (torch.where(better, s_new, s), torch.where(better, m_new, m),
                torch.where(better[..., None], u_new, u), torch.where(better, err_new, err))

    s = _f32(torch.where(hi > lo, (hi - lo) / qmax, torch.ones_like(hi)))  # constant groups: s = 1 here
    m = _f32(lo)
    state = (s, m, *codes_and_error(s, m))
    mean_w = (wg * real).sum(-1) / count
    std = torch.sqrt((((wg - mean_w[..., None]) ** 2) * real).sum(-1) / count)
    s_gauss = _GAUSS_STEP[qmax.bit_length() - 1] * std
    fits = s_gauss > 0
    s_gauss = _f32(torch.where(fits, s_gauss, state[0]))
    state = keep_better(state, s_gauss, _f32(torch.where(fits, mean_w - s_gauss * (qmax / 2), state[1])))
    for _ in range(rounds):
        s, m, u, _ = state
        mean_u = (u * real).sum(-1) / count
        du = (u - mean_u[..., None]) * real
        var_u, cov = (du * du).sum(-1), (du * (wg - mean_w[..., None])).sum(-1)
        fits = (var_u > 0) & (cov > 0)
        s_fit = _f32(torch.where(fits, cov / torch.where(fits, var_u, 1.0), s))
        state = keep_better(state, s_fit, _f32(torch.where(fits, mean_w - s_fit * mean_u, m)))
    return state[0], state[1], state[2]


ACT_FIT_ROUNDS = 2  # Lloyd rounds from each start (kActFitRounds in csrc/qgemm/qgemm_act_fit.h)
ACT_FIT_TIE = 1e-9  # a candidate replaces the best only if better by more than this (kActFitTie)


def act_fit(x: torch.Tensor, bits: int):
    """Per-token scale and offset of the activations for act_bits (A ~ sa * u + ma, u = clamp(round((x - ma)
    / sa), 0, 2^bits - 1)), least squared error: the reference the CPU and CUDA kernels follow (the same
    stages in csrc/qgemm/qgemm_act_fit.h) and what the Triton path runs. x: [M, K] float64, finite rows,
    K > 0; returns (sa, ma) float64 [M].

    The per-token range alone (sa = (max - min) / (2^bits - 1), ma = min) put 1-bit activations at {min, max}:
    a relative error of 2.9 on Gaussian tokens, 9.7 on heavy-tailed ones (Student t, 3 dof): worse than
    zeros (audit). Two chains, each a start and ACT_FIT_ROUNDS rounds of Lloyd's algorithm on the uniform
    grid (the least-squares line through the codes, then each value's nearest code): from the range, and
    from the Gaussian optimum for the token's mean and deviation; the lowest squared error of all is kept,
    so never worse than the range. Gaussian tokens: 1 bit 0.60, 2 bits 0.35 (was 0.71), 4 bits 0.108
    (0.140), 8 bits unchanged. (The passes scale by the reciprocal of sa, where the codes divide: they
    only choose between candidates.)"""
    K = x.shape[1]
    qmax = (1 << bits) - 1
    lo, hi = x.amin(1), x.amax(1)
    mean = x.sum(1) / K
    dev = x - mean[:, None]
    ones = torch.ones_like(lo)

    def evaluate(s, m):  # (squared error, sum u, sum u^2, sum u (x - mean)) of the codes of (s, m)
        u = torch.round(torch.clamp((x - m[:, None]) * (1.0 / s)[:, None], 0, qmax))
        d = u * s[:, None] + m[:, None] - x
        return (d * d).sum(1), u.sum(1), (u * u).sum(1), (u * dev).sum(1)

    big = float(torch.finfo(torch.float32).max)

    def fp32_grid(s, m):  # levels m .. m + qmax s in float32 range (fp32_grid in qgemm_act_fit.h)
        top = m + s * qmax
        return (s <= big) & (m >= -big) & (m <= big) & (top <= big) & (top >= -big)

    best = None
    # one bit over a range past float32's max: the step itself is no float32 (the GPU stores it as one:
    # inf, and NaN products; review finding), so it is capped there, as in qgemm_act_fit.h
    s_range = torch.where(hi > lo, (hi - lo) / qmax, ones).clamp(max=big)
    s_gauss = _GAUSS_STEP[bits - 1] * torch.sqrt((dev * dev).sum(1) / K)
    m_gauss = mean - s_gauss * (qmax * 0.5)
    for s, m, alive in ((s_range, lo, torch.ones_like(lo, dtype=torch.bool)),
                        (s_gauss, m_gauss, (s_gauss > 0) & fp32_grid(s_gauss, m_gauss))):
        for round_ in range(ACT_FIT_ROUNDS + 1):
            if round_:  # Lloyd: the least-squares line through the chain's last codes
                _, su, suu, sux = stats
                var_u = suu - su * (su / K)
                alive = alive & (var_u > 0) & (sux > 0)
                s = sux / torch.where(alive, var_u, ones)
                m = mean - s * (su / K)
                alive = alive & fp32_grid(s, m)
            s, m = torch.where(alive, s, ones), torch.where(alive, m, lo)
            stats = evaluate(s, m)
            if best is None:
                best = (s, m, stats[0])
                continue
            better = alive & (stats[0] < best[2] * (1 - ACT_FIT_TIE))  # clearly better (qgemm_act_fit.h)
            best = tuple(torch.where(better, new, old) for new, old in zip((s, m, stats[0]), best))
    return best[0], best[1]


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
                     dtype=torch.float32) -> torch.Tensor:
    N, K = codes.shape
    gsize, G = group_geometry(K, group_size)
    if K == 0:
        return torch.zeros(N, 0, dtype=dtype, device=codes.device)
    idx = torch.arange(K, device=codes.device) // gsize
    s = scales.to(torch.float64)[:, idx]
    m = offsets.to(torch.float64)[:, idx]
    return (codes.to(torch.float64) * s + m).to(dtype)


# ------------------------------------------------------------------------------------------------
# Packed layouts
# ------------------------------------------------------------------------------------------------
def _pad_codes(codes: torch.Tensor) -> torch.Tensor:
    N, K = codes.shape
    N4, Kp = round_up(max(N, 1), ROW_TILE), round_up(max(K, 1), K_BLOCK)
    out = torch.zeros(N4, Kp, dtype=torch.uint8, device=codes.device)
    out[:N, :K] = codes
    return out


def pack_tiles(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] -> the flat uint8 nib (bits <= 4) or byte (bits 5..8) layout."""
    u = _pad_codes(codes)
    N4, Kp = u.shape
    B = Kp // K_BLOCK
    u = u.reshape(N4 // ROW_TILE, ROW_TILE, B, K_BLOCK)
    if layout_bits(bits) == 4:
        u = u[..., :16] | (u[..., 16:] << 4)
    return u.permute(0, 2, 1, 3).contiguous().reshape(-1)


def unpack_tiles(packed: torch.Tensor, bits: int, N: int, K: int) -> torch.Tensor:
    """Inverse of pack_tiles: [N, K] uint8 codes."""
    N4, Kp = round_up(max(N, 1), ROW_TILE), round_up(max(K, 1), K_BLOCK)
    B = Kp // K_BLOCK
    width = 16 if layout_bits(bits) == 4 else 32
    t = packed.reshape(N4 // ROW_TILE, B, ROW_TILE, width).permute(0, 2, 1, 3)
    if width == 16:
        t = torch.cat([t & 0x0F, t >> 4], dim=-1)
    return t.reshape(N4, Kp)[:N, :K].contiguous()


def plane_geometry(K: int, group_size: int):
    """(gsize, G, gw): group length, number of groups, 64-bit words per group in the bit planes."""
    gsize, G = group_geometry(K, group_size)
    return gsize, G, max(1, math.ceil(gsize / 64))


def pack_planes(codes: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """codes [N, K] -> int64 bit planes [N4/4, G, bits, gw, 4] (flat), see the module docstring."""
    N, K = codes.shape
    gsize, G, gw = plane_geometry(K, group_size)
    N4 = round_up(max(N, 1), ROW_TILE)
    u = torch.zeros(N4, G * gsize, dtype=torch.uint8, device=codes.device)
    u[:N, :K] = codes
    u = u.reshape(N4, G, gsize)
    if gw * 64 != gsize:
        u = torch.cat([u, torch.zeros(N4, G, gw * 64 - gsize, dtype=torch.uint8, device=u.device)], dim=-1)
    weights = (1 << torch.arange(8, dtype=torch.int32, device=u.device))
    planes = []
    for j in range(bits):
        b = ((u >> j) & 1).to(torch.int32).reshape(N4, G, gw * 8, 8)
        byte = (b * weights).sum(-1).to(torch.uint8)           # little-endian bytes of each word
        planes.append(byte.reshape(N4, G, gw, 8))
    p = torch.stack(planes, dim=2)                               # [N4, G, bits, gw, 8 bytes]
    p = p.reshape(N4 // ROW_TILE, ROW_TILE, G, bits, gw, 8).permute(0, 2, 3, 4, 1, 5).contiguous()
    return p.reshape(-1).view(torch.int64)


def code_sums(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """sum of codes per (row, group), int32 [N, G] (the colsum term of the bit-serial recombination)."""
    N, K = codes.shape
    gsize, G = group_geometry(K, group_size)
    u = torch.zeros(N, G * gsize, dtype=torch.int32, device=codes.device)
    u[:, :K] = codes.to(torch.int32)
    return u.reshape(N, G, gsize).sum(-1, dtype=torch.int32)
