"""`Executor`: owns the model and the physical KV pool; turns a `StepPlan` into a `StepResult`.

execute(plan):  1. drop finished and preempted requests' state
                2. add new requests, extend running ones' block tables
                3. one forward pass over the flattened batch (prefill chunks and decodes mixed)
                4. sample one token for each request that reached the end of its tokens
"""

from __future__ import annotations

import torch

from parkade.kernels.backends import AttentionBackend, get_attention_backend
from parkade.schemas import StepPlan, StepResult
from parkade.services.common.model_config import ModelConfig
from parkade.services.executor.input_batch import CachedRequestState, build_inputs
from parkade.services.executor.kv_pool import allocate_kv_pool, num_blocks_for_budget
from parkade.services.executor.model import load_model
from parkade.services.executor.sampler import Sampler

GPU_KV_SHARE = 0.85  # of the device memory left free after loading the weights


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
        kv_cache_memory_bytes: int | None,
        device: torch.device,
        attention_backend: AttentionBackend | str = AttentionBackend.AUTO,
        seed: int = 0,
    ) -> None:
        self.model_config = model_config
        self.block_size = block_size
        self.device = device
        self.attention_backend = get_attention_backend(attention_backend, device)
        self.model = load_model(model_config, device, self.attention_backend)
        if device.type == "cpu" and not cpu_has_native_matmul(model_config.dtype):
            self.model.use_fp32_matmuls()
        kv_dtype = model_config.dtype
        if kv_cache_memory_bytes is None:
            if device.type != "cuda":
                raise ValueError("kv_cache_memory_bytes must be given on a device other than CUDA")
            free, _ = torch.cuda.mem_get_info(device)
            kv_cache_memory_bytes = int(free * GPU_KV_SHARE)
        self.num_blocks = num_blocks_for_budget(model_config, block_size, kv_cache_memory_bytes, kv_dtype)
        self.kv_caches = allocate_kv_pool(model_config, self.num_blocks, block_size, kv_dtype, device)
        self.sampler = Sampler()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.requests: dict[str, CachedRequestState] = {}

    def _apply_plan(self, plan: StepPlan) -> None:
        for request_id in (*plan.finished_request_ids, *plan.preempted_request_ids):
            self.requests.pop(request_id, None)
        for new in plan.new_requests:
            self.requests[new.request_id] = CachedRequestState.from_new(new)
        for cached in plan.cached_requests:
            state = self.requests[cached.request_id]
            assert state.num_computed_tokens == cached.num_computed_tokens, (
                f"{cached.request_id}: executor at {state.num_computed_tokens} tokens, "
                f"plan at {cached.num_computed_tokens}"
            )
            state.block_ids.extend(cached.new_block_ids)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        self._apply_plan(plan)
        if not plan.num_scheduled_tokens:
            return StepResult(step_id=plan.step_id)
        inputs = build_inputs(plan, self.requests, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
        for request_id, n in plan.num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += n
        states = inputs.sampling_states
        if not states:
            return StepResult(step_id=plan.step_id)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        token_ids, logprobs = self.sampler(logits, states, self.generator)
        for state, token_id in zip(states, token_ids, strict=True):
            state.token_ids.append(token_id)
        return StepResult(
            step_id=plan.step_id,
            request_ids=tuple(s.request_id for s in states),
            sampled_token_ids=tuple(token_ids),
            logprobs=tuple(logprobs) if any(lp is not None for lp in logprobs) else None,
        )
