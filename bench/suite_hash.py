"""Hash tables vs what a user would otherwise call (issue #4).

CPU (default, ~2 min): 4M int64 keys at load 0.5 and 0.9 --
  insert  vs pd.factorize (builds a hash table of the keys) and a Python dict,
  find    (100% and 50% hits) vs pd.Index.get_indexer (engine built beforehand) and dict.get,
  count   vs pd.Series.value_counts and torch.unique(return_counts=True),
  multi-value build + find of Zipf-skewed keys, and repeated finds into the built map, vs
  pd.Index.get_indexer_non_unique.
  PYKERNELS_BENCH_HASH_LARGE=1 adds the 32M-key cases (about 4 GiB of memory; =only: just those).
  --quick: 1M keys (smoke run).
GPU (--gpu): 2^26 uint32 and uint64 keys at load 0.5 / 0.9 / 0.95, inserts and finds vs a
  sort + searchsorted index (what a torch user does without a hash table).

DRAM accesses: a find visits `lines/op` windows (each one 64-byte line on the CPU: measured on a
sample with the overflow filter, which lets a miss stop at its first full window; in the notes); an
insert additionally writes its line back. `bytes_moved` counts those lines
plus the streamed key/value/result arrays, so "% of limit" (BW) says how far the random accesses are from
the copy bandwidth measured in the same run (latency-bound random access rarely gets near it).

Every case first checks ours against the baseline's answer (the checks below): exact for finds (found
flags and values: the tables store each key's position, what get_indexer returns), counts and the
multi-value rows; inserts by what a table and pd.factorize / a dict have in common (the distinct keys,
and each key's value a row that pandas coded as that key); the Bloom filter with no false negatives and
false positives on at most BLOOM_FP_LIMIT of the absent keys.
"""
from __future__ import annotations

import os

import torch

from bench.common import Case, ResultMismatch, as_tensor, assert_equal

GROUP = "hash"
BLOOM_FP_LIMIT = 0.02  # 10 bits/key, k=7 in 512-bit blocks: ~1% expected (BloomFilter.false_positive_rate)


def _check_find_vs_get_indexer(ours, positions):
    """The tables hold each key's position, so a find answers get_indexer's positions (-1, the default,
    where the key is absent)."""
    values, found = ours
    positions = as_tensor(positions)
    assert_equal("found", found, positions >= 0)
    assert_equal("values", values, positions)


def _check_find_vs_dict_get(ours, got):
    values, found = ours
    assert_equal("found", found, [v is not None for v in got])
    assert_equal("values", values, [0 if v is None else v for v in got])  # 0: find's default


def _check_same_find(ours, baseline):
    (values, found), (base_values, base_found) = ours, baseline
    assert_equal("found", found, base_found)
    assert_equal("values", values, base_values)


def _check_insert_vs_factorize(table, factorized):
    """The table holds pd.factorize's distinct keys, and each key's value (a row position: the cases insert
    positions) is a row pandas coded as that key."""
    codes, uniques = (as_tensor(a) for a in factorized)
    if len(table) != uniques.numel():
        raise ResultMismatch(f"{len(table)} distinct keys in the table, pd.factorize found {uniques.numel()}")
    rows, found = table.find(uniques, default=-1)
    assert_equal("found (each distinct key of pd.factorize)", found, torch.ones_like(found))
    if bool(((rows < 0) | (rows >= codes.numel())).any()):
        raise ResultMismatch("values: not row positions")
    assert_equal("pd.factorize's code of the row each key maps to", codes[rows], torch.arange(uniques.numel()))


def _check_insert_vs_dict(table, d):
    if len(table) != len(d):
        raise ResultMismatch(f"{len(table)} keys in the table, {len(d)} in the dict")
    values, found = table.find(torch.tensor(list(d)))
    assert_equal("found (each key of the dict)", found, torch.ones_like(found))
    assert_equal("values", values, list(d.values()))


def _key_counts(result):
    """(keys, counts) sorted by key, from a CountingTable's items(), torch.unique's (values, counts) or
    a value_counts Series."""
    import pandas as pd

    if isinstance(result, pd.Series):
        keys, counts = as_tensor(result.index.to_numpy()), as_tensor(result.to_numpy())
    else:
        keys, counts = result
    order = torch.sort(keys, stable=True).indices  # (torch's stable integer sort: its fastest here)
    return keys[order], counts[order]


