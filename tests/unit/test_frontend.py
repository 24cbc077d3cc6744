"""The front end that both paths share: tokenizing and checking requests, arrival times, and the
stream of what a client is shown (detokenization, stop strings, redelivery, usage)."""

from __future__ import annotations

import copy
import itertools

import pytest

from parkade.schemas import ChatMessage, FinishReason, GeneratedTokens, GenerateRequest, SamplingParams
from parkade.services.tokenizer.frontend import FrontEnd, TokenizerOptions, prompt_fields


@pytest.fixture(scope="module")
def frontend():
    return FrontEnd.from_options(TokenizerOptions())  # the shipped stories260K


def test_prompt_forms_become_the_same_request(frontend):
    ids = frontend.tokenizer.encode("Once upon a time")
    text, _ = frontend.make_request("a", **prompt_fields("Once upon a time"))
    as_dict, _ = frontend.make_request("b", **prompt_fields({"prompt": "Once upon a time"}))
    as_ids, stream = frontend.make_request("c", **prompt_fields({"prompt_token_ids": ids, "prompt": "kept"}))
    wire, _ = frontend.make_request_from(GenerateRequest(request_id="d", prompt="Once upon a time"))
    assert text.prompt_token_ids == as_dict.prompt_token_ids == as_ids.prompt_token_ids == tuple(ids)
    assert wire.prompt_token_ids == tuple(ids)
    assert stream.prompt == "kept"
    assert text.eos_token_ids == (2, 1)  # config.json and generation_config.json, as the model ends
    with pytest.raises(ValueError, match="a prompt is text"):
        prompt_fields({"text": "x"})


def test_the_shipped_models_chat_template_continues_the_last_message(frontend):
    """stories260K is a story model: Parkade's template is BOS and the contents, so that a chat
    continues its text exactly as a completion of that text does."""
    chat = [ChatMessage(role="system", content="A story."), ChatMessage(role="user", content="Once upon")]
    request, _ = frontend.make_request("c", messages=chat)
    assert request.prompt_token_ids == tuple(
        frontend.make_request("p", prompt="A story.\nOnce upon")[0].prompt_token_ids
    )


def test_arrival_times_are_wall_clock_and_strictly_increasing(frontend):
    import time

    before = time.time()
    times = [frontend.make_request(str(i), prompt="Hi")[0].arrival_time for i in range(50)]
    assert times[0] >= before and all(a < b for a, b in itertools.pairwise(times))


def test_requests_that_cannot_run_are_refused_with_the_reason(frontend):
    with pytest.raises(ValueError, match=r"must be in \[0, 512\) \(the model's vocab_size\)"):
        frontend.make_request("x", prompt_token_ids=[1, 512])
    with pytest.raises(ValueError, match="no tokens"):
        frontend.make_request("x", prompt_token_ids=[])
    # stories260K's max_position_embeddings is 512: a prompt over it never leaves the front end
    frontend.make_request("x", prompt_token_ids=[5] * 512, sampling_params=SamplingParams(max_tokens=None))
    with pytest.raises(ValueError, match="However, your request has 1048577 input tokens"):
        frontend.make_request("x", prompt_token_ids=[5] * 1_048_577)
    without_template = FrontEnd(
        copy.deepcopy(frontend.tokenizer), vocab_size=512, eos_token_ids=(2,), max_model_len=512
    )
    without_template.tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        without_template.make_request("x", messages=[ChatMessage(role="user", content="hi")])
    bare = FrontEnd(None, vocab_size=512, eos_token_ids=(2,))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        bare.make_request("x", prompt="Once")
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        bare.make_request("x", prompt_token_ids=[1, 5], sampling_params=SamplingParams(stop=["x"]))
    _, stream = bare.make_request("x", prompt_token_ids=[1, 5])
    update = stream.update(GeneratedTokens(request_id="x", index=0, token_ids=(7,)))
    assert update.token_ids == (7,) and update.text == ""  # no tokenizer: token ids only


