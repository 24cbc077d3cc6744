"""The simulated executor: profiles, the roofline cost model, the KV pool sized from the GPU's
memory, deterministic tokens, the checks of its block tables, and its timing."""

from __future__ import annotations

import json
import statistics
import time

import pytest

from parkade import DEFAULT_MODEL, LLM, SamplingParams
from parkade.schemas import CachedRequestData, NewRequestData, StepPlan
from parkade.services.common.simulation import GIB, GPUS, MODELS, ModelShape, Simulation, max_positions
from parkade.services.executor import kv_budget
from parkade.services.executor.build import build_executor
from parkade.services.executor.cost_model import CostModel, Efficiency, StepWork
from parkade.services.executor.options import ExecutorOptions
from parkade.services.executor.simulated import (
    RUNTIME_BYTES,
    SimulatedExecutor,
    next_token,
    request_key,
    simulated_kv_bytes,
)

H200_8B = "h200:llama-3-8b"


def test_profiles_parse_and_bad_specs_name_what_is_known(tmp_path):
    sim = Simulation.parse("H200:Llama-3-8B")
    assert (sim.gpu, sim.model) == (GPUS["h200"], MODELS["llama-3-8b"])
    # Llama-3-8B is 8.03 B parameters; its KV is 128 KiB per token in bf16.
    assert sim.model.num_params == pytest.approx(8.03e9, rel=0.002)
    assert sim.model.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert MODELS["llama-3-70b"].num_params == pytest.approx(70.55e9, rel=0.002)
    assert MODELS["qwen2-7b"].num_params == pytest.approx(7.62e9, rel=0.002)
    for bad, named in (("h200", "GPU:MODEL"), ("v100:llama-3-8b", "h100"), ("h100:gpt-5", "llama-3-70b")):
        with pytest.raises(ValueError, match=named):
            Simulation.parse(bad)
    config = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128)
    (tmp_path / "config.json").write_text(
        json.dumps(config | {"vocab_size": 100, "max_position_embeddings": 999})
    )
    for spec in (f"a100:{tmp_path}", f"a100:{tmp_path / 'config.json'}"):
        model = Simulation.parse(spec).model
        assert (model.num_key_value_heads, model.head_dim, model.max_position_embeddings) == (4, 16, 999)
    assert max_positions(DEFAULT_MODEL, f"a100:{tmp_path}") == 999
    assert max_positions(DEFAULT_MODEL, None) == 512  # the shipped model folder's own
    with pytest.raises(ValueError, match="simulate"):
        ExecutorOptions(simulate="h100:nope")


def test_the_cost_model_is_a_roofline_of_the_steps_work():
    gpu, model = GPUS["h100"], MODELS["llama-3-8b"]
    eff = Efficiency(mfu=0.5, bandwidth_share=0.75, step_overhead_s=0.001)
    cost = CostModel(gpu, model, eff)
    bandwidth, flops = gpu.memory_bandwidth * 0.75, gpu.peak_flops * 0.5
    # One decode with no context: reading the weights (no input embedding table) bounds it.
    weights = (model.num_params - model.vocab_size * model.hidden_size) * 2
    kv = 2 * model.kv_bytes_per_token  # the new token's KV written and read
    assert cost.decode_step_time(1, 0) == pytest.approx(weights / bandwidth + kv / bandwidth + 0.001)
    # A batch of decodes with long contexts: the KV reads add up, the weights are read once.
    assert cost.decode_step_time(64, 4000) - cost.decode_step_time(64, 0) == pytest.approx(
        64 * 4000 * model.kv_bytes_per_token / bandwidth
    )
    # A long prefill is bound by FLOPs: 2 * params per token plus causal attention.
    n = 8192
    linear = 2 * (cost.linear_params * n + cost.lm_head_params) / flops
    attention = 4 * 32 * 32 * 128 * (n * (n + 1) // 2) / flops
    assert cost.prefill_time(n) == pytest.approx(linear + attention + 0.001)
    # Chunks count their pairs against the context before them.
    assert StepWork.of([(100, 10, False), (7, 1, True)]).attention_pairs == 10 * 100 + 55 + 7 + 1
    assert cost.step_time(StepWork()) == 0.0
    # The H200 decodes faster than the H100 (bandwidth), prefills alike (the same compute).
    h200 = CostModel(GPUS["h200"], model, eff)
    assert h200.decode_step_time(32, 1000) < cost.decode_step_time(32, 1000)
    assert h200.prefill_time(n) == pytest.approx(cost.prefill_time(n))
    with pytest.raises(ValueError, match="mfu"):
        Efficiency(mfu=0)


def test_the_kv_pool_is_sized_from_the_gpus_memory_as_on_the_device():
    sim = Simulation.parse(H200_8B)
    total, weights = sim.gpu.memory_bytes, sim.model.weight_bytes
    free = total - weights - RUNTIME_BYTES
    default = simulated_kv_bytes(ExecutorOptions(simulate=H200_8B), sim)
    assert default == int(free * kv_budget.GPU_KV_SHARE)
    assert 100 * GIB < default < 110 * GIB  # (140 - 15 - 1.5) GiB * 0.85
    share = simulated_kv_bytes(ExecutorOptions(simulate=H200_8B, gpu_memory_utilization=0.5), sim)
    assert share == int(free - 0.5 * total)
    given = ExecutorOptions(simulate=H200_8B, kv_cache_memory_bytes=GIB, gpu_memory_utilization=0.5)
    assert simulated_kv_bytes(given, sim) == GIB
    with pytest.raises(ValueError, match="do not fit"):
        simulated_kv_bytes(ExecutorOptions(simulate="h100:llama-3-70b"), Simulation.parse("h100:llama-3-70b"))
    executor, max_model_len = build_executor(ExecutorOptions(simulate=H200_8B, block_size=16))
    assert executor.num_blocks == default // (16 * sim.model.kv_bytes_per_token)
    assert executor.vocab_size == 512  # the model folder's (stories260K): its tokenizer's ids
    assert max_model_len == 8192  # the simulated model's
    small, max_model_len = build_executor(ExecutorOptions(simulate=H200_8B, kv_cache_memory_bytes=64 * 2**20))
    assert (small.num_blocks, max_model_len) == (32, 512)  # an unset limit is lowered to the pool


def _params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=1000, **kwargs)


