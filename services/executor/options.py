"""`ExecutorOptions`: every executor setting a user chooses. Torch-free, so that the command
line (`parkade up`, which passes them on) imports no torch; `build.py` turns them into an
`Executor`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parkade.kernels.backends import AttentionBackend
from parkade.models import DEFAULT_MODEL
from parkade.services.common.environment import enforce_eager_default
from parkade.services.common.model_config import DTYPE_NAMES, check_dtype_name
from parkade.services.common.model_files import MAX_MODEL_LEN_METADATA, MODEL_METADATA
from parkade.services.common.simulation import SIMULATE_METADATA, Simulation
from parkade.services.executor.cost_model import DEFAULT_BANDWIDTH_SHARE, DEFAULT_MFU, DEFAULT_STEP_OVERHEAD_S
from parkade.services.executor.cpu_threads import AUTO, parse_cpu_threads

DType = Any  # a torch.dtype (not named, to keep torch out of this module)

# NOTE: on a CPU the default KV budget is capped, since RAM is shared with everything else on the
# machine; on CUDA the executor takes a share of the memory the weights left free.
CPU_KV_BYTES = 512 * 2**20
DEVICES = ("auto", "cpu", "cuda")
# How many full-length requests a CPU pool is sized for when no budget is given. NOTE: a fixed
# number, not the scheduler's max_num_seqs: the executor must size its pool alike in one process
# and as a service, which never sees the scheduler's options.
CPU_KV_SEQS = 256
# The KV block size when none is given, as vLLM's (its CPU backend's 128, its GPU default 16). On a
# CPU a request's keys then lie in longer contiguous runs, which the hardware prefetchers stream:
# small-llama's decode attention took 8% less time at 128 than at 16 on an AMX Xeon (2026-12-05),
# the whole run 2-7% less. The cost is at most 127 unfilled slots a request, and prefix caching
# in units of 128 tokens.
CPU_BLOCK_SIZE = 128
GPU_BLOCK_SIZE = 16


@dataclass(frozen=True, kw_only=True)
class ExecutorOptions:
    """Every executor setting a user chooses; names as vLLM's engine arguments."""

    model: str | Path = field(default=DEFAULT_MODEL, metadata=MODEL_METADATA)
    dtype: str | DType = field(
        default="auto",
        metadata={"help": "weights and KV cache dtype; auto: the model's", "choices": DTYPE_NAMES},
    )
    device: str = field(
        default="auto", metadata={"help": "auto: cuda when available, else cpu", "choices": DEVICES}
    )
    block_size: int | None = field(
        default=None,
        metadata={
            "help": f"tokens per KV block; unset: {CPU_BLOCK_SIZE} on a CPU, {GPU_BLOCK_SIZE} on CUDA (and "
            "simulated GPUs), as in vLLM"
        },
    )
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata={
            "help": "bytes of the KV block pool; unset: 85% of the free memory on CUDA, on a CPU enough for "
            f"{CPU_KV_SEQS} full-length requests, at most {CPU_KV_BYTES // 2**20} MiB; "
            "wins over gpu_memory_utilization when both are set (as in vLLM)"
        },
    )
    gpu_memory_utilization: float | None = field(
        default=None,
        metadata={
            "help": "share (0, 1] of the device's memory this engine may use; the KV pool gets what the "
            "weights and everything else already in use leave of it. On a CPU: of the RAM (or the "
            f"cgroup limit), at most enough for {CPU_KV_SEQS} full-length requests. Unset: see "
            "kv_cache_memory_bytes"
        },
    )
    max_model_len: int | None = field(default=None, metadata=MAX_MODEL_LEN_METADATA)
    attention_backend: AttentionBackend = field(
        default=AttentionBackend.AUTO,
        metadata={
            "help": "auto: Triton on CUDA; on a CPU the compiled cpu kernel (torch without a C compiler); "
            "triton on a CPU runs interpreted"
        },
    )
    seed: int = field(default=0, metadata={"help": "seed of the sampling of requests without their own seed"})
    enforce_eager: bool = field(
        default_factory=enforce_eager_default,
        metadata={
            "help": "run the model op by op: no torch.compile of the forward on a CPU (compiled once at "
            "start, cached in $PARKADE_HOME/inductor), no CUDA graphs of decode steps on CUDA; "
            "default: $PARKADE_ENFORCE_EAGER"
        },
    )
    cpu_matmul_upcast: bool = field(
        default=True,
        metadata={
            "help": "on a CPU without bf16/fp16 matrix units (no AVX512-BF16/AMX), keep bf16/fp16 matmul "
            "weights in fp32: several times faster there, equal up to summation order; off: native matmuls"
        },
    )
    cpu_threads: str = field(
        default=AUTO,
        metadata={
            "help": "threads of a CPU executor's steps: a number, or auto: as many as the CPUs that the "
            "machine's other processes leave (measured while it steps; see cpu_threads.py)"
        },
    )
    simulate: str | None = field(default=None, metadata=SIMULATE_METADATA)
    simulate_speedup: float = field(
        default=1.0,
        metadata={
            "help": "with --simulate: every predicted step time is divided by this; below 1 the simulated "
            "GPU runs slower, so that a small host keeps its proportions (Dynamo's speedup_ratio)"
        },
    )
    simulate_mfu: float = field(
        default=DEFAULT_MFU,
        metadata={
            "help": "with --simulate: the share of the GPU's peak FLOP/s that matmuls and attention reach"
        },
    )
    simulate_bandwidth_share: float = field(
        default=DEFAULT_BANDWIDTH_SHARE,
        metadata={
            "help": "with --simulate: the share of the GPU's memory bandwidth that weight and KV reads reach"
        },
    )
    simulate_step_overhead_ms: float = field(
        default=DEFAULT_STEP_OVERHEAD_S * 1e3,
        metadata={"help": "with --simulate: the fixed cost of each step (launches, sampling), in ms"},
    )
    simulate_eos_probability: float = field(
        default=0.004,
        metadata={
            "help": "with --simulate: the chance that each token after min_tokens is EOS (outputs of 250 "
            "tokens on average); 0: outputs run to max_tokens"
        },
    )

    def block_size_on(self, device_type: str) -> int:
        """The block size on a device of this type ("cpu", "cuda"): the one given, else the default."""
        if self.block_size is not None:
            return self.block_size
        return CPU_BLOCK_SIZE if device_type == "cpu" else GPU_BLOCK_SIZE

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention_backend", AttentionBackend.parse(self.attention_backend))
        object.__setattr__(self, "device", "auto" if self.device is None else str(self.device))
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {', '.join(DEVICES)} or cuda:N; got {self.device!r}")
        if isinstance(self.dtype, str):
            check_dtype_name(self.dtype)
        for name in ("block_size", "kv_cache_memory_bytes", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or unset, got {value}")
        share = self.gpu_memory_utilization
        if share is not None and not 0 < share <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1] or unset, got {share}")
        object.__setattr__(self, "cpu_threads", str(self.cpu_threads))
        parse_cpu_threads(self.cpu_threads)  # a typo fails here, before anything starts
        if self.simulate is not None:
            Simulation.parse(self.simulate)  # a typo fails here, before anything starts
            if self.simulate_speedup <= 0:
                raise ValueError(f"simulate_speedup must be > 0, got {self.simulate_speedup}")
