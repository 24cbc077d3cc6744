"""What `--simulate GPU:MODEL` names: a GPU's roofline numbers and a model's shapes. Torch-free.

The simulated executor (`services/executor/simulated.py`) predicts each step's time on that GPU
for that model; the tokenizer, the gateway and `parkade up` read only the simulated model's
length limit from here, since the tokens are the model folder's (its tokenizer and vocabulary)
while the cost is the simulated model's.

    GPU:MODEL   h200:llama-3-8b, a100:qwen2-7b, h100:/path/to/config.json (or its folder)

GPU numbers: dense (no sparsity) bf16 tensor-core peak, HBM bandwidth and memory as the vendors'
datasheets give them (memory: what the driver reports, a little under the marketing figure).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30


@dataclass(frozen=True)
class GPUProfile:
    name: str
    peak_flops: float  # dense bf16 FLOP/s of the tensor cores
    memory_bandwidth: float  # HBM bytes/s
    memory_bytes: int  # what torch.cuda.mem_get_info reports as total


@dataclass(frozen=True)
class ModelShape:
    """The decoder's shapes: all the cost model reads of a model (Llama, Mistral, Qwen2 layouts)."""

    name: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2  # bf16 / fp16

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer (q, k, v, o projections, gate/up/down MLP, two norms)."""
        h, q, kv = (
            self.hidden_size,
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
        )
        return h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size + 2 * h

    @property
    def num_params(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * self.layer_params + embeddings + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_config(cls, path: str | Path) -> ModelShape:
        """A Hugging Face config.json (or the folder holding one). Raises ValueError if unreadable."""
        path = Path(path).expanduser()
        file = path / "config.json" if path.is_dir() else path
        try:
            cfg = json.loads(file.read_text())
            heads = cfg["num_attention_heads"]
            dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
            return cls(
                name=path.stem if path.is_file() and path.stem != "config" else file.parent.name,
                num_hidden_layers=cfg["num_hidden_layers"],
                hidden_size=cfg["hidden_size"],
                num_attention_heads=heads,
                num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                intermediate_size=cfg["intermediate_size"],
                vocab_size=cfg["vocab_size"],
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                dtype_bytes=4 if dtype in ("float32", "float") else 2,
            )
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"cannot read a model's shapes from {file}: {error!r}") from error


GPUS = {
    g.name: g
    for g in (
        # H100 SXM5 80GB: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3.
        GPUProfile("h100", 989e12, 3.35e12, 80 * GIB - 512 * 2**20),
        # H200 SXM 141GB: the H100's compute, 4.8 TB/s HBM3e.
        GPUProfile("h200", 989e12, 4.8e12, 140 * GIB),
        # A100 SXM4 80GB: 312 TFLOP/s dense bf16, 2.039 TB/s HBM2e.
        GPUProfile("a100", 312e12, 2.039e12, 80 * GIB - 512 * 2**20),
        # L4 24GB: 121 TFLOP/s dense bf16 (242 with sparsity), 300 GB/s GDDR6.
        GPUProfile("l4", 121e12, 300e9, 22 * GIB + 512 * 2**20),
    )
}

MODELS = {
    m.name: m
    for m in (
        # Meta-Llama-3-8B's config.json (3.1 differs only in RoPE scaling and 131072 positions).
        ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8192),
        ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, 8192),
        # Qwen2-7B's config.json (q/k/v biases: a few thousand parameters, left out).
        ModelShape("qwen2-7b", 28, 3584, 28, 4, 128, 18944, 152064, 32768),
    )
}

SIMULATE_METADATA = {
    "help": "GPU:MODEL: no forward pass; each step waits the time it would take that model on that GPU "
    f"(GPUs: {', '.join(GPUS)}; models: {', '.join(MODELS)} or a config.json path), and the tokens are "
    "a deterministic function of the request; the model folder gives the tokenizer",
}


@dataclass(frozen=True)
class Simulation:
    gpu: GPUProfile
    model: ModelShape

    @classmethod
    def parse(cls, spec: str) -> Simulation:
        """`GPU:MODEL` -> the profiles. Raises ValueError naming what is known."""
        gpu_name, sep, model_name = spec.partition(":")
        gpu = GPUS.get(gpu_name.strip().lower())
        if not sep or gpu is None:
            raise ValueError(f"--simulate takes GPU:MODEL with GPU one of {', '.join(GPUS)}; got {spec!r}")
        model = MODELS.get(model_name.strip().lower())
        if model is None:
            path = Path(model_name).expanduser()
            if not path.exists():
                raise ValueError(
                    f"unknown model {model_name!r} in --simulate {spec}: one of {', '.join(MODELS)}, or the "
                    "path of a config.json (or of its folder)"
                )
            model = ModelShape.from_config(path)
        return cls(gpu, model)


def max_positions(model_dir: str | Path, simulate: str | None) -> int:
    """The model's longest sequence: the simulated model's when simulating, else the folder's."""
    if simulate:
        return Simulation.parse(simulate).model.max_position_embeddings
    from parkade.services.common.model_config import read_max_position_embeddings

    return read_max_position_embeddings(model_dir)
