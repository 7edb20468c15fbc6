"""collectives.all_reduce vs gloo's own dist.all_reduce, in the same run, interleaved.

`rows(quick, machine, device)` (bench/common.py):
  - 4 ranks on loopback gloo, 4 KiB - 64 MiB (float32): time, algbw and busbw (nccl-tests: algbw = n / t,
    busbw = algbw * 2(p-1)/p) for auto and every algorithm, each against dist.all_reduce;
  - as root: the multi-node emulation (tools/netns_cluster.py): 2 "nodes" x 2 ranks joined by a
    100 Mbit/s link, hierarchical vs gloo flat (goal 1.4x), and 3 nodes x 2 ranks.

Every algorithm's answer is checked first, for each size, against dist.all_reduce on the same
rank-dependent integer-valued input (exact in any summation order): an algorithm that differs on any
rank becomes an error row and is not timed.

Each measurement, as nccl-tests defines the time of a size: barrier, one untimed call, then `block`
(3) calls back to back with no barrier between them, timed together; time = their total / block (a call
after a call of its own kind, as in a training loop), the slowest rank's time counts (max over ranks),
median over repeats (>= 30 up to 1 MiB, >= 9 up to 4 MiB, >= 5 above, more while the time budget
lasts); ours and the baseline alternate block by block in the same processes, the order rotating
every repeat. `speedup` is the ratio of the medians, `paired_speedup` the median of the per-repeat
ratios, `cpu_ratio` the ratio of the median CPU seconds per call summed over ranks (all threads).
Why not a barrier before every timed call: the first collective after a barrier starts with every rank
in step, and at 4 MiB that alone made gloo's own all-reduce ~1.3x faster than the same call after any
other collective (4 ranks / 2 cores, 2026-12-02: 6.2 ms right after the barrier, 8.4 ms after a
1-element all-reduce, 6.9 ms back to back), which measured the barrier, not the all-reduce. Calls of
250 ms and more (the emulated slow link) are timed one by one right after the barrier (block 1).
The goal's row (auto) comes from a second race of auto and gloo alone (more repeats in the same time
than six candidates get), with `paired_ci95`, the 95% confidence interval of its paired ratio (the
first race's figures stay in `race_speedup` / `race_paired_speedup`).

Standalone worker (used by the netns script): python -m bench.suite_allreduce worker --rank R --world W
  --init file:///path [--sizes 4194304,...] [--algos auto,hierarchical] [--topology 2,2] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALGOS = ["auto", "recursive_doubling", "halving_doubling", "ring", "hierarchical", "shared_memory"]
# the baseline's key among the timed calls (not "native": algorithm="native" is ours, with its agreement check)
GLOO = "dist.all_reduce"


def _sizes(quick):
    if quick:
        return [4 << 10, 256 << 10, 4 << 20]
    return [4 << 10 << (2 * k) for k in range(8)]  # 4 KiB .. 64 MiB


def measure(sizes, algos, topology, reps, tune_first=True, budget_s=3.0, detect=False):
    """Inside an initialized group: rows (on rank 0) comparing each algorithm with dist.all_reduce.
    detect: only "hierarchical" gets `topology`; auto and the flat algorithms run as a user calls them,
    with the detected topology (on loopback: one host, so auto may use the shared-memory transport;
    the emulated nodes pass their topology to every algorithm, since they share one host)."""
    import torch
    import torch.distributed as dist

    import collectives
    from collectives.all_reduce import tune

    torch.set_num_threads(1)  # 4 ranks share 2 cores: no OpenMP pools spinning against gloo's threads
    p, rank = dist.get_world_size(), dist.get_rank()
    notes = ""
    def topo_of(algo):
        return topology if algo == "hierarchical" or not detect else None

    if tune_first and "auto" in algos:
        t0 = time.perf_counter()
        tune(topology=topo_of("auto"), sizes=sizes, store=False)
        notes = f"auto tuned in {time.perf_counter() - t0:.1f} s"
    rows = []
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4))
        plan_text = collectives.plan(x.numel(), torch.float32, topology=topo_of("auto"))
        runs = "" if rank else plan_text.splitlines()[1].replace("runs: ", "")

        def native():
            dist.all_reduce(x)

        def ours(algo):
            return lambda: collectives.all_reduce(x, algorithm=algo, topology=topo_of(algo))

        # every algorithm's answer first, against gloo's on the same input (a speed-up of a wrong sum
        # means nothing): integer-valued floats, so every summation order gives the same exact sum
        wrong = _check_answers(x.numel(), algos, topo_of, nbytes)
        if rank == 0:
            rows.extend({"group": "allreduce", "op": f"all_reduce[{algo}]", "label": f"{p} ranks {_fmt(nbytes)}",
                         "error": f"ResultMismatch: {why}"} for algo, why in wrong.items())
        run_algos = [a for a in algos if a not in wrong]
        fns = {GLOO: native, **{a: ours(a) for a in run_algos}}
        t0 = time.perf_counter()
        for _ in range(2):  # warm-up (sub-group creation, scratch pages, gloo's pair buffers)
            for k, fn in fns.items():
                fn()
        # calls of 250 ms and more on average (the emulated 100 Mbit link): one call right after the
        # barrier; the lead a call gains from starting there (~2 ms) is noise at that length, and
        # blocks of 3 made the two netns layouts take 4 minutes instead of 1.5
        slow = _sync_max(time.perf_counter() - t0, dist) > 0.25 * 2 * len(fns)
        block = 1 if slow else 3
        # small calls are cheap and noisy: more repeats; big ones at least 5 (the median needs them)
        min_reps = max(reps, 30 if nbytes <= (1 << 20) else 9 if nbytes <= (4 << 20) else 5)
        max_reps = max(min_reps, 60 if nbytes <= (1 << 20) else 25)
        r, med, cmed, paired, t = _race(fns, min_reps, max_reps, budget_s, block)
        # The goal's row (auto vs gloo) again, head to head: more repeats in the same time than six
        # candidates get; the confidence interval says whether a ratio below 1 is a loss or the noise
        # of 4 ranks sharing 2 cores.
        h2h = None
        if "auto" in run_algos:
            hr, hmed, hcmed, hpaired, ht = _race({GLOO: native, "auto": fns["auto"]}, max(5, min_reps),
                                                 2 * max_reps, 2 * budget_s, block)
            h2h = {"repeats": hr, "med": hmed, "cmed": hcmed, "paired": hpaired["auto"],
                   "ci": _median_ci((ht[0] / ht[1]).tolist())}
        if rank == 0:
            for algo in run_algos:
                m, cm, pr, nrep, extra = med, cmed, paired[algo], r, {}
                if algo == "auto" and h2h is not None:
                    m, cm, pr, nrep = h2h["med"], h2h["cmed"], h2h["paired"], h2h["repeats"]
                    extra = {"paired_ci95": h2h["ci"], "race_speedup": med[GLOO] / med[algo],
                             "race_paired_speedup": paired[algo]}
                algbw = nbytes / m[algo]
                busbw = algbw * 2 * (p - 1) / p
                base_bus = nbytes / m[GLOO] * 2 * (p - 1) / p
                lo, hi = extra.get("paired_ci95", (None, None))
                ci_note = (f"head to head with gloo: {nrep} repeats, paired ratio {pr:.2f}x "
                           f"(95% CI {lo:.2f}-{hi:.2f}); " if lo is not None else "")
                rows.append({
                    "group": "allreduce", "op": f"all_reduce[{algo}]", "label": f"{p} ranks {_fmt(nbytes)}",
                    "size": nbytes, "baseline": "dist.all_reduce (gloo)", "ours_s": m[algo],
                    "baseline_s": m[GLOO], "speedup": m[GLOO] / m[algo],
                    "ours_rate": algbw, "baseline_rate": nbytes / m[GLOO], "unit": "B",
                    "paired_speedup": pr, "ours_cpu_s": cm[algo], "baseline_cpu_s": cm[GLOO],
                    "cpu_ratio": cm[GLOO] / cm[algo] if cm[algo] > 0 else float("nan"),
                    "goal": 1.0 if algo == "auto" else None, "repeats": nrep, "device": "cpu", "threads": 1,
                    "algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9, "baseline_busbw_GBps": base_bus / 1e9,
                    "topology": str(topo_of(algo)),
                    "notes": (f"auto runs {runs}; " if algo == "auto" else "") + ci_note + notes, **extra,
                })
    return rows


def _check_answers(numel, algos, topo_of, nbytes):
    """{algorithm: what differs} for the algorithms whose all-reduce of a rank-dependent input differs
    from dist.all_reduce's anywhere on any rank (every rank gets the same dict: the verdicts are summed
    over ranks, so no rank goes on timing a candidate another dropped). Integers below 2^24 in float32:
    exact in any order of summation, so the comparison is exact. The input is gloo's too, copied."""
    import torch
    import torch.distributed as dist

    import collectives

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1000 * rank + nbytes % 997)
    x = torch.randint(-1000, 1001, (numel,), generator=gen).to(torch.float32)
    ref = x.clone()
    dist.all_reduce(ref)
    bad = torch.zeros(len(algos), dtype=torch.float64)
    for i, algo in enumerate(algos):
        got = x.clone()
        # an exception is not caught: raised on some ranks only, possibly mid-exchange, catching it would
        # leave the others blocked in the next collective until the group's timeout (review finding);
        # propagated, the rank exits and its peers fail at once (the suite's error row)
        collectives.all_reduce(got, algorithm=algo, topology=topo_of(algo))
        bad[i] = float((got != ref).sum())
    verdict = bad.clone()
    dist.all_reduce(verdict)  # differing elements over all ranks
    out = {}
    for i, algo in enumerate(algos):
        if verdict[i] > 0:
            out[algo] = (f"{int(verdict[i])} of {numel * dist.get_world_size()} elements differ from "
                         f"dist.all_reduce's sum (summed over ranks)")
    return out


