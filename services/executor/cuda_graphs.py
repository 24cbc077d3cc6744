"""`DecodeGraphs`: decode steps replayed from captured CUDA graphs, as vLLM captures them.

A decode step of a small model is dominated by kernel launches (each layer launches a dozen
kernels, each a few microseconds of CPU), not by the GPU's work. A CUDA graph records the whole
forward pass once and replays it with one launch. A graph replays fixed buffers of fixed shapes,
so for each captured batch size there is one graph over the same static inputs:

    static buffers (largest size B):  input_ids [B]  positions [B]  slot_mapping [B]
                                      seqused_k [B]  block_table [B, max_blocks]  cu_seqlens_q = 0..B
    a step of n decodes: copy its inputs into rows :n, pad rows n:size (slot -1: no KV write; one
    key of block 0: finite garbage, dropped), replay the graph of the smallest size >= n, keep :n.

Only pure decode steps (one query per request) of at most the largest size run here, on the
Triton backend (its kernels read every length on the device). `num_splits` is fixed to 1, since the
split count depends on host lengths: a step the launcher would split (long contexts, few requests)
runs eagerly, as does any other step.

On a CPU there is no graph: `EagerGraph` "replays" by calling the captured function again on the
same static buffers, so the buffer handling is tested without a GPU (`tests/integration`).
"""

from __future__ import annotations

import functools
import time
import types
from collections.abc import Callable
from typing import Protocol

import torch

from parkade.kernels.metadata import AttentionMetadata
from parkade.services.executor.input_batch import ModelInputs
from parkade.services.executor.model import DecoderLM, KVCache

MAX_CAPTURE_SIZE = 256


def capture_sizes(max_size: int) -> list[int]:
    """vLLM's batch sizes: 1, 2, 4, then every multiple of 8 up to `max_size` (inclusive)."""
    sizes = [s for s in (1, 2, 4) if s <= max_size] + list(range(8, max_size + 1, 8))
    return sizes or [1]


class Graph(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...
    def replay(self) -> None: ...


class CudaGraph:
    def __init__(self, pool: object) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """The CPU stand-in: replay reruns the function over the static buffers into the same output."""

    def __init__(self, pool: object = None) -> None:
        del pool
        self.fn: Callable[[], torch.Tensor] | None = None
        self.out: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        assert self.fn is not None and self.out is not None
        self.out.copy_(self.fn())


class DecodeGraphs:
    def __init__(
        self,
        model: DecoderLM,
        kv_caches: list[KVCache],
        attention: types.ModuleType,
        *,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        max_size: int = MAX_CAPTURE_SIZE,
        graph_type: type[CudaGraph] | type[EagerGraph] = CudaGraph,
    ) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.num_kv_heads = model.config.num_key_value_heads
        self.choose_num_splits = attention.choose_num_splits
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_size)
        size = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(size, **i64)
        self.positions = torch.zeros(size, **i64)
        self.slot_mapping = torch.full((size,), -1, **i64)
        self.seqused_k = torch.ones(size, **i32)
        self.block_table = torch.zeros(size, self.max_blocks, **i32)
        self.cu_seqlens_q = torch.arange(size + 1, **i32)
        # The kernels the graphs record: the backend's, with the split count fixed.
        self.attention = types.SimpleNamespace(
            write_kv_cache=attention.write_kv_cache,
            paged_attention_varlen=functools.partial(attention.paged_attention_varlen, num_splits=1),
        )
        self.graph_type = graph_type
        self.graphs: dict[int, tuple[Graph, torch.Tensor]] = {}
        self.capture_s = 0.0
        self._recorded: tuple[torch.Tensor | None, ...] = ()

    def capture(self) -> None:
        """Record one graph per size, largest first (smaller ones reuse its memory pool)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.graph_type is CudaGraph else None
        for size in reversed(self.sizes):
            run = functools.partial(self._forward, size)
            run()  # warm-up: compiles the kernels and builds the RoPE tables outside the graph
            if self.graph_type is CudaGraph:
                torch.cuda.synchronize()
            graph = self.graph_type(pool)
            self.graphs[size] = graph, graph.capture(run)
        if self.graph_type is CudaGraph:
            torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start
        # The graphs hold these tensors' addresses: they must never be rebuilt (see `run`).
        self._recorded = (self.model.rotary.cos, self.model.rotary.sin, self.kv_caches[0][0])

    def _forward(self, size: int) -> torch.Tensor:
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            seqused_k=self.seqused_k[:size],
            block_table=self.block_table[:size],
            max_seqlen_q=1,
            max_seqlen_k=self.max_model_len,
        )
        original = [layer.self_attn.backend for layer in self.model.model.layers]
        self.model.set_attention_backend(self.attention)
        try:
            return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, metadata)
        finally:
            for layer, backend in zip(self.model.model.layers, original, strict=True):
                layer.self_attn.backend = backend

    def can_run(self, inputs: ModelInputs) -> bool:
        md = inputs.attn_metadata
        return (
            bool(self.graphs)
            and md.max_seqlen_q == 1
            and md.num_seqs <= self.sizes[-1]
            and md.block_table.shape[1] <= self.max_blocks
            and md.max_seqlen_k <= self.max_model_len
            # Long contexts with few requests want flash-decoding splits, which a graph fixes at 1.
            and self.choose_num_splits(md.num_seqs, self.num_kv_heads, 1, md.max_seqlen_k) == 1
        )

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """The decode step's hidden states [n, hidden], from the smallest graph that holds it."""
        md = inputs.attn_metadata
        recorded = (self.model.rotary.cos, self.model.rotary.sin, self.kv_caches[0][0])
        if any(now is not then for now, then in zip(recorded, self._recorded, strict=True)):
            raise RuntimeError("a tensor the decode graphs recorded was replaced: recapture them")
        n = md.num_seqs
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(md.slot_mapping, non_blocking=True)
        self.seqused_k[:n].copy_(md.seqused_k, non_blocking=True)
        width = md.block_table.shape[1]
        self.block_table[:n, :width].copy_(md.block_table, non_blocking=True)
        if n < size:  # padding rows: no KV write, one key of block 0
            self.input_ids[n:size] = 0
            self.positions[n:size] = 0
            self.slot_mapping[n:size] = -1
            self.seqused_k[n:size] = 1
            self.block_table[n:size, 0] = 0
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]
