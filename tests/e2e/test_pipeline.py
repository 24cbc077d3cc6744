"""The three services over a real broker: streaming, order, abort, stop strings, bad records.

The services run as tasks of this test's process (real KafkaBus, real topics), so the test can
look at the scheduler's block pool; `test_up.py` runs them as separate processes.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import shutil
import subprocess
import sys
import uuid

import msgspec
import pytest
from hf_reference import STORIES
from pipeline import running_pipeline, wait_idle
from stack import TANSU_NOT_LEADER

from parkade import LLM, SamplingParams
from parkade.client import Client
from parkade.schemas import topics
from parkade.services.bus.kafka import KafkaBus

pytestmark = [pytest.mark.e2e, TANSU_NOT_LEADER]

OPENINGS = [
    "Once upon a time",
    "Lily and Tom",
    "The big dog",
    "One day, a girl",
    "Tim had a ball",
    "Mom said",
]
ENGINE = dict(max_model_len=256, block_size=16)
ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_with_pipeline(bootstrap: str, body, **engine_kwargs):
    """asyncio.run(body(pipeline, prefix)) with the services running on fresh topics."""
    prefix = f"t{uuid.uuid4().hex[:8]}."

    async def main():
        bus = KafkaBus(bootstrap, client_id="e2e-services")
        await bus.create_topics([topics.topic_name(t, prefix) for t in topics.ALL_TOPICS])
        try:
            async with running_pipeline(
                bus, STORIES, prefix=prefix, **{**ENGINE, **engine_kwargs}
            ) as pipeline:
                return await asyncio.wait_for(body(pipeline, prefix), 240)
        finally:
            await bus.close()

    return asyncio.run(main())


def test_32_concurrent_clients_stream_the_in_process_engines_text(bootstrap_servers):
    prompts = [f"{OPENINGS[i % len(OPENINGS)]}{' and' * (i // len(OPENINGS))}" for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = [o.outputs[0] for o in LLM(STORIES, dtype="float32", **ENGINE).generate(prompts, params)]

    async def body(pipeline, prefix):
        async def one_client(prompt):
            async with Client(bootstrap_servers, prefix) as client:
                return [e async for e in client.generate(prompt=prompt, sampling_params=params)]

        results = await asyncio.gather(*(one_client(p) for p in prompts))
        await wait_idle(pipeline)
        kv = pipeline.scheduler.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks
        return results

    results = run_with_pipeline(bootstrap_servers, body)
    for events, exp in zip(results, expected, strict=True):
        indices = [e.index for e in events if e.token_ids]
        assert indices == list(range(len(indices))), "indices out of order, with gaps or repeats"
        assert [t for e in events for t in e.token_ids] == exp.token_ids
        assert "".join(e.text for e in events) == exp.text
        assert events[-1].finish_reason == exp.finish_reason
        assert sum(1 for e in events if e.finish_reason is not None) == 1


def test_abort_mid_stream_frees_the_requests_blocks(bootstrap_servers):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def body(pipeline, prefix):
        async with Client(bootstrap_servers, prefix) as client:
            request_id = await client.submit(prompt="Once upon a time", sampling_params=params)
            events = []
            async for event in client.stream(request_id):
                events.append(event)
                if len(events) == 5:
                    kv = pipeline.scheduler.scheduler.kv
                    assert kv.num_free_blocks < kv.num_blocks  # it holds blocks while it runs
                    await client.cancel(request_id)
            await wait_idle(pipeline)
            kv = pipeline.scheduler.scheduler.kv
            assert kv.num_free_blocks == kv.num_blocks
            pipeline.scheduler.scheduler.check_integrity()
            return events

    events = run_with_pipeline(bootstrap_servers, body)
    assert events[-1].finish_reason == "abort"
    assert sum(len(e.token_ids) for e in events) < 200


def test_stop_strings_end_the_stream_at_the_right_place(bootstrap_servers):
    async def body(pipeline, prefix):
        async with Client(bootstrap_servers, prefix) as client:
            cut = SamplingParams(temperature=0, max_tokens=60, stop=["girl named"])
            keep = SamplingParams(
                temperature=0, max_tokens=60, stop=["girl named"], include_stop_str_in_output=True
            )
            a = [e async for e in client.generate(prompt="Once upon a time", sampling_params=cut)]
            b = [e async for e in client.generate(prompt="Once upon a time", sampling_params=keep)]
            await wait_idle(pipeline)
            return a, b

    cut, keep = run_with_pipeline(bootstrap_servers, body)
    assert "".join(e.text for e in cut) == ", there was a little "
    assert (cut[-1].finish_reason, cut[-1].stop_reason) == ("stop", "girl named")
    assert "".join(e.text for e in keep) == ", there was a little girl named"
    # No streamed delta ever showed the start of the stop string before it was cut.
    assert all("gir" not in e.text for e in cut)


def test_bad_records_get_an_error_event_or_a_dead_letter_and_disturb_nothing(bootstrap_servers):
    params = SamplingParams(temperature=0, max_tokens=12)

    async def body(pipeline, prefix):
        bus = KafkaBus(bootstrap_servers, client_id="e2e-raw")
        dead = await bus.consumer([topics.topic_name(topics.DEAD_LETTER, prefix)], None)
        requests_topic = topics.topic_name(topics.REQUESTS, prefix)
        async with Client(bootstrap_servers, prefix, own_reply_topic=False) as client:
            good = asyncio.create_task(_collect(client, "Once upon a time", params))
            await bus.send(requests_topic, b"\xc1 this is not msgpack")
            invalid = {
                "type": "generate",
                "request_id": "bad-temp",
                "prompt": "hi",
                "sampling_params": {"temperature": -1},
            }
            # Listen for the error event of a raw record (sent without a trace context).
            client.expect("bad-temp")
            await bus.send(requests_topic, msgspec.msgpack.encode(invalid))
            errors = [e async for e in client.stream("bad-temp")]
            letters = []
            while not letters:
                letters = await dead.getmany(timeout_ms=500)
            good_events = await good
        await dead.stop()
        await bus.close()
        return errors, letters, good_events

    errors, letters, good_events = run_with_pipeline(bootstrap_servers, body)
    (error,) = errors
    assert error.finish_reason == "error" and "temperature must be >= 0" in error.error
    assert letters[0].value == b"\xc1 this is not msgpack"
    assert letters[0].header("parkade-error") is not None
    assert good_events[-1].finish_reason == "length" and sum(len(e.token_ids) for e in good_events) == 12


async def _collect(client, prompt, params):
    return [e async for e in client.generate(prompt=prompt, sampling_params=params)]


def test_a_topic_with_several_partitions_is_refused(bootstrap_servers):
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    name = f"t{uuid.uuid4().hex[:8]}.step-plans"

    async def main():
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
        await admin.start()
        await admin.create_topics([NewTopic(name, num_partitions=2, replication_factor=1)])
        await admin.close()
        bus = KafkaBus(bootstrap_servers)
        try:
            with pytest.raises(ValueError, match="has 2 partitions; Parkade needs 1"):
                await bus.create_topics([name])
        finally:
            await bus.close()

    asyncio.run(main())
    # A service on such a topic says so in one line and exits.
    prefix = name.removesuffix("step-plans")
    service = [
        sys.executable,
        "-P",
        "-m",
        "parkade.cli",
        "scheduler",
        "--bootstrap-servers",
        bootstrap_servers,
    ]
    result = subprocess.run([*service, "--topic-prefix", prefix], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"parkade scheduler: topic {name} has 2 partitions; Parkade needs 1\n"


def test_executor_steps_that_raise_are_recomputed_or_end_their_request_with_the_cause(bootstrap_servers):
    """One step fails once (a transient fault); every step with the "poison" request fails (a
    request the model cannot run). The others stream the in-process engine's text regardless."""
    prompts = [f"{OPENINGS[i % len(OPENINGS)]}{' and' * (i // len(OPENINGS))}" for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40)
    expected = [o.outputs[0] for o in LLM(STORIES, dtype="float32", **ENGINE).generate(prompts, params)]

    async def body(pipeline, prefix):
        executor = pipeline.executor.executor
        execute, steps = executor.execute, []

        def flaky(plan):
            steps.append(plan.step_id)
            if len(steps) == 6 or "poison" in plan.num_scheduled_tokens:
                raise RuntimeError("injected fault")
            return execute(plan)

        executor.execute = flaky
        async with Client(bootstrap_servers, prefix) as client:

            async def one(prompt, request_id=None):
                request_id = await client.submit(prompt=prompt, sampling_params=params, request_id=request_id)
                return [e async for e in client.stream(request_id)]

            results = await asyncio.gather(*(one(p) for p in prompts), one("Tim had a ball", "poison"))
        await wait_idle(pipeline)
        assert pipeline.executor.num_failed_steps >= 3  # the poison's three (the 6th may be one)
        return results

    *results, poison = run_with_pipeline(bootstrap_servers, body)
    for events, exp in zip(results, expected, strict=True):
        indices = [e.index for e in events if e.token_ids]
        assert indices == list(range(len(indices))), "indices out of order, with gaps or repeats"
        assert "".join(e.text for e in events) == exp.text
    assert poison[-1].finish_reason == "error" and "injected fault" in poison[-1].error
    assert "failed 3 steps" in poison[-1].error


