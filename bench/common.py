"""The benchmark harness: every case runs our op and the baseline side by side, interleaved, in one
process, and reports the ratio (these machines are shared and noisy: only same-run ratios mean much).

An op's suite is a module `bench/suite_<group>.py` with

    def cases(quick: bool, device: str = "cpu") -> Iterable[Case]   # device "cuda" for `--gpu`

where each Case builds its inputs lazily (`make()` returns the two callables), so listing cases is
cheap. Suites that need several processes (collectives) may instead define
`rows(quick: bool, machine: dict, device: str) -> list[dict]` and measure side by side inside their workers.

A Case's `check(ours_result, baseline_result)` compares one untimed call of each before the timing
(check_agreement, with assert_equal / assert_close / assert_relative_error below) and raises
ResultMismatch, naming the case and what differs, when they disagree: a speed-up over a baseline that
computed something else means nothing, so the case fails instead (an error row; `python -m bench` exits 1).
"""
from __future__ import annotations

import gc
import importlib
import os
import pkgutil
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy
import torch

BENCH_DIR = Path(__file__).resolve().parent
_CPU_BATCH_S = 0.02  # a CPU sample: back-to-back calls of about this long (see time_pair)
_CPU_QUIET_S = 0.015  # and a pause before it, for the other op's spinning threads to sleep


@dataclass
class Case:
    group: str                      # suite: sort, hash, qgemm, attention, allreduce, ...
    op: str                         # what is measured, e.g. "sort_keys"
    label: str                      # the shape/dtype, e.g. "uint32 n=16M"
    size: float                     # x axis of the plots (elements, tokens, ...)
    make: Callable[[], tuple]       # -> (ours_fn, baseline_fn); builds inputs (not timed)
    baseline_name: str              # what a user would otherwise call, e.g. "np.sort"
    work: float                     # items per call, for throughput
    unit: str = "items"             # unit of `work` ("keys", "lookups", "FLOP", ...)
    bytes_moved: Optional[float] = None  # DRAM bytes our op must move at least: % of bandwidth limit
    fma_bound: bool = False         # work is FLOP of fp32 FMAs, the limit the CPU's FMA rate: % of FMA peak
    goal: Optional[float] = None    # the speed-up goal vs the baseline (ratio)
    device: str = "cpu"
    threads: Optional[int] = None   # torch/our thread count during the case
    notes: str = ""
    # (ours' result, the baseline's result) -> None, raising ResultMismatch saying what differs
    check: Optional[Callable[[Any, Any], None]] = None


class ResultMismatch(AssertionError):
    """Our op's answer differs from the baseline's in a bench case (raised by a Case's check)."""


def check_agreement(case: Case, ours: Callable, baseline: Callable) -> None:
    """One untimed call of each op, compared by the case's check, before anything is timed. These are
    calls of their own rather than time_pair's warm-ups: there ours' result would have to outlive the
    baseline's warm-up and batch-sizing calls, holding our output-cache buffers and a GPU result across
    them; here both results are dropped before the timing starts."""
    if case.check is None:
        return
    ours_result = ours()
    baseline_result = baseline()
    try:
        case.check(ours_result, baseline_result)
    except ResultMismatch as exc:
        raise ResultMismatch(f"{case.group} {case.op} [{case.label}]: ours disagrees with {case.baseline_name}: "
                             f"{exc}") from exc
    except Exception as exc:  # a check that cannot compare the results is a broken case as well
        note = f"while checking {case.group} {case.op} [{case.label}] against {case.baseline_name}"
        if hasattr(exc, "add_note"):  # (Python 3.11+; pyproject allows 3.10)
            exc.add_note(note)
            raise
        raise RuntimeError(f"{note}: {type(exc).__name__}: {exc}") from exc


