"""The services' handlers without a bus: idempotency under redelivery, errors, restarts."""

from __future__ import annotations

import msgspec
import pytest
from byte_model import make_byte_model
from fakes import FakeExecutor
from transformers import AutoTokenizer

from parkade.schemas import (
    AbortRequest,
    ChatMessage,
    EngineRequest,
    ErrorKind,
    ExecutorAnnouncement,
    FinishReason,
    FinishRequest,
    GeneratedBatch,
    GeneratedTokens,
    GenerateRequest,
    SamplingParams,
    StepPlan,
    StepResult,
    topics,
)
from parkade.services.bus.base import Outgoing
from parkade.services.bus.serve import serve
from parkade.services.scheduler.config import SchedulingOptions
from parkade.services.scheduler.handler import SchedulerHandler
from parkade.services.tokenizer.frontend import FrontEnd, TokenizerOptions
from parkade.services.tokenizer.handler import TokenizerHandler


@pytest.fixture(scope="module")
def stories_frontend():
    return FrontEnd.from_options(TokenizerOptions())  # the shipped stories260K


@pytest.fixture(scope="module")
def stories_tokenizer(stories_frontend):
    return stories_frontend.tokenizer


def test_tokenizer_handler_is_idempotent_and_reports_errors(stories_frontend, stories_tokenizer):
    handler = TokenizerHandler(stories_frontend)
    request = GenerateRequest(
        request_id="r", prompt="Once upon", sampling_params=SamplingParams(max_tokens=3)
    )
    (out,) = routed(handler.on_request(request, (("traceparent", b"00-x"),)))
    assert out.topic == topics.TOKENIZED and out.message.prompt_token_ids == tuple(
        stories_tokenizer.encode("Once upon")
    )
    assert out.headers == (("traceparent", b"00-x"),)
    assert handler.on_request(request) == []  # redelivered
    ids = stories_tokenizer.encode(" a time", add_special_tokens=False)
    first = GeneratedTokens(request_id="r", index=0, token_ids=(ids[0],))
    (event,) = handler.on_generated(first)
    assert event.topic == topics.TOKENS and event.message.index == 0
    assert handler.on_generated(first) == []  # redelivered
    last = GeneratedTokens(request_id="r", index=1, token_ids=(ids[1],), finish_reason=FinishReason.LENGTH)
    (event,) = handler.on_generated(last)
    assert event.message.finish_reason == "length" and event.message.usage.completion_tokens == 2
    assert handler.on_generated(last) == [] and handler.on_request(request) == []  # finished stays finished
    assert handler.on_request(AbortRequest(request_id="r")) == []  # abort after the end: nothing
    (bad,) = handler.on_request(GenerateRequest(request_id="big", prompt_token_ids=(1, 999)))
    assert bad.message.finish_reason == "error" and "[0, 512)" in bad.message.error
    assert bad.message.error_kind == ErrorKind.INVALID_REQUEST  # the gateway answers 400
    (chat,) = routed(
        handler.on_request(
            GenerateRequest(request_id="c", messages=(ChatMessage(role="user", content="hi"),))
        )
    )
    assert chat.message.prompt_token_ids == tuple(stories_tokenizer.encode("hi"))  # Parkade's template


def test_tokenizer_handler_refuses_what_cannot_fit_with_an_error_event_naming_the_field(stories_frontend):
    handler = TokenizerHandler(stories_frontend)
    too_many = SamplingParams(max_tokens=100_000)
    (refused,) = handler.on_request(GenerateRequest(request_id="m", prompt="Once", sampling_params=too_many))
    event = refused.message
    assert event.finish_reason == "error" and event.error_kind == ErrorKind.INVALID_REQUEST  # 400
    assert event.error.startswith("'max_tokens' is too large: 100000. This model's maximum context length")
    assert event.error_param == "max_tokens"
    (empty,) = handler.on_request(GenerateRequest(request_id="e", prompt=""))
    assert empty.message.error == "The prompt cannot be empty." and empty.message.error_param is None
    (long,) = handler.on_request(GenerateRequest(request_id="l", prompt="x" * 10_000))
    assert "has at least 1429 input tokens" in long.message.error
    assert not handler.streams


def test_a_steps_batch_of_events_becomes_one_token_event_each_and_a_redelivery_nothing(
    stories_frontend, stories_tokenizer
):
    handler = TokenizerHandler(stories_frontend)
    headers = (("traceparent", b"00-y"),)
    for request_id in ("p", "q"):
        handler.on_request(GenerateRequest(request_id=request_id, prompt="Once upon"), headers)
    ids = stories_tokenizer.encode(" a time", add_special_tokens=False)
    step = GeneratedBatch(
        events=(
            GeneratedTokens(request_id="p", index=0, token_ids=(ids[0],)),
            GeneratedTokens(request_id="q", index=0, token_ids=(ids[0],), finish_reason=FinishReason.LENGTH),
        )
    )
    out = handler.on_generated(step)
    assert [(o.topic, o.key, o.message.request_id, o.message.index) for o in out] == [
        (topics.TOKENS, "p", "p", 0),
        (topics.TOKENS, "q", "q", 0),
    ]
    assert all(o.headers == headers for o in out)  # each request's own trace context
    assert out[1].message.finish_reason == "length"
    assert handler.on_generated(step) == []  # redelivered


def test_a_steps_events_for_a_client_that_takes_batches_travel_in_one_record_and_the_rest_alone(
    stories_frontend, stories_tokenizer
):
    handler = TokenizerHandler(stories_frontend)
    to = "t.tokens.0123456789ab"
    batched = ((topics.REPLY_TOPIC, to.encode()), (topics.REPLY_BATCHES, b"1"))
    heads = {
        "p": (("traceparent", b"00-p"), *batched),
        "q": batched,  # no trace context of its own
        "r": (("traceparent", b"00-r"), (topics.REPLY_TOPIC, to.encode())),  # reads single events
        "s": ((topics.REPLY_BATCHES, b"1"),),  # the shared topic: never batched
    }
    for request_id, headers in heads.items():
        handler.on_request(GenerateRequest(request_id=request_id, prompt="Once upon"), headers)
    ids = stories_tokenizer.encode(" a time", add_special_tokens=False)
    step = GeneratedBatch(
        events=tuple(GeneratedTokens(request_id=i, index=0, token_ids=(ids[0],)) for i in "pqrs")
    )
    out = handler.coalesce(handler.on_generated(step))
    assert [(o.to, o.key, type(o.message).__name__) for o in out] == [
        (to, to, "TokenEventBatch"),  # keyed by the topic: one partition for all that goes there
        (to, "r", "TokenEvent"),
        (None, "s", "TokenEvent"),
    ]
    batch = out[0].message
    assert [e.request_id for e in batch.events] == ["p", "q"] and batch.traceparents == ("00-p", "")
    assert [e.text for e in batch.events] == [out[1].message.text] * 2
    assert [p.message for p in out[0].parts] == list(batch.events)  # answered for as its events
    assert out[0].headers == ()  # (msgpack: no content type)


def test_events_that_leave_a_hole_in_a_stream_end_it_with_an_error_never_shown_as_they_came(
    stories_frontend,
):
    """Index 0 then 2: index 1 was lost between the scheduler and here. The client would get a
    stream one token short with nothing said: the request ends with an error event naming the
    lost indices, and its sample is aborted at its replica; the other request goes on."""
    handler = TokenizerHandler(stories_frontend)
    for request_id in ("p", "q"):
        handler.on_request(GenerateRequest(request_id=request_id, prompt="Once upon"))
    handler.on_generated(
        GeneratedBatch(events=tuple(GeneratedTokens(request_id=r, index=0, token_ids=(5,)) for r in "pq"))
    )
    step = GeneratedBatch(
        events=(
            GeneratedTokens(request_id="p", index=2, token_ids=(6,)),
            GeneratedTokens(request_id="q", index=1, token_ids=(6,)),
        )
    )
    error, finish, token = handler.on_generated(step)
    assert error.topic == topics.TOKENS and error.message.request_id == "p"
    assert error.message.finish_reason == "error" and error.message.error_kind == ErrorKind.INTERNAL
    assert error.message.error == "tokens 1 to 1 of this request were lost before the tokenizer"
    assert error.message.index == 1
    assert isinstance(finish.message, FinishRequest) and finish.message.request_id == "p"
    assert finish.message.reason == FinishReason.ABORT
    assert (token.message.request_id, token.message.index, token.message.token_ids) == ("q", 1, (6,))
    assert "p" not in handler.streams and "q" in handler.streams


