"""What `LLM.generate` and `AsyncLLM.generate` return; the same classes and fields as vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per output position: token id -> Logprob (the sampled token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt position; None for the first (nothing comes before it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One sample of a request; `index` is its position among the request's n samples."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    # "stop", "length", "abort" or "error": a plain str, so that it prints as vLLM's does
    # (`finish_reason='length'`); it still equals the FinishReason of the same value.
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs
