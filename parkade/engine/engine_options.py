"""`EngineOptions`: the vLLM engine arguments that only the in-process engine reads.

None of them is a setting of a service: the tokenizer, scheduler and executor services never see
them (they are no flags of `parkade up` or of a service). Each is accepted with a meaning:

    disable_log_stats        False: a stats line every few seconds (`parkade.engine.stats`)
    swap_space               accepted and unused, said once in the log: nothing is ever swapped
    trust_remote_code        True or False alike: no code from a model folder ever runs
    tensor/pipeline_parallel 1: one model, one device; more is refused
    revision, tokenizer_revision, code_revision
                             None: the folder as it is; a revision is refused (no hub)
    tokenizer_mode, kv_cache_dtype, load_format, max_logprobs
                             the one value Parkade implements; any other is refused, by name
    served_model_name        accepted; it names nothing in one process (the gateway's flag does)

Torch-free, as `EngineArgs` is.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from parkade.schemas import MAX_LOGPROBS

log = logging.getLogger(__name__)

# The values Parkade implements of vLLM's choice-valued arguments, and why there are no others.
# NOTE: tokenizer_mode "hf" (vLLM: always the Hugging Face tokenizer) is what "auto" does here.
CHOICES: dict[str, tuple[tuple[str, ...], str]] = {
    "tokenizer_mode": (
        ("auto", "hf"),
        "Parkade loads the fast Hugging Face tokenizer (tokenizer.json) only; use 'auto'",
    ),
    "kv_cache_dtype": (
        ("auto",),
        "the KV cache has the model's dtype (choose it with dtype=...); quantized (fp8) KV caches "
        "are not implemented; use 'auto'",
    ),
    "load_format": (
        ("auto", "safetensors"),
        "Parkade loads safetensors weights only; convert other checkpoints with transformers' "
        "save_pretrained(safe_serialization=True)",
    ),
}


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """vLLM engine arguments the in-process engine takes itself (see the module docstring).

    NOTE: disable_log_stats is True by default, as in vLLM's `LLM`, and for `AsyncLLM` too:
    `parkade offline` runs one prompt on it, and the services report through their metrics."""

    disable_log_stats: bool = True
    swap_space: float | None = None  # GiB, as vLLM's (whose default is 4); unused here
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    revision: str | None = None
    tokenizer_revision: str | None = None
    code_revision: str | None = None
    tokenizer_mode: str = "auto"
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    max_logprobs: int = MAX_LOGPROBS
    served_model_name: str | Sequence[str] | None = None

    def __post_init__(self) -> None:
        """Raise ValueError for a value Parkade cannot honour, naming the argument and why."""
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            size = getattr(self, name)
            if size != 1:
                raise ValueError(
                    f"{name}={size}: Parkade runs a model on one device; use a model (or a dtype) that "
                    "fits one device, or run one engine per device"
                )
        revisions = (("revision", "model"), ("tokenizer_revision", "tokenizer"), ("code_revision", "model"))
        for name, what in revisions:
            value = getattr(self, name)
            if value is not None:
                raise ValueError(
                    f"{name}={value!r}: Parkade loads local folders, not hub revisions; check out that "
                    f"revision into a folder and pass its path ({what}=...)"
                )
        for name, (accepted, why) in CHOICES.items():
            value = str(getattr(self, name))
            if value not in accepted:
                raise ValueError(f"{name}={value!r} is not supported by Parkade: {why}")
        if self.max_logprobs != MAX_LOGPROBS:
            raise ValueError(
                f"max_logprobs={self.max_logprobs}: Parkade's limit on logprobs and prompt_logprobs is fixed "
                f"at {MAX_LOGPROBS} (vLLM's default); a request that asks for more is refused"
            )
        if self.swap_space is not None:
            if self.swap_space < 0:
                raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
            log.info(
                "swap_space=%s GiB is not used: Parkade, like vLLM V1, preempts by recompute (a "
                "preempted request gives its KV blocks back and computes them again when it resumes), "
                "so nothing is swapped to CPU memory",
                self.swap_space,
            )
        names = self.served_model_name
        if names is not None and not isinstance(names, str):
            if not all(isinstance(n, str) for n in names):
                raise ValueError(f"served_model_name must be a name or a list of names, got {names!r}")
            object.__setattr__(self, "served_model_name", tuple(names))  # frozen all the way down
