"""Settings reach the services: every option of the scheduler, the executor and the front end is
a flag of its service, `parkade up` takes it and hands it on, and the service ends up with it."""

from __future__ import annotations

import argparse
import dataclasses
import enum
from pathlib import Path

import pytest

from parkade import up
from parkade.cli import build_parser
from parkade.engine.args import ENGINE_ONLY_FIELDS, EngineArgs
from parkade.kernels.backends import AttentionBackend
from parkade.schemas import ExecutorAnnouncement
from parkade.services.bus.runtime import service_parser
from parkade.services.common.environment import enforce_eager_default
from parkade.services.common.flags import add_flags, dataclass_flags, flag_values, to_argv
from parkade.services.executor import main as executor_main
from parkade.services.executor.options import ExecutorOptions
from parkade.services.scheduler import main as scheduler_main
from parkade.services.scheduler.config import (
    AdmissionMode,
    KVGeometry,
    SchedulerConfig,
    SchedulingOptions,
    SchedulingPolicy,
)
from parkade.services.tokenizer import main as tokenizer_main
from parkade.services.tokenizer.frontend import TokenizerOptions

# A value other than the default for every option. NOTE: a new option fails these tests until it
# is listed here, which is the point: it must be shown to reach its service.
NON_DEFAULTS = {
    SchedulingOptions: dict(
        max_num_seqs=7,
        max_num_batched_tokens=96,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        scheduling_policy=SchedulingPolicy.PRIORITY,
        admission=AdmissionMode.RESERVE,
        max_waiting_requests=11,
        max_waiting_tokens=999,
    ),
    ExecutorOptions: dict(
        model=Path("/models/llama"),
        dtype="bfloat16",
        device="cpu",
        block_size=8,
        kv_cache_memory_bytes=123456,
        gpu_memory_utilization=0.5,
        max_model_len=64,
        attention_backend=AttentionBackend.TRITON,
        seed=11,
        cpu_matmul_upcast=False,
        cpu_threads="3",
        enforce_eager=not enforce_eager_default(),  # the suite runs with $PARKADE_ENFORCE_EAGER=1
        simulate="h100:qwen2-7b",
        simulate_speedup=0.5,
        simulate_mfu=0.4,
        simulate_bandwidth_share=0.7,
        simulate_step_overhead_ms=2.5,
        simulate_eos_probability=0.01,
    ),
    TokenizerOptions: dict(
        model=Path("/models/llama"),
        tokenizer=Path("/models/llama-tokenizer"),
        max_model_len=64,
        simulate="h100:qwen2-7b",
        trust_request_chat_template=True,
    ),
}


ROUTER_NON_DEFAULTS = dict(
    router="session", replica_timeout_s=2.5, replica_wait_s=12.0, balance_factor=3.0, balance_slack=9
)


@pytest.mark.parametrize("cls", list(NON_DEFAULTS), ids=lambda c: c.__name__)
def test_every_option_is_listed_with_a_value_that_is_not_its_default(cls):
    values = NON_DEFAULTS[cls]
    assert set(values) == {f.name for f in dataclasses.fields(cls)}
    defaults = cls()
    assert all(getattr(defaults, name) != value for name, value in values.items())


def _up_args(extra: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["up", *extra])


def _every_option_on_the_up_command_line() -> argparse.Namespace:
    argv = ["--max-in-flight", "3", "--executor-timeout-s", "7.5", "--executor-wait-s", "33"]
    for cls, values in NON_DEFAULTS.items():
        if cls is not ExecutorOptions:  # its --model is the tokenizer's: `parkade up` takes it once
            argv += to_argv(dataclass_flags(cls), values)
    executor = {k: v for k, v in NON_DEFAULTS[ExecutorOptions].items() if k != "model"}
    argv += [*to_argv(tokenizer_main.ROUTER_FLAGS, ROUTER_NON_DEFAULTS), "--tokenizers", "3"]
    return _up_args(argv + to_argv(dataclass_flags(ExecutorOptions), executor))


