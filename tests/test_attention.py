"""flash_attention on CPU against a float64 math oracle: forward, LSE, gradients (q, k, v, and through
the LSE), bottom-right causal for S_q != S_k, GQA/MQA, every dtype, odd/empty shapes, adversarial data,
errors, torch.library/torch.compile. Triton kernels: tests/test_attention_triton.py."""
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import pykernels
from pykernels import flash_attention
from pykernels.attention import _cpu, _forward_impl, _backward_impl

TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


# ---------------------------------------------------------------------------------------------
# The oracle: plain softmax attention in float64, bottom-right causal mask, rows with no visible key
# give out 0 / lse -inf. Differentiable (autograd gives the reference gradients).
# ---------------------------------------------------------------------------------------------
def reference(q, k, v, causal=False, scale=None):
    q, k, v = q.double(), k.double(), v.double()
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    g = q.shape[1] // max(1, k.shape[1])
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    Sq, Sk = s.shape[-2:]
    if causal:
        mask = torch.arange(Sk, device=s.device)[None, :] > torch.arange(Sq, device=s.device)[:, None] + (Sk - Sq)
        s = s.masked_fill(mask, -math.inf)
    lse = torch.logsumexp(s, -1) if Sk > 0 else s.new_full(s.shape[:-1], -math.inf)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe.unsqueeze(-1))
    return p @ v, lse


def make(B, H, Hkv, Sq, Sk, D, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, Sq, D, generator=g, dtype=torch.float64) * scale).to(dtype)
    k = (torch.randn(B, Hkv, Sk, D, generator=g, dtype=torch.float64) * scale).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def assert_close(got, want, dtype, what, tol=1.0):
    got, want = got.double().cpu(), want.double().cpu()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin), f"{what}: finite pattern differs"
    assert torch.equal(got[~fin], want[~fin]), f"{what}: non-finite values differ"
    if fin.any():
        err = (got[fin] - want[fin]).abs().max().item()
        ref = max(1.0, want[fin].abs().max().item())
        assert err <= tol * TOL[dtype] * ref, f"{what}: max abs err {err:.3g} (scale {ref:.3g}) > {tol * TOL[dtype]}"


def check_forward_and_grads(q, k, v, causal, scale=None, config=None, backend="cpu", check_grads=True, tol=1.0):
    dtype = q.dtype
    ro, rl = reference(q, k, v, causal, scale)
    if config is None:
        out, lse = flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True, backend=backend)
    else:
        sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        out, lse = _forward_impl(q, k, v, causal, sc, backend, config, inference=True)
    assert out.dtype == dtype and out.shape == ro.shape
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close(out, ro, dtype, "out", tol)
    assert_close(lse, rl, torch.float32 if dtype != torch.float64 else dtype, "lse", tol)
    if not check_grads:
        return
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(ro.shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=q.device)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    o_ref, _ = reference(qr, kr, vr, causal, scale)
    rdq, rdk, rdv = torch.autograd.grad(o_ref, (qr, kr, vr), dout.double(), allow_unused=True)
    if config is None:
        qa, ka, va = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = flash_attention(qa, ka, va, causal=causal, scale=scale, backend=backend)
        dq, dk, dv = torch.autograd.grad(o, (qa, ka, va), dout)
    else:
        sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        dq, dk, dv = _backward_impl(dout, None, q, k, v, out, lse, causal, sc, backend, config)
    gtol = {torch.float64: torch.float64, torch.float32: torch.float32}.get(dtype, dtype)
    for name, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        want = torch.zeros_like(got, dtype=torch.float64) if want is None else want
        assert got.dtype == dtype, name
        assert_close(got, want, gtol, name, tol)


# (B, H, Hkv, S_q, S_k, D): S_q != S_k both ways, S = 1, GQA/MQA, D not a power of two, not a
# multiple of 8, and larger than aten's vector width.
SHAPES = [
    (2, 4, 2, 5, 9, 24),
    (1, 3, 3, 9, 5, 40),
    (2, 2, 1, 1, 1, 8),
    (1, 2, 2, 1, 7, 32),
    (1, 2, 2, 7, 1, 32),
    (1, 4, 1, 17, 17, 96),
    (1, 1, 1, 33, 70, 7),
    (1, 2, 1, 70, 33, 130),
    (3, 1, 1, 64, 64, 64),
]
IMPLS = [None, {"impl": "flash"}, {"impl": "blocked", "chunk_elems": 64}, {"impl": "blocked"},
         {"impl": "decode", "grain": 1}, {"impl": "fma", "threads": 3}]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("impl", IMPLS, ids=["public", "flash", "blocked-small", "blocked", "decode", "fma"])
def test_matches_float64_oracle_fp32(shape, causal, impl):
    q, k, v = make(*shape, torch.float32, seed=sum(shape))
    check_forward_and_grads(q, k, v, causal, config=impl)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(2, 4, 2, 5, 9, 24), (1, 2, 1, 70, 33, 130), (1, 4, 4, 16, 16, 64)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("impl", [None, {"impl": "blocked", "chunk_elems": 64}, {"impl": "decode", "grain": 1},
                                  {"impl": "bf16dot"}, {"impl": "fma"}], ids=["public", "blocked", "decode", "bf16dot",
                                                                              "fma"])
def test_matches_float64_oracle_other_dtypes(dtype, shape, causal, impl):
    q, k, v = make(*shape, dtype, seed=3)
    check_forward_and_grads(q, k, v, causal, config=impl)


@pytest.mark.parametrize("causal", [False, True])
def test_explicit_scale(causal):
    q, k, v = make(1, 2, 1, 6, 11, 16, torch.float32)
    check_forward_and_grads(q, k, v, causal, scale=0.77)
    check_forward_and_grads(q, k, v, causal, scale=-0.2)


def test_causal_is_bottom_right_aligned():
    """S_q < S_k: the last query sees every key; S_q > S_k: the first S_q - S_k queries see none."""
    q, k, v = make(1, 1, 1, 3, 8, 16, torch.float32)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    full = flash_attention(q, k, v, causal=False)
    torch.testing.assert_close(out[:, :, -1], full[:, :, -1])
    # row 0 sees keys 0..5: same as full attention over the first 6 keys
    torch.testing.assert_close(out[:, :, 0], flash_attention(q[:, :, :1], k[:, :, :6], v[:, :, :6])[:, :, 0])
    q2, k2, v2 = make(1, 1, 1, 8, 3, 16, torch.float32)
    out2, lse2 = flash_attention(q2, k2, v2, causal=True, return_lse=True)
    assert torch.equal(out2[:, :, :5], torch.zeros_like(out2[:, :, :5]))
    assert torch.isneginf(lse2[:, :, :5]).all() and torch.isfinite(lse2[:, :, 5:]).all()
    # the last S_k queries form an ordinary square causal block
    torch.testing.assert_close(out2[:, :, 5:], torch.nn.functional.scaled_dot_product_attention(
        q2[:, :, 5:], k2, v2, is_causal=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Sk", [1, 2, 77])
def test_decode_step_causal_sees_every_key(Sk, dtype):
    """One query row (a decode step): bottom-right causal lets it see all S_k keys, so the CPU path runs
    aten's kernel without a mask; out, lse and gradients as the oracle's, and as the non-causal call."""
    q, k, v = make(2, 4, 2, 1, Sk, 32, dtype, seed=Sk)
    check_forward_and_grads(q, k, v, True)
    out_c, lse_c = flash_attention(q, k, v, causal=True, return_lse=True)
    out_n, lse_n = flash_attention(q, k, v, causal=False, return_lse=True)
    assert torch.equal(out_c, out_n) and torch.equal(lse_c, lse_n)


def test_rows_without_keys_have_zero_output_and_gradient():
    q, k, v = (t.requires_grad_() for t in make(2, 2, 1, 9, 4, 16, torch.float32))
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    assert torch.isneginf(lse[:, :, :5]).all()
    (out.sum() + lse[:, :, 5:].sum()).backward()
    assert torch.equal(q.grad[:, :, :5], torch.zeros_like(q.grad[:, :, :5]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("shape", [(0, 2, 2, 4, 4, 16), (2, 0, 0, 4, 4, 16), (1, 2, 2, 0, 5, 16),
                                   (1, 2, 1, 3, 0, 16), (1, 2, 2, 0, 0, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_empty_shapes(shape, causal):
    q, k, v = make(*shape, torch.float32)
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    check_forward_and_grads(q, k, v, causal)


def test_lse_gradient_flows_through_both_outputs():
    """A loss that uses lse (as ring attention's merge does) gets exact gradients."""
    q, k, v = make(1, 4, 2, 6, 10, 16, torch.float64)
    for causal in (False, True):
        def f(q_, k_, v_):
            o, l = flash_attention(q_, k_, v_, causal=causal, return_lse=True)
            return o, l
        small = [t[:, :, :3, :4].clone().requires_grad_() for t in (q, k, v)]
        assert torch.autograd.gradcheck(f, small, fast_mode=True)

        # and the float32 path against the oracle
        q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
        o, l = flash_attention(q32, k32, v32, causal=causal, return_lse=True)
        w = torch.linspace(-1, 1, l.numel()).view_as(l)
        (o.sum() + (w * l).sum()).backward()
        qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
        ro, rl = reference(qr, kr, vr, causal)
        (ro.sum() + (w.double() * rl).sum()).backward()
        for got, want in ((q32.grad, qr.grad), (k32.grad, kr.grad), (v32.grad, vr.grad)):
            assert_close(got, want, torch.float32, "grad")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 2, 1, 3, 5, 8), (1, 2, 2, 5, 3, 8), (2, 3, 1, 4, 4, 5)])
def test_gradcheck_float64(shape, causal):
    q, k, v = (t.requires_grad_() for t in make(*shape, torch.float64))
    assert torch.autograd.gradcheck(lambda a, b, c: flash_attention(a, b, c, causal=causal), (q, k, v),
                                    fast_mode=True)


def test_adversarial_values():
    # all-equal inputs: uniform attention, the mean of v
    q = torch.ones(1, 2, 5, 16)
    k = torch.ones(1, 2, 9, 16)
    v = torch.arange(9.0).view(1, 1, 9, 1).expand(1, 2, 9, 16).contiguous()
    out, lse = flash_attention(q, k, v, return_lse=True)
    torch.testing.assert_close(out, torch.full_like(out, 4.0))
    torch.testing.assert_close(lse, torch.full_like(lse, 16 / 4 + math.log(9)))
    # huge logits (1e4 range) stay finite and match the oracle (online softmax subtracts the max)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        qh, kh, vh = make(1, 2, 2, 12, 20, 16, dtype, seed=5, scale=15.0)
        check_forward_and_grads(qh, kh, vh, True, check_grads=dtype == torch.float32)
    # sorted and reversed keys, duplicates, -0.0
    qs, ks, vs = make(1, 1, 1, 8, 8, 16, torch.float32)
    ks = torch.sort(ks, dim=2).values
    vs[..., ::2, :] = -0.0
    check_forward_and_grads(qs, ks.flip(2).contiguous(), vs, True)
    # dtype extremes: fp16 values near the top of the range do not overflow the fp32 accumulators
    q16 = torch.full((1, 1, 4, 8), 200.0, dtype=torch.float16)
    v16 = torch.full((1, 1, 6, 8), 60000.0, dtype=torch.float16)
    out16 = flash_attention(q16, q16[:, :, :1].expand(1, 1, 6, 8), v16)
    assert torch.equal(out16, v16[:, :, :4])


def test_nan_stays_in_its_row():
    q, k, v = make(1, 1, 1, 6, 6, 8, torch.float32)
    q[0, 0, 2, 3] = float("nan")
    out, lse = flash_attention(q, k, v, return_lse=True)
    assert torch.isnan(out[0, 0, 2]).all() and torch.isnan(lse[0, 0, 2])
    rows = [0, 1, 3, 4, 5]
    assert torch.isfinite(out[0, 0, rows]).all()


@pytest.mark.parametrize("impl", [None, {"impl": "blocked", "chunk_elems": 64}, {"impl": "decode"}],
                         ids=["public", "blocked", "decode"])
def test_row_with_an_inf_score_is_nan_as_sdpa(impl):
    """A score of +inf (an inf in q or k) makes the row NaN, as SDPA: an output is a convex combination of
    v rows, so +-inf is never right (review finding: the blocked path's guard for rows without keys also
    caught lse = +inf and returned [inf, -inf])."""
    q = torch.tensor([[[[1.0, 0.5], [float("-inf"), 0.0]]]])
    k = torch.tensor([[[[0.3, -1.0], [-0.7, 0.2]]]])       # key 1, column 0 negative: score +inf
    v = torch.tensor([[[[1.0, 2.0], [3.0, -4.0]]]])
    if impl is None:
        out = flash_attention(q, k, v)
    else:
        out, _ = _forward_impl(q, k, v, False, 1 / math.sqrt(2), "cpu", impl, inference=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.isnan(ref[0, 0, 1]).all() and torch.isnan(out[0, 0, 1]).all()
    torch.testing.assert_close(out[0, 0, 0], ref[0, 0, 0])


def test_inputs_unmodified_non_contiguous_and_numpy():
    base = torch.randn(2, 7, 4, 24)          # [B, S, H, D] -> transposed views
    q = base.transpose(1, 2)
    k = torch.randn(2, 11, 2, 24).transpose(1, 2)
    v = torch.randn(2, 24, 11, 2).permute(0, 3, 2, 1)
    assert not q.is_contiguous() and not v.is_contiguous()
    snap = [t.clone() for t in (q, k, v)]
    check_forward_and_grads(q, k, v, True)
    for t, s in zip((q, k, v), snap):
        assert torch.equal(t, s)
    out = flash_attention(q.numpy(), k.contiguous().numpy(), v.contiguous().numpy(), causal=True)
    torch.testing.assert_close(out, flash_attention(q, k, v, causal=True))
    assert isinstance(out, torch.Tensor) and isinstance(np.asarray(out), np.ndarray)


def test_untraced_calls_skip_the_op_dispatch():
    """Where nothing is traced or differentiated (grad mode off, or no input requiring grad) the forward,
    the backward and ring attention's block kernels run the implementation directly: through the
    registered op the first call of a process imported torch._dynamo (~1.2 s; ring attention's first
    call). A fresh interpreter must get the same results as autograd without importing it."""
    import subprocess
    import sys

    code = (
        "import sys, torch, pykernels\n"
        "from collectives._attention_block import _fwd_impl\n"
        "from pykernels.attention import flash_attention_backward\n"
        "g = torch.Generator().manual_seed(0)\n"
        "q, k, v = (torch.randn(1, 2, 24, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))\n"
        "with torch.no_grad():\n"
        "    out, lse = pykernels.flash_attention(q, k, v, causal=True, return_lse=True)\n"
        "    o2, l2 = _fwd_impl(q, k, v, 8 ** -0.5, True)\n"
        "    do = torch.randn(out.shape, generator=g, dtype=torch.float64)\n"
        "    dq, dk, dv = flash_attention_backward(do, q, k, v, out, lse, causal=True)\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
        "assert torch.allclose(out, o2, atol=1e-12) and torch.allclose(lse, l2, atol=1e-12)\n"
        "ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "ref.backward(do)\n"
        "for a, b in ((out, ref), (dq, q.grad), (dk, k.grad), (dv, v.grad)):\n"
        "    assert torch.allclose(a, b, atol=1e-10), (a - b).abs().max()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_autograd_gradients_keep_the_kernels_layout():
    """autograd's backward takes dq, dk, dv as aten's kernel wrote them ([B, S, H, D] in memory), not
    copied to contiguous (three copies were ~2% of a 1024-token fp32 step; SDPA copies none): the leaves'
    grads match SDPA's, and flash_attention_backward, which promises nothing more, still returns contiguous
    ones as the registered op does."""
    from pykernels.attention import flash_attention_backward

    q, k, v = make(1, 4, 2, 67, 67, 32, torch.float32, seed=4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(1, 4, 67, 32, generator=torch.Generator().manual_seed(5))
    flash_attention(*leaves, causal=True).backward(dout)
    torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True).backward(dout)
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    assert all(t.is_contiguous() for t in flash_attention_backward(dout, q, k, v, out, lse, causal=True))


def test_errors_name_the_op_and_argument():
    q, k, v = make(1, 4, 2, 3, 5, 8, torch.float32)
    with pytest.raises(TypeError, match="pykernels.flash_attention: expected 'q' of dtype"):
        flash_attention(q.int(), k, v)
    with pytest.raises(TypeError, match="one dtype"):
        flash_attention(q, k.double(), v)
    with pytest.raises(ValueError, match="'k' with 4 dimensions"):
        flash_attention(q, k[0], v)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        flash_attention(q, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8))
    with pytest.raises(ValueError, match="same head dim"):
        flash_attention(q, k, torch.randn(1, 2, 5, 16))
    with pytest.raises(ValueError, match="same \\[B, Hkv, S_k\\]"):
        flash_attention(q, k, torch.randn(1, 2, 6, 8))
    with pytest.raises(ValueError, match="batch size"):
        flash_attention(q, torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8))
    with pytest.raises(ValueError, match="expected backend"):
        flash_attention(q, k, v, backend="gpu")
    with pytest.raises(ValueError, match="scale"):
        flash_attention(q, k, v, scale=float("nan"))
    with pytest.raises(RuntimeError, match="pykernels.flash_attention: backend 'cuda'"):
        flash_attention(q, k, v, backend="cuda")
    with pytest.raises(RuntimeError, match="one device"):
        flash_attention(q, k.to("meta"), v)
    with pytest.raises(TypeError, match="'q'"):
        flash_attention([1, 2], k, v)


def test_flags_and_scale_are_type_checked():
    """causal="no" must not silently run causal (bool("no") is True), scale=True is not a scale."""
    import numpy as np

    from pykernels.attention import flash_attention_backward

    q, k, v = make(1, 4, 2, 3, 5, 8, torch.float32)
    for bad in ("no", 1, None, torch.tensor(True)):
        with pytest.raises(TypeError, match="^pykernels.flash_attention: expected 'causal' to be a bool"):
            flash_attention(q, k, v, causal=bad)
        with pytest.raises(TypeError, match="^pykernels.flash_attention: expected 'return_lse' to be a bool"):
            flash_attention(q, k, v, return_lse=bad)
    for bad in (True, "0.5", 1j, torch.tensor(0.5)):
        with pytest.raises(TypeError, match="^pykernels.flash_attention: expected 'scale' to be a real number"):
            flash_attention(q, k, v, scale=bad)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    # the backward's errors name it (review finding: its q/k/v/scale/causal errors named flash_attention)
    dout = torch.ones_like(out)
    with pytest.raises(TypeError, match="^pykernels.flash_attention_backward: expected 'causal' to be a bool"):
        flash_attention_backward(dout, q, k, v, out, lse, causal="yes")
    with pytest.raises(ValueError, match="^pykernels.flash_attention_backward: expected 'scale' to be a finite"):
        flash_attention_backward(dout, q, k, v, out, lse, scale=float("nan"))
    with pytest.raises(TypeError, match="^pykernels.flash_attention_backward: expected 'k' of dtype"):
        flash_attention_backward(dout, q, k.int(), v, out, lse)
    with pytest.raises(ValueError, match="^pykernels.flash_attention_backward: expected the query heads"):
        flash_attention_backward(dout, q, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8), out, lse)
    with pytest.raises(ValueError, match="^pykernels.flash_attention_backward: expected backend"):
        flash_attention_backward(dout, q, k, v, out, lse, backend="gpu")
    with pytest.raises(ValueError, match="^pykernels.flash_attention_backward: expected the query heads"):
        torch.ops.pykernels.flash_attention_backward(dout, None, q, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8),
                                                     out, lse, True, 0.5, "auto")
    for low in (torch.float16, torch.bfloat16):  # an lse of 3 significant digits was taken as is
        with pytest.raises(TypeError, match="expected a float32 'lse'"):
            flash_attention_backward(torch.ones_like(out), q, k, v, out, lse.to(low), causal=True)
    # real numbers of any Python/numpy type and numpy booleans still work
    ref = flash_attention(q, k, v, causal=True, scale=0.5)
    torch.testing.assert_close(flash_attention(q, k, v, causal=np.bool_(True), scale=np.float32(0.5)), ref)
    torch.testing.assert_close(flash_attention(q, k, v, causal=True, scale=1) * 1.0,
                               flash_attention(q, k, v, causal=True, scale=1.0))


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from pykernels import _backend

    _backend._triton_status.cache_clear()
    q, k, v = make(1, 1, 1, 3, 3, 16, torch.float32)
    with pytest.raises(RuntimeError, match="pykernels.flash_attention: backend 'triton'"):
        flash_attention(q, k, v, backend="triton")
    _backend._triton_status.cache_clear()


def test_registered_with_torch_library_opcheck():
    q, k, v = make(1, 4, 2, 5, 7, 16, torch.float32)
    q.requires_grad_()
    op = torch.ops.pykernels.flash_attention
    torch.library.opcheck(op, (q, k, v, True, 0.25, "cpu"))
    torch.library.opcheck(op, (q.detach(), k, v, False, 0.25, "auto"))


def test_torch_compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()

    def f(q, k, v):
        o, lse = pykernels.flash_attention(q, k, v, causal=True, return_lse=True)
        return (o * 2).sum() + lse.sum()

    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    q, k, v = make(1, 4, 2, 6, 9, 16, torch.float32)
    args = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_args = [t.clone().requires_grad_() for t in (q, k, v)]
    y = cf(*args)
    y.backward()
    y_ref = f(*ref_args)
    y_ref.backward()
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(args, ref_args):
        torch.testing.assert_close(a.grad, b.grad)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), Hkv=st.integers(1, 3), g=st.integers(1, 3), Sq=st.integers(1, 40),
       Sk=st.integers(1, 40), D=st.integers(1, 48), causal=st.booleans(),
       impl=st.sampled_from(["flash", "blocked", "decode", "bf16dot", "fma"]), seed=st.integers(0, 1000))
