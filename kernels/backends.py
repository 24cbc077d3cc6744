"""Choosing the attention backend: `auto` is Triton on CUDA and torch on a CPU.

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
    AUTO = "auto"  # Triton on CUDA, torch elsewhere
    TRITON = "triton"
    TORCH = "torch"

    @classmethod
    def parse(cls, value: AttentionBackend | str) -> AttentionBackend:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ValueError(f"attention_backend must be one of {choices}; got {value!r}") from None


def get_attention_backend(name: AttentionBackend | str, device: torch.device) -> ModuleType:
    """The kernels module for `name` on `device`. Raises ValueError for an unknown name or a
    backend that cannot run there."""
    backend = AttentionBackend.parse(name)
    if backend is AttentionBackend.AUTO:
        backend = AttentionBackend.TRITON if device.type == "cuda" else AttentionBackend.TORCH
    if backend is AttentionBackend.TORCH:
        return importlib.import_module("parkade.kernels.attention_torch")
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
