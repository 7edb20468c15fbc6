"""torch.compile(fullgraph=True) through the torch.library registration (foundation issue #2):
pykernels ops are custom ops (torch.ops.pykernels.<name>) with fake implementations."""
import numpy as np
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


def test_compiled_vmap_runs_and_compiled_forward_mode_is_still_refused():
    """torch.compile(vmap(op), fullgraph=True) traced the forward-mode check's whole interpreter stack,
    which dynamo cannot (every op failed to compile; review finding). Inside torch.compile the innermost
    transform is read instead: one vmap level runs, a jvp (or a stack too deep to read) still raises
    our error naming the op, and never returns dropped tangents."""
    import pytest

    import pykernels

    g = torch.Generator().manual_seed(0)
    qw = pykernels.quantize(torch.randn(24, 64, generator=g), bits=4, group_size=32)
    x = torch.randn(4, 3, 64, generator=g)
    q = torch.randn(3, 1, 2, 5, 16, generator=g)
    rows = torch.randn(4, 100, generator=g)
    cases = {"qmatmul": (lambda a: pykernels.qmatmul(a, qw), x),
             "sort": (lambda a: pykernels.sort(a).values, rows),
             "flash_attention": (lambda a: pykernels.flash_attention(a, a, a, causal=True), q)}
    for name, (fn, inp) in cases.items():
        torch._dynamo.reset()
        want = torch.func.vmap(fn)(inp)
        torch.testing.assert_close(torch.compile(torch.func.vmap(fn), fullgraph=True)(inp), want)
        for fullgraph in (False, True):
            torch._dynamo.reset()
            jvp = torch.compile(lambda a: torch.func.jvp(fn, (a,), (torch.ones_like(a),)), fullgraph=fullgraph)
            with pytest.raises(Exception, match=rf"pykernels\.{name}: forward-mode AD"):
                jvp(inp[0])
    torch._dynamo.reset()
    nested = torch.compile(torch.func.vmap(torch.func.vmap(cases["qmatmul"][0])), fullgraph=True)
    with pytest.raises(Exception, match=r"pykernels\.qmatmul: inside torch.compile, nested torch.func transforms"):
        nested(x[None])
    torch._dynamo.reset()  # without fullgraph the frame runs eagerly, where the whole stack is read
    torch.testing.assert_close(torch.compile(torch.func.vmap(torch.func.vmap(cases["qmatmul"][0])))(x[None]),
                               torch.func.vmap(torch.func.vmap(cases["qmatmul"][0]))(x[None]))
    # non-strict torch.export runs real Python, where the whole stack is read: nested vmaps export
    # (review finding: the compile-time reading refused them there)
    sort_rows = torch.func.vmap(torch.func.vmap(cases["sort"][0]))

    class Rows(torch.nn.Module):
        def forward(self, a):
            return sort_rows(a)

    exported = torch.export.export(Rows(), (rows[None],), strict=False)
    torch.testing.assert_close(exported.module()(rows[None]), torch.sort(rows[None], stable=True).values)
    # jvp over vmap, eager: our error, not torch's missing batching rule for _unpack_dual
    with pytest.raises(NotImplementedError, match=r"pykernels\.qmatmul: forward-mode AD"):
        torch.func.jvp(torch.func.vmap(cases["qmatmul"][0]), (x,), (torch.ones_like(x),))


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
    # a numpy scalar, which dynamo traces as a 0-d array: our error naming the argument and the remedy under
    # fullgraph (the op's schema refused the symbolic float, naming nothing of ours); without fullgraph the
    # call runs eagerly, as numpy scalars do
    for s in (np.float32(0.3), np.float64(0.3)):
        with pytest.raises(Exception, match=r"flash_attention: under torch.compile, expected 'scale'.*float\(scale\)"):
            f(q, s)
        g = torch.compile(lambda q, s: pykernels.flash_attention(q, q, q, scale=s), backend="eager")
        torch.testing.assert_close(g(q, s), pykernels.flash_attention(q, q, q, scale=float(s)))


