"""The microbenchmarks' answers, in the test suite: every quick CPU case of the sort, hash, qgemm and
attention suites computes what its baseline computes (bench/common.py check_agreement: one untimed call
of each), so `make bench` never reports a ratio for a wrong answer first. The harness's own tests of the
check (bench/test_bench.py, without its timed cases) run here too."""
import pytest

from bench.common import check_agreement
from bench.test_bench import (CASES, CHECKED_GROUPS, test_a_wrong_answer_fails_the_case_before_timing,  # noqa: F401
                              test_bench_main_fails_on_a_wrong_answer,
                              test_check_agreement_compares_one_call_of_each_and_names_the_case,
                              test_every_cpu_case_of_the_checked_suites_has_a_check)

CHECKED = [c for c in CASES if c.group in CHECKED_GROUPS]


@pytest.mark.parametrize("case", CHECKED, ids=[f"{c.group}-{c.op}-{c.label}" for c in CHECKED])
def test_bench_case_agrees_with_its_baseline(case):
    ours, baseline = case.make()
    check_agreement(case, ours, baseline)