def test_a_failure_on_one_event_of_a_batch_ends_that_request_only(stories_frontend, monkeypatch):
    handler = TokenizerHandler(stories_frontend)
    for request_id in ("ok", "bad"):
        handler.on_request(
            GenerateRequest(request_id=request_id, prompt="Once upon"), (("tp", request_id.encode()),)
        )

    def broken(message):
        raise UnicodeDecodeError("utf-8", b"", 0, 1, "broken")

    monkeypatch.setattr(handler.streams["bad"].stream, "update", broken)
    step = GeneratedBatch(
        events=(
            GeneratedTokens(request_id="bad", index=0, token_ids=(5,)),
            GeneratedTokens(request_id="ok", index=0, token_ids=(5,)),
        )
    )
    error, finish, token = handler.on_generated(step)
    assert error.topic == topics.TOKENS and error.message.finish_reason == "error"
    assert "the tokenizer failed" in error.message.error and error.headers == (("tp", b"bad"),)
    assert finish.topic == topics.TOKENIZED and finish.message.reason == FinishReason.ABORT
    assert token.message.request_id == "ok" and token.message.token_ids == (5,)  # unaffected
    assert "bad" not in handler.streams and "ok" in handler.streams


def test_chat_messages_use_the_models_chat_template(tmp_path):
    model = make_byte_model(tmp_path / "byte")
    tok = AutoTokenizer.from_pretrained(str(model))
    handler = TokenizerHandler(FrontEnd.from_options(TokenizerOptions(model=model)))
    messages = (ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hello"))
    (out,) = routed(handler.on_request(GenerateRequest(request_id="c", messages=messages)))
    chat = [{"role": m.role, "content": m.content} for m in messages]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert "Hello" in text and out.message.prompt_token_ids == tuple(
        tok.encode(text, add_special_tokens=False)
    )


def test_tokenizer_handler_stops_the_scheduler_when_a_stop_string_matches(
    stories_frontend, stories_tokenizer
):
    handler = TokenizerHandler(stories_frontend)
    params = SamplingParams(stop=["girl named"])
    handler.on_request(GenerateRequest(request_id="r", prompt="Once", sampling_params=params))
    ids = stories_tokenizer.encode("Once there was a little girl named Lily")[2:]
    outs = []
    for i, token in enumerate(ids):
        outs += handler.on_generated(GeneratedTokens(request_id="r", index=i, token_ids=(token,)))
    finish = [o.message for o in outs if o.topic == topics.TOKENIZED]
    assert finish == [FinishRequest(request_id="r", reason=FinishReason.STOP, stop_reason="girl named")]
    text = "".join(o.message.text for o in outs if o.topic == topics.TOKENS)
    assert text == " there was a little "


def routed(out):
    """The records a tokenizer sent, without its routing journal (RequestRouted)."""
    from parkade.schemas import RequestRouted

    return [o for o in out if not isinstance(o.message, RequestRouted)]


def announce(executor_id="e1", num_blocks=64):
    return ExecutorAnnouncement(
        executor_id=executor_id,
        num_blocks=num_blocks,
        block_size=4,
        max_model_len=64,
        vocab_size=50,
    )


def engine_request(request_id, n=6, max_tokens=4):
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=tuple(3 + i % 40 for i in range(n)),  # in the fake model's vocabulary
        sampling_params=SamplingParams(max_tokens=max_tokens),
    )


def drive(handler, executor, rounds=50, seen_plans=None):
    """Plan, execute, return results until idle; -> GeneratedTokens per request."""
    out = {}
    for _ in range(rounds):
        plans = [o.message for o in handler.next_plans()]
        if not plans:
            break
        if seen_plans is not None:
            seen_plans += plans
        for plan in plans:
            result = executor.execute(plan)
            result = msgspec.structs.replace(
                result, executor_id=plan.executor_id, scheduler_id=plan.scheduler_id, epoch=plan.epoch
            )
            for o in handler.on_step_result(result):  # one record per step
                assert o.topic == topics.GENERATED and isinstance(o.message, GeneratedBatch)
                for event in o.message.events:
                    out.setdefault(event.request_id, []).append(event)
            assert handler.on_step_result(result) == []  # a redelivered result changes nothing
    return out


def test_scheduler_handler_waits_for_an_executor_and_keeps_two_steps_in_flight():
    handler = SchedulerHandler(SchedulingOptions(), max_in_flight=2)
    assert handler.on_tokenized(engine_request("a")) == [] and handler.next_plans() == []  # no executor yet
    handler.on_announcement(announce())
    plans = handler.next_plans()
    assert len(plans) == 2  # prefill, then the first decode before the prefill's token is back
    assert all(p.message.executor_id == "e1" for p in plans)
    assert handler.on_announcement(announce()) == []  # heartbeat


def test_full_steps_go_two_deep_and_small_ones_three():
    handler = SchedulerHandler(SchedulingOptions(max_num_batched_tokens=8))  # 3 in flight at most
    handler.on_announcement(announce())
    for request_id in "abcd":  # 24 prompt tokens: full steps of 8
        handler.on_tokenized(engine_request(request_id))
    plans = [o.message for o in handler.next_plans()]
    assert len(plans) == 2  # no third behind two that hold a step's budget
    assert handler.link.tokens_in_flight == sum(sum(p.num_scheduled_tokens.values()) for p in plans) >= 8
    handler.link.step_budget = None  # the depth rule off: the third goes out
    assert len(handler.next_plans()) == 1
    small = SchedulerHandler(SchedulingOptions(max_num_batched_tokens=8))
    small.on_announcement(announce())
    small.on_tokenized(engine_request("a", n=2, max_tokens=8))
    plans = [o.message for o in small.next_plans()]
    assert [sum(p.num_scheduled_tokens.values()) for p in plans] == [2, 1, 1]  # prefill, 2 decodes
    ran = SchedulerHandler(SchedulingOptions(max_num_batched_tokens=8))
    ran.on_announcement(announce())
    for request_id in "abcd":
        ran.on_tokenized(engine_request(request_id))
    out = drive(ran, FakeExecutor(vocab_size=50, seed=3, block_size=4))
    assert all(out[r][-1].finish_reason is not None for r in "abcd")
    assert ran.link.tokens_in_flight == 0  # every result took its plan's tokens out of flight


def test_scheduler_handler_runs_requests_to_the_end_and_refuses_impossible_ones():
    handler = SchedulerHandler(SchedulingOptions())
    handler.on_announcement(announce())
    (refused,) = handler.on_tokenized(engine_request("long", n=65))
    assert refused.message.finish_reason == "error" and "max_model_len=64" in refused.message.error
    handler.on_tokenized(engine_request("a"))
    handler.on_tokenized(engine_request("a"))  # redelivered
    handler.on_tokenized(engine_request("b"))
    out = drive(handler, FakeExecutor(vocab_size=50, seed=3, block_size=4))
    for request_id in ("a", "b"):
        events = out[request_id]
        assert [e.index for e in events] == list(range(len(events)))
        assert events[-1].finish_reason is not None
    assert handler.scheduler.kv.num_free_blocks == 64


def test_an_idle_scheduler_checks_its_integrity_once_per_idle_spell_not_per_poll(monkeypatch):
    handler = SchedulerHandler(SchedulingOptions())
    handler.on_announcement(announce())
    checks = []
    monkeypatch.setattr(handler.scheduler, "check_integrity", lambda: checks.append(1))
    handler.on_tokenized(engine_request("a"))
    drive(handler, FakeExecutor(vocab_size=50, seed=3, block_size=4))
    assert len(checks) == 1  # when the last step came back and nothing was in flight
    for _ in range(5):  # empty polls: nothing changed, no scan of the pool
        handler.after_batch()
    assert len(checks) == 1
    handler.on_record(announce(), record=None)  # any record may change the state
    handler.next_plans()
    assert len(checks) == 2


