"""`LLM`: the offline API, shaped like vLLM's so that vLLM scripts run unchanged.

llm = LLM()  # the shipped stories260K; or LLM(model="path/to/hf-folder", max_num_seqs=64)
outputs = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32))
print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
from tqdm.auto import tqdm

from parkade.engine.args import EngineArgs
from parkade.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from parkade.engine.engine import Engine
from parkade.engine.outputs import RequestOutput
from parkade.models import DEFAULT_MODEL
from parkade.schemas import ChatMessage, RequestOutputKind, SamplingParams
from parkade.services.common.prompts import ChatOptions, ChatType
from parkade.services.scheduler.scheduler import OverloadedError
from parkade.services.tokenizer.frontend import PromptType, RequestStream


class LLM:
    """Engine settings are `EngineArgs` fields, named as in vLLM (the README's "Engine arguments"
    has the table). `model` defaults to the stories260K folder shipped with Parkade.

    Accepted as in vLLM: tokenizer, skip_tokenizer_init, dtype, seed, max_model_len, block_size,
    max_num_seqs, max_num_batched_tokens, enable_prefix_caching, enable_chunked_prefill,
    scheduling_policy, enforce_eager, kv_cache_memory_bytes (wins over gpu_memory_utilization),
    gpu_memory_utilization (on a CPU: a share of its RAM), disable_log_stats (default True; False
    logs a stats line every 10 s). Accepted, changing nothing: swap_space (logged: Parkade
    preempts by recompute), trust_remote_code (no folder code ever runs), served_model_name.
    Accepted at the one value Parkade implements, refused otherwise with the reason:
    tensor_parallel_size and pipeline_parallel_size (1), revision, tokenizer_revision and
    code_revision (None), tokenizer_mode, kv_cache_dtype and load_format ("auto"), max_logprobs
    (20). Parkade's own: admission, attention_backend, device, cpu_matmul_upcast,
    cpu_threads, max_waiting_requests, max_waiting_tokens.

    Raises ValueError for a vLLM argument Parkade does not implement (quantization, cpu_offload_gb,
    enable_lora, speculative_config, ...: parkade/engine/unsupported.py), unless its value is
    vLLM's default; TypeError for a name vLLM does not have either."""

    def __init__(
        self, model: str | Path = DEFAULT_MODEL, *, skip_tokenizer_init: bool = False, **kwargs: Any
    ) -> None:
        self.engine = Engine(
            EngineArgs.from_kwargs(model=model, **kwargs),
            skip_tokenizer_init=skip_tokenizer_init,
            offline=True,
        )
        self._counter = itertools.count()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block, as vLLM's (benchmarks call it between runs). False,
        changing nothing, while a request holds blocks."""
        return self.engine.core.scheduler.reset_prefix_cache()

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
        """Run every prompt to completion; outputs come back in the prompts' order, each with its
        n samples (as vLLM's, whatever the params' output_kind).

        `use_tqdm` shows a progress bar (requests done, input and output tokens per second), as
        vLLM's; a callable is used in place of `tqdm`. A prompt that could never run raises
        ValueError before any prompt is run."""
        if isinstance(prompts, str | Mapping):
            prompts = [prompts]
        params_list = self._params_list(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("priority must be one per prompt")
        streams = [
            self.engine.prepare(str(next(self._counter)), prompt, params, priority[i] if priority else 0)
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True))
        ]
        return self._run(streams, use_tqdm)

    def chat(
        self,
        messages: ChatType | Sequence[ChatType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to a
        list of them, as vLLM's `LLM.chat`: each is rendered by the chat template (the
        tokenizer's, or `chat_template`), then generated from like a prompt. `content` may be text
        or OpenAI's list of {"type": "text", "text": ...} parts (joined by newlines)."""
        for name, value in (
            ("lora_request", lora_request),
            ("tools", tools),
            ("mm_processor_kwargs", mm_processor_kwargs),
        ):
            if value is not None:
                raise ValueError(
                    f"{name} is not supported by Parkade (text-only models, no adapters, no tools)"
                )
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(
                "chat_template_content_format must be auto, string or openai; "
                f"got {chat_template_content_format!r}"
            )
        conversations = (
            [messages] if messages and isinstance(messages[0], Mapping | ChatMessage) else messages
        )
        chat = ChatOptions(
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
        )
        params_list = self._params_list(sampling_params, len(conversations))
        streams = [
            self.engine.prepare(
                str(next(self._counter)),
                "",
                params,
                chat=chat,
                messages=[_text_message(m) for m in conversation],
            )
            for conversation, params in zip(conversations, params_list, strict=True)
        ]
        return self._run(streams, use_tqdm)

    @staticmethod
    def _params_list(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        """One SamplingParams per prompt, each with output_kind FINAL_ONLY: `generate` and
        `chat` return finished requests only (vLLM does the same)."""

        def final_only(p: SamplingParams) -> SamplingParams:
            if p.output_kind is RequestOutputKind.FINAL_ONLY:
                return p
            return msgspec.structs.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)

        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [final_only(sampling_params or SamplingParams())] * count  # one copy for all
        if len(sampling_params) != count:
            raise ValueError("sampling_params must be one per prompt")
        return [final_only(p) for p in sampling_params]

    def _run(self, streams: list[RequestStream], use_tqdm: bool | Callable[..., tqdm]) -> list[RequestOutput]:
        """Queue prepared requests, step until all finished; their outputs in the same order.

        Requests join as the scheduler's waiting queue has room (its bounds protect a server; a
        batch job waits for room instead, as vLLM's offline engine has no bound). If anything
        raises (a failed step, Ctrl-C), the requests of this call still running are aborted, so
        that the engine serves the next call."""
        pending = collections.deque(streams)
        mine = {stream.request_id for stream in streams}
        progress = _Progress(len(streams), use_tqdm)
        finished: dict[str, RequestOutput] = {}
        try:
            while len(finished) < len(streams):
                while pending:
                    try:
                        self.engine.add_prepared(pending[0])
                    except OverloadedError:
                        if not self.engine.has_unfinished_requests():
                            raise  # it cannot join even an idle engine
                        break
                    pending.popleft()
                for output in self.engine.step():
                    if output.finished and output.request_id in mine:
                        finished[output.request_id] = output
                        progress.done(output)
        except BaseException:
            for stream in streams:
                if stream.request_id not in finished:
                    self.engine.abort(stream.request_id)  # (a no-op for one never added)
            raise
        finally:
            progress.close()
        return [finished[stream.request_id] for stream in streams]

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: bool | Callable[..., tqdm] = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the params.beam_width best sequences of each prompt, best
        first; beams share their prefix blocks (see `parkade.engine.beam_search`)."""
        return beam_search(self, prompts, params, use_tqdm=use_tqdm, concurrency_limit=concurrency_limit)


def _text_message(message: Mapping[str, Any] | ChatMessage) -> ChatMessage:
    """A chat message with text content; OpenAI's list of text parts is joined by newlines."""
    if isinstance(message, ChatMessage):
        return message
    content = message.get("content") or ""
    if not isinstance(content, str):
        texts = []
        for part in content:
            if part.get("type") != "text":
                raise ValueError(f"message content of type {part.get('type')!r} is not supported (text only)")
            texts.append(part["text"])
        content = "\n".join(texts)
    return ChatMessage(role=message["role"], content=content)


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