def _flipped(value: bytes, rng) -> bytes:
    data = bytearray(value)
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    return bytes(data)


def test_fuzzed_input_topics_leave_every_service_up_and_every_good_stream_exact(bootstrap_servers):
    """Random bytes, truncated and bit-flipped copies of real records, wrong types, unknown tags,
    absurd values and duplicate ids on each service's input topics, while good streams run: they
    end with the in-process engine's text, each decodable request gets an error event, each
    undecodable record reaches the dead-letter topic, and the pipeline serves on."""
    import random

    from parkade.schemas import (
        EngineRequest,
        ExecutorAnnouncement,
        GeneratedTokens,
        GenerateRequest,
        StepPlan,
        StepResult,
        TokenEvent,
    )

    rng = random.Random(9)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [
        o.outputs[0].text for o in LLM(STORIES, dtype="float32", **ENGINE).generate(OPENINGS[:4], params)
    ]
    encode = topics.ENCODER.encode

    async def body(pipeline, prefix):
        name = lambda topic: topics.topic_name(topic, prefix)  # noqa: E731
        bus = KafkaBus(bootstrap_servers, client_id="e2e-fuzz")
        async with Client(bootstrap_servers, prefix, own_reply_topic=False) as client:
            await _collect(client, "Mom said", params)  # real records to copy, of a finished request
            real = {}
            for topic in (topics.REQUESTS, topics.TOKENIZED, topics.STEP_PLANS):
                reader = await bus.consumer([name(topic)], None, start={name(topic): 0})
                real[topic] = [r.value for r in await reader.getmany(timeout_ms=1000)]
                await reader.stop()
            executor_id = pipeline.executor.executor_id
            junk, fuzz = [], []  # (topic, bytes): undecodable ones, and all
            inputs = (topics.TOKENIZED, topics.STEP_PLANS, topics.STEP_RESULTS, topics.GENERATED)
            for topic in (topics.REQUESTS, *inputs):
                for _ in range(5):
                    junk.append((topic, rng.randbytes(rng.randint(0, 64))))
            # Wrong types and unknown tags: dead letters, or on the requests topic (where the
            # request id can be read) an error event for that id.
            for topic in (topics.REQUESTS, *inputs):
                unknown = encode({"type": "no-such-type", "request_id": "unknown-tag"})
                wrong = encode(TokenEvent(request_id="wrong-type", index=0))
                (fuzz if topic == topics.REQUESTS else junk).extend([(topic, unknown), (topic, wrong)])
                for value in real.get(topic, [])[:6]:
                    fuzz.append((topic, value[: rng.randrange(len(value))]))  # truncated
                    fuzz.append((topic, _flipped(value, rng)))
            fuzz += junk
            absurd = [
                (
                    topics.REQUESTS,
                    encode(
                        {
                            "type": "generate",
                            "request_id": "neg",
                            "prompt": "hi",
                            "sampling_params": {"max_tokens": -5},
                        }
                    ),
                ),
                (topics.REQUESTS, encode(GenerateRequest(request_id="ids", prompt_token_ids=(10**9,)))),
                (topics.REQUESTS, encode(GenerateRequest(request_id="big", prompt="a " * 5000))),
                (
                    topics.TOKENIZED,
                    encode(
                        EngineRequest(request_id="e-big", prompt_token_ids=(10**9,), sampling_params=params)
                    ),
                ),
                (
                    topics.STEP_PLANS,
                    encode(StepPlan(step_id=10**9, executor_id=executor_id, scheduler_id="forged", epoch=7)),
                ),
                (topics.STEP_PLANS, encode(StepPlan(step_id=-1, executor_id=executor_id))),
                (topics.STEP_RESULTS, encode(StepResult(step_id=3, executor_id="forged", error="x"))),
                (
                    topics.STEP_RESULTS,
                    encode(
                        ExecutorAnnouncement(
                            executor_id=executor_id, num_blocks=0, block_size=0, max_model_len=0, vocab_size=0
                        )
                    ),
                ),
                (
                    topics.GENERATED,
                    encode(GeneratedTokens(request_id="never-seen", index=10**6, token_ids=(10**9,))),
                ),
            ]
            fuzz += absurd
            rng.shuffle(fuzz)
            refused = ("neg", "ids", "big", "unknown-tag", "wrong-type")
            for rid in (*refused, "dup"):
                client.expect(rid)  # listen for raw records' answers
            good = [asyncio.create_task(_collect(client, p, params)) for p in OPENINGS[:4]]
            live = asyncio.create_task(_collect(client, "Tim had a ball", params))
            await asyncio.sleep(0.2)
            dup = GenerateRequest(request_id="dup", prompt="hi")
            for topic, value in fuzz:
                await bus.send(name(topic), value)
            # A second request with the id of a live one: answered with an error at once.
            await bus.send(name(topics.REQUESTS), encode(dup))
            await bus.send(name(topics.REQUESTS), encode(msgspec.structs.replace(dup, prompt="other")))
            answers = {}
            for rid in refused:
                answers[rid] = [e async for e in client.stream(rid, timeout_s=60)]
            dup_events = [e async for e in client.stream("dup", timeout_s=60)]
            texts = ["".join(e.text for e in await task) for task in good]
            await live
            assert (
                "e-big" in pipeline.scheduler.live.finished
            )  # refused there: its token is not in the vocabulary
            after = await _collect(client, "One day, a girl", params)  # still serving
            dead = await bus.consumer([name(topics.DEAD_LETTER)], None, start={name(topics.DEAD_LETTER): 0})
            letters = []
            for _ in range(10):
                letters += await dead.getmany(timeout_ms=300)
            await dead.stop()
        await bus.close()
        letters = {(r.header("parkade-source").decode().rsplit(":", 2)[0], r.value) for r in letters}
        return answers, dup_events, texts, after, letters, [(name(t), v) for t, v in junk]

    answers, dup_events, texts, after, letters, junk = run_with_pipeline(
        bootstrap_servers, body, scheduler_kwargs={"step_timeout_s": 5.0}
    )
    assert texts == expected
    for rid, events in answers.items():
        assert events[-1].finish_reason == "error" and events[-1].error, (rid, events)
    assert "max_tokens" in answers["neg"][-1].error
    assert dup_events[-1].finish_reason == "error" and "in use by a live request" in dup_events[-1].error
    assert after[-1].finish_reason == "length"
    missing = [(topic, value) for topic, value in junk if (topic, value) not in letters]
    assert not missing, missing


