"""`AsyncLLM`: the streaming engine API, in one process (`parkade offline` runs on it).

    engine = AsyncLLM()  # the shipped stories260K; or AsyncLLM(model=DIR, ...)
    async for output in engine.generate("Once upon a time", params, request_id="r1"):
        print(output.outputs[0].text)   # cumulative, as vLLM's default output kind

NOTE: one background task owns the `Engine`. Each step runs on one worker thread of its own
(`StepThread`: always the same) so that the event loop stays free; adds and aborts are queued
and applied by that task between steps, so the engine is never touched by two threads at once.
Validation (`Engine.prepare`) reads only configuration, so `generate` raises a bad request's error
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from parkade.engine.args import EngineArgs
from parkade.engine.core import EngineDeadError
from parkade.engine.engine import Engine, PromptType
from parkade.engine.outputs import RequestOutput
from parkade.models import DEFAULT_MODEL
from parkade.schemas import SamplingParams
from parkade.services.executor.step_thread import StepThread


class AsyncLLM:
    """Takes the engine arguments `LLM` takes, with the same meanings and refusals (see `LLM`).
    NOTE: disable_log_stats defaults to True here too (vLLM's AsyncEngineArgs: False): `parkade
    offline` runs one prompt on it, and the services report through their metrics."""

    def __init__(
        self, model: str | Path = DEFAULT_MODEL, *, skip_tokenizer_init: bool = False, **kwargs: Any
    ) -> None:
        self.engine = Engine(
            EngineArgs.from_kwargs(model=model, **kwargs), skip_tokenizer_init=skip_tokenizer_init
        )
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._pending: list[tuple[str, Any]] = []  # ("add", RequestStream) | ("abort", request_id)
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._dead: EngineDeadError | None = None  # set once: a failed step, or shutdown
        self._step_thread = StepThread()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs until it finishes. Leaving the loop early (break,
        cancellation) aborts the request and frees its blocks."""
        request_id = request_id or uuid.uuid4().hex
        if self._dead is not None:
            raise self._dead
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = self.engine.prepare(request_id, prompt, sampling_params or SamplingParams(), priority)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self._submit(("add", stream))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._submit(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason "abort". Idempotent."""
        if self._dead is None:
            self._submit(("abort", request_id))

    def _submit(self, command: tuple[str, Any]) -> None:
        if self._dead is not None:
            return  # nothing runs any more; open streams already got the error
        self._pending.append(command)
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        assert self._wakeup is not None
        self._wakeup.set()

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for kind, arg in pending:
            if kind == "add":
                try:
                    self.engine.add_prepared(arg)
                except ValueError as error:  # this request's fault: fail its stream only
                    queue = self._queues.pop(arg.request_id, None)
                    if queue is not None:
                        queue.put_nowait(error)
            else:
                self._deliver(self.engine.abort(arg))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is None:
                continue
            queue.put_nowait(output)
            if output.finished:
                del self._queues[output.request_id]

    async def _run(self) -> None:
        assert self._wakeup is not None
        try:
            while True:
                self._apply_pending()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.clear()
                    if not self._pending:
                        await self._wakeup.wait()
                    continue
                outputs = await self._step_thread.run(self.engine.step)
                self._deliver(outputs)
        except BaseException as error:
            # A failed step or a shutdown ends every open stream with an error, never a hang.
            # NOTE: a step cancelled mid-way still finishes in its worker thread; since the loop
            # never restarts once dead, nothing touches the engine beside it.
            if isinstance(error, asyncio.CancelledError):
                self._dead = EngineDeadError("the engine was shut down")
            else:
                self._dead = EngineDeadError(f"the engine failed: {error!r}")
                self._dead.__cause__ = error
            for queue in self._queues.values():
                queue.put_nowait(self._dead)
            self._queues.clear()
            if isinstance(error, asyncio.CancelledError):
                raise

    async def shutdown(self) -> None:
        """Stop the engine loop; open streams end with EngineDeadError."""
        if self._loop_task is not None and not self._loop_task.done():
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, EngineDeadError):
                await self._loop_task
        if self._dead is None:
            self._dead = EngineDeadError("the engine was shut down")
        self._step_thread.close()
