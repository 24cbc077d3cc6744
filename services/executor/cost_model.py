"""`CostModel`: the predicted time of one step of a model on a GPU, a roofline of its real work.

A step's work is two kinds of operator, each bound by compute or by memory, whichever is slower:

    linear layers   FLOPs  2 * layer weights * tokens  +  2 * lm_head * sampled rows
                    bytes  every weight once (a step reads them whatever its batch)
    attention       FLOPs  4 * layers * heads * head_dim * sum over requests of the (query, key)
                           pairs: a chunk of n tokens after c computed ones has n*c + n(n+1)/2
                    bytes  each request's KV read once (c + n tokens) and its n new tokens written

    time = max(linear FLOPs / (peak * mfu), linear bytes / (bandwidth * bandwidth_share))
         + max(attention FLOPs / (peak * mfu), attention bytes / (bandwidth * bandwidth_share))
         + step_overhead

So a decode step of a small batch is bound by reading the weights, a large batch by reading its
KV, and a long prefill by FLOPs; what it leaves out: activations' traffic, the non-matmul
kernels (norms, RoPE, sampling) beyond the fixed overhead, tensor parallelism, quantization.
The defaults are fitted to published measurements (docs/benchmarks.md, "Validation of the cost
model").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from parkade.services.common.simulation import GPUProfile, ModelShape

# Defaults fitted to vLLM's published Llama-3.1-8B bf16 numbers on one H100 (docs/benchmarks.md,
# "Validation of the cost model"): its batch-1 time between tokens, 6.44 ms + 4.37e-5 ms per
# token of context, is 0.9 of HBM bandwidth (the slope: 128 KiB of KV per token) plus 1.4 ms
# (the intercept less the weights' read); its time to first token of 33k-131k token prompts
# is matched by 0.6 of the bf16 peak.
DEFAULT_MFU = 0.6  # share of the tensor-core peak that large matmuls and FlashAttention reach
DEFAULT_BANDWIDTH_SHARE = 0.9  # share of HBM bandwidth that streaming weight and KV reads reach
DEFAULT_STEP_OVERHEAD_S = 0.0014  # per step: kernel launch gaps, sampling, the engine's CPU work


@dataclass(frozen=True)
class Efficiency:
    mfu: float = DEFAULT_MFU
    bandwidth_share: float = DEFAULT_BANDWIDTH_SHARE
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S

    def __post_init__(self) -> None:
        for name in ("mfu", "bandwidth_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"simulate {name} must be in (0, 1], got {getattr(self, name)}")
        if self.step_overhead_s < 0:
            raise ValueError(f"simulate step overhead must be >= 0, got {self.step_overhead_s}")


@dataclass(frozen=True)
class StepWork:
    """What one step computes, summed over its requests."""

    num_tokens: int = 0
    num_sampled: int = 0
    attention_pairs: int = 0  # (query token, key token) pairs, per layer and head
    kv_tokens_read: int = 0
    kv_tokens_written: int = 0

    @classmethod
    def of(cls, chunks: Iterable[tuple[int, int, bool]]) -> StepWork:
        """From (computed tokens before, tokens this step, samples?) per scheduled request."""
        tokens = sampled = pairs = read = 0
        for computed, new, samples in chunks:
            tokens += new
            sampled += samples
            pairs += new * computed + new * (new + 1) // 2
            read += computed + new
        return cls(tokens, sampled, pairs, read, tokens)


class CostModel:
    def __init__(self, gpu: GPUProfile, model: ModelShape, efficiency: Efficiency | None = None) -> None:
        efficiency = efficiency or Efficiency()
        self.gpu, self.model, self.efficiency = gpu, model, efficiency
        m = model
        self.flops = gpu.peak_flops * efficiency.mfu
        self.bandwidth = gpu.memory_bandwidth * efficiency.bandwidth_share
        self.linear_params = m.num_hidden_layers * m.layer_params
        self.lm_head_params = m.vocab_size * m.hidden_size
        # Read each step: every layer, the final norm and the lm_head (the embedding table is
        # only gathered from, a few rows).
        self.weight_bytes = (self.linear_params + m.hidden_size + self.lm_head_params) * m.dtype_bytes
        self.attention_flops_per_pair = 4 * m.num_hidden_layers * m.num_attention_heads * m.head_dim

    def step_time(self, work: StepWork) -> float:
        """Seconds the step takes on the GPU (0 for a step that computes nothing)."""
        if not work.num_tokens:
            return 0.0
        linear_flops = 2 * (self.linear_params * work.num_tokens + self.lm_head_params * work.num_sampled)
        linear = max(linear_flops / self.flops, self.weight_bytes / self.bandwidth)
        kv_bytes = (work.kv_tokens_read + work.kv_tokens_written) * self.model.kv_bytes_per_token
        attention_flops = self.attention_flops_per_pair * work.attention_pairs
        attention = max(attention_flops / self.flops, kv_bytes / self.bandwidth)
        return linear + attention + self.efficiency.step_overhead_s

    def decode_step_time(self, batch: int, context: int) -> float:
        """A step of `batch` decoding requests, each with `context` tokens before its new one."""
        return self.step_time(StepWork.of([(context, 1, True)] * batch))

    def prefill_time(self, prompt: int) -> float:
        """One prompt of `prompt` tokens alone in a step."""
        return self.step_time(StepWork.of([(0, prompt, True)]))
