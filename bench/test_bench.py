"""pytest-benchmark view of the same cases as `python -m bench` (quick sizes):
`pytest bench/ --benchmark-only`. Each case times our op with pytest-benchmark and the baseline
side by side in the same process, and stores the ratio in extra_info."""
import pytest
import torch

from bench.common import Case, ResultMismatch, assert_equal, check_agreement, run_case, suites, time_pair

CASES = [c for mod in suites().values() if hasattr(mod, "cases") for c in mod.cases(True, "cpu")]
CHECKED_GROUPS = ("sort", "hash", "qgemm", "attention")  # suites whose every CPU case checks its answer


@pytest.mark.parametrize("case", CASES, ids=[f"{c.group}-{c.op}-{c.label}" for c in CASES])
def test_bench(benchmark, case: Case):
    ours, baseline = case.make()
    check_agreement(case, ours, baseline)
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


def test_every_cpu_case_of_the_checked_suites_has_a_check():
    unchecked = [f"{c.group} {c.op} [{c.label}]" for c in CASES if c.group in CHECKED_GROUPS and c.check is None]
    assert {c.group for c in CASES} >= set(CHECKED_GROUPS) and not unchecked


def test_check_agreement_compares_one_call_of_each_and_names_the_case():
    calls = {"ours": 0, "baseline": 0}

    def ours():
        calls["ours"] += 1
        return [1, 2, 3]

    def baseline():
        calls["baseline"] += 1
        return [1, 2, 4]

    case = Case("demo", "add", "n=3", 3, lambda: (ours, baseline), "list", 3,
                check=lambda o, b: assert_equal("values", o, b))
    with pytest.raises(ResultMismatch) as info:
        check_agreement(case, ours, baseline)
    assert calls == {"ours": 1, "baseline": 1}
    msg = str(info.value)
    assert msg.startswith("demo add [n=3]: ours disagrees with list: values: 1 of 3 elements differ")
    assert "index 2: ours 3, baseline 4" in msg
    check_agreement(Case("demo", "add", "n=3", 3, None, "list", 3), ours, baseline)  # no check: no calls
    assert calls == {"ours": 1, "baseline": 1}


def _broken(group, op, label_part, corrupt):
    """The quick CPU case of `group` whose op is `op` (and label holds label_part), with ours' result
    passed through corrupt(): a wrong answer, as a bug would give."""
    case = next(c for c in CASES if c.group == group and c.op == op and label_part in c.label)
    make = case.make

    def make_broken():
        ours, baseline = make()
        return (lambda: corrupt(ours())), baseline

    case = Case(**{**case.__dict__, "make": make_broken})
    return case


def _swap_ends(t):
    t = t.clone()
    t[[0, -1]] = t[[-1, 0]]
    return t


def _flip_first(t):
    t = t.clone()
    t[0] = ~t[0]
    return t


def _bump_first(t):
    t = t.clone()
    t[0] += 1
    return t


def _remap_first_key(table):
    """A table whose first key maps to its second key's value."""
    keys, values = table.items()
    table.insert(keys[:1], values[1:2])
    return table


def _swap_rows_of_first_two_keys(found):
    offsets, rows = found
    rows = rows.clone()
    first, second = 0, int(offsets[1])
    rows[[first, second]] = rows[[second, first]]
    return offsets, rows


def _nudge_first(t, by):
    t = t.detach().clone()
    t.view(-1)[0] += by * float(t.abs().max())
    return t


