"""vLLM scripts with only the import changed: chat, parallel sampling on shared blocks, cache
salts, prompt logprobs and the remaining SamplingParams fields (issue 13)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from hf_reference import STORIES
from transformers import AutoModelForCausalLM

from parkade import LLM, AsyncLLM, SamplingParams
from parkade.sampling_params import RequestOutputKind
from parkade.services.scheduler.kv_cache_manager import cdiv

CONVERSATION = [
    {"role": "system", "content": "A short story."},
    {"role": "user", "content": "Once upon a time, there was a little dog."},
]


@pytest.fixture(scope="module")
def llm():
    return LLM(model=STORIES, dtype="float32", max_model_len=256, block_size=8, seed=0)


def greedy(max_tokens=24, **more):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **more)


# ---- LLM.chat ---------------------------------------------------------------------------------
def test_chat_equals_generating_from_the_templated_prompt(llm):
    tokenizer = llm.get_tokenizer()
    outputs = llm.chat(CONVERSATION, greedy(), use_tqdm=False)
    ids = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in transformers 5
    expected = llm.generate({"prompt_token_ids": ids}, greedy(), use_tqdm=False)[0]
    assert outputs[0].prompt_token_ids == list(ids)
    assert outputs[0].outputs[0].text == expected.outputs[0].text and expected.outputs[0].text

    # A list of conversations: one output each, in order.
    other = [{"role": "user", "content": "Tom had a red ball."}]
    both = llm.chat([CONVERSATION, other], greedy(), use_tqdm=False)
    assert both[0].outputs[0].text == outputs[0].outputs[0].text
    alone = llm.chat(other, greedy(), use_tqdm=False)[0]
    assert both[1].outputs[0].text == alone.outputs[0].text


def test_chat_template_and_continue_final_message(llm):
    tokenizer = llm.get_tokenizer()
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    out = llm.chat(CONVERSATION, greedy(), chat_template=template, use_tqdm=False)[0]
    text = tokenizer.apply_chat_template(CONVERSATION, chat_template=template, tokenize=False)
    assert out.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)

    opened = [*CONVERSATION, {"role": "assistant", "content": "The dog liked to"}]
    continued = llm.chat(opened, greedy(), add_generation_prompt=False, continue_final_message=True)[0]
    rendered = tokenizer.decode(continued.prompt_token_ids)
    assert rendered.rstrip().endswith("The dog liked to")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(CONVERSATION, greedy(), continue_final_message=True)  # with add_generation_prompt
    with pytest.raises(ValueError, match="tools"):
        llm.chat(CONVERSATION, greedy(), tools=[{"type": "function"}])


# ---- n > 1 ------------------------------------------------------------------------------------
def test_n_greedy_samples_equal_one_greedy_sample(llm):
    one = llm.generate(["Lily went to"], greedy(), use_tqdm=False)[0].outputs[0]
    many = llm.generate(["Lily went to"], greedy(n=3), use_tqdm=False)[0]
    assert [c.index for c in many.outputs] == [0, 1, 2]
    assert all(c.token_ids == one.token_ids and c.text == one.text for c in many.outputs)


def test_n_seeded_samples_differ_and_are_reproducible_alone_or_batched(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    first = [c.token_ids for c in llm.generate(["The cat"], params, use_tqdm=False)[0].outputs]
    assert len({tuple(t) for t in first}) == 4  # the samples differ
    others = SamplingParams(temperature=0.8, max_tokens=15)
    batched = llm.generate(["Tom", "The cat", "A bird"], [others, params, others], use_tqdm=False)
    assert [c.token_ids for c in batched[1].outputs] == first
    # vLLM's rule: sample i is seeded with seed + i.
    third = SamplingParams(temperature=1.0, seed=9, max_tokens=20, ignore_eos=True)
    assert llm.generate(["The cat"], third, use_tqdm=False)[0].outputs[0].token_ids == first[2]


def peak_blocks(llm, prompts, params) -> int:
    """The most KV blocks in use at once while `prompts` run to completion."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"peak-{i}", prompt, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.core.scheduler.kv.pool.num_used_blocks)
    return peak