def test_stream_cuts_at_a_stop_string_and_tells_the_scheduler_once(frontend):
    tok = frontend.tokenizer
    request, stream = frontend.make_request(
        "r", prompt="Once", sampling_params=SamplingParams(stop=["girl named"], max_tokens=50)
    )
    ids = tok.encode("Once there was a little girl named Lily", add_special_tokens=False)[1:]
    updates = [
        stream.update(GeneratedTokens(request_id="r", index=i, token_ids=(t,))) for i, t in enumerate(ids)
    ]
    shown = [u for u in updates if u is not None]
    assert "".join(u.text_delta for u in shown) == " there was a little "
    assert [u.stop_scheduler for u in shown].count(True) == 1
    last = shown[-1]
    assert (last.finish_reason, last.stop_reason) == (FinishReason.STOP, "girl named")
    assert last.usage.prompt_tokens == len(request.prompt_token_ids) and last.usage.completion_tokens == len(
        shown
    )
    assert all(u is None for u in updates[len(shown) :])  # finished: later tokens change nothing


def test_stream_drops_redelivered_tokens_and_reports_usage(frontend):
    request, stream = frontend.make_request("r", prompt="Once upon")
    ids = frontend.tokenizer.encode(" a time", add_special_tokens=False)
    first = GeneratedTokens(request_id="r", index=0, token_ids=(ids[0],), num_cached_tokens=16)
    assert stream.update(first).index == 0
    assert stream.update(first) is None  # redelivered
    last = GeneratedTokens(
        request_id="r", index=1, token_ids=(ids[1],), finish_reason=FinishReason.LENGTH, num_cached_tokens=16
    )
    update = stream.update(last)
    whole = frontend.tokenizer.decode([*request.prompt_token_ids, *ids[:2]], skip_special_tokens=True)
    assert update.text and whole.endswith(update.text) and update.finish_reason == "length"
    assert (update.usage.completion_tokens, update.usage.cached_tokens) == (2, 16)
    assert stream.update(last) is None and stream.first_token_time >= request.arrival_time


def test_an_error_from_the_scheduler_ends_the_stream(frontend):
    _, stream = frontend.make_request("r", prompt="Once")
    update = stream.update(
        GeneratedTokens(request_id="r", index=0, token_ids=(), finish_reason=FinishReason.ERROR, error="boom")
    )
    assert (update.finish_reason, update.error) == ("error", "boom") and stream.finished


def test_max_tokens_that_cannot_fit_and_empty_prompts_are_refused(frontend):
    """The context rule on the path the Python API and the requests topic share."""
    seven = [1] + [5] * 6
    with pytest.raises(ValueError) as error:
        frontend.make_request("x", prompt_token_ids=seven, sampling_params=SamplingParams(max_tokens=100_000))
    assert str(error.value) == (
        "'max_tokens' is too large: 100000. This model's maximum context length is 512 tokens and "
        "your request has 7 input tokens (100000 > 512 - 7)."
    )
    assert error.value.param == "max_tokens"  # the tokenizer service's error event names it
    with pytest.raises(ValueError, match=r"\(100 > 512 - 507\)"):
        frontend.make_request("x", prompt_token_ids=[5] * 507, sampling_params=SamplingParams(max_tokens=100))
    fits, _ = frontend.make_request(
        "x", prompt_token_ids=[5] * 507, sampling_params=SamplingParams(max_tokens=5)
    )
    rest, _ = frontend.make_request(
        "x", prompt_token_ids=[5] * 511, sampling_params=SamplingParams(max_tokens=None)
    )
    assert fits.sampling_params.max_tokens == 5 and rest.sampling_params.max_tokens is None
    for empty in (dict(prompt=""), {"prompt": ""}):
        with pytest.raises(ValueError, match=r"^The prompt cannot be empty\.$"):
            frontend.make_request("x", **prompt_fields(empty))
    with pytest.raises(ValueError, match=r"^The prompt cannot be empty\.$"):
        frontend.make_request_from(GenerateRequest(request_id="x", prompt=""))


def test_a_megabyte_prompt_is_refused_by_its_length_before_tokenizing(frontend, monkeypatch):
    def never(*_args, **_kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(frontend.tokenizer, "encode", never)
    with pytest.raises(ValueError, match="However, your request has at least 142858 input tokens"):
        frontend.make_request_from(GenerateRequest(request_id="x", prompt="Once " * 200_000))
