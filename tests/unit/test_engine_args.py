"""vLLM's engine arguments: a vLLM script's `LLM(...)` runs; gpu_memory_utilization sizes the KV
pool (the arithmetic on fake memory numbers, then one real engine on the CPU); every argument
Parkade does not implement is refused by name; the stats line appears only when asked for."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from parkade import DEFAULT_MODEL, LLM, SamplingParams
from parkade.engine import stats
from parkade.engine.args import EngineArgs
from parkade.engine.stats import StatLogger
from parkade.engine.unsupported import UNSUPPORTED
from parkade.schemas import GeneratedTokens
from parkade.services.common import model_files
from parkade.services.common.model_config import ModelConfig
from parkade.services.executor import kv_budget
from parkade.services.executor.build import kv_pool_budget
from parkade.services.executor.kv_pool import bytes_per_block
from parkade.services.executor.options import CPU_BLOCK_SIZE, CPU_KV_BYTES, CPU_KV_SEQS, ExecutorOptions
from parkade.services.scheduler.scheduler import SchedulerStats

GIB = 2**30
STATS_LOGGER = "parkade.engine.stats"


def stats_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == STATS_LOGGER]


@pytest.fixture
def every_step(monkeypatch):
    """A stats line at every step rather than every 10 s."""
    monkeypatch.setattr(stats, "LOG_INTERVAL_S", 0.0)


# ---- gpu_memory_utilization: the arithmetic ---------------------------------------------------
def test_on_cuda_the_pool_gets_the_engines_share_less_what_is_in_use():
    # 100 GiB device, 40 GiB in use after the weights: at 0.5 the engine may use 50, so 10 are left.
    assert kv_budget.gpu_kv_bytes(0.5, free=60 * GIB, total=100 * GIB) == 10 * GIB
    assert kv_budget.gpu_kv_bytes(0.9, free=60 * GIB, total=100 * GIB) == 50 * GIB
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.3 .* 40\.00 GiB are in use already"):
        kv_budget.gpu_kv_bytes(0.3, free=60 * GIB, total=100 * GIB)


def test_on_a_cpu_the_pool_gets_the_share_of_ram_less_the_resident_memory_capped():
    assert kv_budget.cpu_kv_bytes(0.5, total=8 * GIB, resident=1 * GIB, cap=10 * GIB) == 3 * GIB
    assert kv_budget.cpu_kv_bytes(0.5, total=8 * GIB, resident=1 * GIB, cap=2 * GIB) == 2 * GIB
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.1 \(on a CPU"):
        kv_budget.cpu_kv_bytes(0.1, total=8 * GIB, resident=1 * GIB, cap=10 * GIB)


def test_the_cgroup_limit_bounds_the_machines_memory(tmp_path, monkeypatch):
    limit = tmp_path / "memory.max"
    assert kv_budget.cgroup_memory_limit(tmp_path / "missing") is None
    limit.write_text("max\n")
    assert kv_budget.cgroup_memory_limit(limit) is None
    limit.write_text(f"{GIB}\n")
    assert kv_budget.cgroup_memory_limit(limit) == GIB
    monkeypatch.setattr(kv_budget, "cgroup_memory_limit", lambda: GIB)
    assert kv_budget.machine_memory_bytes() == GIB  # any test machine has more RAM than that
    assert kv_budget.resident_bytes() > 0


@pytest.mark.parametrize("share", [0, -0.5, 1.01])
def test_gpu_memory_utilization_must_be_a_share(share):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        ExecutorOptions(gpu_memory_utilization=share)


def test_the_block_size_is_vllms_default_for_the_device_unless_given():
    assert ExecutorOptions().block_size_on("cpu") == CPU_BLOCK_SIZE == 128
    assert ExecutorOptions().block_size_on("cuda") == 16
    assert ExecutorOptions(block_size=32).block_size_on("cpu") == 32
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        ExecutorOptions(block_size=0)


def test_the_budget_build_hands_the_executor(monkeypatch):
    config = ModelConfig.from_pretrained(DEFAULT_MODEL, "float32")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    block = CPU_BLOCK_SIZE  # the default on a CPU
    wanted = CPU_KV_SEQS * (128 // block + 1) * bytes_per_block(config, block, torch.float32)
    # Unset: today's defaults (a capped CPU pool; None = CUDA's share of the free memory).
    assert kv_pool_budget(ExecutorOptions(), cpu, config, 128) == min(CPU_KV_BYTES, wanted)
    assert kv_pool_budget(ExecutorOptions(), cuda, config, 128) is None
    # kv_cache_memory_bytes wins, as in vLLM.
    both = ExecutorOptions(kv_cache_memory_bytes=12345, gpu_memory_utilization=0.5)
    assert kv_pool_budget(both, cpu, config, 128) == 12345
    # A share is worked out once the weights are loaded: a function the executor calls.
    monkeypatch.setattr(kv_budget, "machine_memory_bytes", lambda: 10 * GIB)
    monkeypatch.setattr(kv_budget, "resident_bytes", lambda: 5 * GIB - 1000)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * GIB, 100 * GIB))
    share = ExecutorOptions(gpu_memory_utilization=0.5)
    assert kv_pool_budget(share, cpu, config, 128)() == 1000  # under the cap
    monkeypatch.setattr(kv_budget, "resident_bytes", lambda: GIB)
    assert kv_pool_budget(share, cpu, config, 128)() == wanted  # 4 GiB, capped
    assert kv_pool_budget(share, cuda, config, 128)() == 10 * GIB


# ---- real engines ------------------------------------------------------------------------------
def test_a_vllm_script_runs(caplog, monkeypatch, every_step):
    # Plenty of memory beyond what this process holds: the pool is the cap, whatever the machine.
    monkeypatch.setattr(kv_budget, "machine_memory_bytes", lambda: 2 * (kv_budget.resident_bytes() + GIB))
    caplog.set_level(logging.INFO, logger="parkade.engine")
    llm = LLM(
        model=DEFAULT_MODEL,
        dtype="float32",
        max_model_len=128,
        gpu_memory_utilization=0.5,
        enforce_eager=True,
        trust_remote_code=False,
        tensor_parallel_size=1,
        max_num_seqs=8,
        swap_space=4,
        disable_log_stats=False,
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(["Once upon a time", "Lily and Tom"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8]
    assert llm.engine.core.scheduler.config.max_num_seqs == 8
    assert llm.engine.core.scheduler.config.num_blocks == CPU_KV_SEQS * (128 // CPU_BLOCK_SIZE + 1)
    core = llm.engine.core
    assert core.scheduler.config.block_size == core.executor.block_size == CPU_BLOCK_SIZE  # unset: a CPU's
    lines = stats_lines(caplog)
    assert lines and all("Avg prompt throughput" in line for line in lines)
    assert "Running: 2 reqs, Waiting: 0 reqs" in lines[0]
    assert "Avg generation throughput: 0.0 tokens/s" not in lines[-1]
    swap = [r.getMessage() for r in caplog.records if "swap_space" in r.getMessage()]
    assert len(swap) == 1 and "swap_space=4 GiB is not used" in swap[0] and "recompute" in swap[0]


def test_gpu_memory_utilization_sizes_the_pool_on_a_cpu(caplog, monkeypatch, every_step):
    block_bytes = 2 * 5 * CPU_BLOCK_SIZE * 4 * 8 * 4  # K and V, 5 layers, a CPU block, 4 KV heads of 8, fp32
    # Half of "the machine" is 100 blocks beyond this process's resident memory.
    monkeypatch.setattr(kv_budget, "machine_memory_bytes", lambda: 2 * 100 * block_bytes + 2 * GIB)
    monkeypatch.setattr(kv_budget, "resident_bytes", lambda: GIB)
    caplog.set_level(logging.INFO, logger="parkade.engine")
    llm = LLM(dtype="float32", max_model_len=128, gpu_memory_utilization=0.5)
    assert llm.engine.core.scheduler.config.num_blocks == 100
    assert llm.engine.core.executor.kv_caches[0][0].shape[0] == 100
    # Inference tensors (see allocate_kv_pool): the attention op writes them without autograd's layer.
    assert all(cache.is_inference() for layer in llm.engine.core.executor.kv_caches for cache in layer)
    llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    # disable_log_stats is True by default, as in vLLM's LLM: no stats line.
    assert llm.engine.stat_logger is None and stats_lines(caplog) == []
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0\.2 \(on a CPU"):
        LLM(dtype="float32", max_model_len=128, gpu_memory_utilization=0.2)


# ---- accepted and refused ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(trust_remote_code=True),
        dict(trust_remote_code=False),
        dict(tensor_parallel_size=1, pipeline_parallel_size=1),
        dict(revision=None, tokenizer_revision=None, code_revision=None),
        dict(tokenizer_mode="auto", kv_cache_dtype="auto", load_format="safetensors", max_logprobs=20),
        dict(swap_space=0),
        dict(served_model_name=["stories", "tiny"]),
        dict(quantization=None, cpu_offload_gb=0, enable_lora=False, hf_overrides={}, task="generate"),
    ],
)
def test_arguments_that_ask_for_what_parkade_does_are_accepted(kwargs):
    args = EngineArgs.from_kwargs(**kwargs)
    assert all(
        getattr(args, k) == v for k, v in kwargs.items() if hasattr(args, k) and k != "served_model_name"
    )


def test_served_model_name_is_kept_frozen():
    assert EngineArgs.from_kwargs(served_model_name=["a", "b"]).served_model_name == ("a", "b")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tensor_parallel_size=2), "tensor_parallel_size=2: Parkade runs a model on one device"),
        (dict(pipeline_parallel_size=4), "pipeline_parallel_size=4: Parkade runs a model on one device"),
        (
            dict(revision="v1.0"),
            "revision='v1.0': .* check out that revision into a folder and pass its path",
        ),
        (dict(tokenizer_revision="main"), r"tokenizer_revision='main': .* pass its path \(tokenizer="),
        (dict(code_revision="abc"), "code_revision='abc': .* check out that revision"),
        (dict(tokenizer_mode="slow"), "tokenizer_mode='slow' is not supported by Parkade: .*tokenizer.json"),
        (dict(tokenizer_mode="mistral"), "tokenizer_mode='mistral' is not supported"),
        (dict(kv_cache_dtype="fp8"), "kv_cache_dtype='fp8' is not supported by Parkade: .*model's dtype"),
        (dict(load_format="pt"), "load_format='pt' is not supported by Parkade: .*safetensors"),
        (dict(max_logprobs=5), "max_logprobs=5: Parkade's limit .* fixed at 20"),
        (dict(swap_space=-1), "swap_space must be >= 0"),
        (dict(quantization="awq"), "quantization='awq' is not supported by Parkade: serve an unquantized"),
        (dict(cpu_offload_gb=10), "cpu_offload_gb=10 is not supported"),
        (dict(num_gpu_blocks_override=64), "num_gpu_blocks_override=64 .* kv_cache_memory_bytes"),
    ],
)
def test_what_parkade_cannot_do_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs.from_kwargs(**kwargs)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_every_unsupported_vllm_argument_is_refused_by_name_unless_it_asks_for_nothing(name):
    with pytest.raises(ValueError, match=f"^{name}='something' is not supported by Parkade: .+"):
        EngineArgs.from_kwargs(**{name: "something"})
    defaults, _ = UNSUPPORTED[name]
    for value in defaults:
        EngineArgs.from_kwargs(**{name: value})


def test_several_refusals_are_named_together_and_unknown_names_list_the_known():
    with pytest.raises(ValueError, match=r"quantization='awq' .*; enable_lora=True "):
        EngineArgs.from_kwargs(quantization="awq", enable_lora=True)
    with pytest.raises(
        TypeError, match=r"unknown engine argument\(s\) no_such_thing; known: .*gpu_memory_utilization"
    ):
        EngineArgs.from_kwargs(no_such_thing=1)
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(no_such_thing=1)  # refused before anything loads


def test_the_tokenizer_never_runs_code_from_the_folder(monkeypatch):
    seen = {}

    def from_pretrained(path, **kwargs):
        seen.update(kwargs)
        return object()

    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    model_files.load_tokenizer(DEFAULT_MODEL)
    assert seen == {"trust_remote_code": False}


# ---- the stats line ----------------------------------------------------------------------------
def test_the_stat_logger_writes_one_line_per_interval(caplog):
    prefix = SimpleNamespace(queries=0, hits=0)
    now = [100.0]
    scheduler = SimpleNamespace(
        stats=lambda: SchedulerStats(
            num_running=3, num_waiting=2, num_used_blocks=25, num_free_blocks=75, num_live_tokens=0,
            num_allocated_slots=0, num_preemptions=0,
            num_prefix_queries=prefix.queries, num_prefix_hits=prefix.hits,
        ),
    )  # fmt: skip
    caplog.set_level(logging.INFO, logger=STATS_LOGGER)
    logger = StatLogger(scheduler, interval_s=10.0, clock=lambda: now[0])
    prefix.queries, prefix.hits = 400, 100  # 300 prompt tokens to compute
    now[0] = 105.0
    logger.record([GeneratedTokens(request_id="a", index=0, token_ids=(1,))])
    assert stats_lines(caplog) == []  # the interval is not over
    now[0] = 110.0
    logger.record(
        [
            GeneratedTokens(request_id="a", index=1, token_ids=(2, 3)),
            GeneratedTokens(request_id="b", index=0, token_ids=(4,)),
        ]
    )
    assert stats_lines(caplog) == [
        "Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: 0.4 tokens/s, Running: 3 reqs, "
        "Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
    ]
    now[0] = 130.0  # a new interval: nothing carried over
    logger.record([])
    assert stats_lines(caplog)[-1].startswith(
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s"
    )
