"""`SimulatedExecutor`: the executor with its forward pass replaced by waiting, for `--simulate`.

It takes the same plans and answers the same results as `Executor` and keeps what the executor
keeps: each request's tokens, computed count and block table, checked against the pool (a slot
past a request's blocks or a block id past the pool fails the step, as an index error would on
the device). Its pool's size follows from the simulated GPU's memory (`simulated_kv_bytes`).
execute(plan):  1. apply the plan's deltas (drop, add, extend block tables)
                2. per scheduled request: its chunk's work, and a token when it reaches its end
                3. wait until the step's predicted time (`CostModel`) / speedup has passed

Tokens: `next_token` is a pure function of the request's key (its seed, else its id), the
position and the previous token, so the same request gets the same tokens in any batch, in one
process or across Kafka, after a preemption and after a restart. The simulated model is certain
of what it says: every logprob it reports is 0 (rank 1).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from parkade.schemas import (
    CachedRequestData,
    NewRequestData,
    PromptLogprobs,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from parkade.services.common.model_config import resolve_max_model_len
from parkade.services.common.simulation import GIB, Simulation
from parkade.services.executor import kv_budget
from parkade.services.executor.cost_model import CostModel, Efficiency, StepWork
from parkade.services.executor.mixing import MASK64, splitmix64
from parkade.services.executor.options import ExecutorOptions

log = logging.getLogger(__name__)

# What the device holds besides weights and KV: CUDA context, activations' peak, CUDA graphs
# (vLLM logs about 1.5 GiB of these for an 8B model).
RUNTIME_BYTES = 3 * GIB // 2
SPIN_S = 0.0002  # the end of a wait is spun, not slept: a sleep overshoots by ~0.1 ms
NO_LOGPROB = -9999.0  # the tokens the simulated model did not say (vLLM's stand-in for -inf)


def request_key(request_id: str, params: SamplingParams) -> int:
    """The seed of a request's tokens: its own seed, else its id (stable across processes)."""
    if params.seed is not None:
        return splitmix64(params.seed & MASK64)
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")


def next_token(
    key: int,
    token_ids: list[int],
    num_prompt_tokens: int,
    params: SamplingParams,
    eos_token_ids: tuple[int, ...],
    vocab_size: int,
    eos_probability: float,
) -> int:
    """The token after `token_ids`: a function of `key`, the position and the previous token.

    EOS comes with probability `eos_probability` once `min_tokens` are out (never with
    `ignore_eos`); no other draw gives an EOS id, nor a stop token id before `min_tokens`, as the
    real sampler bans them. `allowed_token_ids` is kept to; other logit shaping is not modelled."""
    h = splitmix64(key ^ splitmix64(len(token_ids) ^ (token_ids[-1] << 32)))
    num_outputs = len(token_ids) - num_prompt_tokens
    may_stop = num_outputs >= params.min_tokens
    if may_stop and eos_token_ids and not params.ignore_eos and (h >> 11) / 2**53 < eos_probability:
        return eos_token_ids[0]
    banned = set(eos_token_ids) if may_stop else {*eos_token_ids, *params.stop_token_ids}
    choices = params.allowed_token_ids or range(vocab_size)
    draw = splitmix64(h)
    for i in range(len(choices)):
        token = choices[(draw + i) % len(choices)]
        if token not in banned:
            return token
    return choices[draw % len(choices)]  # every choice banned: the allowlist wins, as in the sampler


@dataclass(eq=False)
class SimulatedRequest:
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    key: int


@dataclass
class SimulationStats:
    steps: int = 0
    predicted_s: float = 0.0  # the GPU's time, before the speedup
    waited_s: float = 0.0  # wall time of the steps
    overrun_s: float = 0.0  # wall time past the deadlines (the host could not keep up)
    step_times: list[float] = field(default_factory=list)  # predicted, per step (the last 10,000)


