"""`Engine`: tokenizer + `EngineCore` + `OutputProcessor`, the synchronous heart of `LLM` and
`AsyncLLM`. Requests go in as prompts; `RequestOutput`s come out of `step()`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from parkade.schemas import EngineRequest, FinishReason, SamplingParams
from parkade.services.engine.args import EngineArgs, build_engine_parts
from parkade.services.engine.core import EngineCore
from parkade.services.engine.output_processor import OutputProcessor
from parkade.services.engine.outputs import RequestOutput

# A prompt: text, {"prompt_token_ids": [...]}, or {"prompt": text}.
PromptType = str | dict[str, Any]


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


class Engine:
    def __init__(self, args: EngineArgs, *, skip_tokenizer_init: bool = False) -> None:
        self.args = args
        self.model_config, scheduler, executor = build_engine_parts(args)
        self.core = EngineCore(scheduler, executor)
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(args.tokenizer or args.model)
        self.output_processor = OutputProcessor(self.tokenizer)

    def prepare(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> tuple[EngineRequest, str | None]:
        """Tokenize and validate a request without touching engine state (thread-safe).

        Raises ValueError for a prompt that could never run."""
        text, token_ids = self._tokenize(prompt)
        vocab_size = self.model_config.vocab_size
        if token_ids and not 0 <= min(token_ids) <= max(token_ids) < vocab_size:
            raise ValueError(f"prompt_token_ids must be in [0, {vocab_size}) (the model's vocab_size)")
        request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=tuple(token_ids),
            sampling_params=params,
            eos_token_ids=self.model_config.eos_token_ids,
            priority=priority,
            arrival_time=time.monotonic(),
        )
        self.core.scheduler.validate(request)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        return request, text

    def add_prepared(self, request: EngineRequest, prompt: str | None) -> None:
        self.core.add_request(request)
        self.output_processor.add_request(
            request.request_id, prompt, list(request.prompt_token_ids), request.sampling_params
        )

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> None:
        self.add_prepared(*self.prepare(request_id, prompt, params, priority))

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        text = prompt["prompt"] if isinstance(prompt, dict) else prompt
        if self.tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass prompt_token_ids instead")
        return text, list(self.tokenizer.encode(text))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request with finish_reason "abort"; its final output, or None if unknown."""
        event = self.core.finish_request(request_id, FinishReason.ABORT)
        if event is None:
            self.output_processor.abort(request_id)
            return None
        outputs, _ = self.output_processor.process([event])
        return outputs[0] if outputs else None

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of every request that got a token or finished."""
        outputs, stopped = self.output_processor.process(self.core.step())
        for request_id, stop in stopped:
            self.core.finish_request(request_id, FinishReason.STOP, stop)
        return outputs
