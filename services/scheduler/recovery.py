"""What a restarted scheduler reads back from the generated topic (which it writes): which
requests finished, and the tokens each live one generated so far. Pure: the service's main.py
reads the records (`read_log`), `LiveRequests.recover` keeps the answer."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from parkade.schemas import GeneratedBatch, GeneratedTokens

log = logging.getLogger(__name__)


def read_back(messages: Iterable[object], start: int) -> tuple[list[str], dict[str, list[int]]]:
    """The generated topic's records from offset `start` (the saved progress) on ->
    (the requests that finished, in order; the live ones' output tokens so far).

    The progress is below every live request's first event, so a live request's events start at
    index 0 here. One whose first event read has a later index was not live at the last progress
    (it ends further on, and is then among the finished) or lost its history (which the progress
    rule excludes): it starts again from no output."""
    finished: dict[str, None] = {}
    outputs: dict[str, list[int]] = {}
    cut: set[str] = set()  # live requests whose first events are below `start`
    for message in messages:
        if isinstance(message, GeneratedBatch):
            events = message.events
        elif isinstance(message, GeneratedTokens):
            events = (message,)
        else:
            continue  # an announcement
        for event in events:
            request_id = event.request_id
            if event.finish_reason is not None:
                finished[request_id] = None
                outputs.pop(request_id, None)
                cut.discard(request_id)
                continue
            tokens = outputs.setdefault(request_id, [])
            if event.index > len(tokens):
                cut.add(request_id)
                continue
            # Events of one request are in index order; one read twice overlaps.
            tokens.extend(event.token_ids[len(tokens) - event.index :])
    for request_id in cut & outputs.keys():
        log.error("request %s: its first events are below offset %d; it starts again", request_id, start)
        outputs[request_id] = []
    return list(finished), outputs