def test_json_and_msgpack_requests_from_a_plain_kafka_client(bootstrap_servers):
    """No parkade import on the client's side: aiokafka, json and msgpack only. A JSON request is
    answered in JSON, a msgpack one in msgpack, both with the in-process engine's text; a keyed
    record that cannot be decoded gets an error event and a dead letter."""
    import json

    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    expected = (
        LLM(STORIES, dtype="float32", **ENGINE)
        .generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=5))[0]
        .outputs[0]
    )

    async def body(pipeline, prefix):
        request = {
            "type": "generate",
            "request_id": "j1",
            "prompt": "Once upon a time",
            "sampling_params": {"max_tokens": 5, "temperature": 0},
        }
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers)
        await producer.start()
        json_header = [("content-type", b"application/json")]
        await producer.send_and_wait(
            f"{prefix}requests", json.dumps(request).encode(), key=b"j1", headers=json_header
        )
        packed = msgspec.msgpack.encode({**request, "request_id": "m1"})
        await producer.send_and_wait(f"{prefix}requests", packed, key=b"m1")
        await producer.send_and_wait(f"{prefix}requests", b"{not json", key=b"bad1", headers=json_header)
        reply_header = [*json_header, ("reply-topic", f"{prefix}my-replies".encode())]
        await producer.send_and_wait(
            f"{prefix}requests", json.dumps({**request, "request_id": "r1"}).encode(), key=b"r1",
            headers=reply_header,
        )  # fmt: skip
        await producer.stop()
        consumer = AIOKafkaConsumer(
            f"{prefix}tokens", f"{prefix}dead-letter", f"{prefix}my-replies",
            bootstrap_servers=bootstrap_servers, auto_offset_reset="earliest", metadata_max_age_ms=500,
        )  # fmt: skip
        await consumer.start()
        events, letters, done, topics_of = {}, [], set(), {}
        while done != {"j1", "m1", "bad1", "r1"} or not letters:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for r in records:
                    if r.topic.endswith("dead-letter"):
                        letters.append(r)
                        continue
                    is_json = dict(r.headers).get("content-type") == b"application/json"
                    event = json.loads(r.value) if is_json else msgspec.msgpack.decode(r.value)
                    events.setdefault(r.key.decode(), []).append((is_json, event))
                    topics_of.setdefault(r.key.decode(), set()).add(r.topic.removeprefix(prefix))
                    if event["finish_reason"] is not None:
                        done.add(r.key.decode())
        await consumer.stop()
        return events, letters, topics_of

    events, letters, topics_of = run_with_pipeline(bootstrap_servers, body)
    assert topics_of == {"j1": {"tokens"}, "m1": {"tokens"}, "bad1": {"tokens"}, "r1": {"my-replies"}}
    assert "".join(e["text"] for _, e in events["r1"]) == expected.text
    for key, is_json in (("j1", True), ("m1", False)):
        assert all(j == is_json for j, _ in events[key]), key
        assert "".join(e["text"] for _, e in events[key]) == expected.text
        assert [t for _, e in events[key] for t in e["token_ids"]] == expected.token_ids
    ((is_json, error),) = events["bad1"]
    assert is_json and error["finish_reason"] == "error" and "invalid request" in error["error"]
    assert [r.value for r in letters] == [b"{not json"]