def test_every_scheduler_flag_reaches_the_scheduler_through_parkade_up():
    args = _every_option_on_the_up_command_line()
    argv = up.service_argv("scheduler", args)
    parser = service_parser("scheduler", None)
    add_flags(parser, scheduler_main.FLAGS)
    handler = scheduler_main.build_service(parser.parse_args(["--bootstrap-servers", "x:1", *argv]))
    expected = SchedulingOptions(**NON_DEFAULTS[SchedulingOptions])
    assert handler.options == expected and handler.link.max_in_flight == 3
    assert (handler.link.executor_timeout_s, handler.executor_wait_s) == (7.5, 33)
    # ... and shapes the scheduler once an executor announces its pool.
    announcement = ExecutorAnnouncement(
        executor_id="e", num_blocks=40, block_size=8, max_model_len=96, vocab_size=50
    )
    handler.on_announcement(announcement)
    config = handler.scheduler.config
    assert config == SchedulerConfig.build(expected, KVGeometry(40, 8, 96))
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (7, 96)
    assert not config.enable_prefix_caching and not config.enable_chunked_prefill
    assert (config.scheduling_policy, config.admission) == ("priority", "reserve")
    assert (config.max_waiting_requests, config.max_waiting_tokens) == (11, 999)
    assert handler.scheduler.kv.enable_caching is False


def test_every_executor_and_tokenizer_flag_reaches_its_service_through_parkade_up():
    args = _every_option_on_the_up_command_line()
    for name, main, cls in (
        ("executor", executor_main, ExecutorOptions),
        ("tokenizer", tokenizer_main, TokenizerOptions),
    ):
        parser = service_parser(name, None)
        add_flags(parser, main.FLAGS)
        parsed = parser.parse_args(up.service_argv(name, args))
        values = flag_values(main.FLAGS, parsed)
        router = {f.name: values.pop(f.name) for f in getattr(main, "ROUTER_FLAGS", ())}
        shards = {f.name: values.pop(f.name) for f in getattr(main, "SHARD_FLAGS", ())}
        assert cls(**values) == cls(**NON_DEFAULTS[cls]), name
        if name == "tokenizer":
            assert router == ROUTER_NON_DEFAULTS
            assert shards == {"tokenizers": 3, "tokenizer_index": 0}  # each child gets its index
            service = tokenizer_main.build_service(TokenizerOptions(), **router)
            assert (service.router.policy, service.router.replica_timeout_s) == ("session", 2.5)
            assert (service.router.balance_factor, service.router.balance_slack) == (3.0, 9)
            assert service.replica_wait_s == 12.0


def test_defaults_pass_nothing_on_and_offline_takes_every_engine_option():
    args = _up_args([])
    assert all(up.service_argv(name, args) == [] for name in ("tokenizer", "executor", "scheduler"))
    offline = build_parser().parse_args(
        ["offline", "hi", "--scheduling-policy", "priority", "--block-size", "8"]
    )
    from parkade.cli import ENGINE_FLAGS

    engine_args = EngineArgs(**flag_values(ENGINE_FLAGS, offline))
    # Not the vLLM arguments only `LLM(...)` reads (EngineOptions): as flags they would mean nothing.
    expected = {f.name for f in dataclasses.fields(EngineArgs)} - {"seed", *ENGINE_ONLY_FIELDS}
    assert {f.name for f in ENGINE_FLAGS} == expected and "gpu_memory_utilization" in expected
    assert (engine_args.scheduling_policy, engine_args.block_size) == (SchedulingPolicy.PRIORITY, 8)


class Color(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Toy:
    count: int = 1
    ratio: float = 0.5
    name: str | None = None
    color: Color = Color.RED
    verbose: bool = False
    tags: tuple[str, ...] = ("a",)


def test_flags_round_trip_through_the_command_line():
    flags = dataclass_flags(Toy)
    parser = argparse.ArgumentParser()
    add_flags(parser, flags)
    for values in ({}, dict(count=3, ratio=0.25, name="x", color=Color.BLUE, verbose=True, tags=("b", "c"))):
        expected = Toy(**values)
        argv = to_argv(flags, dataclasses.asdict(expected))
        assert Toy(**flag_values(flags, parser.parse_args(argv))) == expected, argv
    with pytest.raises(ValueError, match="cannot be set to None"):
        to_argv(dataclass_flags(SchedulingOptions), {"max_num_seqs": None})
    with pytest.raises(ValueError, match="cannot be emptied"):
        to_argv(flags, {"tags": ()})
    assert "default: red" in parser.format_help() and "{red,blue}" in parser.format_help()
