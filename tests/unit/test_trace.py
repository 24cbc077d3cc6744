"""`parkade trace`'s waterfall: every row's bar starts in the same column whatever its label,
and the samples of a request (n > 1) are rows that tell them apart."""

from __future__ import annotations

from parkade import trace

TRACE = "0af7651916cd43dd8448eb211c80319c"


def span(name, service, start_ms, end_ms, span_id, trace_id=TRACE, links=(), **attributes):
    return {
        "name": name,
        "service": f"parkade-{service}",
        "trace_id": trace_id,
        "span_id": span_id,
        "parent_id": None,
        "start_ns": int(start_ms * 1e6),
        "end_ns": int(end_ms * 1e6),
        "attributes": attributes,
        "events": [],
        "links": list(links),
    }


def two_samples():
    """Request r with n=2: one tokenize, each sample's scheduler spans, 32 steps."""
    spans = [
        span("tokenize", "tokenizer", 0, 2, "a1", **{"parkade.request_id": "r"}),
        span("scheduler.queue", "scheduler", 3, 5, "b0", **{"parkade.request_id": "r#0",
             "parkade.prompt_tokens": 5, "parkade.prefix_cache_hit_tokens": 0}),
        span("scheduler.request", "scheduler", 3, 50, "c0", **{"parkade.request_id": "r#0",
             "parkade.prompt_tokens": 5, "parkade.output_tokens": 16, "parkade.finish_reason": "length"}),
        span("scheduler.request", "scheduler", 3, 40, "c1", **{"parkade.request_id": "r#1",
             "parkade.prompt_tokens": 5, "parkade.output_tokens": 9, "parkade.finish_reason": "stop"}),
    ]  # fmt: skip
    steps = [
        span("executor.step", "executor", 5 + i, 5.3 + i, f"s{i}", f"step{i}", [f"{TRACE}-c0", f"{TRACE}-c1"])
        for i in range(32)
    ]
    return trace.request_spans([*spans, *steps], "r")


def test_every_rows_bar_starts_in_the_same_column():
    lines = trace.waterfall(two_samples(), "r").splitlines()
    header, rows = lines[0], lines[1:]
    timeline = header.index("timeline")
    assert len(rows) == 5 and any("executor.step x32" in row for row in rows)
    for row in rows:
        bar = row.index("█")
        # Nothing but spaces between the label and the bar: every bar is drawn from `timeline`.
        assert bar >= timeline and row[timeline:bar].strip() == "", row
        assert row[timeline - 2 : timeline] == "  "
    first = {row.split()[3]: row.index("█") for row in rows}
    assert first["tokenize"] == timeline  # the earliest span starts the timeline
    assert first["executor.step"] > first["scheduler.request"]  # later on the same scale
    details = {row.split()[3] + row.split()[4]: row[timeline + trace.BAR_WIDTH :] for row in rows}
    assert details["executor.stepx32"].strip() == "9.6 ms busy"


def test_each_sample_has_its_own_labelled_row_with_its_own_tokens():
    rows = trace.waterfall(two_samples(), "r").splitlines()[1:]
    samples = [row for row in rows if "scheduler.request" in row]
    assert len(samples) == 2 and samples[0] != samples[1]
    assert "scheduler.request #0" in samples[0] and "output 16 tok, length" in samples[0]
    assert "scheduler.request #1" in samples[1] and "output 9 tok, stop" in samples[1]
    queue = next(row for row in rows if "scheduler.queue" in row)
    assert "scheduler.queue #0" in queue and "cached 0 tok" in queue
    tokenize = next(row for row in rows if "tokenize" in row)
    assert "#" not in tokenize  # the request's own id adds nothing


def test_a_long_label_does_not_push_its_bar_out_of_line():
    spans = [
        span("tokenize", "tokenizer", 0, 1, "a"),
        span("a-span-name-much-longer-than-the-others-of-the-trace", "gateway", 1, 2, "b"),
    ]
    lines = trace.waterfall(spans).splitlines()
    assert lines[1].index("█") == lines[0].index("timeline")
    assert lines[2].index("█") == lines[0].index("timeline") + trace.BAR_WIDTH // 2
