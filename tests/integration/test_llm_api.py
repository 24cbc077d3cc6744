"""The vLLM-shaped APIs on the trained stories260K model: sampling, stops, errors, streaming."""

from __future__ import annotations

import asyncio
import math
import re
import threading

import pytest
import torch
from hf_reference import STORIES
from transformers import AutoModelForCausalLM

from parkade import LLM, AsyncLLM, SamplingParams
from parkade.engine.core import EngineDeadError
from parkade.schemas import FinishReason


@pytest.fixture(scope="module")
def llm():
    return LLM(STORIES, dtype="float32", max_model_len=256, block_size=8, seed=0)


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=30, ignore_eos=True)
    alone = llm.generate(["Lily went to"], seeded)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=t, seed=None, max_tokens=n) for t, n in ((0.8, 12), (0, 40), (1.3, 5))
    ]
    batch = llm.generate(
        ["The dog", "Lily went to", "Once upon a time", "Tom had a"],
        [others[0], seeded, others[1], others[2]],
    )
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate(["Lily went to"], seeded)[0].outputs[0].token_ids
    assert again == alone
    different = llm.generate(
        ["Lily went to"], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=30)
    )
    assert different[0].outputs[0].token_ids != alone


def test_stop_string_ends_the_request_at_the_right_place(llm):
    params = SamplingParams(temperature=0, max_tokens=60, stop=["girl named"])
    out = llm.generate("Once upon a time", params)[0].outputs[0]
    assert out.text == ", there was a little "
    assert (out.finish_reason, out.stop_reason) == ("stop", "girl named")
    keep = SamplingParams(temperature=0, max_tokens=60, stop=["girl named"], include_stop_str_in_output=True)
    assert llm.generate("Once upon a time", keep)[0].outputs[0].text == ", there was a little girl named"
    assert not llm.engine.has_unfinished_requests()
    scheduler = llm.engine.core.scheduler
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_stop_token_ids_and_max_tokens(llm):
    tok = llm.get_tokenizer()
    full = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    stop_id = full.token_ids[5]
    out = llm.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id])
    )
    first = full.token_ids.index(stop_id)
    assert out[0].outputs[0].token_ids == full.token_ids[: first + 1]
    assert out[0].outputs[0].stop_reason == stop_id
    assert tok.decode(full.token_ids[:3])


