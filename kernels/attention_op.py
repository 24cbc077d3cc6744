"""`parkade::paged_attention`: one attention layer's pool write and attention as a single torch op.

torch.compile traces the decoder around this op and never into it: a backend loops in Python over
requests, reads host lengths and calls compiled kernels through ctypes, none of which a graph can
hold. Everything the backend needs travels as tensors (no Python ints that vary per step, so that
one graph serves every batch), and the host lengths it wants are read back from the CPU tensors
inside the op, where that costs nothing.

The op writes this step's K/V into the pool (`mutates_args`), then attends; the compiler keeps the
pool in place rather than copying it, since nothing else in the graph reads it.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType

import torch

from parkade.kernels.metadata import host_lengths

__all__ = ["paged_attention"]


@cache
def _backend(name: str) -> ModuleType:
    return importlib.import_module(name)


@torch.library.custom_op("parkade::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    sliding_window: int | None,
    backend: str,  # the kernels module's name, e.g. "parkade.kernels.attention_cpu"
) -> torch.Tensor:
    kernels = _backend(backend)
    kernels.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    query_lens, seq_lens = host_lengths(cu_seqlens_q, seqused_k)
    return kernels.paged_attention_varlen(
        q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max(query_lens, default=0),
        seqused_k=seqused_k, max_seqlen_k=max(seq_lens, default=0), softmax_scale=softmax_scale,
        block_table=block_table, sliding_window=sliding_window, query_lens=query_lens, seq_lens=seq_lens,
    )  # fmt: skip


@paged_attention.register_fake
def _(q, key, value, k_cache, v_cache, slot_mapping, cu_seqlens_q, seqused_k, block_table, *args):
    return torch.empty_like(q)