def test_n_samples_hold_the_prompt_blocks_once(llm):
    """n samples of a long prompt hold about one prompt's blocks plus each sample's own tail and
    output; n requests that cannot share (each its own cache salt) hold n prompts' blocks."""
    n, max_tokens, block_size = 4, 16, 8
    prompt = list(range(100, 303))  # 203 tokens: 25 full blocks and a tail of 3
    params = SamplingParams(n=n, temperature=1.0, seed=1, max_tokens=max_tokens, ignore_eos=True)
    shared = peak_blocks(llm, [{"prompt_token_ids": prompt}], params)
    full, tail = divmod(len(prompt), block_size)
    own = cdiv(tail + max_tokens, block_size)  # the tail is recomputed by each sample
    assert full + n * own - n <= shared <= full + n * own

    single = SamplingParams(temperature=1.0, seed=1, max_tokens=max_tokens, ignore_eos=True)
    salted = [{"prompt_token_ids": [*prompt[:-1], 5 + i], "cache_salt": f"s{i}"} for i in range(n)]
    independent = peak_blocks(llm, salted, single)
    assert independent >= n * (full + own) - n
    assert shared < independent / 2.5


# ---- cache_salt -------------------------------------------------------------------------------
def test_cache_salt_isolates_prefix_hits(llm):
    prompt = {"prompt_token_ids": list(range(50, 90))}  # 40 tokens: 4 full blocks are offered
    params = greedy(max_tokens=2)

    def cached(salt):
        return llm.generate({**prompt, "cache_salt": salt} if salt else prompt, params, use_tqdm=False)[
            0
        ].num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") == 32  # a hit within one salt (the last block is recomputed)
    assert cached("tenant-b") == 0  # never across salts
    assert cached(None) == 0  # nor between salted and unsalted
    assert cached(None) == 32
    assert cached("tenant-b") == 32


# ---- prompt logprobs ----------------------------------------------------------------------------
def test_prompt_logprobs_equal_transformers_log_softmax(llm):
    text = "Once upon a time, there was a little girl named Lily."
    out = llm.generate(
        [text, "Tom"], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False
    )[0]
    ids = out.prompt_token_ids
    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        assert math.isclose(entry[ids[p]].logprob, reference[p - 1, ids[p]].item(), abs_tol=1e-4)
        top = reference[p - 1].topk(3)
        for rank, (value, token) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
            assert math.isclose(entry[token].logprob, value, abs_tol=1e-4) and entry[token].rank == rank


def test_prompt_logprobs_survive_chunked_prefill_and_samples():
    llm = LLM(STORIES, dtype="float32", max_model_len=256, block_size=8, max_num_batched_tokens=16)
    ids = list(range(100, 160))  # four chunks
    whole = LLM(STORIES, dtype="float32", max_model_len=256, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0, n=2)
    chunked = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    reference = whole.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert len(chunked.prompt_logprobs) == len(ids)
    for a, b in zip(chunked.prompt_logprobs[1:], reference.prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(math.isclose(a[t].logprob, b[t].logprob, abs_tol=1e-4) for t in a)
    assert len(chunked.outputs) == 2


# ---- the other SamplingParams fields ------------------------------------------------------------
def test_clone_and_the_remaining_fields(llm):
    params = SamplingParams(temperature=0.5, logit_bias={3: 1.0}, stop=["x"])
    copy = params.clone()
    assert copy == params and copy.logit_bias is not params.logit_bias

    base = llm.generate(["Lily went to"], greedy(), use_tqdm=False)[0].outputs[0]
    banned = llm.get_tokenizer().decode([base.token_ids[1]]).strip()
    avoided = llm.generate(["Lily went to"], greedy(bad_words=[banned]), use_tqdm=False)[0].outputs[0]
    assert banned not in avoided.text.split()

    forced = llm.generate(["Lily went to"], greedy(max_tokens=4, logit_bias={300: 100.0}), use_tqdm=False)
    assert forced[0].outputs[0].token_ids == [300] * 4
    allowed = llm.generate(["Lily"], greedy(max_tokens=6, allowed_token_ids=[300, 301]), use_tqdm=False)
    assert set(allowed[0].outputs[0].token_ids) <= {300, 301}

    long_prompt = "Once upon a time, there was a little girl named Lily. She liked to play."
    cut = llm.generate([long_prompt], greedy(truncate_prompt_tokens=5), use_tqdm=False)[0]
    full = llm.generate([long_prompt], greedy(), use_tqdm=False)[0]
    assert cut.prompt_token_ids == full.prompt_token_ids[-5:]

    bare = llm.generate(["Lily went to"], greedy(detokenize=False), use_tqdm=False)[0].outputs[0]
    assert bare.text == "" and bare.token_ids == base.token_ids
    spaced = llm.generate(["Lily"], greedy(spaces_between_special_tokens=False), use_tqdm=False)[0]
    assert spaced.outputs[0].text

    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["Lily"], greedy(allowed_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 1000.0})
    with pytest.raises(TypeError, match="best_of"):
        SamplingParams(best_of=2)  # as vLLM V1: use n


