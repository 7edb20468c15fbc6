"""Triton flash-attention kernels against the float64 oracle of tests/test_attention.py.

Without a GPU they run under TRITON_INTERPRET=1 on small CPU tensors (the interpreter is slow: shapes
stay small, with 16x16 tiles so that several tiles, masked edges and the causal diagonal are all
exercised). The @pytest.mark.gpu tests run the compiled kernels on a real GPU, with the tuned configs.
"""

import pytest
import torch

import pykernels
from pykernels.attention import _forward_impl, _backward_impl
from pykernels.attention import _triton_configs as tc

from test_attention import assert_close, check_forward_and_grads, make, reference

pytest.importorskip("triton")

SHAPES = [
    (1, 2, 1, 20, 37, 24),   # S_q < S_k, GQA 2:1, D not a power of two
    (1, 2, 2, 37, 20, 32),   # S_q > S_k: 17 rows see no key under causal
    (2, 4, 1, 33, 33, 16),   # MQA, square, B = 2
    (1, 1, 1, 1, 1, 64),     # S = 1
    (1, 1, 1, 5, 50, 40),    # decode-like: few queries, many keys
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_interpreter_fp32_forward_and_grads(triton_interpret, shape, causal):
    q, k, v = make(*shape, torch.float32, seed=sum(shape))
    check_forward_and_grads(q, k, v, causal, backend="triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_interpreter_16bit(triton_interpret, dtype, causal):
    q, k, v = make(1, 2, 1, 20, 37, 24, dtype, seed=4)
    check_forward_and_grads(q, k, v, causal, backend="triton")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_interpreter_gpu_default_configs(triton_interpret, dtype):
    """The tile sizes a GPU would run (the tuner's defaults), on a shape with ragged edges."""
    q, k, v = make(1, 2, 1, 70, 135, 64, dtype, seed=7)
    fwd = tc.default_fwd(64, str(dtype).replace("torch.", ""))
    bwd = tc.default_bwd(64, str(dtype).replace("torch.", ""))
    for causal in (True, False):
        ro, rl = reference(q, k, v, causal)
        out, lse = _forward_impl(q, k, v, causal, 0.125, "triton", fwd)
        assert_close(out, ro, dtype, "out")
        assert_close(lse, rl, torch.float32, "lse")
        dout = torch.randn_like(out)
        qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
        o_ref, _ = reference(qr, kr, vr, causal)
        want = torch.autograd.grad(o_ref, (qr, kr, vr), dout.double())
        got = _backward_impl(dout, None, q, k, v, out, lse, causal, 0.125, "triton", bwd)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert_close(g, w, dtype, name)


def test_interpreter_lse_gradient_and_dead_rows(triton_interpret):
    q, k, v = make(1, 2, 1, 21, 9, 16, torch.float32, seed=2)
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = pykernels.flash_attention(qa, ka, va, causal=True, return_lse=True, backend="triton")
    assert torch.equal(out[:, :, :12], torch.zeros_like(out[:, :, :12])) and torch.isneginf(lse[:, :, :12]).all()
    w = torch.linspace(-1, 1, 9 * 2).view(1, 2, 9)
    (out.square().sum() + (w * lse[:, :, 12:]).sum()).backward()
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ro, rl = reference(qr, kr, vr, causal=True)
    (ro.square().sum() + (w.double() * rl[:, :, 12:]).sum()).backward()
    for name, g, w_ in (("dq", qa.grad, qr.grad), ("dk", ka.grad, kr.grad), ("dv", va.grad, vr.grad)):
        assert_close(g, w_, torch.float32, name)


def test_interpreter_dead_rows_stay_zero_when_v_holds_nan(triton_interpret):
    """Rows that see no key: out 0 and dq 0 even with a NaN in v (0 * NaN inside tl.dot); rows that see
    the NaN are NaN (fuzz finding)."""
    q, k, v = make(1, 2, 1, 6, 3, 8, torch.float32)
    v[0, 0, 2, 0] = float("nan")
    qa = q.clone().requires_grad_()
    out, lse = pykernels.flash_attention(qa, k, v, causal=True, return_lse=True, backend="triton")
    out.sum().backward()
    assert torch.isneginf(lse[:, :, :3]).all()
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert torch.equal(qa.grad[:, :, :3], torch.zeros_like(qa.grad[:, :, :3]))
    assert torch.isnan(out[:, :, 5]).any()


def test_interpreter_row_of_plus_inf_scores_has_lse_plus_inf(triton_interpret):
    """A +inf score: out NaN as SDPA, and the row's log-sum-exp +inf as on the CPU paths and in the math
    (the running sum's inf - inf had made it NaN; audit finding)."""
    q, k, v = make(1, 1, 1, 3, 4, 8, torch.float32)
    k = k.abs() + 0.1
    q[0, 0, 1, 0] = float("inf")
    out, lse = pykernels.flash_attention(q, k, v, return_lse=True, backend="triton")
    _, lse_cpu = pykernels.flash_attention(q, k, v, return_lse=True, backend="cpu")
    assert torch.isposinf(lse[0, 0, 1]) and torch.isposinf(lse_cpu[0, 0, 1])
    assert torch.isnan(out[0, 0, 1]).all() and torch.isfinite(lse[0, 0, [0, 2]]).all()


def test_interpreter_plus_inf_and_nan_scores_across_key_tiles(triton_interpret):
    """+inf scores in the first or a later key tile (several tiles: S_k past the block), alone or beside a
    NaN score in the same row: lse +inf alone and NaN with the NaN (it was +inf there: an override made
    every row whose max was +inf +inf), out NaN, and the other rows untouched; as on the CPU."""
    q, k, v = make(1, 1, 1, 5, 80, 8, torch.float32)
    k = k.abs() + 0.1
    q[0, 0, [1, 2, 3], 0] = float("inf")  # +inf scores wherever k[..., 0] > 0: every key
    k[0, 0, 70, 1] = float("nan")          # a NaN score for every row at key 70, in a later tile ...
    q[0, 0, [2, 4], 1] = 0.0               # ... except where q's component is 0 (0 * NaN is NaN: every row)
    k2 = k.clone()
    k2[0, 0, 70, 1] = 1.0                  # the same without the NaN
    for kk, want_inf in ((k, False), (k2, True)):
        out, lse = pykernels.flash_attention(q, kk, v, return_lse=True, backend="triton")
        out_c, lse_c = pykernels.flash_attention(q, kk, v, return_lse=True, backend="cpu")
        for r in (1, 2, 3):
            assert (torch.isposinf(lse[0, 0, r]) if want_inf else torch.isnan(lse[0, 0, r])), (r, lse)
            assert torch.isnan(out[0, 0, r]).all()
        assert torch.equal(torch.isnan(lse), torch.isnan(lse_c)) and torch.equal(torch.isinf(lse), torch.isinf(lse_c))
        if want_inf:
            torch.testing.assert_close(out[0, 0, [0, 4]], out_c[0, 0, [0, 4]], rtol=1e-5, atol=1e-5)


def test_interpreter_scores_near_float32_max(triton_interpret):
    """Finite scores above FLT_MAX / log2(e) (or a scale that makes them so) give the CPU paths' exact answer;
    scaled by log2(e) before the max they became inf: out NaN, lse +inf (audit finding). Gradients too."""
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    q = torch.tensor([[[[3e38, 0.0]]]])
    k = torch.tensor([[[[1.0, 0.0], [0.5, 0.0]]]])
    q2 = torch.full((1, 1, 1, 1), 2e-19)
    k2 = torch.tensor([[[[2e-19], [1e-19]]]])                      # scores 12 and 6 through scale=3e38
    for qq, kk, vv, scale in ((q, k, v, 1.0), (q2, k2, v[..., :1], 3e38)):
        want = pykernels.flash_attention(qq, kk, vv, scale=scale, return_lse=True, backend="cpu")
        got = pykernels.flash_attention(qq, kk, vv, scale=scale, return_lse=True, backend="triton")
        assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all(), got
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    # the backward: p = exp2((s - lse) * log2(e)) with lse ~ 2.4e38 (its lse * log2(e) was inf: p and every
    # gradient 0); scores 2.4e38 and 2.4e38 - 1e37 give p ~ (1, 0) and a finite dv
    qa = torch.tensor([[[[2.4e38, 0.0]]]], requires_grad=True)
    va = v.clone().requires_grad_()
    out = pykernels.flash_attention(qa, torch.tensor([[[[1.0, 0.0], [0.95, 0.0]]]]), va, backend="triton")
    out.sum().backward()
    assert torch.equal(va.grad, torch.tensor([[[[1.0, 1.0], [0.0, 0.0]]]])), va.grad


def test_interpreter_dead_rows_take_no_part_in_dk_dv(triton_interpret):
    """Causal rows that see no key have zero gradient and give none: a NaN in such a row's q or dO reached
    dK/dV through 0 * NaN, the tile's first rows being loaded with the live ones (audit finding)."""
    q, k, v = make(1, 1, 1, 21, 4, 8, torch.float32, seed=3)   # rows 0..16 see no key
    q[0, 0, 16, 0] = float("nan")
    do = torch.randn(1, 1, 21, 8)
    do[0, 0, 15, 1] = float("nan")
    grads = {}
    for backend in ("triton", "cpu"):
        qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
        pykernels.flash_attention(qa, ka, va, causal=True, backend=backend).backward(do)
        grads[backend] = (qa.grad, ka.grad, va.grad)
    qg, kg, vg = grads["triton"]
    assert torch.isfinite(kg).all() and torch.equal(qg[:, :, :17], torch.zeros_like(qg[:, :, :17]))
    torch.testing.assert_close(kg, grads["cpu"][1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(vg, grads["cpu"][2], rtol=1e-5, atol=1e-6)
    assert torch.isfinite(vg).all() and torch.equal(grads["cpu"][0][:, :, :17], qg[:, :, :17])


def test_interpreter_empty_and_strided(triton_interpret):
    for shape in [(0, 2, 2, 4, 4, 16), (1, 2, 1, 3, 0, 16), (1, 2, 2, 0, 5, 16)]:
        q, k, v = make(*shape, torch.float32)
        out, lse = pykernels.flash_attention(q, k, v, causal=True, return_lse=True, backend="triton")
        assert out.shape == q.shape and torch.isneginf(lse).all()
    base = torch.randn(1, 19, 2, 32)
    q = base.transpose(1, 2)                        # non-contiguous: strides go to the kernel as they are
    k = torch.randn(1, 23, 1, 32).transpose(1, 2)
    v = torch.randn(1, 23, 1, 32).transpose(1, 2)
    snap = [t.clone() for t in (q, k, v)]
    check_forward_and_grads(q, k, v, True, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), snap))


def test_triton_errors(triton_interpret):
    q, k, v = make(1, 1, 1, 4, 4, 16, torch.float64)
    with pytest.raises(TypeError, match="backend 'triton' supports float16"):
        pykernels.flash_attention(q, k, v, backend="triton")
    q, k, v = make(1, 1, 1, 2, 2, 264, torch.float32)
    with pytest.raises(ValueError, match="head dims up to 256"):
        pykernels.flash_attention(q, k, v, backend="triton")


def test_aot_specs_cover_every_config():
    """Every config the tuner may pick (head dims 64/128/256, 16-bit and fp32) has an AOT spec, so
    tests/test_gpu_build.py proves it compiles for sm_90 without spills."""
    from pykernels.attention import _triton

    names = {(s.name, tuple(sorted(s.constexprs.items())), s.num_warps, s.num_stages) for s in _triton.AOT_SPECS}
    for d in (64, 128, 256):
        for dtype in ("bfloat16", "float32"):
            for c in tc.fwd_configs(d, dtype):
                spec = _triton._fwd_spec(d, dtype, c)
                assert (spec.name, tuple(sorted(spec.constexprs.items())), spec.num_warps, spec.num_stages) in names
            for c in tc.bwd_configs(d, dtype):
                for spec in _triton._bwd_specs(d, dtype, c):
                    assert (spec.name, tuple(sorted(spec.constexprs.items())), spec.num_warps,
                            spec.num_stages) in names


# ---------------------------------------------------------------------------------------------
# Real GPU
# ---------------------------------------------------------------------------------------------
GPU_SHAPES = [
    (2, 8, 8, 1000, 1000, 64),
    (1, 8, 2, 333, 1029, 128),   # GQA 4:1, S_q < S_k
    (1, 4, 1, 1029, 333, 96),    # MQA, S_q > S_k, D padded to 128
    (1, 2, 2, 257, 257, 256),
    (3, 2, 1, 1, 517, 32),       # decode
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_triton_matches_oracle(shape, causal, dtype):
    q, k, v = (t.cuda() for t in make(*shape, dtype, seed=sum(shape)))
    check_forward_and_grads(q, k, v, causal, backend="triton", tol=2.0)
    check_forward_and_grads(q, k, v, causal, backend="auto", tol=2.0, check_grads=False)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_every_config_runs(d):
    """Each listed config launches (shared memory fits) and agrees with the oracle."""
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (t.cuda() for t in make(1, 4, 2, 300, 517, d, dtype, seed=d))
        ro, rl = reference(q, k, v, True)
        dout = torch.randn_like(q)
        qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
        o_ref, _ = reference(qr, kr, vr, True)
        want = torch.autograd.grad(o_ref, (qr, kr, vr), dout.double())
        name = str(dtype).replace("torch.", "")
        for cfg in tc.fwd_configs(d, name):
            out, lse = _forward_impl(q, k, v, True, d ** -0.5, "triton", cfg)
            assert_close(out, ro, dtype, f"out {cfg}", 2.0)
            assert_close(lse, rl, torch.float32, f"lse {cfg}", 2.0)
        for cfg in tc.bwd_configs(d, name):
            got = _backward_impl(dout, None, q, k, v, out, lse, True, d ** -0.5, "triton", cfg)
            for n, g, w in zip(("dq", "dk", "dv"), got, want):
                assert_close(g, w, dtype, f"{n} {cfg}", 2.0)


@pytest.mark.gpu
def test_gpu_compile_and_autotune(tmp_cache):
    import pykernels.autotune as at

    q, k, v = (t.cuda() for t in make(1, 8, 2, 512, 512, 64, torch.bfloat16))
    torch._dynamo.reset()
    f = torch.compile(lambda a, b, c: pykernels.flash_attention(a, b, c, causal=True), fullgraph=True)
    torch.testing.assert_close(f(q, k, v), pykernels.flash_attention(q, k, v, causal=True))
    cfg = at.tune("flash_attention", q, k, v, causal=True, budget_s=0.2)
    assert cfg in tc.fwd_configs(64, "bfloat16")
    check_forward_and_grads(q, k, v, True, backend="auto", tol=2.0)


def test_huge_strides_are_made_int32_safe():
    """In-head offsets are 32-bit in the kernels: a view whose rows are 2**30 elements apart is copied
    to a contiguous tensor first, and a head too large even then is a clear error (meta tensors: no data)."""
    from pykernels.attention import _triton

    t = torch.empty_strided((1, 1, 3, 2), (0, 0, 2 ** 30, 1), device="meta")
    fixed = _triton._i32_offsets(t)
    assert fixed.is_contiguous() and fixed.shape == t.shape
    ok = torch.empty((2, 4, 100, 64), device="meta").transpose(1, 2)
    assert _triton._i32_offsets(ok) is ok
    with pytest.raises(ValueError, match="S\\*D < 2\\*\\*31"):
        _triton._i32_offsets(torch.empty((1, 1, 2 ** 25, 128), device="meta"))


from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(Hkv=st.integers(1, 2), g=st.integers(1, 2), Sq=st.integers(1, 24), Sk=st.integers(1, 24),
       D=st.integers(1, 40), causal=st.booleans(), seed=st.integers(0, 1000))
def test_interpreter_hypothesis_shapes(triton_interpret, Hkv, g, Sq, Sk, D, causal, seed):
    q, k, v = make(1, Hkv * g, Hkv, Sq, Sk, D, torch.float32, seed=seed)
    check_forward_and_grads(q, k, v, causal, backend="triton")
