"""Topic names and one typed msgpack decoder per topic.

Each topic carries one tagged union, so a consumer decodes every record with the one decoder of
its topic and dispatches on the type. Names get a configurable prefix (`parkade.` by default).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from parkade.schemas.engine import (
    EngineRequest,
    FinishRequest,
    GeneratedBatch,
    GeneratedTokens,
    SchedulerAnnouncement,
)
from parkade.schemas.events import TokenEvent, TokenEventBatch
from parkade.schemas.instances import InstanceHeartbeat
from parkade.schemas.requests import AbortRequest, GenerateRequest, TokenizerAnnouncement
from parkade.schemas.routing import DEFAULT_REPLICA, KVEvents, ReplicaStatus, RequestRouted
from parkade.schemas.steps import ExecutorAnnouncement, StepPlan, StepResult

# Sent in every record's `parkade-schema` header. 2: the generated topic carries GeneratedBatch;
# 3: step plans and results carry an epoch, and a result an error; 4: the instances topic, a
# scheduler's announcement says whether it resumes, a tokenizer announces itself on requests;
# 5: an executor's announcement lost `model`, `eos_token_ids` and `heartbeat` (read by nobody:
# a v4 reader refuses a v5 announcement, which lacks the required `model`). 6: engine replicas:
# the kv-events topic, RequestRouted on requests, `replica` on generated records. 7: the tokens
# topic carries TokenEventBatch, to the reply topics of requests that ask for it (REPLY_BATCHES).
SCHEMA_VERSION = 7
DEFAULT_PREFIX = "parkade."

REQUESTS = "requests"  # client -> tokenizer, keyed by request_id
TOKENIZED = "tokenized"  # tokenizer -> scheduler
STEP_PLANS = "step-plans"  # scheduler -> executor, one record per step
STEP_RESULTS = "step-results"  # executor -> scheduler, one record per step
GENERATED = "generated"  # scheduler -> tokenizer: token ids, one record per step
TOKENS = "tokens"  # tokenizer -> clients, keyed by request_id
DEAD_LETTER = "dead-letter"  # records that could not be decoded
INSTANCES = "instances"  # every service, every second: it is there (one instance each)
KV_EVENTS = "kv-events"  # each replica -> routers: status and prefix-cache blocks (compacted)
# Topics an operator may compact (their records are keyed to be): their offsets may have holes.
# Every other topic's offsets are dense (nothing transactional), which consumers check.
COMPACTED = (KV_EVENTS,)
# A replica's own topics: replica "0" uses the plain names, replica R `replica-R.<name>` (see
# replica_topic). The other topics are shared by every replica.
REPLICA_TOPICS = ("tokenized", "step-plans", "step-results")

# The union each topic carries.
TOPIC_TYPES: dict[str, Any] = {
    REQUESTS: GenerateRequest | AbortRequest | TokenizerAnnouncement | RequestRouted,
    TOKENIZED: EngineRequest | FinishRequest,
    STEP_PLANS: StepPlan,
    STEP_RESULTS: StepResult | ExecutorAnnouncement,
    GENERATED: GeneratedBatch | GeneratedTokens | SchedulerAnnouncement,
    TOKENS: TokenEvent | TokenEventBatch,
    INSTANCES: InstanceHeartbeat,
    KV_EVENTS: ReplicaStatus | KVEvents,
}

ENCODER = msgspec.msgpack.Encoder()
JSON_ENCODER = msgspec.json.Encoder()

# A record's encoding, in its `content-type` header: JSON or msgpack (no header: msgpack). Each
# record is decoded by its own header and every record about a request carries the request's
# headers, so a JSON request is answered in JSON on every topic it crosses.
CONTENT_TYPE = "content-type"
# A request's header naming the topic its token events go to, instead of the shared tokens topic
# (Kafka's request-reply convention); keyed by request id there too (but see REPLY_BATCHES).
REPLY_TOPIC = "reply-topic"
# A request's header (any value) saying that its client reads TokenEventBatch on its reply topic:
# its events may then share records with other requests' events, every record to that topic is
# keyed by the topic's name (one partition: the order holds across batches and single events).
# Without a reply topic it means nothing: readers of the shared topic read TokenEvents only.
REPLY_BATCHES = "reply-batches"
_GATEWAY = re.compile(r"gateway-[0-9a-f]{12}")  # (a reply topic's suffix: see services/bus/replies.py)
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")
JSON = b"application/json"
MSGPACK = b"application/msgpack"
ALL_TOPICS = (
    REQUESTS, TOKENIZED, STEP_PLANS, STEP_RESULTS, GENERATED, TOKENS, DEAD_LETTER, INSTANCES, KV_EVENTS
)  # fmt: skip


def topic_name(topic: str, prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}{topic}"


def replica_topic(topic: str, replica: str = DEFAULT_REPLICA) -> str:
    """A replica's own topic (unprefixed): `topic` for replica "0", else `replica-R.topic`."""
    assert topic in REPLICA_TOPICS, topic
    return topic if replica == DEFAULT_REPLICA else f"replica-{replica}.{topic}"


