"""The README's Python examples, taken from README.md as written and run as scripts against the
three services and the gateway on a broker of this module's own (the OpenAI one with the
gateway's URL for the default 127.0.0.1:8000; nothing else changed).

The plain-aiokafka example ("From any Kafka client") runs twice in a row, as a user would run it:
each run must print the in-process engine's text and exit 0 (a fixed request id would be refused
the second time). A third run, with its prompt too long for the model, must print the error
event's message and exit non-zero. The `Client`, `LLM` and OpenAI examples must print a story.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import subprocess
import sys

import pytest
from hf_reference import STORIES
from pipeline import running_pipeline
from stack import TANSU_NOT_LEADER
from test_gateway import running_gateway

from parkade import LLM, SamplingParams
from parkade.schemas import topics
from parkade.services.bus.kafka import KafkaBus
from parkade.services.gateway.handler import GatewayHandler, GatewayOptions

pytestmark = [pytest.mark.e2e, TANSU_NOT_LEADER]

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENGINE = dict(max_model_len=256, block_size=16)
PROMPT = '"prompt": "Once upon a time"'
RUN_TIMEOUT_S = 120


def readme_example(marker: str) -> str:
    """The README's one Python block that has `marker`."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


def readme_aiokafka_example() -> str:
    return readme_example("from aiokafka import")


def test_the_readmes_python_examples_run_as_written(module_broker, tmp_path):
    script = readme_aiokafka_example()
    assert "parkade import" not in script and "import parkade" not in script, "no Parkade import"
    assert 'os.environ["KAFKA_BOOTSTRAP_SERVERS"]' in script
    assert script.count(PROMPT) == 1
    expected = (
        LLM(STORIES, dtype="float32", **ENGINE)
        .generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
        .outputs[0]
    )
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": module_broker}
    env.pop("PARKADE_HOME", None)

    async def run(source: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", source, cwd=tmp_path, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError(f"the README's example did not end in {RUN_TIMEOUT_S}s") from None
        return proc.returncode, out.decode(), err.decode()

    async def main():
        # The example's own topic names (the default prefix), on this module's broker.
        bus = KafkaBus(module_broker, client_id="e2e-readme")
        await bus.create_topics([topics.topic_name(t, topics.DEFAULT_PREFIX) for t in topics.ALL_TOPICS])
        options = GatewayOptions(model=STORIES, http_port=0)
        try:
            async with running_pipeline(bus, STORIES, prefix=topics.DEFAULT_PREFIX, **ENGINE):
                first = await run(script)
                second = await run(script)
                refused = await run(script.replace(PROMPT, f"{PROMPT} * 200"))  # over the context
                others = {"client": await run(readme_example("from parkade.client import Client"))}
                others["llm"] = await run(readme_example("llm = LLM(max_num_seqs=64)"))
                handler = GatewayHandler.from_options(options)
                async with running_gateway(module_broker, topics.DEFAULT_PREFIX, handler, options) as url:
                    example = readme_example("from openai import OpenAI")
                    others["openai"] = await run(example.replace("http://127.0.0.1:8000/v1", url))
                return first, second, refused, others
        finally:
            await bus.close()

    first, second, refused, others = asyncio.run(main())
    for name, (code, out, err) in others.items():
        assert code == 0 and len(out.split()) >= 5, (name, out, err)  # (a story, sampled)
    for code, out, err in (first, second):
        assert code == 0, err
        text, _, summary = out.rpartition("\n[")
        assert text == expected.text, out
        assert summary.startswith("finish_reason=length, usage="), out
    code, out, err = refused
    assert code != 0 and out == "", (out, err)
    kind, _, message = err.partition(": ")
    assert kind == "error (invalid_request)" and message.strip(), err  # the event's own message
