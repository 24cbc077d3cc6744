"""What a model folder must hold, checked before anything loads, and loading its tokenizer.

Parkade serves local Hugging Face folders (there is no model hub download). A folder that lacks a
file fails here with one line that names the file, rather than deep inside transformers (a missing
`tokenizer.json`, for instance, surfaces there as a misleading sentencepiece error).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from parkade.models import DEFAULT_MODEL_NAME

TOKENIZER_FILE = "tokenizer.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


class ModelFolderError(ValueError):
    """A model folder that Parkade cannot serve; the message says what is missing."""


def check_model_folder(
    path: str | Path, *, config: bool = True, weights: bool = True, tokenizer: bool = True
) -> Path:
    """Check that `path` holds what Parkade reads; -> the folder.

    `config`: config.json (every reader of a model); `weights`: safetensors weights (the
    executor); `tokenizer`: tokenizer.json, the fast tokenizer file (the front end). Raises
    ModelFolderError naming what is missing.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelFolderError(
            f"no model folder at {folder}: Parkade serves a local Hugging Face folder (config.json, "
            "*.safetensors, tokenizer.json); there is no model hub download"
        )
    if config and not (folder / "config.json").is_file():
        raise ModelFolderError(f"{folder} has no config.json: it is not a Hugging Face model folder")
    if weights and not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise ModelFolderError(
            f"{folder} has no safetensors weights ({' or '.join(WEIGHT_FILES)}); convert "
            "pytorch_model.bin checkpoints with transformers' save_pretrained(safe_serialization=True)"
        )
    if tokenizer and not (folder / TOKENIZER_FILE).is_file():
        raise ModelFolderError(
            f"{folder} has no {TOKENIZER_FILE}: Parkade needs the fast tokenizer file; save one with "
            "transformers' AutoTokenizer(...).save_pretrained, or point --tokenizer at a folder that has it"
        )
    return folder


def load_tokenizer(path: str | Path) -> Any:
    """The Hugging Face fast tokenizer of a folder (checked first).

    NOTE: trust_remote_code=False whatever the engine was given: Parkade never runs code from a
    model folder, so a tokenizer that exists only as such code is refused by transformers, by name."""
    from transformers import AutoTokenizer

    folder = check_model_folder(path, config=False, weights=False)
    return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)


# The `model` field of an options dataclass: field(default=DEFAULT_MODEL, metadata=MODEL_METADATA).
MODEL_METADATA = {
    "help": "a local Hugging Face model folder (config.json, *.safetensors, tokenizer.json)",
    "default_text": f"{DEFAULT_MODEL_NAME}, shipped with Parkade",
}
# The `max_model_len` field of the executor's and the tokenizer's options (one setting of both).
MAX_MODEL_LEN_METADATA = {
    "help": "longest request, prompt + output; unset: the model's, or what the pool holds"
}
