"""Parkade: LLM serving with PagedAttention and continuous batching.

`from parkade import LLM, SamplingParams` gives the offline API shaped like vLLM's. The engine
(and torch) is imported on first use, so that the scheduler service can import `parkade` without
torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from parkade.schemas.sampling import SamplingParams

if TYPE_CHECKING:
    from parkade.services.engine.async_llm import AsyncLLM
    from parkade.services.engine.llm import LLM
    from parkade.services.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "AsyncLLM", "CompletionOutput", "RequestOutput", "SamplingParams"]

_LAZY = {
    "LLM": "parkade.services.engine.llm",
    "AsyncLLM": "parkade.services.engine.async_llm",
    "RequestOutput": "parkade.services.engine.outputs",
    "CompletionOutput": "parkade.services.engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'parkade' has no attribute {name!r}")
