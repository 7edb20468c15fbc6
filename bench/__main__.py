"""`python -m bench [--ops sort,hash,...] [--quick] [--out DIR]`: every op against what a user would
otherwise call, side by side in this process; writes results.md, results.json and PNG plots."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

from .common import measure_machine, run_case, suite_names, suites, versions


def _fmt_rate(x: float) -> str:
    if not x or not math.isfinite(x):
        return "-"
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.2f}{suffix}"
    return f"{x:.2f}"


def write_markdown(rows, machine, vers, path: Path):
    lines = [
        "# pykernels microbenchmarks", "",
        f"Machine: {machine.get('cpu')} ({machine.get('cores')} cores, AVX2={machine.get('avx2')}), "
        f"{machine.get('gpu', 'no GPU')}; memory bandwidth measured in this run: copy "
        f"{machine['copy_GBps']:.1f} GB/s (read+write), read {machine['read_GBps']:.1f} GB/s, "
        f"{machine['threads']} threads; fp32 FMA peak (AVX2 FMA chains on every thread) "
        f"{machine.get('fma_peak_GFLOPs', 0):.0f} GFLOP/s.", "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()), "",
        "speed-up = baseline time / our time (same process, interleaved runs).", "",
        "| group | op | case | ours (ms) | baseline | baseline (ms) | speed-up | goal | ours rate | % of limit |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['group']} | {r.get('op', '')} | {r.get('label', '')} | error | | | | | | {r['error'][:80]} |")
            continue
        pct = r.get("pct_of_bw")
        limit = f"{pct:.0f}% BW" if pct is not None else ""
        if r.get("pct_of_fma_peak") is not None:
            limit += f" {r['pct_of_fma_peak']:.0f}% FMA peak"
        goal = f"{r['goal']:.1f}x" if r.get("goal") else ""
        lines.append(
            f"| {r['group']} | {r['op']} | {r['label']} | {r['ours_s'] * 1e3:.3f} | {r['baseline']} | "
            f"{r['baseline_s'] * 1e3:.3f} | {r['speedup']:.2f}x | {goal} | "
            f"{_fmt_rate(r['ours_rate'])} {r['unit']}/s | {limit.strip()} |")
    path.write_text("\n".join(lines) + "\n")


def write_plots(rows, out: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    by_op = {}
    for r in rows:
        if "error" not in r:
            by_op.setdefault((r["group"], r["op"], r["baseline"]), []).append(r)
    for (group, op, base), rs in by_op.items():
        # one line per distinct label prefix (dtype etc.) would clutter: plot by size, ours vs baseline
        rs = sorted(rs, key=lambda r: r["size"])
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["size"] for r in rs], [r["ours_rate"] for r in rs], "o-", label="pykernels")
        ax.plot([r["size"] for r in rs], [r["baseline_rate"] for r in rs], "s--", label=base)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("size")
        ax.set_ylabel(f"{rs[0]['unit']}/s")
        ax.set_title(f"{group}: {op}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        stem = f"{group}_{op}_vs_{base}"
        name = out / ("".join(c if c.isalnum() or c in "-." else "_" for c in stem).strip("_") + ".png")
        fig.savefig(name, dpi=100)
        plt.close(fig)
        made.append(name)
    return made


def _gpu_bandwidth() -> float:
    """Device-to-device copy bandwidth (read + write bytes) of the GPU now."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * x.numel() / best / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench")
    p.add_argument("--ops", default=None, help="comma list of suites (default: all): " + ",".join(suite_names()))
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--out", default=None, help="output folder (default bench/results/<timestamp>)")
    p.add_argument("--budget", type=float, default=3.0,
                   help="seconds per case (allreduce and ring_attention time their multi-process runs themselves)")
    p.add_argument("--gpu", action="store_true", help="the GPU cases (torch.cuda tensors) instead of the CPU ones")
    args = p.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        p.error("--gpu needs a CUDA device (torch.cuda.is_available() is False)")
    groups = args.ops.split(",") if args.ops else None
    suites(groups)  # unknown names: an error before the machine is measured
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)

    machine = measure_machine()
    vers = versions()
    print(f"memory bandwidth: copy {machine['copy_GBps']:.1f} GB/s, read {machine['read_GBps']:.1f} GB/s "
          f"({machine['threads']} threads); fp32 FMA peak {machine.get('fma_peak_GFLOPs', 0):.0f} GFLOP/s", flush=True)
    device = "cuda" if args.gpu else "cpu"
    if args.gpu:
        machine["gpu_GBps"] = _gpu_bandwidth()
    rows = []
    for group, mod in suites(groups).items():
        try:
            if hasattr(mod, "rows"):
                new = mod.rows(args.quick, machine, device)
                rows.extend(new)
                for r in new:
                    print(f"{group:10s} {r.get('op', ''):22s} {r.get('label', ''):28s} {r.get('speedup', float('nan')):6.2f}x vs {r.get('baseline', '')}", flush=True)
                continue
            for case in mod.cases(args.quick, device):
                try:
                    r = run_case(case, machine, args.budget)
                except Exception as exc:  # keep going: one broken case must not hide the others
                    traceback.print_exc()
                    r = {"group": group, "op": case.op, "label": case.label, "error": f"{type(exc).__name__}: {exc}"}
                rows.append(r)
                if "error" not in r:
                    pct = f" {r['pct_of_bw']:.0f}% of BW" if r.get("pct_of_bw") is not None else ""
                    if r.get("pct_of_fma_peak") is not None:
                        pct += f" {r['pct_of_fma_peak']:.0f}% of FMA peak"
                    print(f"{group:10s} {r['op']:22s} {r['label']:28s} ours {r['ours_s'] * 1e3:9.3f} ms  "
                          f"{r['baseline']:>24s} {r['baseline_s'] * 1e3:9.3f} ms  {r['speedup']:6.2f}x{pct}", flush=True)
        except Exception as exc:
            traceback.print_exc()
            rows.append({"group": group, "error": f"{type(exc).__name__}: {exc}"})
    machine_after = measure_machine(fma_peak=False)  # (only its bandwidth is read)
    machine["copy_GBps_after"] = machine_after["copy_GBps"]
    (out / "results.json").write_text(json.dumps({"machine": machine, "versions": vers, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows}, indent=1, default=str))
    write_markdown(rows, machine, vers, out / "results.md")
    plots = write_plots(rows, out)
    print(f"\nwrote {out / 'results.md'}, {out / 'results.json'} and {len(plots)} plot(s)")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
