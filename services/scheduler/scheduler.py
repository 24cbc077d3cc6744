"""`Scheduler`: token-level continuous batching over a paged KV cache. Pure Python: no torch, no I/O.

    add(EngineRequest)            a request joins the waiting queue
    schedule() -> StepPlan        hand out this step's tokens
    update(plan, result) -> [GeneratedTokens]
    finish_request(id, reason)    abort, or a stop string matched

There are no prefill and decode phases. Each request has `num_computed_tokens`; every step
hands out at most `max_num_batched_tokens` tokens (the token budget) to at most `max_num_seqs`
requests: running requests first (a decode is one token; a chunked prefill continues), then
admissions from the waiting queue. A long prompt is split into chunks across steps.
When a running request cannot get a block, the scheduler preempts by recompute: the victim (the
newest request, or under the priority policy the lowest-priority one) gives all its blocks back
and returns to the waiting queue; its prefix-cached blocks make its re-prefill cheap.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import msgspec

from parkade.schemas import (
    CachedRequestData,
    EngineRequest,
    ErrorKind,
    FinishReason,
    GeneratedTokens,
    NewRequestData,
    StepPlan,
    StepResult,
)
from parkade.services.scheduler.config import AdmissionMode, SchedulerConfig, SchedulingPolicy
from parkade.services.scheduler.kv_cache_manager import KVCacheManager
from parkade.services.scheduler.queue import WaitingQueue
from parkade.services.scheduler.request import Request, RequestStatus


class OverloadedError(ValueError):
    """The waiting queue is at its bounds: the request is refused now rather than queued."""


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_free_blocks: int
    num_live_tokens: int  # tokens whose KV the running requests hold
    num_allocated_slots: int  # used blocks * block_size
    num_preemptions: int
    num_prefix_queries: int  # prompt tokens looked up in the prefix cache at admissions
    num_prefix_hits: int  # of them, found

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0

    @property
    def kv_cache_usage(self) -> float:
        """Used blocks / all blocks, 0 to 1 (vLLM's `kv_cache_usage_perc`)."""
        total = self.num_used_blocks + self.num_free_blocks
        return self.num_used_blocks / total if total else 0.0

    @property
    def kv_utilization(self) -> float:
        return self.num_live_tokens / self.num_allocated_slots if self.num_allocated_slots else 0.0


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # A request may never hold more tokens than max_model_len or the whole pool.
        self.max_request_len = min(config.max_model_len, config.num_blocks * config.block_size)
        self.step_id = 0
        self.num_preemptions = 0
        self._in_executor: set[str] = set()  # requests whose state the executor holds
        self._finished_ids: list[str] = []  # to tell the executor in the next plan
        self._stop_sets: dict[frozenset[int], frozenset[int]] = {}

    # ---- requests in and out -------------------------------------------------------------
    def add(self, engine_request: EngineRequest, output_token_ids: Sequence[int] = ()) -> None:
        """Queue a request. Raises ValueError at once for a prompt that could never run.

        `output_token_ids`: what it generated already (a restarted scheduler resumes it from
        the log): its next token has that index, and it is recomputed from prompt + those."""
        if engine_request.request_id in self.requests:
            raise ValueError(f"request_id {engine_request.request_id!r} is already in use")
        self.validate(engine_request)
        num_waiting = len(self.waiting)
        # A request resumed with its outputs (a restarted scheduler's) was admitted before.
        if (
            num_waiting
            and not output_token_ids
            and (
                num_waiting >= self.config.max_waiting_requests
                or self.waiting.num_tokens + len(engine_request.prompt_token_ids)
                > self.config.max_waiting_tokens
            )
        ):
            raise OverloadedError(
                f"overloaded: {num_waiting} requests ({self.waiting.num_tokens} tokens) waiting; "
                f"the limits are max_waiting_requests={self.config.max_waiting_requests}, "
                f"max_waiting_tokens={self.config.max_waiting_tokens}"
            )
        request = Request(engine_request, self.config.block_size)
        if output_token_ids:
            request.prompt_logprobs = None  # they went out with its first token
            request.all_token_ids.extend(output_token_ids)
            request.num_tokens += len(output_token_ids)
            request.num_output_tokens = len(output_token_ids)
        request.max_num_tokens = self._reservation(request)
        request.num_tokens_left = request.max_num_tokens - request.num_tokens
        params = request.sampling_params
        eos = () if params.ignore_eos else request.eos_token_ids
        stop_token_ids = frozenset((*eos, *params.stop_token_ids))
        # Requests share one set object per distinct set (a bounded few), which stays in the CPU
        # cache where thousands of per-request sets would not.
        shared = self._stop_sets.get(stop_token_ids)
        if shared is None and len(self._stop_sets) < 256:
            self._stop_sets[stop_token_ids] = shared = stop_token_ids
        request.stop_token_ids = shared or stop_token_ids
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def validate(self, engine_request: EngineRequest) -> None:
        """Raise ValueError if the request could never run. Reads only the configuration."""
        request_id = engine_request.request_id
        num_prompt = len(engine_request.prompt_token_ids)
        if num_prompt > self.config.max_model_len:
            raise ValueError(
                f"prompt of request {request_id!r} has {num_prompt} tokens, more than "
                f"max_model_len={self.config.max_model_len}"
            )
        if num_prompt > self.max_request_len:
            raise ValueError(
                f"prompt of request {request_id!r} has {num_prompt} tokens, more than the KV pool "
                f"holds ({self.config.num_blocks} blocks of {self.config.block_size} tokens)"
            )

    def finish_request(
        self,
        request_id: str,
        reason: FinishReason = FinishReason.ABORT,
        stop_reason: int | str | None = None,
        *,
        error: str | None = None,
        error_kind: ErrorKind | None = None,
    ) -> GeneratedTokens | None:
        """End a live request early (abort, stop string, an error named by `error`). Returns its
        final event, or None when the request is unknown or already finished (idempotent)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, reason, stop_reason)
        return GeneratedTokens(
            request_id=request_id,
            index=request.num_output_tokens,
            token_ids=(),
            finish_reason=reason,
            stop_reason=stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            error=error,
            error_kind=error_kind,
        )

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason, request.stop_reason = reason, stop_reason
        self.kv.free(request)
        del self.requests[request.request_id]
        if request.request_id in self._in_executor:
            self._in_executor.discard(request.request_id)
            self._finished_ids.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self, isolate: Collection[str] = ()) -> StepPlan:
        """Hand out this step's tokens. The plan's requests are already counted as computed.

        `isolate`: requests to run in a step of their own. The first of them in the waiting
        queue's order is admitted alone, ahead of the queue, when it fits; otherwise (none waits,
        or no room) the step is the usual one, which none of them joins: admissions stop at the
        first of them. Who is isolated, and until when, is the caller's."""
        self.step_id += 1
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        grown: dict[str, CachedRequestData] = {}  # running requests whose block table grew
        preempted: list[Request] = []
        new_requests: list[NewRequestData] = []

        # 0. A request to isolate (the service suspects it of failing steps) gets a step of its own
        # when it fits; then if that step fails too, it alone is to blame.
        if isolate and self.waiting:
            budget = self._admit_isolated(isolate, budget, scheduled, new_requests)
        if not scheduled:  # the usual step (or the request to isolate found no room: the others go on)
            budget = self._schedule_running(budget, scheduled, grown, preempted)
            budget = self._admit(budget, scheduled, preempted, new_requests, isolate)

        preempted_ids = tuple(r.request_id for r in preempted if r.request_id in self._in_executor)
        self._in_executor.difference_update(preempted_ids)
        self._in_executor.update(r.request_id for r in new_requests)
        plan = StepPlan(
            step_id=self.step_id,
            new_requests=tuple(new_requests),
            cached_requests=tuple(grown.values()),
            num_scheduled_tokens=scheduled,
            finished_request_ids=tuple(self._finished_ids),
            preempted_request_ids=preempted_ids,
        )
        self._finished_ids = []
        return plan

    def _schedule_running(
        self,
        budget: int,
        scheduled: dict[str, int],
        grown: dict[str, CachedRequestData],
        preempted: list[Request],
    ) -> int:
        """1. Running requests, in admission order; -> the budget left."""
        # NOTE: this loop and `update` run once per running request per step: keep them lean.
        # A scheduled request's counters move at once; a victim that was scheduled earlier in this
        # loop (priority policy only) has its tokens handed back.
        allocate_slots, running_status = self.kv.allocate_slots, RequestStatus.RUNNING
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not running_status:
                continue  # preempted earlier in this loop
            num_computed = request.num_computed_tokens
            num_known = request.num_tokens + request.num_output_placeholders
            # Steps in flight already sample its last token (max_tokens or the length limit).
            if request.num_output_placeholders and request.num_output_placeholders >= request.num_tokens_left:
                continue
            num_new = num_known - num_computed
            if num_new <= 0:
                continue
            if num_new > budget:
                num_new = budget
            if num_computed + num_new <= request.kv_noop_until:
                blocks = ()  # what `allocate_slots` would answer, without the call
            else:
                blocks = allocate_slots(request, num_new)
            while blocks is None:
                victim = self._pick_victim()
                if victim.request_id in scheduled:
                    victim_tokens = scheduled.pop(victim.request_id)
                    budget += victim_tokens
                    victim.num_computed_tokens -= victim_tokens
                    grown.pop(victim.request_id, None)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                blocks = allocate_slots(request, num_new)
            if blocks is None:
                continue
            request_id = request.request_id
            scheduled[request_id] = num_new
            budget -= num_new
            if blocks:  # the executor knows the other requests' block tables already
                grown[request_id] = CachedRequestData(
                    request_id=request_id, new_block_ids=tuple(blocks), num_computed_tokens=num_computed
                )
            request.num_computed_tokens = num_computed = num_computed + num_new
            if num_computed == num_known:
                request.num_output_placeholders += 1  # this step samples its next token
        return budget

    def _admit(
        self,
        budget: int,
        scheduled: dict[str, int],
        preempted: list[Request],
        new_requests: list[NewRequestData],
        isolate: Collection[str] = (),
    ) -> int:
        """2. Admissions from the head of the queue, unless this step had to preempt (the pool is
        full); -> the budget left. FCFS: nobody overtakes the head of the queue, and a request to
        isolate joins no step that others are in."""
        while (
            not preempted
            and budget > 0
            and len(self.waiting) > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            if scheduled and request.request_id in isolate:
                break
            num_new = self._admit_one(request, budget, scheduled, new_requests)
            if num_new is None:
                break
            self.waiting.pop()
            budget -= num_new
        return budget

    def _admit_isolated(
        self,
        isolate: Collection[str],
        budget: int,
        scheduled: dict[str, int],
        new_requests: list[NewRequestData],
    ) -> int:
        """0. The first waiting request of `isolate`, alone (see `schedule`); -> the budget left."""
        request = next((r for r in self.waiting if r.request_id in isolate), None)
        if request is None or len(self.running) >= self.config.max_num_seqs:
            return budget
        num_new = self._admit_one(request, budget, scheduled, new_requests)
        if num_new is None:
            return budget
        self.waiting.remove(request)
        return budget - num_new

    def _admit_one(
        self,
        request: Request,
        budget: int,
        scheduled: dict[str, int],
        new_requests: list[NewRequestData],
    ) -> int | None:
        """Admit a waiting request (its prefix-cache hits, blocks for what it computes this step)
        into this step -> its tokens, or None, changing nothing, when it cannot start now. The
        caller takes it out of the waiting queue."""
        hit_blocks, num_hit = self.kv.match_prefix(request)
        num_new = request.num_tokens - num_hit
        if not self.config.enable_chunked_prefill and num_new > budget:
            return None
        num_new = min(num_new, budget)
        reserved = 0
        if self.config.admission is AdmissionMode.RESERVE:
            reserved = max(0, request.max_num_tokens - num_hit - num_new)
        if self.kv.allocate_slots(request, num_new, hit_blocks, reserved) is None:
            return None
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.admitted_step = self.step_id
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        self.kv.record_admission(request, num_hit)
        params = request.sampling_params
        if params.prompt_logprobs is not None and request.prompt_logprobs is None:
            # Sent with its first token already: a recompute needs no prompt logprobs.
            params = msgspec.structs.replace(params, prompt_logprobs=None)
        new_requests.append(
            NewRequestData(
                request_id=request.request_id,
                token_ids=tuple(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=params,
                block_ids=tuple(request.block_ids),
                num_computed_tokens=num_hit,
                eos_token_ids=request.eos_token_ids,
            )
        )
        scheduled[request.request_id] = num_new
        request.num_computed_tokens = num_hit + num_new
        if request.num_computed_tokens == request.num_tokens:  # (no placeholders while waiting)
            request.num_output_placeholders += 1  # this step samples its next token
        return num_new

    def _reservation(self, request: Request) -> int:
        """Prompt + max_tokens, capped: where a request stops at the latest (`max_num_tokens`), and
        the tokens that `reserve` admission holds slots for."""
        max_tokens = request.sampling_params.max_tokens
        wanted = self.max_request_len if max_tokens is None else request.num_prompt_tokens + max_tokens
        return min(wanted, self.max_request_len)

    def _pick_victim(self) -> Request:
        if self.config.scheduling_policy is SchedulingPolicy.PRIORITY:
            return max(self.running, key=Request.sort_key)
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Called while scheduling, before `num_computed_tokens` counts this step's tokens: blocks
        the victim registered for this step are never computed, so they leave the cache."""
        self.running.remove(request)
        self.kv.free(request, request.num_computed_tokens)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # results in flight are dropped (see `update`)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(request)

    def update(self, plan: StepPlan, result: StepResult) -> list[GeneratedTokens]:
        """Append the sampled tokens, finish the requests that stop. Returns one event per token.

        Results for requests that finished or were preempted since the plan are dropped. With
        several steps in flight, results must arrive in step order.
        """
        outputs: list[GeneratedTokens] = []
        logprobs = result.logprobs or (None,) * len(result.request_ids)
        requests, running_status, step_id = self.requests, RequestStatus.RUNNING, plan.step_id
        if result.prompt_logprobs:
            self._add_prompt_logprobs(plan, result)
        finished: list[Request] = []
        for request_id, token_id, token_logprobs in zip(
            result.request_ids, result.sampled_token_ids, logprobs, strict=True
        ):
            request = requests.get(request_id)
            if (
                request is None
                or request.status is not running_status
                # Sampled for an earlier admission: before a preemption, or for a finished request
                # whose id a new request reuses.
                or step_id < request.admitted_step
            ):
                continue
            request.num_output_placeholders -= 1
            request.all_token_ids.append(token_id)
            request.num_tokens += 1
            request.num_output_tokens = num_outputs = request.num_output_tokens + 1
            request.num_tokens_left = num_left = request.num_tokens_left - 1
            reason = stop_reason = None
            if token_id in request.stop_token_ids:
                reason, stop_reason = self._check_stop_token(request, token_id, num_outputs)
            if reason is None and num_left <= 0:
                reason = FinishReason.LENGTH  # max_tokens, or too long
            if reason is not None:
                finished.append(request)
                self._finish(request, reason, stop_reason)
            prompt_logprobs = request.prompt_logprobs
            if prompt_logprobs is not None:  # its first token: they go out with it, once
                request.prompt_logprobs = None
                prompt_logprobs = tuple(prompt_logprobs)
            outputs.append(
                GeneratedTokens(
                    request_id=request_id,
                    index=num_outputs - 1,
                    token_ids=(token_id,),
                    logprobs=None if token_logprobs is None else (token_logprobs,),
                    finish_reason=reason,
                    stop_reason=stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    prompt_logprobs=prompt_logprobs,
                )
            )
        if finished:  # one pass, not a list.remove per finished request
            self.running = [r for r in self.running if r.status is running_status]
        return outputs

    def _add_prompt_logprobs(self, plan: StepPlan, result: StepResult) -> None:
        """Keep the prompt logprobs a step computed until the request's first token. A request
        recomputed after a preemption sends positions it sent before: kept once, by position."""
        for chunk in result.prompt_logprobs:
            request = self.requests.get(chunk.request_id)
            if (
                request is None
                or request.prompt_logprobs is None
                or request.status is not RequestStatus.RUNNING
                or plan.step_id < request.admitted_step
            ):
                continue
            have = request.prompt_logprobs
            if chunk.start <= len(have):
                have.extend(chunk.logprobs[len(have) - chunk.start :])

    @staticmethod
    def _check_stop_token(
        request: Request, token_id: int, num_outputs: int
    ) -> tuple[FinishReason | None, int | None]:
        """A sampled token that is in `request.stop_token_ids`: does it stop the request?"""
        params = request.sampling_params
        if num_outputs < params.min_tokens:
            return None, None
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return FinishReason.STOP, None
        return FinishReason.STOP, token_id

    def recompute_all(self) -> None:
        """Every running request gives its blocks back and waits to be recomputed, as after a
        preemption, and the prefix cache is emptied. For when the executor dropped its request
        state (it failed a step, or it is a new one; the caller knows which): its pool's blocks
        may hold K/V never written, and the next plan names none of the old requests as finished
        or preempted, since the executor holds none of them."""
        for request in reversed(self.running):
            self.kv.free(request)
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            request.num_output_placeholders = 0
            self.waiting.add_preempted(request)
        self.running = []
        emptied = self.kv.reset_prefix_cache()
        assert emptied, "a request holds blocks after every running one freed its own"
        self._in_executor.clear()
        self._finished_ids = []

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's `reset_prefix_cache`); False, changing
        nothing, while a running request holds blocks."""
        return self.kv.reset_prefix_cache()

    # ---- introspection -------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_used_blocks=pool.num_used_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_live_tokens=sum(r.num_computed_tokens for r in self.running),
            num_allocated_slots=pool.num_used_blocks * self.config.block_size,
            num_preemptions=self.num_preemptions,
            num_prefix_queries=self.kv.num_prefix_queries,
            num_prefix_hits=self.kv.num_prefix_hits,
        )

    def check_integrity(self) -> None:
        """The block manager's invariants, plus: exactly the running requests hold blocks."""
        self.kv.check_integrity()
        assert set(self.kv.block_tables) == {r.request_id for r in self.running}
        assert len(self.running) + len(self.waiting) == len(self.requests)
        for request in self.running:
            assert request.status is RequestStatus.RUNNING
            assert request.num_computed_tokens <= request.num_tokens_with_placeholders
            assert request.num_output_placeholders >= 0
            assert self.kv.block_tables[request.request_id] is request.block_ids
            assert request.kv_noop_until <= len(request.block_ids) * self.config.block_size
            held = len(request.block_ids) * self.config.block_size
            assert held >= request.num_computed_tokens
        assert self.waiting.num_tokens == sum(r.num_tokens for r in self.waiting)
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.num_computed_tokens == 0
            assert not request.block_ids and request.kv_noop_until == 0
        for request in self.requests.values():  # the counters kept for speed
            assert request.num_tokens == len(request.all_token_ids)
            assert request.num_output_tokens == request.num_tokens - request.num_prompt_tokens
            assert request.num_tokens_left == request.max_num_tokens - request.num_tokens
