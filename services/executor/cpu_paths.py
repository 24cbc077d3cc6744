"""Which CPU this is and which paths the executor takes on it: logged at start, in every benchmark.

A speed measured on one CPU says little about another: on AVX2 alone bf16 has no hardware support
(the matmuls upcast to fp32), AVX512-BF16 multiplies bf16 pairs natively, AMX multiplies bf16 tiles.
oneDNN picks its kernels at run time (AMX, AVX512-BF16, AVX2), the attention kernel is compiled
for this CPU (-march=native), and ATen's own vector code has its capability level.
"""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING, Any

import torch

from parkade.services.executor import cpu_malloc
from parkade.services.executor.cpu_threads import usable_cpus

if TYPE_CHECKING:
    from parkade.services.executor.executor import Executor

__all__ = ["ISA_FLAGS", "cpu_description", "executor_paths"]

# The /proc/cpuinfo flags that change which paths run (and how fast).
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_fp16")


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo (they are alike)."""
    model, flags = None, None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model is None:
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and flags is None:
                    flags = set(value.split())
                if model is not None and flags is not None:
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags or set()


def cpu_description() -> dict[str, Any]:
    """{"model", "isa" (the ISA_FLAGS this CPU has), "cpus" (usable by this process)}."""
    model, flags = _cpuinfo()
    return {"model": model, "isa": [f for f in ISA_FLAGS if f in flags], "cpus": len(usable_cpus())}


def _gemm_path(executor: Executor, isa: list[str]) -> str:
    dtype = executor.model_config.dtype
    if executor.fp32_matmuls:
        return f"fp32 (the {str(dtype).removeprefix('torch.')} weights upcast: no native matmul here)"
    if dtype == torch.float32:
        return "fp32"
    if executor.packed_linears:
        from parkade.kernels import linear_cpu

        chosen = linear_cpu.kernel()  # not None: packed linears are used only where one serves
        unit = "AMX tiles" if chosen.name == "amx" else "AVX512-BF16"
        return (
            f"{str(dtype).removeprefix('torch.')} on {unit} up to {chosen.max_rows} rows (weights packed at "
            "load), oneDNN prepacked above"
        )
    unit = "AMX" if "amx_bf16" in isa else "AVX512-BF16" if "avx512_bf16" in isa else "no native unit"
    return f"{str(dtype).removeprefix('torch.')} on oneDNN ({unit})"


def executor_paths(executor: Executor) -> dict[str, Any]:
    """The paths a CPU executor takes: GEMMs, attention kernel, compiled or eager."""
    cpu = cpu_description()
    backend = executor.attention_backend_name
    paths: dict[str, Any] = {
        "cpu": cpu["model"],
        "isa": cpu["isa"],
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "team": executor.team.describe() if executor.team is not None else None,
        "gemm": _gemm_path(executor, cpu["isa"]),
        "attention": backend,
        "compiled": executor.compiled is not None,
        "malloc": cpu_malloc.state,
    }
    if executor.compiled is not None:
        if not executor.packed_linears:
            paths["gemm_weights"] = "prepacked at compile (inductor freezing)"
        seconds = executor.compiled.compile_s
        paths["compile_s"] = None if seconds is None else round(seconds, 1)
    if backend == "attention_cpu":
        from parkade.kernels import attention_cpu

        paths["attention_features"] = attention_cpu.features()
    return paths
