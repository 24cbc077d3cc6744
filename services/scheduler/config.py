"""The scheduler's settings. Pure: no torch, no I/O.

  SchedulingOptions (what a user sets: `LLM(...)`, `parkade scheduler` flags)
+ KVGeometry        (what the executor has: its pool's blocks, block size, max_model_len)
= SchedulerConfig.build(options, geometry), the one constructor both paths use: the in-process
  engine with its own executor's pool, the scheduler service with the executor's announcement.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TypeVar

# The token budget when none is given: vLLM's default for chunked prefill; an executor may announce
# the budget it runs best at instead (`KVGeometry.default_batched_tokens`: a CPU's is smaller).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
# The waiting queue's bounds. Beyond them a request is refused at once ("overloaded", as TGI's
# 429) rather than queued without end: a client can retry elsewhere, and the scheduler's memory
# stays bounded. A request always joins an empty queue, whatever its size.
DEFAULT_MAX_WAITING_REQUESTS = 4096
DEFAULT_MAX_WAITING_TOKENS = 4 * 1024 * 1024

E = TypeVar("E", bound=enum.Enum)


class SchedulingPolicy(enum.StrEnum):
    FCFS = "fcfs"  # arrival order; a preempted request goes back to the head
    PRIORITY = "priority"  # lowest (priority, arrival_time) first, as vLLM


class AdmissionMode(enum.StrEnum):
    PAGED = "paged"  # a block at a time, as the request grows
    RESERVE = "reserve"  # blocks for prompt + max_tokens at admission: the no-paging baseline


def as_enum(cls: type[E], value: E | str, name: str) -> E:
    """`value` as a member of `cls`; ValueError naming the setting and its choices otherwise."""
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(str(m.value) for m in cls)
        raise ValueError(f"{name} must be one of {choices}; got {value!r}") from None


def _coerce_enums(options: SchedulingOptions | SchedulerConfig) -> None:
    """Accept the names ("priority") where the enums are expected, as vLLM's arguments do."""
    for name, cls in (("scheduling_policy", SchedulingPolicy), ("admission", AdmissionMode)):
        object.__setattr__(options, name, as_enum(cls, getattr(options, name), name))


@dataclass(frozen=True, kw_only=True)
class SchedulingOptions:
    """Every scheduling setting a user chooses; names as vLLM's engine arguments."""

    max_num_seqs: int = field(default=256, metadata={"help": "most requests running at once"})
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata={
            "help": "tokens computed per step (the token budget); unset: the executor's default "
            f"({DEFAULT_MAX_NUM_BATCHED_TOKENS}; on a CPU 2048, and 4096 for LLM's offline batches, as "
            "vLLM-CPU's), or max_model_len if that is more and chunked prefill is off"
        },
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "share the KV blocks of identical prompt prefixes"}
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata={"help": "split a prompt longer than the token budget across steps"}
    )
    scheduling_policy: SchedulingPolicy = field(
        default=SchedulingPolicy.FCFS,
        metadata={"help": "fcfs: arrival order; priority: lower request priority first, then arrival"},
    )
    admission: AdmissionMode = field(
        default=AdmissionMode.PAGED,
        metadata={"help": "paged: blocks on demand; reserve: blocks for prompt + max_tokens up front"},
    )
    max_waiting_requests: int = field(
        default=DEFAULT_MAX_WAITING_REQUESTS,
        metadata={"help": "requests waiting to run at most; more are refused at once (overloaded)"},
    )
    max_waiting_tokens: int = field(
        default=DEFAULT_MAX_WAITING_TOKENS,
        metadata={"help": "tokens of the waiting requests at most; more are refused at once (overloaded)"},
    )

    def __post_init__(self) -> None:
        _coerce_enums(self)
        for name in ("max_num_seqs", "max_waiting_requests", "max_waiting_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class KVGeometry:
    """The executor's KV pool as the scheduler sees it."""

    num_blocks: int
    block_size: int
    max_model_len: int  # the longest request (prompt + outputs) the executor serves
    # The token budget this executor runs best at, for when the user sets none (None: the default).
    # Not part of the pool's identity (equality), which tells a replaced pool from the same one.
    default_batched_tokens: int | None = field(default=None, compare=False)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """`admission="reserve"` reserves blocks for prompt + max_tokens when a request is admitted,
    as servers without paging do; it exists to measure what paging saves."""

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    admission: AdmissionMode = AdmissionMode.PAGED
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    max_waiting_tokens: int = DEFAULT_MAX_WAITING_TOKENS

    @classmethod
    def build(cls, options: SchedulingOptions, geometry: KVGeometry) -> SchedulerConfig:
        """The scheduler's configuration over `geometry`. Raises ValueError for options that
        cannot work there.

        The one rule for the token budget: unset, it is the executor's default (else
        DEFAULT_MAX_NUM_BATCHED_TOKENS), raised to max_model_len
        when chunked prefill is off (a whole prompt must then fit one step); set explicitly below
        max_model_len with chunked prefill off, it is an error, never silently changed.
        """
        budget = options.max_num_batched_tokens
        if budget is None:
            budget = geometry.default_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
            if not options.enable_chunked_prefill:
                budget = max(budget, geometry.max_model_len)
        return cls(
            num_blocks=geometry.num_blocks,
            block_size=geometry.block_size,
            max_model_len=geometry.max_model_len,
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=budget,
            enable_prefix_caching=options.enable_prefix_caching,
            enable_chunked_prefill=options.enable_chunked_prefill,
            scheduling_policy=options.scheduling_policy,
            admission=options.admission,
            max_waiting_requests=options.max_waiting_requests,
            max_waiting_tokens=options.max_waiting_tokens,
        )

    def __post_init__(self) -> None:
        _coerce_enums(self)
        for name in (
            "num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
            "max_waiting_requests", "max_waiting_tokens",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # A request resumed after preemption carries prompt + outputs; without chunking it
            # must fit one step, or it could never run again.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is disabled"
            )

    @property
    def geometry(self) -> KVGeometry:
        return KVGeometry(self.num_blocks, self.block_size, self.max_model_len)


def check_options(options: SchedulingOptions, *, block_size: int, max_model_len: int) -> None:
    """Raise ValueError now for options that `SchedulerConfig.build` would refuse on any pool of
    this block size and max_model_len: before the weights load in one process, before the
    services start under `parkade up`."""
    SchedulerConfig.build(options, KVGeometry(1, block_size, max_model_len))
