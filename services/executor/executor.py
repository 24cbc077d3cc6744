"""`Executor`: owns the model and the physical KV pool; turns a `StepPlan` into a `StepResult`.

execute(plan):  1. drop finished and preempted requests' state
                2. add new requests, extend running ones' block tables
                3. one forward pass over the flattened batch (prefill chunks and decodes mixed)
                4. sample one token for each request that reached the end of its tokens
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import torch

from parkade.kernels import linear_cpu
from parkade.kernels.backends import AttentionBackend, get_attention_backend
from parkade.schemas import PromptLogprobs, StepPlan, StepResult, TokenLogprobs
from parkade.services.common.model_config import ModelConfig
from parkade.services.executor import kv_budget
from parkade.services.executor.compiled import CompiledForward
from parkade.services.executor.cpu_threads import (
    SMALL_STEP_TOKENS,
    CpuThreads,
    machine_busy_reader,
    usable_cpus,
)
from parkade.services.executor.cuda_graphs import MAX_CAPTURE_SIZE, CudaGraph, DecodeGraphs, EagerGraph
from parkade.services.executor.input_batch import InputBatch, ModelInputs
from parkade.services.executor.kv_pool import allocate_kv_pool, num_blocks_for_budget
from parkade.services.executor.model import load_model
from parkade.services.executor.sampler import Sampler, token_logprobs

PROMPT_LOGPROBS_ROWS = 512  # prompt positions whose logits are computed at once
# The token budget a CPU executor asks for when the user sets none (`default_batched_tokens`).
# Measured on small-llama (the anchors' main workload, 2 vCPU AVX512-BF16): 2048 against the
# default 8192, 702 and 703 against 549 and 562 tok/s, mean TTFT 3.1 against 5.8 s (tiny-llama:
# the same throughput, TTFT 0.31 against 0.62 s). A step of 8192 prompt tokens keeps the first
# token of all of them waiting for the whole step, and its activations fall out of the caches.
CPU_MAX_NUM_BATCHED_TOKENS = 2048
# `LLM`'s offline batches on a CPU ask for twice that, as vLLM-CPU's defaults do by usage (its LLM
# class 4096, its API server 2048): no first token waits there, and the fewer, larger prefill
# steps win on the AMX Xeon (small-llama, the anchors' main workload, 2026-12-06: 1,176 and 1,197
# against 1,139 and 1,149 tok/s).
CPU_OFFLINE_MAX_NUM_BATCHED_TOKENS = 4096


def cpu_has_native_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` matrices natively (fp32 always; bf16/fp16 need AVX512 or AMX)."""
    if dtype == torch.float32:
        return True
    probe = {
        torch.bfloat16: "_is_mkldnn_bf16_supported",
        torch.float16: "_is_mkldnn_fp16_supported",
    }.get(dtype)
    try:
        return bool(getattr(torch.ops.mkldnn, probe)()) if probe else True
    except (AttributeError, RuntimeError):  # an older torch: assume not, upcasting is always exact
        return False


