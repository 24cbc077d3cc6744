"""The OpenAI HTTP gateway on the real broker, driven by the official `openai` package (sync and
async) and by raw HTTP where the SDK hides what is checked (status codes, a disconnect).

The three services and the gateway run as tasks of this test's process (real KafkaBus, real
topics, a real HTTP server on a free port), so a test can look at the scheduler's block pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from hf_reference import STORIES
from pipeline import running_pipeline, wait_idle
from stack import TANSU_NOT_LEADER

from parkade import LLM, SamplingParams
from parkade.schemas import topics
from parkade.services.bus.kafka import KafkaBus
from parkade.services.gateway.handler import GatewayHandler, GatewayOptions
from parkade.services.gateway.main import serve
from parkade.services.scheduler.config import SchedulingOptions

pytestmark = [pytest.mark.e2e, TANSU_NOT_LEADER]

ENGINE = dict(max_model_len=256, block_size=16)
MODEL = "stories260K"
PROMPTS = ["Once upon a time", "Lily and Tom", "The big dog", "One day, a girl", "Tim had a ball", "Mom said"]


# The layouts a test runs in: the tokenizer apart from the gateway, or beside it (`parkade gateway
# --with-tokenizer`, `parkade up`'s: the gateway's requests and events in memory).
LAYOUTS = pytest.mark.parametrize("beside", [False, True], ids=["apart", "beside"])


def run_with_gateway(
    bootstrap: str,
    body,
    *,
    api_key: str | None = None,
    max_body_bytes: int = 100_000,
    beside: bool = False,
    **kw,
):
    """asyncio.run(body(pipeline, base_url)): the services and a gateway on fresh topics
    (`beside`: the tokenizer served by the gateway, in its memory)."""
    prefix = f"g{uuid.uuid4().hex[:8]}."

    async def main():
        bus = KafkaBus(bootstrap, client_id="e2e-services")
        await bus.create_topics([topics.topic_name(t, prefix) for t in topics.ALL_TOPICS])
        options = GatewayOptions(model=STORIES, http_port=0, max_body_bytes=100_000)
        engine = {**ENGINE, **kw, "serve_tokenizer": not beside}
        try:
            async with running_pipeline(bus, STORIES, prefix=prefix, **engine) as pipeline:
                pipeline.prefix = prefix  # for a test that reads the topics
                pipeline.gateway = GatewayHandler.from_options(options)  # for one that looks inside
                tokenizer = ("tokenizer", pipeline.tokenizer) if beside else None
                async with running_gateway(
                    bootstrap, prefix, pipeline.gateway, options, api_key, beside=tokenizer
                ) as url:
                    return await asyncio.wait_for(body(pipeline, url), 300)
        finally:
            await bus.close()

    return asyncio.run(main())


@contextlib.asynccontextmanager
async def running_gateway(
    bootstrap: str,
    prefix: str,
    handler: GatewayHandler,
    options: GatewayOptions,
    api_key: str | None = None,
    beside=None,
) -> AsyncIterator[str]:
    """The gateway serving `handler` as a task of this process, until the block ends; -> its URL."""
    stop, url = asyncio.Event(), asyncio.get_running_loop().create_future()
    gateway = asyncio.create_task(
        serve(
            bootstrap,
            prefix,
            handler,
            options,
            api_key=api_key,
            stop=stop,
            broker_wait_s=10,
            ready=url.set_result,
            beside=beside,
        )
    )
    await asyncio.wait({gateway, url}, return_when=asyncio.FIRST_COMPLETED)
    try:
        yield await url
    finally:
        stop.set()
        await gateway


async def read_topic(bootstrap: str, topic: str, kind: str) -> list:
    """The decoded records of `topic` on the broker, in order (`kind`: what it carries, unprefixed)."""
    from aiokafka import AIOKafkaConsumer

    decoder = topics.TopicDecoder(kind)
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    try:
        records = [r for batch in (await consumer.getmany(timeout_ms=2000)).values() for r in batch]
    finally:
        await consumer.stop()
    return [decoder.decode(r.value, dict(r.headers).get(topics.CONTENT_TYPE)) for r in records]


async def final_events(bootstrap: str, topic: str) -> list:
    """The scheduler's final GeneratedTokens on `topic` (the generated topic), in order."""
    events = []
    for message in await read_topic(bootstrap, topic, topics.GENERATED):
        events += getattr(message, "events", None) or [message]
    return [e for e in events if getattr(e, "finish_reason", None) is not None]


