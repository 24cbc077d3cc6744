"""`InputBatch`: persistent buffers give the same step inputs as building them per request."""

from __future__ import annotations

import random

import pytest
import torch

from parkade.schemas import CachedRequestData, NewRequestData, SamplingParams, StepPlan
from parkade.services.executor.input_batch import InputBatch

BS = 4


def new(request_id: str, tokens: list[int], blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(
        request_id=request_id,
        token_ids=tuple(tokens),
        num_prompt_tokens=len(tokens),
        sampling_params=SamplingParams(),
        block_ids=tuple(blocks),
        num_computed_tokens=computed,
    )


def reference(plan, known, computed, tables):
    """The per-request loop the buffers replace."""
    ids, positions, slots, samples, offset = [], [], [], [], 0
    for request_id, n in plan.num_scheduled_tokens.items():
        start = computed[request_id]
        for p in range(start, start + n):
            ids.append(known[request_id][p])
            positions.append(p)
            slots.append(tables[request_id][p // BS] * BS + p % BS)
        offset += n
        if start + n == len(known[request_id]):
            samples.append(offset - 1)
    return ids, positions, slots, samples


def test_random_steps_match_the_per_request_loop_while_buffers_grow_and_rows_are_reused():
    rng = random.Random(0)
    batch = InputBatch(BS, torch.device("cpu"), rows=2, width=8)  # tiny, to force every growth
    known: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    tables: dict[str, list[int]] = {}
    next_block, next_id = 0, 0
    for step in range(1, 60):
        # Finish some requests, admit some, and schedule everyone (a chunk or a decode).
        finished = tuple(r for r in known if rng.random() < 0.15)
        for r in finished:
            del known[r], computed[r], tables[r]
        new_requests, cached, scheduled = [], [], {}
        for _ in range(rng.randrange(0, 3)):
            request_id, next_id = f"r{next_id}", next_id + 1
            tokens = [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
            n = rng.randrange(1, len(tokens) + 1)
            blocks = list(range(next_block, next_block + -(-n // BS)))
            next_block += len(blocks)
            known[request_id], computed[request_id], tables[request_id] = tokens, 0, blocks
            new_requests.append(new(request_id, tokens, blocks))
            scheduled[request_id] = n
        for r in known:
            if r in scheduled or computed[r] == len(known[r]):
                continue
            n = min(len(known[r]) - computed[r], rng.randrange(1, 9))
            need = -(-(computed[r] + n) // BS) - len(tables[r])
            if need > 0:
                grown = list(range(next_block, next_block + need))
                next_block += need
                cached.append(
                    CachedRequestData(
                        request_id=r, new_block_ids=tuple(grown), num_computed_tokens=computed[r]
                    )
                )
                tables[r] += grown
            scheduled[r] = n
        if not scheduled:
            continue
        plan = StepPlan(
            step_id=step,
            new_requests=tuple(new_requests),
            cached_requests=tuple(cached),
            num_scheduled_tokens=scheduled,
            finished_request_ids=finished,
        )
        for r in finished:
            batch.remove(r)
        for n_ in new_requests:
            batch.add(n_)
        for c in cached:
            batch.extend_blocks(c)
        inputs = batch.build(plan)
        ids, positions, slots, samples = reference(plan, known, computed, tables)
        assert inputs.input_ids.tolist() == ids
        assert inputs.positions.tolist() == positions
        assert inputs.attn_metadata.slot_mapping.tolist() == slots
        assert inputs.logits_indices.tolist() == samples
        md = inputs.attn_metadata
        for i, r in enumerate(scheduled):
            assert md.block_table[i, : len(tables[r])].tolist() == tables[r]
            assert not md.block_table[i, len(tables[r]) :].any()  # padded with 0, whoever held the row
            assert md.seq_lens[i] == computed[r] + scheduled[r] == int(md.seqused_k[i])
        batch.mark_computed(inputs)
        for r, n in scheduled.items():
            computed[r] += n
        sampled = [rng.randrange(1000) for _ in inputs.sampling_states]
        batch.append_sampled(inputs.sampling_states, sampled)
        for state, token in zip(inputs.sampling_states, sampled, strict=True):
            known[state.request_id].append(token)
            assert state.token_ids == known[state.request_id]
    assert batch.token_ids.shape[0] > 2 and batch.token_ids.shape[1] > 8  # it grew
    assert len(batch) == len(known)


def test_a_plan_that_disagrees_with_the_executor_is_refused():
    batch = InputBatch(BS, torch.device("cpu"))
    batch.add(new("a", [1, 2, 3, 4, 5], [0, 1]))
    with pytest.raises(RuntimeError, match="executor at 0 tokens, plan at 4"):
        batch.extend_blocks(CachedRequestData(request_id="a", new_block_ids=(2,), num_computed_tokens=4))
    with pytest.raises(RuntimeError, match="past their known tokens"):
        batch.build(StepPlan(step_id=1, num_scheduled_tokens={"a": 6}))
    batch.remove("a")
    batch.add(new("b", list(range(9)), [3]))  # row 0 again; 9 tokens need 3 blocks
    with pytest.raises(RuntimeError, match="past the blocks"):
        batch.build(StepPlan(step_id=2, num_scheduled_tokens={"b": 9}))
