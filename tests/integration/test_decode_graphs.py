"""Decode steps from static graph buffers (`DecodeGraphs`) give the eager path's tokens.

There is no CUDA here: the dry run replays through `EagerGraph` (the captured function called again
over the same static buffers), on the Triton kernels interpreted, so the padding, the buffer copies
and the choice of graph size are what is tested. On a GPU the same test runs with real graphs.
"""

from __future__ import annotations

import pytest
from hf_reference import STORIES

from parkade.engine.args import EngineArgs
from parkade.engine.engine import Engine
from parkade.schemas import SamplingParams
from parkade.services.executor.cuda_graphs import capture_sizes

pytest.importorskip("triton")


def run(graphs: bool) -> tuple[dict[str, list[int]], int]:
    engine = Engine(
        EngineArgs(
            model=STORIES, dtype="float32", attention_backend="triton", block_size=8, max_model_len=96,
            kv_cache_memory_bytes=64 * 8 * 1280, enforce_eager=True,
        )
    )  # fmt: skip
    executor = engine.core.executor
    replays = 0
    if graphs:
        on_cuda = executor.device.type == "cuda"
        executor.capture_decode_graphs(96, max_size=4, eager_stand_in=not on_cuda)
        assert sorted(executor.graphs.graphs) == [1, 2, 4]
        real_run = executor.graphs.run

        def counting_run(inputs):
            nonlocal replays
            replays += 1
            return real_run(inputs)

        executor.graphs.run = counting_run
    prompts = ["Once upon a time", "Tom had a big red ball", "The sun"]
    done: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):  # different lengths: 3 decodes pad to the graph of 4
        params = SamplingParams(temperature=0, max_tokens=3 + 3 * i)
        engine.add_request(str(i), {"prompt_token_ids": engine.tokenizer.encode(prompt)}, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
    return done, replays


def test_capture_sizes_are_vllms():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16]
    assert capture_sizes(256)[-3:] == [240, 248, 256] and len(capture_sizes(256)) == 35


def test_decode_steps_from_graph_buffers_give_the_eager_tokens():
    eager, _ = run(graphs=False)
    graphed, replays = run(graphs=True)
    assert replays >= 7  # the decode steps (3, 2, then 1 request left) came from the graphs
    assert graphed == eager and len(graphed["2"]) == 9
