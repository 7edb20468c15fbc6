"""The native CUDA/HIP backend of qmatmul (csrc/qgemm/qgemm.cu) against the float64 oracle; GPU only.
Without a GPU: the module reports a clean error (its .cu build for sm_90/gfx90a is checked by
tests/test_gpu_build.py)."""
import pytest
import torch

import pykernels
from pykernels.quant import _format as F


def test_cuda_backend_without_gpu_is_a_clean_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    qw = pykernels.quantize(torch.randn(8, 64), 4, 32)
    with pytest.raises(RuntimeError, match="pykernels.qmatmul"):
        pykernels.qmatmul(torch.randn(2, 64), qw, backend="cuda")


def _bound(x, qw, ref, eps):
    W = qw.dequantize(torch.float64).cpu()
    x2 = x.reshape(-1, x.shape[-1]).double().cpu()
    return eps * (x2.abs() @ W.abs().T) + 2 * eps * ref.abs() + 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [1, 3, 16, 64, 100])
@pytest.mark.parametrize("bits,group_size,scheme", [(4, 128, "asym"), (3, 32, "sym"), (8, -1, "asym"), (6, 64, "bipolar")])
def test_cuda_weight_only(dtype, M, bits, group_size, scheme):
    N, K = 1037, 1100  # not multiples of any tile; K not a multiple of 64/128
    qw = pykernels.quantize(torch.randn(N, K), bits, group_size, scheme).to("cuda")
    x = torch.randn(M, K, device="cuda").to(dtype)
    bias = torch.randn(N, device="cuda")
    y = pykernels.qmatmul(x, qw, bias, backend="cuda")
    ref = (x.double() @ qw.dequantize(torch.float64).T + bias.double()).cpu()
    eps = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
    assert y.dtype == dtype and ((y.double().cpu() - ref).abs() <= _bound(x, qw, ref, eps)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("mma", [True, False])
@pytest.mark.parametrize("p,q,group_size", [(1, 1, 128), (2, 2, 64), (3, 4, -1), (8, 8, 32)])
def test_cuda_bitserial_matches_cpu(mma, p, q, group_size):
    from pykernels.quant._ops import _impl

    N, K, M = 301, 700, 11
    qw = pykernels.quantize(torch.randn(N, K), q, group_size, "bipolar")
    x = torch.randn(M, K)
    yc = pykernels.qmatmul(x, qw, act_bits=p, backend="cpu")
    g = qw.to("cuda")
    yg = _impl(x.cuda(), g.packed, g.scales, g.offsets, g.planes, g.code_sums, None, N, K, q, group_size, p, "cuda",
               config={"mma": mma}).cpu()
    scale = x.abs().amax(1, keepdim=True) * qw.dequantize().abs().sum(1)[None]
    # the GPU sums the per-token fit (F.act_fit) in another order than the CPU: a code may differ where a
    # value sits within ~1e-15 of a rounding tie: allow one code step of one element (sa * max|w|) on top
    # of the fp32 recombination error
    sa = F.act_fit(x.double(), p)[0].float()
    step = sa[:, None] * qw.dequantize().abs().amax(1)[None]
    assert ((yg - yc).abs() <= 1e-5 * scale + 2 * step + 1e-4).all()


def _cuda_wo(x, qw, bias, config):
    from pykernels.quant._ops import _impl

    N, K = qw.shape
    return _impl(x, qw.packed, qw.scales, qw.offsets, None, None, bias, N, K, qw.bits, qw.group_size, 0, "cuda",
                 config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kernel,rg,pipe", [("mma", 1, False), ("mma", 2, False), ("mma", 4, False), ("mma", 1, True),
                                           ("mma", 2, True), ("mma", 4, True), ("simt", None, None)])
