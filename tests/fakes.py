"""Test doubles that speak the real wire messages."""

from __future__ import annotations

import random

from parkade.schemas import StepPlan, StepResult


class FakeExecutor:
    """Follows step plans the way the real executor does, but samples random tokens.

    It keeps each request's known tokens and block table from the plans alone, so a plan that
    loses information (a missing block, a wrong num_computed_tokens) fails here.
    """

    default_batched_tokens = None  # the scheduler's default budget, as a GPU executor's

    def __init__(self, vocab_size: int = 50, seed: int = 0, block_size: int | None = None) -> None:
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.token_ids: dict[str, list[int]] = {}
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        # The latest token sampled at each output index, per request (a token sampled by a step
        # in flight when its request was preempted is sampled again after the recompute).
        self.sampled: dict[str, dict[int, int]] = {}
        self.num_prompt: dict[str, int] = {}
        # What each KV slot holds: (position, token id) of the token whose K/V was written there.
        # Reads check it, so a prefix-cache hit on a block that was never computed (or was
        # overwritten) fails here; needs block_size.
        self.slots: dict[int, tuple[int, int]] = {}

    @property
    def num_requests(self) -> int:
        return len(self.token_ids)

    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids + plan.preempted_request_ids:
            self.token_ids.pop(request_id)
            self.block_tables.pop(request_id)
            self.num_computed.pop(request_id)
        for new in plan.new_requests:
            assert new.request_id not in self.token_ids, "new request already known"
            self.token_ids[new.request_id] = list(new.token_ids)
            self.block_tables[new.request_id] = list(new.block_ids)
            self.num_computed[new.request_id] = new.num_computed_tokens
            self.num_prompt[new.request_id] = new.num_prompt_tokens
        for cached in plan.cached_requests:
            assert self.num_computed[cached.request_id] == cached.num_computed_tokens
            self.block_tables[cached.request_id].extend(cached.new_block_ids)
        if self.block_size is not None:
            self._check_kv(plan)
        request_ids, sampled = [], []
        for request_id, n in plan.num_scheduled_tokens.items():
            end = self.num_computed[request_id] + n
            assert end <= len(self.token_ids[request_id])
            self.num_computed[request_id] = end
            if end == len(self.token_ids[request_id]):
                token = self.rng.randrange(self.vocab_size)
                index = len(self.token_ids[request_id]) - self.num_prompt[request_id]
                self.token_ids[request_id].append(token)
                self.sampled.setdefault(request_id, {})[index] = token
                request_ids.append(request_id)
                sampled.append(token)
        return StepResult(
            step_id=plan.step_id, request_ids=tuple(request_ids), sampled_token_ids=tuple(sampled)
        )

    def _slot(self, request_id: str, position: int) -> int:
        assert self.block_size is not None
        table = self.block_tables[request_id]
        assert position // self.block_size < len(table), f"{request_id}: too few blocks"
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def _check_kv(self, plan: StepPlan) -> None:
        """Write this step's K/V, then check every token each request attends to (as one layer
        of the forward pass does: all writes, then all reads)."""
        for request_id, n in plan.num_scheduled_tokens.items():
            tokens, start = self.token_ids[request_id], self.num_computed[request_id]
            for pos in range(start, start + n):
                self.slots[self._slot(request_id, pos)] = (pos, tokens[pos])
        for request_id, n in plan.num_scheduled_tokens.items():
            tokens = self.token_ids[request_id]
            for pos in range(self.num_computed[request_id] + n):
                held = self.slots.get(self._slot(request_id, pos))
                assert held == (pos, tokens[pos]), f"{request_id} reads {held} at {pos}, not {tokens[pos]}"
