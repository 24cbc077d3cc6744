"""Parkade's wire types: every message that crosses a service boundary, grouped by topic.

Schemas evolve only by appending fields with defaults.
"""

from parkade.schemas.engine import (
    EngineRequest,
    FinishReason,
    FinishRequest,
    GeneratedTokens,
    TokenLogprobs,
)
from parkade.schemas.requests import AbortRequest, GenerateRequest
from parkade.schemas.sampling import MAX_LOGPROBS, SamplingParams
from parkade.schemas.steps import CachedRequestData, NewRequestData, StepPlan, StepResult

SCHEMA_VERSION = 1

__all__ = [
    "MAX_LOGPROBS",
    "SCHEMA_VERSION",
    "AbortRequest",
    "CachedRequestData",
    "EngineRequest",
    "FinishReason",
    "FinishRequest",
    "GenerateRequest",
    "GeneratedTokens",
    "NewRequestData",
    "SamplingParams",
    "StepPlan",
    "StepResult",
    "TokenLogprobs",
]
