"""The registered ops (torch.ops.pykernels.*) called directly check their arguments as the public
functions do (API.md: each op is a torch.library op users may call). Before, they passed whatever they
were given to the kernels: values shorter than the keys were a segfault or a heap corruption, H not a
multiple of Hkv a SIGFPE, a wrong n for qmatmul read past the weight (review findings)."""
import pytest
import torch

import pykernels
from pykernels.attention import flash_attention_backward

ops = torch.ops.pykernels


def test_sort_ops_check_their_arguments():
    k = torch.randn(5000)
    with pytest.raises(ValueError, match=r"pykernels\.sort_pairs: expected 'values' of length 5000"):
        ops.sort_pairs(k, torch.randn(10), False, 0, 32, "cpu")
    off = torch.tensor([0, 2500, 5000])
    with pytest.raises(ValueError, match=r"pykernels\.segmented_sort_pairs: expected 'values' of length 5000"):
        ops.segmented_sort_pairs(k, off, torch.randn(10), False, "cpu")
    with pytest.raises(ValueError, match=r"pykernels\.segmented_sort: expected at least one offset"):
        ops.segmented_sort(k, torch.empty(0, dtype=torch.int64), False, "cpu")
    with pytest.raises(ValueError, match=r"pykernels\.sort: expected 'dim'"):
        ops.sort(k, 5, False, "cpu")
    with pytest.raises(TypeError, match=r"pykernels\.argsort"):
        ops.argsort(torch.randn(4, dtype=torch.complex64), 0, False, "cpu")
    with pytest.raises(ValueError, match=r"pykernels\.sort_keys"):
        ops.sort_keys(torch.randn(4, 4), False, 0, -1, "cpu")  # sorted the flattened tensor before
    with pytest.raises(ValueError, match=r"pykernels\.sort_keys: expected 0 <= begin_bit"):
        ops.sort_keys(k, False, 0, 40, "cpu")
    for end_bit in (-5, -2):  # only -1 stands for None (every negative did: review finding)
        with pytest.raises(ValueError, match=r"pykernels\.sort_keys: expected 0 <= begin_bit"):
            ops.sort_keys(k, False, 0, end_bit, "cpu")
        with pytest.raises(ValueError, match=r"pykernels\.sort_pairs: expected 0 <= begin_bit"):
            ops.sort_pairs(k, torch.arange(5000), False, 0, end_bit, "cpu")
    # and the ops still work
    v, i = ops.sort(k, 0, False, "cpu")
    torch.testing.assert_close(v, torch.sort(k, stable=True).values)
    kk, vv = ops.sort_pairs(k, torch.arange(5000), False, 0, -1, "cpu")
    assert torch.equal(kk, torch.sort(k, stable=True).values) and torch.equal(vv, torch.sort(k, stable=True).indices)


def test_attention_ops_check_their_arguments():
    q = torch.randn(1, 2, 8, 4)
    kv = torch.randn(1, 3, 8, 4)
    with pytest.raises(ValueError, match=r"pykernels\.flash_attention: expected the query heads H=2"):
        ops.flash_attention(q, kv, kv, False, 0.5, "cpu")
    with pytest.raises(ValueError, match="4 dimensions"):
        ops.flash_attention(q[0], q[0], q[0], False, 0.5, "cpu")
    out, lse = ops.flash_attention(q, q, q, False, 0.5, "cpu")
    with pytest.raises(ValueError, match=r"pykernels\.flash_attention_backward: expected 'lse' of shape"):
        ops.flash_attention_backward(torch.ones_like(out), None, q, q, q, out, lse[:, :, :3], False, 0.5, "cpu")
    with pytest.raises(ValueError, match=r"expected 'dout' of shape"):
        ops.flash_attention_backward(out[:, :1], None, q, q, q, out, lse, False, 0.5, "cpu")
    dq, dk, dv = ops.flash_attention_backward(torch.ones_like(out), None, q, q, q, out, lse, False, 0.5, "cpu")
    assert dq.shape == q.shape and bool(torch.isfinite(dq).all())


def test_flash_attention_backward_takes_numpy_like_q():
    q = torch.randn(1, 2, 8, 4)
    out, lse = pykernels.flash_attention(q, q, q, return_lse=True)
    dq, _, _ = flash_attention_backward(torch.ones_like(out).numpy(), q, q, q, out.numpy(), lse)
    want, _, _ = flash_attention_backward(torch.ones_like(out), q, q, q, out, lse)
    torch.testing.assert_close(dq, want)


def test_qmatmul_op_checks_its_arguments():
    w = torch.randn(16, 96)
    qw = pykernels.quantize(w, bits=4, group_size=32)
    x = torch.randn(3, 96)
    args = [x, qw.packed, qw.scales, qw.offsets, None, None, None, 16, 96, 4, 32, 0, "cpu"]
    y = ops.qmatmul(*args)
    torch.testing.assert_close(y, pykernels.qmatmul(x, qw))
    for i, bad, what in ((7, 100000, "packed"), (9, 8, "packed"), (10, 128, "scales"), (8, 64, "'x'"),
                         (9, 9, "bits"), (10, 48, "group_size"), (11, 3, "planes")):
        a = list(args)
        a[i] = bad
        with pytest.raises(ValueError, match=rf"pykernels\.qmatmul: .*{what}"):
            ops.qmatmul(*a)
    a = list(args)
    a[4] = qw.ensure_planes()[:-4]
    a[5] = qw.code_sums
    a[11] = 4
    with pytest.raises(ValueError, match="planes"):
        ops.qmatmul(*a)


