"""`CompiledForward`: the decoder's step (layers and logits) compiled by torch.compile on a CPU.

Eager, every RMSNorm, RoPE, SiLU gate, residual add and cast is its own op with its own pass over
memory and its own Python call. Inductor fuses them into a few C++ loops. With `freezing` the
weights become constants, so each linear is a oneDNN matmul on weights prepacked once into its
blocked layout (AMX tiles where the CPU has them, AVX512-BF16 or AVX2 otherwise: oneDNN picks at
run time), and linears that share an input (q/k/v, gate/up) are concatenated into one. Attention
stays a single opaque op (`kernels/attention_op.py`).

Shapes: one graph serves every batch. The batch dimensions are dynamic, and each call is padded so
that none of them is ever 0 or 1 (dynamo specializes those): one dummy request of one token is
appended (it writes nothing, slot -1, and reads block 0), the block table gets at least two
columns, and the logits rows at least two. Duck sizing is off, so that two dimensions that happen
to be equal on the first call are not assumed equal forever. So compiling happens once, in
`warmup()`, before any request; a later recompile is counted (`recompiles`) and logged.

Cache: inductor's caches live in `$PARKADE_HOME/inductor` (unless TORCHINDUCTOR_CACHE_DIR is set).
A restart finds every C++ kernel built (the slow part: tiny-llama compiles in about 10 s instead
of 24 s on two cores) but traces and generates code again: inductor's FX graph cache does not take
a graph holding oneDNN-packed weights (they cannot be pickled), and the packing is worth more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
import torch._dynamo
import torch.fx.experimental._config as fx_config

from parkade.kernels.metadata import AttentionMetadata
from parkade.services.common.environment import parkade_home, use_inductor_cache_dir
from parkade.services.executor.model import DecoderLM, KVCache

__all__ = ["INDUCTOR_OPTIONS", "CompiledForward"]

log = logging.getLogger(__name__)

INDUCTOR_OPTIONS = {
    "freezing": True,  # weights as constants: prepacked oneDNN matmuls, folded casts
    "cpp.enable_concat_linear": True,  # q/k/v and gate/up: one matmul each
    # The step's calls (kernels, extern ops) from a generated C++ wrapper rather than Python:
    # small-llama's offline round 4% faster (9.54 s against 9.93, alternated in one process,
    # 2026-12-06); compiling took 33 s instead of 29 with an empty cache, the same with a warm one.
    "cpp_wrapper": True,
    # Kernels read the thread count when they run, not when they compile: the executor sizes its
    # team while it serves (cpu_threads.py). Offline, tiny-llama: 8,755-8,870 tok/s against
    # 8,453-9,058 with the count compiled in (2026-12-06, alternated).
    "cpp.dynamic_threads": True,
    "size_asserts": False,
    "nan_asserts": False,
}


def _configure_inductor() -> None:
    """Set INDUCTOR_OPTIONS in inductor's global config. NOTE: global because `freezing` is read
    there when a graph compiles; torch.compile(options=...) does not reach it (measured: plain
    aten::mm on unpacked weights instead of oneDNN's packed linear)."""
    import torch._inductor.config as inductor_config

    for name, value in INDUCTOR_OPTIONS.items():
        *parents, leaf = name.split(".")
        target = inductor_config
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, leaf, value)