def test_backward_follows_holds_inside_torch_compile():
    """A no_grad forward under pykernels.attention.backward_follows(), then flash_attention_backward on
    its (out, lse): compiled, the forward must take aten's kernels as eager does (the thread-local flag
    was invisible to dynamo: the decode kernel's lse gave gradients off by ~1e-1 at logits ~1e4; audit
    finding). The compiled (out, lse) equal the eager ones bit for bit, and so do the gradients."""
    from pykernels.attention import backward_follows, flash_attention_backward

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, generator=g)
    q = base * 12 + torch.randn(1, 8, 1, 64, generator=g) * 0.1     # decode-shaped: "decode" is the default
    k = base * 12 + torch.randn(1, 2, 64, 64, generator=g) * 0.1
    v, dout = torch.randn(1, 2, 64, 64, generator=g), torch.randn(1, 8, 1, 64, generator=g)

    def fwd(a, b, c):
        return pykernels.flash_attention(a, b, c, scale=1.0, return_lse=True)

    compiled = torch.compile(fwd, backend="eager", fullgraph=True)
    results = []
    for f in (fwd, compiled):
        with torch.no_grad(), backward_follows():
            out, lse = f(q, k, v)
        results.append((out, lse, flash_attention_backward(dout, q, k, v, out, lse, scale=1.0)))
    (o1, l1, g1), (o2, l2, g2) = results
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_find_default_under_compile_is_checked_like_eager():
    """A constant find() default is checked under torch.compile as in eager (it had been filled in
    unchecked: -1 became 255 in a uint8 table, 7 True in a bool table, -1 2^64-1 in a uint64 one; audit
    finding); the defaults eager accepts (True, 5.0) give eager's answer under fullgraph, and a default
    passed into a dynamic compiled function fills in as eager's does."""
    import pytest

    q = torch.tensor([1, 3])
    for value_dtype, vals, bad in ((torch.uint8, [10, 20], -1), (torch.bool, [False, True], 7),
                                   (torch.uint64, [5, 6], -1)):
        torch._dynamo.reset()
        t = pykernels.HashMap(16, value_dtype=value_dtype)
        t.insert(torch.tensor([1, 2]), torch.tensor(vals, dtype=value_dtype))
        with pytest.raises(ValueError, match=r"pykernels.HashMap.find: expected 'default' within the range"):
            torch.compile(lambda a, t=t, bad=bad: t.find(a, default=bad), backend="eager")(q)
    t = pykernels.HashMap(16, value_dtype=torch.uint8)
    t.insert(torch.tensor([1, 2]), torch.tensor([10, 20], dtype=torch.uint8))
    for d in (True, 5.0, 255):
        torch._dynamo.reset()
        got = torch.compile(lambda a, d=d: t.find(a, default=d), backend="eager", fullgraph=True)(q)
        want = t.find(q, default=d)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), d
    torch._dynamo.reset()
    f = torch.compile(lambda a, d: t.find(a, default=d), backend="eager", fullgraph=True, dynamic=True)
    assert f(q, 7)[0].tolist() == [10, 7] and f(q, 9)[0].tolist() == [10, 9]


def test_numpy_inputs_compile_fullgraph():
    """numpy inputs, accepted wherever a tensor is (API.md), also under torch.compile(fullgraph=True):
    dynamo skips torch.from_dlpack, which the eager conversion uses (every op failed; audit finding)."""
    import numpy as np

    a = np.array([3, 1, 2, 5, 4], dtype=np.int64)
    x = np.ones((1, 1, 2, 4), np.float32)
    t = pykernels.HashMap(16)
    t.insert(torch.tensor([1, 2]), torch.tensor([10, 20]))
    for fn, arg, want in ((pykernels.sort_keys, a, pykernels.sort_keys(a)),
                          (lambda y: pykernels.flash_attention(y, y, y), x, pykernels.flash_attention(x, x, x)),
                          (lambda y: t.find(y)[0], a, t.find(a)[0])):
        torch._dynamo.reset()
        got = torch.compile(fn, backend="eager", fullgraph=True)(arg)
        assert torch.equal(got, want)


