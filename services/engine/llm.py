"""`LLM`: the offline API, shaped like vLLM's so that vLLM scripts run unchanged.

llm = LLM(model="path/to/hf-folder", max_num_seqs=64)
outputs = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32))
print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from parkade.schemas import SamplingParams
from parkade.services.engine.args import EngineArgs
from parkade.services.engine.engine import Engine, PromptType
from parkade.services.engine.outputs import RequestOutput


class LLM:
    """Engine settings are `EngineArgs` fields, named as in vLLM: block_size, max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching, enable_chunked_prefill, kv_cache_memory_bytes,
    max_model_len, dtype, seed, scheduling_policy; plus admission, attention_backend, device."""

    def __init__(self, model: str | Path, *, skip_tokenizer_init: bool = False, **kwargs: Any) -> None:
        self.engine = Engine(EngineArgs(model=model, **kwargs), skip_tokenizer_init=skip_tokenizer_init)
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.

        A prompt that could never run raises ValueError before any prompt is run."""
        del use_tqdm  # accepted for vLLM compatibility; no progress bar
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts) or (priority is not None and len(priority) != len(prompts)):
            raise ValueError("sampling_params and priority must be one per prompt")
        prepared = [
            self.engine.prepare(str(next(self._counter)), prompt, params, priority[i] if priority else 0)
            for i, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True))
        ]
        for request, text in prepared:
            self.engine.add_prepared(request, text)
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(prepared):
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[request.request_id] for request, _ in prepared]