def _unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class _Step(torch.nn.Module):
    """The compiled region. NOTE: an nn.Module (not a bound method), so that dynamo installs the
    weights as the graph's own attributes, which `freezing` needs to treat them as constants."""

    def __init__(self, model: DecoderLM, kv_caches: list[KVCache]) -> None:
        super().__init__()
        self.model = model
        self.kv_caches = kv_caches

    def forward(
        self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
        cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor,
        logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        md = AttentionMetadata(slot_mapping, cu_seqlens_q, seqused_k, block_table, 0, 0)
        hidden = self.model.run_layers(input_ids, cos, sin, self.kv_caches, md)
        return hidden, self.model.compute_logits(hidden[logits_indices])


class CompiledForward:
    """Call it as `DecoderLM.forward` plus the logits rows: -> (hidden, logits of those rows)."""

    def __init__(self, model: DecoderLM, kv_caches: list[KVCache]) -> None:
        use_inductor_cache_dir(parkade_home() / "inductor")
        # NOTE: read when dynamo builds its shape environment, i.e. when it compiles.
        fx_config.use_duck_shape = False
        model.use_attention_op()
        self.model = model
        self.kv_caches = kv_caches
        _configure_inductor()
        # Dynamic only where __call__'s mark_dynamic says (the batch dimensions); the rest is static.
        self._compiled = torch.compile(_Step(model, kv_caches).eval(), fullgraph=True)
        self.compile_s: float | None = None
        self._warmup_graphs: int | None = None  # dynamo's graph count once warm
        self._seen_graphs = 0

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, num_seqs = input_ids.shape[0], md.seqused_k.shape[0]
        cos, sin = self.model.rotary(positions, md.max_seqlen_k)
        one = torch.ones(1, dtype=md.seqused_k.dtype)
        table = md.block_table.new_zeros(num_seqs + 1, max(2, md.block_table.shape[1]))
        table[:num_seqs, : md.block_table.shape[1]] = md.block_table
        last = torch.tensor([num_tokens, num_tokens], dtype=logits_indices.dtype)
        inputs = (
            torch.cat([input_ids, input_ids.new_zeros(1)]),
            torch.cat([cos, cos[:1]]),  # (a step has at least one token)
            torch.cat([sin, sin[:1]]),
            torch.cat([md.slot_mapping, md.slot_mapping.new_full((1,), -1)]),
            torch.cat([md.cu_seqlens_q, md.cu_seqlens_q[-1:] + 1]),
            torch.cat([md.seqused_k, one]),
            table,
            torch.cat([logits_indices, last]),
        )
        for tensor in inputs:
            torch._dynamo.mark_dynamic(tensor, 0)
        torch._dynamo.mark_dynamic(table, 1)
        hidden, logits = self._compiled(*inputs)
        if self._warmup_graphs is not None and _unique_graphs() > self._seen_graphs:
            self._seen_graphs = _unique_graphs()
            log.warning("the compiled forward compiled again, for a batch of %d tokens", num_tokens)
        return hidden[:num_tokens], logits[: logits_indices.shape[0]]

    @property
    def recompiles(self) -> int:
        """Graphs compiled since `warmup()` (0 when every batch fits the one graph). NOTE: dynamo's
        count is per process: another executor compiling in the same process counts too."""
        return 0 if self._warmup_graphs is None else _unique_graphs() - self._warmup_graphs

    @torch.inference_mode()
    def warmup(self, team_sizes: Sequence[int] = ()) -> float:
        """Compile now, on a dummy batch that writes nothing, once for each of `team_sizes` (the
        CPU threads the steps may run on: dynamo guards on the count, see cpu_threads.py; none:
        the count in force); -> seconds it took."""
        start = time.perf_counter()
        before = torch.get_num_threads()
        try:
            for size in team_sizes or (before,):
                torch.set_num_threads(size)
                self._dummy_step()
        finally:
            torch.set_num_threads(before)
        self.compile_s = time.perf_counter() - start
        self._warmup_graphs = self._seen_graphs = _unique_graphs()
        return self.compile_s

    @torch.inference_mode()
    def time_decode(self, rows: int, threads: int, repeats: int = 5) -> float:
        """Seconds of the fastest of `repeats` dummy decode steps (`rows` one-token requests, that
        write nothing) on `threads` threads: a size compiled at warm-up, so nothing compiles."""
        inputs = _dummy_inputs((1,) * rows)
        before = torch.get_num_threads()
        best = float("inf")
        try:
            torch.set_num_threads(threads)
            self(*inputs)  # warm caches
            for _ in range(repeats):
                start = time.perf_counter()
                self(*inputs)
                best = min(best, time.perf_counter() - start)
        finally:
            torch.set_num_threads(before)
        return best

    def _dummy_step(self) -> None:
        self(*_dummy_inputs((2, 1)))


def _dummy_inputs(
    query_lens: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """A step's inputs that write nothing (slots -1) and read block 0: requests of `query_lens`
    new tokens and no others, each token's logits row the request's last."""
    lens = torch.tensor(query_lens, dtype=torch.int32)
    cu_seqlens = torch.cat([lens.new_zeros(1), lens.cumsum(0, dtype=torch.int32)])
    num_tokens = int(cu_seqlens[-1])
    md = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
        cu_seqlens_q=cu_seqlens,
        seqused_k=lens,
        block_table=torch.zeros(len(query_lens), 3, dtype=torch.int32),
        max_seqlen_q=max(query_lens),
        max_seqlen_k=max(query_lens),
        query_lens=query_lens,
        seq_lens=query_lens,
    )
    positions = torch.cat([torch.arange(n) for n in query_lens])
    ids = torch.zeros(num_tokens, dtype=torch.int64)
    return ids, positions, md, cu_seqlens[1:].to(torch.int64) - 1
