"""Choosing the attention backend: `auto` is Triton on CUDA, and on a CPU the compiled CPU kernel
(`attention_cpu`), or torch where no C compiler is at hand.

A backend is a module with `write_kv_cache` and `paged_attention_varlen` (same signatures as
`attention_torch`). On a CPU, `triton` runs the same kernels under the Triton interpreter.
"""

from __future__ import annotations

import enum
import importlib
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # NOTE: the enum is imported by torch-free option classes
    import torch


class AttentionBackend(enum.StrEnum):
    AUTO = "auto"  # Triton on CUDA; on a CPU: cpu where its kernel builds, else torch
    TRITON = "triton"
    CPU = "cpu"  # a C decode kernel built on first use, torch SDPA for prefill
    TORCH = "torch"  # pure torch: the reference

    @classmethod
    def parse(cls, value: AttentionBackend | str) -> AttentionBackend:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ValueError(f"attention_backend must be one of {choices}; got {value!r}") from None


def _torch() -> ModuleType:
    return importlib.import_module("parkade.kernels.attention_torch")


def get_attention_backend(name: AttentionBackend | str, device: torch.device) -> ModuleType:
    """The kernels module for `name` on `device`. Raises ValueError for an unknown name or a
    backend that cannot run there."""
    backend = AttentionBackend.parse(name)
    if backend is AttentionBackend.AUTO:
        if device.type == "cuda":
            backend = AttentionBackend.TRITON
        else:
            cpu = importlib.import_module("parkade.kernels.attention_cpu")
            return cpu if device.type == "cpu" and cpu.available() else _torch()
    if backend is AttentionBackend.TORCH:
        return _torch()
    if backend is AttentionBackend.CPU:
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on a CPU, not {device.type}")
        cpu = importlib.import_module("parkade.kernels.attention_cpu")
        cpu.build()  # raises naming why the kernel cannot be built here
        return cpu
    if device.type == "cpu":
        # NOTE: Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. on first import.
        # Set here rather than by every caller; too late once triton was imported without it.
        if "triton" not in sys.modules:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' on a CPU needs TRITON_INTERPRET=1 before triton is imported"
            )
    elif device.type != "cuda":
        raise ValueError(
            f"attention_backend='triton' runs on CUDA or (interpreted) on a CPU, not {device.type}"
        )
    try:
        return importlib.import_module("parkade.kernels.attention_triton")
    except ImportError as error:
        raise ValueError(
            "attention_backend='triton' needs the triton package (pip install triton)"
        ) from error
