"""Parkade's wire types: every message that crosses a service boundary, grouped by topic.

Schemas evolve only by appending fields with defaults.
"""

from parkade.schemas.engine import (
    EngineRequest,
    ErrorKind,
    FinishReason,
    FinishRequest,
    GeneratedBatch,
    GeneratedTokens,
    SchedulerAnnouncement,
    TokenLogprobs,
)
from parkade.schemas.events import TokenEvent, TokenEventBatch, Usage
from parkade.schemas.instances import InstanceHeartbeat
from parkade.schemas.requests import (
    AbortRequest,
    ChatMessage,
    GenerateRequest,
    TokenizerAnnouncement,
    sample_request_id,
)
from parkade.schemas.routing import KVEvents, ReplicaStatus, RequestRouted
from parkade.schemas.sampling import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from parkade.schemas.steps import (
    CachedRequestData,
    ExecutorAnnouncement,
    NewRequestData,
    PromptLogprobs,
    StepPlan,
    StepResult,
    failed_step,
)
from parkade.schemas.topics import SCHEMA_VERSION

__all__ = [
    "MAX_LOGPROBS",
    "SCHEMA_VERSION",
    "AbortRequest",
    "CachedRequestData",
    "ChatMessage",
    "EngineRequest",
    "ErrorKind",
    "ExecutorAnnouncement",
    "FinishReason",
    "FinishRequest",
    "GenerateRequest",
    "GeneratedBatch",
    "GeneratedTokens",
    "InstanceHeartbeat",
    "KVEvents",
    "NewRequestData",
    "PromptLogprobs",
    "ReplicaStatus",
    "RequestOutputKind",
    "RequestRouted",
    "SamplingParams",
    "SchedulerAnnouncement",
    "StepPlan",
    "StepResult",
    "TokenEvent",
    "TokenEventBatch",
    "TokenLogprobs",
    "TokenizerAnnouncement",
    "Usage",
    "failed_step",
    "sample_request_id",
]
