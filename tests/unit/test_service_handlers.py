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
    (out,) = handler.on_request(request, (("traceparent", b"00-x"),))
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
    (chat,) = handler.on_request(
        GenerateRequest(request_id="c", messages=(ChatMessage(role="user", content="hi"),))
    )
    assert chat.message.finish_reason == "error"  # stories260K has no chat template


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
    (out,) = handler.on_request(GenerateRequest(request_id="c", messages=messages))
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


def announce(executor_id="e1", num_blocks=64):
    return ExecutorAnnouncement(
        executor_id=executor_id,
        model="m",
        num_blocks=num_blocks,
        block_size=4,
        max_model_len=64,
        vocab_size=50,
    )


def engine_request(request_id, n=6, max_tokens=4):
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=tuple(range(3, 3 + n)),
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
            result = msgspec.structs.replace(executor.execute(plan), executor_id=plan.executor_id)
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


def test_a_new_executor_makes_the_scheduler_recompute_everything():
    handler = SchedulerHandler(SchedulingOptions())
    handler.on_announcement(announce("e1"))
    handler.on_tokenized(engine_request("a", max_tokens=8))
    (plan, _) = [o.message for o in handler.next_plans()]
    handler.on_step_result(
        StepResult(step_id=plan.step_id, executor_id="e1", request_ids=("a",), sampled_token_ids=(7,))
    )
    handler.on_announcement(announce("e2"))  # e1 died: its KV pool is gone
    assert not handler.in_flight and handler.scheduler.kv.num_free_blocks == 64
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
    assert handler.on_announcement(announce("e1")) == [] and handler.executor_id == "e2"
    assert len(handler.in_flight) == len(plans) > 0


class _CountingExecutor:
    """Stands in for Executor: counts executions and holds request state to be cleared."""

    num_blocks, block_size = 8, 4

    def __init__(self):
        self.executed = []
        self.requests = {"old": object()}

    def execute(self, plan):
        self.executed.append(plan.step_id)
        return StepResult(step_id=plan.step_id)

    def reset(self):
        self.requests.clear()


def test_executor_handler_runs_each_plan_once_and_follows_a_new_scheduler():
    from parkade.services.executor.handler import ExecutorHandler

    fake = _CountingExecutor()
    handler = ExecutorHandler(fake, model="m", max_model_len=32, eos_token_ids=())
    plan = StepPlan(step_id=1, executor_id=handler.executor_id, scheduler_id="s1")
    (out,) = handler.on_plan(plan)
    assert out.message.executor_id == handler.executor_id
    assert handler.on_plan(plan) == []  # redelivered
    assert handler.on_plan(msgspec.structs.replace(plan, step_id=2, executor_id="other")) == []
    assert fake.requests == {}  # the first plan of scheduler s1 cleared state of the one before
    fake.requests["x"] = object()
    handler.on_plan(msgspec.structs.replace(plan, step_id=1, scheduler_id="s2"))  # a restarted scheduler
    assert fake.executed == [1, 1] and fake.requests == {}


def test_tokens_of_a_request_the_tokenizer_never_saw_end_its_stream(stories_frontend):
    handler = TokenizerHandler(stories_frontend)
    error, finish = handler.on_generated(GeneratedTokens(request_id="lost", index=3, token_ids=(5,)))
    assert error.message.finish_reason == "error" and "restarted" in error.message.error
    assert finish.message == FinishRequest(request_id="lost", reason=FinishReason.ABORT)
    assert handler.on_generated(GeneratedTokens(request_id="lost", index=4, token_ids=(6,))) == []


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


def test_a_restarted_scheduler_ends_the_open_streams(stories_frontend):
    from parkade.schemas import SchedulerAnnouncement

    handler = TokenizerHandler(stories_frontend)
    assert handler.on_generated(SchedulerAnnouncement(scheduler_id="s1")) == []  # the first one
    handler.on_request(GenerateRequest(request_id="r", prompt="Once"))
    assert handler.on_generated(SchedulerAnnouncement(scheduler_id="s1")) == []  # the same one again
    (out,) = handler.on_generated(SchedulerAnnouncement(scheduler_id="s2"))
    assert out.message.request_id == "r" and out.message.finish_reason == "error"
    assert "scheduler restarted" in out.message.error and not handler.streams
    scheduler = SchedulerHandler(SchedulingOptions())
    assert scheduler.announcement().message == SchedulerAnnouncement(scheduler_id=scheduler.scheduler_id)


def test_the_service_path_stamps_each_request_with_its_arrival(stories_frontend):
    """The tokenizer service sets arrival_time as the in-process engine does: the priority
    policy breaks ties by it, so a lost arrival_time would order requests by their random ids."""
    import time

    handler = TokenizerHandler(stories_frontend)
    before = time.time()
    sent = [handler.on_request(GenerateRequest(request_id=rid, prompt="Once"))[0].message for rid in "cba"]
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