def _race(fns, min_reps, max_reps, budget_s, block=3):
    """Times every fn of `fns` (the baseline first), alternating, the order rotating every repeat: per
    fn and repeat, barrier, one untimed call, then `block` calls back to back timed together (the
    nccl-tests definition: total / block; see the module notes; block 1: the call right after the
    barrier, no untimed one), every rank timing, the slowest rank's
    time counting. Repeats until min_reps and then until the time budget or max_reps. Returns
    (repeats, median seconds per fn, median CPU seconds per call summed over ranks per fn, median
    per-repeat ratio baseline/fn per fn, the [fn][repeat] tensor of times)."""
    import torch
    import torch.distributed as dist

    names = list(fns)
    times = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    start = time.perf_counter()
    r = 0
    while True:
        # the order rotates every repeat, so no candidate always runs right after the same one
        for k in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[k]
            dist.barrier()
            if block > 1:
                fn()
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(block):
                fn()
            times[k].append((time.perf_counter() - t0) / block)
            cpu[k].append((time.process_time() - c0) / block)  # every thread of this rank (gloo's included)
        r += 1
        spent = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)  # every rank stops after the same repeat
        if r >= min_reps and (spent.item() > budget_s or r >= max_reps):
            break
    t = torch.tensor([times[k][:r] for k in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time of each call
    med = {k: statistics.median(t[i].tolist()) for i, k in enumerate(names)}
    # CPU seconds of all ranks together per call: with 4 ranks on 2 cores (and neighbours) the cost
    # that does not depend on how busy the machine is
    c = torch.tensor([cpu[k][:r] for k in names], dtype=torch.float64)
    dist.all_reduce(c)
    cmed = {k: statistics.median(c[i].tolist()) for i, k in enumerate(names)}
    # the median over repeats of the baseline's time / ours in the same repeat: load that drifts during
    # the run (this machine is shared) cancels out of each pair
    paired = {k: statistics.median((t[0] / t[i]).tolist()) for i, k in enumerate(names)}
    return r, med, cmed, paired, t


def _sync_max(value, dist):
    """The largest of every rank's value (so that every rank makes the same choice)."""
    import torch

    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _median_ci(xs, z=1.96):
    """Distribution-free 95% confidence interval of the median of xs: the order statistics at
    n/2 -+ z*sqrt(n)/2 (the binomial count of samples below the median, normal approximation)."""
    v = sorted(xs)
    n = len(v)
    if n == 0:
        return (float("nan"), float("nan"))
    half = z * math.sqrt(n) / 2
    lo = max(0, int(math.floor(n / 2 - half)))
    hi = min(n - 1, int(math.ceil(n / 2 + half)) - 1)
    return (v[lo], v[max(lo, hi)])


def _fmt(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _quiet_teardown():
    from collectives.all_reduce import _quiet_teardown as q

    q()


_EMPTY_CACHE = None


def _spawn_worker(rank, world, init, sizes, algos, topology, reps, out):
    import torch.distributed as dist

    # auto as measure() tunes it in this run (store=False), never from the user's cache: an empty cache
    # dir of this process (PYKERNELS_AUTOTUNE=0 would make tune() measure nothing)
    global _EMPTY_CACHE
    _EMPTY_CACHE = tempfile.TemporaryDirectory(prefix="pykernels-bench-cache-")
    os.environ.setdefault("PYKERNELS_CACHE_DIR", _EMPTY_CACHE.name)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        rows = measure(sizes, algos, topology, reps, detect=True)
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        _quiet_teardown()


def loopback_rows(quick, world=4):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        init = f"file://{d}/init"
        out = f"{d}/rows.json"
        algos = ALGOS if not quick else ["auto", "hierarchical", "ring"]
        mp.start_processes(_spawn_worker, args=(world, init, _sizes(quick), algos, [2, world // 2], 3, out),
                           nprocs=world, start_method="spawn")
        return json.loads(Path(out).read_text())


def netns_rows(quick):
    """The multi-node emulation (root only): see tools/netns_cluster.py."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return []
    rows = []
    configs = [(2, 2)] + ([] if quick else [(3, 2)])
    for nodes, per in configs:
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "rows.json"
            # always the quick emulation from here (4 MiB, 2 repeats, no tuning: ~30 s per layout);
            # run tools/netns_cluster.py by hand for more sizes and a tuned auto
            cmd = [sys.executable, str(ROOT / "tools" / "netns_cluster.py"), "--nodes", str(nodes), "--ranks-per-node",
                   str(per), "--rate", "100mbit", "--out", str(out), "--quick"]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0 or not out.exists():
                rows.append({"group": "allreduce", "op": "netns", "label": f"{nodes}x{per} @100mbit",
                             "error": f"netns_cluster failed (rc {proc.returncode}): {proc.stderr[-300:]}"})
                continue
            rows.extend(json.loads(out.read_text()))
    return rows


def rows(quick: bool, machine: dict, device: str = "cpu"):
    if device != "cpu":
        return []  # NCCL needs several GPUs; nothing to compare on one
    out = loopback_rows(quick)
    out.extend(netns_rows(quick))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.suite_allreduce")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--world", type=int, required=True)
    w.add_argument("--init", required=True)
    w.add_argument("--sizes", default="1048576,4194304")
    w.add_argument("--algos", default="auto,hierarchical")
    w.add_argument("--topology", default=None)
    w.add_argument("--reps", type=int, default=3)
    w.add_argument("--out", default=None)
    w.add_argument("--label", default="")
    w.add_argument("--tune", action="store_true", help="tune() first, so auto knows the links")
    r = sub.add_parser("run", help="the loopback suite alone; prints the rows")
    r.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        for row in rows(args.quick, {}, "cpu"):
            print(json.dumps(row))
        return 0
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=300))
    topo = [int(s) for s in args.topology.split(",")] if args.topology else None
    try:
        res = measure([int(float(s)) for s in args.sizes.split(",")], args.algos.split(","), topo, args.reps,
                      tune_first=args.tune, budget_s=8.0)
        from collectives import Topology

        levels = topo or list(Topology.detect().effective().sizes)  # collective (cached after auto's)
        if args.rank == 0 and args.out:
            for row in res:
                row["label"] = f"{args.label} {row['label']}".strip()
                if row["op"] == "all_reduce[hierarchical]" and args.label.startswith("netns"):
                    # the link-traffic model: a flat ring sends 2(p-1)/p of the vector over each node's
                    # link, the hierarchical one (a ring over n nodes per rank, the node's ranks sharing
                    # the link) 2(n-1)/n: 1.5x for 2 nodes x 2 ranks (the goal: 1.4x), 1.25x for
                    # 3 x 2
                    nodes = levels[-1] if len(levels) > 1 else None
                    if nodes:
                        model = ((args.world - 1) / args.world) / ((nodes - 1) / nodes)
                        row["model_speedup"] = model
                        row["notes"] = f"link-traffic model predicts {model:.2f}x; " + row.get("notes", "")
                    if args.label.startswith("netns 2x2"):
                        row["goal"] = 1.4
            Path(args.out).write_text(json.dumps(res))
    finally:
        _quiet_teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
