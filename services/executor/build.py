"""Building an `Executor` (or, with `simulate`, a `SimulatedExecutor`) from its options: one
path for the executor service and the in-process engine.

The executor owns the KV pool, so its settings fix the geometry the scheduler works in: the
number of blocks (from the memory budget), `block_size` and the effective `max_model_len`.

NOTE: torch is imported by the functions that build a real executor: a simulated one runs
without it (a service that starts in a second and holds no torch).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from parkade.services.common.model_config import ModelConfig, resolve_max_model_len
from parkade.services.common.model_files import check_model_folder
from parkade.services.executor import cpu_malloc, kv_budget
from parkade.services.executor.cpu_threads import parse_cpu_threads
from parkade.services.executor.options import CPU_KV_BYTES, CPU_KV_SEQS, ExecutorOptions

if TYPE_CHECKING:
    import torch

    from parkade.services.executor.executor import Executor
    from parkade.services.executor.simulated import SimulatedExecutor

log = logging.getLogger(__name__)


def resolve_device(options: ExecutorOptions) -> torch.device:
    import torch

    if options.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(options.device)


def kv_pool_budget(
    options: ExecutorOptions, device: torch.device, model_config: ModelConfig, max_model_len: int
) -> int | Callable[[], int] | None:
    """The KV pool's budget as `Executor` takes it: bytes; a function that works them out once
    the weights are loaded (gpu_memory_utilization counts what they took); or None, CUDA's
    default share of the memory the weights left free."""
    import torch

    from parkade.services.executor.kv_pool import bytes_per_block

    if options.kv_cache_memory_bytes is not None:  # wins over gpu_memory_utilization, as in vLLM
        if options.gpu_memory_utilization is not None:
            log.info("kv_cache_memory_bytes is set: gpu_memory_utilization does not size the KV pool")
        return options.kv_cache_memory_bytes
    # Enough for CPU_KV_SEQS requests at full length: tiny models get a small pool.
    block_size = options.block_size_on(device.type)
    wanted_blocks = CPU_KV_SEQS * (max_model_len // block_size + 1)
    wanted = wanted_blocks * bytes_per_block(model_config, block_size, model_config.dtype)
    share = options.gpu_memory_utilization
    if share is None:
        return min(CPU_KV_BYTES, wanted) if device.type == "cpu" else None
    if device.type == "cuda":

        def on_device() -> int:
            free, total = torch.cuda.mem_get_info(device)
            return kv_budget.gpu_kv_bytes(share, free=free, total=total)

        return on_device

    def on_cpu() -> int:
        total, resident = kv_budget.machine_memory_bytes(), kv_budget.resident_bytes()
        return kv_budget.cpu_kv_bytes(share, total=total, resident=resident, cap=wanted)

    return on_cpu


# The heap reserve (cpu_malloc.reserve_heap): this many times the activations of a full step, at
# least MIN_HEAP_RESERVE. Measured on tiny-llama under `parkade up` (a full step's activations: 25 MB),
# rounds of 64 requests: with 128 MiB the heap held for three rounds and grew in the next two; with
# 256 MiB it held for all five.
HEAP_RESERVE_STEPS = 10
MIN_HEAP_RESERVE = 64 * 2**20


def heap_reserve_bytes(config: ModelConfig, num_tokens: int) -> int:
    """The reserve for steps of `num_tokens` tokens: each token's hidden state, q/k/v and the MLP's
    gate, up and product, in fp32 (the largest the layers hold at once, within a factor of two)."""
    heads = config.num_attention_heads + 2 * config.num_key_value_heads
    per_token = config.hidden_size + heads * config.head_dim + 3 * config.intermediate_size
    return max(MIN_HEAP_RESERVE, HEAP_RESERVE_STEPS * num_tokens * per_token * 4)


def _ready_on_cpu(executor: Executor, config: ModelConfig, *, reserve: bool) -> None:
    """Last on a CPU: the heap reserve where the allocator was set up (after the compile's own
    allocations), then the CPU paths."""
    from parkade.services.executor.cpu_paths import executor_paths

    if reserve:
        cpu_malloc.reserve_heap(heap_reserve_bytes(config, executor.default_batched_tokens or 0))
    log.info("CPU paths: %s", executor_paths(executor))


def build_executor(
    options: ExecutorOptions,
    *,
    before_load: Callable[[int, int], None] | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[Executor | SimulatedExecutor, int]:
    """Load the model and allocate the KV pool -> (executor, effective max_model_len). The
    executor's `block_size` is the options', or the device's default (`block_size_on`).

    `before_load(max_model_len, block_size)` runs once the config is read and before the weights
    load, so that settings which cannot work fail fast. `environ`: the process's environment, which may
    set the allocator up (see cpu_malloc.py; None: the allocator is left alone). Raises
    ValueError (ModelFolderError for a folder that lacks a file) for settings the model or the
    pool cannot meet.
    """
    if options.simulate is not None:
        from parkade.services.executor.simulated import build_simulated_executor

        # The model folder gives the vocabulary (its tokenizer's), not weights.
        folder = check_model_folder(options.model, weights=False, tokenizer=False)
        vocab_size = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
        return build_simulated_executor(options, vocab_size=vocab_size, before_load=before_load)
    from parkade.services.executor.executor import Executor

    check_model_folder(options.model, tokenizer=False)
    device = resolve_device(options)
    options = dataclasses.replace(options, block_size=options.block_size_on(device.type))
    model_config = ModelConfig.from_pretrained(options.model, options.dtype)
    max_model_len = resolve_max_model_len(model_config.max_position_embeddings, options.max_model_len)
    if before_load is not None:
        before_load(max_model_len, options.block_size)
    executor = Executor(
        model_config,
        block_size=options.block_size,
        kv_cache_memory_bytes=kv_pool_budget(options, device, model_config, max_model_len),
        device=device,
        attention_backend=options.attention_backend,
        seed=options.seed,
        cpu_matmul_upcast=options.cpu_matmul_upcast,
        cpu_threads=parse_cpu_threads(options.cpu_threads),
        compile_model=not options.enforce_eager,
    )
    if device.type == "cpu" and environ is not None:
        # After the weights (their loading's temporaries are freed as glibc likes), before the
        # warm-up and the first step (whose thread must find one arena): see cpu_malloc.py.
        cpu_malloc.tune_malloc(environ)
    max_model_len = kv_budget.fit_max_model_len(
        max_model_len, requested=options.max_model_len, num_blocks=executor.num_blocks,
        block_size=options.block_size,
    )  # fmt: skip
    if executor.compiled is not None:
        seconds = executor.compile_model()
        log.info("compiled the forward in %.1f s (torch.compile, inductor)", seconds)
    if device.type == "cpu":
        _ready_on_cpu(executor, model_config, reserve=environ is not None)
    if device.type == "cuda" and not options.enforce_eager and executor.decode_graphs_supported():
        seconds = executor.capture_decode_graphs(max_model_len)
        log.info("captured %d decode CUDA graphs in %.1f s", len(executor.graphs.sizes), seconds)
    return executor, max_model_len
