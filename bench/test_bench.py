"""pytest-benchmark view of the same cases as `python -m bench` (quick sizes):
`pytest bench/ --benchmark-only`. Each case times our op with pytest-benchmark and the baseline
side by side in the same process, and stores the ratio in extra_info."""
import pytest

from bench.common import Case, suites, time_pair

CASES = [c for mod in suites().values() if hasattr(mod, "cases") for c in mod.cases(True, "cpu")]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.group}-{c.op}-{c.label}" for c in CASES])
def test_bench(benchmark, case: Case):
    ours, baseline = case.make()
    t_ours, t_base, _ = time_pair(ours, baseline, case.device, max_repeats=5, budget_s=1.0)
    benchmark.extra_info.update({"baseline": case.baseline_name, "baseline_s": t_base, "ours_s_interleaved": t_ours,
                                 "speedup": t_base / t_ours})
    benchmark.pedantic(ours, rounds=3, warmup_rounds=1)


def test_cpu_timing_batches_short_calls_with_the_gc_paused():
    """The CPU branch of time_pair: a short call is timed in batches of ~20 ms (the mean per call), a
    long one call by call, ours and the baseline alternating, the GC paused while timing."""
    import gc
    import time

    calls = {"short": 0, "long": 0}
    gc_states = []

    def short():
        calls["short"] += 1
        gc_states.append(gc.isenabled())
        time.sleep(0.0001)

    def long():
        calls["long"] += 1
        time.sleep(0.03)

    t_short, t_long, reps = time_pair(short, long, "cpu", min_repeats=3, max_repeats=3, budget_s=0.0)
    assert reps == 3 and calls["long"] == 2 + 3                 # two warm-up calls, then one per sample
    # batches of several calls per sample (at least 2: a 0.1 ms sleep took ~1.5 ms on a loaded machine,
    # and a batch of ~20 ms then held 4, which the former "more than 4" failed on)
    assert calls["short"] >= 2 + 3 * 2
    assert 0.0001 <= t_short < 0.002 and 0.03 <= t_long < 0.3  # per-call means, not batch totals
    assert gc.isenabled() and not all(gc_states)


def test_gpu_timing_uses_event_batches(monkeypatch):
    """The CUDA branch of time_pair, with the CUDA calls faked on the CPU: batches of back-to-back calls
    between two events, sized to ~20 ms, ours and the baseline alternating, the GC paused meanwhile."""
    import gc
    import time

    import torch

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls, gc_states = {"ours": 0, "base": 0}, []

    def ours():
        calls["ours"] += 1
        time.sleep(0.002)

    def base():
        calls["base"] += 1
        gc_states.append(gc.isenabled())
        time.sleep(0.004)

    t_ours, t_base, reps = time_pair(ours, base, "cuda", min_repeats=3, max_repeats=3, budget_s=0.0)
    assert reps == 3
    assert 0.0015 < t_ours < 0.004 and 0.0035 < t_base < 0.008  # per call, not per batch
    assert calls["ours"] > 3 * 5 and calls["base"] > 3 * 3     # batches of several calls
    assert gc.isenabled() and not all(gc_states)                 # paused while timing, back after
