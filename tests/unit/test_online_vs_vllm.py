"""`loadtest/online_vs_vllm.py`'s verdict over repeated runs: medians, and the runs meeting the goal."""

from __future__ import annotations

from loadtest_scripts import load_script

online = load_script("online_vs_vllm")


def result(tok_s: float, ttft_ms: float, tpot_ms: float) -> dict:
    return {"output_throughput": tok_s, "mean_ttft_ms": ttft_ms, "mean_tpot_ms": tpot_ms}


def test_a_run_meets_the_goal_only_with_all_three_and_the_verdict_is_each_ratios_median():
    runs = [
        {"vllm": result(4000, 300, 12), "parkade": result(4400, 270, 11)},  # all three
        {"vllm": result(4000, 300, 12), "parkade": result(4400, 330, 11)},  # TTFT worse
        {"vllm": result(4000, 300, 12), "parkade": result(3800, 240, 12)},  # throughput lower
        {"parkade": result(4000, 300, 12)},  # vLLM skipped: no ratio
    ]
    ratios = [online.ratios_of(r) for r in runs]
    assert ratios[0] == {"output_throughput": 1.1, "mean_ttft": 0.9, "mean_tpot": 0.92}
    assert ratios[3] == {}
    assert online.summarize(ratios) == {
        "parkade_over_vllm": {"output_throughput": 1.1, "mean_ttft": 0.9, "mean_tpot": 0.92},
        "runs_meeting_goal": 1,
    }
    assert online.summarize([{}]) == {"parkade_over_vllm": {}, "runs_meeting_goal": 0}
