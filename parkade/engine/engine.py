"""`Engine`: the front end + `EngineCore` + `OutputProcessor`, the synchronous heart of `LLM` and
`AsyncLLM`. Requests go in as prompts; `RequestOutput`s come out of `step()`.

The front end (`parkade.services.tokenizer.frontend`) is the tokenizer service's own: the same
tokenization, checks, arrival times, detokenization and stop strings as across Kafka.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from parkade.engine.args import EngineArgs
from parkade.engine.core import EngineCore
from parkade.engine.output_processor import OutputProcessor
from parkade.engine.outputs import RequestOutput
from parkade.engine.stats import StatLogger
from parkade.schemas import FinishReason, SamplingParams
from parkade.services.common.model_files import check_model_folder
from parkade.services.common.prompts import ChatOptions, ChatType
from parkade.services.executor.build import build_executor
from parkade.services.executor.executor import Executor
from parkade.services.executor.options import ExecutorOptions
from parkade.services.executor.simulated import SimulatedExecutor
from parkade.services.scheduler.config import KVGeometry, SchedulerConfig, SchedulingOptions, check_options
from parkade.services.scheduler.scheduler import Scheduler
from parkade.services.tokenizer.frontend import (
    FrontEnd,
    PromptType,
    RequestStream,
    TokenizerOptions,
    prompt_fields,
)

__all__ = ["Engine", "PromptType", "build_engine_parts"]


def build_engine_parts(
    args: EngineArgs, *, offline: bool = False
) -> tuple[Scheduler, Executor | SimulatedExecutor]:
    """Load the model, size the KV pool, and build the scheduler over that pool, as the executor
    and scheduler services do (`build_executor`, `SchedulerConfig.build`). `offline`: for `LLM`'s
    batches, whose unset token budget is the executor's offline one (vLLM's LLM class: 4096 on a
    CPU, where its server, as Parkade's services, takes 2048)."""
    scheduling = args.options(SchedulingOptions)
    executor, max_model_len = build_executor(
        args.options(ExecutorOptions),
        before_load=lambda max_len, block_size: check_options(
            scheduling, block_size=block_size, max_model_len=max_len
        ),
        environ=os.environ,
    )
    budget = executor.default_offline_batched_tokens if offline else executor.default_batched_tokens
    geometry = KVGeometry(executor.num_blocks, executor.block_size, max_model_len, budget)
    return Scheduler(SchedulerConfig.build(scheduling, geometry)), executor


class Engine:
    def __init__(self, args: EngineArgs, *, skip_tokenizer_init: bool = False, offline: bool = False) -> None:
        """`offline`: `LLM`'s batches (see build_engine_parts)."""
        self.args = args
        tokenizer = args.options(TokenizerOptions)
        if not skip_tokenizer_init:  # a folder without a tokenizer fails before the weights load
            check_model_folder(tokenizer.tokenizer or tokenizer.model, config=False, weights=False)
        scheduler, executor = build_engine_parts(args, offline=offline)
        # The engine's limit is the executor's (`build_executor` may lower an unset one to its
        # pool), and so the front end's: truncate_prompt_tokens=-1 cuts a prompt to it.
        tokenizer = dataclasses.replace(tokenizer, max_model_len=scheduler.config.max_model_len)
        self.frontend = FrontEnd.from_options(tokenizer, skip_tokenizer_init=skip_tokenizer_init)
        self.core = EngineCore(scheduler, executor)
        self.stat_logger = None if args.disable_log_stats else StatLogger(scheduler)
        self.output_processor = OutputProcessor(self.tokenizer)

    @property
    def tokenizer(self) -> Any | None:
        return self.frontend.tokenizer

    def prepare(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        chat: ChatOptions | None = None,
        messages: ChatType | None = None,
    ) -> RequestStream:
        """Tokenize and check a request without touching the scheduler or the executor, so that
        it may run beside a step in another thread (`AsyncLLM` does). NOTE: it advances the front
        end's arrival clock: call it from one thread at a time. `messages` (a chat, rendered as
        `chat` says) stand in for `prompt`.

        Raises ValueError for a prompt that could never run."""
        fields = {"messages": messages} if messages is not None else prompt_fields(prompt)
        request, stream = self.frontend.make_request(
            request_id, **fields, sampling_params=params, priority=priority, chat=chat
        )
        self.core.scheduler.validate(request)
        return stream

    def add_prepared(self, stream: RequestStream) -> None:
        """Queue each of the request's samples, sample 0 first (see `FrontEnd.make_request`). If
        the scheduler refuses one (overloaded), the ones queued are taken back and the error
        raised."""
        added: list[str] = []
        try:
            for request in stream.engine_requests:
                self.core.add_request(request)
                added.append(request.request_id)
        except BaseException:
            for engine_id in added:
                self.core.finish_request(engine_id, FinishReason.ABORT)
            raise
        self.output_processor.add_request(stream)

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> None:
        self.add_prepared(self.prepare(request_id, prompt, params, priority))

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Finish a request (every sample still running) with finish_reason "abort"; the outputs
        that says (one per sample, or one for all with FINAL_ONLY; none if unknown or finished)."""
        events = [
            event
            for engine_id in self.output_processor.engine_request_ids(request_id)
            if (event := self.core.finish_request(engine_id, FinishReason.ABORT)) is not None
        ]
        outputs, _ = self.output_processor.process(events)
        self.output_processor.abort(request_id)  # (gone already, unless the scheduler knew none)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of every request that got a token or finished."""
        events = self.core.step()
        if self.stat_logger is not None:
            self.stat_logger.record(events)
        outputs, stopped = self.output_processor.process(events)
        for engine_id, stop in stopped:
            reason = FinishReason.STOP if stop is not None else FinishReason.ABORT
            self.core.finish_request(engine_id, reason, stop)
        return outputs
