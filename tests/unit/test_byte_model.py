"""The byte-level test model (tests/byte_model.py): a valid, reproducible Hugging Face folder that
Parkade serves, with a tokenizer family other than stories260K's."""

from __future__ import annotations

import pytest
import torch
from byte_model import BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE, make_byte_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from parkade import LLM, SamplingParams


@pytest.fixture(scope="module")
def byte_dir(tmp_path_factory):
    return make_byte_model(tmp_path_factory.mktemp("byte") / "model")


def test_loads_with_transformers(byte_dir):
    tokenizer = AutoTokenizer.from_pretrained(byte_dir)
    text = "Once upon a time, é 🙂"
    ids = tokenizer(text).input_ids
    assert ids[0] == BOS_TOKEN_ID
    assert len(ids) == 1 + len(text.encode())  # one token per byte, no merges
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID)

    model = AutoModelForCausalLM.from_pretrained(byte_dir)
    assert model.dtype == torch.float32
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), VOCAB_SIZE)
    assert model.generation_config.eos_token_id == EOS_TOKEN_ID


def test_serves_with_parkade(byte_dir):
    llm = LLM(byte_dir, max_model_len=64)
    [greedy] = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=12))
    [sampled] = llm.generate(["Once upon a time"], SamplingParams(seed=1, max_tokens=12, ignore_eos=True))
    assert len(greedy.outputs[0].token_ids) >= 1
    assert len(sampled.outputs[0].token_ids) == 12
    # The bias channel favours printable ASCII, so the text is pseudo-words, not replacement chars.
    text = sampled.outputs[0].text
    assert text.isascii() and len(set(text)) > 3, text


def test_chat_template_renders(byte_dir):
    tokenizer = AutoTokenizer.from_pretrained(byte_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"


def test_same_bytes_every_time(byte_dir, tmp_path):
    again = make_byte_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (byte_dir / name).read_bytes(), name
