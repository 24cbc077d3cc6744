"""`loadtest/cpu_attention_bench.py`: switching builds reaches the prefill cases too."""

from __future__ import annotations

from loadtest_scripts import load_script

from parkade.kernels import attention_cpu

bench = load_script("cpu_attention_bench")


def test_a_prefill_case_run_again_after_a_switch_plans_anew():
    # A step's plan holds the kernel function of the build it was made with, and a case run again
    # with the same lengths would reuse it: the prefill cases then timed one build against itself.
    case = bench._prefill_case(4, 2, 64, 2, 48)
    bench._use(attention_cpu.SOURCE)
    first = case["run"]()
    plan = attention_cpu._last_plan
    assert plan is not None  # (the case goes through the planned path)
    case["run"]()
    assert attention_cpu._last_plan is plan  # the same lengths: the plan is reused
    bench._use(attention_cpu.SOURCE)
    assert attention_cpu._last_plan is None
    again = case["run"]()
    assert attention_cpu._last_plan is not plan
    assert again.equal(first)