class Executor:
    def __init__(
        self,
        model_config: ModelConfig,
        *,
        block_size: int,
        kv_cache_memory_bytes: int | Callable[[], int] | None,
        device: torch.device,
        attention_backend: AttentionBackend | str = AttentionBackend.AUTO,
        seed: int = 0,
        cpu_matmul_upcast: bool = True,
        cpu_threads: int | None = None,
        compile_model: bool = False,
    ) -> None:
        self.model_config = model_config
        self.block_size = block_size
        self.device = device
        self.attention_backend = get_attention_backend(attention_backend, device)
        self.model = load_model(model_config, device, self.attention_backend)
        self.fp32_matmuls = (
            cpu_matmul_upcast and device.type == "cpu" and not cpu_has_native_matmul(model_config.dtype)
        )
        if self.fp32_matmuls:
            self.model.use_fp32_matmuls()
        # A CPU with AMX or AVX512-BF16 computes a decode step's bf16 matmuls with Parkade's kernel on
        # weights packed now (kernels/linear_cpu.py): it streams them while it computes.
        self.packed_linears = (
            device.type == "cpu" and not self.fp32_matmuls and linear_cpu.serves(model_config.dtype)
        )
        if self.packed_linears:
            self.model.use_packed_linears()
        kv_dtype = model_config.dtype
        if callable(kv_cache_memory_bytes):  # a budget that counts what the weights took
            kv_cache_memory_bytes = kv_cache_memory_bytes()
        if kv_cache_memory_bytes is None:
            if device.type != "cuda":
                raise ValueError("kv_cache_memory_bytes must be given on a device other than CUDA")
            free, _ = torch.cuda.mem_get_info(device)
            kv_cache_memory_bytes = int(free * kv_budget.GPU_KV_SHARE)
        self.num_blocks = num_blocks_for_budget(model_config, block_size, kv_cache_memory_bytes, kv_dtype)
        self.kv_caches = allocate_kv_pool(model_config, self.num_blocks, block_size, kv_dtype, device)
        self.sampler = Sampler()
        # A CPU step's team (cpu_threads.py): `cpu_threads` threads, or None: sized as measured.
        self.team = cpu_team(cpu_threads) if device.type == "cpu" else None
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.batch = InputBatch(block_size, device)
        self.graphs: DecodeGraphs | None = None
        self.compiled: CompiledForward | None = None
        if compile_model and self.compile_supported():
            self.compiled = CompiledForward(self.model, self.kv_caches)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def num_requests(self) -> int:
        return len(self.batch)

    @property
    def attention_backend_name(self) -> str:
        """The attention backend's module name without its package, e.g. `attention_cpu`."""
        return self.attention_backend.__name__.rsplit(".", 1)[-1]

    @property
    def default_batched_tokens(self) -> int | None:
        """The token budget this executor runs best at, for the scheduler's default (None: its own)."""
        return CPU_MAX_NUM_BATCHED_TOKENS if self.device.type == "cpu" else None

    @property
    def default_offline_batched_tokens(self) -> int | None:
        """The same for `LLM`'s offline batches, where no request waits for its first token."""
        return CPU_OFFLINE_MAX_NUM_BATCHED_TOKENS if self.device.type == "cpu" else None

    def compile_supported(self) -> bool:
        """torch.compile serves CPUs, with the backends whose kernels run there natively."""
        native = ("attention_cpu", "attention_torch")
        return self.device.type == "cpu" and self.attention_backend_name in native

    def compile_model(self) -> float:
        """Compile the forward now (see `compiled.py`); -> seconds it took."""
        if self.compiled is None:
            raise ValueError("this executor was built without compile_model, or cannot compile here")
        seconds = self.compiled.warmup(self.team.sizes if self.team is not None else ())
        if self.team is not None:
            compiled = self.compiled
            self.team.calibrate_small_steps(lambda threads: compiled.time_decode(SMALL_STEP_TOKENS, threads))
        return seconds

    def decode_graphs_supported(self) -> bool:
        # By name: resolving the Triton backend on a CPU would switch on its interpreter.
        return self.attention_backend.__name__ == "parkade.kernels.attention_triton"

    def capture_decode_graphs(
        self, max_model_len: int, max_size: int = MAX_CAPTURE_SIZE, eager_stand_in: bool = False
    ) -> float:
        """Capture CUDA graphs of decode steps (Triton backend only); -> seconds it took.

        `eager_stand_in`: the CPU dry run, replaying by calling the model again (see cuda_graphs)."""
        if not self.decode_graphs_supported():
            raise ValueError("decode graphs need the triton attention backend")
        self.graphs = DecodeGraphs(
            self.model, self.kv_caches, self.attention_backend,
            max_model_len=max_model_len, block_size=self.block_size, device=self.device,
            max_size=max_size, graph_type=EagerGraph if eager_stand_in else CudaGraph,
        )  # fmt: skip
        with torch.inference_mode():
            self.graphs.capture()
        return self.graphs.capture_s

    def reset(self) -> None:
        """Forget every request (a new scheduler knows none of them)."""
        self.batch.clear()

    def _apply_plan(self, plan: StepPlan) -> None:
        for request_id in (*plan.finished_request_ids, *plan.preempted_request_ids):
            self.batch.remove(request_id)
        for new in plan.new_requests:
            self.batch.add(new)
        for cached in plan.cached_requests:
            self.batch.extend_blocks(cached)

    def execute(self, plan: StepPlan) -> StepResult:
        team = self.team
        if team is None:
            return self._execute(plan)
        team.begin_step(plan.total_num_scheduled_tokens)
        try:
            return self._execute(plan)
        finally:
            team.end_step()

    @torch.inference_mode()
    def _execute(self, plan: StepPlan) -> StepResult:
        self._apply_plan(plan)
        if not plan.num_scheduled_tokens:
            return StepResult(step_id=plan.step_id)
        inputs = self.batch.build(plan)
        logits: torch.Tensor | None = None  # the compiled step computes them with the layers
        if self.compiled is not None:
            hidden, logits = self.compiled(
                inputs.input_ids, inputs.positions, inputs.attn_metadata, inputs.logits_indices
            )
        elif self.graphs is not None and self.graphs.can_run(inputs):
            hidden = self.graphs.run(inputs)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
        prompt_logprobs = (
            self._prompt_logprobs(plan, inputs, hidden) if self.batch.prompt_logprobs_ids else ()
        )
        self.batch.mark_computed(inputs)
        states = inputs.sampling_states
        if not states:
            return StepResult(step_id=plan.step_id, prompt_logprobs=prompt_logprobs)
        if logits is None:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
        token_ids, logprobs = self.sampler(logits, states, self.generator)
        self.batch.append_sampled(states, token_ids)
        return StepResult(
            step_id=plan.step_id,
            request_ids=tuple(s.request_id for s in states),
            sampled_token_ids=tuple(token_ids),
            logprobs=tuple(logprobs) if any(lp is not None for lp in logprobs) else None,
            prompt_logprobs=prompt_logprobs,
        )

    def _prompt_logprobs(
        self, plan: StepPlan, inputs: ModelInputs, hidden: torch.Tensor
    ) -> tuple[PromptLogprobs, ...]:
        """Logprobs of the prompt tokens whose predecessors this step computed, for the requests
        that asked. The logits at position p give the logprob of prompt token p + 1; the last
        prompt position's logits sample the first output instead. Called before `mark_computed`,
        so that a request's computed count is still where its chunk starts."""
        out = []
        offset = 0  # the batch is flattened in plan order
        for i, (request_id, num_new) in enumerate(plan.num_scheduled_tokens.items()):
            first, offset = offset, offset + num_new
            if request_id not in self.batch.prompt_logprobs_ids:
                continue
            state = self.batch.requests[request_id]
            start = int(self.batch.num_computed[inputs.rows[i]])
            end = min(start + num_new, state.num_prompt_tokens - 1)
            if end <= start:
                continue
            params = state.sampling_params
            wanted = msgspec.structs.replace(params, logprobs=params.prompt_logprobs)
            targets = torch.tensor(state.token_ids[start + 1 : end + 1], device=hidden.device)
            entries: list[TokenLogprobs] = []
            # In slices: a long prompt's logits over the whole vocabulary would be large at once.
            for lo in range(0, end - start, PROMPT_LOGPROBS_ROWS):
                hi = min(lo + PROMPT_LOGPROBS_ROWS, end - start)
                logits = self.model.compute_logits(hidden[first + lo : first + hi])
                entries += token_logprobs(logits, targets[lo:hi], [wanted] * (hi - lo))  # type: ignore[misc]
            out.append(PromptLogprobs(request_id=request_id, start=start, logprobs=tuple(entries)))
        return tuple(out)


def cpu_team(fixed: int | None) -> CpuThreads:
    """The team of a CPU executor's steps: at most the threads torch starts with (its default, or
    OMP_NUM_THREADS), over the CPUs this process may use."""
    cpus = usable_cpus()
    return CpuThreads(
        torch.get_num_threads(),
        fixed=fixed,
        num_cpus=len(cpus),
        set_threads=torch.set_num_threads,
        get_threads=torch.get_num_threads,
        machine_busy=machine_busy_reader(cpus),
    )
