"""The KV pool's byte budget from `gpu_memory_utilization`: pure arithmetic, plus the probes of a
CPU machine's memory. Torch-free; `build.py` reads the CUDA numbers and calls these.

    CUDA: |<------------------------------ total ------------------------------>|
          |<--------- utilization * total --------->|<--- (1 - util) * total --->|
          |<- in use (weights, ...) ->|<- KV pool ->|<--- left to the others --->|
          kv = free - (1 - utilization) * total, as vLLM sizes it after the weights load.

    CPU:  kv = utilization * min(RAM, cgroup limit) - this process's resident memory, capped at
          what the default sizes the pool for (CPU_KV_SEQS full-length requests): RAM is shared
          with the whole machine, and a bigger pool than any request mix can use buys nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

GIB = 2**30
GPU_KV_SHARE = 0.85  # on CUDA by default: of the device memory left free after loading the weights
CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")  # cgroup v2: a byte count, or "max"
PROC_STATM = Path("/proc/self/statm")  # pages: size resident shared ...


def fit_max_model_len(max_model_len: int, *, requested: int | None, num_blocks: int, block_size: int) -> int:
    """The executor's limit once its pool is known: an unset limit is lowered to what the pool
    holds; one set above it is a ValueError (the real and the simulated executor alike)."""
    pool_tokens = num_blocks * block_size
    if max_model_len <= pool_tokens:
        return max_model_len
    if requested is not None:
        raise ValueError(
            f"max_model_len={max_model_len} is more than the KV pool holds ({num_blocks} blocks "
            f"of {block_size} = {pool_tokens} tokens): raise kv_cache_memory_bytes or lower "
            "max_model_len"
        )
    return pool_tokens


def gpu_kv_bytes(utilization: float, *, free: int, total: int) -> int:
    """The KV budget on a device with `free` of `total` bytes free once the weights are loaded.

    Raises ValueError when what is already in use leaves nothing of the engine's share."""
    kv = int(free - (1 - utilization) * total)
    if kv <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} lets this engine use {utilization * total / GIB:.2f} GiB "
            f"of the device's {total / GIB:.2f} GiB, but {(total - free) / GIB:.2f} GiB are in use already "
            "(the weights, other processes): nothing is left for the KV cache; raise "
            "gpu_memory_utilization, or set kv_cache_memory_bytes"
        )
    return kv


def cpu_kv_bytes(utilization: float, *, total: int, resident: int, cap: int) -> int:
    """The KV budget on a CPU with `total` bytes for this machine (RAM or cgroup limit) and
    `resident` bytes held by this process once the weights are loaded, at most `cap`.

    Raises ValueError when the process already holds the engine's whole share."""
    kv = int(utilization * total - resident)
    if kv <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} (on a CPU: of its memory) lets this engine use "
            f"{utilization * total / GIB:.2f} GiB of {total / GIB:.2f} GiB, but this process holds "
            f"{resident / GIB:.2f} GiB already (the weights, torch): nothing is left for the KV cache; "
            "raise gpu_memory_utilization, or set kv_cache_memory_bytes"
        )
    return min(kv, cap)


def cgroup_memory_limit(path: Path = CGROUP_MEMORY_MAX) -> int | None:
    """The cgroup v2 memory limit in bytes; None when there is none (unlimited, no cgroup v2)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def machine_memory_bytes() -> int:
    """The memory this process may count on: physical RAM, or the cgroup limit if lower (a
    container sees the host's RAM but is killed at its limit)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_memory_limit()
    return ram if limit is None else min(ram, limit)


def resident_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm); elsewhere its peak, which
    can only make the budget smaller."""
    try:
        return int(PROC_STATM.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