def _check_counts(ours, baseline):
    keys, counts = _key_counts(ours)
    base_keys, base_counts = _key_counts(baseline)
    assert_equal("distinct keys", keys, base_keys)
    assert_equal("counts", counts, base_counts)


def _check_running_counts(table, baseline):
    """The table has counted the batch once per call so far: each key's total is the same multiple of its
    count in the batch."""
    keys, totals = _key_counts(table.items())
    base_keys, counts = _key_counts(baseline)
    assert_equal("distinct keys", keys, base_keys)
    times = max(1, int(totals[0]) // max(1, int(counts[0])))
    assert_equal(f"running totals (the batch's counts x {times})", totals, counts * times)


def _check_multi_find(ours, baseline, row_keys):
    """Each probed key's rows (the values inserted are row positions) as pandas' lists them. pandas
    concatenates the probed keys' positions in probe order: cut where ours' offsets cut, each piece must
    be one key's rows and the same set of rows as ours (whose order within a key is probe order)."""
    offsets, rows = ours
    indexer, missing = baseline
    if len(missing):
        raise ResultMismatch(f"pandas found {len(missing)} probed keys absent: every probed key is in the map")
    base_rows = as_tensor(indexer)
    counts = offsets[1:] - offsets[:-1]
    if int(offsets[0]) != 0 or int(offsets[-1]) != rows.numel() or bool((counts < 0).any()):
        raise ResultMismatch(f"offsets: not a CSR over the {rows.numel()} values returned")
    if rows.numel() != base_rows.numel():
        raise ResultMismatch(f"{rows.numel()} rows in all, pandas {base_rows.numel()}")
    if bool((counts == 0).any()):
        raise ResultMismatch(f"no rows for {int((counts == 0).sum())} of the probed keys (pandas found all)")
    probe = torch.repeat_interleave(torch.arange(counts.numel()), counts)  # the probed key each row answers
    base_keys = row_keys[base_rows]
    assert_equal("pandas' rows cut at ours' offsets: one key per piece", base_keys, base_keys[offsets[:-1]][probe])
    span = row_keys.numel()  # (probed key, row) packed into one int64, sorted
    assert_equal("rows of each probed key (sorted)", torch.sort(probe * span + rows, stable=True).values,
                 torch.sort(probe * span + base_rows, stable=True).values)


def _check_bloom(ours, members):
    """No false negatives (a member reported absent), and false positives on at most BLOOM_FP_LIMIT of the
    keys that are absent."""
    members = as_tensor(members)
    missed = members & ~ours
    if bool(missed.any()):
        raise ResultMismatch(f"{int(missed.sum())} member keys reported absent (a Bloom filter has no false "
                             f"negatives); first at index {int(missed.nonzero()[0])}")
    absent = ~members
    rate = int((ours & absent).sum()) / max(1, int(absent.sum()))
    if rate > BLOOM_FP_LIMIT:
        raise ResultMismatch(f"false positives on {rate:.2%} of the absent keys, limit {BLOOM_FP_LIMIT:.0%}")


def _check_gpu_insert(table, sorted_index):
    """The table maps each key to its position (the values inserted), as the sorted index's permutation."""
    sorted_keys, positions = sorted_index
    if len(table) != sorted_keys.numel():
        raise ResultMismatch(f"{len(table)} keys in the table, {sorted_keys.numel()} inserted")
    values, found = table.find(sorted_keys.view(table.key_dtype))
    assert_equal("found (each key inserted)", found, torch.ones_like(found))
    assert_equal("values", values, positions)


def _keys(n, seed, dtype=torch.int64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64 or dtype == torch.uint64:
        k = torch.randperm(4 * n, generator=g)[:n] * 2654435761 + 12345  # distinct, scattered
        return k.to(device).view(dtype) if dtype == torch.uint64 else k.to(device)
    k = torch.randperm(min(4 * n, 1 << 31), generator=g)[:n].to(torch.int32)
    return k.view(dtype).to(device)


def _zipf_keys(n):
    """n Zipf(1.3) keys (the most frequent about a quarter of them) scattered over int64, as numpy."""
    import numpy as np

    return np.random.default_rng(11).zipf(1.3, n).astype(np.int64) * 2654435761 + 12345


def _lines_per_find(table, q):
    from pykernels.hashing import _layout as L

    sample = L.key_bits(q[: min(q.numel(), 100000)])
    visited = table._mod.probe_windows(table._slots.data_ptr(), table._special.data_ptr(), table._nw, table.window, table.seed, table._kb,
                                       table._vb, sample.data_ptr(), sample.numel())
    return visited / max(1, sample.numel())


def _random_line_rate(table, threads=None):
    """Random 64-byte line reads per second over the table's own memory (huge pages, 32 in flight per
    thread): the DRAM random-access limit a lookup is measured against."""
    import time

    threads = threads or torch.get_num_threads()
    nbytes = table._slots.numel() * 4
    n = 1 << 21
    table._mod.random_lines(table._slots.data_ptr(), nbytes, n // 8, 32, threads)  # warm-up
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        table._mod.random_lines(table._slots.data_ptr(), nbytes, n, 32, threads)
        best = min(best, time.perf_counter() - t0)
    return n / best


def _cpu_cases(quick):
    import numpy as np
    import pandas as pd

    import pykernels

    sizes = [1 << 20] if quick else [1 << 22]
    large = os.environ.get("PYKERNELS_BENCH_HASH_LARGE", "")
    if not quick and large == "1":
        sizes.append(1 << 25)
    elif not quick and large == "only":
        sizes = [1 << 25]
    cases = []
    for n in sizes:
        tag = f"{n >> 20}M"
        for load in (0.5, 0.9):
            label = f"int64 n={tag} load={load}"

            def build(n=n, load=load):
                keys = _keys(n, 1)
                vals = torch.arange(n, dtype=torch.int64)
                t = pykernels.HashMap(int(n / load) + 1, max_load_factor=max(load, 0.9) + 0.01)
                t.insert(keys, vals)
                return keys, vals, t

            def make_insert(n=n, load=load):
                keys = _keys(n, 1)
                vals = torch.arange(n, dtype=torch.int64)
                knp = keys.numpy()

                def ours():  # a new table each call, as pd.factorize builds its own (review finding: a cleared
                    # table reused from the previous call, ~1.2x the ratio, under a note saying "fresh")
                    table = pykernels.HashMap(int(n / load) + 1, max_load_factor=max(load, 0.9) + 0.01)
                    table.insert(keys, vals)
                    return table  # for the check (the timing drops it at once, as the function's end did)

                return ours, lambda: pd.factorize(knp)

            cases.append(Case(GROUP, "insert", label, n, make_insert, "pd.factorize", n, "inserts",
                              bytes_moved=n * (16 + 2 * 64) + 0, goal=10.0,
                              notes="a new table each call (allocated, initialized, filled; its slot memory "
                                    "is the dropped previous table's, from the output cache, as a caching "
                                    "allocator would give it); lines/op: 1 read-for-ownership + 1 writeback",
                              check=_check_insert_vs_factorize))
            for hits in (1.0, 0.5):
                def make_find(case, build=build, hits=hits, n=n):
                    keys, vals, t = build()
                    g = torch.Generator().manual_seed(7)
                    q = keys[torch.randperm(n, generator=g)]
                    if hits < 1.0:
                        q[: n // 2] = _keys(n // 2, 99) | (1 << 62)  # absent keys
                        q = q[torch.randperm(n, generator=g)]
                    idx = pd.Index(keys.numpy())
                    idx.get_indexer(keys[:10].numpy())  # build the engine's hash table outside the timing
                    qnp = q.numpy()
                    lines = _lines_per_find(t, q)
                    # DRAM traffic of the layout: `lines` random 64-byte lines per find, plus the
                    # streamed query (8 B), value (8 B) and found flag (1 B)
                    case.bytes_moved = n * (lines * 64 + 17)
                    limit = _random_line_rate(t) / lines
                    case.notes = (f"{lines:.3f} lines (DRAM accesses)/find; random-line limit "
                                  f"{limit / 1e6:.0f} M finds/s in this run; values and found flags reuse "
                                  f"the dropped outputs (output cache), pandas' are fresh pages")
                    return (lambda: t.find(q, default=-1)), (lambda: idx.get_indexer(qnp))

                c = Case(GROUP, f"find hits={int(hits * 100)}%", label, n, None, "pd.Index.get_indexer", n, "finds",
                         goal=10.0, check=_check_find_vs_get_indexer)
                c.make = lambda c=c, make_find=make_find: make_find(c)
                cases.append(c)
        if n <= 1 << 22 and not quick and len(sizes) and n == sizes[0]:
            nd = 1 << 20  # a Python dict is ~50x slower: 1M keys keep the suite within its time budget

            def make_dict_insert(n=nd):
                keys = _keys(n, 1)
                kl, vl = keys.tolist(), list(range(n))
                t = pykernels.HashMap(2 * n)
                vals = torch.arange(n, dtype=torch.int64)

                def ours():
                    t.clear()
                    t.insert(keys, vals)
                    return t  # for the check

                return ours, lambda: dict(zip(kl, vl))

            def make_dict_find(n=nd):
                keys = _keys(n, 1)
                t = pykernels.HashMap(2 * n)
                t.insert(keys, keys)
                d = dict(zip(keys.tolist(), keys.tolist()))
                q = keys[torch.randperm(n)]
                ql = q.tolist()
                return (lambda: t.find(q)), (lambda: list(map(d.get, ql)))

            def make_small_find(n=nd, m=1000):
                keys = _keys(n, 1)
                t = pykernels.HashMap(2 * n)
                t.insert(keys, torch.arange(n))  # positions: a find answers what get_indexer does (checked)
                idx = pd.Index(keys.numpy())
                idx.get_indexer(keys[:10].numpy())  # the engine built beforehand
                q = keys[torch.randperm(n)[:m]]
                qnp = q.numpy()
                return (lambda: t.find(q, default=-1)), (lambda: idx.get_indexer(qnp))

            cases.append(Case(GROUP, "find hits=100%", "1000 keys into n=1M (a small call)", 1000, make_small_find,
                              "pd.Index.get_indexer", 1000, "finds", notes="per-call overhead: ~8 us of lookups",
                              check=_check_find_vs_get_indexer))
            cases.append(Case(GROUP, "insert", "int64 n=1M load=0.5", nd, make_dict_insert, "dict(zip(...))", nd,
                              "inserts", notes="keys already Python lists for the dict (conversion not timed)",
                              check=_check_insert_vs_dict))
            cases.append(Case(GROUP, "find hits=100%", "int64 n=1M load=0.5", nd, make_dict_find,
                              "list(map(dict.get, ...))", nd, "finds", check=_check_find_vs_dict_get))

        # counting: 4 keys per distinct value
        def make_count(n=n, baseline="value_counts"):
            g = torch.Generator().manual_seed(3)
            keys = _keys(n // 4, 5)[torch.randint(0, n // 4, (n,), generator=g)]
            t = pykernels.CountingTable(int(n / 4 / 0.5))

            def ours():
                t.clear()
                t.add(keys)
                return t.items()

            if baseline == "value_counts":
                s = pd.Series(keys.numpy())
                return ours, lambda: s.value_counts(sort=False)
            return ours, lambda: torch.unique(keys, return_counts=True)

        cases.append(Case(GROUP, "count", f"int64 n={tag} distinct=n/4", n, make_count,
                          "pd.Series.value_counts", n, "keys", goal=10.0, check=_check_counts))
        cases.append(Case(GROUP, "count", f"int64 n={tag} distinct=n/4", n,
                          lambda n=n: make_count(n, "unique"), "torch.unique(return_counts)", n, "keys",
                          check=_check_counts))

        # counting a column of few categories (each key ~1.6% of the rows: summed per thread, added once)
        def make_count_few(n=n, distinct=64):
            g = torch.Generator().manual_seed(4)
            keys = _keys(distinct, 6)[torch.randint(0, distinct, (n,), generator=g)]
            t = pykernels.CountingTable(max(1024, 2 * distinct))
            s = pd.Series(keys.numpy())

            def ours():
                t.clear()
                t.add(keys)
                return t.items()

            return ours, lambda: s.value_counts(sort=False)

        cases.append(Case(GROUP, "count", f"int64 n={tag} distinct=64", n, make_count_few, "pd.Series.value_counts",
                          n, "keys", notes="64 categories: each thread sums the hot keys' adds privately; no distinct-count pass (samples)",
                          check=_check_counts))
        cases.append(Case(GROUP, "count", f"int64 n={tag} distinct=64K", n, lambda n=n: make_count_few(n, 1 << 16),
                          "pd.Series.value_counts", n, "keys",
                          notes="64 copies of each key: none hot, every row added to the table", check=_check_counts))

        # counting batch after batch of the same keys: the table already holds them (at load 0.5), so
        # the batch needs no room (a batch larger than 4x the free room used to grow the table ahead
        # and rebuild it after, two rehashes a batch)
        def make_count_again(n=n):
            g = torch.Generator().manual_seed(3)
            keys = _keys(n // 4, 5)[torch.randint(0, n // 4, (n,), generator=g)]
            t = pykernels.CountingTable(int(n / 4 / 0.5))
            t.add(keys)
            s = pd.Series(keys.numpy())

            def ours():
                t.add(keys)
                return t  # for the check

            return ours, lambda: s.value_counts(sort=False)

        cases.append(Case(GROUP, "count", f"int64 n={tag} distinct=n/4, keys present", n, make_count_again,
                          "pd.Series.value_counts", n, "keys",
                          notes="a further batch of the keys the table holds (streaming counts: the running "
                                "totals stay in the table, no counts returned; value_counts counts from scratch "
                                "and returns them)", check=_check_running_counts))

    # A multi-value map built from skewed keys and probed with each distinct key once (a hash join's
    # build and probe sides): Zipf(1.3) keys, the most frequent a quarter of the rows, vs pandas'
    # non-unique index lookup, which returns the same positions.
    def make_multi(n=sizes[0] // 2):
        knp = _zipf_keys(n)
        keys = torch.from_numpy(knp)
        q = torch.unique(keys)
        q = q[torch.randperm(q.numel(), generator=torch.Generator().manual_seed(5))]
        qnp = q.numpy()
        rows = torch.arange(n, dtype=torch.int64)
        m = pykernels.MultiValueHashMap(2 * q.numel())

        def ours():
            m.clear()
            m.insert(keys, rows)
            return m.find(q)

        return ours, lambda: pd.Index(knp).get_indexer_non_unique(qnp)

    # the check needs the rows' keys (to cut pandas' concatenated answer per probed key): the same keys again
    def check_multi(ours, baseline, n=sizes[0] // 2):
        _check_multi_find(ours, baseline, torch.from_numpy(_zipf_keys(n)))

    cases.append(Case(GROUP, "multi-value build+find", f"int64 n={sizes[0] / (2 << 20):g}M Zipf(1.3) keys", sizes[0] // 2,
                      make_multi, "pd.Index.get_indexer_non_unique", sizes[0] // 2, "rows",
                      notes="top key 25% of rows; each distinct key probed once, all rows returned",
                      check=check_multi))

    # The same map probed again and again (a lookup table's use): 64K keys a call, drawn from the keys
    # with at most 64 rows; pandas' non-unique lookup reads the whole index on every call.
    def make_multi_probe(n=sizes[0] // 2):
        knp = _zipf_keys(n)
        m = pykernels.MultiValueHashMap(1 << 16)
        m.insert(torch.from_numpy(knp), torch.arange(n, dtype=torch.int64))
        idx = pd.Index(knp)
        uq, cnt = np.unique(knp, return_counts=True)
        qnp = np.random.default_rng(3).choice(uq[cnt <= 64], 1 << 16)
        q = torch.from_numpy(qnp)
        idx.get_indexer_non_unique(qnp[:10])  # the engine built outside the timing
        return (lambda: m.find(q)), (lambda: idx.get_indexer_non_unique(qnp))

    cases.append(Case(GROUP, "multi-value find", f"64K keys into n={sizes[0] / (2 << 20):g}M Zipf(1.3) rows", 1 << 16,
                      make_multi_probe, "pd.Index.get_indexer_non_unique (index built)", 1 << 16, "lookups",
                      notes="built once outside the timing; ~2.2 rows per key returned", check=check_multi))

    # Bloom filter contains (built outside the timing) vs exact membership structures also built outside
    # it: the keys sorted once + torch.searchsorted (what a torch user does for repeated queries; a bare
    # torch.isin sorts both sides on every call), and our exact HashSet (16 bytes a key at load 0.5, the
    # filter 10 bits: what the filter trades for its false positives is memory, not time)
    def make_bloom(n=sizes[0], baseline="searchsorted"):
        keys = _keys(n, 1)
        f = pykernels.BloomFilter(10 * n, 7)
        f.add(keys)
        q = _keys(n, 2)
        if baseline == "hashset":
            s = pykernels.HashSet(2 * n)
            s.insert(keys)
            return (lambda: f.contains(q)), (lambda: s.contains(q))
        sk = torch.sort(keys).values

        def base():
            i = torch.searchsorted(sk, q).clamp_(max=n - 1)
            return sk[i] == q
        return (lambda: f.contains(q)), base

    cases.append(Case(GROUP, "bloom contains", f"int64 n={sizes[0] >> 20}M 10 bits/key k=7", sizes[0], make_bloom,
                      "torch.searchsorted (keys sorted once)", sizes[0], "lookups", check=_check_bloom))
    cases.append(Case(GROUP, "bloom contains", f"int64 n={sizes[0] >> 20}M 10 bits/key k=7", sizes[0],
                      lambda: make_bloom(baseline="hashset"), "pykernels.HashSet.contains (exact, 13x the memory)",
                      sizes[0], "lookups", check=_check_bloom))
    return cases


def _gpu_cases(quick):
    import pykernels

    n = 1 << (20 if quick else 26)
    cases = []
    for dtype in (torch.uint32, torch.uint64):
        dname = str(dtype).replace("torch.", "")
        for load in (0.5, 0.9, 0.95):
            label = f"{dname} n=2^{n.bit_length() - 1} load={load}"

            def make_insert(dtype=dtype, load=load):
                keys = _keys(n, 1, dtype, "cuda")
                vals = torch.arange(n, dtype=torch.int32 if dtype == torch.uint32 else torch.int64, device="cuda")
                t = pykernels.HashMap(int(n / load) + 1, key_dtype=dtype, value_dtype=vals.dtype, device="cuda",
                                      max_load_factor=min(1.0, load + 0.01), growable=False)
                sbits = keys.view(torch.int32 if dtype == torch.uint32 else torch.int64)

                def ours():
                    t.clear()
                    t.insert(keys, vals)
                    return t  # for the check

                return ours, lambda: torch.sort(sbits)

            def make_find(dtype=dtype, load=load):
                keys = _keys(n, 1, dtype, "cuda")
                vals = torch.arange(n, dtype=torch.int32 if dtype == torch.uint32 else torch.int64, device="cuda")
                t = pykernels.HashMap(int(n / load) + 1, key_dtype=dtype, value_dtype=vals.dtype, device="cuda",
                                      max_load_factor=min(1.0, load + 0.01), growable=False)
                t.insert(keys, vals)
                sbits = keys.view(torch.int32 if dtype == torch.uint32 else torch.int64)
                sk, perm = torch.sort(sbits)
                q = sbits[torch.randperm(n, device="cuda")]

                def base():
                    pos = torch.searchsorted(sk, q).clamp_(max=n - 1)
                    return vals[perm[pos]], sk[pos] == q

                return (lambda: t.find(q.view(dtype))), base

            cases.append(Case(GROUP, "insert", label, n, make_insert, "torch.sort (build a sorted index)", n,
                              "inserts", device="cuda", goal=None, notes="goal 4 G inserts/s on an H200",
                              check=_check_gpu_insert))
            cases.append(Case(GROUP, "find hits=100%", label, n, make_find, "torch.searchsorted", n, "finds",
                              device="cuda", notes="goal 8 G finds/s on an H200", check=_check_same_find))
    return cases


def cases(quick: bool, device: str = "cpu"):
    if device == "cuda":
        return _gpu_cases(quick)
    return _cpu_cases(quick)
