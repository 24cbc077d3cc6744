"""`OutputProcessor`: turns the scheduler's `GeneratedTokens` into vLLM's `RequestOutput`s.

The front end's `RequestStream` does the detokenization, stop strings and usage (as for the
tokenizer service); this adds what only the Python API shows: cumulative token ids and text, and
logprobs with their decoded tokens. A stop string that matches is returned, so that the engine
tells the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from parkade.engine.outputs import CompletionOutput, Logprob, RequestOutput
from parkade.schemas import GeneratedTokens
from parkade.services.tokenizer.frontend import RequestStream


@dataclass
class _Output:
    stream: RequestStream
    completion: CompletionOutput
    prompt_token_ids: list[int]  # made once: every output of the request shares it


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Output] = {}

    def add_request(self, stream: RequestStream) -> None:
        completion = CompletionOutput(0, "", [])
        if stream.request.sampling_params.logprobs is not None:
            completion.logprobs = []
            completion.cumulative_logprob = 0.0
        self.requests[stream.request_id] = _Output(stream, completion, list(stream.request.prompt_token_ids))

    def process(self, events: list[GeneratedTokens]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """-> (outputs of the requests that changed, [(request_id, stop string)] to finish)."""
        outputs, stopped = [], []
        for event in events:
            entry = self.requests.get(event.request_id)
            update = entry.stream.update(event) if entry is not None else None
            if update is None:
                continue
            completion = entry.completion
            completion.token_ids.extend(update.token_ids)
            self._add_logprobs(completion, event)
            completion.text = update.text
            if update.stop_scheduler:
                stopped.append((event.request_id, str(update.stop_reason)))
            if update.finish_reason is not None:
                completion.finish_reason = update.finish_reason
                completion.stop_reason = update.stop_reason
                del self.requests[event.request_id]
            outputs.append(self._output(entry))
        return outputs, stopped

    def _add_logprobs(self, completion: CompletionOutput, event: GeneratedTokens) -> None:
        if completion.logprobs is None or event.logprobs is None:
            return
        for position in event.logprobs:
            entry: dict[int, Logprob] = {}
            for token_id, logprob, rank in zip(
                position.token_ids, position.logprobs, position.ranks, strict=True
            ):
                decoded = self.tokenizer.decode([token_id]) if self.tokenizer is not None else None
                entry.setdefault(token_id, Logprob(logprob, rank, decoded))
            completion.logprobs.append(entry)
            completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + position.logprobs[0]

    def _output(self, entry: _Output) -> RequestOutput:
        stream, completion = entry.stream, entry.completion
        metrics = {"arrival_time": stream.request.arrival_time}
        if stream.first_token_time is not None:
            metrics["first_token_time"] = stream.first_token_time
        # A copy: a streaming consumer keeps what it got while the request goes on.
        snapshot = replace(
            completion,
            token_ids=list(completion.token_ids),
            logprobs=None if completion.logprobs is None else list(completion.logprobs),
        )
        return RequestOutput(
            request_id=stream.request_id,
            prompt=stream.prompt,
            prompt_token_ids=entry.prompt_token_ids,
            outputs=[snapshot],
            finished=completion.finish_reason is not None,
            num_cached_tokens=stream.num_cached_tokens,
            metrics=metrics,
        )

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
