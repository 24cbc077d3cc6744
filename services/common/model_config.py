"""`ModelConfig`: what Parkade needs from a Hugging Face model folder, read without transformers.

The executor builds its decoder and KV pool from it; the front end takes the vocabulary size and
the EOS token ids that it checks and stamps on every request. Importing this module does not
import torch (the command line and the scheduler stay light); resolving a dtype does.

Supports the Llama, Mistral and Qwen2 families. Both config layouts are read: transformers 5 keeps
RoPE settings in `rope_parameters`; older files have `rope_theta` plus `rope_scaling`. RoPE inverse
frequencies follow transformers' `modeling_rope_utils` for the types we support (default, linear,
llama3), so that logits match it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPE_NAMES", "SUPPORTED_ARCHITECTURES", "ModelConfig", "RopeConfig", "resolve_max_model_len"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# vLLM's names, aliases included.
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}
DTYPE_NAMES = ("auto", *_DTYPES)  # what `dtype` accepts as a string
DEFAULT_MAX_POSITIONS = 2048  # when config.json has no max_position_embeddings
_DEFAULT_ROPE_THETA = 10_000.0  # transformers' `default_theta`


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings. `factor` etc. are only meaningful for the scaled types."""

    theta: float = _DEFAULT_ROPE_THETA
    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """[head_dim // 2] fp32 inverse frequencies, computed as transformers does (on the CPU)."""
        import torch

        # Explicit CPU device: this also runs while the model is being built under `torch.device("meta")`.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            return self._llama3(inv_freq)
        return inv_freq

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        import torch

        # Long wavelengths (low frequencies) are divided by `factor`, short ones kept, and the band
        # between the two cut-offs interpolated smoothly.
        old_len = self.original_max_position_embeddings
        low_freq_wavelen = old_len / self.low_freq_factor
        high_freq_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only model: shapes, RoPE, attention features, dtype and special token ids."""

    model_dir: Path
    architecture: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    dtype: torch.dtype
    # Keys at positions > p - sliding_window are visible from position p; None: all of them.
    sliding_window: int | None = None
    # Per layer: does the sliding window apply? (Qwen2 can limit it to its upper layers.)
    sliding_window_layers: tuple[bool, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: str | torch.dtype = "auto") -> ModelConfig:
        """Read `config.json` (and `generation_config.json`, if any) from a model folder.

        `dtype="auto"` takes the config's `dtype` (or older `torch_dtype`), float32 if absent.
        Raises ValueError for an unsupported architecture, activation or RoPE type.
        """
        model_dir = Path(model_dir)
        cfg = _read_json(model_dir / "config.json")
        if cfg is None:
            raise FileNotFoundError(f"no config.json in {model_dir}")
        gen = _read_json(model_dir / "generation_config.json") or {}
        arch = next((a for a in cfg.get("architectures") or () if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {cfg.get('architectures')!r} in {model_dir}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only 'silu' is supported")
        heads = cfg["num_attention_heads"]
        layers = cfg["num_hidden_layers"]
        window, window_layers = _sliding_window(arch, cfg, layers)
        if arch == "Qwen2ForCausalLM":  # q/k/v always carry a bias, o_proj never
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        bos = cfg.get("bos_token_id")
        if bos is None:
            bos = gen.get("bos_token_id")
        return cls(
            model_dir=model_dir,
            architecture=arch,
            model_type=cfg.get("model_type", ""),
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", DEFAULT_MAX_POSITIONS),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope=_rope_config(cfg),
            dtype=_resolve_dtype(dtype, cfg),
            sliding_window=window,
            sliding_window_layers=window_layers,
            bos_token_id=bos,
            eos_token_ids=_union_ids(cfg.get("eos_token_id"), gen.get("eos_token_id")),
        )

    def layer_sliding_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None when it attends to the whole context."""
        return self.sliding_window if self.sliding_window_layers[layer] else None


def read_max_position_embeddings(model_dir: str | Path) -> int:
    """The model's longest sequence, from config.json alone (no torch, no weights)."""
    cfg = _read_json(Path(model_dir) / "config.json") or {}
    return cfg.get("max_position_embeddings", DEFAULT_MAX_POSITIONS)


def resolve_max_model_len(max_position_embeddings: int, requested: int | None) -> int:
    """The longest request (prompt + output) served: `requested`, or unset the model's own
    limit. ValueError above the model's limit (vLLM's rule). The one rule of the executor, the
    tokenizer, the gateway and `parkade up`; only the executor may then lower an unset limit,
    to what its KV pool holds (`build_executor`), which it announces."""
    if requested is None:
        return max_position_embeddings
    if requested < 1:
        raise ValueError(f"max_model_len must be >= 1, got {requested}")
    if requested > max_position_embeddings:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings={max_position_embeddings}"
        )
    return requested


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with path.open() as f:
        return json.load(f)


def _union_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    """Flatten ints / lists / None into unique ids, first occurrence first."""
    ids: list[int] = []
    for value in values:
        for i in [value] if isinstance(value, int) else value or ():
            if i not in ids:
                ids.append(i)
    return tuple(ids)


def _sliding_window(arch: str, cfg: dict[str, Any], layers: int) -> tuple[int | None, tuple[bool, ...]]:
    window = cfg.get("sliding_window")
    if arch == "LlamaForCausalLM" or window is None:
        return None, (False,) * layers
    if arch == "MistralForCausalLM":
        return window, (True,) * layers
    # Qwen2: off unless `use_sliding_window`; then per `layer_types`, or (older configs) on the
    # layers from `max_window_layers` up, as transformers' Qwen2Config derives them.
    if not cfg.get("use_sliding_window", False):
        return None, (False,) * layers
    types = cfg.get("layer_types")
    if types:
        return window, tuple(t == "sliding_attention" for t in types)
    first = cfg.get("max_window_layers", 28)
    return window, tuple(i >= first for i in range(layers))


def _rope_config(cfg: dict[str, Any]) -> RopeConfig:
    # transformers gives an old `rope_scaling` dict priority over `rope_parameters`, and fills
    # `rope_theta` from the top level when the dict lacks it.
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", _DEFAULT_ROPE_THETA))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type == "linear":
        return RopeConfig(theta=float(theta), rope_type="linear", factor=float(params["factor"]))
    if rope_type == "llama3":
        return RopeConfig(
            theta=float(theta),
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
            ),
        )
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, linear, llama3")


def check_dtype_name(dtype: str) -> str:
    """`dtype` if Parkade serves in it (a name of DTYPE_NAMES); ValueError otherwise."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPE_NAMES)}")
    return dtype


def _resolve_dtype(dtype: str | torch.dtype, cfg: dict[str, Any]) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if dtype not in _DTYPES:  # an unknown name, or "auto" written in config.json itself
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPE_NAMES)}")
    return getattr(torch, _DTYPES[dtype])
