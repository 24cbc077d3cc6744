"""`Request`: the scheduler's record of one request, and the chained block hashes of its tokens.

    all_token_ids:  | prompt_token_ids | output_token_ids |
                    0       num_computed_tokens ^      num_tokens

`num_computed_tokens` counts tokens whose KV is in the pool (or is being written by a step in
flight). It only moves back on preemption, to 0: the request is recomputed from its prefix cache.
"""

from __future__ import annotations

import enum

from parkade.schemas import EngineRequest, FinishReason, SamplingParams, TokenLogprobs
from parkade.services.common.block_hash import BlockHash, hash_block, salt_root


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed
    FINISHED = "finished"


class Request:
    # Slots: the scheduler touches every running request's fields each step, and thousands of
    # slotted objects stay compact in the CPU cache where per-instance dicts do not.
    __slots__ = (  # noqa: RUF023 (the fields a step reads come first: they share cache lines)
        "status", "num_tokens", "num_computed_tokens", "num_output_placeholders", "num_tokens_left",
        "all_token_ids",
        "num_output_tokens", "max_num_tokens",
        "kv_noop_until", "block_ids", "num_hashed_blocks", "request_id", "admitted_step", "num_prompt_tokens",
        "sampling_params", "eos_token_ids", "num_cached_tokens", "stop_token_ids",
        "arrival_time", "block_hashes", "block_size", "finish_reason", "num_preemptions", "priority",
        "prompt_token_ids", "stop_reason", "block_hash_root", "prompt_logprobs",
    )  # fmt: skip

    def __init__(self, engine_request: EngineRequest, block_size: int) -> None:
        self.request_id = engine_request.request_id
        self.prompt_token_ids: tuple[int, ...] = engine_request.prompt_token_ids
        self.sampling_params: SamplingParams = engine_request.sampling_params
        self.eos_token_ids = engine_request.eos_token_ids
        self.priority = engine_request.priority
        self.arrival_time = engine_request.arrival_time
        self.block_size = block_size

        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.max_num_tokens = 0  # prompt + max_tokens, capped by the length limit: set by the scheduler
        # Kept as counters, not computed from the fields above, so that a step reads values it
        # wrote itself (hot in the CPU cache) rather than each request's constants.
        self.num_tokens = self.num_prompt_tokens  # len(all_token_ids)
        self.num_output_tokens = 0
        self.num_tokens_left = 0  # max_num_tokens - num_tokens: set by the scheduler, 0 stops it
        self.stop_token_ids: frozenset[int] = frozenset()  # EOS (unless ignored) + stop ids: set by it too
        self.num_computed_tokens = 0
        # Tokens that steps in flight will sample: a decode can be scheduled before the previous
        # token is known, because the executor keeps the tokens it samples.
        self.num_output_placeholders = 0
        self.admitted_step = 0  # results of steps before this one belong to an earlier admission
        self.num_cached_tokens = -1  # prefix-cache hit of the first admission; -1 before it
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        # block_hashes[i] covers all_token_ids[: (i + 1) * block_size]; grows with the tokens.
        self.block_hashes: list[BlockHash] = []
        self.block_hash_root = salt_root(engine_request.cache_salt)  # the first block's parent
        # Prompt logprobs computed so far (positions 1.. of the prompt), until they go out with
        # the first token; None when not asked for, or once sent.
        self.prompt_logprobs: list[TokenLogprobs] | None = (
            [] if self.sampling_params.prompt_logprobs is not None else None
        )
        # Owned by the KVCacheManager, kept here so that its per-step fast path reads no dict:
        # the block table (empty while the request holds no blocks), how many of its leading
        # blocks were offered to the prefix cache, and up to which num_computed_tokens + new
        # tokens `allocate_slots` has nothing to do (0: always ask it).
        self.block_ids: list[int] = []
        self.num_hashed_blocks = 0
        self.kv_noop_until = 0

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_tokens + self.num_output_placeholders

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    def block_token_ids(self, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(self.all_token_ids[start : start + self.block_size])

    def update_block_hashes(self) -> list[BlockHash]:
        """Extend `block_hashes` to every full block of the known tokens; return them all."""
        num_full = self.num_tokens // self.block_size
        while len(self.block_hashes) < num_full:
            index = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else self.block_hash_root
            self.block_hashes.append(hash_block(parent, self.block_token_ids(index)))
        return self.block_hashes

    def sort_key(self) -> tuple[int, float, str]:
        """Priority-policy order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time, self.request_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
