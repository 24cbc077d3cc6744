"""Executor-side request state, and the flat token batch built from one step plan.

The executor mirrors what the plans say: each request's known tokens (it appends the tokens it
samples itself, so a decode step needs no token ids from the scheduler) and its block table,
which only grows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from parkade.kernels.metadata import AttentionMetadata
from parkade.schemas import NewRequestData, SamplingParams, StepPlan


@dataclass(eq=False)
class CachedRequestState:
    """One request as the executor holds it; also a `SamplingRow` for the sampler."""

    request_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    @classmethod
    def from_new(cls, new: NewRequestData) -> CachedRequestState:
        return cls(
            request_id=new.request_id,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            sampling_params=new.sampling_params,
            eos_token_ids=new.eos_token_ids,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
        )


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling] int64: rows whose hidden state gives a token
    sampling_states: list[CachedRequestState]  # aligned with logits_indices


def build_inputs(
    plan: StepPlan, states: dict[str, CachedRequestState], block_size: int, device: torch.device
) -> ModelInputs:
    """Flatten the plan's scheduled tokens, in plan order, into one batch.

        request r: tokens token_ids[nc : nc + n] at positions nc .. nc + n - 1,
                   slot(p) = block_ids[p // block_size] * block_size + p % block_size
    It samples when nc + n reaches the end of its known tokens.
    """
    input_ids, positions, slots = [], [], []
    query_lens, seq_lens, tables = [], [], []
    logits_indices, sampling_states = [], []
    offset = 0
    for request_id, n in plan.num_scheduled_tokens.items():
        state = states[request_id]
        start, end = state.num_computed_tokens, state.num_computed_tokens + n
        assert end <= len(state.token_ids), f"{request_id}: scheduled past its known tokens"
        pos = np.arange(start, end, dtype=np.int64)
        table = np.asarray(state.block_ids, dtype=np.int64)
        input_ids.append(np.asarray(state.token_ids[start:end], dtype=np.int64))
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        query_lens.append(n)
        seq_lens.append(end)
        tables.append(state.block_ids)
        offset += n
        if end == len(state.token_ids):
            logits_indices.append(offset - 1)
            sampling_states.append(state)
    max_blocks = max(len(t) for t in tables)
    block_table = np.zeros((len(tables), max_blocks), dtype=np.int32)
    for i, table in enumerate(tables):
        block_table[i, : len(table)] = table
    cu_seqlens_q = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=cu_seqlens_q[1:])

    def to(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device, non_blocking=True)

    metadata = AttentionMetadata(
        slot_mapping=to(np.concatenate(slots)),
        cu_seqlens_q=to(cu_seqlens_q),
        seqused_k=to(np.asarray(seq_lens, dtype=np.int32)),
        block_table=to(block_table),
        max_seqlen_q=max(query_lens),
        max_seqlen_k=max(seq_lens),
        query_lens=tuple(query_lens),
        seq_lens=tuple(seq_lens),
    )
    return ModelInputs(
        input_ids=to(np.concatenate(input_ids)),
        positions=to(np.concatenate(positions)),
        attn_metadata=metadata,
        logits_indices=to(np.asarray(logits_indices, dtype=np.int64)),
        sampling_states=sampling_states,
    )
