"""Tuning of the CUDA/HIP Onesweep sort (csrc/sort/sort.cu; issue #3): the per-call config (bin_items,
hist_threads, hist_keys_per_block), its checks, and the backend="cuda" autotune Tunables of
pykernels/sort/_tune.py. The first half runs anywhere (registration, defaults, candidates, errors, keys);
the @pytest.mark.gpu half runs every candidate config on a real GPU against torch.sort."""
import json

import pytest
import torch

import pykernels
import pykernels.autotune as at
from pykernels.sort import _cuda

OPS = ("sort_keys", "sort_pairs", "sort", "argsort", "segmented_sort")
OLD_CONSTANTS = {"bin_items": 15, "hist_threads": 512, "hist_keys_per_block": 1 << 15, "rank": 0}  # before tuning


def tunable(op):
    return at._REGISTRY[(op, "cuda")]


def native():
    return pytest.importorskip("pykernels._cuda_sort", reason="built without nvcc/hipcc")


# ---------------------------------------------------------------------------------------------
# Without a GPU
# ---------------------------------------------------------------------------------------------
def test_every_cuda_sort_op_has_a_tunable():
    regs = {(t.op, t.backend) for t in at.registered("sort")}
    for op in OPS:
        assert (op, "cuda") in regs, op
        assert tunable(op).group == "sort"


@pytest.mark.parametrize("op", OPS)
def test_default_is_the_old_constants_and_a_candidate(op, tmp_cache):
    """Keys alone keep the old constants (3840-key tiles); ops whose keys carry a payload default to
    2048-key tiles (measured on an H200: 2^28 uint32 + int32 pairs 15.2 ms against 17.8 ms)."""
    want = OLD_CONSTANTS if op == "sort_keys" else dict(OLD_CONSTANTS, bin_items=8)
    assert OLD_CONSTANTS == _cuda.DEFAULT_CONFIG
    for key in ({"dtype": "uint32", "n": 1 << 20}, {"dtype": "float64", "n": 1 << 10, "rows": 1},
                {"dtype": "int64", "n": 1 << 32, "value_bytes": 8}):
        d = tunable(op).default(key)
        assert d == want
        assert d in tunable(op).candidates(key)
    assert at.config_for(op, "cuda", {"dtype": "int32", "n": 4096}, "cpu") == want


def test_native_defaults_are_the_old_constants():
    m = native()
    assert m.tile_keys() == 256 * 15 == 3840
    assert m.temp_bytes(1 << 20, 4, 4, 0, 32) == m.temp_bytes(1 << 20, 4, 4, 0, 32, 15)


@pytest.mark.parametrize("key, items", [
    ({"dtype": "uint32", "n": 1 << 20}, (8, 11, 15, 19)),
    ({"dtype": "float16", "n": 1 << 20}, (8, 11, 15, 19)),
    ({"dtype": "int32", "n": 1 << 20, "value_bytes": 2}, (8, 11, 15, 19)),
    ({"dtype": "uint32", "n": 1 << 20, "value_bytes": 4}, (8, 11, 15, 19)),
    ({"dtype": "uint32", "n": 1 << 20, "value_bytes": 8}, (8, 11, 15)),   # a direct 8-byte payload
    ({"dtype": "float64", "n": 1 << 20}, (8, 11, 15)),                    # 8-byte keys
    ({"dtype": "uint64", "n": 1 << 20, "rows": 1}, (8, 11, 15)),
    ({"dtype": "int32", "n": 1 << 31}, (8, 11, 15)),                      # int64 indices from 2^31 keys
])
def test_candidates_are_the_compiled_configs(key, items):
    for op in OPS:
        cands = tunable(op).candidates(key)
        assert len(cands) == len({json.dumps(c, sort_keys=True) for c in cands}), "duplicates"
        assert sorted({c["bin_items"] for c in cands}) == list(items)
        shapes = {(c["hist_threads"], c["hist_keys_per_block"]) for c in cands}
        assert shapes == {(t, t * k) for t in (256, 512, 1024) for k in (16, 64)}
        assert sorted({c["rank"] for c in cands}) == [0, 1]
        assert len(cands) == 6 * len(items) * 2
        # valid for the widest Onesweep call of that key (and so for every narrower one)
        wide = 8 if items == (8, 11, 15) else 4
        for c in cands:
            assert _cuda.check_config(op, c, wide, wide) == c
            assert _cuda.check_config(op, c, 4, 4) == c


