"""`loadtest/scheduler_bench.py` runs end to end on small sizes and measures what it says."""

from __future__ import annotations

from loadtest_scripts import load_script


def test_every_request_decodes_in_every_timed_step():
    sb = load_script("scheduler_bench")
    row = sb.run(size=32, steps=40, prompt_len=40, block_size=4, prefix_caching=True)
    # run() itself asserts that every timed step schedules all 32 requests and nothing was preempted.
    assert row["running"] == 32 and row["us_per_request_per_step"] > 0
    assert row["plan_bytes_mean"] > 32 and row["result_bytes_mean"] > 32
