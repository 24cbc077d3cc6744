"""Read a model folder's safetensors weights, one tensor at a time.

Either `model.safetensors`, or a sharded checkpoint: `model.safetensors.index.json`, whose
`weight_map` names the shard file of every tensor. Tensors are read one by one, so peak host memory
stays near one tensor rather than the whole checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

__all__ = ["checkpoint_files", "iterate_weights"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model folder, in a stable order.

    Raises FileNotFoundError naming the folder when neither layout is there, or when the index
    names a shard that is missing.
    """
    model_dir = Path(model_dir)
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    index = model_dir / INDEX_FILE
    if not index.is_file():
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")
    with index.open() as f:
        weight_map: dict[str, str] = json.load(f)["weight_map"]
    shards = [model_dir / name for name in sorted(set(weight_map.values()))]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise FileNotFoundError(f"{index} names shards that are missing: {', '.join(missing)}")
    return shards


def iterate_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for every tensor of the checkpoint, as stored (CPU, stored dtype)."""
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                yield name, f.get_tensor(name)