def test_python_and_native_config_tables_agree():
    m = native()
    for kb in (4, 8):
        for vb in (0, 4, 8):
            for items in range(1, 33):
                ok = items in _cuda.bin_items_choices(kb, vb)
                try:
                    m.temp_bytes(1000, kb, vb, 0, 8 * kb, items, "sort_pairs")
                    accepted = True
                except ValueError as exc:
                    assert "pykernels.sort_pairs: expected config 'bin_items'" in str(exc)
                    accepted = False
                assert accepted == ok, (kb, vb, items)
    for items in _cuda.BIN_ITEMS:
        assert m.tile_keys(items) == _cuda.BIN_THREADS * items
    # smaller tiles need more tile status words
    assert m.temp_bytes(1 << 20, 4, 0, 0, 32, 8) > m.temp_bytes(1 << 20, 4, 0, 0, 32, 19)


@pytest.mark.parametrize("cfg, match", [
    ({"bin_items": 19}, r"pykernels\.argsort: expected config 'bin_items' in \{8, 11, 15\} for 8-byte keys"),
    ({"bin_items": 12}, r"'bin_items' in \{8, 11, 15\}"),
    ({"hist_threads": 384}, r"pykernels\.argsort: expected config 'hist_threads' in \{256, 512, 1024\}, got 384"),
    ({"hist_keys_per_block": 100}, r"'hist_keys_per_block' in \[1024, 1048576\], got 100"),
    ({"bin_item": 15}, r"pykernels\.argsort: unknown CUDA sort config entry 'bin_item'"),
    ({"rank": 2}, r"pykernels\.argsort: expected config 'rank' in \{0, 1\}, got 2"),
])
def test_bad_configs_are_clear_errors(cfg, match):
    # checked before any allocation or launch, so CPU tensors reach the check on any machine
    x = torch.zeros(100, dtype=torch.int64)
    with pytest.raises(ValueError, match=match):
        _cuda.sort_rows(x.view(1, -1), False, False, config=cfg)


def test_bad_config_types_and_op_names():
    with pytest.raises(TypeError, match=r"pykernels\.sort_keys: expected an int for config 'bin_items', got float"):
        _cuda.sort_1d(torch.zeros(8, dtype=torch.uint32), None, False, 0, None, config={"bin_items": 15.0})
    with pytest.raises(TypeError, match="expected an int for config 'hist_threads', got bool"):
        _cuda.check_config("sort", {"hist_threads": True}, 4, 4)
    with pytest.raises(ValueError, match=r"pykernels\.sort_pairs: .*'bin_items' in \{8, 11, 15\} for 4-byte keys "
                                         r"and 8-byte payloads, got 19"):
        _cuda.sort_1d(torch.zeros(8, dtype=torch.uint32), torch.zeros(8, dtype=torch.int64), False, 0, None,
                      config={"bin_items": 19})
    with pytest.raises(ValueError, match=r"pykernels\.segmented_sort: expected config 'bin_items'"):
        _cuda.segmented(torch.zeros(8, dtype=torch.int32), torch.tensor([0, 8]), None, False, config={"bin_items": 3})


def test_native_entry_checks_configs_before_the_gpu():
    m = native()
    for kw, what in ((dict(bin_items=19), "bin_items"), (dict(hist_threads=128), "hist_threads"),
                     (dict(hist_keys_per_block=1 << 21), "hist_keys_per_block"), (dict(rank=2), "rank")):
        with pytest.raises(ValueError, match=rf"pykernels\.sort_keys: expected config '{what}'"):
            m.onesweep(0, 0, 0, 0, 10, 8, 0, 0, 64, 0, 0, 0, op="sort_keys", **kw)


def _recorded_keys(monkeypatch):
    """The (op, key) pairs that pykernels.sort's dispatch is called with."""
    import sys

    S = sys.modules["pykernels.sort"]  # the module (the package attribute `sort` is the function)
    seen = []
    real = S.dispatch

    def spy(op, device, backend="auto", key=None, **kw):
        seen.append((op, key))
        return real(op, device, backend, key, **kw)
    monkeypatch.setattr(S, "dispatch", spy)
    return seen


def test_tunable_keys_are_the_keys_dispatch_builds(monkeypatch):
    seen = _recorded_keys(monkeypatch)
    x = torch.randint(0, 1000, (3000,), dtype=torch.int32)
    x2 = x.view(30, 100).to(torch.float64)
    vals = torch.arange(3000, dtype=torch.int16)
    off = torch.tensor([0, 10, 2000, 3000])
    calls = [("sort_keys", lambda: pykernels.sort_keys(x, backend="cpu"), (x,), {}),
             ("sort_pairs", lambda: pykernels.sort_pairs(x, vals, backend="cpu"), (x, vals), {}),
             ("sort", lambda: pykernels.sort(x2, backend="cpu"), (x2,), {}),
             ("argsort", lambda: pykernels.argsort(x, backend="cpu"), (x,), {}),
             ("segmented_sort", lambda: pykernels.segmented_sort(x, off, backend="cpu"), (x,), {"offsets": off})]
    for op, call, args, kwargs in calls:
        seen.clear()
        call()
        assert seen and seen[0][0] == op
        assert tunable(op).make_key(*args, **kwargs) == seen[0][1], op