def test_collectives_shard_ops_compile_with_changing_dims_and_strided_inputs():
    """shard_sequence/unshard_sequence (a world of one, no torch.distributed) compiled: a dim that changes
    between calls (automatic dynamic made it a SymInt, which the checks refused), and outputs whose strides
    the fake promises (a world of one's unshard was a clone keeping a transposed input's strides, and
    inductor's stride assert failed; review findings)."""
    import collectives

    def f(x, d):
        return collectives.unshard_sequence(collectives.shard_sequence(x, layout="contiguous", dim=d),
                                            layout="contiguous", dim=d) * 2

    x = torch.randn(4, 6, 8)
    for backend in ("eager", "inductor"):
        torch._dynamo.reset()
        cf = torch.compile(f, fullgraph=True, backend=backend)
        for d in (0, 1, 2, -1):
            assert torch.equal(cf(x, d), x * 2), (backend, d)
    o = torch.randn(1, 8, 2, 4).transpose(1, 2)
    torch._dynamo.reset()
    g = torch.compile(lambda t: collectives.unshard_sequence(t, dim=2) + 1, fullgraph=True, backend="inductor")
    assert torch.equal(g(o), o + 1)


def test_collectives_ops_pass_opcheck():
    """The collectives' registered ops in a world of one (no torch.distributed): schema, fake tensors
    (shapes, dtypes, strides: a transposed and a channels_last input), autograd registration and
    aot_dispatch (review finding: the shard fakes' strides differed from the real outputs')."""
    import collectives  # noqa: F401  (registers the ops)

    ops = torch.ops.pykernels
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 6, 8, generator=g, requires_grad=True)
    for token in (False, True):
        torch.library.opcheck(ops.ring_attention.default, (q, k, k, None, True, "zigzag", "", "", token, True, ""))
    out, lse = ops.ring_attention(q.detach(), k.detach(), k.detach(), None, True, "zigzag", "", "", False, True)
    torch.library.opcheck(ops.ring_attention_backward.default,
                          (torch.randn_like(out), None, q.detach(), k.detach(), k.detach(), out, lse, 0.35, True,
                           "zigzag", "", "", False))
    x = torch.randn(2, 8, 3, 4, generator=g).transpose(1, 2).requires_grad_()
    xc = torch.randn(2, 3, 8, 4, generator=g).to(memory_format=torch.channels_last).requires_grad_()
    for t in (x, xc):
        torch.library.opcheck(ops.shard_sequence.default, (t, "", "zigzag", 2, 1))
        torch.library.opcheck(ops.unshard_sequence.default, (t, "", "contiguous", 2, 1, ""))


def test_jit_trace_records_the_registered_ops():
    """torch.jit.trace records pykernels::* ops, as it records torch.sort: the eager fast paths (which call the
    native code through data pointers) step aside while it traces. Before, a traced sort or qmatmul returned
    its uninitialized output buffer and a traced flash_attention raised (audit finding)."""
    import warnings

    qw = pykernels.quantize(torch.randn(16, 32), 4, 32)
    cases = [
        (lambda x: pykernels.sort(x).values, lambda: torch.randn(2, 2000), "pykernels::sort"),
        (lambda x: pykernels.argsort(x), lambda: torch.randn(3000), "pykernels::argsort"),
        (lambda x: pykernels.sort_keys(x), lambda: torch.randint(0, 1 << 30, (5000,), dtype=torch.int32),
         "pykernels::sort_keys"),
        (lambda x: pykernels.qmatmul(x, qw), lambda: torch.randn(4, 32), "pykernels::qmatmul"),
        (lambda q: pykernels.flash_attention(q, q, q), lambda: torch.randn(1, 2, 5, 8), "pykernels::flash_attention"),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (TorchScript's generic TracerWarnings)
        for fn, make, op in cases:
            traced = torch.jit.trace(fn, make(), check_trace=False)
            assert op in str(traced.graph), op
            x = make()
            # (a traced attention never takes the decode kernel: forward_op, so equal up to rounding)
            torch.testing.assert_close(traced(x), fn(x), rtol=1e-5, atol=1e-6, msg=op)


def test_jit_trace_of_a_module_with_attention_passes_its_own_check():
    """q, k, v from a parameter (every real model): torch.jit.trace's default check reruns the module under
    no_grad, and the op's inference flag, recorded as a constant, differed ("Graphs differed"; audit finding)."""
    import warnings


    class Attn(torch.nn.Module):
        def __init__(self, d=32, h=4):
            super().__init__()
            self.h, self.qkv = h, torch.nn.Linear(d, 3 * d)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
            return pykernels.flash_attention(q, k, v, causal=True)

    m, x = Attn(), torch.randn(2, 6, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(m, x)  # check_trace=True
    y = torch.randn(2, 6, 32)
    torch.testing.assert_close(traced(y), m(y))
    with torch.no_grad():
        torch.testing.assert_close(traced(y), m(y))
