"""Executor-side request state in persistent host buffers, and the flat batch of one step.

The executor mirrors what the plans say: each request's known tokens (it appends the tokens it
samples itself, so a decode step needs no token ids from the scheduler) and its block table,
which only grows. Both live in numpy buffers with one row per live request, written only where a
plan or a sampled token changes them; a step's inputs are then gathered with a few vectorized
indexing operations, with no Python loop over its tokens:

    rows      token_ids [rows, width]    num_tokens   num_computed   block_table [rows, blocks]
    r0 (a)    | 5 9 2 7 1 . . . |        5            3              | 4 7 . |
    r1 (free) | . . . . . . . . |        0            0              | . . . |
    r2 (b)    | 3 8 . . . . . . |        2            1              | 2 . . |

    plan {a: 2, b: 1} -> request rows [0, 2], positions [3, 4, 1], input ids [7, 1, 8],
                         slots block_table[row, pos // B] * B + pos % B
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from parkade.kernels.metadata import AttentionMetadata
from parkade.schemas import CachedRequestData, NewRequestData, SamplingParams, StepPlan


@dataclass(eq=False)
class CachedRequestState:
    """One request as the executor holds it; also a `SamplingRow` for the sampler."""

    request_id: str
    row: int  # its row in the InputBatch buffers
    token_ids: list[int]  # prompt + outputs so far (the sampler's penalties and seeds read it)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampling] int64: rows whose hidden state gives a token
    sampling_states: list[CachedRequestState]  # aligned with logits_indices
    rows: np.ndarray  # [num_seqs] buffer row of each scheduled request, in plan order
    num_scheduled: np.ndarray  # [num_seqs] tokens scheduled for each


def _grown(array: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """A zero-padded copy of a 2-D buffer with at least `shape` (each dimension at least doubled)."""
    rows = max(shape[0], 2 * array.shape[0]) if shape[0] > array.shape[0] else array.shape[0]
    cols = max(shape[1], 2 * array.shape[1]) if shape[1] > array.shape[1] else array.shape[1]
    out = np.zeros((rows, cols), dtype=array.dtype)
    out[: array.shape[0], : array.shape[1]] = array
    return out


class InputBatch:
    """The live requests' tokens, computed counts and block tables, one buffer row each.

    Rows are reused as requests come and go; the buffers grow (doubling) when more requests, a
    longer sequence or a longer block table needs it, and never shrink.
    """

    def __init__(self, block_size: int, device: torch.device, rows: int = 64, width: int = 512) -> None:
        self.block_size = block_size
        self.device = device
        self.token_ids = np.zeros((rows, width), dtype=np.int64)
        self.block_table = np.zeros((rows, max(1, width // block_size)), dtype=np.int32)
        self.num_tokens = np.zeros(rows, dtype=np.int64)
        self.num_computed = np.zeros(rows, dtype=np.int64)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.requests: dict[str, CachedRequestState] = {}
        self.prompt_logprobs_ids: set[str] = set()  # live requests that want prompt logprobs
        self._free_rows = list(range(rows - 1, -1, -1))  # popped from the end: lowest row first

    def __len__(self) -> int:
        return len(self.requests)

    def clear(self) -> None:
        for request_id in list(self.requests):
            self.remove(request_id)

    # ---- the plan's deltas ---------------------------------------------------------------
    def add(self, new: NewRequestData) -> None:
        if new.request_id in self.requests:
            self.remove(new.request_id)  # re-admitted after a preemption the plan did not name
        if not self._free_rows:
            old = self.token_ids.shape[0]
            self._grow(rows=2 * old)
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        n, nb = len(new.token_ids), len(new.block_ids)
        self._grow(width=n + 1, blocks=nb)
        self.token_ids[row, :n] = new.token_ids
        self.block_table[row, :nb] = new.block_ids
        self.num_tokens[row], self.num_computed[row], self.num_blocks[row] = n, new.num_computed_tokens, nb
        self.requests[new.request_id] = CachedRequestState(
            request_id=new.request_id,
            row=row,
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            sampling_params=new.sampling_params,
            eos_token_ids=new.eos_token_ids,
        )
        if new.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs_ids.add(new.request_id)

    def remove(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        self.prompt_logprobs_ids.discard(request_id)
        if state is not None:
            # Zeroed, so that a later owner's block table is padded with 0 as kernels/metadata.py says.
            self.block_table[state.row, : self.num_blocks[state.row]] = 0
            self.num_tokens[state.row] = self.num_computed[state.row] = self.num_blocks[state.row] = 0
            self._free_rows.append(state.row)

    def extend_blocks(self, cached: CachedRequestData) -> None:
        """A running request's block table grew. Raises if the executor's view drifted."""
        row = self.requests[cached.request_id].row
        if self.num_computed[row] != cached.num_computed_tokens:
            raise RuntimeError(
                f"{cached.request_id}: executor at {self.num_computed[row]} tokens, "
                f"plan at {cached.num_computed_tokens}"
            )
        start = int(self.num_blocks[row])
        end = start + len(cached.new_block_ids)
        self._grow(blocks=end)
        self.block_table[row, start:end] = cached.new_block_ids
        self.num_blocks[row] = end

    def append_sampled(self, states: list[CachedRequestState], token_ids: list[int]) -> None:
        """Each sampling request's new token goes after its known tokens."""
        if not states:
            return
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        self._grow(width=int(self.num_tokens[rows].max()) + 1)
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1
        for state, token_id in zip(states, token_ids, strict=True):
            state.token_ids.append(token_id)

    def mark_computed(self, inputs: ModelInputs) -> None:
        """After the forward pass: the step's tokens have their K/V in the pool."""
        self.num_computed[inputs.rows] += inputs.num_scheduled

    def _grow(self, rows: int = 0, width: int = 0, blocks: int = 0) -> None:
        if rows > self.token_ids.shape[0] or width > self.token_ids.shape[1]:
            self.token_ids = _grown(self.token_ids, (rows, width))
        if rows > self.block_table.shape[0] or blocks > self.block_table.shape[1]:
            self.block_table = _grown(self.block_table, (rows, blocks))
        if rows > self.num_tokens.shape[0]:
            size = self.token_ids.shape[0]
            self.num_tokens, self.num_computed, self.num_blocks = (
                np.concatenate([a, np.zeros(size - a.shape[0], dtype=a.dtype)])
                for a in (self.num_tokens, self.num_computed, self.num_blocks)
            )

    # ---- one step ------------------------------------------------------------------------
    def build(self, plan: StepPlan) -> ModelInputs:
        """Flatten the plan's scheduled tokens, in plan order, into one batch.

            request r: tokens token_ids[nc : nc + n] at positions nc .. nc + n - 1,
                       slot(p) = block_ids[p // block_size] * block_size + p % block_size
        It samples when nc + n reaches the end of its known tokens.
        """
        scheduled = plan.num_scheduled_tokens
        num_seqs = len(scheduled)
        states = [self.requests[request_id] for request_id in scheduled]
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=num_seqs)
        num_new = np.fromiter(scheduled.values(), dtype=np.int64, count=num_seqs)
        start = self.num_computed[rows]
        end = start + num_new
        known = self.num_tokens[rows]
        if (end > known).any():
            late = [s.request_id for s, bad in zip(states, end > known, strict=True) if bad]
            raise RuntimeError(f"scheduled past their known tokens: {late}")
        if ((end - 1) // self.block_size >= self.num_blocks[rows]).any():
            raise RuntimeError("scheduled past the blocks a request holds")
        cu_seqlens_q = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu_seqlens_q[1:])
        # Token t of the batch belongs to request seq[t], at position start + (t - its first t).
        seq = np.repeat(np.arange(num_seqs), num_new)
        positions = np.arange(cu_seqlens_q[-1]) - cu_seqlens_q[seq] + start[seq]
        token_rows = rows[seq]
        input_ids = self.token_ids[token_rows, positions]
        bs = self.block_size
        slot_mapping = self.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        block_table = self.block_table[rows, : int(self.num_blocks[rows].max())]
        samples = end == known

        def to(array: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, dtype, non_blocking=True)

        query_lens, seq_lens = num_new.tolist(), end.tolist()
        metadata = AttentionMetadata(
            slot_mapping=to(slot_mapping),
            cu_seqlens_q=to(cu_seqlens_q, torch.int32),
            seqused_k=to(end, torch.int32),
            block_table=to(block_table, torch.int32),
            max_seqlen_q=max(query_lens),
            max_seqlen_k=max(seq_lens),
            query_lens=tuple(query_lens),
            seq_lens=tuple(seq_lens),
        )
        return ModelInputs(
            input_ids=to(input_ids),
            positions=to(positions),
            attn_metadata=metadata,
            logits_indices=to(cu_seqlens_q[1:][samples] - 1),
            sampling_states=[states[i] for i in np.flatnonzero(samples).tolist()],
            rows=rows,
            num_scheduled=num_new,
        )