def as_tensor(x) -> torch.Tensor:
    """A result as a tensor, for comparing: tensors as they are, lists as new tensors, numpy arrays shared
    (copied when read-only, as pandas' copy-on-write ones are: torch warns on those)."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, (list, tuple)):
        return torch.tensor(x)
    a = numpy.asarray(x)
    if not (a.flags.writeable and a.flags.c_contiguous):
        a = a.copy()
    return torch.from_numpy(a)


def signed_view(t: torch.Tensor) -> torch.Tensor:
    """The same bits as a signed integer tensor: exact comparison of floats (NaN, -0.0 and all) and of the
    unsigned dtypes, whose comparisons torch does not implement everywhere."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.dtype.is_floating_point or not t.dtype.is_signed:
        return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _where(flat_index: int, shape) -> str:
    if len(shape) <= 1:
        return f"index {flat_index}"
    return f"index {tuple(int(i) for i in numpy.unravel_index(flat_index, tuple(shape)))}"


def assert_equal(what: str, ours, baseline) -> None:
    """ours == baseline exactly: same shape, and the same bits where the dtypes match (integers of other
    widths compared as int64). numpy arrays and lists are taken as tensors."""
    a, b = as_tensor(ours), as_tensor(baseline)
    if a.shape != b.shape:
        raise ResultMismatch(f"{what}: shape {tuple(a.shape)}, baseline {tuple(b.shape)}")
    if a.dtype != b.dtype:
        if a.dtype.is_floating_point or b.dtype.is_floating_point:
            raise ResultMismatch(f"{what}: dtype {a.dtype}, baseline {b.dtype}")
        if a.element_size() != b.element_size():
            # by value (uint32 4294967295 is not int64 -1: the bits were sign-extended; audit finding);
            # uint64 has no exact int64 value for its top half
            if torch.uint64 in (a.dtype, b.dtype):
                raise ResultMismatch(f"{what}: dtype {a.dtype}, baseline {b.dtype}")
            a, b = a.to(torch.int64), b.to(torch.int64)
    differ = (signed_view(a) != signed_view(b)).reshape(-1)
    if bool(differ.any()):
        first = int(differ.nonzero()[0])
        raise ResultMismatch(f"{what}: {int(differ.sum())} of {differ.numel()} elements differ; first at "
                             f"{_where(first, a.shape)}: ours {a.reshape(-1)[first].item()!r}, baseline "
                             f"{b.reshape(-1)[first].item()!r}")


def assert_close(what: str, ours, baseline, *, rtol: float, atol: float) -> None:
    """|ours - baseline| <= atol + rtol * |baseline| for every element (in float64; NaN only where both are)."""
    a, b = as_tensor(ours).to(torch.float64), as_tensor(baseline).to(torch.float64)
    if a.shape != b.shape:
        raise ResultMismatch(f"{what}: shape {tuple(a.shape)}, baseline {tuple(b.shape)}")
    err = (a - b).abs()
    bad = ~(err <= atol + rtol * b.abs()) & ~(a.isnan() & b.isnan())
    if bool(bad.any()):
        worst = int(torch.where(bad, err.nan_to_num(float("inf")), -1.0).reshape(-1).argmax())
        raise ResultMismatch(f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond atol={atol:g} + "
                             f"rtol={rtol:g} * |baseline|; worst at {_where(worst, a.shape)}: ours "
                             f"{a.reshape(-1)[worst].item():.6g}, baseline {b.reshape(-1)[worst].item():.6g}")


def assert_relative_error(what: str, ours, baseline, *, tol: float) -> float:
    """||ours - baseline|| / ||baseline|| <= tol (Frobenius norms, float64): for results that differ by
    design, e.g. a quantized product against the float one. Returns the error."""
    a, b = as_tensor(ours).to(torch.float64), as_tensor(baseline).to(torch.float64)
    if a.shape != b.shape:
        raise ResultMismatch(f"{what}: shape {tuple(a.shape)}, baseline {tuple(b.shape)}")
    rel = float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))
    if not rel <= tol:  # NaN fails too
        raise ResultMismatch(f"{what}: relative error ||ours - baseline|| / ||baseline|| = {rel:.4g}, "
                             f"tolerance {tol:g}")
    return rel


def assert_cosine(what: str, ours, baseline, *, at_least: float) -> float:
    """cos(ours, baseline) >= at_least (flattened, float64): the direction alone, for results whose scale
    differs by design. Returns the cosine."""
    a, b = as_tensor(ours).to(torch.float64), as_tensor(baseline).to(torch.float64)
    if a.shape != b.shape:
        raise ResultMismatch(f"{what}: shape {tuple(a.shape)}, baseline {tuple(b.shape)}")
    cos = float((a * b).sum() / (torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b)).clamp_min(1e-300))
    if not cos >= at_least:  # NaN fails too
        raise ResultMismatch(f"{what}: cosine similarity to the baseline {cos:.4f}, at least {at_least:g} expected")
    return cos


