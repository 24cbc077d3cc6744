"""`OutputProcessor`: turns the scheduler's `GeneratedTokens` into `RequestOutput`s.

It detokenizes, applies stop strings (a match finishes the request: the processor returns it
so that the engine tells the scheduler), and gathers logprobs. Shared by `LLM` and `AsyncLLM`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from parkade.schemas import FinishReason, GeneratedTokens, SamplingParams
from parkade.services.engine.outputs import CompletionOutput, Logprob, RequestOutput
from parkade.services.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    arrival_time: float
    completion: CompletionOutput = field(default_factory=lambda: CompletionOutput(0, "", []))
    num_cached_tokens: int = 0
    first_token_time: float | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer.for_request(self.tokenizer, prompt_token_ids, params)
        elif params.stop:
            raise ValueError("stop strings need a tokenizer")
        self.requests[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, detokenizer, time.monotonic()
        )
        if params.logprobs is not None:
            self.requests[request_id].completion.logprobs = []
            self.requests[request_id].completion.cumulative_logprob = 0.0

    def process(self, events: list[GeneratedTokens]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """-> (outputs of the requests that changed, [(request_id, stop string)] to finish)."""
        outputs, stopped = [], []
        for event in events:
            state = self.requests.get(event.request_id)
            if state is None:
                continue
            completion = state.completion
            state.num_cached_tokens = event.num_cached_tokens
            if event.token_ids and state.first_token_time is None:
                state.first_token_time = time.monotonic()
            completion.token_ids.extend(event.token_ids)
            self._add_logprobs(state, event)
            finish_reason, stop_reason = event.finish_reason, event.stop_reason
            if state.detokenizer is not None:
                matched = state.detokenizer.add_tokens(event.token_ids)
                if matched is not None:
                    if finish_reason is None:  # the scheduler still runs it
                        stopped.append((event.request_id, matched))
                    finish_reason, stop_reason = FinishReason.STOP, matched
                # A streamed text never shows what a stop string may still cut.
                completion.text = state.detokenizer.text(finished=finish_reason is not None)
            if finish_reason is not None:
                completion.finish_reason = str(finish_reason)
                completion.stop_reason = stop_reason
                del self.requests[event.request_id]
            outputs.append(self._output(state))
        return outputs, stopped

    def _add_logprobs(self, state: RequestState, event: GeneratedTokens) -> None:
        completion = state.completion
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

    def _output(self, state: RequestState) -> RequestOutput:
        completion = state.completion
        metrics = {"arrival_time": state.arrival_time}
        if state.first_token_time is not None:
            metrics["first_token_time"] = state.first_token_time
        # A copy: a streaming consumer keeps what it got while the request goes on.
        snapshot = replace(
            completion,
            token_ids=list(completion.token_ids),
            logprobs=None if completion.logprobs is None else list(completion.logprobs),
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[snapshot],
            finished=completion.finish_reason is not None,
            num_cached_tokens=state.num_cached_tokens,
            metrics=metrics,
        )

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