def test_a_new_executor_makes_the_scheduler_recompute_everything():
    handler = SchedulerHandler(SchedulingOptions(), max_in_flight=2)
    handler.on_announcement(announce("e1"))
    handler.on_tokenized(engine_request("a", max_tokens=8))
    (plan, _) = [o.message for o in handler.next_plans()]
    handler.on_step_result(
        StepResult(
            step_id=plan.step_id,
            executor_id="e1",
            scheduler_id=plan.scheduler_id,
            request_ids=("a",),
            sampled_token_ids=(7,),
        )
    )
    handler.on_announcement(announce("e2"))  # e1 died: its KV pool is gone
    assert not handler.link.in_flight and handler.scheduler.kv.num_free_blocks == 64
    plans = []
    out = drive(handler, FakeExecutor(vocab_size=50, seed=4, block_size=4), seen_plans=plans)
    (resumed,) = plans[0].new_requests
    assert plans[0].executor_id == "e2" and resumed.token_ids[-1] == 7 and resumed.num_computed_tokens == 0
    assert [e.index for e in out["a"]] == list(range(1, 8))  # index 0 came from e1
    assert out["a"][-1].finish_reason == FinishReason.LENGTH


def test_finish_request_from_the_tokenizer_ends_the_request():
    handler = SchedulerHandler(SchedulingOptions())
    handler.on_tokenized(FinishRequest(request_id="x"))  # unknown: nothing
    handler.on_announcement(announce())
    handler.on_tokenized(engine_request("a"))
    (out,) = handler.on_tokenized(FinishRequest(request_id="a", reason=FinishReason.STOP, stop_reason="zz"))
    assert (out.message.finish_reason, out.message.stop_reason) == ("stop", "zz")
    assert handler.on_tokenized(FinishRequest(request_id="a")) == []


def test_an_abort_before_any_executor_still_ends_the_stream():
    handler = SchedulerHandler(SchedulingOptions())
    handler.on_tokenized(engine_request("a"))
    (out,) = handler.on_tokenized(FinishRequest(request_id="a"))
    assert out.message.finish_reason == "abort"
    handler.on_announcement(announce())
    assert handler.next_plans() == []


def test_a_finished_request_delivered_again_does_not_run_again():
    handler = SchedulerHandler(SchedulingOptions())
    handler.on_announcement(announce())
    handler.on_tokenized(engine_request("a", max_tokens=2))
    out = drive(handler, FakeExecutor(vocab_size=50, seed=3, block_size=4))
    assert out["a"][-1].finish_reason is not None
    assert handler.on_tokenized(engine_request("a", max_tokens=2)) == []
    assert handler.next_plans() == []


def test_a_late_heartbeat_of_a_replaced_executor_is_ignored():
    handler = SchedulerHandler(SchedulingOptions())
    handler.on_announcement(announce("e1"))
    handler.on_announcement(announce("e2"))
    handler.on_tokenized(engine_request("a"))
    plans = handler.next_plans()
    assert handler.on_announcement(announce("e1")) == [] and handler.link.executor_id == "e2"
    assert len(handler.link.in_flight) == len(plans) > 0


class _CountingExecutor:
    """Stands in for Executor: counts executions and holds request state to be cleared."""

    num_blocks, block_size = 8, 4

    vocab_size = 50
    default_batched_tokens = None

    def __init__(self):
        self.executed = []
        self.requests = {"old": object()}

    @property
    def num_requests(self):
        return len(self.requests)

    def execute(self, plan):
        self.executed.append(plan.step_id)
        return StepResult(step_id=plan.step_id)

    def reset(self):
        self.requests.clear()


def test_executor_handler_runs_each_plan_once_and_follows_a_new_scheduler():
    from parkade.services.executor.handler import ExecutorHandler

    fake = _CountingExecutor()
    handler = ExecutorHandler(fake, max_model_len=32)
    plan = StepPlan(step_id=1, executor_id=handler.executor_id, scheduler_id="s1")
    (out,) = handler.on_plan(plan)
    assert out.message.executor_id == handler.executor_id
    assert handler.on_plan(plan) == []  # redelivered
    assert handler.on_plan(msgspec.structs.replace(plan, step_id=2, executor_id="other")) == []
    assert fake.requests == {}  # the first plan of scheduler s1 cleared state of the one before
    fake.requests["x"] = object()
    handler.on_plan(msgspec.structs.replace(plan, step_id=1, scheduler_id="s2"))  # a restarted scheduler
    assert fake.executed == [1, 1] and fake.requests == {}


def test_tokens_of_a_request_the_tokenizer_never_saw_wait_for_it_then_end_its_stream(stories_frontend):
    now = [0.0]
    handler = TokenizerHandler(stories_frontend, orphan_wait_s=30, clock=lambda: now[0])
    assert handler.on_generated(GeneratedTokens(request_id="lost", index=3, token_ids=(5,)), 7) == []
    done = GeneratedTokens(request_id="ended", index=0, token_ids=(5,), finish_reason=FinishReason.LENGTH)
    assert handler.on_generated(done, 8) == []
    assert handler.check_orphans() == [] and handler.low_watermarks() == {topics.GENERATED: 7}
    now[0] = 31.0  # their requests were not read again: "lost" was running, "ended" had ended
    error, finish = handler.check_orphans()
    assert error.message.request_id == "lost" and error.message.finish_reason == "error"
    assert "restarted" in error.message.error
    assert finish.message == FinishRequest(request_id="lost", reason=FinishReason.ABORT)
    assert handler.on_generated(GeneratedTokens(request_id="lost", index=4, token_ids=(6,))) == []
    assert not handler.orphans and handler.low_watermarks() == {}
    # Every request from before the start was read again: one with that id now is a new one.
    (reused,) = handler.on_request(GenerateRequest(request_id="ended", prompt="Once"), (), ("t", 0, 1))
    assert "ended recently" in reused.message.error


def test_orphans_wait_until_the_tokenizer_has_read_its_own_announcement(stories_frontend):
    """However long the requests from before a restart take to read again, their events wait."""
    from parkade.schemas import TokenizerAnnouncement

    now = [0.0]
    handler = TokenizerHandler(stories_frontend, orphan_wait_s=30, clock=lambda: now[0])
    marker = handler.announcement()
    assert marker.topic == topics.REQUESTS and marker.message.tokenizer_id == handler.tokenizer_id
    handler.on_generated(GeneratedTokens(request_id="r", index=0, token_ids=(5,)), 3)
    now[0] = 500.0  # a long catch-up
    assert handler.check_orphans() == [] and "r" in handler.orphans
    assert handler.on_request(TokenizerAnnouncement(tokenizer_id="an-earlier-one")) == []
    assert handler.check_orphans() == []
    handler.on_request(marker.message)  # read back: every request from before is read again
    assert handler.check_orphans() == []  # the generated topic gets its own grace
    now[0] = 531.0
    error, _ = handler.check_orphans()
    assert error.message.request_id == "r" and "restarted" in error.message.error


def _stream_text(outgoing):
    events = [o.message for o in outgoing if o.topic == topics.TOKENS]
    return events, "".join(e.text for e in events)