def _cuda_batch_seconds(fn: Callable, reps: int) -> float:
    """Mean seconds of one call over `reps` back-to-back calls, between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def _time_pair_cuda(ours: Callable, baseline: Callable, min_repeats: int, max_repeats: int, budget_s: float):
    """GPU timing: one synchronised call per sample measures the GPU waking up, not the kernel (the
    first H200 run timed a 128 MiB fp16 GEMV, ~35 us of DRAM traffic, at 0.33 ms: the SM clock idles
    at 345 MHz between calls). So: a warm-up burst of ~50 ms per function, then batches of
    back-to-back calls of ~20 ms each between CUDA events, alternating ours and the baseline, with
    the garbage collector paused; the median of the batch means."""
    reps = []
    for fn in (ours, baseline):
        fn()
        torch.cuda.synchronize()
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < 0.05 or n < 3:
            fn()
            n += 1
        torch.cuda.synchronize()
        per_call = (time.perf_counter() - t0) / n
        reps.append(max(1, min(1000, int(0.02 / max(per_call, 1e-7)))))
    t_ours, t_base = [], []
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for i in range(max_repeats):
            t_ours.append(_cuda_batch_seconds(ours, reps[0]))
            t_base.append(_cuda_batch_seconds(baseline, reps[1]))
            if i + 1 >= min_repeats and time.perf_counter() - start > budget_s:
                break
    finally:
        gc.enable()
    return statistics.median(t_ours), statistics.median(t_base), len(t_ours)


def time_pair(ours: Callable, baseline: Callable, device: str = "cpu", *, min_repeats: int = 3,
              max_repeats: int = 15, budget_s: float = 3.0):
    """Seconds of ours() and baseline(), measured alternately after one warm-up each: on the CPU the
    fastest of each one's samples, on the GPU the medians."""
    if device == "cuda":
        return _time_pair_cuda(ours, baseline, min_repeats, max_repeats, budget_s)
    # CPU, as timeit does: the garbage collector paused while timing (a collection before every call
    # walked every Python object, evicting the caches and letting the thread pools fall asleep: a 0.2 ms
    # GEMV measured 0.8 ms that way), and a sample of a short call is the mean of a batch of back-to-back
    # calls of ~20 ms. Each batch starts after a pause: torch's OpenMP workers spin for several ms
    # after each parallel op (GOMP_SPINCOUNT pause loops; pause is slow on AMD cores) and took a core
    # from whatever ran next (a 0.2 ms GEMV right after torch's int4 GEMV: 0.35-0.4 ms). The batch is
    # long so that waking the threads and cores after the pause (0.3-0.6 ms on these VMs) is a small
    # part of it: each op is timed in its own steady state.
    batch = []
    for fn in (ours, baseline):
        fn()
        t0 = time.perf_counter()
        fn()
        batch.append(max(1, min(1000, int(_CPU_BATCH_S / max(time.perf_counter() - t0, 1e-7)))))
    t_ours, t_base = [], []
    gc_was_on = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for i in range(max_repeats):
            for fn, acc, reps in ((ours, t_ours, batch[0]), (baseline, t_base, batch[1])):
                time.sleep(_CPU_QUIET_S)
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                acc.append((time.perf_counter() - t0) / reps)
            if i + 1 >= min_repeats and time.perf_counter() - start > budget_s:
                break
    finally:
        if gc_was_on:
            gc.enable()
    # The fastest sample of each: on these shared 2-core VMs a descheduled thread stalls an op whose
    # threads split the work statically (OpenMP) until the OS runs it again, in states that last hundreds
    # of ms; torch's int4 GEMV took 0.45 ms or 8 ms for identical calls, and the median of 15 samples
    # swung our ratio against it between 1.1x and 27x (review finding), while our pool lets the calling
    # thread take a stalled worker's share. The minimum is each op's uncontended time, for both sides.
    return min(t_ours), min(t_base), len(t_ours)


