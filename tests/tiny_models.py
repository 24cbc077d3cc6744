"""Tiny random Hugging Face checkpoints for tests: no hub, fixed seed, fp32, a few hundred KB.

    path = make_tiny_model(tmp_path, "llama", num_hidden_layers=3)

Weights are re-drawn after transformers' init (larger std, non-trivial norm weights and biases),
so that attention is far from uniform and every weight visibly changes the logits: a loader that
skipped a bias or a norm would fail the comparison tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, MistralConfig, Qwen2Config

FAMILIES = ("llama", "mistral", "qwen2")
EOS_TOKEN_IDS = (2, 3)  # config.json has 2; generation_config.json has [2, 3]
BOS_TOKEN_ID = 1

_BASE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=BOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_IDS[0],
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
_CONFIG_CLASSES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": 8},
    "qwen2": {"use_sliding_window": False},
}


def make_tiny_config(family: str, **overrides: Any):
    """The transformers config of a tiny model; `overrides` replace any config field."""
    if family not in _CONFIG_CLASSES:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    kwargs = {**_BASE, **_FAMILY_DEFAULTS[family], **overrides}
    return _CONFIG_CLASSES[family](**kwargs)


def make_tiny_model(tmp_dir: str | Path, family: str, *, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random `family` model ("llama", "mistral", "qwen2") under `tmp_dir`; -> its folder.

    `overrides` go to the config (e.g. `tie_word_embeddings=True`, `sliding_window=4`,
    `rope_parameters={...}`). Pass `max_shard_size="20KB"` to save a sharded checkpoint.
    """
    max_shard_size = overrides.pop("max_shard_size", None)
    config = make_tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    out = Path(tmp_dir) / f"tiny-{family}-{seed}"
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=list(EOS_TOKEN_IDS)).save_pretrained(out)
    return out
