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
plus the streamed key/value/result arrays, so "% of BW limit" says how far the random accesses are from
the copy bandwidth measured in the same run (latency-bound random access rarely gets near it).
"""
from __future__ import annotations

import os

import torch

from bench.common import Case

GROUP = "hash"


def _keys(n, seed, dtype=torch.int64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64 or dtype == torch.uint64:
        k = torch.randperm(4 * n, generator=g)[:n] * 2654435761 + 12345  # distinct, scattered
        return k.to(device).view(dtype) if dtype == torch.uint64 else k.to(device)
    k = torch.randperm(min(4 * n, 1 << 31), generator=g)[:n].to(torch.int32)
    return k.view(dtype).to(device)


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
                    pykernels.HashMap(int(n / load) + 1, max_load_factor=max(load, 0.9) + 0.01).insert(keys, vals)

                return ours, lambda: pd.factorize(knp)

            cases.append(Case(GROUP, "insert", label, n, make_insert, "pd.factorize", n, "inserts",
                              bytes_moved=n * (16 + 2 * 64) + 0, goal=10.0,
                              notes="a new table each call (allocated, initialized, filled); lines/op: 1 "
                                    "read-for-ownership + 1 writeback"))
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
                         goal=10.0)
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
                t.insert(keys, keys)
                idx = pd.Index(keys.numpy())
                idx.get_indexer(keys[:10].numpy())  # the engine built beforehand
                q = keys[torch.randperm(n)[:m]]
                qnp = q.numpy()
                return (lambda: t.find(q, default=-1)), (lambda: idx.get_indexer(qnp))

            cases.append(Case(GROUP, "find hits=100%", "1000 keys into n=1M (a small call)", 1000, make_small_find,
                              "pd.Index.get_indexer", 1000, "finds", notes="per-call overhead: ~8 us of lookups"))
            cases.append(Case(GROUP, "insert", "int64 n=1M load=0.5", nd, make_dict_insert, "dict(zip(...))", nd,
                              "inserts", notes="keys already Python lists for the dict (conversion not timed)"))
            cases.append(Case(GROUP, "find hits=100%", "int64 n=1M load=0.5", nd, make_dict_find,
                              "list(map(dict.get, ...))", nd, "finds"))

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
                          "pd.Series.value_counts", n, "keys", goal=10.0))
        cases.append(Case(GROUP, "count", f"int64 n={tag} distinct=n/4", n,
                          lambda n=n: make_count(n, "unique"), "torch.unique(return_counts)", n, "keys"))

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
                          n, "keys", notes="64 categories: each thread sums the hot keys' adds privately; no distinct-count pass (samples)"))
        cases.append(Case(GROUP, "count", f"int64 n={tag} distinct=64K", n, lambda n=n: make_count_few(n, 1 << 16),
                          "pd.Series.value_counts", n, "keys",
                          notes="64 copies of each key: none hot, every row added to the table"))

        # counting batch after batch of the same keys: the table already holds them (at load 0.5), so
        # the batch needs no room (a batch larger than 4x the free room used to grow the table ahead
        # and rebuild it after, two rehashes a batch)
        def make_count_again(n=n):
            g = torch.Generator().manual_seed(3)
            keys = _keys(n // 4, 5)[torch.randint(0, n // 4, (n,), generator=g)]
            t = pykernels.CountingTable(int(n / 4 / 0.5))
            t.add(keys)
            s = pd.Series(keys.numpy())
            return (lambda: t.add(keys)), lambda: s.value_counts(sort=False)

        cases.append(Case(GROUP, "count", f"int64 n={tag} distinct=n/4, keys present", n, make_count_again,
                          "pd.Series.value_counts", n, "keys",
                          notes="a further batch of the keys the table holds (streaming counts: the running "
                                "totals stay in the table, no counts returned; value_counts counts from scratch "
                                "and returns them)"))

    # A multi-value map built from skewed keys and probed with each distinct key once (a hash join's
    # build and probe sides): Zipf(1.3) keys, the most frequent a quarter of the rows, vs pandas'
    # non-unique index lookup, which returns the same positions.
    def make_multi(n=sizes[0] // 2):
        import numpy as np

        z = np.random.default_rng(11).zipf(1.3, n).astype(np.int64)
        knp = z * 2654435761 + 12345
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

    cases.append(Case(GROUP, "multi-value build+find", f"int64 n={sizes[0] / (2 << 20):g}M Zipf(1.3) keys", sizes[0] // 2,
                      make_multi, "pd.Index.get_indexer_non_unique", sizes[0] // 2, "rows",
                      notes="top key 25% of rows; each distinct key probed once, all rows returned"))

    # The same map probed again and again (a lookup table's use): 64K keys a call, drawn from the keys
    # with at most 64 rows; pandas' non-unique lookup reads the whole index on every call.
    def make_multi_probe(n=sizes[0] // 2):
        import numpy as np

        z = np.random.default_rng(11).zipf(1.3, n).astype(np.int64)
        knp = z * 2654435761 + 12345
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
                      notes="built once outside the timing; ~2.2 rows per key returned"))

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
                      "torch.searchsorted (keys sorted once)", sizes[0], "lookups"))
    cases.append(Case(GROUP, "bloom contains", f"int64 n={sizes[0] >> 20}M 10 bits/key k=7", sizes[0],
                      lambda: make_bloom(baseline="hashset"), "pykernels.HashSet.contains (exact, 13x the memory)",
                      sizes[0], "lookups"))
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
                              "inserts", device="cuda", goal=None, notes="goal 4 G inserts/s on an H200"))
            cases.append(Case(GROUP, "find hits=100%", label, n, make_find, "torch.searchsorted", n, "finds",
                              device="cuda", notes="goal 8 G finds/s on an H200"))
    return cases


def cases(quick: bool, device: str = "cpu"):
    if device == "cuda":
        return _gpu_cases(quick)
    return _cpu_cases(quick)
