"""The models that ship inside Parkade, as package data.

`DEFAULT_MODEL` is the trained stories260K Llama (MIT; see `stories260K/README.md`): what
`parkade up`, `parkade offline`, `LLM()` and the tests serve unless they are given a folder.
Parkade loads local Hugging Face folders only; there is no model hub download.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent / "stories260K"
DEFAULT_MODEL_NAME = "stories260K"
