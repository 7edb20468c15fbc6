"""Sort benchmarks: pykernels' radix sorts vs what a user would otherwise call (numpy / torch), same
process, interleaved (bench.common.time_pair). Goals from issue #3 are attached to their cases.

bytes_moved is the DRAM traffic our plan needs at least: an LSD sort reads the keys once for all the
histograms, then reads and writes keys (and payloads) once per digit pass (32-bit keys whose top byte
spreads them take the MSD split + in-cache LSD instead: see the int32 case). With 11-bit digits a 32-bit
key takes 3 passes: 4 + 3 * 8 = 28 bytes per key (Onesweep's 8-bit plan: 36); an int32 key with an
index (32-bit in between, int64 written by the last pass) about 4 + 3 * 16 + 4 = 56.

Every case first checks that ours and the baseline sorted alike, exactly: the keys bit for bit, and the
indices / payload in the same order (both sides are stable; the one unstable baseline, torch.sort along
dim 0, sorts distinct keys). On the GPU, where torch.sort is unstable, payloads of equal keys are
compared as sets.
"""
from __future__ import annotations

import numpy as np
import torch

import pykernels
from pykernels import _memory
from bench.common import Case, ResultMismatch, assert_equal, signed_view

M = 1 << 20


def _parts(result):
    """A sort's result as named tensors: (values, indices) of a torch.sort result, (keys, payload) of a
    pair, or the one array (keys or indices)."""
    if isinstance(result, torch.return_types.sort):
        return [("values", result.values), ("indices", result.indices)]
    if isinstance(result, (tuple, list)):
        return list(zip(("keys", "payload"), result))
    return [("result", result)]


def _check_same_sort(ours, baseline):
    """Output by output, exactly the baseline's."""
    ours_parts, base_parts = _parts(ours), _parts(baseline)
    if len(ours_parts) != len(base_parts):
        raise ResultMismatch(f"{len(ours_parts)} outputs, baseline {len(base_parts)}")
    for (name, a), (_, b) in zip(ours_parts, base_parts):
        assert_equal(name, a, b)


def _wrap_point(keys: torch.Tensor, base_keys: torch.Tensor) -> int:
    """Where our uint32 keys, sorted unsigned, wrap around in the order torch sorts their int32 view (what
    the GPU baseline sorts where torch has no CUDA uint32 sort: there the keys from 2^31 on come first);
    0 when the baseline sorted uint32 itself."""
    if base_keys.dtype == keys.dtype:
        return 0
    return int((keys.view(torch.int32) >= 0).sum())


def _rotated(t: torch.Tensor, at: int) -> torch.Tensor:
    return torch.cat([t[at:], t[:at]]) if at else t


def _check_gpu_keys(ours, baseline):
    assert_equal("keys", _rotated(ours, _wrap_point(ours, baseline.values)), baseline.values)


def _check_gpu_pairs(ours, baseline):
    """Keys exactly; the payload (positions 0..n-1) per run of equal keys as a set: torch.sort without
    stable=True may order equal keys' payloads either way."""
    (keys, payload), (base_keys, base_payload) = ours, baseline
    at = _wrap_point(keys, base_keys)
    keys, payload = _rotated(keys, at), _rotated(payload, at)
    assert_equal("keys", keys, base_keys)
    bits = signed_view(base_keys)
    run = torch.cat([bits.new_zeros(1, dtype=torch.int64), (bits[1:] != bits[:-1]).to(torch.int64).cumsum(0)])
    n = bits.numel()  # the payloads are < n: (run, payload) packed into one int64, sorted, unpacked
    assert_equal("payload (sorted within each run of equal keys)",
                 torch.sort(run * n + payload.to(torch.int64)).values % n,
                 torch.sort(run * n + base_payload.to(torch.int64)).values % n)


def _keys(dtype, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float32).to(dtype)
    if dtype == torch.uint32:
        return torch.randint(0, 1 << 32, (n,), generator=g, dtype=torch.int64).to(torch.uint32)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(dtype)


