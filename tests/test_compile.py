"""torch.compile(fullgraph=True) through the torch.library registration (foundation issue #2):
pykernels ops are custom ops (torch.ops.pykernels.<name>) with fake implementations."""
import torch

import pykernels


def test_sort_and_sort_keys_compile_fullgraph():
    torch._dynamo.reset()

    def f(x, k):
        v, i = pykernels.sort(x, dim=-1, descending=True)
        return v * 2, i, pykernels.sort_keys(k) + 1

    compiled = torch.compile(f, fullgraph=True, backend="inductor")
    x = torch.randn(8, 257)
    k = torch.randint(-1000, 1000, (5000,), dtype=torch.int32)
    v, i, ks = compiled(x, k)
    rv, ri = torch.sort(x, dim=-1, descending=True, stable=True)
    assert torch.equal(v, rv * 2) and torch.equal(i, ri)
    assert torch.equal(ks, torch.sort(k, stable=True).values + 1)


def test_segmented_sort_compiles_fullgraph_and_still_checks_offsets():
    """The offsets' value checks read the tensor, so they live inside the custom op: dynamo traces the
    public call without a graph break, and bad offsets are still a ValueError naming the op."""
    import pytest

    torch._dynamo.reset()

    def f(k, o, v):
        keys, vals = pykernels.segmented_sort(k, o, v, descending=True)
        return keys + 1, vals, pykernels.segmented_sort(k, o)[0]

    compiled = torch.compile(f, fullgraph=True, backend="inductor")
    k = torch.randint(-50, 50, (300,), dtype=torch.int32)
    v = torch.randn(300)
    o = torch.tensor([0, 10, 10, 200, 290])
    keys, vals, keys2 = compiled(k, o, v)
    rk, rv, rk2 = f(k, o, v)
    assert torch.equal(keys, rk) and torch.equal(vals, rv) and torch.equal(keys2, rk2)
    ref = k.clone()
    for a, b in zip(o[:-1].tolist(), o[1:].tolist()):
        ref[a:b] = torch.sort(k[a:b], descending=True, stable=True).values
    assert torch.equal(keys, ref + 1)
    with pytest.raises(ValueError, match=r"^pykernels\.segmented_sort: expected non-decreasing 'offsets'"):
        compiled(k, torch.tensor([0, 20, 10, 300]), v)
    with pytest.raises(ValueError, match=r"^pykernels\.segmented_sort: expected 'offsets' within \[0, 300\]"):
        compiled(k, torch.tensor([0, 301]), v)


def test_ops_are_registered_and_pass_opcheck():
    x = torch.randn(4, 33)
    torch.library.opcheck(torch.ops.pykernels.sort.default, (x, 1, False, "auto"))
    torch.library.opcheck(torch.ops.pykernels.argsort.default, (x, 0, True, "auto"))
    k = torch.randint(0, 100, (300,), dtype=torch.int64)
    torch.library.opcheck(torch.ops.pykernels.sort_keys.default, (k, False, 0, 64, "auto"))
    torch.library.opcheck(torch.ops.pykernels.sort_pairs.default, (k, torch.randn(300), False, 0, 64, "auto"))
    off = torch.tensor([0, 10, 100, 300])
    torch.library.opcheck(torch.ops.pykernels.segmented_sort.default, (k, off, False, "auto"))
    torch.library.opcheck(torch.ops.pykernels.segmented_sort_pairs.default, (k, off, torch.randn(300), False, "auto"))


def test_forward_mode_ad_is_refused_not_silently_zero():
    """The ops register reverse-mode derivatives only. Forward mode (torch.func.jvp / jacfwd, forward_ad
    dual tensors) went through them with the tangents dropped: zero derivatives, no error (review
    finding). Now a NotImplementedError naming the op, as torch's CPU flash attention gives."""
    import pytest
    from torch.autograd import forward_ad

    import pykernels

    x = torch.randn(3000)
    t = torch.randn(3000)
    cases = {"sort": lambda a: pykernels.sort(a)[0], "sort_keys": pykernels.sort_keys,
             "flash_attention": lambda a: pykernels.flash_attention(a.view(1, 1, 3000, 1)[:, :, :64],
                                                                    a.view(1, 1, 3000, 1)[:, :, :64],
                                                                    a.view(1, 1, 3000, 1)[:, :, :64])}
    qw = pykernels.quantize(torch.randn(8, 3000), bits=4, group_size=-1)
    cases["qmatmul"] = lambda a: pykernels.qmatmul(a.view(1, 3000), qw)
    for name, fn in cases.items():
        with pytest.raises(NotImplementedError, match=rf"pykernels\.{name}: forward-mode AD"):
            torch.func.jvp(fn, (x,), (t,))
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(x, t)
        with pytest.raises(NotImplementedError, match=r"pykernels\.sort: forward-mode AD"):
            pykernels.sort(dual)
        plain = pykernels.sort(x)[0]  # no dual input: runs
    assert torch.equal(plain, torch.sort(x).values)
    # reverse mode still works through the same transforms
    g = torch.func.grad(lambda a: pykernels.sort_keys(a).pow(2).sum())(x)
    torch.testing.assert_close(g, 2 * x)