def test_hypothesis_shapes(B, Hkv, g, Sq, Sk, D, causal, impl, seed):
    q, k, v = make(B, Hkv * g, Hkv, Sq, Sk, D, torch.float32, seed=seed)
    check_forward_and_grads(q, k, v, causal, config={"impl": impl, "chunk_elems": 256, "grain": 1 << (seed % 20)})


def test_autotune_cpu_picks_a_candidate(tmp_cache):
    import pykernels.autotune as at

    q, k, v = make(1, 2, 2, 64, 64, 32, torch.float32)
    cfg = at.tune("flash_attention", q, k, v, causal=True, budget_s=0.05)
    fma = ("fma",) if _cpu.fma_available() else ()
    assert cfg["impl"] in ("flash", "blocked") + fma
    # a decode step: the native decode kernel is a candidate (and the default)
    qd = q[:, :, :1].contiguous()
    assert at.config_for("flash_attention", "cpu", pykernels.attention.problem_key(qd, k), "cpu")["impl"] == "decode"
    cfg_d = at.tune("flash_attention", qd, k, v, causal=True, budget_s=0.05)
    assert cfg_d["impl"] in ("flash", "blocked", "decode") + fma
    assert at.cache_file().exists()
    tunables = [t for t in at.registered("attention") if t.backend == "cpu"]
    assert {t.op for t in tunables} == {"flash_attention", "flash_attention_backward"}
    # `generate` tunes a decode step too (the decode kernel's grain)
    fwd = next(t for t in tunables if t.op == "flash_attention")
    decode_examples = [e for e in fwd.examples([64]) if e[0][0].shape[2] == 1]
    assert decode_examples and decode_examples[0][0][1].shape[1] < decode_examples[0][0][0].shape[1]  # GQA
    # the backward tunable runs on its own examples
    bwd = next(t for t in tunables if t.op == "flash_attention_backward")
    (args, kwargs), = [e for e in bwd.examples([32]) if e[1]["causal"]][:1]
    cfg_b = at.tune("flash_attention_backward", *args, budget_s=0.05, **kwargs)
    fma_bwd = ("fma",) if _cpu.fma_takes(args[1]) else ()
    assert cfg_b["impl"] in ("flash", "blocked") + fma_bwd
    # and bfloat16 examples, forward and backward, whose candidates include the bf16dot kernels (and the
    # forward's the fma kernel)
    native = ("bf16dot",) if _cpu.bf16dot_available() else ()
    for tunable in (fwd, bwd):
        (args, kwargs), = [e for e in tunable.examples([64]) if e[0][1].dtype == torch.bfloat16][:1]
        cfg_bf = at.tune(tunable.op, *args, budget_s=0.05, **kwargs)
        assert cfg_bf["impl"] in ("flash", "blocked") + native + (fma if tunable is fwd else ())


def test_autotune_takes_every_keyword_the_ops_take(tmp_cache):
    """tune() on the arguments of a call as a user writes it: return_lse for the forward, dlse for the
    backward (a TypeError from the tunable's check before; review finding); the op's results afterwards
    are those of the untuned op."""
    import pykernels.autotune as at
    from pykernels.attention import flash_attention, flash_attention_backward

    q, k, v = make(1, 4, 2, 24, 40, 16, torch.float32, seed=3)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    want_b = flash_attention_backward(dout, q, k, v, out, lse, causal=True, dlse=dlse)
    assert at.tune("flash_attention", q, k, v, causal=True, return_lse=True, budget_s=0.02)["impl"]
    assert at.tune("flash_attention_backward", dout, q, k, v, out, lse, causal=True, dlse=dlse, budget_s=0.02)["impl"]
    got_o, got_l = flash_attention(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(got_o, out)
    torch.testing.assert_close(got_l, lse)
    for g, w in zip(flash_attention_backward(dout, q, k, v, out, lse, causal=True, dlse=dlse), want_b):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("impl", ["flash", "blocked"])
def test_backward_per_key_block_with_global_out_and_lse(impl):
    """Ring attention's use: split the keys into blocks, call the backward per block with the global
    out/lse; dk/dv concatenate and dq sums to the full gradient (causal diagonal block included)."""
    from pykernels.attention import flash_attention_backward

    q, k, v = make(1, 4, 2, 12, 12, 16, torch.float32, seed=11)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    dout = torch.randn_like(out)
    full = flash_attention_backward(dout, q, k, v, out, lse, causal=True)
    # keys [0, 5) are visible to the rows [5, 12) without a mask; keys [5, 12) vs rows [5, 12) are the
    # square causal diagonal block (rows [0, 5) handled with their own diagonal block of keys [0, 5)).
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    pieces = [((0, 5), (0, 5), True), ((5, 12), (0, 5), False), ((5, 12), (5, 12), True)]
    for (r0, r1), (c0, c1), causal in pieces:
        args = (dout[:, :, r0:r1], q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1], out[:, :, r0:r1],
                lse[:, :, r0:r1])
        if impl == "flash":
            g = flash_attention_backward(*args, causal=causal)
        else:
            g = _backward_impl(args[0], None, *args[1:], causal, 0.25, "cpu", {"impl": "blocked"})
        dq[:, :, r0:r1] += g[0]
        dk[:, :, c0:c1] += g[1]
        dv[:, :, c0:c1] += g[2]
    for a, b in zip((dq, dk, dv), full):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="'lse' of shape"):
        flash_attention_backward(dout, q, k, v, out, lse[:, :, 1:])


@pytest.mark.parametrize("shape", [(1, 4, 2, 5, 9, 24), (2, 6, 2, 9, 5, 16), (1, 3, 1, 8, 8, 8)])
def test_gqa_expansion_fallback(monkeypatch, shape):
    """If aten's kernels ever stop grouping K/V heads as we do, the wrapper expands them instead."""
    from pykernels.attention import _cpu

    assert _cpu.aten_handles_gqa() in (True, False)
    monkeypatch.setattr(_cpu, "aten_handles_gqa", lambda: False)
    q, k, v = make(*shape, torch.float32, seed=9)
    for causal in (False, True):
        check_forward_and_grads(q, k, v, causal)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("shape, causal", [((1, 4, 2, 70, 70, 64), True), ((2, 2, 2, 33, 90, 40), True),
                                           ((1, 3, 1, 48, 20, 32), False)])
def test_bf16_aten_backward_through_fp32_without_a_bf16_dot_product(native, shape, causal, monkeypatch):
    """aten's bf16 backward (6-13x slower than fp32 where the CPU has no AVX512-BF16, as oneDNN's bf16
    GEMMs convert on the way) runs on fp32 copies there: the same answer as the fp32 call rounded once,
    and at least as close to the float64 gradient; where the CPU multiplies bf16 natively it stays bf16."""
    from pykernels import _native

    monkeypatch.setattr(_native, "torch_bf16_gemm_native", lambda: native)
    q, k, v = make(*shape, torch.bfloat16, seed=3)
    scale = shape[-1] ** -0.5
    out, lse = _cpu.flash_forward(q, k, v, causal, scale)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).bfloat16()
    got = _cpu.flash_backward(dout, q, k, v, out, lse, causal, scale)
    via_fp32 = [g.bfloat16() for g in _cpu.flash_backward(dout.float(), q.float(), k.float(), v.float(),
                                                           out.float(), lse, causal, scale)]
    if not native:
        assert all(torch.equal(a, b) for a, b in zip(got, via_fp32))
        return
    assert not all(torch.equal(a, b) for a, b in zip(got, via_fp32))  # aten's bf16 kernel (P, dS in bf16)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    o64, _ = reference(q64, k64, v64, causal, scale)
    exact = torch.autograd.grad(o64, (q64, k64, v64), dout.double())
    for bf16, fp32, want in zip(got, via_fp32, exact):
        assert (fp32.double() - want).abs().max() <= (bf16.double() - want).abs().max() * 1.05 + 1e-3


