"""transformers as the reference: greedy generation with its own modeling code."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from parkade.models import DEFAULT_MODEL as STORIES  # the trained stories260K that ships with Parkade

__all__ = ["STORIES", "hf_greedy"]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """`generate(do_sample=False)` per prompt in fp32, cut after the first EOS."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new
            )
            tokens = gen[0, len(prompt) :].tolist()
            cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
            out.append(tokens[:cut])
    return out