def test_tokens_are_a_function_of_the_key_position_and_previous_token():
    params = _params()
    key = request_key("r1", params)
    assert key == request_key("r1", _params(temperature=0.0))  # the id, when there is no seed
    assert request_key("r1", _params(seed=7)) == request_key("r2", _params(seed=7))

    def run(key: int, prompt: list[int], n: int = 50, **kwargs) -> list[int]:
        tokens = list(prompt)
        for _ in range(n):
            tokens.append(next_token(key, tokens, len(prompt), _params(**kwargs), (2,), 512, 0.0))
        return tokens[len(prompt) :]

    a = run(key, [1, 5, 9])
    assert a == run(key, [1, 5, 9]) and all(0 <= t < 512 and t != 2 for t in a)
    assert a != run(key + 1, [1, 5, 9])  # another request
    assert a != run(key, [1, 5, 10])  # another previous token
    assert a != run(key, [1, 1, 5, 9])  # another position
    assert len(set(a)) > 30  # spread over the vocabulary
    allowed = run(key, [1, 5, 9], allowed_token_ids=(3, 4, 2))
    assert set(allowed) <= {3, 4}  # EOS comes only by the EOS draw
    # Stop token ids are banned until min_tokens, EOS always outside the EOS draw.
    early = run(key, [1], n=200, min_tokens=200, stop_token_ids=tuple(range(256)))
    assert all(t >= 256 for t in early)


def test_eos_comes_with_its_probability_after_min_tokens_and_never_with_ignore_eos():
    def length(request: int, p: float, **kwargs) -> int:
        params = _params(**kwargs)
        key = request_key(f"r{request}", params)
        tokens = [1]
        for _ in range(2000):
            tokens.append(next_token(key, tokens, 1, params, (2, 3), 512, p))
            if tokens[-1] in (2, 3):
                break
        return len(tokens) - 1

    lengths = [length(i, 0.05) for i in range(400)]
    assert statistics.fmean(lengths) == pytest.approx(20, rel=0.15)  # geometric, mean 1 / p
    assert min(length(i, 0.5, min_tokens=10) for i in range(50)) == 11
    assert {length(i, 0.5, ignore_eos=True) for i in range(5)} == {2000}


def _new(request_id: str, tokens: list[int], blocks: tuple[int, ...], **params) -> NewRequestData:
    return NewRequestData(
        request_id=request_id,
        token_ids=tuple(tokens),
        num_prompt_tokens=len(tokens),
        sampling_params=_params(**params),
        block_ids=blocks,
        num_computed_tokens=0,
        eos_token_ids=(2,),
    )


