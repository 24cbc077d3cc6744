"""`LLM`: the offline API, shaped like vLLM's so that vLLM scripts run unchanged.

llm = LLM()  # the shipped stories260K; or LLM(model="path/to/hf-folder", max_num_seqs=64)
outputs = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32))
print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from parkade.engine.args import EngineArgs
from parkade.engine.engine import Engine
from parkade.engine.outputs import RequestOutput
from parkade.models import DEFAULT_MODEL
from parkade.schemas import SamplingParams
from parkade.services.tokenizer.frontend import PromptType


class LLM:
    """Engine settings are `EngineArgs` fields, named as in vLLM: tokenizer, block_size,
    max_num_seqs, max_num_batched_tokens, enable_prefix_caching, enable_chunked_prefill,
    kv_cache_memory_bytes, max_model_len, dtype, seed, scheduling_policy; plus admission,
    attention_backend, device. `model` defaults to the stories260K folder shipped with Parkade."""

    def __init__(
        self, model: str | Path = DEFAULT_MODEL, *, skip_tokenizer_init: bool = False, **kwargs: Any
    ) -> None:
        self.engine = Engine(
            EngineArgs.from_kwargs(model=model, **kwargs), skip_tokenizer_init=skip_tokenizer_init
        )
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., tqdm] = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.

        `use_tqdm` shows a progress bar (requests done, input and output tokens per second), as
        vLLM's; a callable is used in place of `tqdm`. A prompt that could never run raises
        ValueError before any prompt is run."""
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
        for request, stream in prepared:
            self.engine.add_prepared(request, stream)
        progress = _Progress(len(prepared), use_tqdm)
        finished: dict[str, RequestOutput] = {}
        try:
            while len(finished) < len(prepared):
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        progress.done(output)
        finally:
            progress.close()
        return [finished[request.request_id] for request, _ in prepared]


class _Progress:
    """The progress bar of one `generate` call: requests done, and token rates since its start."""

    def __init__(self, total: int, use_tqdm: bool | Callable[..., tqdm]) -> None:
        self.bar = None
        if use_tqdm:
            make = use_tqdm if callable(use_tqdm) else tqdm
            self.bar = make(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
            self.bar.set_postfix_str(self._rates(0, 0, 1.0))
        self.start = time.perf_counter()
        self.input_tokens = self.output_tokens = 0

    @staticmethod
    def _rates(input_tokens: int, output_tokens: int, seconds: float) -> str:
        return f"input: {input_tokens / seconds:.1f} tok/s, output: {output_tokens / seconds:.1f} tok/s"

    def done(self, output: RequestOutput) -> None:
        if self.bar is None:
            return
        self.input_tokens += len(output.prompt_token_ids)
        self.output_tokens += sum(len(c.token_ids) for c in output.outputs)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(self._rates(self.input_tokens, self.output_tokens, elapsed), refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
