import random
from unittest import mock

import pytest
from transformers import AutoTokenizer

from parkade.models import DEFAULT_MODEL as STORIES
from parkade.services.tokenizer.detokenizer import IncrementalDetokenizer, decoder


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(STORIES))


@pytest.mark.parametrize(
    "text",
    [
        "Once upon a time, there was a little girl named Lily.",
        "héllo wörld: 😀 and 世界 and ü",  # multi-byte UTF-8 through byte-fallback tokens
        "  leading spaces\nand\ttabs  ",
        "😀😀",
    ],
)
def test_incremental_text_equals_whole_decode(tok, text):
    prompt = tok.encode("Tell me:")
    output = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    shown = ""
    for token_id in output:
        assert detok.add_tokens([token_id]) is None
        text = detok.text(finished=False)
        assert "\ufffd" not in text, "a partial character escaped"
        assert text.startswith(shown)  # streamed text only grows
        shown = text
    whole = tok.decode(prompt + output, skip_special_tokens=True)
    assert whole.endswith(detok.output_text)
    assert detok.text(finished=True) == detok.output_text
    assert detok.output_text.strip() == text.strip()


def test_byte_fallback_tokens_are_held_until_the_character_completes(tok):
    output = tok.encode("😀", add_special_tokens=False)
    byte_tokens = [t for t in output if tok.convert_ids_to_tokens(t).startswith("<0x")]
    assert len(byte_tokens) == 4  # the emoji is four UTF-8 bytes, one token each
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    texts = []
    for token_id in output:
        detok.add_tokens([token_id])
        texts.append(detok.output_text)
    assert texts[-2].endswith("\ufffd") is False and "😀" not in texts[-2]
    assert texts[-1].endswith("😀")


def split(tok, text: str, prompt_words: int = 1) -> tuple[list[int], list[int]]:
    """Token ids of `text` split after its first word, as a prompt and its continuation."""
    ids = tok.encode(text)
    n = len(tok.encode(" ".join(text.split(" ")[:prompt_words])))
    return ids[:n], ids[n:]


def test_stop_string_cuts_the_text_and_is_found_across_tokens(tok):
    prompt, output = split(tok, "Once there was a little girl named Lily. She")
    detok = IncrementalDetokenizer(tok, prompt, stop=("girl named",))
    matched = None
    for token_id in output:
        matched = detok.add_tokens([token_id])
        if matched:
            break
    assert matched == "girl named"
    assert detok.output_text == " there was a little "
    with_stop = IncrementalDetokenizer(tok, prompt, stop=("girl named",), include_stop_str_in_output=True)
    for token_id in output:
        if with_stop.add_tokens([token_id]):
            break
    assert with_stop.output_text == " there was a little girl named"


def test_streaming_holds_back_a_possible_stop_string_prefix(tok):
    prompt, output = split(tok, "Once named Lily")
    detok = IncrementalDetokenizer(tok, prompt, stop=("Lily!",))
    detok.add_tokens(output)
    assert detok.output_text == " named Lily"
    # "Lily" could still become "Lily!": the last len("Lily!") - 1 = 4 characters wait.
    assert detok.text(finished=False) == " named "
    assert detok.text(finished=True) == " named Lily"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decoder_gives_the_wrappers_text_without_calling_it(tok, monkeypatch, skip_special_tokens):
    rng = random.Random(0)
    windows = [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(8))] for _ in range(500)]
    windows += [[tok.bos_token_id, *tok.encode(" héllo 😀", add_special_tokens=False), tok.eos_token_id]]
    expected = [tok.decode(ids, skip_special_tokens=skip_special_tokens) for ids in windows]
    # A fast tokenizer that does not clean up spaces: the Rust decoder, never the wrapper.
    monkeypatch.setattr(type(tok), "decode", lambda *args, **kwargs: pytest.fail("the wrapper was called"))
    decode = decoder(tok, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=True)
    assert [decode(ids) for ids in windows] == expected


def test_decoder_keeps_the_wrapper_where_it_does_more(monkeypatch):
    class Slow:  # a tokenizer without a Rust one (a slow tokenizer's place)
        decode = mock.Mock(return_value="text")

    slow, options = Slow(), {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    assert decoder(slow, **options)([1, 2]) == "text"
    slow.decode.assert_called_once_with([1, 2], **options)
    # A fast tokenizer that cleans up spaces: its wrapper does that in Python after the Rust decode.
    cleaning = AutoTokenizer.from_pretrained(str(STORIES), clean_up_tokenization_spaces=True)
    monkeypatch.setattr(cleaning, "decode", mock.Mock(return_value="cleaned"))
    assert decoder(cleaning, skip_special_tokens=True)([5, 6]) == "cleaned"
    cleaning.decode.assert_called_once_with([5, 6], skip_special_tokens=True)