class FakeClock:
    """Time that passes by sleeping, and by a microsecond each read (the wait's spin ends)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_step_waits_its_predicted_time_over_the_speedup_and_checks_its_block_tables():
    clock = FakeClock()
    sim = Simulation.parse(H200_8B)
    executor = SimulatedExecutor(
        sim, vocab_size=512, block_size=4, num_blocks=8, speedup=2.0, clock=clock, sleep=clock.sleep
    )
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    plan = StepPlan(step_id=1, new_requests=(_new("a", prompt, (0, 1)),), num_scheduled_tokens={"a": 8})
    result = executor.execute(plan)
    predicted = CostModel(sim.gpu, sim.model).step_time(StepWork.of([(0, 8, True)]))
    assert clock.now == pytest.approx(predicted / 2, abs=1e-5)
    assert result.request_ids == ("a",) and len(result.sampled_token_ids) == 1
    assert executor.stats.predicted_s == pytest.approx(predicted) and executor.stats.steps == 1
    # Token 9 needs a third block: without it the step fails, as an index would on the device.
    with pytest.raises(IndexError, match="blocks"):
        executor.execute(StepPlan(step_id=2, num_scheduled_tokens={"a": 1}))
    grown = CachedRequestData(request_id="a", new_block_ids=(5,), num_computed_tokens=8)
    result = executor.execute(StepPlan(step_id=3, cached_requests=(grown,), num_scheduled_tokens={"a": 1}))
    assert executor.requests["a"].block_ids == [0, 1, 5] and len(executor.requests["a"].token_ids) == 10
    with pytest.raises(IndexError, match="outside the pool"):
        executor.execute(
            StepPlan(step_id=4, new_requests=(_new("b", [1], (8,)),), num_scheduled_tokens={"b": 1})
        )
    # Logprobs: the simulated model is sure of every token it gives and of the prompt.
    asks = _new("c", [1, 2, 3], (3,), logprobs=2, prompt_logprobs=1)
    result = executor.execute(StepPlan(step_id=5, new_requests=(asks,), num_scheduled_tokens={"c": 3}))
    token = result.sampled_token_ids[0]
    assert result.logprobs[0].token_ids[:2] == (token, token) and result.logprobs[0].logprobs[0] == 0.0
    assert [e.token_ids[0] for e in result.prompt_logprobs[0].logprobs] == [2, 3]


def test_a_step_takes_its_predicted_time_on_the_wall_clock():
    """Within 5% over many steps (sleep, then spin the last 0.2 ms). The machine's load can only
    make a step late, never early: the lower bound is exact."""
    executor = SimulatedExecutor(
        Simulation.parse(H200_8B), vocab_size=512, block_size=16, num_blocks=1000, speedup=0.5
    )
    tokens = list(range(1, 200))
    plans = [
        StepPlan(
            step_id=1, new_requests=(_new("a", tokens, tuple(range(20))),), num_scheduled_tokens={"a": 199}
        )
    ]
    executor.execute(plans[0])
    started = time.perf_counter()
    for step in range(2, 42):
        executor.execute(StepPlan(step_id=step, num_scheduled_tokens={"a": 1}))
    elapsed = time.perf_counter() - started
    predicted = sum(executor.stats.step_times[1:]) / 0.5
    assert predicted <= elapsed < predicted * 1.05


def test_llm_simulate_gives_the_same_tokens_in_any_batch_and_after_preemption():
    prompts = ["Once upon a time", "Lily and Tom", "The big dog went to the park", "Mom said"] * 3
    params = [SamplingParams(max_tokens=60, seed=i if i % 2 else None, temperature=0.0) for i in range(12)]
    big = LLM(simulate=H200_8B, simulate_speedup=1000.0, max_model_len=512)
    outputs = [o.outputs[0] for o in big.generate(prompts, params)]
    # Seeded requests are keyed by their seed (others by their id, which LLM counts on).
    alone = [big.generate([prompts[i]], params[i], use_tqdm=False)[0].outputs[0] for i in (1, 5)]
    assert [o.token_ids for o in alone] == [outputs[1].token_ids, outputs[5].token_ids]
    # A pool of 16 blocks of 16 cannot hold 12 requests of ~70 tokens: they are preempted.
    small = LLM(
        simulate=H200_8B,
        simulate_speedup=1000.0,
        max_model_len=128,
        kv_cache_memory_bytes=16 * 16 * MODELS["llama-3-8b"].kv_bytes_per_token,
    )
    again = [o.outputs[0] for o in small.generate(prompts, params)]
    assert small.engine.core.scheduler.num_preemptions > 0
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]
    assert [o.text for o in again] == [o.text for o in outputs]
    # With the default EOS probability some requests end early, by EOS.
    reasons = {o.finish_reason for o in outputs}
    assert "length" in reasons


def test_model_shape_of_an_unreadable_config_says_so(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="cannot read"):
        ModelShape.from_config(tmp_path)
