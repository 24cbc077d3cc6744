"""Structured logs (structlog) for every service: JSON lines when the output is not a terminal
(a log file, a container), readable lines on one.

Every line carries `service`, `level`, `timestamp`, `logger` and `event` (the message); where
known, `request_id`, `trace_id` and `step_id`, given as `extra` to the standard `logging` calls
the code makes (`log.warning("...", extra=logs.request(request_id, headers))`), so that one
request's lines can be found across services by its id or its trace.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import structlog

# What a log line may carry beyond the message (passed as `extra`).
FIELDS = ("request_id", "trace_id", "step_id", "executor_id", "scheduler_id", "topic", "offset", "reason")


def configure(
    service: str, stream: TextIO | None = None, *, json: bool | None = None, level: int = logging.INFO
) -> None:
    """Route the process's `logging` through structlog: JSON unless `stream` is a terminal."""
    stream = stream or sys.stderr
    if json is None:
        json = not stream.isatty()
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )

    def add_service(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("service", service)
        return event

    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.stdlib.ExtraAdder(allow=FIELDS),
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            add_service,
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiokafka").setLevel(logging.WARNING)  # its reconnect chatter at INFO


def request(request_id: str, headers: Sequence[tuple[str, bytes]] = ()) -> dict[str, str]:
    """`extra` for a line about one request: its id, and its trace id where its records carry one."""
    fields = {"request_id": request_id}
    traceparent = next((v for k, v in headers if k == "traceparent"), None)
    if traceparent is not None:
        parts = traceparent.decode(errors="replace").split("-")
        if len(parts) == 4:
            fields["trace_id"] = parts[1]
    return fields
