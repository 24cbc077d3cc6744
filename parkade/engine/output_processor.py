"""`OutputProcessor`: turns the scheduler's `GeneratedTokens` into vLLM's `RequestOutput`s.

The front end's `RequestStream` does the detokenization, stop strings and usage (as for the
tokenizer service); this adds what only the Python API shows: cumulative token ids and text,
logprobs with their decoded tokens, prompt logprobs, and the output kinds. A stop string that
matches is returned, so that the engine tells the scheduler.

With n > 1 samples, as vLLM: CUMULATIVE and DELTA outputs carry the one sample that changed
(its `index` says which); FINAL_ONLY waits for every sample and carries all n, in index order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from parkade.engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from parkade.schemas import GeneratedTokens, RequestOutputKind, TokenLogprobs
from parkade.services.tokenizer.frontend import RequestStream, StreamUpdate


@dataclass
class _Output:
    stream: RequestStream
    completions: list[CompletionOutput]  # one per sample, cumulative
    prompt_token_ids: list[int]  # made once: every output of the request shares it
    kind: RequestOutputKind
    prompt_logprobs: PromptLogprobs | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Output] = {}  # by the client's request id
        self.engine_ids: dict[str, str] = {}  # a sample's engine request id -> the client's id

    def add_request(self, stream: RequestStream) -> None:
        params = stream.request.sampling_params
        completions = []
        for sample in stream.samples:
            completion = CompletionOutput(sample.index, "", [])
            if params.logprobs is not None:
                completion.logprobs = []
                completion.cumulative_logprob = 0.0
            completions.append(completion)
        self.requests[stream.request_id] = _Output(
            stream, completions, list(stream.request.prompt_token_ids), params.output_kind
        )
        for engine_id in stream.engine_request_ids:
            self.engine_ids[engine_id] = stream.request_id

    def process(
        self, events: list[GeneratedTokens]
    ) -> tuple[list[RequestOutput], list[tuple[str, str | None]]]:
        """-> (outputs of the requests that changed, [(engine request id, stop string)] that the
        scheduler must finish: a sample a stop string ended (STOP), or one of a request that
        failed (None: abort))."""
        outputs, stopped = [], []
        for event in events:
            request_id = self.engine_ids.get(event.request_id)
            entry = self.requests.get(request_id) if request_id is not None else None
            update = entry.stream.update(event) if entry is not None else None
            if update is None:
                continue
            completion = entry.completions[update.sample_index]
            completion.token_ids.extend(update.token_ids)
            new_logprobs = self._logprobs(event.logprobs) if completion.logprobs is not None else []
            if completion.logprobs is not None:
                completion.logprobs.extend(new_logprobs)
                completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + sum(
                    p.logprobs[0] for p in event.logprobs or ()
                )
            completion.text = update.text
            if update.prompt_logprobs is not None:
                entry.prompt_logprobs = [None, *self._logprobs(update.prompt_logprobs)]
            if update.stop_scheduler:
                stopped.append((event.request_id, str(update.stop_reason)))
            stopped += [(engine_id, None) for engine_id in update.cancel]
            if update.finish_reason is not None:
                completion.finish_reason = update.finish_reason.value  # see CompletionOutput
                completion.stop_reason = update.stop_reason
            if entry.stream.finished:
                self._forget(entry.stream)
            output = self._output(entry, update, new_logprobs)
            if output is not None:
                outputs.append(output)
        return outputs, stopped

    def _logprobs(self, positions: tuple[TokenLogprobs, ...] | None) -> list[dict[int, Logprob]]:
        out = []
        for position in positions or ():
            entry: dict[int, Logprob] = {}
            for token_id, logprob, rank in zip(
                position.token_ids, position.logprobs, position.ranks, strict=True
            ):
                decoded = self.tokenizer.decode([token_id]) if self.tokenizer is not None else None
                entry.setdefault(token_id, Logprob(logprob, rank, decoded))
            out.append(entry)
        return out

    def _output(
        self, entry: _Output, update: StreamUpdate, new_logprobs: list[dict[int, Logprob]]
    ) -> RequestOutput | None:
        stream = entry.stream
        if entry.kind is RequestOutputKind.FINAL_ONLY:
            if not stream.finished:
                return None
            completions = [self._snapshot(c) for c in entry.completions]
        elif entry.kind is RequestOutputKind.DELTA:
            completion = entry.completions[update.sample_index]
            completions = [
                replace(
                    completion,
                    text=update.text_delta,
                    token_ids=list(update.token_ids),
                    logprobs=None if completion.logprobs is None else new_logprobs,
                )
            ]
        else:
            completions = [self._snapshot(entry.completions[update.sample_index])]
        metrics = {"arrival_time": stream.request.arrival_time}
        if stream.first_token_time is not None:
            metrics["first_token_time"] = stream.first_token_time
        return RequestOutput(
            request_id=stream.request_id,
            prompt=stream.prompt,
            prompt_token_ids=entry.prompt_token_ids,
            outputs=completions,
            finished=stream.finished,
            num_cached_tokens=stream.num_cached_tokens,
            metrics=metrics,
            # DELTA: only the output they came with (vLLM sends them once).
            prompt_logprobs=(
                entry.prompt_logprobs
                if entry.kind is not RequestOutputKind.DELTA or update.prompt_logprobs is not None
                else None
            ),
        )

    @staticmethod
    def _snapshot(completion: CompletionOutput) -> CompletionOutput:
        """A copy: a streaming consumer keeps what it got while the request goes on."""
        return replace(
            completion,
            token_ids=list(completion.token_ids),
            logprobs=None if completion.logprobs is None else list(completion.logprobs),
        )

    def engine_request_ids(self, request_id: str) -> tuple[str, ...]:
        """The samples the scheduler may still run for a request (none when unknown)."""
        entry = self.requests.get(request_id)
        return entry.stream.live_engine_request_ids() if entry is not None else ()

    def _forget(self, stream: RequestStream) -> None:
        self.requests.pop(stream.request_id, None)
        for engine_id in stream.engine_request_ids:
            self.engine_ids.pop(engine_id, None)

    def abort(self, request_id: str) -> None:
        entry = self.requests.get(request_id)
        if entry is not None:
            self._forget(entry.stream)