def test_tunable_keys_are_stable():
    x = torch.zeros(3000, dtype=torch.uint32)
    # pinned: a cache written by one version must be found by the next
    assert at._entry_key("sort_keys", "cuda", tunable("sort_keys").make_key(x)) == \
        'sort_keys|cuda|{"dtype": "uint32", "n": 4096}'
    assert at._entry_key("sort_pairs", "cuda", tunable("sort_pairs").make_key(x, torch.zeros(3000))) == \
        'sort_pairs|cuda|{"dtype": "uint32", "n": 4096, "value_bytes": 4}'
    assert tunable("sort").make_key(x.view(3, 1000)) == {"dtype": "uint32", "n": 4096, "rows": 4}
    assert tunable("segmented_sort").make_key(x, offsets=torch.tensor([0, 5, 3000])) == \
        {"dtype": "uint32", "n": 4096, "segments": 2}
    # sizes within a power-of-two bucket share a key
    for op in ("sort_keys", "argsort"):
        assert tunable(op).make_key(torch.zeros(2049)) == tunable(op).make_key(torch.zeros(4096))


def test_examples_are_empty_without_the_cuda_backend():
    from pykernels._backend import backends

    if backends()["cuda"]:
        pytest.skip("the CUDA backend runs here")
    for op in OPS:
        assert tunable(op).examples(None) == []


# ---------------------------------------------------------------------------------------------
# On a GPU: every candidate config against torch.sort
# ---------------------------------------------------------------------------------------------
def _random_bits(dtype, n, seed, low_entropy=False):
    """Full-range random unsigned keys on the GPU (uint32/uint64 through a same-width signed view)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    iv = torch.int32 if dtype == torch.uint32 else torch.int64
    info = torch.iinfo(iv)
    k = torch.randint(info.min, info.max, (n,), generator=g, device="cuda", dtype=iv)
    if low_entropy:  # equal keys everywhere and constant digits: trivial passes are skipped
        k = k & 0x0F0F
    return k.view(dtype)


def _ref_order(keys):
    """Stable ascending order of unsigned keys by torch.sort on an order-preserving int64 image."""
    if keys.dtype == torch.uint32:
        img = keys.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    else:
        img = keys.view(torch.int64) ^ torch.iinfo(torch.int64).min  # flip the sign bit
    return torch.sort(img, stable=True).indices


DIRECT = [(torch.uint32, None), (torch.uint32, torch.int32), (torch.uint32, torch.int64),
          (torch.uint64, None), (torch.uint64, torch.int32), (torch.uint64, torch.int64)]


@pytest.mark.gpu
@pytest.mark.parametrize("kdt, vdt", DIRECT, ids=[f"{k}-{v}".replace("torch.", "") for k, v in DIRECT])
def test_every_config_sorts_keys_and_pairs_like_torch(kdt, vdt):
    """The direct Onesweep paths (uint32/uint64 keys, 4/8-byte payloads) with every candidate of their key,
    at sizes around the config's tile (one tile short, exact, one over, many) and past 2^20."""
    op = "sort_keys" if vdt is None else "sort_pairs"
    key = {"dtype": str(kdt).replace("torch.", ""), "n": 1 << 21}
    if vdt is not None:
        key["value_bytes"] = vdt.itemsize
    cands = tunable(op).candidates(key)
    assert OLD_CONSTANTS in cands
    for ci, cfg in enumerate(cands):
        tile = 256 * cfg["bin_items"]
        for n, low in ((tile - 1, False), (tile, False), (tile + 1, False), (37 * tile + 5, False),
                       ((1 << 21) + 3, False), ((1 << 20) + 1, True)):
            keys = _random_bits(kdt, n, seed=n + ci, low_entropy=low)
            vals = torch.arange(n, dtype=vdt, device="cuda") if vdt is not None else None
            k, v = _cuda.sort_1d(keys, vals, False, 0, None, config=cfg)
            order = _ref_order(keys)
            what = f"{kdt} {vdt} n={n} low={low} {cfg}"
            iv = torch.int32 if kdt == torch.uint32 else torch.int64  # unsigned tensors cannot be indexed
            assert torch.equal(k.view(iv), keys.view(iv)[order]), what
            if vdt is not None:
                assert torch.equal(v.to(torch.int64), order), what