async def requests_on_the_broker(bootstrap: str, topic: str) -> list:
    """The GenerateRequests and AbortRequests on `topic` (the requests topic) of the broker."""
    from parkade.schemas import AbortRequest, GenerateRequest

    messages = await read_topic(bootstrap, topic, topics.REQUESTS)
    return [m for m in messages if isinstance(m, GenerateRequest | AbortRequest)]


def expected_outputs(prompts, params):
    return [o.outputs[0] for o in LLM(STORIES, dtype="float32", **ENGINE).generate(prompts, params)]


@LAYOUTS
def test_the_openai_package_gets_the_in_process_engines_text_streaming_or_not(module_broker, beside):
    greedy = expected_outputs(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=24, logprobs=2))
    stopped = expected_outputs(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=24, stop=["Lily"]))[0]

    async def body(pipeline, url):
        sync = openai.OpenAI(base_url=url, api_key="unused")
        client = openai.AsyncOpenAI(base_url=url, api_key="unused")
        out = {}
        # Sync, not streaming, two prompts in one request, with logprobs.
        out["batch"] = await asyncio.to_thread(
            sync.completions.create, model=MODEL, prompt=PROMPTS[:2], max_tokens=24, temperature=0, logprobs=2
        )
        # Async chat, streaming, with usage; the shipped model's template continues the message.
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_completion_tokens=24,
            temperature=0, stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        out["chat_chunks"] = [chunk async for chunk in stream]
        out["chat"] = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=24, temperature=0,
            stop=["Lily"], logprobs=True, top_logprobs=2,
        )  # fmt: skip
        seeded = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=1.0, seed=7)
        out["seeded"] = [(await client.completions.create(**seeded)).choices[0].text for _ in range(2)]
        out["other_seed"] = (await client.completions.create(**{**seeded, "seed": 8})).choices[0].text
        # The same long prompt again: its full blocks come from the prefix cache.
        long_prompt = " ".join(PROMPTS * 3)
        for _ in range(2):
            out["cached"] = await client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2)
        stream = await client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True
        )
        out["completion_chunks"] = [chunk async for chunk in stream]
        out["models"] = await client.models.list()
        await client.close()
        return out

    out = run_with_gateway(module_broker, body, beside=beside)
    batch = out["batch"]
    assert [c.text for c in batch.choices] == [g.text for g in greedy]
    assert [c.index for c in batch.choices] == [0, 1]
    for choice, expected in zip(batch.choices, greedy, strict=True):
        assert choice.finish_reason == "length"
        assert choice.logprobs.token_logprobs == pytest.approx([lp[t].logprob for lp, t in zip(
            expected.logprobs, expected.token_ids, strict=True)], abs=1e-4)  # fmt: skip
        assert len(choice.logprobs.top_logprobs[0]) == 2
        assert "".join(choice.logprobs.tokens) == choice.text
    assert batch.usage.completion_tokens == 48 and batch.usage.total_tokens == batch.usage.prompt_tokens + 48

    chunks = out["chat_chunks"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == greedy[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24

    chat = out["chat"].choices[0]
    assert chat.message.content == stopped.text and chat.finish_reason == "stop"
    assert "".join(t.token for t in chat.logprobs.content).startswith(stopped.text)
    assert all(len(t.top_logprobs) == 2 for t in chat.logprobs.content)

    first, again = out["seeded"]
    assert first == again and first != out["other_seed"]
    assert out["cached"].usage.prompt_tokens_details.cached_tokens >= 16
    assert "".join(c.choices[0].text for c in out["completion_chunks"]) == greedy[0].text
    assert [m.id for m in out["models"].data] == [MODEL]


def test_errors_are_answered_as_openai_clients_expect(module_broker):
    async def body(pipeline, url):
        seen = {}
        client = openai.AsyncOpenAI(base_url=url, api_key="secret", max_retries=0)
        cases = {
            "temperature": dict(prompt="Hi", temperature=-1),
            "max_tokens": dict(prompt="Hi", max_tokens="many"),
            "n": dict(prompt="Hi", n=129),
            "prompt": dict(prompt="Once " * 600),  # longer than the model's 512 positions
        }
        for name, kwargs in cases.items():
            with pytest.raises(openai.BadRequestError) as error:
                await client.completions.create(model=MODEL, **kwargs)
            seen[name] = error.value.body
        with pytest.raises(openai.NotFoundError) as error:
            await client.completions.create(model="gpt-4", prompt="Hi")
        seen["model"] = error.value.body
        unauthorized = openai.AsyncOpenAI(base_url=url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await unauthorized.models.list()
        async with httpx.AsyncClient() as http:
            root = url.removesuffix("/v1")
            headers = {"Authorization": "Bearer secret"}
            large = await http.post(f"{url}/completions", content=b"x" * 200_000, headers=headers)

            async def chunked():  # no Content-Length: counted as it arrives
                for _ in range(20):
                    yield b"x" * 10_000

            large_chunked = await http.post(f"{url}/completions", content=chunked(), headers=headers)
            no_key = await http.post(f"{url}/completions", json={"prompt": "Hi"})
            open_paths = [(await http.get(f"{root}/{p}")).status_code for p in ("health", "metrics")]
            metrics = (await http.get(f"{root}/metrics")).text
            health = (await http.get(f"{root}/health")).json()
        await client.close()
        await unauthorized.close()
        return seen, (large, large_chunked), no_key, open_paths, metrics, health

    seen, large, no_key, open_paths, metrics, health = run_with_gateway(module_broker, body, api_key="secret")
    assert all(body["param"] == name for name, body in seen.items()) and len(seen) == 5
    assert seen["prompt"]["message"] == (
        "This model's maximum context length is 512 tokens. However, your request has 602 input tokens. "
        "Please reduce the length of the input messages."
    )
    assert seen["prompt"]["type"] == "BadRequestError" and seen["prompt"]["code"] == 400
    assert [r.status_code for r in large] == [413, 413]
    assert large[0].json()["error"]["type"] == "invalid_request_error"
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    # /health and /metrics need no key; the in-process services send no heartbeats, so the
    # gateway reports them missing (a `parkade up` stack is healthy: test_up.py).
    assert open_paths == [503, 200]
    assert health["broker"] and health["services_missing"] == ["tokenizer", "scheduler", "executor"]
    assert 'parkade:gateway_requests_total{endpoint="/v1/completions",status="400"} 4.0' in metrics


def test_an_overloaded_pipeline_answers_429_and_serves_the_rest(module_broker):
    async def body(pipeline, url):
        async with httpx.AsyncClient(timeout=120) as http:

            async def one(i):
                request = {"prompt": f"{PROMPTS[i % 6]} {i}", "max_tokens": 16, "ignore_eos": True}
                return await http.post(f"{url}/completions", json=request)

            return await asyncio.gather(*(one(i) for i in range(24)))

    options = SchedulingOptions(max_num_seqs=2, max_waiting_requests=2)
    answers = run_with_gateway(module_broker, body, options=options)
    codes = [a.status_code for a in answers]
    # All arrive before a step: two wait (the bound), the rest are refused at once.
    assert set(codes) == {200, 429} and codes.count(200) >= 2, codes
    refused = next(a for a in answers if a.status_code == 429).json()["error"]
    assert refused["type"] == "rate_limit_error" and refused["message"].startswith("overloaded")
    assert all(a.json()["usage"]["completion_tokens"] == 16 for a in answers if a.status_code == 200)


@LAYOUTS
def test_a_client_that_disconnects_mid_stream_aborts_its_request(module_broker, beside):
    async def body(pipeline, url):
        request = {"prompt": PROMPTS[0], "max_tokens": 500, "ignore_eos": True, "stream": True}
        async with (
            httpx.AsyncClient(timeout=60) as http,
            http.stream("POST", f"{url}/completions", json=request) as response,
        ):
            assert response.status_code == 200
            lines = response.aiter_lines()
            while not (await anext(lines)).startswith("data: {"):
                pass
            kv = pipeline.scheduler.scheduler.kv
            held = kv.num_blocks - kv.num_free_blocks
        # Leaving the block closed the connection after the first chunk.
        await wait_idle(pipeline)
        streamed = kv.num_blocks - kv.num_free_blocks, len(pipeline.scheduler.live.finished)
        # Not streaming: the client gives up waiting for the whole answer.
        async with httpx.AsyncClient(timeout=0.3) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(f"{url}/completions", json={**request, "stream": False, "max_tokens": 500})
        await wait_idle(pipeline)
        after = kv.num_blocks - kv.num_free_blocks, len(pipeline.scheduler.live.finished)
        return held, streamed, after, await final_events(module_broker, f"{pipeline.prefix}generated")

    held, streamed, after, finals = run_with_gateway(module_broker, body, max_model_len=512, beside=beside)
    assert held > 0 and streamed == (0, 1) and after == (0, 2)  # blocks freed, both requests ended
    # ... by an abort, long before their 500 tokens.
    assert [(e.finish_reason, e.index < 400) for e in finals] == [("abort", True), ("abort", True)]


@LAYOUTS
def test_64_concurrent_streaming_clients_each_get_their_whole_stream_in_order(module_broker, beside):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]}{' and' * (i // len(PROMPTS))}" for i in range(64)]
    expected = expected_outputs(prompts, SamplingParams(temperature=0, max_tokens=16))

    async def body(pipeline, url):
        client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)

        async def one(prompt):
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True
            )
            return [chunk async for chunk in stream]

        results = await asyncio.gather(*(one(p) for p in prompts))
        await client.close()
        await wait_idle(pipeline)
        kv = pipeline.scheduler.scheduler.kv
        on_broker = await requests_on_the_broker(module_broker, f"{pipeline.prefix}requests")
        return results, kv.num_free_blocks == kv.num_blocks, len(on_broker)

    results, all_free, on_broker = run_with_gateway(module_broker, body, beside=beside)
    # Beside its tokenizer, the gateway's requests never reach the broker (they stay in memory).
    assert on_broker == (0 if beside else 64)
    for chunks, want in zip(results, expected, strict=True):
        assert "".join(c.choices[0].text for c in chunks) == want.text
        reasons = [c.choices[0].finish_reason for c in chunks]
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert all_free


def test_sse_events_end_with_a_blank_line_so_a_plain_split_reads_every_stream(module_broker):
    """OpenAI and vLLM end each event with "\\n\\n": a client that reads large chunks and splits
    them on a blank line the simple way gets every event of every stream, even when several
    arrive in one read."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]}{' and' * (i // len(PROMPTS))}" for i in range(24)]

    async def body(pipeline, url):
        async def one(http, prompt):
            payload = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}
            raw = b""
            async with http.stream("POST", f"{url}/completions", json=payload) as response:
                assert response.status_code == 200
                async for chunk in response.aiter_raw(1 << 16):
                    raw += chunk
            return raw

        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*(one(http, p) for p in prompts))

    for raw in run_with_gateway(module_broker, body):
        assert b"\r" not in raw
        events = [e for e in raw.split(b"\n\n") if e]
        assert all(e.startswith(b"data: ") and b"\n" not in e for e in events), events
        assert events[-1] == b"data: [DONE]"
        chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert sum(1 for c in chunks if c["choices"][0]["text"]) >= 1 and text


def test_max_tokens_past_the_context_and_empty_prompts_are_answered_400(module_broker):
    async def body(pipeline, url):
        async with httpx.AsyncClient(timeout=60) as http:
            answers = {}
            for name, payload in {
                "max_tokens": {"prompt": "Once upon a time", "max_tokens": 100_000},
                "empty": {"prompt": ""},
                "missing": {"max_tokens": 4},
            }.items():
                answers[name] = await http.post(f"{url}/completions", json=payload)
            return answers

    answers = run_with_gateway(module_broker, body)
    assert {name: a.status_code for name, a in answers.items()} == {
        "max_tokens": 400,
        "empty": 400,
        "missing": 400,
    }
    assert answers["max_tokens"].json() == {
        "error": {
            "message": "'max_tokens' is too large: 100000. This model's maximum context length is 512 tokens "
            "and your request has 5 input tokens (100000 > 512 - 5).",
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }
    }
    assert answers["empty"].json()["error"]["message"] == "The prompt cannot be empty."
    assert answers["missing"].json()["error"]["message"] == "prompt is required"


def test_n_samples_salts_and_chat_options_over_http(module_broker):
    """`n` gives n choices per prompt (OpenAI's order), equal to the in-process engine's samples;
    usage counts each prompt once; vLLM's cache_salt and chat options pass through."""
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    expected = LLM(STORIES, dtype="float32", **ENGINE).generate(PROMPTS[:2], params, use_tqdm=False)

    async def body(pipeline, base_url):
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none")
        completion = await client.completions.create(
            model=MODEL, prompt=PROMPTS[:2], n=2, temperature=1.0, seed=11, max_tokens=8,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        streamed: dict[int, str] = {}
        stream = await client.completions.create(
            model=MODEL, prompt=PROMPTS[:2], n=2, temperature=1.0, seed=11, max_tokens=8, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            for choice in chunk.choices:
                streamed[choice.index] = streamed.get(choice.index, "") + choice.text
        salted = []
        for salt in ("x", "x", "y"):
            answer = await client.completions.create(
                model=MODEL, prompt=PROMPTS[0] * 3, max_tokens=2, temperature=0,
                extra_body={"cache_salt": salt},
            )  # fmt: skip
            salted.append(answer.usage.prompt_tokens_details.cached_tokens)
        chat = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tom"}, {"role": "assistant", "content": "Tom had a"}],
            max_tokens=4, temperature=0,
            extra_body={"add_generation_prompt": False, "continue_final_message": True},
        )  # fmt: skip
        await wait_idle(pipeline)
        return completion, streamed, salted, chat

    completion, streamed, salted, chat = run_with_gateway(module_broker, body)
    texts = [c.text for o in expected for c in o.outputs]
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert [c.text for c in completion.choices] == texts
    assert [streamed[i] for i in range(4)] == texts
    prompt_tokens = sum(len(o.prompt_token_ids) for o in expected)
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (prompt_tokens, 32)
    assert salted[0] == 0 and salted[1] > 0 and salted[2] == 0
    assert chat.choices[0].message.content


class _CountingTokenizer:
    """A tokenizer that counts the calls that turn text into tokens (decoding is not counted)."""

    TOKENIZING = ("encode", "encode_plus", "batch_encode_plus", "tokenize", "apply_chat_template")

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        value = getattr(self.tokenizer, name)
        if name not in self.TOKENIZING:
            return value

        def counted(*args, **kwargs):
            self.calls += 1
            return value(*args, **kwargs)

        return counted


def test_a_prompt_through_the_gateway_is_tokenized_once(module_broker):
    """The gateway tokenizes (and checks) each prompt, a chat rendered first, and the bad words:
    they travel as token ids, and the tokenizer service tokenizes nothing. The text is the
    in-process engine's all the same."""
    params = SamplingParams(temperature=0, max_tokens=12, bad_words=["little"])
    llm = LLM(STORIES, dtype="float32", **ENGINE)
    expected = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    (expected_chat,) = llm.chat(
        [{"role": "user", "content": "Tom"}], SamplingParams(temperature=0, max_tokens=4)
    )

    async def body(pipeline, base_url):
        gateway = pipeline.gateway.tokenizer = _CountingTokenizer(pipeline.gateway.tokenizer)
        frontend = pipeline.tokenizer.frontend
        service = frontend.tokenizer = _CountingTokenizer(frontend.tokenizer)
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none")
        counts, texts = [], []
        for prompt in PROMPTS[:2]:
            before = gateway.calls
            completion = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"bad_words": ["little"]}
            )
            counts.append(gateway.calls - before)
            texts.append(completion.choices[0].text)
        before = gateway.calls
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tom"}], max_tokens=4, temperature=0
        )
        counts.append(gateway.calls - before)
        await wait_idle(pipeline)
        return counts, service.calls, texts, chat

    counts, service_calls, texts, chat = run_with_gateway(module_broker, body)
    # One call for the prompt and two for the bad word (alone and after a space); a chat's
    # template rendered, then its text encoded. The tokenizer service: none at all.
    assert counts == [3, 3, 2] and service_calls == 0
    assert texts == [o.outputs[0].text for o in expected]
    assert chat.choices[0].message.content == expected_chat.outputs[0].text
    assert chat.usage.prompt_tokens == len(expected_chat.prompt_token_ids)