def gateway_requests(gateway: str) -> str:
    """A gateway's own requests topic (unprefixed), which the tokenizer in its process reads from
    its memory beside the requests topic (`parkade gateway --with-tokenizer`): `gateway-G.requests`."""
    return f"gateway-{gateway}.{REQUESTS}"


def is_gateway_requests(name: str) -> bool:
    """Whether a topic name (prefixed or not) is a gateway's own requests topic: in memory, so a
    restart reads nothing of it again."""
    parts = name.rsplit(".", 2)
    return len(parts) >= 2 and parts[-1] == REQUESTS and _GATEWAY.fullmatch(parts[-2]) is not None


def base_topic(topic: str) -> str:
    """What a topic carries: `replica-R.tokenized` -> `tokenized` (replica names have no dot)."""
    return topic.rsplit(".", 1)[-1]


def all_topic_names(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Every topic of a Parkade deployment: what `parkade up` and each service create."""
    return [topic_name(t, prefix) for t in ALL_TOPICS]


def decoder(topic: str) -> msgspec.msgpack.Decoder:
    """The typed msgpack decoder of one topic (its name without the prefix)."""
    return msgspec.msgpack.Decoder(TOPIC_TYPES[base_topic(topic)])


class TopicDecoder:
    """A topic's typed decoders, msgpack and JSON; `decode` picks by the record's content type."""

    def __init__(self, topic: str) -> None:
        self.msgpack = msgspec.msgpack.Decoder(TOPIC_TYPES[base_topic(topic)])
        self.json = msgspec.json.Decoder(TOPIC_TYPES[base_topic(topic)])

    def decode(self, value: bytes, content_type: bytes | None = None) -> Any:
        return (self.json if is_json(content_type) else self.msgpack).decode(value)


def is_json(content_type: bytes | None) -> bool:
    """Whether a content-type header value names JSON (parameters such as a charset aside)."""
    return content_type is not None and content_type.split(b";")[0].strip().lower() == JSON


def header(headers: tuple[tuple[str, bytes], ...], name: str) -> bytes | None:
    """The first value of header `name`, if any."""
    return next((v for k, v in headers if k == name), None)


def reply_topic(headers: tuple[tuple[str, bytes], ...]) -> str | None:
    """The reply topic a request's headers name, if any and valid (Kafka's topic name rules)."""
    value = header(headers, REPLY_TOPIC)
    if value is None:
        return None
    name = value.decode(errors="replace")
    return name if _TOPIC_NAME.fullmatch(name) and name not in (".", "..") else None


def encode(message: Any, headers: tuple[tuple[str, bytes], ...] = ()) -> bytes:
    """A message in the encoding its headers name (see CONTENT_TYPE)."""
    json = any(key == CONTENT_TYPE and is_json(value) for key, value in headers)
    return JSON_ENCODER.encode(message) if json else ENCODER.encode(message)