def test_collectives_ops_check_their_arguments():
    """The collectives' registered ops (what they trace into under torch.compile), called directly in a
    world of one (no torch.distributed): the public functions' errors, naming the op."""
    import collectives  # noqa: F401  (registers the ops)

    q = torch.randn(1, 4, 6, 8)
    k = torch.randn(1, 2, 6, 8)
    out, lse = ops.ring_attention(q, k, k, None, True, "zigzag", "", "", False, True)
    torch.testing.assert_close(out, pykernels.flash_attention(q, k, k, causal=True))
    with pytest.raises(ValueError, match=r"collectives\.ring_attention: expected the number of q heads"):
        ops.ring_attention(q, torch.randn(1, 3, 6, 8), torch.randn(1, 3, 6, 8), None, False, "zigzag", "", "",
                           False, False)
    with pytest.raises(ValueError, match=r"collectives\.token_ring_attention: expected 'layout'"):
        ops.ring_attention(q, k, k, None, False, "diagonal", "", "", True, False)
    with pytest.raises(ValueError, match=r"collectives\.ring_attention: expected 'scale'"):
        ops.ring_attention(q, k, k, -1.0, False, "zigzag", "", "", False, False)
    g = torch.randn_like(out)
    for bad in ({"lse": lse[:, :, :3]}, {"out": out.double()}, {"dout": g[:, :2]}, {"dlse": lse[..., None]}):
        args = dict(dout=g, dlse=None, q=q, k=k, v=k, out=out, lse=lse)
        args.update(bad)
        name = next(iter(bad))
        with pytest.raises(ValueError, match=rf"collectives\.ring_attention \(backward\): expected '{name}'"):
            ops.ring_attention_backward(*args.values(), 0.3, True, "zigzag", "", "", False)
    dq, dk, dv = ops.ring_attention_backward(g, None, q, k, k, out, lse, 8 ** -0.5, True, "zigzag", "", "", False)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape

    x = torch.randn(3, 8)
    assert torch.equal(ops.shard_sequence(x, "", "zigzag", 1, 1), x)
    with pytest.raises(ValueError, match=r"collectives\.shard_sequence: expected 'layout'"):
        ops.shard_sequence(x, "", "striped", 1, 1)
    with pytest.raises(ValueError, match=r"collectives\.shard_sequence: expected 'dim'"):
        ops.shard_sequence(x, "", "zigzag", 2, 1)
    with pytest.raises(ValueError, match=r"collectives\.shard_sequence: expected the length along dim 0"):
        ops.shard_sequence(x, "", "zigzag", 0, 1)
    with pytest.raises(RuntimeError, match=r"collectives\.shard_sequence: the process group '' has 1 ranks, not "
                                           r"the 2"):
        ops.shard_sequence(x, "", "zigzag", 1, 2)
    with pytest.raises(ValueError, match=r"collectives\.unshard_sequence: layout 'zigzag' needs an even"):
        ops.unshard_sequence(x, "", "zigzag", 0, 1)
    assert torch.equal(ops.unshard_sequence(x, "", "contiguous", 0, 1), x)

    with pytest.raises(RuntimeError, match=r"collectives\.all_reduce: torch\.distributed is not initialized"):
        ops.all_reduce_(x, "sum", "", "auto", [], [])


def test_ops_refuse_meta_tensors_mixed_with_real_ones():
    """A meta tensor among real ones sent the call to the op's fake, whose outputs were uninitialized memory
    on the first tensor's device, returned with no error (a QuantLinear left on meta, a model built with
    init_empty_weights; audit finding). All-meta calls still give their shapes; empty inputs of a huge
    shape sort at once (torch.sort walked 2**40 empty rows)."""
    x = torch.randn(1, 1, 2, 4)
    m = torch.randn(1, 1, 2, 4, device="meta")
    with pytest.raises(RuntimeError, match=r"pykernels\.flash_attention: expected all tensors on one device"):
        ops.flash_attention(x, m, m, False, 0.5, "auto")
    with pytest.raises(RuntimeError, match=r"pykernels\.segmented_sort: expected all tensors on one device"):
        ops.segmented_sort(torch.tensor([3, 1, 2]), torch.tensor([0, 3], device="meta"), False, "auto")
    with pytest.raises(RuntimeError, match=r"pykernels\.sort_pairs: expected all tensors on one device"):
        ops.sort_pairs(torch.tensor([3, 1, 2]), torch.empty(3, device="meta"), False, 0, -1, "auto")
    layer = pykernels.QuantLinear(256, 64, device="meta")
    with pytest.raises(RuntimeError, match=r"pykernels\.QuantLinear\.forward: expected 'x' on the layer's device meta"):
        layer(torch.randn(4, 256))
    assert layer(torch.randn(4, 256, device="meta")).shape == (4, 64)
    assert ops.flash_attention(m, m, m, False, 0.5, "auto")[0].device.type == "meta"
    v, i = pykernels.sort(torch.empty(2 ** 40, 0))
    assert v.shape == i.shape == (2 ** 40, 0)
