"""What a restarted scheduler reads back from the generated topic (which it writes): which
requests finished, and the tokens each live one generated so far. Pure: the service's main.py
reads the records (`read_log`), `LiveRequests.recover` keeps the answer."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from parkade.schemas import GeneratedBatch, GeneratedTokens
from parkade.schemas.routing import DEFAULT_REPLICA

log = logging.getLogger(__name__)


def read_back(
    messages: Iterable[object], start: int, replica: str = DEFAULT_REPLICA
) -> tuple[list[str], dict[str, tuple[int, list[int]]]]:
    """The generated topic's records from offset `start` (the saved progress) on, those of
    `replica` only (the topic is shared) -> (the requests that finished, in order; for each live
    one, the index of its first event read and its output tokens from there).

    The progress is below every live request's first event, so a live request's events start at
    index 0 here, or, for one handed over from another replica, at the index it took over from
    (its tokenized record says how many tokens came before: `LiveRequest.resume`)."""
    finished: dict[str, None] = {}
    outputs: dict[str, tuple[int, list[int]]] = {}
    for message in messages:
        if isinstance(message, GeneratedBatch):
            if (message.replica or DEFAULT_REPLICA) != replica:
                continue
            events = message.events
        elif isinstance(message, GeneratedTokens):
            if (message.replica or DEFAULT_REPLICA) != replica:
                continue
            events = (message,)
        else:
            continue  # an announcement
        for event in events:
            request_id = event.request_id
            if event.finish_reason is not None:
                finished[request_id] = None
                outputs.pop(request_id, None)
                continue
            first, tokens = outputs.setdefault(request_id, (event.index, []))
            end = first + len(tokens)
            if event.index > end:
                log.error("request %s: a gap in its events at index %d; it starts again", request_id, end)
                outputs[request_id] = (event.index, list(event.token_ids))
                continue
            # Events of one request are in index order; one read twice overlaps.
            tokens.extend(event.token_ids[end - event.index :])
    return list(finished), outputs
