"""Quantized GEMMs: formats vs a plain round-to-nearest reference, weight-only qmatmul vs
x @ dequant(W).T in float64, bit-serial integer sums vs an exact integer reference."""
import io
import itertools
import math

import numpy as np
import pytest
import torch

import pykernels
from pykernels._native import torch_bf16_gemm_native
from pykernels.quant import _format as F
from pykernels.quant._ops import _impl, cpu_bitserial

SCHEME_BITS = [("asym", b) for b in (2, 3, 4, 8)] + [("sym", b) for b in (2, 3, 4, 8)] + \
              [("bipolar", b) for b in range(1, 9)]
GROUPS = (32, 64, 128, -1)


# ------------------------------------------------------------------------------------------------
# A plain numpy round-to-nearest reference, one group at a time
# ------------------------------------------------------------------------------------------------
def ref_quantize(w, bits, group_size, scheme):
    w = np.asarray(w, dtype=np.float64)
    N, K = w.shape
    g = K if group_size == -1 else group_size
    G = math.ceil(K / g)
    qmax = 2 ** bits - 1
    codes = np.zeros((N, K), np.int64)
    S = np.zeros((N, G)); Mo = np.zeros((N, G))
    for n in range(N):
        for gi in range(G):
            seg = w[n, gi * g:(gi + 1) * g]
            if scheme == "asym":
                lo, hi = min(seg.min(), 0.0), max(seg.max(), 0.0)
                s = float(np.float32((hi - lo) / qmax)) if hi > lo else 1.0
                zp = min(max(np.round(-lo / s), 0), qmax)
                u = np.clip(np.round(seg / s) + zp, 0, qmax)
                m = -s * zp
                if hi == lo:  # a zero group: s = 0, w = m = 0 (the codes as computed with s = 1)
                    s, m = 0.0, 0.0
            elif scheme == "sym":
                half = 2 ** (bits - 1)
                a = np.abs(seg).max()
                s = float(np.float32(a / (half - 1))) if a > 0 else 1.0
                u = np.clip(np.round(seg / s) + half, 0, qmax)
                m = -s * half
                if a == 0:
                    s, m = 0.0, 0.0
            else:
                lo, hi = seg.min(), seg.max()
                s = float(np.float32((hi - lo) / qmax)) if hi > lo else 1.0
                m = float(np.float32(lo))
                u = np.clip(np.round((seg - m) / s), 0, qmax)
                if hi == lo:  # a constant group: s = 0, w = m
                    s = 0.0
            codes[n, gi * g:gi * g + len(seg)] = u
            S[n, gi], Mo[n, gi] = s, np.float32(m)
    return codes, S, Mo


def deq(codes, S, Mo, group_size):
    K = codes.shape[1]
    g = K if group_size == -1 else group_size
    idx = np.arange(K) // g
    return codes * S[:, idx] + Mo[:, idx]