def test_a_restarted_tokenizer_rebuilds_its_streams_from_the_log(stories_frontend, stories_tokenizer):
    """The events read again before or after their request: either way, the stream's text (with
    a stop string's hold-back) is what the first tokenizer would have sent, and the last event
    is not lost."""
    ids = stories_tokenizer.encode(" a time there was a little girl", add_special_tokens=False)
    params = SamplingParams(max_tokens=20, stop=["little girl"])
    request = GenerateRequest(request_id="r", prompt="Once upon", sampling_params=params)
    events = [GeneratedTokens(request_id="r", index=i, token_ids=(t,)) for i, t in enumerate(ids)]
    first = TokenizerHandler(stories_frontend)
    (engine,) = routed(first.on_request(request, (), (topics.REQUESTS, 0, 4)))
    full = []
    for offset, event in enumerate(events, start=10):
        full += first.on_generated(event, offset)
        if offset == 10:  # opened before any generated record was read: from the first one
            assert first.low_watermarks() == {topics.REQUESTS: 4, topics.GENERATED: 10}
    expected, expected_text = _stream_text(full)
    assert expected[-1].finish_reason == "stop" and expected_text.endswith("there was a ")
    cut = 3  # the first tokenizer died after sending the events of the first three tokens
    for events_first in (True, False):
        second = TokenizerHandler(stories_frontend)
        out = []
        if events_first:
            for offset, event in enumerate(events[:cut], start=10):
                out += second.on_generated(event, offset)
            assert out == [] and second.low_watermarks() == {topics.GENERATED: 10}
        out += second.on_request(request, (), (topics.REQUESTS, 0, 4))
        (again,) = [o.message for o in out if o.topic == topics.TOKENIZED]
        assert msgspec.structs.replace(again, arrival_time=0.0) == msgspec.structs.replace(
            engine.message, arrival_time=0.0
        )
        assert second.low_watermarks()[topics.REQUESTS] == 4
        start = 10 if events_first else 0
        for offset, event in enumerate(events, start=start):
            out += second.on_generated(event, offset)  # read again, or new
        got, text = _stream_text(out)
        assert text == expected_text and got[-1] == expected[-1]
        assert {e.index for e in got if e.token_ids} == {e.index for e in expected if e.token_ids}
        assert not second.streams and second.low_watermarks() == {}


def test_a_gateways_requests_in_memory_never_hold_the_requests_topics_commit(stories_frontend):
    """A request from the gateway's own topic (in its memory beside the tokenizer) dies with the
    process: a restart cannot read it again, so only the broker's requests hold the commit."""
    local = "p." + topics.gateway_requests("0123456789ab")
    assert topics.is_gateway_requests(local) and topics.base_topic(local) == topics.REQUESTS
    assert not topics.is_gateway_requests("p.requests") and not topics.is_gateway_requests(
        "gateway-x.requests"
    )
    handler = TokenizerHandler(stories_frontend)
    params = SamplingParams(max_tokens=20)
    for request_id, source in (("mem", (local, 0, 2)), ("kafka", ("p.requests", 0, 9))):
        out = handler.on_request(
            GenerateRequest(request_id=request_id, prompt="Once upon", sampling_params=params), (), source
        )
        assert routed(out)
        if request_id == "mem":
            assert topics.REQUESTS not in handler.low_watermarks()
    assert handler.low_watermarks()[topics.REQUESTS] == 9


def test_a_tokenizer_stream_read_again_after_it_ended_sends_its_last_event_again(stories_frontend):
    """The crash came after the final event was handled but before it went out."""
    request = GenerateRequest(request_id="r", prompt="Once", sampling_params=SamplingParams(max_tokens=2))
    handler = TokenizerHandler(stories_frontend)
    handler.on_generated(GeneratedTokens(request_id="r", index=0, token_ids=(5,)), 20)
    done = GeneratedTokens(request_id="r", index=1, token_ids=(6,), finish_reason=FinishReason.LENGTH)
    handler.on_generated(done, 21)
    out = handler.on_request(request, (), (topics.REQUESTS, 0, 3))
    assert [o.topic for o in out] == [topics.TOKENS, topics.TOKENS]  # no EngineRequest: it ended
    assert out[-1].message.finish_reason == "length" and not handler.streams


def test_a_broken_chat_template_fails_only_its_request():
    class Broken:
        def apply_chat_template(self, *args, **kwargs):
            from jinja2 import TemplateError

            raise TemplateError("only user and assistant roles")

    handler = TokenizerHandler(FrontEnd(Broken(), vocab_size=512, eos_token_ids=(2,)))
    (out,) = handler.on_request(
        GenerateRequest(request_id="c", messages=(ChatMessage(role="x", content="hi"),))
    )
    assert out.message.finish_reason == "error" and "roles" in out.message.error


def test_an_executor_with_another_pool_ends_live_requests_with_an_error():
    handler = SchedulerHandler(SchedulingOptions())
    handler.on_announcement(announce("e1", num_blocks=64))
    handler.on_tokenized(engine_request("a"))
    handler.next_plans()
    (out,) = handler.on_announcement(announce("e2", num_blocks=32))
    assert out.message.request_id == "a" and out.message.finish_reason == "error"
    assert "another KV pool" in out.message.error
    assert handler.scheduler.config.num_blocks == 32 and not handler.scheduler.requests
    handler.on_tokenized(engine_request("b"))
    assert (
        drive(handler, FakeExecutor(vocab_size=50, seed=5, block_size=4))["b"][-1].finish_reason is not None
    )


def test_a_restarted_scheduler_keeps_the_open_streams_unless_it_lost_them(stories_frontend):
    from parkade.schemas import SchedulerAnnouncement

    handler = TokenizerHandler(stories_frontend)
    assert handler.on_generated(SchedulerAnnouncement(scheduler_id="s1")) == []  # the first one
    handler.on_request(GenerateRequest(request_id="r", prompt="Once"))
    assert handler.on_generated(SchedulerAnnouncement(scheduler_id="s1")) == []  # the same one again
    assert handler.on_generated(SchedulerAnnouncement(scheduler_id="s2", resumes=True)) == []
    assert "r" in handler.streams
    (out,) = handler.on_generated(SchedulerAnnouncement(scheduler_id="s3"))  # one that does not resume
    assert out.message.request_id == "r" and out.message.finish_reason == "error"
    assert "scheduler restarted" in out.message.error and not handler.streams
    scheduler = SchedulerHandler(SchedulingOptions())
    assert scheduler.announcement().message == SchedulerAnnouncement(
        scheduler_id=scheduler.scheduler_id, resumes=True
    )


def test_another_record_with_the_id_of_a_request_that_ended_gets_an_error_event():
    """A client reusing an id that a restarted tokenizer forgot: answered, never left waiting.
    The same record read again is a redelivery."""
    handler = SchedulerHandler(SchedulingOptions())
    handler.on_announcement(announce())
    handler.on_tokenized(engine_request("a", max_tokens=2), (), offset=7)
    assert drive(handler, FakeExecutor(vocab_size=50, seed=1, block_size=4))["a"][-1].finish_reason
    assert handler.on_tokenized(engine_request("a", max_tokens=2), (), offset=7) == []  # redelivered
    (reused,) = handler.on_tokenized(engine_request("a", max_tokens=2), (("traceparent", b"t2"),), offset=9)
    assert reused.message.finish_reason == "error" and "ended recently" in reused.message.error
    assert reused.headers == (("traceparent", b"t2"),) and not handler.scheduler.requests


def test_recover_tells_a_request_that_ended_in_the_window_from_one_whose_history_is_cut():
    handler = SchedulerHandler(SchedulingOptions())
    ended_late = [  # live before the progress, ended after it: its first events are below
        GeneratedTokens(request_id="x", index=5, token_ids=(1, 2)),
        GeneratedTokens(request_id="x", index=7, token_ids=(), finish_reason=FinishReason.LENGTH),
    ]
    cut = [GeneratedTokens(request_id="y", index=3, token_ids=(4,))]  # cannot be; starts again
    live = [GeneratedTokens(request_id="z", index=0, token_ids=(8, 9))]
    handler.recover(100, [GeneratedBatch(events=(*ended_late, *cut, *live))])
    assert "x" in handler.live.finished and "x" not in handler.live
    recovered = {r.request_id: (r.outputs_from, r.outputs) for r in handler.live.values()}
    assert recovered == {"y": (3, [4]), "z": (0, [8, 9])}
    handler.live["y"].resume(())  # its tokenized record names no tokens from elsewhere: cut
    assert handler.live["y"].outputs == [] and handler.live["y"].num_outputs_before == 0