def _ref_segmented(keys, off):
    out = keys.clone()
    o = off.tolist()
    for a, b in zip(o[:-1], o[1:]):
        out[a:b] = torch.sort(keys[a:b], stable=True).values
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_every_candidate_through_the_tunable_run(op):
    """The (encoded key, index) paths that sort/argsort/segments and non-direct keys take, through the
    Tunable's own `run`, with every candidate of the example's key."""
    n = (1 << 20) + 7
    g = torch.Generator().manual_seed(5)
    if op == "sort_keys":
        x = torch.randn(n, generator=g).cuda()
        args, kwargs = (x,), {}
    elif op == "sort_pairs":
        x = torch.randint(-(1 << 40), 1 << 40, (n,), generator=g).cuda()
        args, kwargs = (x, (torch.arange(n, device="cuda") % 32768).to(torch.int16)), {}  # not a direct path
    elif op == "sort":
        x = torch.randint(0, 50, (n - 7,), generator=g).to(torch.float64).cuda().view(1024, -1)
        args, kwargs = (x,), {}
    elif op == "argsort":
        x = torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int32).cuda()
        args, kwargs = (x,), {}
    else:
        x = torch.randint(-(1 << 30), 1 << 30, (n,), generator=g, dtype=torch.int32).cuda()
        off = torch.tensor([0, 0, 3, 3840, 3841, 100000, n - 1, n], device="cuda")
        args, kwargs = (x,), {"offsets": off}
    t = tunable(op)
    key = t.make_key(*args, **kwargs)
    cands = t.candidates(key)
    assert t.default(key) in cands
    ref = torch.sort(x, dim=-1, stable=True)
    for cfg in cands:
        out = t.run(cfg, *args, **kwargs)
        if op == "sort_keys":
            assert torch.equal(out[0], ref.values), cfg
            k = _cuda.sort_1d(x, None, True, 0, None, config=cfg)[0]
            assert torch.equal(k, torch.sort(x, descending=True, stable=True).values), cfg
        elif op == "sort_pairs":
            assert torch.equal(out[0], ref.values) and torch.equal(out[1].to(torch.int64), ref.indices % 32768), cfg
        elif op == "sort":
            vals, idx = out
            assert torch.equal(vals.view(x.shape), ref.values) and torch.equal(idx.view(x.shape), ref.indices), cfg
        elif op == "argsort":
            assert torch.equal(out[1], ref.indices), cfg
        else:
            assert torch.equal(out[0], _ref_segmented(x, off)), cfg


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("items", _cuda.BIN_ITEMS)
def test_each_tile_with_wide_status_words(items):
    """From 2^28 keys the look-back uses 64-bit status words (another instantiation per bin_items)."""
    n = (1 << 28) + 1000
    keys = _random_bits(torch.uint32, n, seed=items)
    k, _ = _cuda.sort_1d(keys, None, False, 0, None, config=dict(OLD_CONSTANTS, bin_items=items))
    img = keys.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(k.view(torch.int32).to(torch.int64) & 0xFFFFFFFF, torch.sort(img).values)


@pytest.mark.gpu
@pytest.mark.slow
def test_match_ranking_with_wide_status_words():
    """rank=1 (lanes OR their bit into their digit's word) with the 64-bit status words of 2^28+ keys: the
    ranking code is shared with the 32-bit instantiation, but this one had no test (review of the untested
    GPU variants)."""
    n = (1 << 28) + 1000
    keys = _random_bits(torch.uint32, n, seed=3)
    k, _ = _cuda.sort_1d(keys, None, False, 0, None, config=dict(OLD_CONSTANTS, rank=1))
    img = keys.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(k.view(torch.int32).to(torch.int64) & 0xFFFFFFFF, torch.sort(img).values)


@pytest.mark.gpu
def test_tuning_on_the_gpu_caches_a_candidate(tmp_cache):
    x = _random_bits(torch.uint32, 1 << 20, seed=1)
    cfg = at.tune("sort_keys", x, backend="cuda", budget_s=0.01)
    key = tunable("sort_keys").make_key(x)
    assert cfg in tunable("sort_keys").candidates(key)
    assert at.config_for("sort_keys", "cuda", key, x.device) == cfg
    assert at.lookup("sort_keys", key, x.device, "cuda")["candidates"] == 24


def test_position_payloads_widen_from_2_31():
    # the segment pass of sort_rows/segmented_sort carried int32 positions past 2^31 - 1 (they wrapped
    # negative: wrong elements, no error); argsort already widened
    assert _cuda._positions(5, "cpu").dtype == torch.int32
    assert _cuda._positions((1 << 31) - 1, "meta").dtype == torch.int32
    assert _cuda._positions(1 << 31, "meta").dtype == torch.int64
    assert torch.equal(_cuda._positions(4, "cpu"), torch.arange(4, dtype=torch.int32))