def test_torch_compile_dynamic_shapes_and_partial_grads():
    torch._dynamo.reset()

    def f(q, k, v):
        o, lse = pykernels.flash_attention(q, k, v, causal=True, return_lse=True)
        return o.sum() + lse.sum()

    cf = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for S in (7, 13):
        q, k, v = (t.requires_grad_() for t in make(1, 4, 2, S, S + 3, 16, torch.float32, seed=S))
        y = cf(q, k, v)
        y.backward()
        got = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        y_ref = f(q, k, v)
        y_ref.backward()
        torch.testing.assert_close(y, y_ref)
        for a, t in zip(got, (q, k, v)):
            torch.testing.assert_close(a, t.grad)
    # only q requires grad: k and v get none, q's gradient is right
    q, k, v = make(1, 4, 2, 9, 9, 16, torch.float32)
    q.requires_grad_()
    flash_attention(q, k, v, causal=True).sum().backward()
    assert k.grad is None and v.grad is None
    qr = q.detach().double().requires_grad_()
    reference(qr, k, v, True)[0].sum().backward()
    assert_close(q.grad, qr.grad, torch.float32, "dq")


@pytest.mark.parametrize("shape", [(2, 4, 2, 5, 9, 24), (1, 1, 1, 33, 70, 7), (1, 2, 2, 1, 7, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rectangular_causal_split_path(monkeypatch, shape, dtype):
    """S_q < S_k causal without the explicit mask (too large): prefix + square block, merged by LSE."""
    from pykernels.attention import _cpu

    monkeypatch.setattr(_cpu, "MASK_BYTES", 0)
    assert _cpu._bottom_right_mask(5, 9, torch.float32) is None
    q, k, v = make(*shape, dtype, seed=13)
    check_forward_and_grads(q, k, v, True)


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (0, 2, 1, 3), (2, 0, 1, 3)])
@pytest.mark.parametrize("shape,sk,causal", [((2, 4, 64, 16), 64, False), ((1, 1, 32, 8), 32, True),
                                             ((2, 1, 16, 8), 40, True), ((1, 3, 24, 8), 8, True)])
def test_cpu_out_follows_q_layout_and_fake_strides_match(order, shape, sk, causal):
    """out comes back in q's memory order, as from aten's kernels and SDPA (no copy for a contiguous
    q or a model's [B, S, H, D]-strided one), whatever path made it (masked, split, dead rows), and
    the fake op reports exactly those strides (torch.compile relies on it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.Generator().manual_seed(0)
    B, H, Sq, D = shape
    phys = [shape[i] for i in order]
    q = torch.randn(phys, generator=g).permute([order.index(i) for i in range(4)])
    k, v = torch.randn(B, H, sk, D, generator=g), torch.randn(B, H, sk, D, generator=g)
    out, lse = pykernels.flash_attention(q, k, v, causal=causal, return_lse=True, backend="cpu")
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fo, fl = torch.ops.pykernels.flash_attention(fq, fk, fv, causal, 1.0 / D ** 0.5, "cpu")
    assert out.stride() == fo.stride() and lse.stride() == fl.stride(), (out.stride(), fo.stride())
    if 1 not in shape[:3]:
        assert out.stride() == torch.empty_like(q).stride()  # q's own layout: aten wrote it, no copy
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(),
        attn_mask=None if not causal else torch.ones(Sq, sk, dtype=torch.bool).tril(sk - Sq))
    live = slice(max(0, Sq - sk), Sq) if causal else slice(0, Sq)
    torch.testing.assert_close(out[:, :, live].double(), ref[:, :, live], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("sq,sk", [(64, 64), (32, 256), (4096, 8192), (128, 32)])
@pytest.mark.parametrize("causal", [False, True])
def test_nan_query_row_is_caught_on_every_cpu_path(sq, sk, causal):
    """aten zeroes a NaN query row (out 0, lse exactly 0): the CPU path reads q only when some lse is
    exactly 0, except after the split + merge of a large rectangular causal problem (4096 x 8192),
    where the merged lse is log 2 and q is always read. Either way the row comes back NaN."""
    g = torch.Generator().manual_seed(sq)
    q = torch.randn(1, 1, sq, 16, generator=g)
    k, v = torch.randn(1, 1, sk, 16, generator=g), torch.randn(1, 1, sk, 16, generator=g)
    q[0, 0, sq - 1, 3] = float("nan")
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True, backend="cpu")
    assert torch.isnan(out[0, 0, sq - 1]).all() and torch.isnan(lse[0, 0, sq - 1])
    assert torch.isfinite(out[0, 0, : sq - 1]).all()


@pytest.mark.parametrize("sq,sk,causal", [(40, 40, False), (32, 256, True), (4096, 8192, True)])
def test_rows_of_all_minus_inf_scores_get_lse_minus_inf(sq, sk, causal):
    """A row whose every score is -inf (-inf in k against a positive q; finite bf16 inputs whose fp32
    scores overflow) has lse = log(0) = -inf and out 0, as the blocked/decode/Triton paths and the
    float64 math: aten's kernels gave lse 0 (audit finding), which an LSE merge of key blocks (ring
    attention) weighs as a block of total weight 1. 4096 x 8192 causal: aten splits and merges, where
    the bad lse came out as log 2. Other heads stay exact."""
    g = torch.Generator().manual_seed(sk)
    q = torch.rand(1, 2, sq, 8, generator=g) + 0.1
    k, v = torch.randn(1, 2, sk, 8, generator=g), torch.randn(1, 2, sk, 8, generator=g)
    k[0, 0, :, 0] = float("-inf")                      # head 0: every score is -inf
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True, backend="cpu")
    live = slice(max(0, sq - sk), sq) if causal else slice(0, sq)
    assert torch.isneginf(lse[0, 0]).all() and torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    mask = None if not causal else torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, 1:].double(), k[:, 1:].double(), v[:, 1:].double(),
                                                           attn_mask=mask)
    torch.testing.assert_close(out[:, 1:, live].double(), ref[:, :, live], atol=2e-5, rtol=1e-4)
    # finite inputs, scores beyond fp32 (bf16 holds 1e20): -inf in fp32 arithmetic, so -inf here too
    qb = ((torch.rand(1, 1, 40, 8, generator=g) + 0.1) * 1e20).bfloat16()
    kb = (-(torch.rand(1, 1, 40, 8, generator=g) + 0.1) * 1e20).bfloat16()
    _, lb = flash_attention(qb, kb, v[:, :1, :40].bfloat16(), return_lse=True, backend="cpu")
    assert torch.isneginf(lb).all()
    # one key with a score of exactly 0 (a legitimate lse of 0) is recomputed and stays 0
    _, l0 = flash_attention(torch.zeros(1, 1, 3, 8), torch.ones(1, 1, 1, 8), torch.ones(1, 1, 1, 8),
                            return_lse=True, backend="cpu")
    assert torch.equal(l0, torch.zeros_like(l0))


def test_rows_with_an_lse_of_exactly_zero_are_recomputed_alone(monkeypatch):
    """A zero key at position 0 of a causal problem gives row 0 an lse of exactly 0 (a zero-padded
    position: ordinary input): only those rows are recomputed (_cpu.patch_rows), not the whole call on
    the blocked path (8x slower; review finding), and they come out exact."""
    calls = []
    real = _cpu.blocked_forward

    def counting(q, *a, **kw):
        calls.append(q.shape[2])
        return real(q, *a, **kw)

    monkeypatch.setattr(_cpu, "blocked_forward", counting)
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 3, 64, 16, generator=g) for _ in range(3))
    k[:, :, 0] = 0.0
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True, backend="cpu")
    assert calls == [], calls                          # the blocked path never ran
    assert torch.equal(lse[:, :, 0], torch.zeros(2, 3)) and torch.equal(out[:, :, 0], v[:, :, 0])
    ro, rl = reference(q.double(), k.double(), v.double(), True)
    torch.testing.assert_close(out.double(), ro, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), rl, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_patched_rows_match_the_blocked_path_with_gqa(causal):
    """Rows patched after aten (NaN in q; a KV head whose keys are all -inf for a positive q column) in a
    batched GQA problem: the same out and lse as the blocked path computing the whole call."""
    g = torch.Generator().manual_seed(12)
    q = torch.rand(2, 4, 32, 16, generator=g) + 0.05
    k, v = torch.randn(2, 2, 32, 16, generator=g), torch.randn(2, 2, 32, 16, generator=g)
    q[0, 1, 5, 2] = float("nan")
    q[1, 3, 7, 0] = float("nan")
    k[1, 0, :, 0] = float("-inf")                      # batch 1, query heads 0 and 1: every score -inf
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True, backend="cpu")
    ro, rl = _forward_impl(q, k, v, causal, 0.25, "cpu", {"impl": "blocked"}, inference=True)
    torch.testing.assert_close(out, ro, atol=1e-6, rtol=1e-5, equal_nan=True)
    torch.testing.assert_close(lse, rl, atol=1e-6, rtol=1e-6, equal_nan=True)
    assert torch.isneginf(lse[1, :2]).all() and torch.isnan(lse[0, 1, 5]) and torch.isnan(out[1, 3, 7]).all()


def test_split_regime_rows_whose_prefix_scores_overflow():
    """A large rectangular causal problem, which aten computes as a prefix part and a causal part merged:
    finite bf16 inputs whose prefix scores overflow fp32 (-inf) gave that part lse 0 and out 0, which the
    merge weighed as 1 (out off by O(1), no zero or NaN left to see; review finding). Such rows are
    marked before the merge and recomputed: the prefix contributes nothing, as in fp32 arithmetic."""
    g = torch.Generator().manual_seed(6)
    sq, sk, d = 2048, 8192, 8                        # bf16 2048 x 8192: over MASK_BYTES, the split regime
    assert sq * sk * 2 > _cpu.MASK_BYTES
    q = torch.randn(1, 1, sq, d, generator=g)
    k, v = torch.randn(1, 1, sk, d, generator=g), torch.randn(1, 1, sk, d, generator=g)
    q[..., 0] = 1e20
    k[:, :, : sk - sq, 0] = -1e20                    # the prefix every row sees: scores -1e40 -> -inf
    k[:, :, sk - sq:, 0] = 0.0                       # the causal part: ordinary scores (an lse of a few)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True, backend="cpu")
    ob, lb = flash_attention(q, k[:, :, sk - sq:], v[:, :, sk - sq:], causal=True, return_lse=True, backend="cpu")
    torch.testing.assert_close(out.float(), ob.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, lb, atol=1e-3, rtol=1e-5)


def test_blocked_path_stays_accurate_at_large_logits():
    """The blocked path (a NaN anywhere in q sends the whole call there) normalizes by the row sum, not
    exp(s - lse): lse in fp32 carries ~|lse| * 6e-8 of rounding into every weight, at logits of ~1e4 a
    1.6e-4 error in out (audit finding); now as accurate as SDPA for every other row."""
    g = torch.Generator().manual_seed(5)
    q = torch.full((1, 2, 16, 8), 60.0)                # tied logits of 60 * 60 * 8 / sqrt(8) ~ 1e4
    k = torch.full((1, 2, 16, 8), 60.0)
    v = torch.randn(1, 2, 16, 8, generator=g)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    qn = q.clone()
    qn[0, 1, 3, 0] = float("nan")                      # another head's row: the call goes blocked
    for impl in ({"impl": "blocked", "chunk_elems": 64}, None):
        if impl is None:
            out = flash_attention(qn, k, v, backend="cpu")
        else:
            out, _ = _forward_impl(q, k, v, False, 1 / math.sqrt(8), "cpu", impl, inference=True)
        err = (out[0, 0].double() - ref[0, 0]).abs().max().item()
        assert err < 1e-6, err


def test_cpu_overlapping_and_broadcast_q():
    """A q whose rows overlap (as_strided) or are broadcast: aten would write out with the wrong strides,
    so such a q is copied first (the result matches SDPA)."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(20, generator=g)
    k, v = torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    for q in (base.as_strided((1, 2, 6, 8), (12, 6, 1, 1)), torch.randn(1, 1, 1, 8, generator=g).expand(1, 2, 6, 8)):
        out = flash_attention(q, k, v, backend="cpu")
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal,sq,sk", [(False, 4, 4), (True, 4, 4), (True, 3, 7), (False, 5, 3)])
def test_cpu_backward_with_strided_head_dim_or_overlapping_rows(causal, sq, sk):
    """A q whose head dim is not dense (a transposed view) or whose rows overlap, an out/dout with a
    strided head dim: aten's backward reads them as if dense, so they are laid out first (fuzz finding:
    dq/dk/dv were off by O(10))."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, sk, 8, generator=g), torch.randn(1, 2, sk, 8, generator=g)
    q_t = torch.randn(1, 2, 8, sq, generator=g).mT                       # stride(-1) == sq
    q_o = torch.randn(2 * sq + 8, generator=g).as_strided((1, 2, sq, 8), (2 * sq, sq, 1, 1))  # rows overlap
    dout = torch.randn(1, 2, 8, sq, generator=g).mT                      # strided head dim too

    def want(q):
        qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
        ro, _ = reference(qr, kr, vr, causal)
        return torch.autograd.grad(ro, (qr, kr, vr), dout.double())

    for q in (q_t, q_o):
        qa, ka, va = (t.detach().requires_grad_() for t in (q, k, v))   # detach keeps q's strides
        o = flash_attention(qa, ka, va, causal=causal, backend="cpu")
        got = torch.autograd.grad(o, (qa, ka, va), dout)
        for name, a, b in zip(("dq", "dk", "dv"), got, want(q)):
            torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=name)
    # the public backward entry, handed an out with a strided head dim (same values)
    out, lse = flash_attention(q_t, k, v, causal=causal, return_lse=True, backend="cpu")
    dq, dk, dv = pykernels.attention.flash_attention_backward(dout, q_t, k, v, out.mT.contiguous().mT, lse,
                                                             causal=causal)
    for name, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), want(q_t)):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("impl", [None, {"impl": "blocked", "chunk_elems": 64}, {"impl": "decode"}],
                         ids=["public", "blocked", "decode"])
def test_rows_without_keys_stay_zero_when_v_holds_nan(impl):
    """Rows that see no key give out 0 and dq 0 even when some v is NaN/inf (0 * NaN would be NaN);
    rows that do see the NaN are NaN, as in the oracle (fuzz finding)."""
    q, k, v = make(1, 2, 1, 6, 3, 8, torch.float32)
    v[0, 0, 2, 0] = float("nan")
    if impl is None:
        qa = q.clone().requires_grad_()
        out, lse = flash_attention(qa, k, v, causal=True, return_lse=True)
        out.sum().backward()
        dq = qa.grad
    else:
        out, lse = _forward_impl(q, k, v, True, 1 / math.sqrt(8), "cpu", impl, inference=True)
        dq, _, _ = _backward_impl(torch.ones_like(out), None, q, k, v, out, lse, True, 1 / math.sqrt(8), "cpu", impl)
    assert torch.isneginf(lse[:, :, :3]).all()
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert torch.equal(dq[:, :, :3], torch.zeros_like(dq[:, :, :3]))
    assert torch.isnan(out[:, :, 5]).any()


def test_sparse_inputs_and_out_of_range_scale_are_clear_errors():
    q, k, v = make(1, 1, 1, 4, 4, 8, torch.float32)
    with pytest.raises(ValueError, match=r"flash_attention: expected 'q' to be a dense"):
        flash_attention(q.to_sparse(), k, v)
    with pytest.raises(ValueError, match=r"flash_attention: expected 'scale' within float32's range"):
        flash_attention(q, k, v, scale=1e40)
    out = flash_attention(q.double(), k.double(), v.double(), scale=1e40)  # float64 computes in float64
    assert torch.isfinite(out).all()


def test_vmap_over_flash_attention(monkeypatch):
    """torch.func.vmap (and vmap of grad: per-sample gradients) folds the vmapped dim into the batch: one
    call of the forward and one of the backward kernels for the whole vmapped batch (torch's fallback
    called them once per sample, and refused a vmapped batch of 0), the same results as a loop; k/v not
    vmapped (in_dims None) serve every sample; GQA and causal as everywhere."""
    import pykernels.attention as A

    calls = {"fwd": 0, "bwd": 0}
    real_fwd, real_bwd = A._forward_impl, A._backward_impl

    def count(name, real):
        def wrapped(*a, **kw):
            calls[name] += 1
            return real(*a, **kw)
        return wrapped

    monkeypatch.setattr(A, "_forward_impl", count("fwd", real_fwd))
    monkeypatch.setattr(A, "_backward_impl", count("bwd", real_bwd))
    g = torch.Generator().manual_seed(2)
    N, B, H, Hkv, S, D = 3, 2, 4, 2, 9, 8
    q = torch.randn(N, B, H, S, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(N, B, Hkv, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    f = lambda a, b, c: flash_attention(a, b, c, causal=True)  # noqa: E731
    got = torch.func.vmap(f)(q, k, v)
    assert calls["fwd"] == 1
    want = torch.stack([f(q[i], k[i], v[i]) for i in range(N)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    got = torch.func.vmap(f, in_dims=(1, None, 0))(q.transpose(0, 1), k[0], v)
    torch.testing.assert_close(got, torch.stack([f(q[i], k[0], v[i]) for i in range(N)]), rtol=0, atol=1e-12)
    calls.update(fwd=0, bwd=0)
    loss = lambda a, b, c: flash_attention(a, b, c, causal=True).square().sum()  # noqa: E731
    grads = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert calls == {"fwd": 1, "bwd": 1}, calls
    for i in range(N):
        qi, ki, vi = (t[i].clone().requires_grad_() for t in (q, k, v))
        loss(qi, ki, vi).backward()
        for got_g, want_g in zip(grads, (qi.grad, ki.grad, vi.grad)):
            torch.testing.assert_close(got_g[i], want_g, rtol=0, atol=1e-12)
    assert torch.func.vmap(f)(q[:0], k[:0], v[:0]).shape == (0, B, H, S, D)


def test_lse_flags_native_and_numpy_agree():
    """_cpu.lse_flags (the check after aten's kernel that sends NaN/inf rows to the blocked path): the
    native scan of a dense LSE ([B, H, S] or aten's [B, S, H] memory order, float32/float64) and the
    numpy fallback for causal row ranges give the same (nonfinite, zero) flags as a direct test."""
    from pykernels.attention import _cpu

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        for special in (None, float("nan"), float("inf"), -float("inf"), 0.0, -0.0):
            for pos in (0, 7, 59):
                base = torch.randn(2, 5, 6, generator=g, dtype=dtype) + 10  # [B, S, H] memory, no zeros
                if special is not None:
                    base.view(-1)[pos] = special
                for lse in (base.transpose(1, 2), base.transpose(1, 2).contiguous()):
                    for first in (0, 1, 3):
                        rows = lse[:, :, first:]
                        want = (not bool(torch.isfinite(rows).all()), bool((rows == 0).any()))
                        assert _cpu.lse_flags(lse, first) == want, (dtype, special, pos, first)


def test_lean_call_path_matches_the_general_path_and_is_taken(monkeypatch):
    """A plain contiguous CPU call that aten runs in one kernel call (a decode step, non-causal, square
    causal) takes the lean path (_lean_cpu_forward); every other call the general one. Both give the same
    out and lse, bit for bit and with the same strides, and the lean path is not silently skipped."""
    import importlib

    pa = importlib.import_module("pykernels.attention")
    cases = [(1, 8, 8, 1, 128, 64, False), (1, 8, 8, 1, 128, 64, True), (2, 4, 2, 1, 33, 16, True),
             (1, 2, 2, 17, 17, 8, True), (2, 3, 3, 5, 9, 32, False), (1, 4, 1, 7, 7, 8, True)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for B, H, Hkv, Sq, Sk, D, causal in cases:
            q, k, v = make(B, H, Hkv, Sq, Sk, D, dtype, seed=Sq + Sk)
            for scale in (None, 0.3):
                what = f"{dtype} {(B, H, Hkv, Sq, Sk, D)} causal={causal} scale={scale}"
                lean = pa._lean_cpu_forward(q, k, v, causal, scale, "auto")
                assert lean is not None, what
                with monkeypatch.context() as m:
                    m.setattr(pa, "_lean_cpu_forward", lambda *a: None)
                    want = flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True)
                for got, ref in zip(lean, want):
                    assert got.stride() == ref.stride() and got.dtype == ref.dtype, what
                    assert torch.equal(got, ref), what
                ref_out, ref_lse = reference(q, k, v, causal, scale)
                assert_close(lean[0], ref_out, dtype, what)
    # the public call takes it (the general path's as_tensor never runs)
    q, k, v = make(1, 8, 8, 1, 64, 32, torch.float32)
    monkeypatch.setattr(pykernels._native, "as_tensor", lambda *a: pytest.fail("general path taken"))
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(flash_attention(q, k, v, backend="cpu"), out)
    monkeypatch.undo()
    # every other call: the general path, with its results and errors
    for args, kw in [((q, k, v), dict(scale=-0.5)), ((q, k, v), dict(scale=2)),
                     ((q.double(), k.double(), v.double()), {}),
                     # not contiguous, for aten's kernels (40 rows of D = 8: no native kernel takes them)
                     ((make(1, 2, 2, 1, 50, 8, torch.float32)[0].expand(1, 2, 40, 8),)
                      + make(1, 2, 2, 1, 50, 8, torch.float32)[1:], {}),
                     (make(1, 2, 2, 40, 50, 8, torch.float32), dict(causal=True))]:  # rectangular: 2 aten calls
        assert pa._lean_cpu_forward(*args, kw.get("causal", False), kw.get("scale"), "auto") is None
        got, got_lse = flash_attention(*args, return_lse=True, **kw)
        ref_out, ref_lse = reference(*args, kw.get("causal", False), kw.get("scale"))
        assert_close(got, ref_out, args[0].dtype, str(kw))
        assert_close(got_lse, ref_lse, args[0].dtype, str(kw))
    # strided tensors that a native kernel reads where they lie: a slice of a preallocated KV cache, q laid
    # out [B, S, H, D], q rows that overlap (expanded) or a head dim that is not dense (copied first, as on
    # the general path): the lean path, with the general path's results and strides
    for dtype, D in ((torch.float32, 40), (torch.float32, 64), (torch.bfloat16, 64)):
        k_cache, v_cache = (torch.randn(2, 4, 300, D).to(dtype) for _ in range(2))
        q_bshd = torch.randn(2, 5, 8, D).to(dtype).transpose(1, 2)
        q_wide = torch.randn(2, 8, 5, 2 * D).to(dtype)[..., ::2]
        for qs, Sk, causal in ((q_bshd, 100, False), (q_bshd, 300, True), (q_wide, 77, True),
                               (q_bshd[:, :, :1].expand(2, 8, 3, D), 256, False),
                               (torch.randn(2, 8, 1, D).to(dtype), 1, True)):
            ks, vs = k_cache[:, :, :Sk], v_cache[:, :, :Sk]
            what = f"{dtype} strided q {tuple(qs.stride())} Sk={Sk} causal={causal}"
            lean = pa._lean_cpu_forward(qs, ks, vs, causal, None, "auto")
            assert lean is not None, what
            with monkeypatch.context() as m:
                m.setattr(pa, "_lean_cpu_forward", lambda *a: None)
                want = flash_attention(qs, ks, vs, causal=causal, return_lse=True)
            for got, ref in zip(lean, want):
                assert got.stride() == ref.stride() and torch.equal(got, ref), what
            assert_close(lean[0], reference(qs, ks, vs, causal, None)[0], dtype, what)
    qn = q.clone()
    qn[0, 3, 0, 5] = float("nan")
    lean = pa._lean_cpu_forward(qn, k, v, False, None, "auto")  # NaN row: recomputed on the exact path
    with monkeypatch.context() as m:
        m.setattr(pa, "_lean_cpu_forward", lambda *a: None)
        want = flash_attention(qn, k, v, return_lse=True)
    for got, ref in zip(lean, want):
        torch.testing.assert_close(got, ref, equal_nan=True, rtol=0, atol=0)
        assert got.stride() == ref.stride()
    out = flash_attention(qn, k, v)
    assert torch.isnan(out[0, 3]).all() and torch.isfinite(out[0, :3]).all()
    with pytest.raises(TypeError, match="return_lse"):
        flash_attention(q, k, v, return_lse="yes")
    with pytest.raises(ValueError, match="scale"):
        flash_attention(q, k, v, scale=float("inf"))
    with torch.enable_grad():
        qg = q.clone().requires_grad_()
        assert pa._lean_cpu_forward(qg, k, v, False, None, "auto") is None
        flash_attention(qg, k, v).sum().backward()
        assert qg.grad is not None


DECODE_SHAPES = [  # (B, H, Hkv, S_q, S_k, D): GQA groups, S_k around the 32-key block and the 256-key chunk,
    (1, 8, 8, 1, 128, 64),  # head dims with tails of 8 and 32 floats, S_q > S_k (causal rows with no key)
    (1, 4, 2, 2, 70, 130),
    (2, 8, 2, 3, 1000, 80),
    (1, 6, 2, 4, 2049, 128),
    (2, 3, 1, 16, 31, 33),
    (1, 4, 4, 5, 3, 7),
    (3, 2, 1, 1, 257, 1),
    (1, 2, 2, 2, 32, 40),
]


@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("threads,grain", [(1, 1 << 40), (2, 1), (3, 1)], ids=["one-thread", "split", "split3"])
def test_decode_kernel_matches_the_oracle(shape, dtype, causal, threads, grain):
    """The native decode kernel (csrc/attention/attention_cpu.cpp): one pass over K/V per KV head for
    every query row of its group, split over the keys (split-K, then merged by lse) when there are
    fewer groups than threads. Same contract as every CPU path: bottom-right causal, rows without keys
    out 0 / lse -inf, out in q's memory order and lse laid out as aten's."""
    q, k, v = make(*shape, dtype, seed=sum(shape))
    for scale in (None, -0.7):
        sc = 1 / math.sqrt(shape[-1]) if scale is None else scale
        out, lse = _cpu.decode_forward(q, k, v, causal, sc, threads, grain)
        ro, rl = reference(q, k, v, causal, sc)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert out.stride() == _cpu.out_strides(q, shape[-1]) and lse.stride() == _cpu.to_bshd(lse).stride()
        assert_close(out, ro, dtype, "out")
        assert_close(lse, rl, torch.float32, "lse")


def test_decode_kernel_reads_strided_inputs_and_leaves_them_unmodified():
    """K/V laid out [B, S, H, D] (a KV cache written token by token), q transposed the same way, and a
    q whose rows overlap: the kernel takes any strides with a dense head dim."""
    g = torch.Generator().manual_seed(5)
    B, H, Hkv, Sq, Sk, D = 2, 8, 2, 3, 300, 64
    q = torch.randn(B, Sq, H, D, generator=g).transpose(1, 2)
    k = torch.randn(B, Sk, Hkv, D, generator=g).transpose(1, 2)
    v = torch.randn(B, Sk, Hkv, D, generator=g).transpose(1, 2)
    before = [t.clone() for t in (q, k, v)]
    for causal in (False, True):
        out, lse = _cpu.decode_forward(q, k, v, causal, 0.125, 2, 1)
        ro, rl = reference(q, k, v, causal, 0.125)
        assert_close(out, ro, torch.float32, "out")
        assert_close(lse, rl, torch.float32, "lse")
        assert out.stride() == _cpu.out_strides(q, D)
    for a, b in zip((q, k, v), before):
        assert torch.equal(a, b)
    qo = torch.randn(B * H * D + 8, generator=g).as_strided((B, H, 4, D), (H * D, D, 2, 1))  # rows overlap
    out, _ = _forward_impl(qo, k, v, False, 0.125, "cpu", {"impl": "decode"}, inference=True)
    assert_close(out, reference(qo, k, v, False, 0.125)[0], torch.float32, "overlapping q")


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_kernel_without_keys_gives_zero_rows(threads):
    """The native kernel itself with S_k = 0 (its Python wrapper answers that case without calling it):
    every row sees no key, so out 0 and lse -inf; it divided by a chunk length of 0 (SIGFPE) before."""
    from pykernels import _native
    B, H, Hkv, Sq, D = 2, 4, 2, 3, 16
    q = torch.randn(B, H, Sq, D)
    k = v = torch.empty(B, Hkv, 0, D)
    out = torch.full((B, H, Sq, D), 7.0)
    lse = torch.full((B, H, Sq), 7.0)
    bad = _native.cpu_module("attention").decode_forward(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), B, H, Hkv, Sq, 0, D,
        q.stride()[:3], k.stride()[:3], v.stride()[:3], out.stride()[:3], lse.stride(), 0.25, False,
        _native.dtype_code(q.dtype), threads, 1)
    assert bad == 0
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, torch.full_like(lse, -math.inf))


@pytest.mark.parametrize("where", ["q", "k", "v", "k-inf"])
def test_decode_kernel_non_finite_inputs_follow_the_math(where):
    """NaN/inf in q or k give a row that sees it a non-finite lse: the kernel reports it and the exact
    path recomputes (NaN rows as the math, SDPA and the other paths give them); NaN in a v reaches only
    the rows that see it (a causal row never reads a masked key's value, not even as 0 * NaN)."""
    q, k, v = make(1, 4, 2, 4, 40, 16, torch.float32, seed=9)
    t = {"q": q, "k": k, "v": v, "k-inf": k}[where.split("-")[0]]
    t[0, 1, 3 if where == "q" else 38, 5] = float("inf") if where == "k-inf" else float("nan")
    assert (_cpu.decode_forward(q, k, v, True, 0.25, 2, 1) is None) == (where != "v")
    out, lse = _forward_impl(q, k, v, True, 0.25, "cpu", {"impl": "decode", "grain": 1}, inference=True)
    if where == "v":  # key 38 is seen by query rows 2 and 3 (bottom-right: row i sees j <= i + 36) of heads 2, 3
        assert torch.isnan(out[0, 2:, 2:, 5]).all() and torch.isfinite(out[0, 2:, :2]).all()
        assert torch.isfinite(out[0, :2]).all() and torch.isfinite(lse).all()
        clean = v.clone()
        clean[0, 1, 38, 5] = 0.0  # what the rows that do not see key 38 attend to (the oracle's 0 * NaN is NaN)
        assert_close(out[0, 2:, :2], reference(q, k, clean, True, 0.25)[0][0, 2:, :2], torch.float32, "other rows")
    else:  # recomputed on the exact path: its NaN (and +-inf) exactly
        want, want_lse = _forward_impl(q, k, v, True, 0.25, "cpu", {"impl": "blocked"})
        assert torch.isnan(out).any()
        torch.testing.assert_close(out, want, equal_nan=True, rtol=0, atol=0)
        torch.testing.assert_close(lse, _cpu.to_bshd(want_lse), equal_nan=True, rtol=0, atol=0)


def test_decode_kernel_portable_tier_matches_avx2():
    """The portable loops (PYKERNELS_DISABLE_AVX2=1, read once per process) against the oracle, in a fresh
    process: the head-dim tails, the GQA pairing of rows and split-K of the AVX2 loops have a scalar twin."""
    import os
    import subprocess
    import sys

    code = (
        "import math, torch\n"
        "from pykernels.attention import _cpu\n"
        "from pykernels._native import cpu_module\n"
        "assert not cpu_module('runtime').cpu_has_avx2()\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for B, H, Hkv, Sq, Sk, D in [(2, 8, 2, 3, 300, 80), (1, 2, 1, 5, 33, 7)]:\n"
        "    for dt in (torch.float32, torch.bfloat16, torch.float16):\n"
        "        q, k, v = (torch.randn(B, h, s, D, generator=g).to(dt) for h, s in ((H, Sq), (Hkv, Sk), (Hkv, Sk)))\n"
        "        out, lse = _cpu.decode_forward(q, k, v, True, 0.3, 2, 1)\n"
        "        kk, vv = (t.double().repeat_interleave(H // Hkv, 1) for t in (k, v))\n"
        "        s = q.double() @ kk.transpose(-1, -2) * 0.3\n"
        "        s = s.masked_fill(torch.arange(Sk)[None, :] > torch.arange(Sq)[:, None] + Sk - Sq, -math.inf)\n"
        "        ro, rl = torch.softmax(s, -1) @ vv, torch.logsumexp(s, -1)\n"
        "        tol = 2e-5 if dt == torch.float32 else 3e-2\n"
        "        assert (out.double() - ro).abs().max() < tol, (dt, (out.double() - ro).abs().max())\n"
        "        assert (lse.double() - rl).abs().max() < 1e-4\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   env=dict(os.environ, PYKERNELS_DISABLE_AVX2="1"))


def test_decode_kernel_only_where_no_backward_follows(monkeypatch):
    """The decode kernel's lse differs from aten's in its last bits, and aten's backward recomputes P from
    the lse: so calls a backward may follow (autograd, torch.func.grad) keep aten's forward, while eager
    calls that record no graph (no_grad, even with inputs that require grad; plain tensors) take the
    kernel on the lean and the general path alike (review findings: torch.func.grad ran it, and no_grad
    with requires_grad inputs took it on one path only)."""
    import importlib

    pa = importlib.import_module("pykernels.attention")
    q, k, v = make(1, 8, 2, 2, 300, 64, torch.float32, seed=4)
    calls = []
    real = _cpu.decode_forward
    monkeypatch.setattr(_cpu, "decode_forward", lambda *a: calls.append(1) or real(*a))
    loss = lambda q_: flash_attention(q_, k, v, causal=True).pow(2).sum()  # noqa: E731
    g_func = torch.func.grad(loss)(q)
    qa = q.clone().requires_grad_()
    loss(qa).backward()
    assert calls == []
    torch.testing.assert_close(g_func, qa.grad)
    with torch.no_grad():
        lean = flash_attention(qa, k, v, causal=True, return_lse=True)
        general = flash_attention(qa.transpose(2, 3).contiguous().transpose(2, 3), k, v, causal=True, return_lse=True)
    assert len(calls) == 2
    assert torch.equal(lean[0], general[0]) and torch.equal(lean[1], general[1])
    assert pa._lean_cpu_forward(q, k, v, True, None, "auto") is not None and len(calls) == 3
    # an empty problem: the layouts of the general path (and of the fake op)
    q0, k0, v0 = make(1, 0, 1, 3, 5, 16, torch.float32)[0], *make(1, 1, 1, 3, 5, 16, torch.float32)[1:]
    with monkeypatch.context() as m:
        m.setattr(pa, "_lean_cpu_forward", lambda *a: None)
        want = flash_attention(q0, k0, v0, return_lse=True)
    got = flash_attention(q0, k0, v0, return_lse=True)
    assert got[0].stride() == want[0].stride() and got[1].stride() == want[1].stride()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_step_keeps_aten_forward_for_its_backward(monkeypatch, backend):
    """A compiled training step whose q is computed inside the compiled function: at run time the op's
    inputs carry no requires_grad, yet the compiled backward follows (review finding: the decode kernel
    ran there, and with logits ~1e3-1e4 dW was off by up to 10% relative where eager was right). The
    decision is made where torch.compile traces the autograd state: the compiled step runs aten's
    kernel as eager does, with the same gradients; a compiled call under no_grad keeps the decode kernel."""
    calls = []
    real = _cpu.decode_forward
    monkeypatch.setattr(_cpu, "decode_forward", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    x = torch.randn(1, 5, 8)
    W = torch.randn(8, 8) * 30  # logits in the thousands: a foreign lse shows in the gradients
    W.requires_grad_()
    k, v = torch.randn(1, 1, 6, 4) * 30, torch.randn(1, 1, 6, 4)

    def step(x, W, k, v):
        q = (x @ W).view(1, 5, 2, 4).transpose(1, 2)
        return flash_attention(q, k, v, causal=True, scale=1.0)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    out = compiled(x, W, k, v)
    out.pow(2).sum().backward()
    g_compiled, W.grad = W.grad.clone(), None
    assert calls == []
    ref = step(x, W, k, v)
    ref.pow(2).sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(g_compiled, W.grad)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, W, k, v), ref.detach())
    assert calls == [1]


def test_ring_attention_blocks_keep_aten_forward_for_their_backward(monkeypatch):
    """Ring and token-ring attention run each block's forward under no_grad inside their own autograd
    Function and then differentiate it with flash_attention_backward: the blocks must not take the decode
    kernel there (review finding: dq was 40x less accurate than flash_attention's at logits ~1e4); without
    a gradient to compute they may. World of 1 (no process group)."""
    collectives = pytest.importorskip("collectives")
    calls = []
    real = _cpu.decode_forward
    monkeypatch.setattr(_cpu, "decode_forward", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 8, 4, 64) * 0.3, torch.randn(1, 2, 4, 64) * 0.3, torch.randn(1, 2, 4, 64)
    q[..., 0], k[..., 0] = 100.0, 100.0
    go = torch.randn(1, 8, 4, 64)

    def grads(fn, dtype=torch.float32):
        ts = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        (fn(*ts, causal=True, scale=1.0) * go.to(dtype)).sum().backward()
        return [t.grad.double() for t in ts]

    exact = grads(lambda *a, **kw: reference(*a, **kw)[0], torch.float64)
    rel_err = lambda gs: max(float((g - e).norm() / e.norm()) for g, e in zip(gs, exact))  # noqa: E731
    flash_err = rel_err(grads(flash_attention))
    assert calls == []
    for fn in (collectives.ring_attention, collectives.token_ring_attention):
        calls.clear()
        err = rel_err(grads(fn))
        assert calls == [], fn.__name__
        assert err <= 2 * flash_err, (fn.__name__, err, flash_err)  # the decode kernel's lse: ~40x
        fn(q, k, v, causal=True, scale=1.0)  # nothing to differentiate: the decode kernel may run
        assert calls, fn.__name__
    # the same promise to a user's own autograd.Function, on the public function's lean path too
    from pykernels.attention import backward_follows
    calls.clear()
    with torch.no_grad(), backward_follows():
        flash_attention(q, k, v, causal=True, scale=1.0, return_lse=True)
    assert calls == []


def test_lean_path_memo_follows_what_dispatch_reads(monkeypatch, tmp_cache):
    """The lean CPU path remembers dispatch's answer per call signature: a decode loop whose cache grows
    within a power-of-two bucket asks once, a new bucket asks again, and a config stored by the autotuner
    (a new generation) or PYKERNELS_AUTOTUNE=0 is followed at once."""
    import sys

    import pykernels.autotune as at

    A = sys.modules["pykernels.attention"]
    calls = []
    real = A.dispatch

    def spy(*args, **kw):
        calls.append(args[3])
        return real(*args, **kw)
    monkeypatch.setattr(A, "dispatch", spy)
    A._LEAN_PLANS.clear()
    q = torch.randn(1, 8, 1, 64)
    for sk in range(129, 257, 16):  # one bucket (256)
        k, v = torch.randn(1, 8, sk, 64), torch.randn(1, 8, sk, 64)
        A.flash_attention(q, k, v, causal=True)
    assert len(calls) == 1 and calls[0]["sk"] == 256
    k, v = torch.randn(1, 8, 300, 64), torch.randn(1, 8, 300, 64)
    A.flash_attention(q, k, v, causal=True)
    assert len(calls) == 2 and calls[1]["sk"] == 512
    # a stored config: the next call dispatches again and runs it
    gen = at.generation()
    at.tune("flash_attention", q, k, v, causal=True, backend="cpu", budget_s=0.01)
    assert at.generation() != gen
    n = len(calls)
    out = A.flash_attention(q, k, v, causal=True)
    assert len(calls) == n + 1
    A.flash_attention(q, k, v, causal=True)
    assert len(calls) == n + 1
    monkeypatch.setenv("PYKERNELS_AUTOTUNE", "0")
    out0 = A.flash_attention(q, k, v, causal=True)
    assert len(calls) == n + 2
    torch.testing.assert_close(out, out0, rtol=1e-5, atol=1e-6)


def test_double_backward_says_it_is_not_implemented():
    """A second derivative through flash_attention raises an error naming the op (torch's default told the
    user to register an autograd formula for pykernels.flash_attention_backward; review finding)."""
    q, k, v = (t.requires_grad_() for t in make(1, 2, 2, 5, 7, 16, torch.float32, seed=3))
    g, = torch.autograd.grad(flash_attention(q, k, v, causal=True).pow(2).sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="pykernels.flash_attention: a second derivative"):
        g.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_eager_autograd_function_matches_the_registered_op(dtype):
    """An eager call whose inputs require grad runs under the module's own autograd.Function
    (_EagerFlashAttention), not through the registered op's autograd: the same outputs and the same
    gradients as the op's, through out alone, lse alone, both, and with only some inputs requiring grad;
    saved-tensor hooks see its saved tensors; a second derivative raises as through the op."""
    import pykernels.attention as A

    for causal, (Sq, Sk) in ((False, (7, 7)), (True, (5, 9)), (True, (9, 5))):
        base = make(2, 4, 2, Sq, Sk, 16, dtype, seed=Sq + Sk)
        for needs in ((True, True, True), (True, False, False), (False, False, True)):
            for use in ("out", "lse", "both"):
                grads = []
                for via_op in (False, True):
                    q, k, v = (t.clone().requires_grad_(r) for t, r in zip(base, needs))
                    if via_op:
                        out, lse = torch.ops.pykernels.flash_attention(q, k, v, causal, 1 / 4, "cpu")
                        assert "pykernels_flash_attention" in type(out.grad_fn).__name__
                    else:
                        out, lse = flash_attention(q, k, v, causal=causal, scale=1 / 4, return_lse=True, backend="cpu")
                        assert type(out.grad_fn).__name__ == "_EagerFlashAttentionBackward"
                    g = torch.Generator().manual_seed(1)
                    loss = 0
                    if use != "lse":
                        loss = loss + (out.float() * torch.randn(out.shape, generator=g)).sum()
                    if use != "out":
                        loss = loss + (lse.float().nan_to_num(neginf=0.0) * torch.randn(lse.shape, generator=g)).sum()
                    loss.backward()
                    grads.append([out.detach(), lse.detach()] + [t.grad for t in (q, k, v)])
                for a, b in zip(*grads):
                    if a is None or b is None:
                        assert a is None and b is None
                    else:
                        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    q, k, v = (t.requires_grad_() for t in make(1, 2, 2, 5, 7, 16, torch.float32, seed=3))
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = flash_attention(q, k, v, causal=True)
    assert len(packed) == 5 and type(out.grad_fn).__name__ == "_EagerFlashAttentionBackward"
    out.sum().backward()
    assert A._EagerFlashAttention is not None and q.grad is not None


def test_all_finite_sees_every_nan_and_inf():
    """The backward's check whether aten's kernel may take the call (_all_finite): every layout it scans
    natively (dense float32/float64, one value expanded as out.sum() gives dout) or with numpy (other
    strides, bf16/fp16, past the native scan's size) finds a NaN or inf anywhere; finite tensors pass."""
    from pykernels.attention import _NATIVE_FINITE_MAX, _all_finite

    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for n in (1, 37, 4096, _NATIVE_FINITE_MAX + 3):
            x = torch.randn(n).to(dtype)
            views = {"dense": x, "strided": x[::2] if n > 1 else x, "expanded": x[:1].expand(64),
                     "permuted": x[: (n // 4) * 4].view(-1, 4).t() if n >= 4 else x}
            for name, t in views.items():
                assert _all_finite(t), (dtype, n, name)
            for bad in (float("nan"), float("inf"), float("-inf")):
                for where in (0, n // 2, n - 1):
                    y = x.clone()
                    y[where] = bad
                    views = {"dense": y, "expanded": y[where:where + 1].expand(64)}
                    if where % 2 == 0:
                        views["strided"] = y[::2]
                    for name, t in views.items():
                        assert not _all_finite(torch.ones(3), t), (dtype, n, name, bad, where)


# ---------------------------------------------------------------------------------------------
# "bf16dot": the native bfloat16 kernel with AVX-512 BF16 dot products (csrc/attention/attention_cpu.cpp)
# ---------------------------------------------------------------------------------------------
needs_bf16dot = pytest.mark.skipif(not _cpu.bf16dot_available(),
                                   reason="this CPU lacks AVX-512 BF16 (the bf16dot kernel's instructions)")

BF16DOT_SHAPES = [  # (B, H, Hkv, S_q, S_k, D): key counts around the 16-key groups and 64-key blocks, query
    (1, 2, 2, 5, 7, 64),        # rows around the 64-row items and 6-row register tiles, GQA, S_q != S_k
    (2, 4, 2, 65, 63, 64),
    (1, 3, 1, 64, 129, 128),
    (1, 2, 2, 130, 65, 192),
    (1, 1, 1, 7, 200, 256),
    (2, 8, 2, 1, 300, 128),
    (1, 2, 1, 200, 3, 64),
    (1, 6, 6, 13, 13, 512),
]


@needs_bf16dot
@pytest.mark.parametrize("shape", BF16DOT_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_bf16dot_kernel_matches_the_oracle(shape, causal, threads):
    """Same contract as every CPU path: bottom-right causal, rows without keys out 0 / lse -inf, out in q's
    memory order and lse laid out as aten's; bf16 accuracy (P rounded to bf16 for P V, as aten's kernel)."""
    q, k, v = make(*shape, torch.bfloat16, seed=sum(shape))
    for scale in (None, -0.7):
        sc = 1 / math.sqrt(shape[-1]) if scale is None else scale
        out, lse = _cpu.bf16dot_forward(q, k, v, causal, sc, threads)
        ro, rl = reference(q, k, v, causal, sc)
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        assert out.stride() == _cpu.out_strides(q, shape[-1]) and lse.stride() == _cpu.to_bshd(lse).stride()
        assert_close(out, ro, torch.bfloat16, "out")
        assert_close(lse, rl, torch.float32, "lse")


@needs_bf16dot
def test_bf16dot_kernel_as_accurate_as_sdpa():
    """Large logits and long rows: the error of out against the float64 oracle stays within 1.5x of SDPA's
    (the same precision choices: fp32 scores and softmax, bf16 probabilities, fp32 accumulation)."""
    q, k, v = make(1, 4, 2, 300, 1000, 128, torch.bfloat16, seed=7, scale=3.0)
    for causal in (False, True):
        out, lse = _cpu.bf16dot_forward(q, k, v, causal, 128 ** -0.5, 2)
        ro, rl = reference(q, k, v, causal)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        if causal:  # SDPA aligns the causal mask top-left: its rows i see keys j <= i
            ro = reference(q, k[:, :, :300], v[:, :, :300], True)[0]
            out = _cpu.bf16dot_forward(q, k[:, :, :300], v[:, :, :300], True, 128 ** -0.5, 2)[0]
        err = (out.double() - ro).abs().max().item()
        err_sdpa = (sdpa.double() - ro).abs().max().item()
        assert err <= 1.5 * err_sdpa + 1e-3, (causal, err, err_sdpa)
        if not causal:
            assert (lse.double() - rl).abs().max().item() < 1e-3


@pytest.mark.parametrize("kernel,dtype", [("bf16dot", torch.bfloat16), ("fma", torch.float32), ("fma", torch.float16)])
def test_native_prefill_reads_strided_inputs_and_leaves_them_unmodified(kernel, dtype):
    """K/V laid out [B, S, H, D] (a KV cache), q transposed the same way, an odd row stride (bf16dot's K packing
    gathers 4-byte words at any byte offset), and inputs left as they were."""
    if not (_cpu.bf16dot_available() if kernel == "bf16dot" else _cpu.fma_available()):
        pytest.skip(f"this CPU lacks the {kernel} kernel's instructions")
    forward = _cpu.bf16dot_forward if kernel == "bf16dot" else _cpu.fma_forward
    g = torch.Generator().manual_seed(5)
    B, H, Hkv, Sq, Sk, D = 2, 8, 2, 70, 100, 64
    q = torch.randn(B, Sq, H, D, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(B, Sk, Hkv, D, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(B, Sk, Hkv, D, generator=g).to(dtype).transpose(1, 2)
    odd = torch.randn(B * Hkv * Sk * (D + 1), generator=g).to(dtype)
    k_odd = odd.as_strided((B, Hkv, Sk, D), (Hkv * Sk * (D + 1), Sk * (D + 1), D + 1, 1))
    for kk in (k, k_odd):
        before = [t.clone() for t in (q, kk, v)]
        for causal in (False, True):
            out, lse = forward(q, kk, v, causal, 0.125, 2)
            ro, rl = reference(q, kk, v, causal, 0.125)
            assert_close(out, ro, dtype, "out")
            assert_close(lse, rl, torch.float32, "lse")
            assert out.stride() == _cpu.out_strides(q, D)
        for a, b in zip((q, kk, v), before):
            assert torch.equal(a, b)


@needs_bf16dot
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16dot_kernel_without_keys_gives_zero_rows(threads):
    """The native kernel itself with S_k = 0 (the wrapper answers that case without calling it)."""
    from pykernels import _native
    B, H, Hkv, Sq, D = 2, 4, 2, 3, 64
    q = torch.randn(B, H, Sq, D).to(torch.bfloat16)
    k = v = torch.empty(B, Hkv, 0, D, dtype=torch.bfloat16)
    out = torch.full((B, H, Sq, D), 7.0, dtype=torch.bfloat16)
    lse = torch.full((B, H, Sq), 7.0)
    bad = _native.cpu_module("attention").prefill_forward(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), B, H, Hkv, Sq, 0, D,
        q.stride()[:3], k.stride()[:3], v.stride()[:3], out.stride()[:3], lse.stride(), 0.25, False,
        _native.dtype_code(q.dtype), threads)
    assert bad == 0
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, torch.full_like(lse, -math.inf))
    # and where it does not apply (another dtype, a head dim not a multiple of 64): -1, nothing written
    for dt, d in ((torch.float32, 64), (torch.bfloat16, 96)):
        q2, k2 = torch.zeros(1, 1, 2, d, dtype=dt), torch.zeros(1, 1, 2, d, dtype=dt)
        o2, l2 = torch.full_like(q2, 7.0), torch.full((1, 1, 2), 7.0)
        assert _native.cpu_module("attention").prefill_forward(
            q2.data_ptr(), k2.data_ptr(), k2.data_ptr(), o2.data_ptr(), l2.data_ptr(), 1, 1, 1, 2, 2, d,
            q2.stride()[:3], k2.stride()[:3], k2.stride()[:3], o2.stride()[:3], l2.stride(), 0.25, False,
            _native.dtype_code(dt), 1) == -1
        assert (o2 == 7).all() and (l2 == 7).all()


@pytest.mark.parametrize("kernel", ["bf16dot", "fma"])
@pytest.mark.parametrize("where", ["q", "k", "v", "k-inf", "k-all-inf"])
def test_native_prefill_non_finite_inputs_follow_the_math(where, kernel):
    """NaN/inf in q or k give a row that sees it a non-finite lse: the kernel reports it and the exact path
    recomputes; NaN in a v reaches the rows that see it, and no row of another 6-row tile (as the contract
    says, a masked key's value may reach rows that share its tile: p = 0, but 0 * NaN is NaN)."""
    if not (_cpu.bf16dot_available() if kernel == "bf16dot" else _cpu.fma_available()):
        pytest.skip(f"this CPU lacks the {kernel} kernel's instructions")
    forward = _cpu.bf16dot_forward if kernel == "bf16dot" else _cpu.fma_forward
    q, k, v = make(1, 4, 2, 70, 100, 64, torch.bfloat16 if kernel == "bf16dot" else torch.float32, seed=9)
    t = {"q": q, "k": k, "v": v}[where.split("-")[0]]
    if where == "k-all-inf":  # every score of the rows of KV head 1 that see key 0 only is -inf
        k[0, 1, 0] = float("inf")
        q[0, 2:, 0] = -1.0
    else:
        t[0, 1, 3 if where == "q" else 98, 5] = float("inf") if where == "k-inf" else float("nan")
    assert (forward(q, k, v, True, 0.25, 2) is None) == (where != "v")
    out, lse = _forward_impl(q, k, v, True, 0.25, "cpu", {"impl": kernel}, inference=True)
    if where == "v":  # key 98 is seen by query rows 68 and 69 (row i sees j <= i + 30) of heads 2, 3; rows
        # 64..69 are one register tile
        assert torch.isnan(out[0, 2:, 68:, 5]).all() and torch.isfinite(out[0, 2:, :64]).all()
        assert torch.isfinite(out[0, :2]).all() and torch.isfinite(lse).all()
    else:  # recomputed on the exact path: its NaN (and +-inf) exactly
        want, want_lse = _forward_impl(q, k, v, True, 0.25, "cpu", {"impl": "blocked"})
        torch.testing.assert_close(out, want, equal_nan=True, rtol=0, atol=0)
        torch.testing.assert_close(lse, _cpu.to_bshd(want_lse), equal_nan=True, rtol=0, atol=0)


@needs_bf16dot
def test_bf16dot_is_the_default_for_bfloat16_forwards(monkeypatch):
    """A bfloat16 call takes the kernel on the lean and the general path alike, and also where a backward
    follows (autograd, torch.compile); float32 and a head dim not a multiple of 64 never take it."""
    import importlib

    pa = importlib.import_module("pykernels.attention")
    monkeypatch.setenv("PYKERNELS_AUTOTUNE", "0")
    q, k, v = make(1, 8, 2, 128, 128, 64, torch.bfloat16, seed=4)
    calls = []
    real = _cpu.bf16dot_forward
    monkeypatch.setattr(_cpu, "bf16dot_forward", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        lean = flash_attention(q, k, v, causal=True, return_lse=True)
        general = flash_attention(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, causal=True,
                                  return_lse=True)
    assert len(calls) == 2
    assert torch.equal(lean[0], general[0]) and torch.equal(lean[1], general[1])
    assert_close(lean[0], reference(q, k, v, True)[0], torch.bfloat16, "out")
    qa = q.clone().requires_grad_()
    out = flash_attention(qa, k, v, causal=True)
    assert len(calls) == 3 and torch.equal(out.detach(), lean[0])
    flash_attention(q.float(), k.float(), v.float(), causal=True)
    flash_attention(*make(1, 8, 2, 128, 128, 96, torch.bfloat16), causal=True)
    assert len(calls) == 3
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c: flash_attention(a, b, c, causal=True), backend="aot_eager",
                             fullgraph=True)(qa, k, v)
    assert len(calls) == 4 and torch.equal(compiled.detach(), lean[0])


@needs_bf16dot
@pytest.mark.parametrize("logit_scale", [1.0, 30.0, 300.0])
def test_bf16dot_forward_with_aten_backward_is_as_accurate_as_aten_forward(logit_scale):
    """Training in bfloat16: the kernel's lse under aten's backward (which recomputes P from its own scores)
    gives dq, dk, dv as close to the float64 oracle as aten's own forward's lse, up to logits in the
    thousands (and within the bfloat16 tolerance where the logits are ordinary)."""
    q, k, v = make(1, 4, 2, 200, 200, 64, torch.bfloat16, seed=11, scale=math.sqrt(logit_scale))
    g = torch.Generator().manual_seed(2)
    dout = torch.randn(q.shape, generator=g).to(torch.bfloat16)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(reference(qr, kr, vr, True)[0], (qr, kr, vr), dout.double())
    sc = 1 / math.sqrt(64)
    errs = {}
    for impl in ("bf16dot", "flash"):
        out, lse = _forward_impl(q, k, v, True, sc, "cpu", {"impl": impl})
        grads = _cpu.flash_backward(dout, q, k, v, out, lse, True, sc)
        errs[impl] = [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, ref)]
    for ours, aten in zip(errs["bf16dot"], errs["flash"]):
        assert ours <= 1.25 * aten + 2e-3, errs
    if logit_scale == 1.0:
        assert max(errs["bf16dot"]) < TOL[torch.bfloat16], errs


@needs_bf16dot
@pytest.mark.parametrize("shape", BF16DOT_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_bf16dot_backward_matches_the_oracle(shape, causal, threads):
    """The native backward against the float64 oracle's gradients, with and without a gradient flowing into
    the lse (ring-attention merges), and for a negative scale; dq/dk/dv of rows and keys no one sees are 0."""
    _native_backward_matches_the_oracle(_cpu.bf16dot_backward, shape, causal, threads, torch.bfloat16,
                                        ((None, False, "flash"), (-0.7, True, "flash")))


def _native_backward_matches_the_oracle(backward, shape, causal, threads, dtype, cases):
    """backward(dout, q, k, v, out, lse, causal, scale, dlse, threads) against the float64 oracle's gradients
    for each (scale or None for 1/sqrt(D), with an LSE gradient, the forward impl that gives out and lse)."""
    q, k, v = make(*shape, dtype, seed=sum(shape) + 1)
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(q.shape, generator=g).to(dtype)
    dlse = torch.randn(q.shape[:3], generator=g)
    for scale, with_dlse, forward in cases:
        sc = 1 / math.sqrt(shape[-1]) if scale is None else scale
        out, lse = _forward_impl(q, k, v, causal, sc, "cpu", {"impl": forward})
        qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
        o_ref, l_ref = reference(qr, kr, vr, causal, sc)
        loss = (o_ref * dout.double()).sum()
        if with_dlse:
            loss = loss + (torch.where(torch.isinf(l_ref), 0.0, l_ref) * dlse.double()).sum()
        want = torch.autograd.grad(loss, (qr, kr, vr))
        got = backward(dout, q, k, v, out, lse, causal, sc, dlse if with_dlse else None, threads)
        for name, a, w in zip(("dq", "dk", "dv"), got, want):
            assert a.dtype == dtype and a.is_contiguous()
            assert_close(a, w, dtype, name)
        if causal and shape[3] > shape[4]:  # the rows that see no key (S_q > S_k): exactly 0
            assert not got[0][:, :, :shape[3] - shape[4]].any()


def _native_backward_reads_strided_inputs(backward, dtype, D, forward, B, H, Hkv, threads):
    """q/k/v laid out [B, S, H, D], an odd K row stride, and the expanded dout of out.sum(): a native backward's
    gradients against the float64 oracle's; the inputs are not modified."""
    g = torch.Generator().manual_seed(6)
    Sq, Sk = 70, 100
    q = torch.randn(B, Sq, H, D, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(B, Sk, Hkv, D, generator=g).to(dtype).transpose(1, 2)
    odd = torch.randn(B * Hkv * Sk * (D + 1), generator=g).to(dtype)
    k = odd.as_strided((B, Hkv, Sk, D), (Hkv * Sk * (D + 1), Sk * (D + 1), D + 1, 1))
    dout = torch.ones((), dtype=dtype).expand(B, H, Sq, D)
    before = [t.clone() for t in (q, k, v)]
    out, lse = _forward_impl(q, k, v, True, 0.125, "cpu", {"impl": forward})
    got = backward(dout, q, k, v, out, lse, True, 0.125, None, threads)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(reference(qr, kr, vr, True, 0.125)[0].sum(), (qr, kr, vr))
    for name, a, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(a, w, dtype, name)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))


# (B, H, Hkv, threads): a group per thread; threads that share a group (one KV head: each packs its own
# blocks of Q and dO, or takes its own (head, query block) pairs); one head on 3 threads (its two query
# blocks split between two of them)
_STRIDED_SPLITS = [(2, 4, 2, 2), (1, 4, 1, 2), (1, 4, 1, 3), (1, 1, 1, 3)]
_STRIDED_IDS = ["group-per-thread", "shared-2", "shared-3", "one-head-3"]


@needs_bf16dot
@pytest.mark.parametrize("B, H, Hkv, threads", _STRIDED_SPLITS, ids=_STRIDED_IDS)
def test_bf16dot_backward_reads_strided_inputs(B, H, Hkv, threads):
    _native_backward_reads_strided_inputs(_cpu.bf16dot_backward, torch.bfloat16, 64, "flash", B, H, Hkv, threads)


@needs_bf16dot
@pytest.mark.parametrize("shape", [(1, 8, 2, 96, 160, 128), (1, 4, 2, 150, 70, 64)], ids=["sq<sk", "sq>sk"])
def test_bf16dot_backward_is_the_default_and_non_finite_takes_the_exact_path(monkeypatch, shape):
    """Autograd through the public op runs the native backward for bfloat16 (and its gradients match the
    oracle), also with S_q > S_k causal, whose first rows have lse -inf by contract (the finiteness check
    looks at the rows that see keys; audit finding: they sent every such call to the slow exact path); a
    NaN in dout sends the call to the exact blocked path, as for the other impls."""
    monkeypatch.setenv("PYKERNELS_AUTOTUNE", "0")
    calls = []
    real = _cpu.bf16dot_backward
    monkeypatch.setattr(_cpu, "bf16dot_backward", lambda *a: calls.append(1) or real(*a))
    q, k, v = make(*shape, torch.bfloat16, seed=8)
    check_forward_and_grads(q, k, v, True)
    assert len(calls) == 1
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    dout = torch.randn(out.shape).to(torch.bfloat16)
    dout[0, 1, -5, 7] = float("nan")  # a row that sees keys (the others take no part in the backward)
    sc = shape[-1] ** -0.5
    got = _backward_impl(dout, None, q, k, v, out, lse, True, sc, "cpu", {"impl": "bf16dot"})
    want = _backward_impl(dout, None, q, k, v, out, lse, True, sc, "cpu", {"impl": "blocked"})
    assert len(calls) == 1
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)


def _bf16dot_refuses_and_the_exact_path_answers(q, k, v, scale, dout):
    """The bf16dot kernels refuse (q, k, v) at `scale`, forward and backward (None: nothing computed), and
    the bf16dot config still answers, on the exact path: its forward and dv against the float64 oracle (dq
    and dk of such calls may pass bfloat16's range: not compared)."""
    assert _cpu.bf16dot_forward(q, k, v, False, scale, 2) is None
    check_forward_and_grads(q, k, v, False, scale=scale, config={"impl": "bf16dot"}, check_grads=False)
    out, lse = _forward_impl(q, k, v, False, scale, "cpu", {"impl": "flash"})
    assert _cpu.bf16dot_backward(dout, q, k, v, out, lse, False, scale, None, 2) is None
    vr = v.double().requires_grad_()
    want_dv, = torch.autograd.grad(reference(q, k, vr, False, scale)[0], (vr,), dout.double())
    _, _, dv = _backward_impl(dout, None, q, k, v, out, lse, False, scale, "cpu", {"impl": "bf16dot"})
    assert_close(dv, want_dv, torch.bfloat16, "dv")


def _with_one_value_in_each(tensors, value, at=(0, 1, 69, 63)):
    """(index of the changed tensor, the tensors with tensors[i][at] = value in a copy), for each i."""
    for i, t in enumerate(tensors):
        changed = t.clone()
        changed[at] = value
        yield i, [changed if j == i else x for j, x in enumerate(tensors)]


@needs_bf16dot
def test_bf16dot_subnormal_inputs_take_an_exact_path():
    """vdpbf16ps reads subnormal bf16 inputs as 0: a subnormal q component times keys near 1e38 is an
    ordinary score, so such calls (q, k, v or dout holding a subnormal) go to the exact paths (audit finding:
    every score of the repro read as 0, lse off by 0.36, dv off by 1.0)."""
    q = torch.zeros(1, 8, 64, 64)
    q[..., 0] = 5e-39
    k = torch.zeros(1, 8, 64, 64)
    k[..., 0] = torch.linspace(-3, 3, 64) * 1e38
    v = torch.randn(1, 8, 64, 64, generator=torch.Generator().manual_seed(0))
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    _bf16dot_refuses_and_the_exact_path_answers(q, k, v, 1.0, dout)
    check_forward_and_grads(q, k, v, False, scale=1.0, check_grads=False)
    q2, k2, v2 = make(1, 2, 2, 70, 70, 64, torch.bfloat16, seed=2)
    for _, args in _with_one_value_in_each((q2, k2, v2), 1e-39):  # a subnormal anywhere: the exact path
        assert _cpu.bf16dot_forward(*args, True, 0.125, 2) is None
        check_forward_and_grads(*args, True, config={"impl": "bf16dot"})
    out2, lse2 = _forward_impl(q2, k2, v2, True, 0.125, "cpu", {"impl": "flash"})
    dout2 = torch.randn(out2.shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert _cpu.bf16dot_backward(dout2, q2, k2, v2, out2, lse2, True, 0.125, None, 2) is not None
    dout2[0, 0, 3, 5] = -1e-39
    assert _cpu.bf16dot_backward(dout2, q2, k2, v2, out2, lse2, True, 0.125, None, 2) is None


@needs_bf16dot
def test_bf16dot_tiny_inputs_and_huge_scales_take_an_exact_path():
    """vdpbf16ps also flushes subnormal products to 0: normal q ~1e-19 and k ~1e-20 (products ~1e-39) at
    scale 3e38 are scores from about -11 to 10, which the kernel read as all 0 (audit finding: uniform
    probabilities, lse off by 5.5). Calls with a nonzero input below 2^-50 or |scale| * D above 2^80 take
    the exact paths; inputs just above the bound and ordinary scales keep the kernel."""
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(1, 8, 64, 64, generator=g) * 1e-19).to(torch.bfloat16)
    k = (torch.randn(1, 8, 64, 64, generator=g) * 1e-20).to(torch.bfloat16)
    v = torch.randn(1, 8, 64, 64, generator=g).to(torch.bfloat16)
    dout = torch.randn(q.shape, generator=g).to(torch.bfloat16)
    _bf16dot_refuses_and_the_exact_path_answers(q, k, v, 3e38, dout)
    # the bounds: 2^-50 per input, 2^80 for |scale| * D (D = 64 here)
    q2, k2, v2 = make(1, 2, 2, 70, 70, 64, torch.bfloat16, seed=3)
    for value, takes in ((2.0 ** -51, False), (-(2.0 ** -51), False), (2.0 ** -49, True)):
        for which, args in _with_one_value_in_each((q2, k2, v2), value):
            assert (_cpu.bf16dot_forward(*args, True, 0.125, 2) is not None) == takes, (value, which)
    # q and k near 2^-40 (none below 2^-50): the scores stay ordinary at scale 2^74 = 2^80 / D and above
    small = [(t.float().sign() * t.float().abs().clamp_min(0.01) * 2.0 ** -40).to(torch.bfloat16) for t in (q2, k2)]
    assert not any(((x != 0) & (x.float().abs() < 2.0 ** -50)).any() for x in small)
    assert _cpu.bf16dot_forward(*small, v2, True, 2.0 ** 74, 2) is not None
    assert _cpu.bf16dot_forward(*small, v2, True, 2.0 ** 75, 2) is None
    assert _cpu.bf16dot_forward(*small, v2, True, -(2.0 ** 75), 2) is None
    check_forward_and_grads(*small, v2, True, scale=2.0 ** 75, config={"impl": "bf16dot"}, check_grads=False)
    out2, lse2 = _forward_impl(*small, v2, True, 2.0 ** 74, "cpu", {"impl": "flash"})
    dout2 = torch.randn(out2.shape, generator=g).to(torch.bfloat16)
    assert _cpu.bf16dot_backward(dout2, *small, v2, out2, lse2, True, 2.0 ** 74, None, 2) is not None
    assert _cpu.bf16dot_backward(dout2, *small, v2, out2, lse2, True, 2.0 ** 75, None, 2) is None
    dout2[0, 0, 3, 5] = 1e-16  # below 2^-50 (~8.9e-16)
    assert _cpu.bf16dot_backward(dout2, *small, v2, out2, lse2, True, 2.0 ** 74, None, 2) is None


@needs_bf16dot
@pytest.mark.parametrize("where", ["q", "dout"])
@pytest.mark.parametrize("block", [0, 4, 11])  # owned by parts 0, 1, 2
def test_bf16dot_backward_subnormal_in_any_parts_block(where, block):
    """Where threads share a group, each part checks only the query blocks it packs: a subnormal in any
    (head, 64-row block) of q or dout, whichever of 3 parts owns it, still sends the call to an exact path."""
    q, k, v = make(1, 4, 1, 130, 70, 64, torch.bfloat16, seed=7)
    out, lse = _forward_impl(q, k, v, False, 0.125, "cpu", {"impl": "flash"})
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    assert _cpu.bf16dot_backward(dout, q, k, v, out, lse, False, 0.125, None, 3) is not None
    head, row = divmod(block, 3)  # blocks of (head, 64 rows) numbered head * 3 + row block
    t = (q if where == "q" else dout).clone()
    t[0, head, min(129, row * 64 + 63), 17] = -3e-39
    args = {"q": q, "dout": dout}
    args[where] = t
    assert _cpu.bf16dot_backward(args["dout"], args["q"], k, v, out, lse, False, 0.125, None, 3) is None


@needs_bf16dot
def test_bf16dot_nan_in_v_stays_in_its_tiles():
    """A key no row of a 6-row tile sees is read as 0 even when it shares a pair of keys with one they do
    (audit finding: key 65's NaN reached rows 60-63, which see keys up to 64, through the pair (64, 65))."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, s, 64, generator=g).to(torch.bfloat16) for s in (128, 129, 129))
    v[0, 0, 65, 3] = float("nan")  # causal, S_k - S_q = 1: row i sees keys j <= i + 1, so rows >= 64 see 65
    out, _ = _cpu.bf16dot_forward(q, k, v, True, 0.125, 2)
    nan_rows = torch.nonzero(torch.isnan(out[0, 0, :, 3])).flatten().tolist()
    assert nan_rows == list(range(64, 128))
    assert torch.isfinite(out[0, 1:]).all() and torch.isfinite(out[0, 0, :, :3]).all()


@needs_bf16dot
def test_bf16dot_backward_ignores_rows_that_see_no_key():
    """Causal with S_q > S_k: a NaN in the q (or dout) of a row that sees no key has no effect: zero dq for
    that row and dk/dv as without it (review finding: such rows shared the first live 64-row block, where
    dK += dS^T Q met 0 * NaN)."""
    q, k, v = make(1, 4, 2, 150, 70, 64, torch.bfloat16, seed=13)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    out, lse = _forward_impl(q, k, v, True, 0.125, "cpu", {"impl": "flash"})
    want = _cpu.bf16dot_backward(dout, q, k, v, out, lse, True, 0.125, None, 2)
    q_nan, dout_nan = q.clone(), dout.clone()
    q_nan[0, 1, 75, 3] = float("nan")  # rows 0..79 see no key
    dout_nan[0, 2, 79, 0] = float("inf")
    got = _cpu.bf16dot_backward(dout_nan, q_nan, k, v, out, lse, True, 0.125, None, 2)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(got[0][:, :, :80], torch.zeros_like(got[0][:, :, :80]))


def test_bf16dot_off_without_avx512():
    """PYKERNELS_DISABLE_AVX512=1 (or a CPU without AVX-512 BF16): not available, not a candidate, not the
    default; bfloat16 calls take the fma kernels (aten's without AVX2) and stay correct."""
    import os
    import subprocess
    import sys

    code = (
        "import torch, pykernels\n"
        "from pykernels.attention import _cpu, _tuning, problem_key\n"
        "assert not _cpu.bf16dot_available()\n"
        "q = torch.randn(1, 4, 128, 64).to(torch.bfloat16)\n"
        "key = problem_key(q, q, causal=True)\n"
        "assert _tuning._cpu_fwd_default(key)['impl'] == ('fma' if _cpu.fma_available() else 'flash')\n"
        "assert all(c['impl'] != 'bf16dot' for c in _tuning._cpu_fwd_candidates(key))\n"
        "assert _tuning._cpu_bwd_default(key)['impl'] == ('fma' if _cpu.fma_available() else 'flash')\n"
        "assert all(c['impl'] != 'bf16dot' for c in _tuning._cpu_bwd_candidates(key))\n"
        "out = pykernels.flash_attention(q, q, q, causal=True)\n"
        "qd = q.double()\n"  # (the float64 answer: the fma forward keeps P in fp32, aten rounds it to bf16)
        "ref = torch.nn.functional.scaled_dot_product_attention(qd, qd, qd, is_causal=True)\n"
        "assert (out.double() - ref).abs().max() <= 2 ** -7 * ref.abs().max()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                   env=dict(os.environ, PYKERNELS_DISABLE_AVX512="1", PYKERNELS_AUTOTUNE="0"))


# ---------------------------------------------------------------------------------------------
# "fma": the native fp32 forward with AVX2 FMAs (csrc/attention/attention_cpu.cpp)
# ---------------------------------------------------------------------------------------------
needs_fma = pytest.mark.skipif(not _cpu.fma_available(), reason="this CPU lacks AVX2 + FMA (the fma kernel's)")

FMA_SHAPES = [  # (B, H, Hkv, S_q, S_k, D): key counts around the 8-key groups, 16-key chunks and 64-key
    (1, 2, 2, 5, 7, 16),        # blocks, query rows around the 64-row items and 6-row register tiles, GQA,
    (2, 4, 2, 65, 63, 32),      # S_q != S_k both ways, head dims from 16 to 512
    (1, 3, 1, 64, 129, 48),
    (1, 2, 2, 130, 65, 128),
    (1, 1, 1, 7, 200, 256),
    (2, 8, 2, 1, 300, 64),
    (1, 2, 1, 200, 3, 80),
    (1, 6, 6, 13, 13, 512),
]


@needs_fma
@pytest.mark.parametrize("shape", FMA_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fma_kernel_matches_the_oracle(shape, causal, dtype):
    """Same contract as every CPU path: bottom-right causal, rows without keys out 0 / lse -inf, out in q's
    memory order and lse laid out as aten's; fp32 accuracy whatever the input dtype (out rounded once)."""
    q, k, v = make(*shape, dtype, seed=sum(shape))
    for scale, threads in ((None, 1), (-0.7, 2), (0.3, 3)):
        sc = 1 / math.sqrt(shape[-1]) if scale is None else scale
        out, lse = _cpu.fma_forward(q, k, v, causal, sc, threads)
        ro, rl = reference(q, k, v, causal, sc)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert out.stride() == _cpu.out_strides(q, shape[-1]) and lse.stride() == _cpu.to_bshd(lse).stride()
        assert_close(out, ro, dtype, "out")
        assert_close(lse, rl, torch.float32, "lse")
        if threads > 1:  # every item is computed alone: the same bits on any thread count
            again, again_lse = _cpu.fma_forward(q, k, v, causal, sc, 1)
            assert torch.equal(out, again) and torch.equal(lse, again_lse)


@pytest.mark.skipif(not _cpu.bf16dot_available(), reason="this CPU lacks AVX-512 BF16: the tests above run the "
                    "fma kernel's AVX2 tier already")
def test_fma_kernel_avx2_tier_where_the_cpu_has_avx512():
    """The fma tests ran the AVX-512 tier; the AVX2 tier (what CPUs without AVX-512 BF16 run: forward and
    backward) passes them too, under PYKERNELS_DISABLE_AVX512=1 in a subprocess (the switch is read once per
    process)."""
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "fma and not avx2_tier"], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYKERNELS_DISABLE_AVX512="1", PYKERNELS_AUTOTUNE="0"))
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and " skipped" not in run.stdout and " failed" not in run.stdout, tail


@needs_fma
def test_fma_kernel_as_accurate_as_sdpa():
    """Large logits and long rows in fp32: the error of out against the float64 oracle within 1.5x of SDPA's
    (fp32 throughout, as aten's kernel), and lse within 1e-5 relative."""
    q, k, v = make(1, 4, 2, 300, 1000, 128, torch.float32, seed=7, scale=3.0)
    out, lse = _cpu.fma_forward(q, k, v, False, 128 ** -0.5, 2)
    ro, rl = reference(q, k, v, False)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    err, err_sdpa = (out.double() - ro).abs().max().item(), (sdpa.double() - ro).abs().max().item()
    assert err <= 1.5 * err_sdpa + 1e-6, (err, err_sdpa)
    assert ((lse.double() - rl).abs() <= 1e-5 * rl.abs().clamp_min(1)).all()


@needs_fma
@pytest.mark.parametrize("threads", [1, 2])
def test_fma_kernel_without_keys_and_where_it_does_not_apply(threads):
    """The native kernel itself with S_k = 0 (the wrapper answers that case without calling it): zero rows and
    lse -inf; a head dim not a multiple of 16 (or above 512): -1 and nothing written."""
    from pykernels import _native
    mod = _native.cpu_module("attention")

    def call(q, k, out, lse, Sk):
        B, H, Sq, D = q.shape
        return mod.fma_forward(q.data_ptr(), k.data_ptr(), k.data_ptr(), out.data_ptr(), lse.data_ptr(), B, H,
                               k.shape[1], Sq, Sk, D, q.stride()[:3], k.stride()[:3], k.stride()[:3], out.stride()[:3],
                               lse.stride(), 0.25, False, _native.dtype_code(q.dtype), threads)

    q = torch.randn(2, 4, 3, 32)
    out, lse = torch.full_like(q, 7.0), torch.full((2, 4, 3), 7.0)
    assert call(q, torch.empty(2, 2, 0, 32), out, lse, 0) == 0
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, torch.full_like(lse, -math.inf))
    for d in (24, 528):
        q2, k2 = torch.zeros(1, 1, 2, d), torch.zeros(1, 1, 2, d)
        o2, l2 = torch.full_like(q2, 7.0), torch.full((1, 1, 2), 7.0)
        assert call(q2, k2, o2, l2, 2) == -1
        assert (o2 == 7).all() and (l2 == 7).all()


@needs_fma
def test_fma_is_the_default_for_forwards_and_before_a_backward_only_its_own(monkeypatch, tmp_cache):
    """Where the CPU has AVX2 (either tier): an inference call takes the kernel on the lean and the general
    path alike (fp32, fp16; bf16 where bf16dot does not take it), and so does a call a backward may follow
    (autograd, torch.compile), whose backward is the kernel's own (the same score tiles); a head dim not a
    multiple of 16 never takes it."""
    import importlib

    pa = importlib.import_module("pykernels.attention")
    monkeypatch.setenv("PYKERNELS_AUTOTUNE", "0")  # (tmp_cache: no config memo from before)
    calls, bwd_calls = [], []
    real, real_bwd = _cpu.fma_forward, _cpu.fma_backward
    monkeypatch.setattr(_cpu, "fma_forward", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(_cpu, "fma_backward", lambda *a: bwd_calls.append(1) or real_bwd(*a))
    pa._LEAN_PLANS.clear()
    try:
        for dt in (torch.float32, torch.float16):
            q, k, v = make(1, 8, 2, 128, 128, 64, dt, seed=4)
            n, nb = len(calls), len(bwd_calls)
            with torch.no_grad():
                lean = flash_attention(q, k, v, causal=True, return_lse=True)
                general = flash_attention(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, causal=True,
                                          return_lse=True)
            assert len(calls) == n + 2
            assert torch.equal(lean[0], general[0]) and torch.equal(lean[1], general[1])
            assert_close(lean[0], reference(q, k, v, True)[0], dt, "out")
            qa = q.clone().requires_grad_()
            out = flash_attention(qa, k, v, causal=True)
            out.float().sum().backward()
            assert len(calls) == n + 3 and len(bwd_calls) == nb + 1
            qr = q.detach().double().requires_grad_()
            reference(qr, k, v, True)[0].sum().backward()
            assert_close(qa.grad, qr.grad, dt, "dq")
            flash_attention(*make(1, 8, 2, 128, 128, 40, dt), causal=True)
            assert len(calls) == n + 3
        torch._dynamo.reset()
        n = len(calls)
        torch.compile(lambda a, b, c: flash_attention(a, b, c, causal=True), backend="aot_eager",
                      fullgraph=True)(qa, k, v)
        assert len(calls) == n + 1  # (before a backward too: its own)
    finally:
        pa._LEAN_PLANS.clear()


@needs_fma
@pytest.mark.parametrize("shape", FMA_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("threads, dtype", [(1, torch.float32), (2, torch.float32), (3, torch.float32),
                                            (2, torch.bfloat16), (3, torch.float16)])
def test_fma_backward_matches_the_oracle(shape, causal, threads, dtype):
    """The native backward (fp32 arithmetic, any of the three dtypes widened, gradients rounded once) against
    the float64 oracle's gradients, with and without a gradient flowing into the lse, for a negative scale,
    from its own forward's lse and from aten's; with fewer (batch, KV head) groups than threads the threads
    split a group's (head, query block) pairs; dq/dk/dv of rows and keys no one sees are 0."""
    _native_backward_matches_the_oracle(_cpu.fma_backward, shape, causal, threads, dtype,
                                        ((None, False, "fma"), (-0.7, True, "flash"), (0.3, False, "flash")))


@needs_fma
@pytest.mark.parametrize("B, H, Hkv, threads", _STRIDED_SPLITS, ids=_STRIDED_IDS)
def test_fma_backward_reads_strided_inputs(B, H, Hkv, threads):
    """(Strided float32 q and dO are copied where dense rows are read in place.)"""
    _native_backward_reads_strided_inputs(_cpu.fma_backward, torch.float32, 48, "fma", B, H, Hkv, threads)


@needs_fma
@pytest.mark.parametrize("logit_scale", [1.0, 30.0, 300.0])
def test_fma_forward_and_backward_as_accurate_as_aten(logit_scale):
    """Training in float32 at logits up to the thousands: dq, dk, dv against the float64 oracle, from the fma
    forward and backward, and from the fma forward under aten's backward (a tuner may pair them: aten
    recomputes P from its own scores), each within 1.5x of aten's forward and backward's errors."""
    q, k, v = make(1, 4, 2, 200, 200, 64, torch.float32, seed=11, scale=math.sqrt(logit_scale))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(reference(qr, kr, vr, True)[0], (qr, kr, vr), dout.double())
    sc = 1 / math.sqrt(64)
    errs = {}
    for fwd, bwd in (("fma", "fma"), ("fma", "flash"), ("flash", "flash")):
        out, lse = _forward_impl(q, k, v, True, sc, "cpu", {"impl": fwd})
        grads = _backward_impl(dout, None, q, k, v, out, lse, True, sc, "cpu", {"impl": bwd})
        errs[fwd, bwd] = [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, ref)]
    for pair in (("fma", "fma"), ("fma", "flash")):
        for ours, aten in zip(errs[pair], errs["flash", "flash"]):
            assert ours <= 1.5 * aten + 1e-6, errs


@needs_fma
def test_fma_backward_non_finite_inputs_take_the_exact_path(monkeypatch):
    """NaN in dout (a row that sees keys) or inf in v: the fma config's backward answers on the exact
    blocked path, as the other impls; the kernel is not called."""
    monkeypatch.setenv("PYKERNELS_AUTOTUNE", "0")
    calls = []
    real = _cpu.fma_backward
    monkeypatch.setattr(_cpu, "fma_backward", lambda *a: calls.append(1) or real(*a))
    q, k, v = make(1, 4, 2, 70, 70, 32, torch.float32, seed=8)
    out, lse = _forward_impl(q, k, v, True, 0.2, "cpu", {"impl": "fma"})
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    dout[0, 1, -5, 7] = float("nan")
    got = _backward_impl(dout, None, q, k, v, out, lse, True, 0.2, "cpu", {"impl": "fma"})
    want = _backward_impl(dout, None, q, k, v, out, lse, True, 0.2, "cpu", {"impl": "blocked"})
    assert not calls
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)


@needs_fma
def test_fma_kernel_after_a_failed_allocation():
    """A call whose packed K/V cannot be allocated raises MemoryError, and the thread's next call works (the
    kept buffer had stayed null with its old size: the next smaller call wrote through a null pointer;
    review finding, shared with bf16dot)."""
    from pykernels import _native
    mod = _native.cpu_module("attention")
    q, k, v = make(1, 1, 1, 4, 4, 64, torch.float32, seed=1)

    def call(B):
        out, lse = torch.empty_like(q), torch.empty(1, 1, 4)
        bad = mod.fma_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), B, 1, 1, 4,
                              4, 64, q.stride()[:3], k.stride()[:3], v.stride()[:3], out.stride()[:3], lse.stride(),
                              0.125, False, _native.dtype_code(q.dtype), 1)
        return bad, out, lse

    assert call(1)[0] == 0
    with pytest.raises(MemoryError, match=r"^pykernels\.flash_attention: native CPU code: out of memory"):
        call(1 << 40)  # (fails at the allocation, before any input is read)
    bad, out, lse = call(1)
    assert bad == 0
    ro, rl = reference(q, k, v, False, 0.125)
    assert_close(out, ro, torch.float32, "out")


def test_outputs_take_in_place_ops_and_autocast_and_negated_gradients():
    """In grad mode the outputs are not views (aten's transposed ones were: o.mul_(0.5) raised, as SDPA's
    does not); under torch.autocast q, k, v are cast to its dtype as SDPA's are (mixed dtypes from an
    autocast layer raised); a lazily negated fp16/bf16 upstream gradient works (its finiteness check read
    it as raw bits and raised). Audit findings."""
    import torch.nn.functional as F
    q, k, v = make(1, 2, 2, 8, 8, 16, torch.float32, seed=3)
    q.requires_grad_(True)
    o = pykernels.flash_attention(q, k, v)
    assert not o._is_view()
    o.mul_(0.5)  # (a backward would then refuse it, as SDPA's: the output is saved for it)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = pykernels.flash_attention(q.bfloat16(), k, v)
        want = F.scaled_dot_product_attention(q.bfloat16(), k, v)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, pykernels.flash_attention(q.bfloat16(), k.bfloat16(), v.bfloat16()))
    for dt in (torch.float16, torch.bfloat16):
        a = q.detach().to(dt).requires_grad_(True)
        b = q.detach().to(dt).requires_grad_(True)
        g = torch.randn(1, 2, 8, 16, dtype=dt)
        pykernels.flash_attention(a, k.to(dt), v.to(dt)).backward(torch._neg_view(g))
        pykernels.flash_attention(b, k.to(dt), v.to(dt)).backward(-g)
        assert torch.equal(a.grad, b.grad)


def test_nested_and_mkldnn_inputs_get_the_layout_error():
    """Contiguous nested / mkldnn inputs reach the layout check (the lean path read a nested tensor's sizes
    first: 'Internal error: NestedTensorImpl doesn't support sizes'; audit finding)."""
    import warnings
    q = torch.randn(1, 2, 8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs = (q.to_mkldnn(), torch.nested.nested_tensor([q[0], q[0]]), q.to_sparse())
    for x in inputs:
        with pytest.raises(ValueError, match=r"^pykernels\.flash_attention: expected 'q' to be a dense"):
            pykernels.flash_attention(x, x, x)


def test_autocast_takes_array_inputs_and_keeps_the_exact_paths_in_float32():
    """Under autocast: numpy k, v are cast with a tensor q (they raised 'expected q, k, v of one dtype'), and the
    exact paths (a NaN in q recomputes the call through torch.matmul) run with autocast off, as SDPA's
    internals do (their lse was 1e-2 off; review findings)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pykernels.flash_attention(q, k.numpy(), v.numpy())
    assert out.dtype == torch.bfloat16
    q[0, 0, 3, 0] = float("nan")
    _, plain = pykernels.flash_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), return_lse=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, auto = pykernels.flash_attention(q, k, v, return_lse=True)
    torch.testing.assert_close(auto, plain, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_that_see_no_key_give_no_gradient(dtype):
    """Causal with S_q > S_k: rows 0..S_q-S_k-1 see no key; a NaN in their q or dO stays out of dK/dV (it came
    in through P = 0 times NaN inside the products: audit finding), and their dq is 0. The rest as the oracle."""
    q, k, v = make(2, 4, 2, 19, 6, 16, dtype, seed=4)
    q[0, 1, 12, 3] = float("nan")
    do = torch.randn(2, 4, 19, 16).to(dtype)
    do[1, 2, 5, 0] = float("nan")
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = pykernels.flash_attention(qa, ka, va, causal=True, return_lse=True)
    (out.float() * do.float()).sum().backward()
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ro, _ = reference(qr[:, :, 13:], kr, vr, causal=True)
    ro.backward(do[:, :, 13:].double())
    assert torch.equal(qa.grad[:, :, :13], torch.zeros_like(qa.grad[:, :, :13]))
    for name, g, w in (("dq", qa.grad[:, :, 13:], qr.grad[:, :, 13:]), ("dk", ka.grad, kr.grad), ("dv", va.grad, vr.grad)):
        assert torch.isfinite(g).all(), name
        assert_close(g, w, dtype, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_query_row_leaves_dv_of_keys_it_cannot_see_finite(dtype):
    """Causal: a NaN in query row 0 (which sees key 0 only) makes dV[0] NaN, not every dV row: P is 0 at the
    keys a row cannot see whatever its lse (exp(-inf - NaN) was NaN; audit finding). As SDPA."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4).to(dtype) for _ in range(3))
    q[0, 0, 0, 1] = float("nan")
    grads = []
    for f in (lambda *a: pykernels.flash_attention(*a, causal=True),
              lambda *a: torch.nn.functional.scaled_dot_product_attention(*a, is_causal=True)):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        f(qq, kk, vv).float().sum().backward()
        grads.append(vv.grad)
    nan_rows = torch.isnan(grads[0][0, 0]).any(-1)
    assert nan_rows.tolist() == [True] + [False] * 7, nan_rows
    assert torch.equal(nan_rows, torch.isnan(grads[1][0, 0]).any(-1))
    assert_close(grads[0][0, :, 1:], grads[1][0, :, 1:], dtype, "dv")


def test_backward_tuned_for_s_q_above_s_k_is_the_one_used(tmp_cache, monkeypatch):
    """A causal backward with S_q > S_k runs on its rows that see keys; tune() keys its entry so (it keyed the
    full S_q, an entry the backward never looked up; review finding)."""
    from pykernels import autotune
    from pykernels.attention import OP_BWD, problem_key

    monkeypatch.setenv("PYKERNELS_AUTOTUNE", "1")
    q, k, v = make(1, 2, 2, 256, 32, 64, torch.float32, seed=5)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    autotune.tune(OP_BWD, torch.randn_like(out), q, k, v, out, lse, causal=True, budget_s=0.01)
    assert autotune.lookup(OP_BWD, problem_key(q[:, :, 224:], k, causal=True), torch.device("cpu")) is not None
