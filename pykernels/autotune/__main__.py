"""Command line of the autotuner.

  python -m pykernels.autotune generate --ops sort,hash,qgemm,attention,allreduce [--sizes 1e6,4e6] [--backends cuda] [--out FILE]
  python -m pykernels.autotune show [FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import pykernels.autotune as at

GROUPS = ("sort", "hash", "qgemm", "attention", "allreduce")


def _progress(done: int, total: int, label: str, started: float):
    width = 30
    filled = int(width * done / max(total, 1))
    elapsed = time.perf_counter() - started
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {elapsed:6.1f}s {label[:60]:<60}")
    sys.stderr.flush()


MAX_SIZE = 1 << 34  # elements: 16G, beyond every op's own limit (the ops then say what theirs is)


def _parse_sizes(text):
    """--sizes "65536,1e6": positive element counts (argparse reports a bad one)."""
    if not text:
        return None
    out = []
    for s in (s.strip() for s in text.split(",")):
        if not s:
            continue
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--sizes: {s!r} is not a number") from None
        if not (1 <= v <= MAX_SIZE):  # (NaN fails too) 1e30 reached the example builders (review finding)
            # MAX_SIZE exactly: "2e+10" read as a bound that 1.8e10 broke (audit finding)
            raise argparse.ArgumentTypeError(f"--sizes: expected sizes in [1, 2^{MAX_SIZE.bit_length() - 1} = "
                                             f"{MAX_SIZE}], got {s!r}")
        out.append(int(v))
    return out


def _budget(text):
    """--budget: a finite number of seconds > 0 (-5, nan and inf ran before; review finding)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budget: {text!r} is not a number") from None
    if not 0 < v < float("inf"):  # (NaN fails too)
        raise argparse.ArgumentTypeError(f"--budget: expected a finite number of seconds > 0, got {text!r}")
    return v