# ---- AsyncLLM output kinds -----------------------------------------------------------------------
def test_async_output_kinds_with_samples():
    async def run():
        engine = AsyncLLM(STORIES, dtype="float32", max_model_len=256, block_size=8)
        try:
            seen = {}
            for kind in RequestOutputKind:
                params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=10, output_kind=kind)
                seen[kind] = [o async for o in engine.generate("The dog", params, request_id=kind.name)]
            return seen
        finally:
            await engine.shutdown()

    seen = asyncio.run(run())
    final = seen[RequestOutputKind.FINAL_ONLY]
    assert len(final) == 1 and final[0].finished and [c.index for c in final[0].outputs] == [0, 1]
    texts = [c.text for c in final[0].outputs]
    deltas = ["", ""]
    for output in seen[RequestOutputKind.DELTA]:
        (completion,) = output.outputs
        deltas[completion.index] += completion.text
    assert deltas == texts
    cumulative = {}
    for output in seen[RequestOutputKind.CUMULATIVE]:
        (completion,) = output.outputs
        cumulative[completion.index] = completion.text
    assert [cumulative[0], cumulative[1]] == texts
    assert seen[RequestOutputKind.CUMULATIVE][-1].finished


# ---- what a batch job and a server must survive (review of the change) -------------------------
def test_generate_waits_for_room_and_an_interrupted_call_leaves_nothing_behind():
    llm = LLM(STORIES, dtype="float32", max_model_len=256, block_size=8, max_waiting_requests=4)
    params = SamplingParams(n=2, temperature=0, max_tokens=4)
    outputs = llm.generate([f"Story {i}" for i in range(6)], params, use_tqdm=False)  # 12 samples
    assert [len(o.outputs) for o in outputs] == [2] * 6

    class Interrupt(Exception):
        pass

    def interrupting_bar(**kwargs):
        class Bar:
            def set_postfix_str(self, *a, **k):
                pass

            def update(self, n):
                raise Interrupt  # as a Ctrl-C after the first request finished

            def close(self):
                pass

        return Bar()

    with pytest.raises(Interrupt):
        llm.generate(
            ["Tom", "Lily went to", "The cat"], SamplingParams(max_tokens=40), use_tqdm=interrupting_bar
        )
    assert not llm.engine.has_unfinished_requests() and not llm.engine.output_processor.requests
    again = llm.generate(["Tom"], greedy(max_tokens=3), use_tqdm=False)
    assert len(again) == 1 and len(again[0].outputs[0].token_ids) == 3


def test_truncation_to_the_engines_max_model_len_and_chat_kwargs_that_collide():
    llm = LLM(STORIES, dtype="float32", max_model_len=64, block_size=8)
    prompt = {"prompt_token_ids": list(range(100, 322))}
    # -1: the engine's 64, not the model's 512; with 2 tokens more it cannot fit (as vLLM says).
    fits = "maximum context length is 64 tokens and your request has 64 input tokens"
    with pytest.raises(ValueError, match=fits):
        llm.generate(prompt, greedy(max_tokens=2, truncate_prompt_tokens=-1), use_tqdm=False)
    out = llm.generate(prompt, greedy(max_tokens=2, truncate_prompt_tokens=62), use_tqdm=False)[0]
    assert out.prompt_token_ids == list(range(260, 322)) and len(out.outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="chat_template_kwargs may not set add_generation_prompt"):
        llm.chat(CONVERSATION, greedy(), chat_template_kwargs={"add_generation_prompt": False})
    assert LLM(
        STORIES, dtype="float32", enable_prefix_caching=None, max_num_seqs=None
    ).engine.args.enable_prefix_caching


def test_aborting_a_request_with_samples_ends_each_sample_and_delta_sends_prompt_logprobs_once():
    async def run():
        engine = AsyncLLM(STORIES, dtype="float32", max_model_len=256, block_size=8)
        try:
            params = SamplingParams(n=3, max_tokens=200, ignore_eos=True)
            seen = []
            async for output in engine.generate("The dog", params, request_id="a"):
                seen.append(output)
                if len(seen) == 4:
                    await engine.abort("a")
            delta = SamplingParams(n=2, max_tokens=5, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA)
            deltas = [o async for o in engine.generate("The dog ran", delta, request_id="d")]
            return seen, deltas
        finally:
            await engine.shutdown()

    seen, deltas = asyncio.run(run())
    ended = {o.outputs[0].index for o in seen if o.outputs[0].finish_reason == "abort"}
    assert ended == {0, 1, 2} and seen[-1].finished
    assert sum(o.prompt_logprobs is not None for o in deltas) == 1