def test_a_request_handed_over_joins_the_tokens_from_elsewhere_and_its_own_log():
    handler = SchedulerHandler(SchedulingOptions(), replica="b")
    assert handler.consumes == ("replica-b.tokenized", "replica-b.step-results")
    handler.recover(
        0,
        [
            GeneratedBatch(events=(GeneratedTokens(request_id="h", index=3, token_ids=(4, 5)),), replica="b"),
            GeneratedBatch(events=(GeneratedTokens(request_id="o", index=0, token_ids=(1,)),), replica="a"),
            GeneratedTokens(request_id="p", index=0, token_ids=(1,)),  # replica 0's
        ],
    )
    assert set(handler.live) == {"h"}
    handler.live["h"].resume((9, 9, 9))  # 3 tokens came from the replica before
    assert handler.live["h"].outputs == [9, 9, 9, 4, 5]
    fresh = SchedulerHandler(SchedulingOptions(), replica="c")
    fresh.on_announcement(announce("e1"))
    fresh.on_tokenized(msgspec.structs.replace(engine_request("n", max_tokens=8), output_token_ids=(3, 4)))
    assert fresh.scheduler.requests["n"].num_output_tokens == 2


def test_a_restarted_scheduler_resumes_each_request_at_its_next_index():
    """What the first scheduler generated is read back from the log: the second one recomputes
    prompt + outputs and goes on from the next index; finished requests are not run again."""
    first = SchedulerHandler(SchedulingOptions())
    first.on_announcement(announce("e1"))
    for request_id in ("a", "b", "c"):
        first.on_tokenized(engine_request(request_id, max_tokens=8), (), offset=ord(request_id))
    assert first.low_watermarks() == {topics.TOKENIZED: ord("a")}
    log_ = []  # the generated topic
    executor = FakeExecutor(vocab_size=50, seed=7, block_size=4)
    for _ in range(2):  # a few steps, then the first scheduler dies
        for plan_out in first.next_plans():
            plan = plan_out.message
            result = msgspec.structs.replace(
                executor.execute(plan), executor_id="e1", scheduler_id=plan.scheduler_id, epoch=plan.epoch
            )
            for out in first.on_step_result(result):
                first.on_sent(out, len(log_))
                log_.append(out.message)
    generated = {}
    for message in log_:
        for event in message.events:
            generated.setdefault(event.request_id, []).extend(event.token_ids)
    (ended,) = first.on_tokenized(FinishRequest(request_id="c"), (), offset=200)  # aborted
    first.on_sent(ended, len(log_))
    log_.append(ended.message)
    assert len(generated["a"]) >= 2 and first.progress() == {topics.GENERATED: 0}  # live since 0
    assert first.low_watermarks() == {topics.TOKENIZED: ord("a")}

    second = SchedulerHandler(SchedulingOptions())
    second.recover(0, log_)
    assert set(second.live) == {"a", "b"} and "c" in second.live.finished
    assert second.live["a"].outputs == generated["a"]
    second.on_sent(Outgoing(topics.GENERATED, GeneratedBatch(events=())), 50)  # others' events
    second.on_announcement(announce("e1"))
    assert second.progress() == {topics.GENERATED: 0}  # "a" and "b" are not read again yet
    for request_id in ("a", "b", "c"):  # read again: its commit stayed at "a"
        second.on_tokenized(engine_request(request_id, max_tokens=8), (), offset=ord(request_id))
    plans = []
    out = drive(second, FakeExecutor(vocab_size=50, seed=8, block_size=4), seen_plans=plans)
    resumed = {new.request_id: new for new in plans[0].new_requests}
    assert set(resumed) == {"a", "b"} and "c" not in out
    for request_id in ("a", "b"):
        done = len(generated[request_id])
        assert resumed[request_id].token_ids[-done:] == tuple(generated[request_id])
        assert resumed[request_id].num_prompt_tokens == len(resumed[request_id].token_ids) - done
        assert [e.index for e in out[request_id]] == list(range(done, 8))
    assert second.low_watermarks() == {} and second.progress() == {topics.GENERATED: 51}


def test_the_service_path_stamps_each_request_with_its_arrival(stories_frontend):
    """The tokenizer service sets arrival_time as the in-process engine does: the priority
    policy breaks ties by it, so a lost arrival_time would order requests by their random ids."""
    import time

    handler = TokenizerHandler(stories_frontend)
    before = time.time()
    sent = [
        routed(handler.on_request(GenerateRequest(request_id=rid, prompt="Once")))[0].message for rid in "cba"
    ]
    times = [request.arrival_time for request in sent]
    assert before <= times[0] < times[1] < times[2] <= time.time()


def test_options_that_cannot_work_on_the_announced_pool_answer_every_request_with_why():
    """One rule in both paths (SchedulerConfig.build): an explicit token budget below
    max_model_len with chunked prefill off is an error, never silently raised."""
    options = SchedulingOptions(enable_chunked_prefill=False, max_num_batched_tokens=32)
    handler = SchedulerHandler(options)
    handler.on_tokenized(engine_request("early"))  # waits for an executor
    (refused,) = handler.on_announcement(announce())  # max_model_len=64 > 32
    assert refused.message.request_id == "early" and refused.message.finish_reason == "error"
    assert "max_num_batched_tokens (32) must be >= max_model_len (64)" in refused.message.error
    (late,) = handler.on_tokenized(engine_request("late"))
    assert late.message.finish_reason == "error" and handler.next_plans() == []
    fitting = msgspec.structs.replace(announce("e2"), max_model_len=32)
    assert handler.on_announcement(fitting) == [] and handler.config_error is None
    handler.on_tokenized(engine_request("ok"))
    out = drive(handler, FakeExecutor(vocab_size=50, seed=6, block_size=4))
    assert out["ok"][-1].finish_reason is not None
    # Unset, the budget follows max_model_len when chunked prefill is off.
    default = SchedulerHandler(SchedulingOptions(enable_chunked_prefill=False))
    default.on_announcement(msgspec.structs.replace(announce(), max_model_len=9000, num_blocks=600))
    assert default.scheduler.config.max_num_batched_tokens == 9000


def test_the_budget_unset_is_the_one_the_executor_announces_and_set_is_the_users():
    from parkade.services.scheduler.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

    cpu = msgspec.structs.replace(announce(), default_batched_tokens=2048)
    unset = SchedulerHandler(SchedulingOptions())
    unset.on_announcement(cpu)
    assert unset.scheduler.config.max_num_batched_tokens == 2048
    # The same pool announced again by a new executor is the same pool: its requests go on.
    unset.on_tokenized(engine_request("a"))
    unset.next_plans()
    assert unset.on_announcement(msgspec.structs.replace(cpu, executor_id="e2")) == []
    assert "a" in unset.scheduler.requests
    silent = SchedulerHandler(SchedulingOptions())  # an executor that announces no budget (a GPU's)
    silent.on_announcement(announce())
    assert silent.scheduler.config.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    chosen = SchedulerHandler(SchedulingOptions(max_num_batched_tokens=512))
    chosen.on_announcement(cpu)
    assert chosen.scheduler.config.max_num_batched_tokens == 512
    # With chunked prefill off, a whole prompt must fit one step, whatever the executor asks.
    whole = SchedulerHandler(SchedulingOptions(enable_chunked_prefill=False))
    whole.on_announcement(msgspec.structs.replace(cpu, max_model_len=9000, num_blocks=600))
    assert whole.scheduler.config.max_num_batched_tokens == 9000


# ---- failures: a step that raises, an executor that goes silent -------------------------------


class _FlakyExecutor(FakeExecutor):
    """A FakeExecutor whose step raises when `fails(plan)` says so, and that can drop its state."""

    num_blocks, block_size = 64, 4

    def __init__(self, fails, seed=5):
        super().__init__(vocab_size=50, seed=seed, block_size=4)
        self.fails = fails
        self.num_resets = 0

    def execute(self, plan):
        if self.fails(plan):
            raise RuntimeError("CUDA out of memory (injected)")
        return super().execute(plan)

    def reset(self):
        self.num_resets += 1
        for state in (self.token_ids, self.block_tables, self.num_computed, self.num_prompt):
            state.clear()


def _executor_handler(fake):
    from parkade.services.executor.handler import ExecutorHandler

    return ExecutorHandler(fake, max_model_len=64)


