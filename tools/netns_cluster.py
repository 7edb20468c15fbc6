#!/usr/bin/env python3
"""Emulate several nodes on one machine and run the all-reduce benchmark across them (root only).

    sudo python tools/netns_cluster.py --nodes 2 --ranks-per-node 2 --rate 100mbit [--quick] [--out rows.json]

What it builds (every name carries this process's id, so runs never collide):
  - one network namespace per "node", holding that node's ranks: they talk over loopback (their own
    address is local, so the kernel routes it through lo, unlimited);
  - one namespace with a bridge (the "switch"); each node joins it through a veth pair;
  - a tbf rate limit on both ends of every veth (this kernel has no netem: no added delay or loss),
    with a 100 ms queue so the shaping does not distort the measurement (FIELD_NOTES);
  - addresses 10.201.0.0/24, which exist only inside these namespaces.
Ranks of node i are ranks i*L .. i*L+L-1 (LOCAL_WORLD_SIZE=L, so Topology.detect finds the nodes) with
GLOO_SOCKET_IFNAME set to the node's one veth. It runs `python -m bench.suite_allreduce worker` on
every rank (hierarchical, ring, auto and gloo's own flat all_reduce, interleaved), prints the
comparison and removes everything it made — the namespaces, the veths, the bridge, the processes — on
success, on failure and on Ctrl-C/SIGTERM.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Cluster:
    def __init__(self, nodes: int, per: int, rate: str, burst: str = "256kb", latency: str = "100ms"):
        self.nodes, self.per, self.rate, self.burst, self.latency = nodes, per, rate, burst, latency
        self.prefix = f"pkar{os.getpid()}"
        self.bridge_ns = f"{self.prefix}sw"
        self.node_ns = [f"{self.prefix}n{i}" for i in range(nodes)]
        self.made: list[str] = []       # namespaces created (deleted in reverse order)
        self.procs: list[subprocess.Popen] = []
        self._cleaned = False

    # -- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def sh(*args, check=True):
        res = subprocess.run(list(args), capture_output=True, text=True)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed: {res.stderr.strip()}")
        return res

    def addr(self, i: int) -> str:
        return f"10.201.0.{i + 1}"

    # -- build -----------------------------------------------------------------------------------
    def build(self):
        existing = self.sh("ip", "netns", "list").stdout
        for ns in [self.bridge_ns] + self.node_ns:
            if ns in existing.split():
                raise RuntimeError(f"namespace {ns} already exists")
        self.sh("ip", "netns", "add", self.bridge_ns)
        self.made.append(self.bridge_ns)
        self.sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        self.sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, ns in enumerate(self.node_ns):
            self.sh("ip", "netns", "add", ns)
            self.made.append(ns)
            # the veth pair is created directly inside the two namespaces (never in the host's)
            self.sh("ip", "link", "add", f"v{i}", "netns", ns, "type", "veth", "peer", "name", f"s{i}",
                    "netns", self.bridge_ns)
            self.sh("ip", "-n", self.bridge_ns, "link", "set", f"s{i}", "master", "br0")
            self.sh("ip", "-n", self.bridge_ns, "link", "set", f"s{i}", "up")
            self.sh("ip", "-n", ns, "link", "set", "lo", "up")
            self.sh("ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", f"v{i}")
            self.sh("ip", "-n", ns, "link", "set", f"v{i}", "up")
            # both directions of the node's link: node -> switch and switch -> node
            for where, dev in ((ns, f"v{i}"), (self.bridge_ns, f"s{i}")):
                self.sh("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                        "burst", self.burst, "latency", self.latency)
        # reachability check: node 0 pings every other node once
        for i in range(1, self.nodes):
            self.sh("ip", "netns", "exec", self.node_ns[0], "ping", "-c", "1", "-W", "2", self.addr(i), check=False)

    # -- run -------------------------------------------------------------------------------------
    def run_bench(self, sizes, algos, reps, tune: bool, out: Path, timeout: float):
        world = self.nodes * self.per
        with tempfile.TemporaryDirectory(prefix="netns_allreduce_") as d:
            init = f"file://{d}/init"
            for i, ns in enumerate(self.node_ns):
                for k in range(self.per):
                    rank = i * self.per + k
                    env = dict(os.environ, GLOO_SOCKET_IFNAME=f"v{i}", LOCAL_WORLD_SIZE=str(self.per),
                               LOCAL_RANK=str(k), PYTHONPATH=str(ROOT),
                               # auto as --tune measures it in this run, never from the user's cache
                               PYKERNELS_CACHE_DIR=f"{d}/autotune-cache")
                    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "bench.suite_allreduce", "worker",
                           "--rank", str(rank), "--world", str(world), "--init", init,
                           "--sizes", ",".join(map(str, sizes)), "--algos", ",".join(algos), "--reps", str(reps),
                           "--label", f"netns {self.nodes}x{self.per} @{self.rate}"]
                    if tune:
                        cmd.append("--tune")
                    if rank == 0:
                        cmd += ["--out", str(out)]
                    self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                                       stderr=subprocess.STDOUT, text=True))
            deadline = time.monotonic() + timeout
            logs = []
            for p in self.procs:
                try:
                    logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"benchmark did not finish within {timeout} s")
            bad = [(i, p.returncode) for i, p in enumerate(self.procs) if p.returncode != 0]
            if bad:
                raise RuntimeError(f"ranks failed: {bad}\n" + "\n".join(f"--- rank {i}:\n{logs[i][-3000:]}" for i, _ in bad))

    # -- clean up --------------------------------------------------------------------------------
    def cleanup(self):
        if self._cleaned:
            return
        self._cleaned = True
        for p in self.procs:  # only the processes this script started
            if p.poll() is None:
                p.kill()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        for ns in reversed(self.made):  # deleting a namespace deletes its veths, qdiscs and bridge
            self.sh("ip", "netns", "del", ns, check=False)
        left = [ns for ns in self.made if ns in self.sh("ip", "netns", "list", check=False).stdout.split()]
        if left:
            print(f"warning: could not delete namespaces {left}", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--rate", default="100mbit", help="tbf rate of each node's link (both directions)")
    ap.add_argument("--sizes", default=None, help="bytes, comma separated (default 1 MiB,4 MiB,16 MiB; quick: 4 MiB)")
    ap.add_argument("--algos", default="hierarchical,ring,auto")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-tune", action="store_true", help="auto without tune() (model defaults)")
    ap.add_argument("--timeout", type=float, default=500)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("netns_cluster: needs root (network namespaces, veth, tc)", file=sys.stderr)
        return 2
    sizes = [int(float(s)) for s in args.sizes.split(",")] if args.sizes else (
        [4 << 20] if args.quick else [1 << 20, 4 << 20, 16 << 20])
    cluster = Cluster(args.nodes, args.ranks_per_node, args.rate)
    atexit.register(cluster.cleanup)

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="netns_rows_")) / "rows.json"
    try:
        cluster.build()
        cluster.run_bench(sizes, args.algos.split(","), 2 if args.quick else args.reps,
                          tune=not args.no_tune and not args.quick and "auto" in args.algos, out=out,
                          timeout=args.timeout)
    except Exception as exc:  # noqa: BLE001 - report, clean up, fail
        print(f"netns_cluster: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.cleanup()
    rows = json.loads(out.read_text())
    for r in rows:
        print(f"{r['label']:40s} {r['op']:26s} ours {r['ours_s'] * 1e3:9.1f} ms  gloo flat {r['baseline_s'] * 1e3:9.1f} ms"
              f"  {r['speedup']:5.2f}x  busbw {r['busbw_GBps'] * 1e3:7.1f} MB/s  {r.get('notes', '')[:80]}")
    if args.out is None:
        print(f"rows: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
