import msgspec
import pytest

from parkade.schemas import (
    CachedRequestData,
    EngineRequest,
    GenerateRequest,
    NewRequestData,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenLogprobs,
)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "temperature must be >= 0"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
        ("top_p", 1.5, "top_p must be in (0, 1]"),
        ("top_k", -2, "top_k must be -1, 0 (disabled) or >= 1"),
        ("min_p", 1.1, "min_p must be in [0, 1]"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
        ("frequency_penalty", -3.0, "frequency_penalty must be in [-2, 2]"),
        ("max_tokens", 0, "max_tokens must be >= 1 or None"),
        ("min_tokens", -1, "min_tokens must be >= 0"),
        ("logprobs", 21, "logprobs must be in [0, 20] or None"),
        ("seed", 2**63, "seed must be a 64-bit signed integer"),
    ],
)
def test_invalid_sampling_params_name_the_field_and_range(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SamplingParams(**{field: value})
    # The same check runs when the struct is decoded off the wire.
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.msgpack.decode(msgspec.msgpack.encode({field: value}), type=SamplingParams)


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_stop_accepts_a_string_or_a_list():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3]).stop_token_ids == (3,)
    assert SamplingParams(temperature=0).greedy


def test_generate_request_needs_exactly_one_prompt():
    with pytest.raises(ValueError, match="exactly one of prompt, prompt_token_ids and messages"):
        GenerateRequest(request_id="a")
    with pytest.raises(ValueError, match="exactly one"):
        GenerateRequest(request_id="a", prompt="x", prompt_token_ids=(1,))
    with pytest.raises(ValueError, match="prompt_token_ids must be non-empty"):
        EngineRequest(request_id="a", prompt_token_ids=(), sampling_params=SamplingParams())


def test_step_messages_round_trip_through_msgpack():
    plan = StepPlan(
        step_id=3,
        new_requests=(
            NewRequestData(
                request_id="a",
                token_ids=(1, 2, 3),
                num_prompt_tokens=3,
                sampling_params=SamplingParams(temperature=0.5, stop=("x",)),
                block_ids=(4, 5),
                num_computed_tokens=0,
                eos_token_ids=(2,),
            ),
        ),
        cached_requests=(CachedRequestData(request_id="b", new_block_ids=(9,), num_computed_tokens=17),),
        num_scheduled_tokens={"a": 3, "b": 1},
        finished_request_ids=("c",),
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=StepPlan) == plan
    result = StepResult(
        step_id=3,
        request_ids=("a", "b"),
        sampled_token_ids=(7, 8),
        logprobs=(TokenLogprobs(token_ids=(7, 1), logprobs=(-0.1, -0.2), ranks=(1, 2)), None),
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(result), type=StepResult) == result


def test_a_running_request_costs_the_same_bytes_at_any_context_length():
    def size(num_computed: int) -> int:
        plan = StepPlan(
            step_id=1,
            cached_requests=(
                CachedRequestData(request_id="a", new_block_ids=(), num_computed_tokens=num_computed),
            ),
            num_scheduled_tokens={"a": 1},
        )
        return len(msgspec.msgpack.encode(plan))

    assert size(1_000) == size(60_000)


def test_each_topic_decodes_its_own_union_and_refuses_others():
    from parkade.schemas import AbortRequest, FinishReason, TokenEvent, Usage, topics

    requests = topics.decoder(topics.REQUESTS)
    for message in (GenerateRequest(request_id="a", prompt="hi"), AbortRequest(request_id="a")):
        assert requests.decode(topics.ENCODER.encode(message)) == message
    event = TokenEvent(
        request_id="a",
        index=3,
        token_ids=(5,),
        text="x",
        finish_reason=FinishReason.STOP,
        usage=Usage(prompt_tokens=4, completion_tokens=4),
    )
    assert topics.decoder(topics.TOKENS).decode(topics.ENCODER.encode(event)) == event
    with pytest.raises(msgspec.ValidationError):
        requests.decode(topics.ENCODER.encode(event))
    with pytest.raises(msgspec.DecodeError):
        requests.decode(b"\xc1 not msgpack")
    assert set(topics.TOPIC_TYPES) | {topics.DEAD_LETTER} == {
        topics.REQUESTS,
        topics.TOKENIZED,
        topics.STEP_PLANS,
        topics.STEP_RESULTS,
        topics.GENERATED,
        topics.TOKENS,
        topics.DEAD_LETTER,
        topics.INSTANCES,
        topics.KV_EVENTS,
    }
    # A replica's own topics carry what the plain ones do.
    plan_decoder = topics.TopicDecoder(topics.replica_topic(topics.STEP_PLANS, "7"))
    assert plan_decoder.msgpack.type is topics.TOPIC_TYPES[topics.STEP_PLANS]
    assert topics.replica_topic(topics.TOKENIZED, "0") == topics.TOKENIZED
    assert topics.replica_topic(topics.TOKENIZED, "b-2") == "replica-b-2.tokenized"


def test_the_published_json_schemas_match_the_wire_types():
    """docs/schemas/ is generated: after changing a public message type, run
    `python -m parkade.schemas.publish`."""
    from pathlib import Path

    from parkade.schemas.publish import json_schemas

    folder = Path(__file__).resolve().parents[2] / "docs" / "schemas"
    for name, text in json_schemas().items():
        stale = f"{name} is out of date: python -m parkade.schemas.publish"
        assert (folder / name).read_text() == text, stale


def test_a_json_request_valid_against_the_published_schema_decodes():
    import json

    from parkade.schemas import GenerateRequest, topics

    raw = {"type": "generate", "request_id": "j1", "prompt": "Once", "sampling_params": {"max_tokens": 5}}
    message = topics.TopicDecoder(topics.REQUESTS).decode(json.dumps(raw).encode(), topics.JSON)
    assert isinstance(message, GenerateRequest) and message.sampling_params.max_tokens == 5


def test_json_is_named_by_the_content_type_header_parameters_aside():
    from parkade.schemas import AbortRequest, topics

    message = AbortRequest(request_id="a")
    for value in (b"application/json", b"application/json; charset=utf-8", b"Application/JSON"):
        encoded = topics.encode(message, ((topics.CONTENT_TYPE, value),))
        assert encoded == b'{"type":"abort","request_id":"a"}'
        assert topics.TopicDecoder(topics.REQUESTS).decode(encoded, value) == message
    packed = topics.encode(message, ((topics.CONTENT_TYPE, topics.MSGPACK),))
    assert packed == topics.ENCODER.encode(message) == topics.encode(message)