def test_logprobs_are_the_models_raw_log_softmax(llm):
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=3, logprobs=2))[0]
    hf = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
    ids = torch.tensor([out.prompt_token_ids + out.outputs[0].token_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(ids).logits[0].float(), -1)
    completion = out.outputs[0]
    assert len(completion.logprobs) == 3
    total = 0.0
    for i, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        row = logprobs[len(out.prompt_token_ids) - 1 + i]
        assert entry[token_id].rank == 1  # greedy picks the most likely token
        assert math.isclose(entry[token_id].logprob, row[token_id].item(), abs_tol=1e-4)
        top2 = row.topk(2).indices.tolist()
        assert set(entry) == set(top2)
        total += entry[token_id].logprob
    assert math.isclose(completion.cumulative_logprob, total, abs_tol=1e-6)


def test_impossible_prompts_fail_at_once_and_nothing_runs(llm):
    tok = llm.get_tokenizer()
    long_prompt = {"prompt_token_ids": [5] * 257}
    with pytest.raises(
        ValueError, match=r"length is 256 tokens\. However, your request has 257 input tokens"
    ):
        llm.generate(["Once upon a time", long_prompt], SamplingParams(max_tokens=5))
    assert not llm.engine.has_unfinished_requests()
    four_blocks = dict(dtype="float32", block_size=8, kv_cache_memory_bytes=4 * 8 * 1280)
    small_pool = LLM(STORIES, **four_blocks)
    assert small_pool.engine.core.scheduler.kv.num_blocks == 4
    # Unset, max_model_len shrinks to what the pool holds; such a prompt is refused at once.
    with pytest.raises(ValueError, match="maximum context length is 32 tokens"):
        small_pool.generate({"prompt_token_ids": tok.encode("Once upon a time " * 10)})
    with pytest.raises(ValueError, match="more than the KV pool holds"):
        LLM(STORIES, max_model_len=64, **four_blocks)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(STORIES, max_model_len=1024)
    with pytest.raises(ValueError, match=r"prompt_token_ids must be in \[0, 512\)"):
        llm.generate({"prompt_token_ids": [1, 512]})


def test_max_tokens_past_the_context_and_empty_prompts_raise_as_in_vllm(llm):
    prompt = {"prompt_token_ids": [1] + [5] * 6}
    with pytest.raises(ValueError) as error:
        llm.generate([prompt, "Once upon a time"], SamplingParams(max_tokens=100_000))
    assert str(error.value) == (
        "'max_tokens' is too large: 100000. This model's maximum context length is 256 tokens and "
        "your request has 7 input tokens (100000 > 256 - 7)."
    )
    with pytest.raises(ValueError, match=r"^The prompt cannot be empty\.$"):
        llm.generate("", SamplingParams(max_tokens=5))
    assert not llm.engine.has_unfinished_requests()
    (output,) = llm.generate("Once", SamplingParams(max_tokens=3, ignore_eos=True))
    # vLLM's users see finish_reason='length', and comparing with the enum still works.
    assert "finish_reason='length'" in repr(output.outputs[0])
    assert output.outputs[0].finish_reason == FinishReason.LENGTH == "length"
    (rest,) = llm.generate({"prompt_token_ids": [1] + [5] * 250}, SamplingParams(max_tokens=None))
    assert len(rest.outputs[0].token_ids) <= 5  # unset: the rest of the context


def test_priority_argument_and_token_id_prompts(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("Once upon a time")
    a, b = llm.generate(
        [{"prompt_token_ids": ids}, "Once upon a time"],
        SamplingParams(temperature=0, max_tokens=8),
        priority=[1, 0],
    )
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.prompt_token_ids == ids


def test_async_llm_streams_and_an_abort_frees_blocks():
    engine = AsyncLLM(STORIES, dtype="float32", max_model_len=256, block_size=8)
    scheduler = engine.engine.core.scheduler
    step, step_threads = engine.engine.step, set()
    # Every step on the same thread of its own, not asyncio's shared pool (an OpenMP team belongs
    # to the thread that starts it).
    engine.engine.step = lambda: step_threads.add(threading.current_thread()) or step()

    async def main():
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        seen = []
        async for output in engine.generate("Once upon a time", params, request_id="full"):
            seen.append(len(output.outputs[0].token_ids))
        assert seen == list(range(1, 41)) and output.finished
        with pytest.raises(ValueError, match=r"^'max_tokens' is too large: 300\. "):
            async for _ in engine.generate("Once", SamplingParams(max_tokens=300)):
                pass

        async def consume_and_abort():
            texts = []
            async for output in engine.generate("Lily", params, request_id="aborted"):
                texts.append(output)
                if len(output.outputs[0].token_ids) == 5:
                    await engine.abort("aborted")
            return texts[-1]

        async def consume_and_break():
            async for output in engine.generate("Tom", params, request_id="left"):
                if len(output.outputs[0].token_ids) == 3:
                    break
            return output

        last, left = await asyncio.gather(consume_and_abort(), consume_and_break())
        assert last.finished and last.outputs[0].finish_reason == "abort"
        assert len(last.outputs[0].token_ids) < 40
        assert len(left.outputs[0].token_ids) == 3
        for _ in range(100):  # the break's abort is applied by the engine loop
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
        scheduler.check_integrity()
        with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
            async for _ in engine.generate({"prompt_token_ids": [5] * 300}, params):
                pass

        started = asyncio.Event()
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

        async def consume():
            async for _ in engine.generate("Tom", long, request_id="open"):
                started.set()

        stream = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), timeout=5)  # open, and far from its 200 tokens
        await engine.shutdown()  # an open stream ends with an error, never hangs
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(stream, timeout=5)
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("Tom", params):
                pass

    asyncio.run(main())
    (thread,) = step_threads
    assert thread.name.startswith("parkade-step")


def test_seeded_sampling_survives_preemption():
    """A seeded request recomputed after preemption draws the same tokens as one never preempted."""
    prompts = ["Once upon a time", "Lily and Tom", "The big dog", "One day"]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, ignore_eos=True) for s in range(4)]
    roomy = LLM(STORIES, dtype="float32", block_size=4, max_model_len=96)
    tight = LLM(STORIES, dtype="float32", block_size=4, max_model_len=96, kv_cache_memory_bytes=40 * 4 * 1280)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert roomy.engine.core.scheduler.num_preemptions == 0
    assert got == expected


def test_generate_shows_vllms_progress_bar_when_asked(llm, capsys):
    prompts = ["Once upon a time", "Lily and Tom", "The big dog"]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    assert capsys.readouterr().err == ""
    llm.generate(prompts, params, use_tqdm=True)
    final = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "Processed prompts" in final and "3/3" in final
    rates = re.search(r"input: ([\d.]+) tok/s, output: ([\d.]+) tok/s", final)
    assert rates and float(rates[1]) > 0 and float(rates[2]) > 0, final
    made = []

    def my_tqdm(**kwargs):
        from tqdm import tqdm

        made.append(kwargs["total"])
        return tqdm(**kwargs)

    llm.generate(prompts, params, use_tqdm=my_tqdm)
    assert made == [3]


def test_reset_prefix_cache_forgets_the_cached_blocks(llm):
    prompt = "Once upon a time there was a little girl named Lily. " * 2
    params = SamplingParams(temperature=0, max_tokens=4)
    first, again = (llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert llm.reset_prefix_cache()
    after = llm.generate(prompt, params, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0 and after.outputs[0].text == first.outputs[0].text
    llm.engine.core.scheduler.check_integrity()
