"""The gateway's pure parts: OpenAI bodies checked into SamplingParams, answers and chunks built
from token events, the handler's refusals before anything reaches Kafka."""

from __future__ import annotations

import json

import pytest

from parkade.schemas import ErrorKind, FinishReason, SamplingParams, TokenEvent, TokenLogprobs, Usage
from parkade.services.gateway.handler import GatewayHandler, GatewayOptions
from parkade.services.gateway.protocol import (
    Answer,
    Choice,
    GatewayError,
    joined,
    joins,
    parse_chat,
    parse_completion,
    pipeline_error,
)

MODEL = "stories260K"


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


@pytest.fixture(scope="module")
def handler():
    return GatewayHandler.from_options(GatewayOptions())


def test_completion_fields_become_sampling_params_with_openais_defaults():
    request = parse_completion(
        body(prompt="Hi", temperature=0.5, top_k=4, stop="x", seed=3, logprobs=2, priority=-1, user="u")
    )
    assert request.params == SamplingParams(
        temperature=0.5, top_k=4, stop=("x",), seed=3, logprobs=2, max_tokens=16
    )
    assert request.priority == -1 and not request.stream and not request.chat
    chat = parse_chat(body(messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=5,
                           max_tokens=9, logprobs=True, top_logprobs=3))  # fmt: skip
    assert chat.params.max_tokens == 5 and chat.params.logprobs == 3  # the current name wins
    assert parse_chat(body(messages=[{"role": "user", "content": "Hi"}])).params.max_tokens is None


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (dict(prompt="Hi", temperature=-1), "temperature", "temperature must be >= 0"),
        (dict(prompt="Hi", max_tokens="many"), "max_tokens", "Expected `int | null`"),
        (dict(prompt="Hi", n=0), "n", "n must be in [1, 128]"),
        (dict(prompt="Hi", n=2, best_of=3), "best_of", "best_of is not supported"),
        (dict(prompt="Hi", echo=True), "echo", "echo is not supported"),
        (dict(prompt="Hi", logit_bias={"x": 1.0}), "logit_bias", "logit_bias keys must be token ids"),
        (dict(prompt="Hi", logit_bias={"5": 500.0}), "logit_bias", "logit_bias must be"),
        (dict(prompt="Hi", cache_salt=""), "cache_salt", "cache_salt must be"),
        (dict(prompt="Hi", prompt_logprobs=1), "prompt_logprobs", "not served over HTTP"),
        (dict(prompt=[1, "a"]), "prompt", "prompt must be"),
        (dict(prompt="Hi", stream_options={"include_usage": True}), "stream_options", "only allowed"),
    ],
)
def test_an_invalid_completion_field_is_refused_by_name(fields, param, message):
    with pytest.raises(GatewayError) as error:
        parse_completion(body(**fields))
    assert error.value.status == 400 and error.value.param == param and message in error.value.message


def test_an_invalid_chat_is_refused_by_name():
    for fields, param in [
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages"),
        (dict(messages=[{"role": "user", "content": "x"}], top_logprobs=2), "top_logprobs"),
        (dict(messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}]), "tools"),
    ]:
        with pytest.raises(GatewayError) as error:
            parse_chat(body(**fields))
        assert error.value.param == param, fields
    with pytest.raises(GatewayError, match="not valid JSON"):
        parse_chat(b"{nope")


def test_the_handler_refuses_what_cannot_run_and_names_choices(handler):
    with pytest.raises(GatewayError) as error:
        handler.open(False, body(model="gpt-4", prompt="Hi"))
    assert error.value.status == 404 and error.value.code == "model_not_found"
    with pytest.raises(
        GatewayError, match=r"maximum context length is 512 tokens. However, your request has 513"
    ):
        handler.open(False, body(prompt=[5] * 513))
    with pytest.raises(GatewayError, match=r"\[0, 512\)"):
        handler.open(False, body(prompt=[[5, 600]]))
    opened = handler.open(False, body(model=MODEL, prompt=["Once upon", "Lily"]))
    tokens = [len(handler.tokenizer.encode(p)) for p in ("Once upon", "Lily")]
    assert [c.num_prompt_tokens for c in opened.choices] == tokens
    assert [s["request_id"] for s in opened.submits] == [f"{opened.answer.id}-0", f"{opened.answer.id}-1"]
    chat = handler.open(True, body(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]))
    # Text parts joined, rendered by the template, tokenized here: the ids travel, not the chat.
    rendered = handler.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert chat.submits[0]["prompt_token_ids"] == handler.tokenizer.encode(rendered, add_special_tokens=False)
    assert "messages" not in chat.submits[0] and "prompt" not in chat.submits[0]
    assert chat.answer.id.startswith("chatcmpl-") and opened.answer.id.startswith("cmpl-")