class SimulatedExecutor:
    def __init__(
        self,
        simulation: Simulation,
        *,
        vocab_size: int,
        block_size: int,
        num_blocks: int,
        efficiency: Efficiency | None = None,
        speedup: float = 1.0,
        eos_probability: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if speedup <= 0:
            raise ValueError(f"simulate_speedup must be > 0, got {speedup}")
        if not 0 <= eos_probability <= 1:
            raise ValueError(f"simulate_eos_probability must be in [0, 1], got {eos_probability}")
        self.simulation = simulation
        self.cost = CostModel(simulation.gpu, simulation.model, efficiency or Efficiency())
        self.vocab_size, self.block_size, self.num_blocks = vocab_size, block_size, num_blocks
        self.speedup, self.eos_probability = speedup, eos_probability
        self.clock, self.sleep = clock, sleep
        self.requests: dict[str, SimulatedRequest] = {}
        self.stats = SimulationStats()

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def default_batched_tokens(self) -> None:
        return None  # a GPU's steps: the scheduler's default budget

    @property
    def default_offline_batched_tokens(self) -> None:
        return None

    def reset(self) -> None:
        """Forget every request (a new scheduler knows none of them)."""
        self.requests.clear()

    def _apply_plan(self, plan: StepPlan) -> None:
        for request_id in (*plan.finished_request_ids, *plan.preempted_request_ids):
            self.requests.pop(request_id, None)
        for new in plan.new_requests:
            self._add(new)
        for cached in plan.cached_requests:
            self._extend(cached)

    def _add(self, new: NewRequestData) -> None:
        self._check_blocks(new.request_id, new.block_ids)
        self.requests[new.request_id] = SimulatedRequest(
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            num_computed_tokens=new.num_computed_tokens,
            block_ids=list(new.block_ids),
            params=new.sampling_params,
            eos_token_ids=new.eos_token_ids,
            key=request_key(new.request_id, new.sampling_params),
        )

    def _extend(self, cached: CachedRequestData) -> None:
        request = self.requests.get(cached.request_id)
        if request is None:
            raise KeyError(f"new blocks for request {cached.request_id!r}, which this executor does not hold")
        self._check_blocks(cached.request_id, cached.new_block_ids)
        request.block_ids += cached.new_block_ids

    def _check_blocks(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise IndexError(
                f"request {request_id!r}: block ids {bad[:4]} outside the pool of {self.num_blocks}"
            )

    def predict(self, plan: StepPlan) -> float:
        """The step's time on the simulated GPU, in seconds, for the requests this executor holds
        (call it after the plan's deltas are applied; `execute` does)."""
        chunks = []
        for request_id, num_new in plan.num_scheduled_tokens.items():
            request = self.requests[request_id]
            end = request.num_computed_tokens + num_new
            chunks.append((request.num_computed_tokens, num_new, end >= len(request.token_ids)))
        return self.cost.step_time(StepWork.of(chunks))

    def execute(self, plan: StepPlan) -> StepResult:
        started = self.clock()
        self._apply_plan(plan)
        if not plan.num_scheduled_tokens:
            return StepResult(step_id=plan.step_id)
        predicted = self.predict(plan)
        request_ids, token_ids, logprobs, prompt_logprobs = [], [], [], []
        for request_id, num_new in plan.num_scheduled_tokens.items():
            request = self.requests[request_id]
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
            if end > len(request.token_ids) or end > len(request.block_ids) * self.block_size:
                raise IndexError(
                    f"request {request_id!r}: tokens {start}..{end} scheduled, but it has "
                    f"{len(request.token_ids)} tokens and {len(request.block_ids)} blocks"
                )
            request.num_computed_tokens = end
            params = request.params
            if params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
                prompt_logprobs.append(self._prompt_logprobs(request_id, request, start, end))
            if end < len(request.token_ids):
                continue  # a prefill chunk that is not the last
            token = next_token(
                request.key, request.token_ids, request.num_prompt_tokens, params,
                request.eos_token_ids, self.vocab_size, self.eos_probability,
            )  # fmt: skip
            request.token_ids.append(token)
            request_ids.append(request_id)
            token_ids.append(token)
            logprobs.append(
                None if params.logprobs is None else _certain(token, params.logprobs, self.vocab_size)
            )
        self._wait(started, predicted)
        return StepResult(
            step_id=plan.step_id,
            request_ids=tuple(request_ids),
            sampled_token_ids=tuple(token_ids),
            logprobs=tuple(logprobs) if any(lp is not None for lp in logprobs) else None,
            prompt_logprobs=tuple(prompt_logprobs),
        )

    def _prompt_logprobs(
        self, request_id: str, request: SimulatedRequest, start: int, end: int
    ) -> PromptLogprobs:
        """Prompt tokens start + 1 .. of the positions this step computed (as `Executor`'s)."""
        k = request.params.prompt_logprobs or 0
        last = min(end, request.num_prompt_tokens - 1)
        entries = tuple(_certain(request.token_ids[p + 1], k, self.vocab_size) for p in range(start, last))
        return PromptLogprobs(request_id=request_id, start=start, logprobs=entries)

    def _wait(self, started: float, predicted: float) -> None:
        """Until `predicted / speedup` seconds after `started`: slept, then the last bit spun."""
        deadline = started + predicted / self.speedup
        remaining = deadline - self.clock()
        if remaining > SPIN_S:
            self.sleep(remaining - SPIN_S)
        while (now := self.clock()) < deadline:
            pass
        stats = self.stats
        stats.steps += 1
        stats.predicted_s += predicted
        stats.waited_s += now - started
        stats.overrun_s += max(0.0, -remaining)
        if len(stats.step_times) < 10_000:
            stats.step_times.append(predicted)


def _certain(token: int, k: int, vocab_size: int) -> TokenLogprobs:
    """Logprobs of a model sure of `token`: it at 0, then the next `k` - 1 ids at NO_LOGPROB."""
    top = [token, *((token + i) % vocab_size for i in range(1, k))][:k]
    return TokenLogprobs(
        token_ids=(token, *top),
        logprobs=(0.0, *[0.0 if t == token else NO_LOGPROB for t in top]),
        ranks=(1, *range(1, len(top) + 1)),
    )


def simulated_kv_bytes(options: ExecutorOptions, simulation: Simulation) -> int:
    """The KV pool's bytes on the simulated GPU, by the real executor's rules on CUDA: the
    budget given, or `gpu_memory_utilization` of the memory less what is in use, or by default
    a share of what the weights left free."""
    if options.kv_cache_memory_bytes is not None:
        return options.kv_cache_memory_bytes
    gpu, model = simulation.gpu, simulation.model
    in_use = model.weight_bytes + RUNTIME_BYTES
    if in_use >= gpu.memory_bytes:
        raise ValueError(
            f"{model.name}'s weights ({model.weight_bytes / GIB:.1f} GiB) and the runtime's "
            f"{RUNTIME_BYTES / GIB:.1f} GiB do not fit in {gpu.name}'s {gpu.memory_bytes / GIB:.1f} GiB "
            "(tensor parallelism is not simulated)"
        )
    free = gpu.memory_bytes - in_use
    share = options.gpu_memory_utilization
    if share is None:
        return int(free * kv_budget.GPU_KV_SHARE)
    return kv_budget.gpu_kv_bytes(share, free=free, total=gpu.memory_bytes)


def build_simulated_executor(
    options: ExecutorOptions, *, vocab_size: int, before_load: Callable[[int, int], None] | None = None
) -> tuple[SimulatedExecutor, int]:
    """-> (the executor, its effective max_model_len), as `build_executor` does for a real one."""
    assert options.simulate is not None
    options = replace(options, block_size=options.block_size_on("cuda"))  # a simulated GPU
    simulation = Simulation.parse(options.simulate)
    model = simulation.model
    max_model_len = resolve_max_model_len(model.max_position_embeddings, options.max_model_len)
    if before_load is not None:
        before_load(max_model_len, options.block_size)
    budget = simulated_kv_bytes(options, simulation)
    per_block = model.kv_bytes_per_token * options.block_size
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"a KV budget of {budget} bytes is less than one block ({per_block} bytes)")
    max_model_len = kv_budget.fit_max_model_len(
        max_model_len, requested=options.max_model_len, num_blocks=num_blocks, block_size=options.block_size
    )
    executor = SimulatedExecutor(
        simulation,
        vocab_size=vocab_size,
        block_size=options.block_size,
        num_blocks=num_blocks,
        efficiency=Efficiency(
            options.simulate_mfu, options.simulate_bandwidth_share, options.simulate_step_overhead_ms / 1e3
        ),
        speedup=options.simulate_speedup,
        eos_probability=options.simulate_eos_probability,
    )
    log.info(
        "simulating %s on %s: %d KV blocks of %d (%.1f GiB), speedup %g",
        model.name, simulation.gpu.name, num_blocks, options.block_size, num_blocks * per_block / GIB,
        options.simulate_speedup,
    )  # fmt: skip
    return executor, max_model_len
