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
