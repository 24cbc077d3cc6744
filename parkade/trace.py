"""`parkade trace REQUEST_ID`: one request's spans as a terminal waterfall, from the file that
`parkade up --trace` has the services write (`$PARKADE_HOME/traces.jsonl`, JSON lines).

  offset ms  duration ms  service    span                  timeline
        0.0          2.0  tokenizer  tokenize              █
        3.0         47.0  scheduler  scheduler.request #0    ███████████  prompt 5 tok, output 16 tok, length
        3.0         37.0  scheduler  scheduler.request #1    █████████    prompt 5 tok, output 9 tok, stop
        5.0         31.3  executor   executor.step x32         ███████    9.6 ms busy

The request's trace is every span under the trace id of the spans that name the request (the
gateway's request id names its choices' requests too: `cmpl-...-0`). The executor's steps live
in traces of their own, linked to the requests they served: they are shown as one line, from the
first to the last step that served the request, with their count and summed time. The samples
of a request with n > 1 have spans of their own (ids `<request id>#i`): each row names its sample
and shows its own tokens and finish reason.
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
                "attributes": {},
            }
        )
    return sorted(mine, key=lambda s: (s["start_ns"], s["name"]))


# The attributes a row shows after its bar, in this order: what tells one sample from another.
_DETAILS = (
    ("parkade.replica", "replica {}"),
    ("parkade.step_id", "step {}"),
    ("parkade.prompt_tokens", "prompt {} tok"),
    ("parkade.prefix_cache_hit_tokens", "cached {} tok"),
    ("parkade.output_tokens", "output {} tok"),
    ("parkade.finish_reason", "{}"),
)


def label(span: dict[str, Any], request_id: str) -> str:
    """The row's name: the span's, and what its request id adds to the one asked for (a
    sample's `#i`, a gateway choice's `-i`), so that each sample's rows can be told apart."""
    named = str(span.get("attributes", {}).get("parkade.request_id", ""))
    suffix = named.removeprefix(request_id) if named.startswith(request_id) else ""
    return f"{span['name']} {suffix}" if suffix else span["name"]


def details(span: dict[str, Any]) -> str:
    attributes = span.get("attributes", {})
    shown = [text.format(attributes[key]) for key, text in _DETAILS if key in attributes]
    if "busy_ns" in span:
        shown.append(f"{span['busy_ns'] / 1e6:.1f} ms busy")
    return ", ".join(shown)


def waterfall(spans: list[dict[str, Any]], request_id: str = "") -> str:
    """One row per span: offset, duration, service, label, a bar on a shared time scale, details.

    NOTE: the columns are as wide as their widest cell, and the bar column is always BAR_WIDTH
    wide, so that every row's bar starts at the same column and its details after it."""
    start = min(s["start_ns"] for s in spans)
    end = max(s["end_ns"] for s in spans)
    scale = BAR_WIDTH / max(end - start, 1)
    rows = []
    for span in spans:
        offset, duration = span["start_ns"] - start, span["end_ns"] - span["start_ns"]
        left = min(int(offset * scale), BAR_WIDTH - 1)
        bar = " " * left + "█" * max(1, min(int(duration * scale), BAR_WIDTH - left))
        service = span["service"].removeprefix("parkade-")
        rows.append(
            (
                f"{offset / 1e6:.1f}",
                f"{duration / 1e6:.1f}",
                service,
                label(span, request_id),
                bar,
                details(span),
            )
        )
    header = ("offset ms", "duration ms", "service", "span", "timeline", "")
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(4)]
    lines = []
    for offset, duration, service, name, bar, detail in (header, *rows):
        cells = [
            offset.rjust(widths[0]),
            duration.rjust(widths[1]),
            service.ljust(widths[2]),
            name.ljust(widths[3]),
        ]
        lines.append(f"{'  '.join(cells)}  {bar.ljust(BAR_WIDTH)}  {detail}".rstrip())
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
    print(waterfall(spans, request_id))
    return 0
