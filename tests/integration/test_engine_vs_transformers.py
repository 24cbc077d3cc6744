"""Greedy outputs of the whole engine equal transformers' `generate(do_sample=False)` in fp32.

Every scenario that changes how the KV cache is filled is covered, because each is a place
where serving engines garble output: requests arriving at different steps, chunked prefill,
prefix-cache hits, and preemption by recompute in a KV pool that is too small.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hf_reference import STORIES, hf_greedy
from tiny_models import make_tiny_model
from transformers import AutoModelForCausalLM

from parkade import LLM, SamplingParams
from parkade.engine.args import EngineArgs
from parkade.engine.engine import Engine
from parkade.services.common.model_config import ModelConfig
from parkade.services.executor.kv_pool import bytes_per_block

MAX_NEW = 24
SHARED_PREFIX_LEN = 37


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """16 prompts of 1 to 120 tokens; six share a 37-token prefix (cache hits across blocks)."""
    rng = random.Random(seed)
    lengths = [1, 2, 3, 5, 8, 13, 16, 17, 21, 31, 40, 47, 55, 64, 77, 90]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    prefix = [rng.randrange(3, vocab) for _ in range(SHARED_PREFIX_LEN)]
    for i in (9, 10, 11, 12, 14, 15):
        prompts[i] = prefix + prompts[i][SHARED_PREFIX_LEN - 30 :]
    return prompts


@pytest.fixture(scope="module", params=["stories260K", "llama", "llama-tied", "qwen2", "mistral"])
def reference(request, tmp_path_factory):
    """(model_dir, prompts, transformers' greedy outputs) for one model."""
    if request.param == "stories260K":
        model_dir = STORIES
    else:
        family, _, variant = request.param.partition("-")
        overrides = {"tie_word_embeddings": True} if variant == "tied" else {}
        model_dir = make_tiny_model(tmp_path_factory.mktemp(request.param), family, **overrides)
    vocab = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
    prompts = make_prompts(vocab)
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_NEW)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def run(
    engine: Engine, prompts: list[list[int]], arrivals: list[int], priorities: list[int] | None = None
) -> list[list[int]]:
    """Add prompt i at step arrivals[i]; step until every request finished."""
    done: dict[str, list[int]] = {}
    step = 0
    while len(done) < len(prompts):
        for i, prompt in enumerate(prompts):
            if arrivals[i] == step:
                priority = priorities[i] if priorities else 0
                engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY, priority)
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0].token_ids
        engine.core.scheduler.check_integrity()
        step += 1
    assert engine.core.scheduler.kv.num_free_blocks == engine.core.scheduler.kv.num_blocks
    return [done[str(i)] for i in range(len(prompts))]


def engine_for(model_dir: Path, **kwargs) -> Engine:
    kwargs.setdefault("max_model_len", 256)
    return Engine(EngineArgs(model=model_dir, dtype="float32", **kwargs), skip_tokenizer_init=True)


SCENARIOS = {
    # name: (engine kwargs, arrival step of each prompt)
    "all_at_once": (dict(block_size=16), [0] * 16),
    "staggered_arrivals": (dict(block_size=8), [0, 0, 1, 2, 3, 3, 5, 8, 9, 12, 13, 14, 20, 21, 22, 30]),
    "chunked_prefill": (dict(block_size=4, max_num_batched_tokens=16), [0, 1, 2, 3] * 4),
    # 36 blocks of 4 = 144 slots: the longest request (120 + 24 tokens) alone.
    "tiny_pool_preemption": (dict(block_size=4, num_blocks=36, max_model_len=144), [0] * 16),
    # Priority preemption can pick a victim already scheduled in the same step.
    "tiny_pool_priority": (
        dict(block_size=4, num_blocks=36, max_model_len=144, scheduling_policy="priority"),
        [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7],
    ),
    "reserve_admission": (dict(admission="reserve"), [0] * 16),
}
PRIORITIES = [2, 0, 1, 2, 0, 1, 1, 0, 2, 2, 0, 1, 0, 1, 2, 0]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_greedy_tokens_equal_transformers(reference, scenario):
    model_dir, prompts, expected = reference
    kwargs, arrivals = SCENARIOS[scenario]
    kwargs = dict(kwargs)
    if "num_blocks" in kwargs:  # a pool of exactly that many blocks
        config = ModelConfig.from_pretrained(model_dir, "float32")
        block_bytes = bytes_per_block(config, kwargs["block_size"], torch.float32)
        kwargs["kv_cache_memory_bytes"] = kwargs.pop("num_blocks") * block_bytes
    engine = engine_for(model_dir, **kwargs)
    got = run(engine, prompts, arrivals, PRIORITIES if "priority" in scenario else None)
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}): {g} != {e}"
    scheduler = engine.core.scheduler
    if scenario.startswith("tiny_pool"):
        assert scheduler.num_preemptions > 0
    if scenario in ("all_at_once", "staggered_arrivals"):
        assert scheduler.kv.num_prefix_hits > 0, "prompts sharing a prefix must hit the cache"


def test_llm_generate_matches_transformers_on_stories260k():
    llm = LLM(STORIES, dtype="float32", max_model_len=256)
    tok = llm.get_tokenizer()
    texts = ["Once upon a time", "Lily and Tom went to the park", "The cat"]
    outputs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=40))
    expected = hf_greedy(STORIES, [tok.encode(t) for t in texts], 40)
    for output, exp, text in zip(outputs, expected, texts, strict=True):
        assert output.prompt == text and output.prompt_token_ids == tok.encode(text)
        assert output.outputs[0].token_ids == exp
        assert (
            output.outputs[0].text
            == tok.decode(tok.encode(text) + exp, skip_special_tokens=True)[len(text) :]
        )
    assert outputs[0].outputs[0].text.startswith(", there was a little girl named Lily")