def weights(kind, N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    if kind == "outliers":
        w[torch.rand(N, K, generator=g) < 0.01] *= 100.0
    elif kind == "constant_rows":
        w[::2] = 0.75
        w[1::4] = -2.0
    elif kind == "zeros":
        w.zero_()
    elif kind == "positive":
        w = w.abs() + 1.0
    return w


def check_bipolar_fit(w, qw, bits, group_size, range_codes, range_S, range_Mo):
    """The bipolar quantizer's promises (pykernels/quant/_format.py, _bipolar_fit): each code is the nearest
    level of its group's stored (float32) scale and offset, and no group's squared error exceeds that of
    the plain range quantizer (ref_quantize); constant groups are exact."""
    K = w.shape[1]
    idx = np.arange(K) // (K if group_size == -1 else group_size)
    S, Mo = qw.scales.double().numpy(), qw.offsets.double().numpy()
    w64, u = w.double().numpy(), qw.codes().numpy().astype(np.float64)
    s_safe = np.where(S > 0, S, 1.0)[:, idx]
    nearest = np.clip(np.round((w64 - Mo[:, idx]) / s_safe), 0, 2 ** bits - 1)
    np.testing.assert_array_equal(u, nearest)
    d = qw.dequantize(torch.float64).numpy()
    np.testing.assert_allclose(d, u * S[:, idx] + Mo[:, idx], rtol=1e-12, atol=1e-12)
    G = S.shape[1]
    err = np.zeros((w.shape[0], G))
    err_range = np.zeros((w.shape[0], G))
    np.add.at(err.T, idx, ((d - w64) ** 2).T)
    np.add.at(err_range.T, idx, ((deq(range_codes, range_S, range_Mo, group_size) - w64) ** 2).T)
    assert (err <= err_range * (1 + 1e-9) + 1e-12).all(), (err - err_range).max()
    constant = np.array([[np.ptp(w64[n, idx == g]) == 0 for g in range(G)] for n in range(w.shape[0])])
    assert (err[constant] == 0).all()


def test_bipolar_low_bits_fit_the_weights():
    """1-3 bit bipolar weights are fitted for least squared error: the range alone (levels at each group's
    min and max) gave a relative error of 2.1 at 1 bit on Gaussian weights, worse than zeros (audit)."""
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    for bits, group_size, at_most in [(1, -1, 0.61), (1, 32, 0.6), (2, -1, 0.35), (2, 32, 0.33), (3, 128, 0.2)]:
        qw = pykernels.quantize(w, bits, group_size, "bipolar")
        rel = float((qw.dequantize() - w).norm() / w.norm())
        assert rel <= at_most, (bits, group_size, rel)


@pytest.mark.parametrize("scheme,bits", SCHEME_BITS)
@pytest.mark.parametrize("group_size", GROUPS)
def test_quantize_matches_rtn_reference(scheme, bits, group_size):
    N, K = 7, 200  # K not a multiple of 64/128: a shorter last group
    for kind in ("randn", "outliers", "constant_rows"):
        w = weights(kind, N, K, seed=bits)
        qw = pykernels.quantize(w, bits, group_size, scheme)
        codes, S, Mo = ref_quantize(w.numpy(), bits, group_size, scheme)
        if scheme == "bipolar":  # fitted, not the range: checked by what the fit promises
            check_bipolar_fit(w, qw, bits, group_size, codes, S, Mo)
            continue
        np.testing.assert_array_equal(qw.codes().numpy().astype(np.int64), codes)
        np.testing.assert_allclose(qw.scales.numpy(), S, rtol=0, atol=0)
        np.testing.assert_allclose(qw.offsets.numpy(), Mo.astype(np.float32), rtol=0, atol=0)
        d = qw.dequantize(torch.float64).numpy()
        np.testing.assert_allclose(d, deq(codes, S, Mo, group_size), rtol=1e-12, atol=1e-12)
        # round-to-nearest error: half a step (asym: a step, the zero point is rounded too)
        step = S[:, np.arange(K) // (K if group_size == -1 else group_size)]
        bound = (1.0 if scheme == "asym" else 0.5) * step * (1 + 1e-6) + 1e-6 * np.abs(w.numpy())
        assert (np.abs(d - w.numpy()) <= bound).all(), (kind, np.abs(d - w.numpy()).max())
        assert qw.bits == bits and qw.group_size == group_size and qw.scheme == scheme
        assert tuple(qw.shape) == (N, K)


def test_constant_and_zero_groups_are_exact():
    for scheme, bits in [("asym", 4), ("sym", 4), ("bipolar", 1), ("bipolar", 3)]:
        w = torch.full((4, 64), 0.3125)
        w[1] = 0.0
        w[2] = -7.5
        d = pykernels.quantize(w, bits, 32, scheme).dequantize()
        assert torch.allclose(d, w, atol=1e-6 * 8), (scheme, d)


@pytest.mark.parametrize("scheme,bits", [("asym", 8), ("asym", 4), ("sym", 8), ("bipolar", 8), ("bipolar", 1)])
def test_constant_groups_multiply_exactly(scheme, bits, simd):
    """A zero row (pruned, padded) gives exactly 0 and a constant group c * sum(x) to float rounding, at
    every M and on every tier: constant groups store s = 0 (with s = 1 the kernels left 2^(bits-1) times
    the int16 activations' rounding error: an 8-bit asym zero row gave 0.07-0.5 instead of 0)."""
    g = torch.Generator().manual_seed(11)
    N, K = 8, 512
    w = torch.randn(N, K, generator=g) * 0.02
    w[3] = 0.0
    w[5, 128:256] = 0.0                       # one zero group inside a random row
    if scheme == "bipolar":
        w[6] = 0.25                           # a constant row
        w[7, :128] = -3.0                     # one constant group
    qw = pykernels.quantize(w, bits, 128, scheme)
    assert (qw.scales[3] == 0).all() and (qw.offsets[3] == 0).all() and qw.scales[5, 1] == 0
    assert torch.equal(qw.dequantize()[3], w[3])
    for M in (1, 4, 16, 130):
        x = torch.randn(M, K, generator=g)
        y = pykernels.qmatmul(x, qw)
        assert (y[:, 3] == 0).all(), (M, y[:, 3])
        check_close(y, x, qw)
        if scheme == "bipolar":  # the constant row: 0.25 * sum(x) up to float32 sums
            x64 = x.to(torch.float64)
            err = (y[:, 6].to(torch.float64) - 0.25 * x64.sum(1)).abs()
            assert bool((err <= 1e-6 * 0.25 * x64.abs().sum(1)).all()), (M, err.max())


def test_bipolar_format_semantics():
    # W = (s/2) * W' + z with W' = sum_i (2 b_i - 1) 2^i: odd values in [-(2^b - 1), 2^b - 1]
    w = torch.randn(3, 64)
    for bits in (1, 2, 5):
        qw = pykernels.quantize(w, bits, 32, "bipolar")
        u = qw.codes().to(torch.float64)
        planes = [((qw.codes() >> i) & 1).to(torch.float64) for i in range(bits)]
        wprime = sum((2 * p - 1) * 2 ** i for i, p in enumerate(planes))
        assert torch.equal(wprime, 2 * u - (2 ** bits - 1))
        idx = torch.arange(64) // 32
        s, z = qw.scales.double()[:, idx], qw.zeros.double()[:, idx]
        assert torch.allclose(s / 2 * wprime + z, qw.dequantize(torch.float64), atol=1e-5)


@pytest.mark.parametrize("bits", [1, 3, 4, 6, 8])
def test_packed_layouts_round_trip(bits):
    N, K = 9, 77
    codes = torch.randint(0, 2 ** bits, (N, K), dtype=torch.uint8)
    assert torch.equal(F.unpack_tiles(F.pack_tiles(codes, bits), bits, N, K), codes)
    for gs in (32, 64, -1):
        gsize, G, gw = F.plane_geometry(K, gs)
        planes = F.pack_planes(codes, bits, gs).view(torch.uint8).numpy()
        words = planes.view(np.uint64).reshape(-1, G, bits, gw, 4)
        for n in range(N):
            for k in range(K):
                gi, t = divmod(k, gsize)
                for j in range(bits):
                    bit = (int(words[n // 4, gi, j, t // 64, n % 4]) >> (t % 64)) & 1
                    assert bit == (int(codes[n, k]) >> j) & 1


def test_code_sums():
    codes = torch.randint(0, 16, (5, 70), dtype=torch.uint8)
    cs = F.code_sums(codes, 32)
    ref = torch.stack([codes[:, :32].sum(1), codes[:, 32:64].sum(1), codes[:, 64:].sum(1)], 1)
    assert torch.equal(cs, ref.to(torch.int32))


@pytest.mark.parametrize("edit, err", [
    (lambda sd: sd.update(shape=[4096, 4096]), "'packed' does not match"),      # segfaulted in qmatmul
    (lambda sd: sd.update(packed=torch.empty(0, dtype=torch.uint8)), "'packed' does not match"),  # segfaulted
    (lambda sd: sd.update(bits=8), "'packed' does not match"),                  # byte layout over nibbles
    (lambda sd: (sd.update(bits=2), sd.pop("planes")), "more than bits=2"),      # same layout, codes too big
    (lambda sd: sd.update(scales=torch.empty(1)), "'scales' does not match"),    # read past its end
    (lambda sd: sd.update(scales=sd["scales"].double()), "'scales' does not match"),  # bytes reinterpreted
    (lambda sd: sd.update(code_sums=sd["code_sums"][:, :1]), "'code_sums' does not match"),
    (lambda sd: sd.update(planes=torch.zeros(3, dtype=torch.int64)), "'planes' does not match"),
    (lambda sd: sd.update(group_size=64), "does not match"),
    (lambda sd: sd.update(scheme="nf4"), "expected scheme"),
    (lambda sd: sd.pop("offsets"), "lacks offsets"),
    (lambda sd: sd.update(dtype="int8"), "floating-point 'dtype'"),
    (lambda sd: sd.update(bits=4.9), "expected an int 'bits'|expected bits in"),     # became 4 (audit finding)
    (lambda sd: sd.update(group_size=32.7), "expected an int 'group_size'|expected group_size"),
    (lambda sd: sd.update(bits=float("inf")), "expected an int 'bits'|expected bits in"),  # OverflowError
    (lambda sd: sd.update(shape=None), "expected 'shape'"),                   # "NoneType is not iterable"
])
def test_quantized_weight_parts_must_match_its_metadata(edit, err):
    """A state dict (or a pickled QuantizedWeight) whose buffers do not match its shape/bits/group size is
    refused with the op named, before any kernel indexes the buffers by the metadata (audit finding: a
    segfault in qmatmul, or garbage products without an error)."""
    qw = pykernels.quantize(torch.randn(16, 64, generator=torch.Generator().manual_seed(0)), 4, 32, "asym")
    qw.ensure_planes()
    sd = qw.state_dict()
    edit(sd)
    with pytest.raises((ValueError, TypeError), match=err):
        pykernels.QuantizedWeight.from_state_dict(sd)
    # the same parts through pickle (torch.load, weights_only=True): refused when loaded
    bad = object.__new__(pykernels.QuantizedWeight)
    bad.__dict__.update(qw.__dict__)
    bad.__dict__.update({k: v for k, v in sd.items() if k in ("packed", "scales", "offsets", "code_sums")})
    bad.planes = sd.get("planes")
    if "shape" in sd:
        bad.shape = torch.Size(sd["shape"]) if sd["shape"] is not None else None
    bad.bits, bad.group_size, bad.scheme = sd.get("bits"), sd.get("group_size"), sd.get("scheme")
    buf = io.BytesIO()
    torch.save(bad, buf)
    buf.seek(0)
    if "offsets" in sd and sd.get("dtype", "float32") == "float32":
        with pytest.raises((ValueError, TypeError), match=err):
            torch.load(buf)
    with pytest.raises((TypeError, KeyError), match="QuantizedWeight.from_state_dict"):
        pykernels.QuantizedWeight.from_state_dict(None)


def test_quantized_weight_serialization(tmp_path):
    w = torch.randn(10, 96)
    for scheme, bits in [("asym", 4), ("bipolar", 2), ("sym", 8)]:
        qw = pykernels.quantize(w, bits, 32, scheme)
        sd = qw.state_dict()
        path = tmp_path / "qw.pt"
        torch.save(sd, path)
        back = pykernels.QuantizedWeight.from_state_dict(torch.load(path, weights_only=True))
        assert torch.equal(back.dequantize(), qw.dequantize())
        # a shape stored as a tensor or an array (tensor-only checkpoint formats) is taken as before
        for shape in (torch.tensor(list(sd["shape"])), np.array(list(sd["shape"]))):
            assert pykernels.QuantizedWeight.from_state_dict(dict(sd, shape=shape)).shape == qw.shape
        buf = io.BytesIO()
        torch.save(qw, buf)
        buf.seek(0)
        again = torch.load(buf, weights_only=False)
        assert torch.equal(again.dequantize(), qw.dequantize())
        # the default torch.load (weights_only=True): QuantizedWeight is a registered safe global
        for obj in (qw, qw.to(torch.bfloat16), {"layer.qw": qw, "n": 3}):
            buf = io.BytesIO()
            torch.save(obj, buf)
            buf.seek(0)
            got = torch.load(buf)
            got = got["layer.qw"] if isinstance(got, dict) else got
            want = obj["layer.qw"] if isinstance(obj, dict) else obj
            assert isinstance(got, pykernels.QuantizedWeight) and got.dtype == want.dtype
            assert (got.shape, got.bits, got.group_size, got.scheme) == (qw.shape, bits, 32, scheme)
            assert (got.planes is None) == (qw.planes is None)
            for name in ("packed", "scales", "offsets", "code_sums"):
                assert torch.equal(getattr(got, name), getattr(qw, name)), name
            assert torch.equal(pykernels.qmatmul(torch.ones(2, 96), got), pykernels.qmatmul(torch.ones(2, 96), qw))
        moved = qw.to("cpu")
        assert moved.device.type == "cpu" and torch.equal(moved.packed, qw.packed)
        assert qw.to(torch.bfloat16).dequantize().dtype == torch.bfloat16
        x = torch.randn(3, 96)
        assert torch.equal(pykernels.qmatmul(x, back), pykernels.qmatmul(x, qw))


def test_quantize_does_not_modify_input_and_accepts_numpy():
    w = torch.randn(8, 64)
    keep = w.clone()
    qw = pykernels.quantize(w, 4, 32)
    assert torch.equal(w, keep)
    qn = pykernels.quantize(w.numpy(), 4, 32)
    assert torch.equal(qn.packed, qw.packed)
    qb = pykernels.quantize(w.to(torch.bfloat16), 4, 32)
    assert qb.dequantize().dtype == torch.bfloat16


def test_quantize_errors():
    w = torch.randn(4, 64)
    with pytest.raises(ValueError, match="pykernels.quantize: .*scheme"):
        pykernels.quantize(w, 4, 32, "nf4")
    with pytest.raises(ValueError, match="bits"):
        pykernels.quantize(w, 5, 32, "asym")
    with pytest.raises(ValueError, match="bits"):
        pykernels.quantize(w, 9, 32, "bipolar")
    with pytest.raises(ValueError, match="group_size"):
        pykernels.quantize(w, 4, 48)
    with pytest.raises(ValueError, match="group_size"):
        pykernels.quantize(w, 4, 0)
    with pytest.raises(ValueError, match="shape"):
        pykernels.quantize(w[0], 4, 32)
    with pytest.raises(TypeError, match="pykernels.quantize: expected a 'weight' of dtype float32"):
        pykernels.quantize(w.to(torch.int32), 4, 32)
    bad = w.clone()
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        pykernels.quantize(bad, 4, 32)
    # fuzz findings: a group far longer than K (every layout pads groups to group_size), a meta weight,
    # an integer dequantize dtype, a CUDA move without CUDA: clear errors naming the op
    assert pykernels.quantize(w, 4, 128).group_size == 128  # one shorter group: fine
    with pytest.raises(ValueError, match=r"pykernels.quantize: expected group_size at most"):
        pykernels.quantize(w, 4, 10 ** 9)
    with pytest.raises(ValueError, match=r"pykernels.quantize: .*meta device"):
        pykernels.quantize(torch.empty(4, 64, device="meta"), 4, 32)
    qw = pykernels.quantize(w, 4, 32)
    with pytest.raises(TypeError, match=r"QuantizedWeight.dequantize: expected a floating-point dtype"):
        qw.dequantize(torch.int32)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"QuantizedWeight.to: no CUDA device"):
            qw.to("cuda")


# ------------------------------------------------------------------------------------------------
# Weight-only qmatmul
# ------------------------------------------------------------------------------------------------
def oracle(x, qw, bias=None):
    y = x.to(torch.float64) @ qw.dequantize(torch.float64).T
    return y if bias is None else y + bias.to(torch.float64)


def _int16_bound(x, qw, rel):
    """rel * max|x_row| * sum|W_n| (+ the centred weights): the int16 activation blocks' error bound."""
    N, K = qw.shape
    # the kernel multiplies int16 activations by s * (u - 2^(bits-1)): its error scales with that
    idx = torch.arange(K) // (K if qw.group_size == -1 else qw.group_size)
    centred = qw.scales.double()[:, idx] * (qw.codes().double() - 2 ** (qw.bits - 1))
    mag = qw.dequantize(torch.float64).abs().sum(1) + centred.abs().sum(1)
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float64)
    return (rel * x2.abs().amax(1, keepdim=True) * mag[None]).reshape(*x.shape[:-1], N)


def check_close(y, x, qw, bias=None, rel=4e-5):
    """|y - ref| <= rel * max|x_row| * sum|W_n| (int16 activation blocks: <= 1.5e-5 of that) plus the
    output dtype's rounding."""
    ref = oracle(x, qw, bias)
    bound = _int16_bound(x, qw, rel) + 1e-30
    eps = {torch.float32: 2 ** -23, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[y.dtype]
    tol = bound + 2 * eps * ref.abs()
    err = (y.to(torch.float64) - ref).abs()
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert bool((err <= tol).all()), f"max err {err.max().item()} vs tol {tol.min().item()}"


@pytest.fixture(params=["avx512", "avx2", "portable"])
def simd(request, monkeypatch):
    """The SIMD tier of the weight-only kernel (pykernels.quant._ops reads the flags on every call; a
    machine without AVX-512 runs the "avx512" case on AVX2). test_simd_flags_from_process_start checks
    the flags the native module reads once, in fresh processes."""
    if request.param == "portable":
        monkeypatch.setenv("PYKERNELS_DISABLE_AVX2", "1")
    elif request.param == "avx2":
        monkeypatch.setenv("PYKERNELS_DISABLE_AVX512", "1")
    return request.param


@pytest.mark.parametrize("scheme,bits", [("sym", 8), ("asym", 4)])
def test_qmatmul_tiny_weights_keep_their_precision(scheme, bits, simd):
    """Weights of ~1e-38 and ~1e-40 (fp32 denormal scales): every tier within 2e-4 relative error of the
    float64 product, in the GEMV (M=3) and the AVX-512 panel GEMM (M=13, 20). The AVX-512 kernels had
    multiplied the activation and weight scales first, a product that underflowed (2% error at 1e-38,
    all of it at 1e-40; audit finding); check_close's absolute floor of 1e-30 could not see it."""
    g = torch.Generator().manual_seed(bits)
    for wscale in (1e-38, 1e-40):
        qw = pykernels.quantize(torch.randn(16, 512, generator=g) * wscale, bits, 128, scheme)
        for M in (3, 13, 20):
            x = torch.randn(M, 512, generator=g)
            ref = x.double() @ qw.dequantize(torch.float64).T
            rel = ((pykernels.qmatmul(x, qw).double() - ref).norm() / ref.norm()).item()
            assert rel < 2e-4, (wscale, M, rel)


@pytest.mark.parametrize("scheme,bits,group_size,N,K", [
    ("asym", 4, -1, 13, 2100),     # one group over several activation blocks (AVX-512: 1024 codes each)
    ("sym", 8, 256, 6, 800),       # the byte layout's largest AVX-512 group (and a partial last group)
    ("asym", 8, 512, 5, 1100),     # larger: the AVX-512 kernel hands it to the AVX2 one
    ("bipolar", 5, 96, 7, 500),    # 3 blocks per group, groups not a multiple of 4 (register quads)
    ("asym", 2, 160, 3, 700),      # 5 blocks per group, 1..3 rows in the last tile
    ("asym", 4, 2048, 9, 4500),    # the nibble layout's largest AVX-512 group
])
def test_qmatmul_group_geometries(scheme, bits, group_size, N, K, simd):
    g = torch.Generator().manual_seed(N * K)
    qw = pykernels.quantize(weights("outliers", N, K, seed=K), bits, group_size, scheme)
    for M in (1, 5, 13):  # AVX-512: the GEMV kernel up to M=11, the panel GEMM from 12
        x = torch.randn(M, K, generator=g)
        check_close(pykernels.qmatmul(x, qw), x, qw)


@pytest.mark.parametrize("bits", [4, 8])
def test_qmatmul_extreme_codes_do_not_overflow(bits, simd):
    """Every activation at its block's max (int16 code 32767) times extreme codes over the longest
    integer accumulation each kernel does: the exact integer sums must not wrap."""
    K = 4096 if bits == 4 else 256
    w = torch.ones(8, K)
    w[1::2] = -1.0
    w[2] = 0.0
    w[3, ::2] = 5.0
    qw = pykernels.quantize(w, bits, -1 if bits == 4 else 256, "asym")
    for x in (torch.full((13, K), 3.0), torch.full((13, K), -7.5), torch.randn(13, K).sign() * 2.0):
        check_close(pykernels.qmatmul(x, qw), x, qw)          # M >= 12: the AVX-512 panel GEMM
        check_close(pykernels.qmatmul(x[:1], qw), x[:1], qw)  # M = 1: the GEMV kernel


@pytest.mark.parametrize("flags", [{"PYKERNELS_DISABLE_AVX512": "1"}, {"PYKERNELS_DISABLE_AVX2": "1"}])
def test_simd_flags_from_process_start(flags):
    """The flags as a user sets them (read once by the native module at its first call)."""
    import os
    import subprocess
    import sys

    code = (
        "import torch, pykernels\n"
        "from pykernels._native import cpu_module\n"
        "m = cpu_module('qgemm')\n"
        "assert not m.cpu_has_avx512()\n"
        "assert m.cpu_has_avx2() == ('PYKERNELS_DISABLE_AVX2' not in %r)\n"
        "g = torch.Generator().manual_seed(0)\n"
        "qw = pykernels.quantize(torch.randn(9, 300, generator=g), 4, 64)\n"
        "x = torch.randn(3, 300, generator=g)\n"
        "ref = x.double() @ qw.dequantize(torch.float64).T\n"
        "err = (pykernels.qmatmul(x, qw).double() - ref).abs().max().item()\n"
        "assert err <= 1e-4 * ref.abs().max().item(), err\n"
        "y = pykernels.qmatmul(x, pykernels.quantize(torch.randn(9, 300, generator=g), 2, 64, 'bipolar'), act_bits=2)\n"
        "assert torch.isfinite(y).all()\n" % (sorted(flags),))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYKERNELS_DISABLE_")}
    env.update(flags)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


@pytest.mark.parametrize("scheme,bits", SCHEME_BITS)
@pytest.mark.parametrize("group_size", GROUPS)
def test_qmatmul_weight_only(scheme, bits, group_size, simd):
    N, K = 37, 200
    qw = pykernels.quantize(weights("randn", N, K, seed=bits), bits, group_size, scheme)
    g = torch.Generator().manual_seed(1)
    for M in (1, 3, 16, 100):
        x = torch.randn(M, K, generator=g)
        check_close(pykernels.qmatmul(x, qw), x, qw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K,N,group_size", [(256, 64, 128), (33, 5, -1), (100, 9, 32), (4096, 8, 128)])
def test_qmatmul_dtypes_bias_and_shapes(dtype, K, N, group_size, simd):
    g = torch.Generator().manual_seed(K)
    qw = pykernels.quantize(torch.randn(N, K, generator=g), 4, group_size, "asym")
    bias = torch.randn(N, generator=g)
    x = torch.randn(2, 3, K, generator=g).to(dtype)
    keep = x.clone()
    y = pykernels.qmatmul(x, qw, bias)
    assert y.shape == (2, 3, N)
    check_close(y, x, qw, bias)
    assert torch.equal(x, keep)
    # non-contiguous activations
    xt = torch.randn(K, 4, generator=g).to(dtype).t()
    check_close(pykernels.qmatmul(xt, qw), xt, qw)


@pytest.mark.parametrize("case", ["zeros", "constant", "outliers", "huge", "tiny", "sorted"])
def test_qmatmul_adversarial_activations(case, simd):
    N, K = 12, 192
    qw = pykernels.quantize(weights("outliers", N, K), 4, 64, "asym")
    x = torch.randn(5, K)
    if case == "zeros":
        x.zero_()
    elif case == "constant":
        x.fill_(-1.25)
    elif case == "outliers":
        x[:, ::37] *= 1000.0
    elif case == "huge":
        x *= 1e30
    elif case == "tiny":
        x *= 1e-30
    elif case == "sorted":
        x = torch.sort(x, dim=1).values
    check_close(pykernels.qmatmul(x, qw), x, qw)


@pytest.mark.parametrize("kind", ["zeros", "constant_rows", "outliers", "positive"])
def test_qmatmul_adversarial_weights(kind, simd):
    qw = pykernels.quantize(weights(kind, 10, 160), 4, 32, "asym")
    x = torch.randn(4, 160)
    check_close(pykernels.qmatmul(x, qw), x, qw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qmatmul_gemm_sizes_bias_and_nan(dtype, simd):
    """M from 12 up runs the AVX-512 panel GEMM (16 tokens per vector): partial token groups, bias,
    half-precision in/out, and a NaN/inf token that must not leak into the others. The native config
    is forced (without AVX-512 the default for bf16 at this M is the dequantize route, tested above)."""
    g = torch.Generator().manual_seed(3)
    N, K = 22, 320
    cfg = {"impl": "native", "threads": 0, "m_block": 4096, "n_block": 8, "isa": 2, "gemm_min_m": 12}
    for bits, gs in ((4, 64), (8, 128), (3, -1)):
        qw = pykernels.quantize(torch.randn(N, K, generator=g), bits, gs, "asym")
        bias = torch.randn(N, generator=g)
        x = torch.randn(33, K, generator=g).to(dtype)
        run = lambda x: _impl(x, qw.packed, qw.scales, qw.offsets, None, None, bias, N, K, bits, gs, 0, "cpu",  # noqa: E731
                              config=cfg)
        check_close(run(x), x, qw, bias)
        x[5, 7] = float("nan")
        x[20, 1] = float("inf")
        y = run(x)
        assert torch.isnan(y[5]).all() and not torch.isfinite(y[20]).any()
        keep = [i for i in range(33) if i not in (5, 20)]
        check_close(y[keep], x[keep], qw, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 20])
def test_qmatmul_two_scale_rows_keep_their_small_values(dtype, M, simd):
    """A row with huge outliers next to ordinary values (an LLM's "massive activations"): int16 blocks
    scaled by the outlier would round the ordinary values away, which shows when the outliers' weight
    columns are zero. Such rows go through magnitude bands (act_range_flags), so y is as accurate as
    for the ordinary values alone."""
    g = torch.Generator().manual_seed(M)
    N, K = 24, 256
    w = torch.randn(N, K, generator=g)
    cols = [0, 77, 200]
    w[:, cols] = 0.0  # sym codes: exactly zero after quantization
    qw = pykernels.quantize(w, 4, 64, "sym")
    x = torch.randn(M, K, generator=g)
    big = 3e4 if dtype == torch.float16 else 1e9
    x[0, cols] = torch.tensor([big, -big / 1e3, big / 1e5])  # three scales in one row
    x = x.to(dtype)
    y = pykernels.qmatmul(x, qw)
    assert torch.equal(qw.dequantize(torch.float64)[:, cols], torch.zeros(N, 3, dtype=torch.float64))
    rest = x.clone()
    rest[:, cols] = 0  # the error bound of the ordinary values (the outliers contribute exactly 0)
    check_close(y, rest, qw)
    bias = torch.randn(N, generator=g).to(dtype)  # added once, to these rows (split apart) as to the others
    check_close(pykernels.qmatmul(x, qw, bias), rest, qw, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme,bits,gs", [("asym", 4, 128), ("sym", 4, 128), ("asym", 8, -1), ("sym", 3, 32),
                                            ("bipolar", 6, 64), ("asym", 2, 32)])
def test_qmatmul_outliers_on_zero_weight_columns_are_exact(dtype, scheme, bits, gs, simd):
    """Fuzz findings: (1) asym weights and a 1e6-1e8 activation on a channel whose weights are ~0: the
    kernel's two fp32 terms (s * (u - c) and m + c * s, times x) cancel, leaving errors of the order of y;
    (2) an outlier 300-3000x the row's values, unseen in y, made its block's int16 steps too coarse for
    the others (1e-2 of max|y|). Such rows' outliers are now multiplied exactly."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(9, 512, generator=g)  # 9 rows: a partial 4-row tile; columns 0 and 7 in the nibble/byte layouts
    w[:, [0, 7]] = 0.0
    qw = pykernels.quantize(w, bits, gs, scheme)
    for big in (3e2, 3e3, 1e6, 1e8):
        x = torch.randn(5, 512, generator=g)
        x[:, 7] = big
        x[2, 0] = -big * 3
        x = x.to(dtype)
        rest = x.clone()
        rest[:, [0, 7]] = 0  # the outliers' true contribution is (nearly) 0: the bound is the ordinary values'
        y = pykernels.qmatmul(x, qw)
        # the int16 bound of the ordinary values, plus the output's own rounding of the outliers' exact
        # products (bipolar's "zero" column is only zero to half a step)
        eps = 2 ** -23 if dtype == torch.float32 else 2 ** -8
        err = (y.double() - oracle(x, qw)).abs()
        assert bool((err <= _int16_bound(rest, qw, 4e-5) + 2 * eps * oracle(x, qw).abs() + 1e-30).all()), \
            (big, err.max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("neighbours", [1, 3, 7, 8, 20])
def test_qmatmul_outlier_with_few_nonzero_neighbours_is_split(dtype, neighbours, simd):
    """Review finding: a flagged row (its max above 2^8 times the mean of the others) whose outlier had at
    most 7 nonzero neighbours kept it, because the split measured the outlier against a mean that included
    it; the neighbours then rounded to 0 in the outlier's int16 block (y ~0, error 100%)."""
    N, K = 8, 64
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(neighbours))
    w[:, 0] = 0.0  # a pruned input channel: sym codes make it exactly 0
    qw = pykernels.quantize(w, 8, 32, "sym")
    for big, M in ((3e2, 2), (1e4, 2), (1e6, 2), (1e6, 12)):  # M=12: the panel GEMM, and AMX for bf16
        x = torch.zeros(M, K)
        x[:, 0] = big
        x[:, 1:1 + neighbours] = torch.linspace(-1.0, 1.5, neighbours)
        x = x.to(dtype)
        rest = x.clone()
        rest[:, 0] = 0
        check_close(pykernels.qmatmul(x, qw), rest, qw)


def test_act_range_flags_leave_ordinary_rows_alone():
    """Only two-scale rows (1) and NaN/inf rows (2) are flagged: Gaussian, uniform, ReLU'd, sparse,
    constant and LLM-like rows with ~50x outlier features take the fast path."""
    from pykernels import _native

    g = torch.Generator().manual_seed(0)
    K = 4096
    rows = [torch.randn(K, generator=g), torch.rand(K, generator=g), torch.randn(K, generator=g).relu(),
            torch.randn(K, generator=g) * (torch.rand(K, generator=g) < 0.1), torch.full((K,), -2.5),
            torch.zeros(K)]
    llm = torch.randn(K, generator=g)
    llm[::512] *= 50.0
    rows.append(llm)
    two = torch.randn(K, generator=g)
    two[3] = 1e7
    nonfinite = torch.randn(K, generator=g)
    nonfinite[9] = float("-inf")
    x = torch.stack(rows + [two, nonfinite])
    flags = torch.empty(x.shape[0], dtype=torch.uint8)
    n = _native.cpu_module("qgemm").act_range_flags(x.data_ptr(), _native.dtype_code(x.dtype), x.shape[0], K,
                                                    flags.data_ptr(), 2)
    assert flags.tolist() == [0] * len(rows) + [1, 2] and n == 2


def test_qmatmul_nan_propagates(simd):
    qw = pykernels.quantize(torch.randn(6, 64), 4, 32)
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    y = pykernels.qmatmul(x, qw)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()
    ya = pykernels.qmatmul(x, qw, act_bits=4)
    assert torch.isnan(ya[1]).all() and torch.isfinite(ya[[0, 2]]).all()


def test_qmatmul_empty_and_tiny():
    qw = pykernels.quantize(torch.randn(5, 64), 4, 32)
    assert pykernels.qmatmul(torch.randn(0, 64), qw).shape == (0, 5)
    assert pykernels.qmatmul(torch.randn(0, 64), qw, act_bits=2).shape == (0, 5)
    q1 = pykernels.quantize(torch.randn(1, 1), 4, -1)
    x = torch.randn(1, 1)
    check_close(pykernels.qmatmul(x, q1), x, q1)
    q0 = pykernels.quantize(torch.randn(0, 64), 4, 32)
    assert pykernels.qmatmul(torch.randn(2, 64), q0).shape == (2, 0)
    qk = pykernels.quantize(torch.randn(3, 0), 4, -1)
    b = torch.randn(3)
    assert torch.equal(pykernels.qmatmul(torch.randn(2, 0), qk, b), b.expand(2, 3))
    x = torch.randn(64)  # 1-D activations
    assert pykernels.qmatmul(x, qw).shape == (5,)


def test_qmatmul_direct_path_leaves_transforms_to_the_op():
    """The eager fast path is pykernels._backend.eager_direct's: under vmap the registered op runs (its
    batching rule), with grad mode off a requires_grad input takes the direct path."""
    import warnings

    qw = pykernels.quantize(torch.randn(32, 64), 4, 32)
    x = torch.randn(3, 64)
    ref = pykernels.qmatmul(x, qw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "no batching rule for pykernels::qmatmul"
        y = torch.vmap(lambda r: pykernels.qmatmul(r, qw))(x.unsqueeze(1))
    assert torch.equal(y.squeeze(1), ref)
    xr = x.clone().requires_grad_()
    with torch.no_grad():
        assert not pykernels.qmatmul(xr, qw).requires_grad
    assert pykernels.qmatmul(xr, qw).requires_grad


def test_vmap_over_qmatmul_is_one_call_per_batch(monkeypatch):
    """vmap over the activations (one weight for every sample) runs the kernels once, the vmapped dim as
    one more leading dim of x, where torch's fallback ran them per sample (and refused a batch of 0);
    a vmapped bias runs per sample, each exactly as the plain call. Per-sample gradients agree."""
    from pykernels.quant import _ops

    calls = []
    real = _ops._impl
    monkeypatch.setattr(_ops, "_impl", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(4)
    qw = pykernels.quantize(torch.randn(48, 64, generator=g), 4, 32)
    bias = torch.randn(48, generator=g)
    x = torch.randn(5, 3, 64, generator=g)
    f = lambda a: pykernels.qmatmul(a, qw, bias)  # noqa: E731
    for dim in (0, 1):
        calls.clear()
        got = torch.vmap(f, in_dims=dim)(x)
        assert len(calls) == 1
        want = torch.stack([f(x.select(dim, i)) for i in range(x.shape[dim])])
        # M differs, so another kernel (GEMV or panel GEMM: activation scales per 32-block or per group)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-4 * float(want.abs().max()))
    grads = torch.func.vmap(torch.func.grad(lambda a: f(a).square().sum()))(x)
    for i in range(5):
        xi = x[i].clone().requires_grad_()
        f(xi).square().sum().backward()
        torch.testing.assert_close(grads[i], xi.grad, rtol=0, atol=2e-4 * float(xi.grad.abs().max()))
    biases = torch.randn(5, 48, generator=g)
    got = torch.vmap(lambda a, b: pykernels.qmatmul(a, qw, b))(x, biases)
    assert torch.equal(got, torch.stack([pykernels.qmatmul(x[i], qw, biases[i]) for i in range(5)]))
    assert torch.vmap(f)(x[:0]).shape == (0, 3, 48)


@pytest.mark.parametrize("group_size", [96, 256])
def test_qmatmul_any_group_size_quantize_accepts_runs_through_the_op(group_size):
    """Every group_size quantize accepts (-1 or a multiple of 32) passes the registered op too: with
    autograd and through torch.ops (review: 256 worked eagerly and was refused once x required grad)."""
    qw = pykernels.quantize(torch.randn(8, 512), 4, group_size)
    x = torch.randn(3, 512)
    ref = pykernels.qmatmul(x, qw)
    check_close(ref, x, qw)
    xr = x.clone().requires_grad_()
    y = pykernels.qmatmul(xr, qw)
    assert torch.equal(y.detach(), ref)
    y.sum().backward()
    torch.testing.assert_close(xr.grad, qw.dequantize().sum(0).expand(3, 512), rtol=1e-4, atol=1e-4)
    y2 = torch.ops.pykernels.qmatmul(x, qw.packed, qw.scales, qw.offsets, None, None, None, 8, 512, 4, group_size,
                                     0, "auto")
    assert torch.equal(y2, ref)
    with pytest.raises(ValueError, match="group_size"):
        torch.ops.pykernels.qmatmul(x, qw.packed, qw.scales, qw.offsets, None, None, None, 8, 512, 4, 100, 0, "auto")


def test_qmatmul_numpy_input():
    qw = pykernels.quantize(torch.randn(5, 64), 4, 32)
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    check_close(pykernels.qmatmul(x, qw), torch.from_numpy(x), qw)


def test_qmatmul_errors():
    qw = pykernels.quantize(torch.randn(5, 64), 4, 32)
    x = torch.randn(2, 64)
    with pytest.raises(TypeError, match="pykernels.qmatmul: .*'x'"):
        pykernels.qmatmul(x.to(torch.float64), qw)
    with pytest.raises(TypeError, match="QuantizedWeight"):
        pykernels.qmatmul(x, torch.randn(5, 64))
    with pytest.raises(ValueError, match=r"\[..., 64\]"):
        pykernels.qmatmul(torch.randn(2, 63), qw)
    with pytest.raises(ValueError, match="bias"):
        pykernels.qmatmul(x, qw, torch.randn(4))
    with pytest.raises(ValueError, match="act_bits"):
        pykernels.qmatmul(x, qw, act_bits=9)
    with pytest.raises(ValueError, match="act_bits"):
        pykernels.qmatmul(x, qw, act_bits=0)
    with pytest.raises(RuntimeError, match="pykernels.qmatmul: backend 'cuda'"):
        pykernels.qmatmul(x, qw, backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        pykernels.qmatmul(x, qw, backend="gpu")


def _amx_available():
    from pykernels.quant._ops import _has_amx
    return _has_amx()


def _bf16dot_available():
    from pykernels.quant._ops import _has_avx512, _has_bf16dot
    return _has_avx512() and _has_bf16dot()


# the two bf16 product kernels: AMX tiles, and the same data and math on AVX-512 BF16 dot products
_BF16_KERNELS = [
    pytest.param("amx", marks=pytest.mark.skipif(not _amx_available(),
                                                 reason="needs a CPU with AMX-BF16 (and the OS's permission)")),
    pytest.param("bf16dot", marks=pytest.mark.skipif(not _bf16dot_available(),
                                                     reason="needs a CPU with AVX-512 VNNI and BF16")),
]


@pytest.mark.parametrize("impl", _BF16_KERNELS)
@pytest.mark.parametrize("scheme,bits,group_size,M,N,K", [
    ("asym", 4, 128, 16, 64, 512),     # whole tiles
    ("asym", 4, 32, 33, 37, 100),      # partial token tile, panel and block; groups of one block
    ("sym", 3, 64, 70, 130, 300),      # 5 token tiles (4 at once + 1), partial last group
    ("bipolar", 1, -1, 9, 17, 33),     # one group over the whole (odd) K
    ("bipolar", 2, 128, 20, 15, 1),    # K = 1: one code, zero-padded block
    ("asym", 2, -1, 128, 16, 4100),    # a group of 129 blocks
    ("sym", 4, 32, 1, 1, 32),          # one token, one row
    ("asym", 4, 64, 12, 1000, 2048),   # bf16dot's first M; 62 full panels + a partial one
])
def test_qmatmul_bf16_products_are_the_rounded_exact_product(impl, scheme, bits, group_size, M, N, K):
    """The bf16 kernels multiply bf16 activations by the codes exactly (products of bf16 and small
    integers) and sum in fp32, so y is the exact x @ dequant(W).T (+ bias) up to fp32 sums and the
    output's bf16 rounding: nearly every element is the correctly rounded value."""
    g = torch.Generator().manual_seed(M * N + K)
    qw = pykernels.quantize(torch.randn(N, K, generator=g), bits, group_size, scheme)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    for bias in (None, torch.randn(N, generator=g)):
        y = _impl(x, qw.packed, qw.scales, qw.offsets, None, None, bias, N, K, bits, group_size, 0, "cpu",
                  config={"impl": impl, "threads": 2})
        check_close(y, x, qw, bias, rel=1e-6)
        exact = oracle(x, qw, bias).to(torch.bfloat16)
        assert (y == exact).double().mean().item() >= 0.99


@pytest.mark.parametrize("impl", _BF16_KERNELS)
def test_qmatmul_bf16_products_default_nan_inf_and_fallbacks(impl):
    from pykernels.quant._ops import BF16DOT_MIN_M, _default_cpu_config, _key

    # the default for bf16 activations from M = 9 (bucket 16), codes of <= 4 bits; not below, not fp32
    # (AMX where the CPU has it, else bf16dot)
    if impl == "bf16dot" and _amx_available():
        pytest.skip("the default on this CPU is AMX")
    assert _default_cpu_config(_key(16, 64, 64, 4, 32, 0, torch.bfloat16))["impl"] == impl
    assert _default_cpu_config(_key(9, 64, 64, 4, 32, 0, torch.bfloat16))["impl"] == impl
    assert _default_cpu_config(_key(8, 64, 64, 4, 32, 0, torch.bfloat16))["impl"] != impl
    assert _default_cpu_config(_key(64, 64, 64, 4, 32, 0, torch.float32))["impl"] != impl
    assert _default_cpu_config(_key(64, 64, 64, 8, 32, 0, torch.bfloat16))["impl"] != impl
    g = torch.Generator().manual_seed(5)
    N, K = 22, 320
    qw = pykernels.quantize(torch.randn(N, K, generator=g), 4, 64, "asym")
    x = torch.randn(33, K, generator=g).to(torch.bfloat16)
    x[5, 7] = float("nan")
    x[20, 1] = float("inf")
    y = pykernels.qmatmul(x, qw)  # the default
    assert torch.isnan(y[5]).all() and not torch.isfinite(y[20]).any()
    keep = [i for i in range(33) if i not in (5, 20)]
    check_close(y[keep], x[keep], qw, rel=1e-6)
    # rows with huge outliers on zero weights take the VNNI path's outlier split (an fp32 sum holding
    # 1e8 * (u - c) would keep ~8 of absolute error); the other rows stay on the bf16 kernel
    for k, gs in ((256, 32), (96, -1)):
        w = torch.randn(N, k, generator=g)
        w[:, 0] = 0.0
        q = pykernels.quantize(w, 4, gs, "sym")  # sym: the zero column stays exactly zero
        xo = torch.randn(16, k, generator=g)
        xo[3, 0] = 1e8
        xo = xo.to(torch.bfloat16)
        rest = xo.clone()
        rest[:, 0] = 0
        check_close(pykernels.qmatmul(xo, q), rest, q, rel=1e-6)
    # a cached choice on inputs it cannot take (fp32 activations, 8-bit codes; bf16dot: fewer than min_m
    # tokens) runs the VNNI kernels (their int16 rounding: the default tolerance, not the exact one)
    cfg = {"impl": impl, "threads": 2}
    for xs, q in ((x[keep].float(), qw), (x[keep], pykernels.quantize(torch.randn(N, K, generator=g), 8, 64))):
        y = _impl(xs, q.packed, q.scales, q.offsets, None, None, None, N, K, q.bits, 64, 0, "cpu", config=cfg)
        check_close(y, xs, q)
    if impl == "bf16dot":
        from pykernels.quant._ops import _vnni_config

        def run(xs, config):
            return _impl(xs, qw.packed, qw.scales, qw.offsets, None, None, None, N, K, 4, 64, 0, "cpu", config=config)

        for m in (BF16DOT_MIN_M - 1, BF16DOT_MIN_M):
            xs = x[keep][:m]
            y = run(xs, {**cfg, "min_m": BF16DOT_MIN_M})
            assert torch.equal(y, run(xs, _vnni_config() if m < BF16DOT_MIN_M else cfg))
            # a cached "amx" (a cache tuned on an AMX machine) runs the same product here, from min_m on
            assert torch.equal(run(xs, {"impl": "amx", "threads": 2}), y)


def test_config_memos_follow_the_tier_switches(tmp_cache, monkeypatch):
    """Found when an xdist order ran the AMX test after a PYKERNELS_DISABLE_AVX512=1 one: autotune's config
    memo (and qmatmul's plan memo over it) kept the default made without AVX-512 (bf16 "dequant_mm",
    bf16-rounded weights) for later calls with AVX-512 and AMX back on. Both follow the switches now."""
    from pykernels import autotune
    from pykernels.quant._ops import _default_cpu_config, _key, _plan

    cpu = torch.device("cpu")
    for M in (1, 64):
        key = _key(M, 64, 64, 4, 32, 0, torch.bfloat16)
        for switch in ("PYKERNELS_DISABLE_AVX512", "PYKERNELS_DISABLE_AMX", "PYKERNELS_DISABLE_AVX2", None):
            for name in ("PYKERNELS_DISABLE_AVX512", "PYKERNELS_DISABLE_AMX", "PYKERNELS_DISABLE_AVX2"):
                monkeypatch.delenv(name, raising=False)
            if switch:
                monkeypatch.setenv(switch, "1")
            want = _default_cpu_config(key)
            assert autotune.config_for("qmatmul", "cpu", key, cpu) == want, (M, switch)
            assert _plan(cpu, "auto", M, 64, 64, 4, 32, 0, torch.bfloat16) == ("cpu", want), (M, switch)


@pytest.mark.parametrize("impl,m_block,n_block", [("native", 1, 1), ("native", 4, 32), ("dequant_mm", 16, 8),
                                                   ("sgemm", 16, 8)])
def test_qmatmul_configs_agree(impl, m_block, n_block):
    N, K = 70, 300
    qw = pykernels.quantize(torch.randn(N, K), 3, 32, "sym")
    x = torch.randn(21, K)
    cfg = {"impl": impl, "threads": 2, "m_block": m_block, "n_block": n_block}
    y = _impl(x, qw.packed, qw.scales, qw.offsets, None, None, None, N, K, 3, 32, 0, "cpu", config=cfg)
    check_close(y, x, qw, rel=4e-5 if impl == "native" else 1e-6)


def test_qmatmul_documented_accuracy_and_exact_route():
    """qmatmul's docstring: the native fp32 path rounds x to int16 per 32-block (each x_k within 2^-16
    of its block's max|x|, ~1e-5 of max|y|); the dequantize route is the fp32 product itself."""
    g = torch.Generator().manual_seed(5)
    N, K = 48, 256
    qw = pykernels.quantize(torch.randn(N, K, generator=g), 4, 32)
    x = torch.randn(7, K, generator=g) * torch.logspace(-3, 2, K)  # blocks of very different scales
    b = torch.randn(N, generator=g)
    W = qw.dequantize(torch.float32)
    exact = torch.nn.functional.linear(x, W, b)
    ref = x.double() @ W.double().T + b.double()
    assert (exact.double() - ref).abs().max() <= 1e-6 * ref.abs().max()
    y = _impl(x, qw.packed, qw.scales, qw.offsets, None, None, b, N, K, 4, 32, 0, "cpu",
              config={"impl": "native", "threads": 1, "m_block": 16, "n_block": 8})
    blockmax = x.abs().reshape(7, K // 32, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(7, K)
    bound = (blockmax.double() * 2.0 ** -16) @ W.double().abs().T + 1e-6 * ref.abs().max()
    assert ((y.double() - ref).abs() <= bound).all()
    assert (y.double() - ref).abs().max() <= 1e-4 * ref.abs().max()
    dq = _impl(x, qw.packed, qw.scales, qw.offsets, None, None, b, N, K, 4, 32, 0, "cpu",
               config={"impl": "dequant_mm", "threads": 1, "m_block": 16, "n_block": 8})
    assert torch.allclose(dq, exact, rtol=1e-6, atol=1e-6 * float(ref.abs().max()))


@pytest.mark.parametrize("M,N,K", [(1, 64, 64), (1, 256, 256), (3, 260, 96), (2, 1030, 64),
                                   (1, 1024, 1024), (2, 1024, 1024), (16, 256, 256), (32, 256, 256)])
@pytest.mark.parametrize("impl", ["native", "dequant_mm", "sgemm"])
def test_qmatmul_thread_counts_agree(M, N, K, impl):
    """Around the work thresholds that cap the threads (the per-element passes one per ~2^16 elements;
    the GEMM loops one per 2^20 multiply-adds, so 1 x 1024 x 1024 and 16 x 256 x 256 run on one, twice
    that on two; GEMV kernel below M=12, panel GEMM above): 1, 2 and 7 requested threads give the same
    bits (every tile is computed alone)."""
    qw = pykernels.quantize(torch.randn(N, K), 4, 32, "asym")
    x = torch.randn(M, K)
    ys = [_impl(x, qw.packed, qw.scales, qw.offsets, None, None, None, N, K, 4, 32, 0, "cpu",
                config={"impl": impl, "threads": t, "m_block": 16, "n_block": 1}) for t in (1, 2, 7)]
    assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2])
    check_close(ys[0], x, qw, rel=4e-5 if impl == "native" else 1e-6)


@pytest.mark.parametrize("impl", ["dequant_mm", "sgemm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_qmatmul_dequant_mm_path(dtype, simd, impl):
    """The compute-bound routes: dequantize chunks + torch GEMM, and our fp32 GEMM that dequantizes into
    its panels (the default without AVX-512 from M=9; dequant_mm on the portable tier)."""
    N, K = 1030, 200  # more rows than one dequantization chunk, N and K odd sizes
    qw = pykernels.quantize(torch.randn(N, K), 4, 64, "asym")
    x = torch.randn(40, K).to(dtype)
    bias = torch.randn(N)
    cfg = {"impl": impl, "threads": 0}
    y = _impl(x, qw.packed, qw.scales, qw.offsets, None, None, bias, N, K, 4, 64, 0, "cpu", config=cfg)
    ref = oracle(x, qw, bias)
    W = qw.dequantize(torch.float64)
    eps = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    bound = eps * (x.double().abs() @ W.abs().T) + 2 * eps * ref.abs() + 1e-6
    assert y.dtype == dtype and bool(((y.double() - ref).abs() <= bound).all())
    yd = pykernels.qmatmul(x, qw, bias)  # default config for this shape
    assert bool(((yd.double() - ref).abs() <= bound + 4e-5 * x.double().abs().amax() * W.abs().sum(1)).all())


@pytest.mark.parametrize("bf16_native", [False, True])
def test_dequant_mm_bf16_multiplies_as_the_cpu_can(bf16_native, monkeypatch):
    """bf16 activations on the dequantize route: bf16 weights where the CPU multiplies bf16 natively
    (AVX512-BF16), else the fp32 product (oneDNN's bf16 GEMM without it ran 5.7x slower than fp32),
    each rounded to bf16 once."""
    from pykernels.quant import _ops

    monkeypatch.setattr(_ops, "torch_bf16_gemm_native", lambda: bf16_native)
    N, K = 70, 200
    qw = pykernels.quantize(torch.randn(N, K), 4, 64, "asym")
    x = torch.randn(33, K).bfloat16()
    b = torch.randn(N)
    y = _impl(x, qw.packed, qw.scales, qw.offsets, None, None, b, N, K, 4, 64, 0, "cpu",
              config={"impl": "dequant_mm", "threads": 1, "m_block": 16, "n_block": 8})
    W = qw.dequantize(torch.float32)
    if bf16_native:
        want = torch.addmm(b.bfloat16(), x, W.bfloat16().t())
    else:
        want = torch.addmm(b, x.float(), W.t()).bfloat16()
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)


@pytest.mark.parametrize("avx2", [True, False])
def test_default_config_without_avx512(monkeypatch, avx2):
    """Without AVX-512: our fp32 GEMM from the M=16 bucket (M >= 9) where AVX2 is there, the dequantize
    route for bf16 activations from M=64 where the CPU multiplies bf16 natively, and without AVX2 the
    int16 kernel (portable) up to M=64, the dequantize route from the M=128 bucket."""
    from pykernels.quant import _ops

    monkeypatch.setenv("PYKERNELS_DISABLE_AVX512", "1")
    if not avx2:
        monkeypatch.setenv("PYKERNELS_DISABLE_AVX2", "1")
    elif not _ops._has_avx2():
        pytest.skip("this CPU has no AVX2")
    for native in (False, True):
        monkeypatch.setattr(_ops, "torch_bf16_gemm_native", lambda native=native: native)
        for dtype in (torch.float32, torch.bfloat16):
            bf16_gemm = native and dtype == torch.bfloat16
            fp32_gemm = "sgemm" if avx2 else "dequant_mm"
            for M, want in ((8, "native"), (9, "sgemm" if avx2 else "native"), (16, "sgemm" if avx2 else "native"),
                            (64, "dequant_mm" if bf16_gemm else "sgemm" if avx2 else "native"),
                            (65, "dequant_mm" if bf16_gemm else fp32_gemm), (128, "dequant_mm" if bf16_gemm else fp32_gemm)):
                assert _ops._default_cpu_config(_ops._key(M, 4096, 4096, 4, 128, 0, dtype))["impl"] == want, (M, dtype)


_SGEMM_BLOCKINGS = [(32, 6, 16), (64, 12, 32), (256, 144, 256)]  # (kc, mc, nc): many blocks, some, one


def _sgemm(x, qw, bias=None, kc=256, mc=144, nc=256, threads=2):
    N, K = qw.shape
    return _impl(x, qw.packed, qw.scales, qw.offsets, None, None, bias, N, K, qw.bits, qw.group_size, 0, "cpu",
                 config={"impl": "sgemm", "threads": threads, "kc": kc, "mc": mc, "nc": nc})


@pytest.mark.parametrize("kc,mc,nc", _SGEMM_BLOCKINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sgemm_blocking_edges(kc, mc, nc, dtype):
    """The fp32 GEMM that dequantizes into its panels, against float64 and against the dequantize route
    (the same fp32 weights, only the order of the sums differs): M not a multiple of the 6-row sliver or
    of mc, N not a multiple of the 16-column sliver, of nc or of 4 (the tile rows), K not a multiple of
    32 or of kc, every layout's bits, one and many groups, with and without bias, more rows than one
    packed chunk of x (768)."""
    g = torch.Generator().manual_seed(kc + mc + nc)
    for M, N, K, bits, gs in ((1, 1, 1, 4, -1), (5, 3, 31, 2, -1), (7, 17, 33, 4, 32), (13, 35, 100, 8, -1),
                              (50, 290, 520, 3, 64), (145, 47, 257, 4, 128), (800, 20, 70, 8, 32)):
        qw = pykernels.quantize(torch.randn(N, K, generator=g), bits, gs, "asym")
        x = torch.randn(M, K, generator=g).to(dtype)
        x_before = x.clone()
        for bias in (None, torch.randn(N, generator=g)):
            y = _sgemm(x, qw, bias, kc, mc, nc)
            ref = oracle(x, qw, bias)
            W = qw.dequantize(torch.float64)
            eps = {torch.float32: 2 ** -23, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
            bound = 2 ** -20 * (x.double().abs() @ W.abs().T) + 2 * eps * ref.abs() + 1e-30
            assert y.dtype == dtype and y.shape == (M, N)
            assert bool(((y.double() - ref).abs() <= bound).all()), (M, N, K, bits, gs)
            dq = _impl(x, qw.packed, qw.scales, qw.offsets, None, None, bias, N, K, bits, gs, 0, "cpu",
                       config={"impl": "dequant_mm", "threads": 1})
            if dtype == torch.bfloat16 and torch_bf16_gemm_native():
                # there the dequantize route multiplies bf16 weights natively (by design: its speed), so its
                # weights carry a bf16 rounding of their own (AVX512-BF16 CPUs; Zen 4's failed the rtol below)
                assert bool(((y.double() - dq.double()).abs() <= bound + 2 * eps * (x.double().abs() @ W.abs().T)).all())
            else:
                assert torch.allclose(y.float(), dq.float(), rtol=2 * eps, atol=1e-5 * float(ref.abs().max()) + 1e-30)
        assert torch.equal(x, x_before)


def test_sgemm_special_values_as_torch():
    """inf and NaN activations, zero rows, huge and tiny values: the fp32 product's own answer (as torch's
    GEMM of the dequantized weight gives it: inf where a product is inf, NaN where inf meets a zero
    weight or +inf meets -inf), not the int16 path's special routes."""
    g = torch.Generator().manual_seed(1)
    N, K = 40, 96
    w = torch.randn(N, K, generator=g)
    w[3] = 0.0  # a zero row: inf * 0 = NaN
    qw = pykernels.quantize(w, 4, 32, "sym")
    x = torch.randn(9, K, generator=g)
    x[0, 5] = float("inf")
    x[1, 7] = float("nan")
    x[2] = 0.0
    x[3, 0], x[3, 1] = float("inf"), float("-inf")
    x[4] *= 1e30
    x[5] *= 1e-30
    y = _sgemm(x, qw)
    want = x @ qw.dequantize(torch.float32).T
    assert torch.equal(torch.isnan(y), torch.isnan(want)) and torch.equal(torch.isinf(y), torch.isinf(want))
    fin = torch.isfinite(want)
    assert torch.allclose(y[fin], want[fin], rtol=1e-5, atol=1e-5 * float(want[fin].abs().max()))


def test_sgemm_empty_and_k0():
    qw = pykernels.quantize(torch.randn(5, 64), 4, 32)
    assert _sgemm(torch.randn(0, 64), qw).shape == (0, 5)
    q0 = pykernels.quantize(torch.randn(5, 0), 4, -1)
    b = torch.randn(5)
    assert torch.equal(_sgemm(torch.randn(3, 0), q0, b), b.expand(3, 5))
    assert torch.equal(_sgemm(torch.randn(3, 0), q0), torch.zeros(3, 5))


def test_sgemm_bad_blocking_is_a_clear_error():
    qw = pykernels.quantize(torch.randn(8, 64), 4, 32)
    x = torch.randn(12, 64)
    for kc, mc, nc, name in ((48, 144, 256, "kc"), (256, 10, 256, "mc"), (256, 144, 100, "nc"), (0, 144, 256, "kc")):
        if not _has_avx2_here():
            pytest.skip("the sgemm kernel runs only with AVX2 (others take the dequantize route)")
        with pytest.raises(ValueError, match=f"qmatmul.*sgemm {name}"):
            _sgemm(x, qw, kc=kc, mc=mc, nc=nc)


def _has_avx2_here():
    from pykernels.quant._ops import _has_avx2

    return _has_avx2()


_ONE_ROUNDING = """
import torch, pykernels
from pykernels.quant._ops import _dequant_cpu
torch.manual_seed(0)
w = torch.randn(4, 64)
w[:, 5] = 0.0
qw = pykernels.quantize(w, bits=4, group_size=32, scheme="asym")
x = torch.randn(1, 64)
x[0, 5] = float("inf")
W = qw.dequantize(torch.float32)
assert torch.equal(_dequant_cpu(qw.packed, qw.scales, qw.offsets, 4, 64, 4, 32), W)
torch.testing.assert_close(pykernels.qmatmul(x, qw), torch.nn.functional.linear(x, W), equal_nan=True)
print("ONE-ROUNDING-OK")
"""


@pytest.mark.parametrize("tier", [None, "PYKERNELS_DISABLE_AVX2", "PYKERNELS_DISABLE_AVX512"])
def test_dequantize_rounds_once_in_every_tier(tier):
    """The native dequantize is QuantizedWeight.dequantize() exactly in every tier (the switches are read
    once per process, so each tier runs in its own): the portable one rounded twice, a zero point's weight
    came out 0, not the tiny value dequantize() gives, and an inf activation there gave NaN where torch
    gives inf (audit finding)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYKERNELS_DISABLE_")}
    if tier:
        env[tier] = "1"
    res = subprocess.run([sys.executable, "-c", _ONE_ROUNDING], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ONE-ROUNDING-OK" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


def test_dequantize_native_matches_python():
    from pykernels.quant._ops import _dequant_cpu

    for bits, gs in ((4, 32), (8, -1), (3, 128), (6, 64)):
        N, K = 9, 200
        qw = pykernels.quantize(torch.randn(N, K), bits, gs, "bipolar" if bits == 6 else "asym")
        ref = qw.dequantize(torch.float32)
        assert torch.allclose(_dequant_cpu(qw.packed, qw.scales, qw.offsets, N, K, bits, gs), ref, rtol=1e-6, atol=1e-6)
        bf = _dequant_cpu(qw.packed, qw.scales, qw.offsets, N, K, bits, gs, dtype=torch.bfloat16)
        assert torch.allclose(bf.float(), ref, rtol=2 ** -8, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Bit-serial (act_bits)
# ------------------------------------------------------------------------------------------------
def ref_act_codes(x, p):
    """The activations' codes, scale and offset per token (finite rows): A = sa * u + ma."""
    x = x.to(torch.float64)
    sa, ma = F.act_fit(x, p)
    sa, ma = sa[:, None], ma[:, None]
    return torch.round(torch.clamp((x - ma) / sa, 0, 2 ** p - 1)).to(torch.int64), sa, ma


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("p,q", [(1, 1), (2, 2), (1, 4), (3, 2), (4, 4), (8, 8), (2, 7)])
@pytest.mark.parametrize("group_size,K", [(32, 100), (64, 64), (128, 300), (-1, 2100), (32, 330)])
def test_bitserial_integer_sums_are_exact(mode, p, q, group_size, K):
    """(32, 330): 11 groups, so the AVX-512 kernel's blocks of four groups and its remainder both run; the
    activations' codes must equal the float64 reference exactly in every kernel tier."""
    N, M = 9, 3
    g = torch.Generator().manual_seed(p * 10 + q)
    qw = pykernels.quantize(torch.randn(N, K, generator=g), q, group_size, "bipolar")
    x = torch.randn(M, K, generator=g)
    if K == 330:  # bf16 activations through the same code path (exactly representable in float64)
        x = x.to(torch.bfloat16)
    gsize, G = F.group_geometry(K, group_size)
    I = torch.zeros(M, N, G, dtype=torch.int64)
    ua = torch.zeros(M, K, dtype=torch.uint8)
    cpu_bitserial(x, qw.planes, qw.scales, qw.offsets, qw.code_sums, None, N, K, q, group_size, p,
                  {"mode": mode}, int_out=I, act_codes=ua)
    ref_ua, sa, lo = ref_act_codes(x, p)
    assert torch.equal(ua.to(torch.int64), ref_ua)
    uw = qw.codes().to(torch.int64)
    for gi in range(G):
        sl = slice(gi * gsize, min(K, (gi + 1) * gsize))
        assert torch.equal(I[:, :, gi], ref_ua[:, sl] @ uw[:, sl].T), gi
    # after scaling: exactly (up to fp rounding) the product of the two dequantized operands
    y = pykernels.qmatmul(x, qw, act_bits=p)
    A = sa * ref_ua + lo
    ref = A @ qw.dequantize(torch.float64).T
    scale = A.abs().amax(1, keepdim=True) * qw.dequantize(torch.float64).abs().sum(1)[None]
    rel = 2.0 ** -8 if x.dtype == torch.bfloat16 else 1e-6  # y in x's dtype: one bf16 rounding
    assert ((y.double() - ref).abs() <= 1e-5 * scale + rel * ref.abs()).all()


def _act_rows(K, seed):
    """Tokens of several shapes: Gaussian, heavy-tailed (Student t, 3 dof), one large outlier, uniform,
    ReLU'd (half zeros), sparse."""
    g = torch.Generator().manual_seed(seed)
    gauss = torch.randn(4, K, generator=g, dtype=torch.float64)
    heavy = gauss / torch.sqrt(torch.randn(4, K, 3, generator=g, dtype=torch.float64).pow(2).mean(-1))
    outlier = torch.randn(4, K, generator=g, dtype=torch.float64)
    outlier[:, K // 3] = 60.0
    uniform = torch.rand(4, K, generator=g, dtype=torch.float64)
    sparse = torch.randn(4, K, generator=g, dtype=torch.float64) * (torch.rand(4, K, generator=g) < 0.05)
    return torch.cat([gauss, heavy, outlier, uniform, gauss.clamp(min=0), sparse])


def _act_error(x, sa, ma, p):
    u = torch.round(torch.clamp((x - ma[:, None]) / sa[:, None], 0, 2 ** p - 1))
    return ((u * sa[:, None] + ma[:, None] - x) ** 2).sum(1)


@pytest.mark.parametrize("p", range(1, 9))
def test_act_fit_never_worse_than_the_range_and_near_the_best_grid(p):
    """act_bits' per-token scale/offset (F.act_fit, the reference every kernel follows): never a larger
    squared error than the token's range (the old choice: 1-bit codes at {min, max}, a relative error of
    2.9 on Gaussian tokens); at 1-2 bits within 10% of the best uniform grid a brute-force search finds for
    Gaussian, heavy-tailed, outlier and uniform tokens (a single start missed the outlier ones' by 6x),
    within 1.5x for ReLU'd and sparse ones."""
    x = _act_rows(512, p)
    qmax = 2 ** p - 1
    lo, hi = x.amin(1), x.amax(1)
    sa, ma = F.act_fit(x, p)
    err = _act_error(x, sa, ma, p)
    err_range = _act_error(x, (hi - lo) / qmax, lo, p)
    assert (err <= err_range).all()
    rel = (err / (x * x).sum(1)).sqrt()
    if p <= 2:  # Gaussian rows: 0.60 at 1 bit, 0.35 at 2 (range: 2.9, 0.71)
        assert (rel[:4] < (0.64, 0.38)[p - 1]).all(), rel[:4]
        scales = torch.linspace(0.01, 1.0, 100, dtype=torch.float64)[:, None] * (hi - lo)[None]
        best = torch.full_like(err, float("inf"))
        for frac in torch.linspace(-0.3, 1.0, 66, dtype=torch.float64):  # grid start m = lo + frac * (hi - lo)
            m = lo + frac * (hi - lo)
            best = torch.minimum(best, torch.stack([_act_error(x, sc, m, p) for sc in scales]).amin(0))
        ratio = err / best
        assert (ratio[:16] <= 1.1).all() and (ratio <= 1.5).all(), ratio


def test_act_fit_ties_resolve_alike_in_every_kernel_tier():
    """Review: candidates whose errors tie in exact arithmetic (integer-valued tokens: mirror-image 1-bit
    grids) were told apart by the last bits of sums each kernel adds in its own order, so the CPU tiers
    and the reference kept different grids for the same token (6, 3 and 3 of 20000 rounded tokens in
    modes 0/2/3 at 1 bit, y off by up to 10.7 of ~13). A candidate now replaces the best only if clearly
    better: every tier gives the reference's codes."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(4000, 48, generator=g, dtype=torch.float64)
    x = torch.cat([base.round(), (base * 2).round() / 2, base.abs().round(),
                   torch.randint(0, 3, (4000, 48), generator=g).double()]).float()
    qw = pykernels.quantize(torch.randn(4, 48, generator=g), 2, -1, "bipolar")
    ref, _, _ = ref_act_codes(x, 1)
    for mode in (0, 2, 3):
        ua = torch.zeros(x.shape, dtype=torch.uint8)
        cpu_bitserial(x, qw.planes, qw.scales, qw.offsets, qw.code_sums, None, 4, 48, 2, -1, 1, {"mode": mode},
                      act_codes=ua)
        assert int((ua.to(torch.int64) != ref).any(1).sum()) == 0, mode


@pytest.mark.parametrize("p", range(1, 9))
def test_act_fit_grids_stay_in_float32_range(p):
    """Review: a Lloyd line through a token holding +-3.4e38 reached ma = -4e38, -inf in the fp32 the GPU
    kernels store (the CPU keeps fp64). Fitted grids whose levels leave float32 are not taken; one bit's
    range step (6.8e38 here) is capped at float32's max."""
    x = torch.randn(3, 96, dtype=torch.float64)
    x[:, :2] = torch.tensor([3.4e38, -3.4e38], dtype=torch.float64)
    x[1, 5] = 1e38
    sa, ma = F.act_fit(x, p)
    big = torch.finfo(torch.float32).max
    top = ma + sa * (2 ** p - 1)
    assert (ma.abs() <= big).all() and (top.abs() <= big).all() and (sa <= big).all()
    assert torch.isfinite(sa.float()).all() and torch.isfinite(ma.float()).all()


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_bitserial_adversarial_activation_rows(mode, p):
    """Tokens with a 1e30 outlier (its quotient far outside int32 once the grid clips the tail: converted
    after clamping), constant, two-valued, all zeros with -0.0, denormal, float32 extremes: every kernel
    tier gives the reference's codes, and y is the product of the dequantized operands. Rows spanning 30+
    decades compare candidates' squared errors below their own rounding (an error near 1e28 from the
    1e30 value's last bit): there the kernels may pick another candidate than the reference, so those
    rows are held to the float product instead (a code converted unclamped gave INT_MIN -> 0 there)."""
    K, N = 96, 5
    g = torch.Generator().manual_seed(p)
    rows = torch.randn(9, K, generator=g)
    rows[0, 7] = 1e30
    rows[1] = 0.25
    rows[2] = torch.where(torch.arange(K) % 3 == 0, 1.0, -2.0)
    rows[3] = 0.0
    rows[3, ::2] = -0.0
    rows[4] = torch.randn(K, generator=g) * 1e-40  # denormals
    rows[5, :2] = torch.tensor([3.4e38, -3.4e38])
    rows[6] = (torch.arange(K) % 4).float()  # 0..3: exact at 2 bits
    rows[7, 40] = -1e30
    wide = [0, 5, 7]
    qw = pykernels.quantize(torch.randn(N, K, generator=g), 2, 32, "bipolar")
    x = rows.clone()
    ua = torch.zeros(rows.shape, dtype=torch.uint8)
    y = cpu_bitserial(rows, qw.planes, qw.scales, qw.offsets, qw.code_sums, None, N, K, 2, 32, p, {"mode": mode},
                      act_codes=ua)
    assert torch.equal(rows, x) and torch.equal(torch.signbit(rows), torch.signbit(x))  # -0.0 kept too
    ref_ua, sa, ma = ref_act_codes(rows, p)
    narrow = [i for i in range(len(rows)) if i not in wide]
    assert torch.equal(ua.to(torch.int64)[narrow], ref_ua[narrow])
    A = sa * ref_ua + ma
    assert torch.equal(A[1], torch.full((K,), 0.25, dtype=torch.float64)) and ref_ua[3].max() == 0
    assert torch.equal(A[2], rows[2].double())  # two values: exact from 1 bit on
    if p == 2:
        assert torch.equal(A[6], rows[6].double())
    W = qw.dequantize(torch.float64)
    ref = A @ W.T
    scale = A.abs().amax(1, keepdim=True) * W.abs().sum(1)[None]
    close = (y.double() - ref).abs() <= 1e-5 * scale + 1e-6 * ref.abs()
    assert close[narrow].all()
    # one outlier each: two levels already hold it and the rest; +-3.4e38 (row 5) may overflow y itself
    exact = rows[[0, 7]].double() @ W.T
    assert ((y[[0, 7]].double() - exact).abs() <= 1e-3 * 1e30 * W.abs().sum(1)[None]).all()
    assert not torch.isnan(y).any()


def test_bitserial_avx512_token_chunks_match_the_portable_kernel():
    """The AVX-512 kernel spreads the activation planes of at most ~8 MiB of tokens at a time (here 128
    tokens of K=4096, 8 bits, groups of 32, so 300 tokens take three chunks): the same integer sums and
    outputs as the portable kernel (mode 0)."""
    N, M, K, gs = 6, 300, 4096, 32
    g = torch.Generator().manual_seed(3)
    qw = pykernels.quantize(torch.randn(N, K, generator=g), 2, gs, "bipolar")
    x = torch.randn(M, K, generator=g)
    G = K // gs
    outs = []
    for mode in (0, 3):
        I = torch.zeros(M, N, G, dtype=torch.int64)
        cpu_bitserial(x, qw.ensure_planes(), qw.scales, qw.offsets, qw.code_sums, None, N, K, 2, gs, 8,
                      {"mode": mode}, int_out=I)
        y = cpu_bitserial(x, qw.ensure_planes(), qw.scales, qw.offsets, qw.code_sums, None, N, K, 2, gs, 8,
                          {"mode": mode})
        outs.append((I, y))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.allclose(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", [0, 2, 3])
def test_bitserial_tokens_quantized_in_parallel_match_one_at_a_time(mode):
    """Tokens are quantized on several threads in chunks (~16K elements: here 170 tokens of K=96, so
    2000 tokens take twelve chunks): the activation codes, integer sums and outputs of a batch equal those
    of each token alone on one thread, bit for bit (rows of NaN and constant rows among them). Modes the
    CPU lacks fall back to a tier it has (the native module caps them)."""
    N, M, K, gs, p = 5, 2000, 96, 32, 2
    g = torch.Generator().manual_seed(11)
    qw = pykernels.quantize(torch.randn(N, K, generator=g), 3, gs, "bipolar")
    x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 10
    x[7, 3] = float("nan")
    x[400] = 2.5
    args = (qw.ensure_planes(), qw.scales, qw.offsets, qw.code_sums, None, N, K, 3, gs, p)

    def run(rows, threads):
        I = torch.zeros(rows.shape[0], N, K // gs, dtype=torch.int64)
        codes = torch.zeros(rows.shape[0], K, dtype=torch.uint8)
        cpu_bitserial(rows, *args, {"mode": mode, "threads": threads}, int_out=I, act_codes=codes)
        y = cpu_bitserial(rows, *args, {"mode": mode, "threads": threads})
        return I, codes, y

    I, codes, y = run(x, 2)
    for m in range(M):
        Im, cm, ym = run(x[m:m + 1], 1)
        assert torch.equal(I[m], Im[0]) and torch.equal(codes[m], cm[0]), m
        assert torch.equal(y[m], ym[0]) or (y[m].isnan().all() and ym[0].isnan().all()), m


@pytest.mark.parametrize("mode", [0, 3])
@pytest.mark.parametrize("M,N,K,p,q", [(1, 1024, 1024, 2, 2), (2, 1024, 1024, 2, 2), (1, 512, 512, 4, 4),
                                       (1, 1024, 512, 4, 4), (3, 260, 96, 2, 2)])
def test_bitserial_thread_counts_agree(mode, M, N, K, p, q):
    """The tile loop takes a thread per 2^20 multiply-adds, a product of p x q one-bit planes counting as
    p * q / 4 of one (W2A2 at 1 x 1024 x 1024 and W4A4 at 1 x 512 x 512 on one thread, twice those on two):
    1, 2 and 7 requested threads give the same integer sums and outputs, and the sums are the exact
    products of the activation and weight codes."""
    g = torch.Generator().manual_seed(M * 7 + p)
    qw = pykernels.quantize(torch.randn(N, K, generator=g), q, 128, "bipolar")
    x = torch.randn(M, K, generator=g)
    G = F.group_geometry(K, 128)[1]
    outs = []
    for threads in (1, 2, 7):
        I = torch.zeros(M, N, G, dtype=torch.int64)
        ua = torch.zeros(M, K, dtype=torch.uint8)
        args = (qw.planes, qw.scales, qw.offsets, qw.code_sums, None, N, K, q, 128, p, {"mode": mode, "threads": threads})
        cpu_bitserial(x, *args, int_out=I, act_codes=ua)
        outs.append((I, ua, cpu_bitserial(x, *args)))
    for I, ua, y in outs[1:]:
        assert torch.equal(I, outs[0][0]) and torch.equal(ua, outs[0][1]) and torch.equal(y, outs[0][2])
    I, ua, _ = outs[0]
    uw, u = qw.codes().to(torch.int64), ua.to(torch.int64)
    for gi in range(G):
        sl = slice(gi * 128, min(K, (gi + 1) * 128))
        assert torch.equal(I[:, :, gi], u[:, sl] @ uw[:, sl].T), gi


@pytest.mark.parametrize("scheme,bits", [("asym", 4), ("sym", 3), ("bipolar", 2), ("bipolar", 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bitserial_close_to_float_product(scheme, bits, dtype):
    N, K = 20, 256
    qw = pykernels.quantize(torch.randn(N, K), bits, 64, scheme)
    x = torch.randn(4, K).to(dtype)
    bias = torch.randn(N)
    ref = oracle(x, qw, bias)
    y8 = pykernels.qmatmul(x, qw, bias, act_bits=8)
    assert y8.dtype == dtype
    W = qw.dequantize(torch.float64)
    bound = x.double().abs().amax(1, keepdim=True) * W.abs().sum(1)[None]
    assert ((y8.double() - ref).abs() <= 1e-2 * bound + 1e-2 * ref.abs()).all()
    # fewer activation bits: larger error, but the same estimator (still correlated with the truth)
    y2 = pykernels.qmatmul(x, qw, bias, act_bits=2).double()
    assert torch.corrcoef(torch.stack([y2.flatten(), ref.flatten()]))[0, 1] > 0.5


def test_act_bits_rows_holding_nan_or_inf_are_nan_and_leave_the_others():
    """Documented: per-token activation quantization has no scale for a NaN/inf token: its row is NaN on
    the bit-serial path; the other tokens are unaffected."""
    g = torch.Generator().manual_seed(3)
    qw = pykernels.quantize(torch.randn(8, 64, generator=g), 2, 32, "bipolar")
    x = torch.randn(4, 64, generator=g)
    ref = pykernels.qmatmul(x, qw, act_bits=2)
    x[1, 3], x[2, 9] = float("inf"), float("nan")
    y = pykernels.qmatmul(x, qw, act_bits=2)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    assert torch.equal(y[[0, 3]], ref[[0, 3]])


def test_registered_op_without_planes_for_act_bits_is_a_clear_error():
    """Review note: torch.ops.pykernels.qmatmul called directly with act_bits and no planes raised an
    AttributeError deep inside; now the op's ValueError."""
    qw = pykernels.quantize(torch.randn(8, 64), 2, 32, "bipolar")
    with pytest.raises(ValueError, match="pykernels.qmatmul: act_bits needs the weight's bit planes"):
        torch.ops.pykernels.qmatmul(torch.randn(2, 64), qw.packed, qw.scales, qw.offsets, None, None, None,
                                    8, 64, 2, 32, 2, "auto")


def test_strided_bias_works_through_the_op_as_in_eager_code():
    """A bias view (strided, expanded) works wherever the call goes through the registered op (autograd,
    torch.func.vmap, torch.compile) as it does in plain eager code and in F.linear (review finding: the op
    refused it with "expected a contiguous 'bias' of 48 floating elements ..., got 48 torch.float32")."""
    torch.manual_seed(0)
    qw = pykernels.quantize(torch.randn(48, 256), bits=4, group_size=128)
    x = torch.randn(3, 256)
    for bias in (torch.randn(96)[::2], torch.tensor([0.5]).expand(48)):
        want = pykernels.qmatmul(x, qw, bias.contiguous())
        assert torch.equal(pykernels.qmatmul(x, qw, bias), want)
        xg = x.clone().requires_grad_()
        got = pykernels.qmatmul(xg, qw, bias)
        torch.testing.assert_close(got, want)
        got.sum().backward()
        assert xg.grad.shape == x.shape
        torch.testing.assert_close(torch.func.vmap(lambda r: pykernels.qmatmul(r, qw, bias))(x), want)
        torch._dynamo.reset()
        compiled = torch.compile(lambda r, b: pykernels.qmatmul(r, qw, b), fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(x, bias), want)
    # a strided bias that itself requires grad: its gradient, as F.linear's
    base = torch.randn(96, requires_grad=True)
    out = pykernels.qmatmul(x, qw, base[::2])
    out.sum().backward()
    assert torch.equal(base.grad[::2], torch.full((48,), 3.0)) and not bool(base.grad[1::2].any())


def test_numpy_integers_are_taken_for_bits_group_size_and_act_bits():
    """NumPy integers work as the library's other integer arguments do (sort's dim, table capacities;
    review finding: "expected bits in (2, 3, 4, 8) for scheme 'asym', got np.int64(4)"), stored as ints."""
    w = torch.randn(64, 128)
    ref = pykernels.quantize(w, bits=4, group_size=128)
    qw = pykernels.quantize(w, bits=np.int64(4), group_size=np.int32(128))
    assert type(qw.bits) is int and type(qw.group_size) is int and torch.equal(qw.packed, ref.packed)
    x = torch.randn(2, 128)
    assert torch.equal(pykernels.qmatmul(x, qw, act_bits=np.int8(4)), pykernels.qmatmul(x, ref, act_bits=4))
    lin = torch.nn.Linear(128, 64)
    layer = pykernels.QuantLinear.from_linear(lin, bits=np.int64(4), group_size=np.int64(128), act_bits=np.int64(8))
    assert type(layer.bits) is int and type(layer.group_size) is int and type(layer.act_bits) is int
    for bad in (np.bool_(True), True, 4.0, "4"):
        with pytest.raises(ValueError, match="pykernels.quantize: expected bits"):
            pykernels.quantize(w, bits=bad)


def test_bitserial_refuses_groups_whose_code_sums_overflow_int32(monkeypatch):
    """The bit-serial kernels sum a group's codes (weights' and activations', up to 255 each) in 32 bits: a
    longer group is refused, naming qmatmul and group_size, through the function and the op alike (review
    finding: K = 9M with group_size=-1 wrapped the sums; the result was wrong with no error). The limit is
    lowered here (the real one needs 8.4M-input groups); it is the largest that cannot wrap."""
    assert 255 * F.MAX_BITSERIAL_GROUP < 2 ** 31 <= 255 * (F.MAX_BITSERIAL_GROUP + 1)
    monkeypatch.setattr(F, "MAX_BITSERIAL_GROUP", 64)
    w, x = torch.randn(8, 128), torch.randn(2, 128)
    for group_size in (-1, 128):
        qw = pykernels.quantize(w, bits=4, group_size=group_size)
        with pytest.raises(ValueError, match="pykernels.qmatmul: act_bits needs groups of at most 64 inputs"):
            pykernels.qmatmul(x, qw, act_bits=4)
        with pytest.raises(ValueError, match="act_bits needs groups of at most 64"):
            torch.ops.pykernels.qmatmul(x, qw.packed, qw.scales, qw.offsets, qw.ensure_planes(), qw.code_sums,
                                        None, 8, 128, 4, group_size, 4, "auto")
        pykernels.qmatmul(x, qw)  # weight-only: no code sums
    qw = pykernels.quantize(w, bits=4, group_size=64)
    ref = x.double() @ qw.dequantize(torch.float32).double().T
    assert (pykernels.qmatmul(x, qw, act_bits=8).double() - ref).abs().max() < 0.05 * ref.abs().max()


def test_reassigned_weight_buffers_are_checked_on_every_call():
    """A QuantizedWeight's or QuantLinear's tensors can be replaced after they were checked: every qmatmul
    call checks them, the eager path as the op does (review findings: a 16-byte `packed` was read out of
    bounds -- a segfault --, float16 scales gave 1e29 or NaN, and a bias-free QuantLinear loaded with
    assign=True from a state dict of float16 scales returned inf/NaN, where a biased one raised)."""
    import copy

    qw = pykernels.quantize(torch.randn(64, 256), 4, 32)
    x = torch.randn(2, 256)
    bad = copy.copy(qw)
    bad.scales = qw.scales.half()
    with pytest.raises(ValueError, match="pykernels.qmatmul: expected a contiguous 'scales' of 512 torch.float32"):
        pykernels.qmatmul(x, bad)
    bad = copy.copy(qw)
    bad.packed = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="pykernels.qmatmul: expected a contiguous 'packed'"):
        pykernels.qmatmul(x, bad)
    bad = copy.copy(qw)
    bad.scales = qw.scales.t().contiguous().t()
    with pytest.raises(ValueError, match="not contiguous"):
        pykernels.qmatmul(x, bad)
    for bias in (True, False):
        lin = torch.nn.Linear(256, 64, bias=bias)
        layer = pykernels.QuantLinear.from_linear(lin, bits=4, group_size=32)
        sd = {k: (v.half() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in layer.state_dict().items()}
        fresh = pykernels.QuantLinear(256, 64, bias=bias, bits=4, group_size=32)
        fresh.load_state_dict(sd, assign=True)
        with pytest.raises(ValueError, match="pykernels.qmatmul: expected a contiguous 'scales'"):
            fresh(x)


def test_meta_quantized_weight_copies_and_saves():
    """A QuantizedWeight on the meta device deep-copies and round-trips through torch.save (the loader's
    check of the codes read a meta tensor: "Tensor.item() cannot be called on meta tensors")."""
    import copy
    import io

    qm = pykernels.quantize(torch.randn(64, 128), 4, 32).to("meta")
    for cp in (copy.deepcopy(qm),):
        assert cp.packed.is_meta and cp.shape == qm.shape
    buf = io.BytesIO()
    torch.save(qm, buf)
    buf.seek(0)
    back = torch.load(buf)
    assert back.packed.is_meta and back.bits == 4 and back.scales.shape == qm.scales.shape


def test_outputs_of_batched_inputs_take_in_place_ops_in_grad_mode():
    """A QuantLinear on [B, S, K] followed by ReLU(inplace=True) works as nn.Linear does: the output is not a
    view of the 2-D result (autograd refused the in-place op on the custom op's view; audit finding)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    q = torch.nn.Sequential(pykernels.QuantLinear.from_linear(lin, 4, 32), torch.nn.ReLU(inplace=True))
    x = torch.randn(2, 5, 64)
    y = q(x)
    ref = torch.relu(torch.nn.functional.linear(x, q[0].qweight.dequantize(torch.float32), lin.bias))
    assert y.shape == (2, 5, 32) and not y._is_view()
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    y.sum().backward()
    assert q[0].bias.grad is not None
    qw = pykernels.quantize(torch.randn(32, 64), 4, 32)
    for shape in ((64,), (3, 64), (2, 3, 64), (0, 3, 64)):
        xr = torch.randn(*shape, requires_grad=True)
        out = pykernels.qmatmul(xr, qw)
        out.add_(1.0)  # raised "... is a view and is being modified inplace" for 1-D and 3-D x
        assert out.shape == (*shape[:-1], 32)


def test_autocast_casts_the_activations_as_for_nn_linear():
    """Under torch.autocast a QuantLinear (and qmatmul) returns autocast's dtype, as nn.Linear does (it
    returned float32); float64 is left alone, as autocast leaves it."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    q = pykernels.QuantLinear.from_linear(lin, 4, 32)
    x = torch.randn(3, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, ref = q(x), lin(x)
        y2 = pykernels.qmatmul(x, q.qweight, q.bias)
    assert y.dtype == ref.dtype == y2.dtype == torch.bfloat16
    torch.testing.assert_close(y, q(x.bfloat16()))
    torch.testing.assert_close(y2, y)


@pytest.mark.parametrize("scheme,bits", [("asym", 2), ("asym", 3), ("asym", 4), ("asym", 8), ("sym", 4),
                                         ("bipolar", 1), ("bipolar", 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backward_dequantizes_natively_as_the_formulas(scheme, bits, dtype):
    """The gradient w.r.t. x on CPU takes the native dequantizer (the torch formulas cost ~17 ms of an M=16
    1024x1024 layer's backward): dx is grad @ W with W exactly the formulas' weights (odd N and K, a
    last partial group, one group per row), for 2-D and batched x; the bias gets its sum."""
    for (N, K), gs in (((40, 200), 32), ((33, 130), -1), ((64, 256), 128)):
        g = torch.Generator().manual_seed(N + K + bits)
        try:
            qw = pykernels.quantize(torch.randn(N, K, generator=g), bits=bits, group_size=gs, scheme=scheme)
        except ValueError:
            continue  # a group size the scheme refuses
        n, k = qw.shape
        W = F.dequantize_codes(F.unpack_tiles(qw.packed, bits, n, k), qw.scales, qw.offsets, qw.group_size,
                               torch.float32)
        for shape in ((5, K), (2, 3, K)):
            x = torch.randn(shape, generator=g).to(dtype).requires_grad_()
            bias = torch.randn(N, generator=g).requires_grad_()
            y = pykernels.qmatmul(x, qw, bias=bias)
            gy = torch.randn(y.shape, generator=g).to(y.dtype)
            y.backward(gy)
            want = (gy.reshape(-1, N).float() @ W).to(dtype).reshape(shape)
            assert torch.equal(x.grad, want), (scheme, bits, N, K, gs, shape)
            assert torch.equal(bias.grad, gy.reshape(-1, N).sum(0).float())  # (in y's dtype, as F.linear's)


def test_eager_autograd_function_matches_the_registered_op():
    """An eager call whose x or bias requires grad runs under the module's own autograd.Function
    (_EagerQmatmul), not through the registered op's autograd: the same output and gradients as the op's
    (x only, bias only, both; batched x; bit-serial), and the same second derivative."""
    g = torch.Generator().manual_seed(0)
    qw = pykernels.quantize(torch.randn(24, 64, generator=g), bits=4, group_size=32)
    qb = pykernels.quantize(torch.randn(24, 64, generator=g), bits=2, group_size=32, scheme="bipolar")
    for w, act_bits in ((qw, None), (qb, 2)):
        for shape in ((5, 64), (2, 3, 64)):
            for needs in ((True, False), (False, True), (True, True)):
                x0, b0 = torch.randn(shape, generator=g), torch.randn(24, generator=g)
                dy = torch.randn(*shape[:-1], 24, generator=g)
                got = []
                for via_op in (False, True):
                    x, b = x0.clone().requires_grad_(needs[0]), b0.clone().requires_grad_(needs[1])
                    if via_op:
                        planes = w.ensure_planes() if act_bits else None
                        y = torch.ops.pykernels.qmatmul(x, w.packed, w.scales, w.offsets, planes,
                                                        w.code_sums if act_bits else None, b, 24, 64, w.bits,
                                                        w.group_size, act_bits or 0, "cpu")
                    else:
                        y = pykernels.qmatmul(x, w, bias=b, act_bits=act_bits)
                        assert type(y.grad_fn).__name__ == "_EagerQmatmulBackward"
                    y.backward(dy)
                    got.append((y.detach(), x.grad, b.grad))
                for a, c in zip(*got):
                    assert (a is None and c is None) or torch.equal(a, c)
    second = []  # a second derivative (the backward is torch ops of the gradient): the same both ways
    for via_op in (False, True):
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        y = (torch.ops.pykernels.qmatmul(x, qw.packed, qw.scales, qw.offsets, None, None, None, 24, 64, 4, 32, 0, "cpu")
             if via_op else pykernels.qmatmul(x, qw))
        gx, = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
        second.append(torch.autograd.grad(gx.pow(2).sum(), x)[0])
    torch.testing.assert_close(second[0], second[1], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("rows", [4, 8, 256])
def test_cpu_backward_dequantizes_in_chunks_of_rows(monkeypatch, rows):
    """dx accumulates grad[:, chunk] @ W[chunk] over chunks of _DX_ROWS weight rows (each dequantized into one
    buffer while in cache): with chunks of 4, 8 or 256 rows and N not a multiple of them (a last short
    chunk), dx matches grad @ W of the formulas' weights (to fp32 rounding: the sums' order differs)."""
    from pykernels.quant import _ops

    monkeypatch.setattr(_ops, "_DX_ROWS", rows)
    g = torch.Generator().manual_seed(rows)
    for N, K in ((601, 96), (37, 64)):
        qw = pykernels.quantize(torch.randn(N, K, generator=g), bits=4, group_size=32)
        W = F.dequantize_codes(F.unpack_tiles(qw.packed, 4, N, K), qw.scales, qw.offsets, 32, torch.float32)
        x = torch.randn(3, 5, K, generator=g, requires_grad=True)
        gy = torch.randn(3, 5, N, generator=g)
        pykernels.qmatmul(x, qw).backward(gy)
        torch.testing.assert_close(x.grad, gy @ W, rtol=1e-5, atol=1e-4)
