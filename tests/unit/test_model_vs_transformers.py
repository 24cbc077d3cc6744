"""Parkade's decoder over the paged KV pool against transformers' own modeling code.

Prefill logits, then decode steps that read the K/V written by earlier steps, must equal the logits
transformers computes for the whole sequence at once (fp32, atol 1e-4).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import EOS_TOKEN_IDS, make_tiny_model
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from parkade.kernels import attention_cpu, attention_torch, linear_cpu
from parkade.kernels.metadata import AttentionMetadata
from parkade.models import DEFAULT_MODEL as STORIES
from parkade.services.common.model_config import ModelConfig
from parkade.services.executor.model import DecoderLM, load_model
from parkade.services.executor.weights import checkpoint_files

BLOCK_SIZE = 4
NUM_BLOCKS = 48
ATOL = 1e-4

Request = tuple[list[int], int, list[int]]  # (block ids, first position, token ids to compute)


class PagedRunner:
    """Runs steps of our model over a KV pool, building AttentionMetadata as the executor does."""

    def __init__(self, model: DecoderLM) -> None:
        cfg = model.config
        shape = (NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        self.model = model
        self.kv_caches = [
            (torch.zeros(shape, dtype=cfg.dtype), torch.zeros(shape, dtype=cfg.dtype))
            for _ in range(cfg.num_hidden_layers)
        ]

    def step(self, requests: list[Request]) -> torch.Tensor:
        """Compute all requests' tokens in one batch; -> logits [num_tokens, vocab]."""
        ids, positions, slots = [], [], []
        for blocks, start, tokens in requests:
            for pos in range(start, start + len(tokens)):
                positions.append(pos)
                slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            ids += tokens
        query_lens = tuple(len(t) for _, _, t in requests)
        seq_lens = tuple(start + len(t) for _, start, t in requests)
        width = max(len(b) for b, _, _ in requests)
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seqused_k=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=torch.tensor([b + [0] * (width - len(b)) for b, _, _ in requests], dtype=torch.int32),
            max_seqlen_q=max(query_lens),
            max_seqlen_k=max(seq_lens),
            query_lens=query_lens,
            seq_lens=seq_lens,
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, md)
            return self.model.compute_logits(hidden)


def scattered_blocks(n: int, seed: int = 0) -> list[int]:
    """n distinct physical block ids in a shuffled order, so the block table really matters."""
    return torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))[:n].tolist()


def hf_logits(path: Path, token_ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0].float()


def check_prefill_then_decode(
    path: Path, prompt_len: int = 20, decode_steps: int = 4, chunk: int = 0, backend=attention_torch
) -> None:
    """Prefill (in chunks of `chunk` tokens if > 0), then decode one token at a time."""
    model = load_model(ModelConfig.from_pretrained(path), torch.device("cpu"), backend)
    vocab = model.config.vocab_size
    tokens = torch.randint(4, vocab, (prompt_len + decode_steps,), generator=torch.Generator().manual_seed(1))
    tokens = tokens.tolist()
    expected = hf_logits(path, tokens)
    runner = PagedRunner(model)
    blocks = scattered_blocks(-(-len(tokens) // BLOCK_SIZE))
    chunk = chunk or prompt_len
    prefill = [
        runner.step([(blocks, s, tokens[s : min(s + chunk, prompt_len)])])
        for s in range(0, prompt_len, chunk)
    ]
    torch.testing.assert_close(torch.cat(prefill), expected[:prompt_len], atol=ATOL, rtol=0)
    for pos in range(prompt_len, len(tokens)):
        logits = runner.step([(blocks, pos, [tokens[pos]])])
        torch.testing.assert_close(logits[0], expected[pos], atol=ATOL, rtol=0)


LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}  # fmt: skip
MODEL_CASES = {
    "llama-gqa": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-mqa-3-layers": ("llama", {"num_key_value_heads": 1, "num_hidden_layers": 3}),
    "llama-attention-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "qwen2-bias": ("qwen2", {}),
    "qwen2-linear-rope": (
        "qwen2",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}},
    ),
    "qwen2-sliding-upper-layer": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
    ),
    "mistral-sliding-window": ("mistral", {"sliding_window": 8}),
}


