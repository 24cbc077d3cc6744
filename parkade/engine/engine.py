"""`Engine`: the front end + `EngineCore` + `OutputProcessor`, the synchronous heart of `LLM` and
`AsyncLLM`. Requests go in as prompts; `RequestOutput`s come out of `step()`.

The front end (`parkade.services.tokenizer.frontend`) is the tokenizer service's own: the same
tokenization, checks, arrival times, detokenization and stop strings as across Kafka.
"""

from __future__ import annotations

from typing import Any

from parkade.engine.args import EngineArgs
from parkade.engine.core import EngineCore
from parkade.engine.output_processor import OutputProcessor
from parkade.engine.outputs import RequestOutput
from parkade.schemas import EngineRequest, FinishReason, SamplingParams
from parkade.services.common.model_config import ModelConfig
from parkade.services.executor.build import build_executor
from parkade.services.executor.executor import Executor
from parkade.services.executor.options import ExecutorOptions
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


def build_engine_parts(args: EngineArgs) -> tuple[ModelConfig, Scheduler, Executor]:
    """Load the model, size the KV pool, and build the scheduler over that pool, as the executor
    and scheduler services do (`build_executor`, `SchedulerConfig.build`)."""
    scheduling = args.options(SchedulingOptions)
    model_config, executor, max_model_len = build_executor(
        args.options(ExecutorOptions),
        before_load=lambda max_len: check_options(
            scheduling, block_size=args.block_size, max_model_len=max_len
        ),
    )
    geometry = KVGeometry(executor.num_blocks, args.block_size, max_model_len)
    return model_config, Scheduler(SchedulerConfig.build(scheduling, geometry)), executor


class Engine:
    def __init__(self, args: EngineArgs, *, skip_tokenizer_init: bool = False) -> None:
        self.args = args
        # The front end first: a folder without a tokenizer fails before the weights load.
        self.frontend = FrontEnd.from_options(
            args.options(TokenizerOptions), skip_tokenizer_init=skip_tokenizer_init
        )
        self.model_config, scheduler, executor = build_engine_parts(args)
        self.core = EngineCore(scheduler, executor)
        self.output_processor = OutputProcessor(self.tokenizer)

    @property
    def tokenizer(self) -> Any | None:
        return self.frontend.tokenizer

    def prepare(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> tuple[EngineRequest, RequestStream]:
        """Tokenize and check a request without touching the scheduler or the executor, so that
        it may run beside a step in another thread (`AsyncLLM` does). NOTE: it advances the front
        end's arrival clock: call it from one thread at a time.

        Raises ValueError for a prompt that could never run."""
        request, stream = self.frontend.make_request(
            request_id, **prompt_fields(prompt), sampling_params=params, priority=priority
        )
        self.core.scheduler.validate(request)
        return request, stream

    def add_prepared(self, request: EngineRequest, stream: RequestStream) -> None:
        self.core.add_request(request)
        self.output_processor.add_request(stream)

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> None:
        self.add_prepared(*self.prepare(request_id, prompt, params, priority))

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