def generate(args) -> int:
    if not at._enabled():
        print("python -m pykernels.autotune generate: PYKERNELS_AUTOTUNE=0 turns tuning off; nothing was measured",
              file=sys.stderr)
        return 2
    if args.out:
        at._OUT_OVERRIDE = Path(args.out).resolve()
    groups = [g.strip() for g in args.ops.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown or not groups:
        print(f"unknown --ops {unknown or repr(args.ops)}; choose from {', '.join(GROUPS)}", file=sys.stderr)
        return 2
    try:
        sizes = _parse_sizes(args.sizes)
    except argparse.ArgumentTypeError as exc:
        print(f"python -m pykernels.autotune generate: {exc}", file=sys.stderr)
        return 2
    backends = {b.strip() for b in args.backends.split(",") if b.strip()} if args.backends else None
    if backends is not None and (not backends or backends - {"cpu", "cuda", "triton"}):
        print(f"python -m pykernels.autotune generate: expected --backends from cpu, cuda, triton, got "
              f"{args.backends!r}", file=sys.stderr)
        return 2
    jobs, self_tuning = [], []
    for g in groups:
        tunables = at.registered(g)
        if not tunables:
            print(f"note: no tunable ops registered for {g!r} in this build", file=sys.stderr)
        for t in tunables:
            if backends and t.backend not in backends:
                continue
            if t.generate is not None:  # tunes itself (across ranks): counted and reported as the others
                self_tuning.append(t)
                continue
            try:  # building one op's examples may fail (sizes too large for it): report, go on
                jobs += [(t, ex_args, ex_kwargs) for ex_args, ex_kwargs in t.examples(sizes)]
            except Exception as exc:  # noqa: BLE001
                print(f"{t.op}/{t.backend}: cannot make examples of sizes {sizes}: {exc}", file=sys.stderr)
    gpu_asked = sorted((backends or set()) & {"cuda", "triton"})
    if gpu_asked and not torch.cuda.is_available():  # else "tuned 0 shape(s)" and exit 0 said nothing why
        print(f"note: no CUDA device here: --backends {','.join(gpu_asked)} has nothing to tune on this machine",
              file=sys.stderr)
    started = time.perf_counter()
    results = []
    for i, (t, ex_args, ex_kwargs) in enumerate(jobs):
        try:
            _progress(i, len(jobs), f"{t.op}/{t.backend} {t.make_key(*ex_args, **ex_kwargs)}", started)
            cfg = at.tune(t.op, *ex_args, backend=t.backend, budget_s=args.budget, **ex_kwargs)
            results.append((t.op, t.backend, cfg))
        except Exception as exc:  # report and go on with the other ops
            print(f"\n{t.op}/{t.backend}: tuning failed: {exc}", file=sys.stderr)
    _progress(len(jobs), len(jobs), "done", started)
    sys.stderr.write("\n")
    for t in self_tuning:
        try:
            results += [(t.op, t.backend, None)] * int(t.generate(sizes))
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{t.op}/{t.backend}: tuning failed: {exc}", file=sys.stderr)
    devices = sorted({"cpu" if b == "cpu" else "cuda" for _, b, _ in results}) or ["cpu"]
    files = ", ".join(str(at.cache_file(torch.device(d))) for d in devices)
    print(f"tuned {len(results)} shape(s); cache: {files}")
    return 0 if results or not (jobs or self_tuning) else 1


def show(args) -> int:
    path = Path(args.file) if args.file else at.cache_file()
    if not path.exists():
        print(f"no cache at {path}")
        return 1
    try:
        data = at.read_cache_json(path)
        meta = data.get("metadata", {})
        if not isinstance(meta, dict) or not isinstance(data.get("entries", {}), dict):
            raise ValueError("metadata or entries is not an object")
    except (OSError, ValueError, AttributeError, RecursionError) as exc:
        print(f"corrupt cache {path}: {exc}", file=sys.stderr)
        return 1
    # what lookups would use (invalid entries dropped, with the loader's warning)
    entries = at.load_cache_file(path, check_metadata=False)
    print(f"cache {path}")
    print("  " + ", ".join(f"{k}={v}" for k, v in meta.items()))
    rows = []
    for ekey, e in sorted(entries.items()):
        if ekey.count("|") < 2:
            continue
        op, backend, key = ekey.split("|", 2)
        # entries without a time (the all-reduce's model parameters, measured by its own tune()): "-"
        t, td = e.get("time_s") or 0, e.get("default_time_s") or 0
        # a hand-edited "fast", true or a 300-digit integer: "-"
        t, td = (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e300 else 0
                 for v in (t, td))
        ms = f"{t * 1e3:9.3f}" if t else f"{'-':>9}"
        sp = f"{td / t:9.2f}x" if t and td else f"{'-':>10}"
        rows.append((op, backend, key, json.dumps(e["config"], sort_keys=True), ms, sp))
    print(f"{'op':<18} {'backend':<7} {'time ms':>9} {'vs default':>10}  key -> config")
    for op, backend, key, cfg, ms, sp in rows:
        print(f"{op:<18} {backend:<7} {ms} {sp}  {key} -> {cfg}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pykernels.autotune")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="measure every op's configs on this device and write the cache")
    g.add_argument("--ops", default=",".join(GROUPS), help="comma list of " + ",".join(GROUPS))
    g.add_argument("--sizes", default=None, help="comma list of problem sizes (op-specific meaning)")
    g.add_argument("--backends", default=None, help="comma list of backends to tune (cpu, cuda, triton; default all)")
    g.add_argument("--out", default=None, help="write to this file instead of the user cache")
    g.add_argument("--budget", type=_budget, default=0.5, help="seconds of measuring per config")
    s = sub.add_parser("show", help="print a cache file")
    s.add_argument("file", nargs="?")
    args = p.parse_args(argv)
    return generate(args) if args.cmd == "generate" else show(args)


if __name__ == "__main__":
    sys.exit(main())