def events_of(outs):
    """The GeneratedTokens in a handler's outputs (a step's batch, or one alone)."""
    for o in outs:
        if o.topic == topics.GENERATED:
            yield from (o.message.events if isinstance(o.message, GeneratedBatch) else (o.message,))


def run_both(scheduler, executor, rounds=400):
    """The two handlers wired by hand, as the topics wire them; -> (events per request, plans)."""
    events, plans = {}, []

    def collect(outs):
        for event in events_of(outs):
            events.setdefault(event.request_id, []).append(event)

    for _ in range(rounds):
        out = scheduler.next_plans()
        collect(out)
        new_plans = [o.message for o in out if o.topic == topics.STEP_PLANS]
        if not new_plans:
            break
        plans += new_plans
        for plan in new_plans:
            for result in executor.on_plan(plan):
                collect(scheduler.on_step_results(result.message))
    return events, plans


def _announced(scheduler, executor):
    (out,) = [executor.announcement()]
    scheduler.on_step_results(out.message)


def test_a_step_that_raises_is_answered_and_the_executor_starts_a_new_epoch():
    fake = _FlakyExecutor(lambda plan: plan.step_id == 2)
    handler = _executor_handler(fake)
    plan = StepPlan(step_id=1, executor_id=handler.executor_id, scheduler_id="s")
    (ok,) = handler.on_plan(plan)
    assert ok.message.error is None and ok.message.epoch == 0
    (failed,) = handler.on_plan(msgspec.structs.replace(plan, step_id=2))
    assert failed.message.error == "RuntimeError: CUDA out of memory (injected)"
    assert failed.message.epoch == 0 and handler.epoch == 1 and fake.num_resets == 2  # first plan, failure
    assert handler.on_plan(msgspec.structs.replace(plan, step_id=3)) == []  # planned before: void
    (ok,) = handler.on_plan(msgspec.structs.replace(plan, step_id=4, epoch=1))
    assert ok.message.error is None and ok.message.epoch == 1 and fake.num_resets == 2
    assert handler.on_plan(msgspec.structs.replace(plan, step_id=4, epoch=1)) == []  # redelivered
    (beat,) = [handler.announcement()]
    assert (beat.message.scheduler_id, beat.message.epoch) == ("s", 1)


def test_plans_the_scheduler_did_not_send_cannot_stall_it():
    """A forged plan that fails moves the executor to a new epoch without an answer the scheduler
    matches: its heartbeat says so. One that moves the executor's step count past the
    scheduler's makes its plans look like redeliveries: the step timeout voids them."""
    now = [0.0]
    fake = _FlakyExecutor(lambda plan: plan.step_id >= 1000)
    executor = _executor_handler(fake)
    scheduler = SchedulerHandler(SchedulingOptions(), step_timeout_s=10, clock=lambda: now[0])
    _announced(scheduler, executor)
    scheduler.on_tokenized(engine_request("a", max_tokens=6))
    plan = scheduler.next_plans()[0].message
    (forged,) = executor.on_plan(msgspec.structs.replace(plan, step_id=1000, new_requests=()))
    assert scheduler.on_step_results(forged.message) == []  # not a step it sent: no match
    scheduler.on_step_results(executor.announcement().message)
    assert scheduler.link.epoch == executor.epoch == 1 and not scheduler.link.in_flight
    fake.fails = lambda plan: False
    empty = StepPlan(step_id=5000, executor_id=executor.executor_id, scheduler_id=plan.scheduler_id, epoch=1)
    (ran,) = executor.on_plan(empty)
    assert ran.message.error is None
    plans = [o.message for o in scheduler.next_plans()]
    assert plans and all(executor.on_plan(p) == [] for p in plans)  # "redelivered": no answers
    now[0] = 11.0
    plans = [o.message for o in scheduler.next_plans()]  # the step timeout: a new epoch
    assert scheduler.link.epoch == 2 and {p.epoch for p in plans} == {2}
    events = {}
    for p in plans:  # the executor takes them
        for event in events_of(scheduler.on_step_results(executor.on_plan(p)[0].message)):
            events.setdefault(event.request_id, []).append(event)
    more, _ = run_both(scheduler, executor)
    events = [*events.get("a", []), *more["a"]]
    assert [e.index for e in events] == list(range(6)) and events[-1].finish_reason == FinishReason.LENGTH


def test_a_failed_step_recomputes_every_request_and_loses_no_token():
    fake = _FlakyExecutor(lambda plan: plan.step_id == 4)
    executor, scheduler = _executor_handler(fake), SchedulerHandler(SchedulingOptions())
    _announced(scheduler, executor)
    for request_id in ("a", "b", "c"):
        scheduler.on_tokenized(engine_request(request_id, max_tokens=10))
    events, plans = run_both(scheduler, executor)
    for request_id in ("a", "b", "c"):
        assert [e.index for e in events[request_id]] == list(range(10))
        assert events[request_id][-1].finish_reason == FinishReason.LENGTH
    # After the failure the three suspects each ran a step of their own, then batched again.
    after = [p for p in plans if p.epoch == 1]
    assert [tuple(p.num_scheduled_tokens) for p in after[:3]] == [("a",), ("b",), ("c",)]
    assert len(after[-2].num_scheduled_tokens) > 1 or len(after[-3].num_scheduled_tokens) > 1
    assert scheduler.scheduler.kv.num_free_blocks == 64 and not scheduler.live


def test_a_request_that_fails_every_step_ends_with_the_cause_and_the_others_finish():
    fake = _FlakyExecutor(lambda plan: "bad" in plan.num_scheduled_tokens)
    executor, scheduler = _executor_handler(fake), SchedulerHandler(SchedulingOptions())
    _announced(scheduler, executor)
    for request_id in ("good1", "bad", "good2"):
        scheduler.on_tokenized(engine_request(request_id, max_tokens=6))
    events, _ = run_both(scheduler, executor)
    (bad,) = events["bad"]
    assert bad.finish_reason == FinishReason.ERROR and bad.index == 0
    assert "failed 3 steps" in bad.error and "CUDA out of memory (injected)" in bad.error
    for request_id in ("good1", "good2"):  # they shared the first failed step only
        assert [e.index for e in events[request_id]] == list(range(6))
        assert events[request_id][-1].finish_reason == FinishReason.LENGTH


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_a_silent_executor_is_declared_lost_and_its_requests_resume_when_it_returns():
    clock = _Clock()
    fake = _FlakyExecutor(lambda plan: False)
    executor = _executor_handler(fake)
    scheduler = SchedulerHandler(SchedulingOptions(), executor_timeout_s=15, executor_wait_s=60, clock=clock)
    _announced(scheduler, executor)
    scheduler.on_tokenized(engine_request("a", max_tokens=12))
    plans = [o.message for o in scheduler.next_plans()]
    (result,) = executor.on_plan(plans[0])
    scheduler.on_step_results(result.message)  # index 0 is out; plan 2 is still in flight
    clock.now += 16  # no heartbeat, no result
    assert (
        scheduler.next_plans() == [] and scheduler.link.executor_id is None and not scheduler.link.in_flight
    )
    scheduler.on_tokenized(engine_request("late", max_tokens=3))  # waits for an executor too
    clock.now += 30
    assert scheduler.next_plans() == []  # still within executor_wait_s
    _announced(scheduler, executor)  # it was only slow: adopted again, everything recomputed
    events, plans = run_both(scheduler, executor)
    assert plans[0].epoch == 2  # lost, then adopted again: a new epoch each
    assert [e.index for e in events["a"]] == list(range(1, 12))
    assert [e.index for e in events["late"]] == [0, 1, 2]


def test_requests_without_an_executor_end_with_an_error_after_the_wait():
    clock = _Clock()
    scheduler = SchedulerHandler(SchedulingOptions(), executor_wait_s=60, clock=clock)
    scheduler.on_tokenized(engine_request("never"))  # no executor ever announced
    clock.now += 59
    assert scheduler.next_plans() == []
    clock.now += 2
    (event,) = events_of(scheduler.next_plans())
    assert event.finish_reason == FinishReason.ERROR and "no executor" in event.error
    assert not scheduler.live


