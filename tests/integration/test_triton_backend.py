"""The whole model on the Triton kernels (interpreted on a CPU) equals transformers greedily."""

from __future__ import annotations

import pytest
import torch
from hf_reference import STORIES, hf_greedy

from parkade import LLM, SamplingParams
from parkade.engine.args import EngineArgs
from parkade.engine.engine import Engine

pytest.importorskip("triton")


def test_llm_on_triton_matches_transformers_with_preemption_and_a_prefix_hit():
    engine = Engine(
        EngineArgs(
            model=STORIES,
            dtype="float32",
            attention_backend="triton",
            block_size=8,
            kv_cache_memory_bytes=14 * 8 * 1280,  # 14 blocks of 8 tokens: preemption is certain
            max_num_batched_tokens=64,
        )
    )
    assert engine.core.executor.attention_backend.__name__ == "parkade.kernels.attention_triton"
    tok = engine.tokenizer
    story = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play outside")
    prompts = [
        story,
        tok.encode("Tom had a big red ball"),
        story + tok.encode(" in the park", add_special_tokens=False),
    ]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    done: dict[str, list[int]] = {}
    step = 0
    while len(done) < len(prompts):
        if step < 2:  # the third prompt arrives once the first one's blocks are cached
            engine.add_request(str(step), {"prompt_token_ids": prompts[step]}, greedy)
        elif step == 6:
            engine.add_request("2", {"prompt_token_ids": prompts[2]}, greedy)
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
        step += 1
    scheduler = engine.core.scheduler
    assert scheduler.num_preemptions > 0
    assert scheduler.kv.num_prefix_hits > 0
    assert [done[str(i)] for i in range(3)] == hf_greedy(STORIES, prompts, 24)


def test_auto_backend_is_the_cpu_kernel_on_a_cpu_and_unknown_names_fail():
    if torch.cuda.is_available():
        pytest.skip("auto picks Triton on CUDA")
    llm = LLM(STORIES, max_model_len=64)
    assert llm.engine.core.executor.attention_backend.__name__ == "parkade.kernels.attention_cpu"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        LLM(STORIES, attention_backend="flash")
