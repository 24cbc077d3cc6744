"""The context rule (`services/common/context.py`): vLLM's refusals of a prompt, or a prompt with
its max_tokens, over max_model_len; and the lower bound on tokens from a text's length, which
must never refuse a prompt that would fit."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers

from parkade.models import DEFAULT_MODEL
from parkade.services.common.context import (
    EMPTY_PROMPT,
    ContextLengthError,
    TokenLowerBound,
    check_context_length,
    prompt_token_ids,
)
from parkade.services.common.model_files import load_tokenizer


@pytest.fixture(scope="module")
def stories():
    return load_tokenizer(DEFAULT_MODEL)


def test_max_tokens_over_the_context_is_refused_in_vllms_words():
    with pytest.raises(ContextLengthError) as error:
        check_context_length(7, 100_000, 512)
    assert str(error.value) == (
        "'max_tokens' is too large: 100000. This model's maximum context length is 512 tokens and "
        "your request has 7 input tokens (100000 > 512 - 7)."
    )
    assert error.value.param == "max_tokens"
    with pytest.raises(ContextLengthError, match=r"^'max_completion_tokens' is too large: 6\.") as error:
        check_context_length(507, 6, 512, max_tokens_name="max_completion_tokens")
    assert error.value.param == "max_completion_tokens"
    check_context_length(507, 5, 512)  # exactly the context
    check_context_length(512, None, 512)  # unset: the rest of the context (none here)
    check_context_length(10**6, 10**6, None)  # no limit known


def test_a_prompt_over_the_context_is_refused_with_its_count_or_its_bound():
    with pytest.raises(ContextLengthError) as error:
        check_context_length(513, None, 512)
    assert str(error.value) == (
        "This model's maximum context length is 512 tokens. However, your request has 513 input "
        "tokens. Please reduce the length of the input messages."
    )
    assert error.value.param is None  # the caller names its prompt field
    with pytest.raises(ContextLengthError, match="has at least 600 input tokens"):
        check_context_length(600, 1, 512, at_least=True)


def test_the_shipped_tokenizers_longest_token_bounds_its_counts(stories):
    bound = TokenLowerBound.from_tokenizer(stories)
    assert bound is not None and bound.max_token_chars == 7  # "▁friend"
    for text in ("friend friend friend", "a" * 1000, " " * 50, "</s><s><unk>" * 9, "ü€😀 x", "\n\t"):
        assert bound.min_tokens(text) <= len(stories.encode(text)), text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.sampled_from(
            ["friend", " friend", "Once", " upon", "</s>", "<s>", " ", "  ", "é", "😀", "\n", "ab"]
        )
        | st.text(max_size=12),
        max_size=40,
    ).map("".join)
)
def test_the_bound_never_exceeds_the_real_count_on_the_shipped_tokenizer(stories, text):
    bound = TokenLowerBound.from_tokenizer(stories)
    assert bound.min_tokens(text) <= len(stories.encode(text, add_special_tokens=False))


def tiny_tokenizer(**bpe) -> Tokenizer:
    """A byte-fallback BPE whose longest pieces are a 9-character added token (10 normalized:
    "▁abracadab") and "▁hello"."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ("▁", "h", "e", "l", "o", "he", "ll", "hell", "hello", "▁hello"):
        vocab[piece] = len(vocab)
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("▁", "hello")]
    tokenizer = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, **bpe))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.ByteFallback()
    tokenizer.add_special_tokens(["<|long|>"])  # 8 characters
    tokenizer.add_tokens(["abracadab"])  # 9
    return tokenizer


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(["hello", " hello", "<|long|>", "abracadab", " ", "x", "ü", "😀"]), max_size=30)
)
@example(["abracadab", " ", "abracadab"])  # the normalized added token: 2 tokens, 19 characters
def test_the_bound_holds_on_a_tiny_byte_fallback_tokenizer(words):
    tokenizer, text = tiny_tokenizer(), "".join(words)
    bound = TokenLowerBound.from_tokenizer(tokenizer)
    assert bound is not None and bound.max_token_chars == 10  # "▁abracadab", normalized
    assert bound.min_tokens(text) <= len(tokenizer.encode(text).ids)


def with_spec(tokenizer: Tokenizer, change) -> Tokenizer:
    spec = json.loads(tokenizer.to_str())
    change(spec)
    return Tokenizer.from_str(json.dumps(spec))


def test_no_bound_where_a_token_may_cover_any_number_of_characters():
    base = tiny_tokenizer()
    assert TokenLowerBound.from_tokenizer(base) is not None

    def no_fallback(spec):  # unknown text becomes one fused <unk>, whatever its length
        spec["model"]["byte_fallback"] = False

    def shortening(spec):  # NFC composes characters: the text the model sees may be shorter
        spec["normalizer"] = {"type": "NFC"}

    def dropping(spec):  # Whitespace drops the spaces: they become no token at all
        spec["pre_tokenizer"] = {"type": "Whitespace"}

    def stripping(spec):  # an added token that swallows the spaces before it
        spec["added_tokens"][0]["lstrip"] = True

    def wordpiece(spec):
        vocab = spec["model"]["vocab"]
        spec["model"] = {
            "type": "WordPiece",
            "unk_token": "<0x00>",
            "continuing_subword_prefix": "##",
            "max_input_chars_per_word": 100,
            "vocab": vocab,
        }

    for change in (no_fallback, shortening, dropping, stripping, wordpiece):
        assert TokenLowerBound.from_tokenizer(with_spec(base, change)) is None, change.__name__
    assert TokenLowerBound.from_tokenizer(object()) is None  # a slow tokenizer: nothing to read


def test_a_text_that_cannot_fit_is_refused_without_being_tokenized(stories):
    class Untokenizable:  # the shipped tokenizer's rules, and no encode()
        backend_tokenizer = stories.backend_tokenizer

    bound = TokenLowerBound.from_tokenizer(stories)
    checks = dict(bound=bound, vocab_size=512, max_model_len=512)
    with pytest.raises(ContextLengthError, match="has at least 572 input tokens"):
        prompt_token_ids(Untokenizable(), prompt="x" * 4000, **checks)
    with pytest.raises(ValueError, match=f"^{EMPTY_PROMPT}$"):
        prompt_token_ids(stories, prompt="", **checks)
    # The bound is not the count: a text under it is tokenized, and counted exactly.
    with pytest.raises(ContextLengthError, match=f"has {len(stories.encode('x' * 1000))} input tokens"):
        prompt_token_ids(stories, prompt="x" * 1000, **checks)
    # A prompt that is cut to its last tokens is never refused for its length.
    assert len(prompt_token_ids(stories, prompt="x" * 5000, truncate=-1, **checks)) == 512