def test_the_executors_heartbeat_survives_failed_sends():
    import asyncio

    from parkade.services.bus.memory import MemoryBus
    from parkade.services.executor import main as executor_main

    class FlakyBus(MemoryBus):
        failures = 2

        async def queue_many(self, records):
            if self.failures:
                self.failures -= 1
                raise ConnectionError("broker away (injected)")
            return await super().queue_many(records)

    executor = executor_main.ExecutorService(
        _FlakyExecutor(lambda plan: False), max_model_len=64, heartbeat_s=0.01
    )

    async def main():
        bus, stop = FlakyBus(), asyncio.Event()
        await bus.create_topics(topics.all_topic_names("t."))
        reader = await bus.consumer([topics.topic_name(topics.STEP_RESULTS, "t.")], None)
        task = asyncio.create_task(serve(bus, executor, prefix="t.", stop=stop))
        beats = []
        for _ in range(200):
            beats += await reader.getmany(timeout_ms=10)
            if len(beats) >= 2:
                break
        stop.set()
        await task
        return beats

    beats = asyncio.run(main())
    assert len(beats) >= 2  # the two failed sends did not end the heartbeat


def test_the_executor_runs_every_step_on_one_thread_of_its_own():
    """An OpenMP team belongs to the thread that starts it: steps spread over asyncio's shared
    pool ran on several teams at once. Each step also sees its caller's context (its span)."""
    import asyncio
    import contextvars
    import threading

    from parkade.services.executor import main as executor_main

    where = contextvars.ContextVar("where", default=None)
    executor = executor_main.ExecutorService(_FlakyExecutor(lambda plan: False), max_model_len=64)
    steps = []
    executor.on_plan = lambda plan: steps.append((threading.get_ident(), where.get())) or []

    async def main():
        loop_thread = threading.get_ident()
        for step_id in range(1, 7):
            where.set(step_id)
            plan = StepPlan(step_id=step_id, executor_id=executor.executor_id, scheduler_id="s")
            # Two at once, as the loop never sends them, and each with another busy pool beside.
            await asyncio.gather(executor.on_record(plan, None), asyncio.to_thread(lambda: None))
        first = {ident for ident, _ in steps}
        await executor.stop()  # the thread ends; a later step gets a new one
        plan = StepPlan(step_id=7, executor_id=executor.executor_id, scheduler_id="s")
        await executor.on_record(plan, None)
        await executor.stop()
        return loop_thread, first

    loop_thread, first = asyncio.run(main())
    assert len(first) == 1 and loop_thread not in first
    assert [step for _, step in steps[:6]] == [1, 2, 3, 4, 5, 6]
    assert steps[6][0] != loop_thread


def test_an_executor_whose_step_hangs_gives_up_its_process():
    """Heartbeats come from the event loop, so they go on while a step's thread hangs: the
    heartbeat loop itself notices the step's age and ends the process (a supervisor restarts it)."""
    import asyncio
    import threading

    from parkade.services.bus.memory import MemoryBus
    from parkade.services.executor import main as executor_main

    release = threading.Event()
    hung = []
    executor = executor_main.ExecutorService(
        _FlakyExecutor(lambda plan: release.wait(10) and False),
        max_model_len=64,
        heartbeat_s=0.02,
        step_deadline_s=0.2,
        on_hung=lambda: hung.append(True),
    )

    async def main():
        bus, stop = MemoryBus(), asyncio.Event()
        await bus.create_topics(topics.all_topic_names("t."))
        task = asyncio.create_task(serve(bus, executor, prefix="t.", stop=stop))
        plan = StepPlan(step_id=1, executor_id=executor.executor_id, scheduler_id="s")
        await bus.send(topics.topic_name(topics.STEP_PLANS, "t."), topics.ENCODER.encode(plan))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if hung:
                break
        release.set()
        stop.set()
        await task

    asyncio.run(main())
    assert hung == [True]


# ---- records the broker refuses (too large) ---------------------------------------------------


def test_the_tokenizer_answers_for_its_refused_records(stories_frontend):
    from parkade.services.bus.base import RecordRejected

    handler = TokenizerHandler(stories_frontend)
    (forward,) = routed(handler.on_request(GenerateRequest(request_id="r", prompt="Once upon")))
    (event,) = handler.on_send_error(forward, RecordRejected("MessageSizeTooLargeError: 3 MB"))
    assert event.topic == topics.TOKENS and event.message.finish_reason == FinishReason.ERROR
    assert "could not be forwarded: MessageSizeTooLargeError: 3 MB" in event.message.error
    assert handler.on_request(GenerateRequest(request_id="r", prompt="Once upon")) == []  # ended

    handler.on_request(GenerateRequest(request_id="s", prompt="Once upon"))
    (tokens,) = handler.on_generated(GeneratedTokens(request_id="s", index=0, token_ids=(5,)))
    finish, error = handler.on_send_error(tokens, RecordRejected("too large"))
    assert finish.topic == topics.TOKENIZED and finish.message == FinishRequest(request_id="s")
    assert error.message.index == 0 and "could not be sent" in error.message.error
    assert handler.on_send_error(error, RecordRejected("too large")) == []  # nothing smaller to say
    assert "s" not in handler.streams


def test_a_step_plan_the_broker_refuses_is_a_failed_step():
    from parkade.services.bus.base import RecordRejected

    executor = _executor_handler(_FlakyExecutor(lambda plan: False))
    scheduler = SchedulerHandler(SchedulingOptions())
    _announced(scheduler, executor)
    for request_id in ("ok", "huge"):
        scheduler.on_tokenized(engine_request(request_id, max_tokens=5))
    events = {}
    for _ in range(200):
        plans = [o for o in scheduler.next_plans() if o.topic == topics.STEP_PLANS]
        if not plans:
            break
        for out in plans:
            if "huge" in out.message.num_scheduled_tokens:  # its plans never fit the broker
                answers = scheduler.on_send_error(out, RecordRejected("MessageSizeTooLargeError"))
            else:
                results = executor.on_plan(out.message)
                answers = [a for r in results for a in scheduler.on_step_results(r.message)]
            for event in events_of(answers):
                events.setdefault(event.request_id, []).append(event)
    (huge,) = events["huge"]
    assert huge.finish_reason == FinishReason.ERROR and "the step plan could not be sent" in huge.error
    assert [e.index for e in events["ok"]] == list(range(5))


def test_the_executor_answers_for_a_result_the_broker_refuses():
    from parkade.services.bus.base import RecordRejected

    fake = _FlakyExecutor(lambda plan: False)
    handler = _executor_handler(fake)
    (result,) = handler.on_plan(StepPlan(step_id=1, executor_id=handler.executor_id, scheduler_id="s"))
    (answer,) = handler.on_send_error(result, RecordRejected("too large"))
    assert answer.message.step_id == 1 and answer.message.epoch == 0
    assert "the step's result could not be sent: too large" in answer.message.error
    assert handler.epoch == 1 and fake.num_resets == 2
    assert handler.on_send_error(answer, RecordRejected("too large")) == []
    assert handler.on_send_error(handler.announcement(), RecordRejected("too large")) == []


def test_a_second_request_with_an_id_in_use_or_just_used_gets_an_error_event(stories_frontend):
    handler = TokenizerHandler(stories_frontend)
    request = GenerateRequest(request_id="r", prompt="Once", sampling_params=SamplingParams(max_tokens=1))
    first, second = ("requests", 0, 7), ("requests", 0, 9)
    (forward,) = routed(handler.on_request(request, (("traceparent", b"00-a"),), first))
    assert forward.topic == topics.TOKENIZED
    assert handler.on_request(request, (("traceparent", b"00-a"),), first) == []  # redelivered
    (live,) = handler.on_request(request, (("traceparent", b"00-b"),), second)
    assert live.topic == topics.TOKENS and "is in use by a live request" in live.message.error
    assert live.headers == (("traceparent", b"00-b"),)  # the second request's: its client's event
    handler.on_generated(GeneratedTokens(request_id="r", index=0, token_ids=(5,), finish_reason="length"))
    assert handler.on_request(request, (), first) == []  # the first, redelivered after its end
    (reused,) = handler.on_request(request, (), second)
    assert "was used by a request that ended recently" in reused.message.error


