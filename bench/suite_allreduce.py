"""collectives.all_reduce vs gloo's own dist.all_reduce, in the same run, interleaved.

`rows(quick, machine, device)` (bench/common.py):
  - 4 ranks on loopback gloo, 4 KiB - 64 MiB (float32): time, algbw and busbw (nccl-tests: algbw = n / t,
    busbw = algbw * 2(p-1)/p) for auto and every algorithm, each against dist.all_reduce;
  - as root: the multi-node emulation (tools/netns_cluster.py): 2 "nodes" x 2 ranks joined by a
    100 Mbit/s link, hierarchical vs gloo flat (goal 1.4x), and 3 nodes x 2 ranks.

Each measurement: barrier, every rank times the call, the slowest rank's time counts (max over ranks),
median over repeats (>= 30 up to 1 MiB, >= 9 up to 4 MiB, >= 5 above, more while the time budget
lasts); ours and the baseline alternate call by call in the same processes, the order rotating every
repeat. `speedup` is the ratio of the medians, `paired_speedup` the median of the per-repeat ratios,
`cpu_ratio` the ratio of the median CPU seconds per call summed over ranks (all threads).

Standalone worker (used by the netns script): python -m bench.suite_allreduce worker --rank R --world W
  --init file:///path [--sizes 4194304,...] [--algos auto,hierarchical] [--topology 2,2] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
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
ALGOS = ["auto", "recursive_doubling", "halving_doubling", "ring", "hierarchical"]


def _sizes(quick):
    if quick:
        return [4 << 10, 256 << 10, 4 << 20]
    return [4 << 10 << (2 * k) for k in range(8)]  # 4 KiB .. 64 MiB


def measure(sizes, algos, topology, reps, tune_first=True, budget_s=3.0):
    """Inside an initialized group: rows (on rank 0) comparing each algorithm with dist.all_reduce."""
    import torch
    import torch.distributed as dist

    import collectives
    from collectives.all_reduce import tune

    torch.set_num_threads(1)  # 4 ranks share 2 cores: no OpenMP pools spinning against gloo's threads
    p, rank = dist.get_world_size(), dist.get_rank()
    notes = ""
    if tune_first and "auto" in algos:
        t0 = time.perf_counter()
        tune(topology=topology, sizes=sizes, store=False)
        notes = f"auto tuned in {time.perf_counter() - t0:.1f} s"
    rows = []
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4))
        plan_text = collectives.plan(x.numel(), torch.float32, topology=topology)
        runs = "" if rank else plan_text.splitlines()[1].replace("runs: ", "")

        def native():
            dist.all_reduce(x)

        def ours(algo):
            return lambda: collectives.all_reduce(x, algorithm=algo, topology=topology)

        fns = {"native": native, **{a: ours(a) for a in algos}}
        names = list(fns)
        times = {k: [] for k in fns}
        cpu = {k: [] for k in fns}
        for _ in range(2):  # warm-up (sub-group creation, scratch pages, gloo's pair buffers)
            for k, fn in fns.items():
                fn()
        # small calls are cheap and noisy: more repeats; big ones at least 5 (the median needs them)
        min_reps = max(reps, 30 if nbytes <= (1 << 20) else 9 if nbytes <= (4 << 20) else 5)
        max_reps = max(min_reps, 60 if nbytes <= (1 << 20) else 25)
        start = time.perf_counter()
        r = 0
        while True:
            # the order rotates every repeat, so no candidate always runs right after the same one
            for k in names[r % len(names):] + names[:r % len(names)]:
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                fns[k]()
                times[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)  # every thread of this rank (gloo's included)
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
        # the median over repeats of gloo's time / ours in the same repeat: load that drifts during the
        # run (this machine is shared) cancels out of each pair
        paired = {k: statistics.median((t[0] / t[i]).tolist()) for i, k in enumerate(names)}
        if rank == 0:
            for algo in algos:
                algbw = nbytes / med[algo]
                busbw = algbw * 2 * (p - 1) / p
                base_bus = nbytes / med["native"] * 2 * (p - 1) / p
                rows.append({
                    "group": "allreduce", "op": f"all_reduce[{algo}]", "label": f"{p} ranks {_fmt(nbytes)}",
                    "size": nbytes, "baseline": "dist.all_reduce (gloo)", "ours_s": med[algo],
                    "baseline_s": med["native"], "speedup": med["native"] / med[algo],
                    "ours_rate": algbw, "baseline_rate": nbytes / med["native"], "unit": "B",
                    "paired_speedup": paired[algo], "ours_cpu_s": cmed[algo], "baseline_cpu_s": cmed["native"],
                    "cpu_ratio": cmed["native"] / cmed[algo] if cmed[algo] > 0 else float("nan"),
                    "goal": 1.0 if algo == "auto" else None, "repeats": r, "device": "cpu", "threads": 1,
                    "algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9, "baseline_busbw_GBps": base_bus / 1e9,
                    "topology": str(topology), "notes": (f"auto runs {runs}; " if algo == "auto" else "") + notes,
                })
    return rows


def _fmt(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _quiet_teardown():
    from collectives.all_reduce import _quiet_teardown as q

    q()


def _spawn_worker(rank, world, init, sizes, algos, topology, reps, out):
    import torch.distributed as dist

    os.environ.setdefault("PYKERNELS_AUTOTUNE", "0")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        rows = measure(sizes, algos, topology, reps)
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        _quiet_teardown()


def loopback_rows(quick, world=4):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        init = f"file://{d}/init"
        out = f"{d}/rows.json"
        mp.start_processes(_spawn_worker, args=(world, init, _sizes(quick), ALGOS if not quick else ["auto", "hierarchical", "ring"],
                                                [2, world // 2], 3, out), nprocs=world, start_method="spawn")
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
        if args.rank == 0 and args.out:
            for row in res:
                row["label"] = f"{args.label} {row['label']}".strip()
                if row["op"] == "all_reduce[hierarchical]" and args.label.startswith("netns"):
                    row["goal"] = 1.4  # the link-traffic model predicts 1.5x for 2 nodes x 2 ranks
            Path(args.out).write_text(json.dumps(res))
    finally:
        _quiet_teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