@pytest.mark.parametrize("backend", [attention_torch, attention_cpu], ids=["torch", "cpu"])
@pytest.mark.parametrize("case", MODEL_CASES)
def test_prefill_and_decode_match_transformers(tmp_path, case, backend):
    family, overrides = MODEL_CASES[case]
    check_prefill_then_decode(make_tiny_model(tmp_path, family, **overrides), backend=backend)


def test_chunked_prefill_matches_transformers(tmp_path):
    check_prefill_then_decode(make_tiny_model(tmp_path, "mistral", sliding_window=5), chunk=7)


def test_stories260k_matches_transformers():
    check_prefill_then_decode(STORIES, prompt_len=11, decode_steps=6)


def test_stories260k_greedy_story_matches_transformers():
    """The trained model's greedy story from "<s> Once upon a time", checked against transformers."""
    prompt, new = [1, 403, 407, 261, 378], 24
    runner = PagedRunner(load_model(ModelConfig.from_pretrained(STORIES), "cpu"))
    blocks = scattered_blocks(-(-(len(prompt) + new) // BLOCK_SIZE))
    tokens = list(prompt)
    logits = runner.step([(blocks, 0, tokens)])
    while len(tokens) < len(prompt) + new:
        tokens.append(int(logits[-1].argmax()))
        logits = runner.step([(blocks, len(tokens) - 1, tokens[-1:])])
    # Teacher-forced, one forward: transformers' greedy choice at every step is our token.
    expected = hf_logits(STORIES, tokens)[len(prompt) - 1 : -1].argmax(-1)
    assert expected.tolist() == tokens[len(prompt) :]
    text = Tokenizer.from_file(str(STORIES / "tokenizer.json")).decode(tokens)
    assert text.startswith("Once upon a time, there was a little girl named Lily.")


def test_mixed_batch_equals_separate_runs(tmp_path):
    """A decode and a prefill chunk in one step give the same logits as in separate steps."""
    model = load_model(ModelConfig.from_pretrained(make_tiny_model(tmp_path, "llama")), "cpu")
    a, b = list(range(10, 23)), list(range(40, 49))  # request a: 12 prompt + 1 decode; b: 9 prompt
    blocks_a, blocks_b = [3, 17, 8, 30], [21, 5, 11]
    alone = PagedRunner(model)
    alone.step([(blocks_a, 0, a[:12])])
    expected = torch.cat([alone.step([(blocks_a, 12, a[12:])]), alone.step([(blocks_b, 0, b)])])
    batched = PagedRunner(model)
    batched.step([(blocks_a, 0, a[:12])])
    torch.testing.assert_close(
        batched.step([(blocks_a, 12, a[12:]), (blocks_b, 0, b)]), expected, atol=1e-5, rtol=0
    )


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    single = make_tiny_model(tmp_path / "single", "qwen2")
    sharded = make_tiny_model(tmp_path / "sharded", "qwen2", max_shard_size="20KB")
    assert len(checkpoint_files(sharded)) > 1
    request = [(scattered_blocks(3), 0, list(range(5, 15)))]
    logits = [
        PagedRunner(load_model(ModelConfig.from_pretrained(p), "cpu")).step(request)
        for p in (single, sharded)
    ]
    assert torch.equal(logits[0], logits[1])


def test_bfloat16_load_is_close_to_float32(tmp_path):
    path = make_tiny_model(tmp_path, "llama")
    fp32 = load_model(ModelConfig.from_pretrained(path), "cpu")
    bf16 = load_model(ModelConfig.from_pretrained(path, dtype="bfloat16"), "cpu")
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    request = [(scattered_blocks(3), 0, list(range(5, 15)))]
    ref, low = PagedRunner(fp32).step(request), PagedRunner(bf16).step(request)
    assert low.dtype == torch.float32
    assert (ref - low).abs().max() < 0.25 * ref.abs().max()
    assert (ref.argmax(-1) == low.argmax(-1)).float().mean() >= 0.8


def test_fp32_matmuls_compute_what_bf16_matmuls_do(tmp_path):
    """The upcast weights of a CPU without bf16 GEMMs: the same bf16 model, the same logits up to the
    summation order of the products, while norms, RoPE and the KV cache stay bf16."""
    path = make_tiny_model(tmp_path, "llama", tie_word_embeddings=True)
    config = ModelConfig.from_pretrained(path, dtype="bfloat16")
    native, upcast = load_model(config, "cpu"), load_model(config, "cpu")
    upcast.use_fp32_matmuls()
    attn = upcast.model.layers[0].self_attn
    assert attn.q_proj.weight.dtype == torch.float32 and upcast.logits_weight.dtype == torch.float32
    assert upcast.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(attn.q_proj.weight.bfloat16(), native.model.layers[0].self_attn.q_proj.weight)
    blocks = scattered_blocks(4)
    tokens = list(range(5, 17))
    runners = PagedRunner(native), PagedRunner(upcast)
    assert runners[1].kv_caches[0][0].dtype == torch.bfloat16
    for first, chunk in ((0, tokens[:10]), (10, tokens[10:11]), (11, tokens[11:])):
        a, b = (r.step([(blocks, first, chunk)]) for r in runners)
        assert (a - b).abs().max() <= 0.02 * a.abs().max()
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.skipif(
    not linear_cpu.serves(torch.bfloat16),
    reason="a packed-linear kernel serves only on a CPU with AMX tiles or AVX512-BF16",
)
@pytest.mark.parametrize(
    ("family", "overrides"),
    [("llama", {}), ("llama", {"tie_word_embeddings": True}), ("qwen2", {})],  # qwen2: q/k/v biases
    ids=["llama", "llama-tied", "qwen2-bias"],
)
def test_a_model_on_packed_linears_computes_the_same_logits(tmp_path, family, overrides):
    """Prefill then decode of a bf16 model: the packed model's logits equal the unpacked one's, bit
    for bit (q/k/v and gate/up concatenated change no output column), and the modules they replace
    are gone."""
    path = make_tiny_model(tmp_path, family, **overrides)
    config = ModelConfig.from_pretrained(path, dtype="bfloat16")
    plain, packed = load_model(config, "cpu"), load_model(config, "cpu")
    packed.use_packed_linears()
    attn = packed.model.layers[0].self_attn
    assert attn.q_proj is None and attn.qkv_proj is not None and packed.lm_head is None
    assert packed.model.layers[0].mlp.gate_up_proj.splits == [config.intermediate_size] * 2
    runners = PagedRunner(plain), PagedRunner(packed)
    blocks, tokens = scattered_blocks(5), list(range(5, 19))
    for first, chunk in ((0, tokens[:12]), (12, tokens[12:13]), (13, tokens[13:])):
        a, b = (r.step([(blocks, first, chunk)]) for r in runners)
        assert torch.equal(a, b)
    # oneDNN's packed copy replaces the plain weight (two copies of the weights, not three), and
    # serves a step of more rows than the kernel takes (AVX512-BF16: 64), its sums maybe in another
    # order: the logits within bf16 rounding, the same tokens.
    assert attn.qkv_proj.weight is None and attn.qkv_proj.onednn >= 0
    long = [(7 * i) % config.vocab_size for i in range(100)]
    blocks = scattered_blocks(25, seed=1)
    a, b = (PagedRunner(model).step([(blocks, 0, long)]) for model in (plain, packed))
    assert (a - b).abs().max() <= 0.02 * a.abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_the_executor_upcasts_only_where_the_cpu_lacks_bf16_matmuls_and_only_when_asked(tmp_path):
    from parkade.services.executor.build import build_executor
    from parkade.services.executor.executor import cpu_has_native_matmul
    from parkade.services.executor.options import ExecutorOptions

    path = make_tiny_model(tmp_path, "llama")
    for upcast in (True, False):
        options = ExecutorOptions(model=path, dtype="bfloat16", device="cpu", cpu_matmul_upcast=upcast)
        executor, _ = build_executor(options)
        expected = upcast and not cpu_has_native_matmul(torch.bfloat16)
        assert executor.fp32_matmuls is expected
        assert executor.packed_linears is (not expected and linear_cpu.serves(torch.bfloat16))
        mlp = executor.model.model.layers[0].mlp
        weight = mlp.gate_up_proj.packed if executor.packed_linears else mlp.up_proj.weight
        assert weight.dtype == (torch.float32 if expected else torch.bfloat16)


# --- errors -----------------------------------------------------------------------------------


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    path = make_tiny_model(tmp_path, "llama")
    _edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(
        ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM"
    ):
        ModelConfig.from_pretrained(path)


def test_unsupported_rope_type_raises(tmp_path):
    path = make_tiny_model(tmp_path, "llama")
    _edit_config(path, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_pretrained(path)


def test_missing_and_unexpected_weights_are_named(tmp_path):
    path = make_tiny_model(tmp_path, "llama")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"up_proj.*self_attn\.extra"):
        load_model(ModelConfig.from_pretrained(path), "cpu")


def test_no_weights_is_a_clear_error(tmp_path):
    path = make_tiny_model(tmp_path, "llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_model(ModelConfig.from_pretrained(path), "cpu")


# --- config parsing ---------------------------------------------------------------------------


def test_config_fields_of_stories260k():
    cfg = ModelConfig.from_pretrained(STORIES)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 4, 8)
    assert cfg.tie_word_embeddings and cfg.dtype == torch.float32 and cfg.sliding_window is None
    assert cfg.bos_token_id == 1
    assert cfg.eos_token_ids == (2, 1)  # config's 2, then generation config's [2, 1]


def test_config_families(tmp_path):
    llama = ModelConfig.from_pretrained(make_tiny_model(tmp_path, "llama"))
    assert llama.eos_token_ids == EOS_TOKEN_IDS
    assert not llama.qkv_bias and llama.sliding_window is None
    qwen = ModelConfig.from_pretrained(make_tiny_model(tmp_path, "qwen2", sliding_window=16))
    assert qwen.qkv_bias and not qwen.o_proj_bias
    assert qwen.sliding_window is None  # use_sliding_window is false
    mistral = ModelConfig.from_pretrained(make_tiny_model(tmp_path, "mistral", sliding_window=None))
    assert mistral.sliding_window is None and mistral.layer_sliding_window(0) is None
    assert (
        ModelConfig.from_pretrained(make_tiny_model(tmp_path, "mistral", seed=1)).layer_sliding_window(1) == 8
    )


def test_dtype_resolution(tmp_path):
    path = make_tiny_model(tmp_path, "llama")
    assert ModelConfig.from_pretrained(path, dtype=torch.float16).dtype == torch.float16
    _edit_config(path, dtype=None, torch_dtype="bfloat16")
    assert ModelConfig.from_pretrained(path).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float64"):
        ModelConfig.from_pretrained(path, dtype="float64")


def test_old_style_rope_keys_match_transformers(tmp_path):
    """Pre-v5 configs keep `rope_theta` and `rope_scaling` at the top level."""
    path = make_tiny_model(tmp_path, "llama")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["rope_parameters"]
    cfg.update(rope_theta=2000.0, rope_scaling={"type": "linear", "factor": 3.0})
    (path / "config.json").write_text(json.dumps(cfg))
    rope = ModelConfig.from_pretrained(path).rope
    assert (rope.theta, rope.rope_type, rope.factor) == (2000.0, "linear", 3.0)
    check_prefill_then_decode(path, prompt_len=9, decode_steps=2)
