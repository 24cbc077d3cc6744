"""Pure-torch paged attention: the reference the kernel tests compare against, and the CPU backend.

The KV pool of one layer is two tensors `[num_blocks, block_size, num_kv_heads, head_dim]`. A token
at position `p` of request `b` lives in block `block_table[b, p // block_size]` at offset
`p % block_size`, i.e. pool slot `block_id * block_size + offset` (see `kernels/metadata.py`).

    request b's context:  | keys 0 .. seq_len-q_len-1 (cached) | q_len new tokens (queries) |
                          0                                            seq_len = seqused_k[b]

The query at position `p` sees keys `max(0, p - sliding_window + 1) .. p` (causal; no window: all).

NOTE: two paths. Decode requests (q_len == 1) are the bulk of serving steps, so they are batched:
one gather of their blocks, padded to the longest of them, and one masked fp32 computation. Prefill
chunks differ in shape, so each runs alone through torch SDPA with an explicit mask. Everything is
computed in fp32 (K/V gathered from the pool are copies anyway) and cast back to q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parkade.kernels.metadata import host_lengths

__all__ = ["decode_batch", "paged_attention_varlen", "write_kv_cache"]


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1: do not write this token
) -> None:
    """Store each token's key and value at its pool slot, in place. Slots must be distinct."""
    # view (not reshape): a copy would silently drop the writes.
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, num_kv_heads, head_dim]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_flat[slots] = key[keep].to(k_cache.dtype)
    v_flat[slots] = value[keep].to(v_cache.dtype)


def paged_attention_varlen(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    *,
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    max_seqlen_q: int,
    seqused_k: torch.Tensor,  # [num_seqs] int32: context length including this step's tokens
    max_seqlen_k: int,
    softmax_scale: float,
    block_table: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    sliding_window: int | None = None,
    query_lens: tuple[int, ...] = (),
    seq_lens: tuple[int, ...] = (),
) -> torch.Tensor:
    """Causal attention of each request's new queries over its paged context.

    Shaped like FlashAttention's `flash_attn_varlen_func` with a block table. Query head `h` reads
    KV head `h // (num_q_heads // num_kv_heads)` (transformers' `repeat_kv`). `query_lens` and
    `seq_lens` are host copies of the two length vectors; when given, no device sync happens to
    read them. `max_seqlen_q`/`max_seqlen_k` are accepted for signature parity and not needed.
    Prefill chunks run one by one through SDPA, every decode row in one `decode_batch` call.
    Returns `[num_tokens, num_q_heads, head_dim]` in q's dtype.
    """
    del max_seqlen_q, max_seqlen_k
    query_lens, seq_lens = host_lengths(cu_seqlens_q, seqused_k, query_lens, seq_lens)
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")

    out = torch.empty_like(q)
    decode_seqs: list[int] = []
    decode_rows: list[int] = []
    start = 0
    for b, q_len in enumerate(query_lens):
        if q_len == 1:
            decode_seqs.append(b)
            decode_rows.append(start)
        elif q_len > 1:
            rows = slice(start, start + q_len)
            out[rows] = _prefill_one(
                q[rows], k_cache, v_cache, block_table[b], seq_lens[b], softmax_scale, sliding_window
            )
        start += q_len

    if decode_seqs:
        lens = [seq_lens[b] for b in decode_seqs]
        if len(decode_seqs) == len(query_lens):  # pure decode step: rows and requests line up
            seqs, rows = slice(None), slice(None)
        else:
            seqs = torch.tensor(decode_seqs, device=q.device)
            rows = torch.tensor(decode_rows, device=q.device)
        out[rows] = decode_batch(
            q[rows], k_cache, v_cache, block_table[seqs], lens, softmax_scale, sliding_window
        )
    return out


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """`blocks` [..., n] block ids -> [..., n * block_size, num_kv_heads, head_dim] in fp32."""
    gathered = cache[blocks.long()]  # [..., n, block_size, num_kv_heads, head_dim]
    return gathered.flatten(-4, -3).float()


def _prefill_one(
    q: torch.Tensor,  # [q_len, num_q_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_row: torch.Tensor,  # [max_num_blocks] int32
    seq_len: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    q_len = q.shape[0]
    block_size = k_cache.shape[1]
    blocks = block_row[: -(-seq_len // block_size)]
    k = _gather_blocks(k_cache, blocks)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
    v = _gather_blocks(v_cache, blocks)[:seq_len]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]  # [q_len, 1]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]  # [1, seq_len]
    mask = k_pos <= q_pos  # [q_len, seq_len]; True = attend
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),  # [num_q_heads, q_len, head_dim]
        k.transpose(0, 1),  # [num_kv_heads, seq_len, head_dim]
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1).to(q.dtype)  # [q_len, num_q_heads, head_dim]


def decode_batch(
    q: torch.Tensor,  # [num_decodes, num_q_heads, head_dim]: each request's single query
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_decodes, max_num_blocks] int32
    seq_lens: list[int],
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    num_decodes, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    # Pad every request to the longest one's blocks; padded keys are masked out below.
    max_len = max(seq_lens)
    blocks = block_table[:, : -(-max_len // block_size)]
    k = _gather_blocks(k_cache, blocks)  # [num_decodes, padded_len, num_kv_heads, head_dim]
    v = _gather_blocks(v_cache, blocks)
    # q head h = kv_head * group + g, so this view groups query heads by the KV head they read.
    qg = q.float().view(num_decodes, num_kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,bskd->bkgs", qg, k) * scale  # [num_decodes, kv_heads, group, padded]

    lens = torch.tensor(seq_lens, device=q.device)[:, None]  # [num_decodes, 1]
    k_pos = torch.arange(k.shape[1], device=q.device)[None, :]  # [1, padded_len]
    mask = k_pos < lens  # the query sits at position len - 1
    if sliding_window is not None:
        mask &= k_pos > lens - 1 - sliding_window
    scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("bkgs,bskd->bkgd", probs, v)  # [num_decodes, kv_heads, group, head_dim]
    return out.reshape(num_decodes, num_q_heads, head_dim).to(q.dtype)
