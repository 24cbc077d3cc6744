"""Parkade: LLM serving with PagedAttention and continuous batching.

`from parkade import LLM, SamplingParams` gives the offline API shaped like vLLM's; with no model
given it serves `DEFAULT_MODEL`, the trained stories260K that ships inside the package. The
engine (and torch) is imported on first use, so that the scheduler service can import `parkade`
without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from parkade.models import DEFAULT_MODEL
from parkade.schemas.sampling import SamplingParams

if TYPE_CHECKING:
    from parkade.engine.async_llm import AsyncLLM
    from parkade.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from parkade.engine.llm import LLM
    from parkade.engine.outputs import CompletionOutput, RequestOutput

__all__ = [
    "DEFAULT_MODEL",
    "LLM",
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
]

_LAZY = {
    "LLM": "parkade.engine.llm",
    "AsyncLLM": "parkade.engine.async_llm",
    "RequestOutput": "parkade.engine.outputs",
    "CompletionOutput": "parkade.engine.outputs",
    "BeamSearchParams": "parkade.engine.beam_search",
    "BeamSearchOutput": "parkade.engine.beam_search",
    "BeamSearchSequence": "parkade.engine.beam_search",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'parkade' has no attribute {name!r}")