def measure_machine(nbytes: int = 256 << 20, threads: Optional[int] = None, fma_peak: bool = True) -> dict:
    """Memory bandwidth of this machine now (copy counts read + write bytes), with our thread pool, and (with
    fma_peak) its fp32 FMA rate."""
    from pykernels import _cpu_runtime as rt

    threads = threads or torch.get_num_threads()
    src = torch.ones(nbytes // 8, dtype=torch.int64)
    dst = torch.empty_like(src)
    rt.copy_bytes(dst.data_ptr(), src.data_ptr(), nbytes, threads)  # touch pages
    copies, reads = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        rt.copy_bytes(dst.data_ptr(), src.data_ptr(), nbytes, threads)
        copies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        rt.read_sum(src.data_ptr(), nbytes, threads)
        reads.append(time.perf_counter() - t0)
    info = {
        "copy_GBps": 2 * nbytes / min(copies) / 1e9,  # read + write
        "read_GBps": nbytes / min(reads) / 1e9,
        "threads": threads,
        "cpu": _cpu_name(),
        "cores": len(os.sched_getaffinity(0)),
        "avx2": bool(rt.cpu_has_avx2()),
        # fp32 FMA chains on every thread (0 without AVX2): the limit of compute-bound rows (fma_bound)
        "fma_peak_GFLOPs": float(rt.fma_peak_gflops(threads)) if fma_peak else None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def versions() -> dict:
    import numpy

    out = {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__}
    for mod in ("pandas", "triton", "numba"):
        try:
            out[mod] = importlib.import_module(mod).__version__
        except ImportError:
            pass
    import pykernels

    out["pykernels"] = pykernels.__version__
    return out


def suites(groups=None):
    """{group: module} for bench/suite_<group>.py."""
    found = {}
    for info in pkgutil.iter_modules([str(BENCH_DIR)]):
        if info.name.startswith("suite_"):
            group = info.name[len("suite_"):]
            if groups is None or group in groups:
                found[group] = importlib.import_module(f"bench.{info.name}")
    if groups is not None:  # in the order asked for (a time-limited GPU run puts the goals first)
        unknown = [g for g in groups if g not in found]
        if unknown:  # (a typo ran nothing and exited 0: an empty "successful" run; audit finding)
            raise SystemExit(f"python -m bench: unknown suite(s) {', '.join(unknown)}; choose from "
                             f"{', '.join(suite_names())}")
        found = {g: found[g] for g in groups}
    return found


def suite_names() -> list:
    return sorted(info.name[len("suite_"):] for info in pkgutil.iter_modules([str(BENCH_DIR)])
                  if info.name.startswith("suite_"))


def run_case(case: Case, machine: dict, budget_s: float = 3.0) -> dict:
    prev_threads = torch.get_num_threads()
    if case.threads:
        torch.set_num_threads(case.threads)
    try:
        ours, baseline = case.make()
        check_agreement(case, ours, baseline)
        t_ours, t_base, reps = time_pair(ours, baseline, case.device, budget_s=budget_s)
    finally:
        torch.set_num_threads(prev_threads)
        gc.collect()
    row = {
        "group": case.group, "op": case.op, "label": case.label, "size": case.size,
        "baseline": case.baseline_name, "ours_s": t_ours, "baseline_s": t_base,
        "speedup": t_base / t_ours if t_ours > 0 else float("nan"),
        "ours_rate": case.work / t_ours if t_ours > 0 else float("nan"),
        "baseline_rate": case.work / t_base if t_base > 0 else float("nan"),
        "unit": case.unit, "goal": case.goal, "repeats": reps, "device": case.device,
        "threads": case.threads or prev_threads, "notes": case.notes,
    }
    if case.bytes_moved and t_ours > 0:
        limit = machine.get("copy_GBps") if case.device == "cpu" else machine.get("gpu_GBps")
        row["ours_GBps"] = case.bytes_moved / t_ours / 1e9
        row["pct_of_bw"] = 100.0 * row["ours_GBps"] / limit if limit else None
    peak = machine.get("fma_peak_GFLOPs")
    if case.fma_bound and case.device == "cpu" and peak and t_ours > 0:
        row["pct_of_fma_peak"] = 100.0 * case.work / t_ours / 1e9 / peak
    return row
