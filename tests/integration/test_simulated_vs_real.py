"""The simulated executor is a drop-in: given the tokens the real model sampled, Parkade's
scheduler makes the very same step plans over it as over the real executor (the same block ids,
chunks, preemptions and finishes), and the simulated executor takes every one of them."""

from __future__ import annotations

import msgspec

from parkade import DEFAULT_MODEL, LLM, SamplingParams
from parkade.services.common.model_config import ModelConfig
from parkade.services.common.simulation import MODELS
from parkade.services.executor.kv_pool import bytes_per_block

BLOCKS = 24  # too few for every request at once: preemptions happen
PROMPTS = [
    "Once upon a time",
    "Lily and Tom went to the park",
    "The big dog",
    "Mom said",
    "Tim had a ball",
] * 2


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=40 + 7 * i, ignore_eos=i % 3 == 0
        )
        for i in range(len(PROMPTS))
    ]


def test_the_scheduler_plans_alike_over_the_real_and_the_simulated_executor():
    config = ModelConfig.from_pretrained(DEFAULT_MODEL, "float32")
    engine = dict(max_model_len=256, block_size=16, max_num_seqs=8, max_num_batched_tokens=64)
    real = LLM(
        dtype="float32", kv_cache_memory_bytes=BLOCKS * bytes_per_block(config, 16, config.dtype), **engine
    )
    steps: dict[int, tuple] = {}
    execute = real.engine.core.executor.execute

    def recorded(plan):
        result = execute(plan)
        steps[plan.step_id] = (plan, result)
        return result

    real.engine.core.executor.execute = recorded
    want = real.generate(PROMPTS, _params(), use_tqdm=False)
    assert real.engine.core.scheduler.num_preemptions > 0

    sim = LLM(
        simulate="h200:llama-3-8b",
        simulate_speedup=1e9,
        kv_cache_memory_bytes=BLOCKS * 16 * MODELS["llama-3-8b"].kv_bytes_per_token,
        **engine,
    )
    simulated = sim.engine.core.executor
    simulate = simulated.execute
    seen = []

    def replayed(plan):
        real_plan, real_result = steps[plan.step_id]
        assert plan == real_plan, f"step {plan.step_id} planned otherwise"
        result = simulate(plan)
        assert result.request_ids == real_result.request_ids
        for request_id, token in zip(result.request_ids, real_result.sampled_token_ids, strict=True):
            simulated.requests[request_id].token_ids[-1] = token  # the real model's token
        seen.append(plan.step_id)
        return msgspec.structs.replace(result, sampled_token_ids=real_result.sampled_token_ids)

    simulated.execute = replayed
    got = sim.generate(PROMPTS, _params(), use_tqdm=False)
    assert sorted(seen) == sorted(steps)  # every step, none more
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