@pytest.mark.parametrize("N,K,group_size,scheme,bits", [
    (1030, 1100, 128, "asym", 4),   # N % 16 = 6: the last 16-row group reaches past the packed tiles
    (64, 1037, -1, "asym", 4),      # K odd: x read element by element, one group per row (gsize = K)
    (200, 512, 32, "sym", 3),       # 3-bit codes in the nibble layout, a group per block
    (40, 4096, 64, "bipolar", 2),   # long K: every warp of the CTA gets several groups
])
def test_cuda_weight_only_kernels(dtype, kernel, rg, pipe, N, K, group_size, scheme, bits):
    """Both weight-only CUDA kernels (tensor-core 'mma' with 1/2/4 row groups per CTA, loads pipelined or
    not; 'simt') against the float64 oracle: token counts around the 8/16-token MMA tiles, bias, and an
    x at an odd offset."""
    g = torch.Generator().manual_seed(N + K)
    qw = pykernels.quantize(torch.randn(N, K, generator=g), bits, group_size, scheme).to("cuda")
    bias = torch.randn(N, generator=g).cuda()
    cfg = {"kernel": kernel} if rg is None else {"kernel": kernel, "rg": rg, "pipe": pipe}
    for M in (1, 5, 8, 9, 16, 17, 40):
        base = torch.randn(M * K + 1, generator=g).cuda().to(dtype)
        for x in (base[:M * K].view(M, K), base[1:].view(M, K)):  # aligned, and 2 bytes off (no vector loads)
            for b in (None, bias):
                y = _cuda_wo(x, qw, b, cfg)
                ref = (x.double() @ qw.dequantize(torch.float64).T + (0 if b is None else b.double())).cpu()
                eps = {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
                assert y.dtype == dtype and y.shape == (M, N)
                bad = (y.double().cpu() - ref).abs() > _bound(x, qw, ref, eps)
                assert not bad.any(), (M, x.data_ptr() % 8, b is None, bad.nonzero()[:5].tolist())


@pytest.mark.gpu
def test_cuda_mma_kernel_config_errors():
    qw8 = pykernels.quantize(torch.randn(64, 256), 8, 128).to("cuda")
    qw4 = pykernels.quantize(torch.randn(64, 256), 4, 128).to("cuda")
    x16 = torch.randn(3, 256, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="kernel='mma' needs"):
        _cuda_wo(x16, qw8, None, {"kernel": "mma"})
    with pytest.raises(ValueError, match="kernel='mma' needs"):
        _cuda_wo(x16.float(), qw4, None, {"kernel": "mma"})
    with pytest.raises(ValueError, match="'kernel'"):
        _cuda_wo(x16, qw4, None, {"kernel": "wgmma"})
    with pytest.raises(ValueError, match="'rg'"):
        _cuda_wo(x16, qw4, None, {"kernel": "mma", "rg": 3})
    # the default for fp16 x and 4-bit codes is the tensor-core kernel, and it matches the simt one
    torch.testing.assert_close(_cuda_wo(x16, qw4, None, {}), _cuda_wo(x16, qw4, None, {"kernel": "simt"}),
                               rtol=2e-3, atol=2e-3)


def test_gpu_backend_order_without_a_tuned_entry(monkeypatch):
    """The CUDA tensor-core kernel first for weight-only fp16/bf16 x <= 4-bit codes up to 16 tokens
    (measured faster than Triton there on an H200), Triton otherwise and on ROCm."""
    from pykernels.quant._ops import _gpu_preference

    monkeypatch.setattr(torch.version, "hip", None)
    for dtype in (torch.float16, torch.bfloat16):
        for M, bits in ((1, 4), (16, 4), (3, 2)):
            assert _gpu_preference(M, bits, 0, dtype) == ("cuda", "triton")
    for M, bits, act_bits, dtype in ((17, 4, 0, torch.float16), (1, 8, 0, torch.float16),
                                     (1, 4, 0, torch.float32), (1, 4, 4, torch.float16)):
        assert _gpu_preference(M, bits, act_bits, dtype) == ("triton", "cuda")
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert _gpu_preference(1, 4, 0, torch.float16) == ("triton", "cuda")


def test_cuda_tunable_candidates(monkeypatch):
    """The CUDA qmatmul tunable: {} (the kernel's own choice) is the default and a candidate; the
    tensor-core configs only where they apply (fp16/bf16, <= 4 bits, CUDA rather than ROCm)."""
    from pykernels import autotune as at
    from pykernels.quant._ops import _key

    t = next(t for t in at.registered("qgemm") if t.op == "qmatmul" and t.backend == "cuda")
    monkeypatch.setattr(torch.version, "hip", None)
    key = _key(16, 8192, 8192, 4, 128, 0, torch.float16)
    cands = t.candidates(key)
    assert t.default(key) == {} and {} in cands and {"kernel": "simt"} in cands
    assert {"kernel": "mma", "rg": 4, "pipe": True} in cands and len(cands) == 2 + 6
    assert not [c for c in t.candidates(_key(16, 8192, 8192, 8, 128, 0, torch.float16)) if c.get("kernel") == "mma"]
    assert not [c for c in t.candidates(_key(1, 64, 64, 4, 32, 0, torch.float32)) if c.get("kernel") == "mma"]
    assert t.candidates(_key(1, 64, 64, 2, 32, 2, torch.float16)) == [{}, {"mma": False}]
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not [c for c in t.candidates(key) if c.get("kernel") == "mma"]
    assert t.examples(None) == [] or torch.cuda.is_available()