def test_the_tokenizer_fans_a_request_out_into_samples_and_gathers_their_events(
    stories_frontend, stories_tokenizer
):
    handler = TokenizerHandler(stories_frontend)
    params = SamplingParams(n=3, seed=5, max_tokens=4, stop=["girl"])
    out = routed(
        handler.on_request(GenerateRequest(request_id="r", prompt="Once upon", sampling_params=params))
    )
    samples = [o.message for o in out]
    assert [s.request_id for s in samples] == ["r#0", "r#1", "r#2"] and {o.key for o in out} == {"r"}
    assert [s.sampling_params.seed for s in samples] == [5, 6, 7] and samples[1].sampling_params.n == 1
    # A client id that names a live sample is refused; so is a request whose samples would.
    (taken,) = handler.on_request(GenerateRequest(request_id="r#1", prompt="Hi"))
    assert taken.message.finish_reason == "error" and "in use" in taken.message.error
    handler.on_request(GenerateRequest(request_id="x#0", prompt="Hi"))
    (clash,) = handler.on_request(
        GenerateRequest(request_id="x", prompt="Hi", sampling_params=SamplingParams(n=2))
    )
    assert "sample id 'x#0' is in use" in clash.message.error

    girl = stories_tokenizer.encode(" girl", add_special_tokens=False)
    a_time = stories_tokenizer.encode(" a time", add_special_tokens=False)
    (first,) = handler.on_generated(GeneratedTokens(request_id="r#1", index=0, token_ids=(a_time[0],)))
    assert (first.message.request_id, first.message.sample_index) == ("r", 1)
    finish, stopped = handler.on_generated(GeneratedTokens(request_id="r#2", index=0, token_ids=tuple(girl)))
    assert finish.topic == topics.TOKENIZED and finish.message.request_id == "r#2"  # that sample only
    assert stopped.message.finish_reason == "stop" and stopped.message.usage is None  # others run on
    assert handler.on_generated(GeneratedTokens(request_id="r#2", index=1, token_ids=(5,))) == []
    (last0,) = handler.on_generated(
        GeneratedTokens(request_id="r#0", index=0, token_ids=(a_time[0],), finish_reason=FinishReason.LENGTH)
    )
    assert last0.message.usage is None
    (abort,) = handler.on_request(AbortRequest(request_id="r"))  # the one sample still running
    assert abort.message == FinishRequest(request_id="r#1", reason=FinishReason.ABORT)
    (last,) = handler.on_generated(
        GeneratedTokens(request_id="r#1", index=1, token_ids=(), finish_reason=FinishReason.ABORT)
    )
    assert last.message.sample_index == 1 and last.message.usage.completion_tokens == 1 + len(girl) + 1
    assert "r" not in handler.streams and not [e for e in handler.engine_ids if e.startswith("r#")]


def test_an_error_on_one_sample_ends_the_request_and_stops_the_other_samples(stories_frontend):
    handler = TokenizerHandler(stories_frontend)
    params = SamplingParams(n=2, max_tokens=4)
    handler.on_request(GenerateRequest(request_id="r", prompt="Once upon", sampling_params=params))
    refused = GeneratedTokens(
        request_id="r#1", index=0, token_ids=(), finish_reason=FinishReason.ERROR,
        error="overloaded", error_kind=ErrorKind.OVERLOADED,
    )  # fmt: skip
    out = handler.on_generated(refused)
    finish = [o.message for o in out if o.topic == topics.TOKENIZED]
    (error,) = [o.message for o in out if o.topic == topics.TOKENS]
    assert finish == [FinishRequest(request_id="r#0", reason=FinishReason.ABORT)]
    assert error.finish_reason == "error" and error.error_kind == ErrorKind.OVERLOADED
    assert "r" not in handler.streams
    late = GeneratedTokens(request_id="r#0", index=0, token_ids=(), finish_reason=FinishReason.ABORT)
    assert handler.on_generated(late) == []  # the aborted sample's last word: nobody waits for it


def test_a_restarted_tokenizer_rebuilds_a_request_with_samples(stories_frontend):
    params = SamplingParams(n=2, max_tokens=2)
    request = GenerateRequest(request_id="r", prompt="Once upon", sampling_params=params)
    events = [
        GeneratedTokens(request_id="r#1", index=0, token_ids=(5,)),
        GeneratedTokens(request_id="r#0", index=0, token_ids=(6,)),
        GeneratedTokens(request_id="r#0", index=1, token_ids=(7,), finish_reason=FinishReason.LENGTH),
    ]
    handler = TokenizerHandler(stories_frontend)
    out = []
    for offset, event in enumerate(events, start=10):
        out += handler.on_generated(event, offset)
    assert out == [] and set(handler.orphans) == {"r#0", "r#1"}
    out = handler.on_request(request, (), (topics.REQUESTS, 0, 4))
    tokens = [o.message for o in out if o.topic == topics.TOKENS]
    assert [(e.sample_index, e.index) for e in tokens] == [(0, 0), (0, 1), (1, 0)]  # in order per sample
    # Sample 0 ended meanwhile: only sample 1 goes to the scheduler again.
    assert [o.message.request_id for o in out if o.topic == topics.TOKENIZED] == ["r#1"]
    assert handler.low_watermarks()[topics.GENERATED] == 10 and not handler.orphans
    (last,) = handler.on_generated(
        GeneratedTokens(request_id="r#1", index=1, token_ids=(8,), finish_reason=FinishReason.LENGTH), 13
    )
    assert last.message.usage.completion_tokens == 4 and not handler.streams


def test_what_a_request_on_the_topics_may_not_ask(stories_frontend, monkeypatch):
    handler = TokenizerHandler(stories_frontend)
    messages = (ChatMessage(role="user", content="hi"),)
    templated = GenerateRequest(request_id="t", messages=messages, chat_template="{{ messages[0].content }}")
    (refused,) = handler.on_request(templated)
    assert refused.message.finish_reason == "error"
    assert "--trust-request-chat-template" in refused.message.error
    trusting = TokenizerHandler(FrontEnd.from_options(TokenizerOptions(trust_request_chat_template=True)))
    (accepted,) = routed(trusting.on_request(templated))
    assert accepted.topic == topics.TOKENIZED
    # The bound as it would be for a model longer than this one's 512 positions.
    monkeypatch.setattr("parkade.services.tokenizer.frontend.MAX_WIRE_PROMPT_LOGPROB_ENTRIES", 5_000)
    long_prompt = tuple(range(3, 503))  # 500 tokens x (1 + 20) entries: more than one record carries
    big_ask = GenerateRequest(
        request_id="p",
        prompt_token_ids=long_prompt,
        sampling_params=SamplingParams(prompt_logprobs=20, max_tokens=8),
    )
    (big,) = handler.on_request(big_ask)
    assert "prompt_logprobs=20 over a 500-token prompt" in big.message.error
    small_ask = GenerateRequest(
        request_id="q",
        prompt_token_ids=long_prompt,
        sampling_params=SamplingParams(prompt_logprobs=1, max_tokens=8),
    )
    (ok,) = routed(handler.on_request(small_ask))
    assert ok.topic == topics.TOKENIZED


def test_requests_read_before_an_executor_are_admitted_in_the_order_they_were_read():
    """After a restart the recovered requests (first in the records, by their events) and the
    new ones wait together for the executor; they reach the core in the tokenized topic's order."""
    handler = SchedulerHandler(SchedulingOptions())
    handler.recover(
        0,
        [GeneratedBatch(events=tuple(GeneratedTokens(request_id=r, index=0, token_ids=(7,)) for r in "ya"))],
    )
    for offset, request_id in enumerate("xay", start=10):
        assert handler.on_tokenized(engine_request(request_id), (), offset=offset) == []
    assert list(handler.live.pending) == ["x", "a", "y"]
    handler.on_announcement(announce())
    (plan,) = [o.message for o in handler.next_plans()][:1]
    assert [new.request_id for new in plan.new_requests] == ["x", "a", "y"]
    assert not handler.live.pending and handler.low_watermarks() == {topics.TOKENIZED: 10}
