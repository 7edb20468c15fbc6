"""The native CUDA/HIP backend of qmatmul (csrc/qgemm/qgemm.cu) against the float64 oracle; GPU only.
Without a GPU: the module reports a clean error (its .cu build for sm_90/gfx90a is checked by
tests/test_gpu_build.py)."""
import pytest
import torch

import pykernels


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
    # fp32 activation codes on the GPU can differ from the CPU's fp64 rounding at exact ties: allow one
    # code step of one element (sa * max|w|) on top of the fp32 recombination error
    sa = (x.amax(1) - x.amin(1)) / (2 ** p - 1)
    step = sa[:, None] * qw.dequantize().abs().amax(1)[None]
    assert ((yg - yc).abs() <= 1e-5 * scale + 2 * step + 1e-4).all()
