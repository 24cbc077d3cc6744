"""The demo model that `parkade up` serves without --model: a valid, reproducible HF folder."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from parkade import LLM, SamplingParams
from parkade.demo_model import BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE, ensure_demo_model


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_model(tmp_path_factory.mktemp("home") / "demo-model")


def test_loads_with_transformers(demo_dir):
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    text = "Once upon a time, é 🙂"
    ids = tokenizer(text).input_ids
    assert ids[0] == BOS_TOKEN_ID
    assert len(ids) == 1 + len(text.encode())  # one token per byte, no merges
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID)

    model = AutoModelForCausalLM.from_pretrained(demo_dir)
    assert model.dtype == torch.float32
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), VOCAB_SIZE)
    assert model.generation_config.eos_token_id == EOS_TOKEN_ID


def test_serves_with_parkade(demo_dir):
    llm = LLM(demo_dir, max_model_len=64)
    [greedy] = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=12))
    [sampled] = llm.generate(["Once upon a time"], SamplingParams(seed=1, max_tokens=12, ignore_eos=True))
    assert len(greedy.outputs[0].token_ids) >= 1
    assert len(sampled.outputs[0].token_ids) == 12
    # The bias channel favours printable ASCII, so the text is pseudo-words, not replacement chars.
    text = sampled.outputs[0].text
    assert text.isascii() and len(set(text)) > 3, text


def test_chat_template_renders(demo_dir):
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"


def test_same_bytes_every_time_and_reused(demo_dir, tmp_path):
    again = ensure_demo_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (demo_dir / name).read_bytes(), name

    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(again) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == ["again"]  # no temporary folder left behind


def test_refuses_a_folder_that_is_not_a_demo_model(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        ensure_demo_model(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
