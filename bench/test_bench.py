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
