"""Messages between the scheduler and the executor: one `StepPlan` and one `StepResult` a step.

The plan carries only what changed since the previous step: a request the executor has not seen
(or one resumed after preemption) travels in full as `NewRequestData`; a running one as
`CachedRequestData` with its new block ids. Block tables only grow, so the executor keeps them.
A running request's entry does not grow with its context: a decode costs one entry in
`num_scheduled_tokens` (and one `CachedRequestData` each `block_size` tokens). An admission does:
its `NewRequestData` carries every token it has (a request resumed after a preemption, a
restart or a failed step, its outputs too), once per admission, as vLLM's.

    request tokens:  | computed (KV in pool) | scheduled this step | not yet scheduled |
                     0                num_computed_tokens   + num_scheduled_tokens
"""

from __future__ import annotations

import msgspec

from parkade.schemas.engine import TokenLogprobs
from parkade.schemas.sampling import SamplingParams


class NewRequestData(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A request the executor must (re)build state for. `token_ids` = prompt + outputs so far."""

    request_id: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[int, ...]
    num_computed_tokens: int  # prefix-cache hits are already computed
    eos_token_ids: tuple[int, ...] = ()  # suppressed until sampling_params.min_tokens
    traceparent: str = ""  # the request's W3C trace context, for the executor's spans ("": none)


class CachedRequestData(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A request the executor already holds whose block table grew: append `new_block_ids`.

    Sent only for requests that got new blocks this step (about one decode step in `block_size`):
    the executor knows every other scheduled request's state, so a decode costs the plan one entry
    in `num_scheduled_tokens` and nothing here."""

    request_id: str
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int


class StepPlan(msgspec.Struct, frozen=True, kw_only=True, tag="step_plan"):
    """What to compute in one step.

    `num_scheduled_tokens[request_id]` tokens are computed for each scheduled request, from its
    `num_computed_tokens` on. A request samples a token when that reaches the end of its known
    tokens (the last chunk of a prefill, or a decode). `finished_request_ids` and
    `preempted_request_ids` name requests whose executor state can be dropped; their blocks are
    already back in the scheduler's pool.
    """

    step_id: int
    new_requests: tuple[NewRequestData, ...] = ()
    cached_requests: tuple[CachedRequestData, ...] = ()
    num_scheduled_tokens: dict[str, int] = {}
    finished_request_ids: tuple[str, ...] = ()
    preempted_request_ids: tuple[str, ...] = ()
    # The executor this plan is for; another executor (a restarted one) ignores it.
    executor_id: str = ""
    # The scheduler that made it: step ids count per scheduler, and a new scheduler (a restart)
    # starts from an empty page table, so the executor drops the old one's requests.
    scheduler_id: str = ""
    # The generation of the executor's request state this plan builds on. The scheduler moves it
    # on whenever it recomputes every request (a failed step, an executor it lost and found
    # again); the executor drops its request state on a newer epoch and ignores older plans.
    epoch: int = 0

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class PromptLogprobs(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Logprobs of one request's prompt tokens `start + 1 ..`, from the positions a step
    computed (position p's logits give token p + 1's logprob)."""

    request_id: str
    start: int
    logprobs: tuple[TokenLogprobs, ...]


class StepResult(msgspec.Struct, frozen=True, kw_only=True, tag="step_result"):
    """The tokens sampled in step `step_id`, one per request that reached the end of its tokens."""

    step_id: int
    request_ids: tuple[str, ...] = ()
    sampled_token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs | None, ...] | None = None
    executor_id: str = ""
    scheduler_id: str = ""  # the plan's: step ids count per scheduler
    epoch: int = 0  # the plan's
    # Set when the step raised: nothing was sampled, and the executor dropped its request state
    # and moved to epoch + 1 (the scheduler recomputes every request there).
    error: str | None = None
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()  # of requests with prompt_logprobs set


def failed_step(step: StepPlan | StepResult, error: str) -> StepResult:
    """The answer to a step that did not run (it raised, or its plan or result could not be
    sent): nothing sampled, `error` saying why, addressed as `step` is."""
    return StepResult(
        step_id=step.step_id,
        executor_id=step.executor_id,
        scheduler_id=step.scheduler_id,
        epoch=step.epoch,
        error=error[:2000],
    )


class ExecutorAnnouncement(msgspec.Struct, frozen=True, kw_only=True, tag="executor_announcement"):
    """An executor's capacity, sent at start and then as a heartbeat on the step-results topic.

    The scheduler sizes its page table from it. A new `executor_id` means a new executor with an
    empty KV pool: the scheduler recomputes every running request there.
    """

    executor_id: str
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    # Whose plans it follows, and under which epoch: an epoch ahead of the scheduler's means a
    # failed step whose answer the scheduler never matched (a plan it did not send).
    scheduler_id: str = ""
    epoch: int = 0
    # The token budget it runs best at, for a scheduler whose user set none (None: the default).
    default_batched_tokens: int | None = None