@pytest.mark.parametrize("group, op, label_part, corrupt, expect", [
    ("sort", "argsort", "int32", _swap_ends, "result: 2 of 262144 elements differ; first at index 0"),
    ("sort", "sort", "float32 n=16K", lambda r: type(r)((r.values, _swap_ends(r.indices))),
     "indices: 2 of 16384"),
    ("hash", "find hits=50%", "load=0.5", lambda r: (r[0], _flip_first(r[1])), "found: 1 of 1048576"),
    ("hash", "count", "distinct=64", lambda r: (r[0], _bump_first(r[1])), "counts: 1 of 64"),
    ("hash", "insert", "load=0.9", _remap_first_key, "pd.factorize's code of the row each key maps to: 1 of"),
    ("hash", "multi-value build+find", "", _swap_rows_of_first_two_keys, "rows of each probed key (sorted): 2 of"),
    ("hash", "bloom contains", "", torch.zeros_like, "member keys reported absent"),
    ("qgemm", "qmatmul W4 g128", "M=1 K=N=1024 float32 act", lambda y: y * 1.05, "relative error"),
    ("qgemm", "qmatmul W4 g128", "M=16 K=N=1024 float32", lambda y: y.flip(-1), "relative error"),
    ("attention", "flash_attention fwd", "float32 B=1 H=8 S=256 D=64 causal", lambda y: _nudge_first(y, 0.01),
     "out: 1 of"),
    ("attention", "flash_attention fwd+bwd", "bfloat16", lambda r: (r[0], r[1], _nudge_first(r[2], 0.5), r[3]),
     "dk: 1 of"),
])
def test_a_wrong_answer_fails_the_case_before_timing(monkeypatch, group, op, label_part, corrupt, expect):
    """Mutation check: each suite's check catches a corrupted result of ours, and run_case raises naming the
    case (op and label) and what differs instead of timing it."""
    import bench.common

    timed = []
    monkeypatch.setattr(bench.common, "time_pair", lambda *a, **k: timed.append(1) or (1.0, 1.0, 1))
    case = _broken(group, op, label_part, corrupt)
    with pytest.raises(ResultMismatch) as info:
        run_case(case, {})
    msg = str(info.value)
    assert msg.startswith(f"{group} {case.op} [{case.label}]: ours disagrees with {case.baseline_name}: ")
    assert expect in msg and not timed


def test_bench_main_fails_on_a_wrong_answer(monkeypatch, tmp_path):
    """`python -m bench` (so `make bench`) exits 1 on a mismatch, with the case's row an error naming it."""
    import json
    import types

    import bench.__main__ as main_mod

    suite = types.SimpleNamespace(cases=lambda quick, device: [Case(
        "demo", "sum", "n=4", 4, lambda: ((lambda: [1, 2, 3, 5]), (lambda: [1, 2, 3, 4])), "list", 4,
        check=lambda o, b: assert_equal("values", o, b))])
    monkeypatch.setattr(main_mod, "suites", lambda groups: {"demo": suite})
    monkeypatch.setattr(main_mod, "measure_machine", lambda **kw: {"copy_GBps": 1.0, "read_GBps": 1.0, "threads": 1})
    assert main_mod.main(["--out", str(tmp_path)]) == 1
    row, = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert row["error"].startswith("ResultMismatch: demo sum [n=4]: ours disagrees with list: values: 1 of 4")


def test_unknown_suites_and_mixed_integer_dtypes_are_refused():
    """A misspelt suite is an error naming the suites (it ran nothing and exited 0), and integers of other
    widths compare by value (uint32 4294967295 passed for int64 -1; audit findings)."""
    import torch

    from bench.common import ResultMismatch, suites

    with pytest.raises(SystemExit, match="unknown suite.*attn.*choose from.*attention"):
        suites(["attn"])
    assert_equal("k", torch.tensor([4294967295], dtype=torch.uint32), torch.tensor([4294967295]))
    assert_equal("k", torch.tensor([-1], dtype=torch.int8), torch.tensor([-1]))
    with pytest.raises(ResultMismatch, match="ours 4294967295, baseline -1"):
        assert_equal("k", torch.tensor([4294967295], dtype=torch.uint32), torch.tensor([-1]))
    with pytest.raises(ResultMismatch, match="dtype torch.uint64"):
        assert_equal("k", torch.tensor([1], dtype=torch.uint64), torch.tensor([1], dtype=torch.int32))


def test_compute_bound_rows_report_the_share_of_the_fma_peak():
    """A case marked fma_bound gets pct_of_fma_peak = its FLOP rate over the machine's measured FMA peak;
    others (and a machine without a measured peak) get none."""
    import time

    def op():
        time.sleep(0.002)

    case = Case("qgemm", "op", "label", 1, lambda: (op, op), "base", 1e9, "FLOP", fma_bound=True)
    row = run_case(case, {"copy_GBps": 10.0, "fma_peak_GFLOPs": 100.0}, budget_s=0.05)
    assert row["pct_of_fma_peak"] == pytest.approx(100.0 * 1e9 / row["ours_s"] / 1e9 / 100.0)
    assert "pct_of_fma_peak" not in run_case(case, {"copy_GBps": 10.0}, budget_s=0.05)
    plain = Case("qgemm", "op", "label", 1, lambda: (op, op), "base", 1e9, "FLOP")
    assert "pct_of_fma_peak" not in run_case(plain, {"copy_GBps": 10.0, "fma_peak_GFLOPs": 100.0}, budget_s=0.05)
