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
