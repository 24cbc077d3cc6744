"""`AttentionMetadata`: what every attention layer needs to know about one step's batch.

The executor builds one per step and passes it down the forward call (no hidden globals).
Tokens of all scheduled requests are flattened into one batch of `num_tokens` rows:

    q rows:   | req 0: 5 prefill tokens | req 1: 1 decode | req 2: 3 (prefill chunk) |
    cu_seqlens_q = [0, 5, 6, 9]

Request b's queries are its positions `seqused_k[b] - q_len_b .. seqused_k[b] - 1`: a query
attends causally to every key of its request up to and including its own position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: pool slot (block_id * block_size + offset); -1 skips
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32: query start of each request in the batch
    seqused_k: torch.Tensor  # [num_seqs] int32: context length after this step (computed + scheduled)
    block_table: torch.Tensor  # [num_seqs, max_num_blocks] int32: physical block ids, padded with 0
    max_seqlen_q: int
    max_seqlen_k: int
    # Host copies of the two length vectors, so that backends that loop per request on the CPU
    # need no device-to-host sync.
    query_lens: tuple[int, ...] = ()
    seq_lens: tuple[int, ...] = ()

    @property
    def num_seqs(self) -> int:
        return int(self.seqused_k.shape[0])


def host_lengths(
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    query_lens: tuple[int, ...] = (),
    seq_lens: tuple[int, ...] = (),
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(query_lens, seq_lens) on the host: the ones given, else read from the two tensors (a device
    sync on a GPU)."""
    if not query_lens:
        query_lens = tuple((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist())
    if not seq_lens:
        seq_lens = tuple(seqused_k.tolist())
    return query_lens, seq_lens
