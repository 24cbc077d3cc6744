"""Choosing the attention backend: `auto` is Triton on CUDA and torch on a CPU.

A backend is a module with `write_kv_cache` and `paged_attention_varlen` (same signatures as
`attention_torch`). On a CPU, `triton` runs the same kernels under the Triton interpreter.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import torch

ATTENTION_BACKENDS = ("auto", "triton", "torch")


def get_attention_backend(name: str, device: torch.device) -> ModuleType:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
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
