"""`parkade trace REQUEST_ID`: one request's spans as a terminal waterfall, from the file that
`parkade up --trace` has the services write (`$PARKADE_HOME/traces.jsonl`, JSON lines).

    offset ms  duration ms  service     span
        0.0        12.3     tokenizer   tokenize            ███
        ...

The request's trace is every span under the trace id of the spans that name the request (the
gateway's request id names its choices' requests too: `cmpl-...-0`). The executor's steps live
in traces of their own, linked to the requests they served: they are shown as one line, from the
first to the last step that served the request, with their count and summed time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

BAR_WIDTH = 40


def load(path: Path) -> list[dict[str, Any]]:
    spans = []
    for line in path.read_text().splitlines():
        try:
            spans.append(json.loads(line))
        except json.JSONDecodeError:  # blank, or the last line while a service writes it
            continue
    return spans


def request_spans(spans: list[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    """The request's spans, and the steps that served it summed into one."""

    def names_it(span: dict[str, Any]) -> bool:
        named = str(span["attributes"].get("parkade.request_id", ""))
        choice = named.removeprefix(f"{request_id}-")  # the gateway's choice i: `<id>-<i>`
        return named == request_id or (choice != named and choice.isdigit())

    trace_ids = {s["trace_id"] for s in spans if names_it(s)}
    mine = [s for s in spans if s["trace_id"] in trace_ids]
    linked = {f"{s['trace_id']}-{s['span_id']}" for s in mine}
    steps = [s for s in spans if s["name"] == "executor.step" and linked.intersection(s["links"])]
    if steps:
        mine.append(
            {
                "name": f"executor.step x{len(steps)}",
                "service": steps[0]["service"],
                "start_ns": min(s["start_ns"] for s in steps),
                "end_ns": max(s["end_ns"] for s in steps),
                "busy_ns": sum(s["end_ns"] - s["start_ns"] for s in steps),
            }
        )
    return sorted(mine, key=lambda s: (s["start_ns"], s["name"]))


def waterfall(spans: list[dict[str, Any]]) -> str:
    start = min(s["start_ns"] for s in spans)
    end = max(s["end_ns"] for s in spans)
    scale = BAR_WIDTH / max(end - start, 1)
    lines = [f"{'offset ms':>10} {'duration ms':>12}  {'service':<20} {'span':<26} timeline"]
    for span in spans:
        offset, duration = span["start_ns"] - start, span["end_ns"] - span["start_ns"]
        left = int(offset * scale)
        bar = " " * left + "█" * max(1, int(duration * scale))
        name = span["name"]
        if "busy_ns" in span:
            name += f" ({span['busy_ns'] / 1e6:.1f} ms busy)"
        service = span["service"].removeprefix("parkade-")
        lines.append(f"{offset / 1e6:>10.1f} {duration / 1e6:>12.1f}  {service:<20} {name:<26} {bar}")
    return "\n".join(lines)


def main(request_id: str, path: Path) -> int:
    if not path.exists():
        print(
            f"parkade trace: no trace file at {path}: start Parkade with `parkade up --trace`",
            file=sys.stderr,
        )
        return 2
    spans = request_spans(load(path), request_id)
    if not spans:
        message = f"no span of request {request_id!r} in {path} (yet? spans are written in batches)"
        print(f"parkade trace: {message}", file=sys.stderr)
        return 1
    print(waterfall(spans))
    return 0