def test_token_texts_keep_their_leading_space(handler):
    ids = handler.tokenizer.encode("Once upon a time, there", add_special_tokens=False)
    assert "".join(handler.token_text(t) for t in ids) == " Once upon a time, there"


def test_answers_and_chunks_have_openais_shapes():
    logprobs = TokenLogprobs(token_ids=(7, 7, 9), logprobs=(-0.5, -0.5, -1.5), ranks=(1, 1, 2))
    event = TokenEvent(request_id="r", index=0, token_ids=(7,), text=" hi", logprobs=(logprobs,))
    last = TokenEvent(
        request_id="r", index=1, token_ids=(8,), text="!", finish_reason=FinishReason.STOP,
        usage=Usage(prompt_tokens=4, completion_tokens=2, cached_tokens=1),
    )  # fmt: skip
    choice = Choice(0, 4)
    choice.add(event)
    choice.add(last)
    token_text = {7: " hi", 8: "!", 9: " yo"}.__getitem__
    answer = Answer.new(False, MODEL)
    response = answer.completion_response([choice], token_text)
    assert response["object"] == "text_completion" and response["choices"][0]["text"] == " hi!"
    assert response["choices"][0]["logprobs"] == {
        "tokens": [" hi"], "token_logprobs": [-0.5], "top_logprobs": [{" hi": -0.5, " yo": -1.5}],
        "text_offset": [0],
    }  # fmt: skip
    assert response["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    chat = Answer.new(True, MODEL).chat_response([choice], token_text)
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": " hi!"}
    top = chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert top == [{"token": " hi", "logprob": -0.5, "bytes": [32, 104, 105]},
                   {"token": " yo", "logprob": -1.5, "bytes": [32, 121, 111]}]  # fmt: skip
    first = Answer.new(True, MODEL).chunk(True, choice, event, token_text, 0, first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": " hi"}
    assert first["object"] == "chat.completion.chunk"
    usage_chunk = answer.usage_chunk(False, [choice])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["total_tokens"] == 6


def test_a_pipeline_error_maps_to_a_status_and_an_error_chunk():
    statuses = {}
    for kind in ErrorKind:
        failed = TokenEvent(
            request_id="r", index=0, finish_reason=FinishReason.ERROR, error="boom", error_kind=kind
        )
        statuses[kind.value] = pipeline_error(failed).status
    assert statuses == {"invalid_request": 400, "overloaded": 429, "unavailable": 503, "internal": 500}
    unknown = pipeline_error(TokenEvent(request_id="r", index=0, finish_reason=FinishReason.ERROR, error="x"))
    assert unknown.status == 500
    assert Answer.new(False, MODEL).error_chunk(unknown) == {
        "error": {"message": "x", "type": "server_error", "param": None, "code": None}
    }


def test_samples_are_choices_and_requests_templates_need_trust(handler):
    opened = handler.open(False, body(prompt=["Once upon", "Lily"], n=3, cache_salt="t1"))
    assert [c.index for c in opened.choices] == list(range(6))
    assert [c.num_prompt_tokens > 0 for c in opened.choices] == [True, False, False] * 2  # once a prompt
    assert all(s["cache_salt"] == "t1" and s["sampling_params"].n == 3 for s in opened.submits)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    chat = body(messages=[{"role": "user", "content": "Hi"}], chat_template=template)
    with pytest.raises(GatewayError, match="chat_template is refused") as error:
        handler.open(True, chat)
    assert error.value.param == "chat_template"
    trusting = GatewayHandler.from_options(GatewayOptions(trust_request_chat_template=True))
    # The request's template rendered the chat: "Hi" alone, with no BOS.
    assert trusting.open(True, chat).submits[0]["prompt_token_ids"] == handler.tokenizer.encode(
        "Hi", add_special_tokens=False
    )
    cut = handler.open(False, body(prompt="Once upon a time", truncate_prompt_tokens=-1))
    assert cut.submits[0]["sampling_params"].truncate_prompt_tokens == 512  # its limit, as a number


def test_max_tokens_over_the_context_is_refused_as_vllm_refuses_it(handler):
    with pytest.raises(GatewayError) as error:
        handler.open(False, body(prompt=[5] * 7, max_tokens=100_000))
    assert error.value.status == 400
    assert error.value.body() == {
        "error": {
            "message": "'max_tokens' is too large: 100000. This model's maximum context length is 512 "
            "tokens and your request has 7 input tokens (100000 > 512 - 7).",
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }
    }
    with pytest.raises(GatewayError, match=r"'max_tokens' is too large: 100\. .* \(100 > 512 - 507\)"):
        handler.open(False, body(prompt=[5] * 507, max_tokens=100))
    chat = body(messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=600)
    with pytest.raises(GatewayError, match=r"^'max_completion_tokens' is too large: 600") as error:
        handler.open(True, chat)
    assert error.value.param == "max_completion_tokens"
    with pytest.raises(GatewayError, match=r"^'max_tokens' is too large: 600") as error:
        handler.open(True, body(messages=[{"role": "user", "content": "Hi"}], max_tokens=600))
    assert error.value.param == "max_tokens"
    # A too-long prompt: vLLM's words and shape too, naming the prompt's field.
    with pytest.raises(GatewayError) as error:
        handler.open(False, body(prompt="x" * 4000))  # refused by its length: >= 572 tokens
    assert error.value.body()["error"] == {
        "message": "This model's maximum context length is 512 tokens. However, your request has at "
        "least 572 input tokens. Please reduce the length of the input messages.",
        "type": "BadRequestError",
        "param": "prompt",
        "code": 400,
    }


def test_max_tokens_unset_is_the_rest_of_the_context(handler):
    # Completions' default (16) that does not fit becomes the rest of the context, as before.
    opened = handler.open(False, body(prompt=[[5] * 507, [5] * 7]))
    assert [s["sampling_params"].max_tokens for s in opened.submits] == [None, 16]
    assert (
        handler.open(False, body(prompt=[5] * 507, max_tokens=5)).submits[0]["sampling_params"].max_tokens
        == 5
    )
    chat = handler.open(True, body(messages=[{"role": "user", "content": "Hi"}]))
    assert chat.submits[0]["sampling_params"].max_tokens is None


def test_empty_and_missing_prompts_are_refused_by_name(handler):
    with pytest.raises(GatewayError, match=r"^The prompt cannot be empty.$") as error:
        handler.open(False, body(prompt=""))
    assert error.value.status == 400 and error.value.param == "prompt"
    with pytest.raises(GatewayError, match=r"^The prompt cannot be empty.$"):
        handler.open(False, body(prompt=["Once", ""]))
    with pytest.raises(GatewayError, match=r"^prompt is required$") as error:
        parse_completion(body(max_tokens=5))
    assert error.value.param == "prompt"
    with pytest.raises(GatewayError, match=r"^prompt must be a string"):
        parse_completion(body(prompt=5))
    with pytest.raises(GatewayError, match=r"^messages is required$"):
        parse_chat(body(max_tokens=5))
    with pytest.raises(GatewayError, match=r"^messages must be a non-empty list$"):
        parse_chat(body(messages=[]))


def test_a_pipeline_refusal_names_the_field_to_blame():
    event = TokenEvent(
        request_id="r",
        index=0,
        finish_reason=FinishReason.ERROR,
        error="'max_tokens' is too large: 9.",
        error_kind=ErrorKind.INVALID_REQUEST,
        error_param="max_tokens",
    )
    error = pipeline_error(event)
    assert error.status == 400 and error.param == "max_tokens"


def event(index: int, *tokens: int, **fields) -> TokenEvent:
    text = "".join(f"<{t}>" for t in tokens)
    return TokenEvent(request_id="r", index=index, token_ids=tokens, text=text, **fields)


def test_consecutive_events_of_a_choice_join_into_one_with_the_same_text_and_tokens():
    usage = Usage(prompt_tokens=3, completion_tokens=3)
    last = event(1, 8, 9, finish_reason=FinishReason.LENGTH, stop_reason=None, usage=usage)
    assert joins(event(0, 7), last)
    both = joined(event(0, 7), last)
    assert both == TokenEvent(
        request_id="r",
        index=0,
        token_ids=(7, 8, 9),
        text="<7><8><9>",
        finish_reason=FinishReason.LENGTH,
        usage=usage,
    )
    choice, apart = Choice(index=0, num_prompt_tokens=3), Choice(index=0, num_prompt_tokens=3)
    choice.add(both)
    apart.add(event(0, 7))
    apart.add(last)
    assert choice == apart  # what the answer and the usage are built from


@pytest.mark.parametrize(
    "first, then",
    [
        (event(0, 7, finish_reason=FinishReason.STOP), event(1, 8)),  # the choice ended
        (event(0, 7), event(2, 8)),  # not where the first ends (a duplicate or a gap)
        (event(0, 7, logprobs=(TokenLogprobs(token_ids=(7,), logprobs=(-0.1,), ranks=(1,)),)), event(1, 8)),
        (event(0, 7), event(1, 8, logprobs=(TokenLogprobs(token_ids=(8,), logprobs=(-0.1,), ranks=(1,)),))),
        (
            event(0, 7),
            event(1, finish_reason=FinishReason.ERROR, error="lost", error_kind=ErrorKind.INTERNAL),
        ),
        (event(0, 7, prompt_logprobs=()), event(1, 8)),
    ],
)
def test_failures_logprobs_ends_and_gaps_never_join(first, then):
    assert not joins(first, then)
