"""A tiny random Llama with a byte-level tokenizer and a chat template, for the tests that need a
model unlike stories260K: another tokenizer family (GPT-2's byte-level BPE rather than
SentencePiece with byte fallback), other shapes, and a chat template (stories260K has none).

    path = make_byte_model(tmp_path / "byte")

A Hugging Face folder like any other (config.json, model.safetensors, tokenizer files,
generation_config.json), made from a fixed seed, so the same bytes come out on every machine.
Its weights are random: its text is meaningless.

Vocabulary: `<unk>` = 0, `<s>` = 1 (BOS, added by the tokenizer), `</s>` = 2 (EOS), then the 256
byte tokens, byte b at id 3 + b (GPT-2's byte-level alphabet, no merges).
"""

from __future__ import annotations

from pathlib import Path

SEED = 0
BOS_TOKEN_ID, EOS_TOKEN_ID = 1, 2
NUM_SPECIAL = 3
VOCAB_SIZE = NUM_SPECIAL + 256

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def make_byte_model(directory: str | Path) -> Path:
    """Write the model into `directory` (created); -> the folder."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    _write_model(out)
    return out


def _write_model(out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        dtype="float32",
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32)
    _redraw_weights(model, torch.Generator().manual_seed(SEED))
    config.save_pretrained(out)
    # NOTE: safetensors directly rather than save_pretrained: same bytes, no progress bar on stderr.
    save_file(model.state_dict(), str(out / "model.safetensors"), metadata={"format": "pt"})
    GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID).save_pretrained(out)
    _byte_tokenizer().save_pretrained(out)


def _redraw_weights(model, generator) -> None:
    """Replace transformers' init (std 0.02: every position predicts nearly the same token) with
    larger random weights, in a fixed order from `generator`.

    NOTE: a bias channel. Hidden dimension 0 of the residual stream holds the same constant for
    every token: its embedding column is constant and no layer writes to it (row 0 of every
    o_proj and down_proj is zero). After the final norm it is a positive number at every position,
    so lm_head's column 0 acts as a per-token logit bias, which we use to favour lowercase letters
    and spaces and to make control and non-ASCII bytes (mostly invalid UTF-8 alone) and EOS rare.
    The text stays meaningless but prints as pseudo-words instead of replacement characters.
    """
    import torch

    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.15 * torch.randn(param.shape, generator=generator))
        inner = model.model
        inner.embed_tokens.weight[:, 0] = 0.5
        for layer in inner.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        inner.norm.weight[0] = 5.0  # the channel comes out of the final norm near 1
        model.lm_head.weight[:, 0] = torch.tensor([_logit_bias(i) for i in range(VOCAB_SIZE)])


def _logit_bias(token_id: int) -> float:
    """lm_head's weight on the bias channel for one token (see `_redraw_weights`)."""
    if token_id == EOS_TOKEN_ID:
        return -2.0
    if token_id < NUM_SPECIAL:
        return -5.0
    char = chr(token_id - NUM_SPECIAL)
    if char == " ":
        return 3.0
    if "a" <= char <= "z":
        return 2.0
    if char.isascii() and char.isprintable():
        return -1.0
    return -5.0


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (what the ByteLevel pre-tokenizer uses)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)}
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({char: NUM_SPECIAL + b for b, char in _bytes_to_unicode().items()})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_TOKEN_ID)]
    )
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=512,
        chat_template=CHAT_TEMPLATE,
    )