def _cpu_cases(quick: bool):
    n_keys = M if quick else 16 * M
    n_mid = M // 4 if quick else 4 * M
    # torch.sort's baseline size: 4,000,000, not 4M = 2^22. At exactly 2^22 int32 keys torch's radix
    # sort (values + int64 indices) runs 2.5-3.5x slower than at 4,000,000 (88-120 vs 31-45 ms on the
    # 2-core Zen 3; int64 266 vs 104 ms): power-of-two buffers alias in the caches during its scatters.
    # Past 32 MiB of a buffer (4.2M int64 indices) glibc maps fresh pages for it on every call, another
    # ~1.5x; at 4,000,000 its 32,000,000-byte index buffer sits just under that line, and whether a call
    # gets fresh pages depends on the allocations before it (torch 31-78 ms across runs, ours 22-26). A
    # ratio taken at 2^22 measured torch's slowdown, not our sort (the int32 ratio read 4.4-6.3x there,
    # 1.4-3.0x here, 1.4-1.5x with out= on both sides); the 2^22 case is kept beside it, labeled.
    n_torch = 250_000 if quick else 4_000_000
    segs = 1 << 14 if quick else M

    def sort_keys_vs_np():
        x = _keys(torch.uint32, n_keys)
        xn = x.numpy()
        return (lambda: pykernels.sort_keys(x)), (lambda: np.sort(xn))

    yield Case("sort", "sort_keys", f"uint32 n={n_keys // M}M" if n_keys >= M else f"uint32 n={n_keys}",
               n_keys, sort_keys_vs_np, "np.sort", n_keys, "keys",
               # MSD split + in-cache LSD, keys only: 4 (count) + 4 + 4 (split) + 4 + 4 (bucket in, out)
               bytes_moved=n_keys * 20, goal=3.0, check=_check_same_sort)

    def sort_vs_torch(dtype, n):
        def make():
            x = _keys(dtype, n, 1)
            return (lambda: pykernels.sort(x)), (lambda: torch.sort(x, stable=True))
        return make

    for dtype, goal in ((torch.int32, 4.0), (torch.int64, None), (torch.float32, None), (torch.float64, None)):
        kb = torch.empty((), dtype=dtype).element_size()
        name = str(dtype).replace("torch.", "")
        # random int32 keys take the MSD split + in-cache LSD: 4 (top-byte count) + 4 + 8 (split into
        # (key, index) records) + 8 + 12 (records in, values + int64 indices out) = 36 bytes per key;
        # random int64 keys the wide split: 8 + 8 + 8 (min/max read, digit count, split read) + 16 + 16
        # ({key - min, index} records out and back) + 16 (values + indices out) = 72 bytes per key;
        # randn float32 the split by the top 11 bits (36 bytes, as int32: randn floats cluster in a few
        # top bytes), randn float64 the wide split by pieces of the span (sign and exponent: 72, as int64)
        moved = {torch.int32: 36, torch.float32: 36, torch.int64: 72, torch.float64: 72}[dtype]
        yield Case("sort", "sort", f"{name} n={n_torch:,}", n_torch, sort_vs_torch(dtype, n_torch),
                   "torch.sort(stable=True)", n_torch, "keys", bytes_moved=n_torch * moved, goal=goal,
                   notes="values + int64 indices; ours reuse the dropped outputs (output cache), torch's "
                         "are fresh pages each call", check=_check_same_sort)

    yield Case("sort", "sort", f"int32 n=2^{n_mid.bit_length() - 1} (torch's slow size)", n_mid,
               sort_vs_torch(torch.int32, n_mid), "torch.sort(stable=True)", n_mid, "keys", bytes_moved=n_mid * 36,
               notes="values + int64 indices; at a power of two torch.sort runs 2.5-3.5x slower than at 4,000,000 "
                     "(see n_torch): the ratio here is not the goal's", check=_check_same_sort)

    # 8- and 16-bit keys, where torch.sort runs its own radix sort (64K-1M keys): ours count (uint8: 1 byte
    # read to count, 1 + 8 written) or split by the top byte (int16: 2 + 2 read to count and split, 4 + 4
    # records out and back, 2 + 8 written)
    n_narrow = M // 4 if quick else M
    for dtype, moved in ((torch.int16, 22), (torch.uint8, 11)):
        name = str(dtype).replace("torch.", "")
        yield Case("sort", "sort", f"{name} n={n_narrow / M:g}M", n_narrow, sort_vs_torch(dtype, n_narrow),
                   "torch.sort(stable=True)", n_narrow, "keys", bytes_moved=n_narrow * moved,
                   notes="values + int64 indices; torch sorts these by radix too", check=_check_same_sort)

    # inside the caches (100K keys: 1.2 MB with the indices), where a call's fixed costs and the choice of
    # plan weigh more than bandwidth: uniform int32 keys take the LSD engine there (their 256 buckets would
    # be too small), randn floats the split on 16K-key threads, whose buckets sort in L1
    n_small = 1 << 14 if quick else 100_000
    for dtype in (torch.int32, torch.float32):
        name = str(dtype).replace("torch.", "")
        yield Case("sort", "sort", f"{name} n={n_small // 1000}K", n_small, sort_vs_torch(dtype, n_small),
                   "torch.sort(stable=True)", n_small, "keys",
                   notes="values + int64 indices, inside the caches", check=_check_same_sort)

    # a small call, where the Python around the kernel decides (2000 keys: ~30 us in all, ~13 of them the
    # kernel); below TORCH_BELOW (1024 to 5120 elements by dtype) backend="auto" runs torch.sort itself
    yield Case("sort", "sort", "int32 n=2000 (a small call)", 2000, sort_vs_torch(torch.int32, 2000),
               "torch.sort(stable=True)", 2000, "keys", notes="values + int64 indices; per-call overhead",
               check=_check_same_sort)

    def sort_fresh_vs_torch():
        x = _keys(torch.int32, n_torch, 1)

        def ours():
            limit, _memory.OUTPUTS.limit = _memory.OUTPUTS.limit, 0  # plain allocations, as torch's
            try:
                return pykernels.sort(x)
            finally:
                _memory.OUTPUTS.limit = limit
        return ours, (lambda: torch.sort(x, stable=True))

    yield Case("sort", "sort(output cache off)", f"int32 n={n_torch:,}", n_torch, sort_fresh_vs_torch,
               "torch.sort(stable=True)", n_torch, "keys", bytes_moved=n_torch * 36,
               notes="values + int64 indices in fresh pages each call, as torch's: what the output cache saves",
               check=_check_same_sort)

    # a large input: 16M random int64 keys, whose 256 buckets of 16-byte records (~1 MiB each) are sorted
    # from L3 (the split used to be refused past L2-sized buckets: 2.2x torch.sort here, on the LSD engine)
    n_big = 1_000_000 if quick else 16_000_000  # not 2^24: torch.sort of 2^24 int64 keys 1.37 s, of 16,000,000 0.72
    yield Case("sort", "sort", f"int64 n={n_big:,}", n_big, sort_vs_torch(torch.int64, n_big),
               "torch.sort(stable=True)", n_big, "keys", bytes_moved=n_big * 72,
               notes="values + int64 indices (ours from the output cache); buckets past L2, sorted from L3",
               check=_check_same_sort)

    # skewed keys: Zipf(1.3) ranks hashed over int32 (a quarter of the keys one value, ~20 values with
    # 0.4% or more each: categorical ids, join keys). Each such value gets an MSD bucket of its own that is
    # copied, not sorted (the LSD engine took these before, ~2.5x slower than random keys).
    def sort_zipf_vs_torch():
        ranks = np.random.default_rng(8).zipf(1.3, n_torch).astype(np.int64)
        h = ranks * -7046029254386353131  # 0x9E3779B97F4A7C15 (wraps): the ranks' order gone
        x = torch.from_numpy(h ^ (h >> 29)).to(torch.int32)
        return (lambda: pykernels.sort(x)), (lambda: torch.sort(x, stable=True))

    yield Case("sort", "sort", f"int32 Zipf(1.3) ids n={n_torch:,}", n_torch, sort_zipf_vs_torch,
               "torch.sort(stable=True)", n_torch, "keys", bytes_moved=n_torch * 36,
               notes="values + int64 indices; the hot values' buckets copied, not sorted (4 + 4 + 8 + 8 + 12 bytes "
                     "a key: the count, the split, the buckets)", check=_check_same_sort)

    # power laws: raw Zipf(1.3) ranks (counts, word or page ranks: half the keys below 7, the span 2^31),
    # ascending and descending (a top-k by count). Every linear cut of the span leaves most keys in its
    # first bucket: the split cuts it by binades (LogDigit; the LSD engine took them before, 2x slower).
    def sort_power_law_vs_torch(descending):
        def make():
            ranks = np.minimum(np.random.default_rng(9).zipf(1.3, n_torch), (1 << 31) - 1)
            x = torch.from_numpy(ranks.astype(np.int32))
            return (lambda: pykernels.sort(x, descending=descending)), \
                (lambda: torch.sort(x, stable=True, descending=descending))
        return make

    for descending in (False, True):
        yield Case("sort", "sort", f"int32 Zipf(1.3) ranks{' descending' if descending else ''} n={n_torch:,}", n_torch,
                   sort_power_law_vs_torch(descending), "torch.sort(stable=True)", n_torch, "keys",
                   bytes_moved=n_torch * 36,
                   notes="values + int64 indices; split by binades of the span, the hot ranks' buckets copied",
                   check=_check_same_sort)

    def sort_ids_vs_torch():
        x = torch.randint(0, 1 << 31, (n_torch,), generator=torch.Generator().manual_seed(4), dtype=torch.int64)
        return (lambda: pykernels.sort(x)), (lambda: torch.sort(x, stable=True))

    yield Case("sort", "sort", f"int64 ids < 2^31 n={n_torch:,}", n_torch, sort_ids_vs_torch,
               "torch.sort(stable=True)", n_torch, "keys", bytes_moved=n_torch * (8 + 8 + 8 + 8 + 8 + 16),
               notes="values + int64 indices; keys spanning < 2^32 travel as 8-byte (key - min, index) records",
               check=_check_same_sort)

    def sort_out_vs_torch():
        x = _keys(torch.int32, n_torch, 1)
        ov, oi = torch.empty_like(x), torch.empty(n_torch, dtype=torch.int64)
        tv, ti = torch.empty_like(x), torch.empty(n_torch, dtype=torch.int64)
        return (lambda: pykernels.sort(x, out=(ov, oi))), (lambda: torch.sort(x, stable=True, out=(tv, ti)))

    yield Case("sort", "sort(out=)", f"int32 n={n_torch:,}", n_torch, sort_out_vs_torch,
               "torch.sort(stable=True, out=)", n_torch, "keys", bytes_moved=n_torch * 36,
               notes="values + int64 indices into reused out= tensors: no fresh pages to zero (~1/3 of a "
                     "fresh call here)", check=_check_same_sort)

    def argsort_vs_np():
        x = _keys(torch.int32, n_mid, 2)
        xn = x.numpy()
        return (lambda: pykernels.argsort(x)), (lambda: np.argsort(xn, kind="stable"))

    yield Case("sort", "argsort", f"int32 n={n_mid / M:g}M", n_mid, argsort_vs_np, "np.argsort(kind='stable')",
               n_mid, "keys", bytes_moved=n_mid * (4 + 4 + 8 + 8 + 8), goal=10.0,
               check=_check_same_sort)  # split; indices only out

    def pairs_vs_torch():
        k = _keys(torch.int32, n_torch, 3)
        v = torch.randn(n_torch)

        def base():  # what a torch user writes: the sorted keys come with the sort, one gather for v
            s = torch.sort(k, stable=True)
            return s.values, v[s.indices]
        return (lambda: pykernels.sort_pairs(k, v)), base

    yield Case("sort", "sort_pairs", f"int32+float32 n={n_torch:,}", n_torch, pairs_vs_torch,
               "torch.sort + gather", n_torch, "pairs", bytes_moved=n_torch * (4 + 8 + 8 + 8 + 8),
               check=_check_same_sort)  # split, payload carried

    def rows_vs_torch():
        x = torch.randn(segs, 16)
        return (lambda: pykernels.sort(x, dim=-1)), (lambda: torch.sort(x, dim=-1, stable=True))

    yield Case("sort", "sort(rows)", f"float32 {segs // 1024}K rows x 16", segs * 16, rows_vs_torch,
               "torch.sort(dim=-1, stable=True)", segs * 16, "keys", bytes_moved=segs * 16 * (4 + 4 + 8),
               check=_check_same_sort)

    # rows of up to 1024 keys (512 of 1 byte): NV rows at a time through a sorting network in SIMD lanes
    # (csrc/sort/sort_rows_simd.h); past that each row's own radix sort; and the shape of top-p sampling,
    # vocabulary-sized bfloat16 logits sorted descending per row
    def mid_rows_vs_torch(dtype, shape, descending):
        def make():
            g = torch.Generator().manual_seed(6)
            x = (torch.rand(shape, generator=g) < 0.5) if dtype == torch.bool else \
                (torch.randn(shape, generator=g) * 8).to(dtype)
            return (lambda: pykernels.sort(x, dim=-1, descending=descending)), \
                (lambda: torch.sort(x, dim=-1, descending=descending, stable=True))
        return make

    mid_shapes = [(torch.int16, (1000, 1000), False), (torch.float32, (1000, 1000), False),
                  (torch.bfloat16, (64, 32000), True),
                  # MoE routing: every token's expert scores ranked (16K tokens x 64 experts)
                  (torch.bfloat16, (16384, 64), True)]
    if quick:
        mid_shapes = [(d, (s[0] // 8, s[1]), desc) for d, s, desc in mid_shapes]
    for dtype, shape, desc in mid_shapes:
        nm = shape[0] * shape[1]
        yield Case("sort", "sort(rows)", f"{str(dtype).replace('torch.', '')} {shape[0]} rows x {shape[1]}"
                   + (" desc" if desc else ""), nm, mid_rows_vs_torch(dtype, shape, desc),
                   "torch.sort(dim=-1, stable=True)", nm, "keys", check=_check_same_sort)

    # a sort along dim 0: the rows are columns, sorted where they lie (no transposing copies). The baseline
    # is not stable, but a column's 16 keys drawn from 2^63 values are distinct: its indices are the stable ones
    def dim0_vs_torch():
        g = torch.Generator().manual_seed(8)
        x = torch.randint(-(1 << 62), 1 << 62, (16, segs // 10), generator=g)
        return (lambda: pykernels.sort(x, dim=0)), (lambda: torch.sort(x, dim=0))

    yield Case("sort", "sort(dim=0)", f"int64 16 x {segs // 10 // 1000}K", 16 * (segs // 10), dim0_vs_torch,
               "torch.sort(dim=0)", 16 * (segs // 10), "keys", check=_check_same_sort)

    def segmented_vs_torch():
        x = torch.randn(segs * 16)
        v = torch.arange(segs * 16, dtype=torch.int32)
        off = torch.arange(0, segs * 16 + 1, 16)

        def base():  # sorted rows come with the sort; the payload follows by one gather per row
            s = torch.sort(x.view(segs, 16), dim=-1, stable=True)
            return s.values.view(-1), torch.gather(v.view(segs, 16), 1, s.indices).view(-1)
        return (lambda: pykernels.segmented_sort(x, off, v)), base

    yield Case("sort", "segmented_sort", f"float32+int32 {segs // 1024}K segs x 16", segs * 16, segmented_vs_torch,
               "torch.sort(rows) + gather", segs * 16, "keys", bytes_moved=segs * 16 * 16, check=_check_same_sort)

    # segments of varied lengths (uniform in 0..64: no padded rows to sort). The baseline: one stable
    # torch.sort of (segment << 32 | the float's order-preserving bits), the fastest torch route found
    # (two stable sorts, or padding to the longest segment, were slower), then gathers
    def varied_vs_torch():
        g = torch.Generator().manual_seed(9)
        lens = torch.randint(0, 65, (segs * 16 // 32,), generator=g)
        off = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        n = int(off[-1])
        x = torch.randn(n, generator=g)
        v = torch.arange(n, dtype=torch.int32)
        seg = torch.repeat_interleave(torch.arange(lens.numel()), lens)

        def base():
            b = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
            ordered = torch.where(b >= 0x80000000, 0xFFFFFFFF - b, b | 0x80000000)
            idx = torch.sort((seg << 32) | ordered, stable=True).indices
            return x[idx], v[idx]
        return (lambda: pykernels.segmented_sort(x, off, v)), base

    n_varied = segs * 16 // 32 * 32  # (about: the lengths average 32)
    yield Case("sort", "segmented_sort", f"float32+int32 {segs * 16 // 32 // 1024}K segs of 0..64", n_varied,
               varied_vs_torch, "torch.sort(segment << 32 | key) + gather", n_varied, "keys",
               bytes_moved=n_varied * 16, check=_check_same_sort)


def _gpu_cases(quick: bool):
    n = (1 << 24) if quick else (1 << 28)

    # torch's CUDA sort has no uint32 kernel in some releases (2.11: "not implemented for 'UInt32'"): the
    # baseline then sorts the same 32-bit words as int32. torch.sort is the baseline (what a user
    # calls) but not a keys-only CUB sort: it always returns int64 indices, so CUB sorts (key, int64 index)
    # pairs, ~3x the traffic of a keys-only sort (review finding); a keys-only CUB sort would be faster.
    def _as_torch_sortable(x):
        try:
            torch.sort(x[:2])
            return x
        except (NotImplementedError, RuntimeError):
            return x.view(torch.int32)

    def keys_vs_torch():
        x = torch.randint(0, 1 << 32, (n,), dtype=torch.int64, device="cuda").to(torch.uint32)
        xt = _as_torch_sortable(x)
        return (lambda: pykernels.sort_keys(x)), (lambda: torch.sort(xt))

    yield Case("sort", "sort_keys", f"uint32 n=2^{n.bit_length() - 1}", n, keys_vs_torch, "torch.sort (CUB)", n,
               "keys", bytes_moved=36 * n, goal=1.2, device="cuda",
               notes="torch.sort also returns int64 indices (CUB sorts key + int64 index pairs): not a keys-only CUB sort",
               check=_check_gpu_keys)

    def pairs_vs_torch():
        k = torch.randint(0, 1 << 32, (n,), dtype=torch.int64, device="cuda").to(torch.uint32)
        v = torch.arange(n, dtype=torch.int32, device="cuda")
        kt = _as_torch_sortable(k)

        def base():
            s = torch.sort(kt)
            return s.values, v[s.indices]
        return (lambda: pykernels.sort_pairs(k, v)), base

    yield Case("sort", "sort_pairs", f"uint32+int32 n=2^{n.bit_length() - 1}", n, pairs_vs_torch,
               "torch.sort + gather (CUB)", n, "pairs", bytes_moved=68 * n, goal=1.2, device="cuda",
               notes="the baseline carries int64 indices (8-byte payload) and gathers the values after: more "
                     "work than a CUB pairs sort with the 4-byte payload", check=_check_gpu_pairs)

    def triton_vs_cuda():
        x = torch.randint(0, 1 << 32, (n // 16,), dtype=torch.int64, device="cuda").to(torch.uint32)
        return (lambda: pykernels.sort_keys(x, backend="triton")), (lambda: pykernels.sort_keys(x, backend="cuda"))

    yield Case("sort", "sort_keys[triton]", f"uint32 n=2^{(n // 16).bit_length() - 1}", n // 16, triton_vs_cuda,
               "pykernels cuda backend", n // 16, "keys", bytes_moved=36 * n // 16, device="cuda",
               check=_check_same_sort)


def cases(quick: bool, device: str = "cpu"):
    return list(_gpu_cases(quick) if device == "cuda" else _cpu_cases(quick))
