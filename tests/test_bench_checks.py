"""The microbenchmarks' answers, in the test suite: every quick CPU case of the sort, hash, qgemm and
attention suites computes what its baseline computes (bench/common.py check_agreement: one untimed call
of each), so `make bench` never reports a ratio for a wrong answer first. The harness's own tests of the
check (bench/test_bench.py, without its timed cases) run here too."""
import pytest

from bench.common import check_agreement
from bench.test_bench import (CASES, CHECKED_GROUPS, test_a_wrong_answer_fails_the_case_before_timing,  # noqa: F401
                              test_bench_main_fails_on_a_wrong_answer,
                              test_check_agreement_compares_one_call_of_each_and_names_the_case,
                              test_compute_bound_rows_report_the_share_of_the_fma_peak,
                              test_every_cpu_case_of_the_checked_suites_has_a_check,
                              test_unknown_suites_and_mixed_integer_dtypes_are_refused)

CHECKED = [c for c in CASES if c.group in CHECKED_GROUPS]


@pytest.mark.parametrize("case", CHECKED, ids=[f"{c.group}-{c.op}-{c.label}" for c in CHECKED])
def test_bench_case_agrees_with_its_baseline(case):
    ours, baseline = case.make()
    check_agreement(case, ours, baseline)


def test_attention_check_weighs_a_16_bit_disagreement_against_float64():
    """Where ours and SDPA disagree in bf16 beyond the tolerance, the one closer to the float64 answer is
    right: ours passes when it is at least as close as SDPA (aten's bf16 backward was the one off), and
    fails, saying so, when it is further (or when the case drew no inputs)."""
    import torch
    import torch.nn.functional as F

    from bench.common import ResultMismatch
    from bench.suite_attention import _check_close

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g).bfloat16() for _ in range(3))
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    off = exact.clone()
    off[0, 1, 3, 5] += 0.5
    close, far = exact.bfloat16(), off.bfloat16()
    inputs = dict(q=q, k=k, v=v, dout=None, mask=None, causal=False)
    _check_close(close, far, inputs)
    with pytest.raises(ResultMismatch, match="further from the float64 answer"):
        _check_close(far, close, inputs)
    with pytest.raises(ResultMismatch, match="beyond atol"):
        _check_close(close, far)
