"""`EngineArgs`: every engine setting, with vLLM's names, and how they become an engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from parkade.services.executor.executor import Executor
from parkade.services.executor.kv_pool import bytes_per_block
from parkade.services.executor.model_config import ModelConfig
from parkade.services.scheduler.scheduler import Scheduler, SchedulerConfig

# NOTE: on a CPU the default KV budget is capped, since RAM is shared with everything else on the
# machine; on CUDA the executor takes a share of the memory the weights left free.
CPU_KV_BYTES = 512 * 2**20


@dataclass(kw_only=True)
class EngineArgs:
    model: str | Path
    tokenizer: str | Path | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # None: the model's max_position_embeddings, or what the KV pool holds if that is less.
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_memory_bytes: int | None = None
    dtype: str | torch.dtype = "auto"
    seed: int = 0
    scheduling_policy: str = "fcfs"
    admission: str = "paged"  # or "reserve": blocks for prompt + max_tokens up front
    attention_backend: str = "auto"
    device: str | None = None  # None: cuda when available, else cpu

    def resolve_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def scheduler_config(self, num_blocks: int, max_model_len: int) -> SchedulerConfig:
        """The scheduler's settings over a pool of `num_blocks` (validates them)."""
        return SchedulerConfig(
            num_blocks=num_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            enable_chunked_prefill=self.enable_chunked_prefill,
            policy=self.scheduling_policy,
            admission=self.admission,
        )


def build_engine_parts(args: EngineArgs) -> tuple[ModelConfig, Scheduler, Executor]:
    """Load the model, size the KV pool, and give the scheduler the pool's block count."""
    model_config, executor, max_model_len = build_executor(args)
    return model_config, Scheduler(args.scheduler_config(executor.num_blocks, max_model_len)), executor


def build_executor(args: EngineArgs) -> tuple[ModelConfig, Executor, int]:
    """Load the model and allocate the KV pool -> (config, executor, effective max_model_len)."""
    device = args.resolve_device()
    model_config = ModelConfig.from_pretrained(args.model, args.dtype)
    max_model_len = args.max_model_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
            f"{model_config.max_position_embeddings}"
        )
    args.scheduler_config(1, max_model_len)  # validate the cheap settings before loading weights
    kv_bytes = args.kv_cache_memory_bytes
    if kv_bytes is None and device.type == "cpu":
        # Enough for every sequence at full length, capped; tiny models get a small pool.
        wanted_blocks = args.max_num_seqs * (max_model_len // args.block_size + 1)
        block_bytes = bytes_per_block(model_config, args.block_size, model_config.dtype)
        kv_bytes = min(CPU_KV_BYTES, wanted_blocks * block_bytes)
    executor = Executor(
        model_config,
        block_size=args.block_size,
        kv_cache_memory_bytes=kv_bytes,
        device=device,
        attention_backend=args.attention_backend,
        seed=args.seed,
    )
    pool_tokens = executor.num_blocks * args.block_size
    if max_model_len > pool_tokens:
        if args.max_model_len is not None:
            raise ValueError(
                f"max_model_len={max_model_len} is more than the KV pool holds ({executor.num_blocks} blocks "
                f"of {args.block_size} = {pool_tokens} tokens): raise kv_cache_memory_bytes or lower "
                "max_model_len"
            )
        max_model_len = pool_tokens
    return model_config, executor, max_model_len
