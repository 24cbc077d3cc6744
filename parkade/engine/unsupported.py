"""vLLM engine arguments that Parkade does not implement, each refused by name with what to do
instead, so that a vLLM script fails at its first line with a reason rather than with "unknown
argument" (or, worse, runs without what it asked for).

A value that asks for nothing (vLLM's default: quantization=None, cpu_offload_gb=0,
enable_lora=False) is accepted and ignored: Parkade already behaves so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_NO_CUDA_GRAPH_KNOBS = "Parkade captures decode CUDA graphs itself; enforce_eager=True turns them off"
_ONE_DEVICE = "Parkade runs a model on one device; run one engine per device instead"
_TEXT_ONLY = "Parkade serves text-only models (Llama, Mistral, Qwen2); prompts are text or token ids"
_NO_LORA = "merge the LoRA adapter into the weights and serve that folder"

# name -> (values that ask for nothing, what to do instead)
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    # the model and its files
    "quantization": ((None,), "serve an unquantized bf16/fp16/fp32 checkpoint"),
    "download_dir": ((None,), "Parkade has no model hub download; pass a local folder as model=..."),
    "hf_token": ((None, False), "Parkade has no model hub download; pass a local folder as model=..."),
    "hf_config_path": ((None,), "Parkade reads config.json from the model folder"),
    "hf_overrides": ((None, {}), "edit the model folder's config.json"),
    "rope_scaling": ((None, {}), "edit the model folder's config.json"),
    "rope_theta": ((None,), "edit the model folder's config.json"),
    "config_format": (("auto", "hf"), "Parkade reads Hugging Face config.json only"),
    "model_impl": (("auto",), "Parkade runs its own Llama, Mistral and Qwen2 implementations"),
    "runner": (("auto", "generate"), "Parkade only generates text"),
    "convert": (("auto", "none"), "Parkade only generates text"),
    "task": ((None, "auto", "generate"), "Parkade only generates text"),
    "pooler_config": ((None,), "Parkade only generates text (no pooling or embedding models)"),
    "override_pooler_config": ((None,), "Parkade only generates text (no pooling or embedding models)"),
    "generation_config": (
        ("auto",),
        "Parkade reads the EOS ids of the folder's generation_config.json only; give sampling "
        "settings in SamplingParams",
    ),
    "override_generation_config": ((None, {}), "give sampling settings in SamplingParams"),
    "model_loader_extra_config": ((None, {}), "Parkade loads safetensors weights as they are"),
    "logits_processors": (
        (None, []),
        "use SamplingParams (logit_bias, allowed_token_ids, bad_words, penalties)",
    ),
    "logprobs_mode": (("raw_logprobs",), "Parkade returns the logprobs of the raw logits"),
    # memory
    "cpu_offload_gb": ((0,), "use a model (or dtype) that fits the device"),
    "num_gpu_blocks_override": ((None,), "size the KV pool with kv_cache_memory_bytes"),
    "calculate_kv_scales": ((False,), "quantized (fp8) KV caches are not implemented"),
    "enable_sleep_mode": ((False,), "sleep mode is not implemented; delete the engine to free its memory"),
    # parallelism and processes
    "distributed_executor_backend": ((None,), _ONE_DEVICE),
    "data_parallel_size": ((1,), _ONE_DEVICE),
    "enable_expert_parallel": ((False,), "Parkade serves dense models"),
    "disable_custom_all_reduce": ((False, True), _ONE_DEVICE),
    "worker_cls": (("auto",), "Parkade runs its own executor; nothing of it is pluggable"),
    "worker_extension_cls": (("",), "Parkade runs its own executor; nothing of it is pluggable"),
    "scheduler_cls": ((None,), "Parkade runs its own scheduler; nothing of it is pluggable"),
    # compilation and CUDA graphs
    "compilation_config": ((None, {}, 0), _NO_CUDA_GRAPH_KNOBS),
    "max_seq_len_to_capture": ((8192,), _NO_CUDA_GRAPH_KNOBS),
    "cuda_graph_sizes": ((None, []), _NO_CUDA_GRAPH_KNOBS),
    "cudagraph_capture_sizes": ((None, []), _NO_CUDA_GRAPH_KNOBS),
    "max_cudagraph_capture_size": ((None,), _NO_CUDA_GRAPH_KNOBS),
    # features
    "speculative_config": ((None,), "speculative decoding is not implemented"),
    "enable_lora": ((False,), _NO_LORA),
    "max_loras": ((1,), _NO_LORA),
    "max_lora_rank": ((16,), _NO_LORA),
    "max_cpu_loras": ((None,), _NO_LORA),
    "limit_mm_per_prompt": ((None, {}), _TEXT_ONLY),
    "mm_processor_kwargs": ((None, {}), _TEXT_ONLY),
    "allowed_local_media_path": (("",), _TEXT_ONLY),
    "enable_prompt_embeds": ((False,), _TEXT_ONLY),
    "structured_outputs_config": ((None,), "structured outputs (guided decoding) are not implemented"),
    "guided_decoding_backend": ((None,), "structured outputs (guided decoding) are not implemented"),
    "reasoning_parser": ((None, ""), "reasoning parsers are not implemented"),
    "kv_transfer_config": ((None,), "disaggregated prefill (KV transfer) is not implemented"),
    "kv_events_config": ((None,), "KV cache events are not published; see the scheduler's metrics"),
    "async_scheduling": ((False,), "the in-process engine runs one step at a time"),
    "max_num_partial_prefills": ((1,), "chunked prefill has one knob here: max_num_batched_tokens"),
    "max_long_partial_prefills": ((1,), "chunked prefill has one knob here: max_num_batched_tokens"),
    "long_prefill_token_threshold": ((0,), "chunked prefill has one knob here: max_num_batched_tokens"),
}


def _asks_nothing(value: Any, defaults: tuple[Any, ...]) -> bool:
    # NOTE: by type as well as equality, so that True is not taken for a default of 1.
    return any(value == d and isinstance(value, bool) == isinstance(d, bool) for d in defaults)


def check_unsupported(kwargs: Mapping[str, Any]) -> None:
    """Raise ValueError naming each vLLM argument in `kwargs` that Parkade does not implement and
    that asks for something (a value other than vLLM's default); say what to do instead."""
    refused = [
        f"{name}={value!r} is not supported by Parkade: {UNSUPPORTED[name][1]}"
        for name, value in kwargs.items()
        if name in UNSUPPORTED and not _asks_nothing(value, UNSUPPORTED[name][0])
    ]
    if refused:
        raise ValueError("; ".join(refused))


def without_unsupported(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`kwargs` less the unsupported arguments (after `check_unsupported`: each asks for nothing)."""
    return {name: value for name, value in kwargs.items() if name not in UNSUPPORTED}