def test_reverse_mode_func_transforms_match_autograd():
    """torch.func.grad / vjp / jacrev and vmap over grad (per-sample gradients) through sort,
    flash_attention (its backward is a kernel of its own) and qmatmul. torch 2.13's register_autograd
    wrapper is refused by torch.func (pytorch/pytorch#168393): every one of these raised "must override
    the setup_context staticmethod" while the forward-mode error told users to use them."""
    import torch.nn.functional as F

    import pykernels

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 37, dtype=torch.float64, generator=g)
    # sort: the gradient of a weighted sum of the sorted values goes back to where each value came from
    w = torch.linspace(-1, 1, 37, dtype=torch.float64)
    ours = torch.func.grad(lambda a: (pykernels.sort(a, dim=-1).values * w).sum())(x)
    ref = torch.func.grad(lambda a: (torch.sort(a, dim=-1, stable=True).values * w).sum())(x)
    torch.testing.assert_close(ours, ref)
    jac = torch.func.jacrev(lambda a: pykernels.sort(a).values)(x[0])
    torch.testing.assert_close(jac, torch.func.jacrev(lambda a: torch.sort(a, stable=True).values)(x[0]))
    per_row = torch.func.vmap(torch.func.grad(lambda a: (pykernels.sort(a).values * w).sum()))(x)
    torch.testing.assert_close(per_row, ref)

    # flash attention (GQA, causal) against the math of SDPA in float64, gradients in q, k and v
    q = torch.randn(1, 4, 9, 8, dtype=torch.float64, generator=g)
    k = torch.randn(1, 2, 11, 8, dtype=torch.float64, generator=g)
    v = torch.randn(1, 2, 11, 8, dtype=torch.float64, generator=g)
    dout = torch.randn(1, 4, 9, 8, dtype=torch.float64, generator=g)

    def reference(q, k, v):
        kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        mask = torch.ones(9, 11, dtype=torch.bool).tril(diagonal=11 - 9)  # bottom-right aligned
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)

    out, vjp = torch.func.vjp(lambda q, k, v: pykernels.flash_attention(q, k, v, causal=True), q, k, v)
    ref_out, ref_vjp = torch.func.vjp(reference, q, k, v)
    torch.testing.assert_close(out, ref_out)
    for got, want in zip(vjp(dout), ref_vjp(dout)):
        torch.testing.assert_close(got, want)
    dq = torch.func.grad(lambda q: pykernels.flash_attention(q, k, v, causal=True).mul(dout).sum())(q)
    torch.testing.assert_close(dq, ref_vjp(dout)[0])

    # qmatmul: d/dx of x @ W.T with W the dequantized weight, per sample too
    qw = pykernels.quantize(torch.randn(24, 64, generator=g), bits=4, group_size=32)
    W = qw.dequantize().to(torch.float64)
    xs = torch.randn(5, 64, generator=g)
    gx = torch.func.vmap(torch.func.grad(lambda a: pykernels.qmatmul(a, qw).sum()))(xs)
    torch.testing.assert_close(gx, W.sum(0).to(torch.float32).expand(5, 64), rtol=1e-5, atol=1e-5)


def test_flash_attention_scale_argument_compiles_for_every_value():
    """A scale passed as an argument of a compiled function: the second value broke the fullgraph trace
    on math.isfinite (review finding); a bad value is still refused when the op runs."""
    import pytest

    import pykernels

    torch._dynamo.reset()
    q = torch.randn(1, 2, 16, 8)

    @torch.compile(fullgraph=True, backend="eager")
    def f(q, s):
        return pykernels.flash_attention(q, q, q, scale=s)

    for s in (0.3, 0.2, 0.7):
        torch.testing.assert_close(f(q, s), pykernels.flash_attention(q, q, q, scale=s))
    with pytest.raises(Exception, match="scale"):
        f(q, float("inf"))
