"""`parkade::paged_attention`: one attention layer's pool write and attention as a single torch op.

torch.compile traces the decoder around this op and never into it: a backend loops in Python over
requests, reads host lengths and calls compiled kernels through ctypes, none of which a graph can
hold. Everything the backend needs travels as tensors (no Python ints that vary per step, so that
one graph serves every batch), and the host lengths it wants are read back from the CPU tensors
inside the op, where that costs nothing.

The op writes this step's K/V into the pool (the schema marks k_cache and v_cache as written), then
attends; the compiler keeps the pool in place rather than copying it, since nothing else in the
graph reads it.

NOTE: defined with a plain `torch.library.Library` rather than `torch.library.custom_op`, whose
Python layers (autograd, in-place/view and default-filling wrappers) cost about 100 us a call
(measured: 209 us a call for a decode of 64 one-key requests, 95 of them in the backend), paid by
every layer of every step; there is no autograd here to wrap.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType

import torch

from parkade.kernels.metadata import host_lengths

__all__ = ["paged_attention"]

_LIBRARY = torch.library.Library("parkade", "FRAGMENT")
_LIBRARY.define(
    "paged_attention(Tensor q, Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor slot_mapping, Tensor cu_seqlens_q, Tensor seqused_k, Tensor block_table, float softmax_scale, "
    "int? sliding_window, str backend) -> Tensor"
)


@cache
def _backend(name: str) -> ModuleType:
    return importlib.import_module(name)


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
    query_lens: tuple[int, ...] = ()
    seq_lens: tuple[int, ...] = ()
    if not getattr(kernels, "READS_LENGTHS_ONCE_PER_STEP", False):  # else: it reads them, once a step
        query_lens, seq_lens = host_lengths(cu_seqlens_q, seqused_k)
    return kernels.paged_attention_varlen(
        q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max(query_lens, default=0),
        seqused_k=seqused_k, max_seqlen_k=max(seq_lens, default=0), softmax_scale=softmax_scale,
        block_table=block_table, sliding_window=sliding_window, query_lens=query_lens, seq_lens=seq_lens,
    )  # fmt: skip


_LIBRARY.impl("paged_attention", paged_attention, "CPU")
_LIBRARY.impl("paged_attention", paged_attention, "CUDA")


@torch.library.register_fake("parkade::paged_attention")
def _(q, key, value, k_cache, v_cache, slot_mapping, cu_seqlens_q, seqused_k, block_table, *args):
    return torch.empty_like(q)