def _readme_kcat_lines() -> list[str]:
    """The README's kcat block, line by line (a line ending in `|` goes on on the next)."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", readme, re.S)
    (block,) = [b for b in blocks if "kcat -P" in b]
    return [line for line in block.replace("|\n", "| ").splitlines() if line.strip()]


def test_the_readmes_kcat_commands_stream_a_json_request(bootstrap_servers):
    """kcat (librdkafka, not Python) runs the README's lines as written, topic names aside: the
    request it produces is answered with JSON events carrying the in-process engine's text."""
    import json

    assert shutil.which("kcat"), "kcat is missing: `make test` installs Debian's kcat where it can"
    export, produce, consume = _readme_kcat_lines()
    assert export.startswith("export KAFKA_BOOTSTRAP_SERVERS=")
    expected = (
        LLM(STORIES, dtype="float32", **ENGINE)
        .generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32))[0]
        .outputs[0]
    )
    venv = str(pathlib.Path(sys.executable).parent.parent)

    async def shell(line: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", f"set -eo pipefail; source scripts/kcat-env.sh; {line}", cwd=ROOT,
            env={**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers, "VENV": venv},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, (line, err.decode())
        return out.decode()

    async def body(pipeline, prefix):
        await shell(produce.replace("-t parkade.", f"-t {prefix}"))
        for _ in range(120):  # the consume line exits at the end of what is written so far
            events = [json.loads(line.split(" ", 1)[1]) for line in (await shell(
                consume.replace("-t parkade.", f"-t {prefix}"))).splitlines()]  # fmt: skip
            if events and events[-1]["finish_reason"] is not None:
                return events
            await asyncio.sleep(0.5)
        raise AssertionError("the README's kcat request was never finished")

    events = run_with_pipeline(bootstrap_servers, body)
    assert "".join(e["text"] for e in events) == expected.text
    assert [t for e in events for t in e["token_ids"]] == expected.token_ids
    assert events[-1]["finish_reason"] == "length"
    assert events[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 32, "cached_tokens": 0}


def test_parallel_samples_prompt_logprobs_and_cache_salts_through_kafka(bootstrap_servers):
    """n > 1 streams each sample under its `sample_index`, equal to the in-process engine's; the
    samples share the prompt's blocks; prompt logprobs come once; salts isolate the cache."""
    prompt = "Once upon a time, there was a little girl named Lily. She liked to play"
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, prompt_logprobs=1, ignore_eos=True)
    expected = LLM(STORIES, dtype="float32", **ENGINE).generate([prompt], params, use_tqdm=False)[0]
    greedy = SamplingParams(temperature=0, max_tokens=4)

    async def body(pipeline, prefix):
        async with Client(bootstrap_servers, prefix) as client:
            events = [e async for e in client.generate(prompt=prompt, sampling_params=params)]
            salted = []
            for salt in ("a", "a", "b", None):
                request = [
                    e async for e in client.generate(prompt=prompt, sampling_params=greedy, cache_salt=salt)
                ]
                salted.append(request[-1].usage.cached_tokens)
            request_id = await client.submit(
                prompt=prompt, sampling_params=SamplingParams(n=2, max_tokens=300, ignore_eos=True)
            )
            aborted = []
            async for event in client.stream(request_id):
                aborted.append(event)
                if len(aborted) == 6:
                    await client.cancel(request_id)
            final_only = SamplingParams(output_kind=2)
            refused = [e async for e in client.generate(prompt=prompt, sampling_params=final_only)]
            await wait_idle(pipeline)
            kv = pipeline.scheduler.scheduler.kv
            assert kv.num_free_blocks == kv.num_blocks
            pipeline.scheduler.scheduler.check_integrity()
            return events, salted, aborted, refused

    events, salted, aborted, refused = run_with_pipeline(bootstrap_servers, body)
    for sample in expected.outputs:
        mine = [e for e in events if e.sample_index == sample.index]
        assert [t for e in mine for t in e.token_ids] == sample.token_ids
        assert "".join(e.text for e in mine) == sample.text
        assert sum(1 for e in mine if e.finish_reason is not None) == 1
    with_prompt_logprobs = [e for e in events if e.prompt_logprobs is not None]
    assert len(with_prompt_logprobs) == 1 and with_prompt_logprobs[0].sample_index == 0
    entries = with_prompt_logprobs[0].prompt_logprobs
    assert [e.token_ids[0] for e in entries] == expected.prompt_token_ids[1:]
    for entry, reference in zip(entries, expected.prompt_logprobs[1:], strict=True):
        assert abs(entry.logprobs[0] - reference[entry.token_ids[0]].logprob) < 1e-4
    usage = [e.usage for e in events if e.usage is not None]
    assert len(usage) == 1 and events[-1].usage is not None
    assert usage[0].completion_tokens == 36 and usage[0].prompt_tokens == len(expected.prompt_token_ids)
    block = ENGINE["block_size"]
    assert salted[0] == 0 and salted[1] == (len(expected.prompt_token_ids) - 1) // block * block
    assert salted[2] == 0  # another salt: no hit, though the prompt is cached
    assert salted[3] > 0  # unsalted: the first request's blocks
    assert {e.finish_reason for e in aborted if e.finish_reason} == {"abort"}
    assert len({e.sample_index for e in aborted if e.finish_reason}) == 2
    assert refused[-1].finish_reason == "error" and "FINAL_ONLY" in refused[-1].error
