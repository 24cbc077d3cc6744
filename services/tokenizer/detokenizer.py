"""Incremental detokenization and stop strings, for one request. Pure: no I/O.

Decoding tokens one at a time is wrong for two reasons: a SentencePiece-style decoder drops
the leading space of the first token it sees, and a multi-byte UTF-8 character split over
byte-fallback tokens decodes to U+FFFD until its last byte arrives. So each new token is decoded
together with a few tokens before it (the window `tokens[prefix_offset:]`), and text is emitted
only once it no longer ends in U+FFFD:

    tokens:  | ... prompt ... | out0 out1 out2 |
                   ^prefix_offset   ^read_offset
    new text = decode(tokens[prefix_offset:]) minus decode(tokens[prefix_offset:read_offset])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from parkade.schemas import SamplingParams

# Tokens of context decoded in front of new ones: enough for any decoder's leading-space rule.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def decoder(tokenizer: Any, *, skip_special_tokens: bool, **options: Any) -> Callable[[Sequence[int]], str]:
    """token ids -> `tokenizer.decode(ids, skip_special_tokens=..., **options)`, the same text;
    made once for a tokenizer and its settings, since a detokenizer decodes twice a token.

    Through the Rust tokenizer under a transformers fast tokenizer where that is all the wrapper
    does: its Python layers (argument handling, `to_py_obj` over the ids) cost more than the
    decoding of a few ids. Measured (transformers 5, tokenizers 0.23, a Zen 4 EPYC), five ids:
    1.35 us against 3.6 (the shipped tokenizer) and 4.7 (the anchors' tiny-llama), for each of
    the 2 x 8,192 decodes of a 64-stream round of 128 tokens: about 50 ms of the gateway's CPU,
    which shares the cores with the executor. The wrapper stays where it does more: a tokenizer
    that cleans up tokenization spaces (a Python pass over the text), a slow tokenizer (no Rust
    one). `options` are the wrapper's alone (`spaces_between_special_tokens`: a slow tokenizer's;
    a fast one's wrapper ignores it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if type(backend).__module__.startswith("tokenizers") and not getattr(
        tokenizer, "clean_up_tokenization_spaces", True
    ):

        def direct(token_ids: Sequence[int]) -> str:
            return backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

        return direct

    def through_wrapper(token_ids: Sequence[int]) -> str:
        return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens, **options)

    return through_wrapper


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        # spaces_between_special_tokens: transformers' option; NOTE: a fast (Rust) tokenizer joins
        # tokens by its own decoder and ignores it, as vLLM's fast detokenizer does.
        self._decode = decoder(
            tokenizer, skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )  # fmt: skip
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.num_output_tokens = 0
        self.output_text = ""
        # A stop string may straddle deltas: hold back what could be its beginning.
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    @classmethod
    def for_request(
        cls, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> IncrementalDetokenizer:
        """A detokenizer with the request's stop strings and decoding options."""
        return cls(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    def add_tokens(self, token_ids: Sequence[int]) -> str | None:
        """Append new output tokens. Returns the stop string that matched, if one did; the text
        is then cut at it (after it, with include_stop_str_in_output)."""
        for token_id in token_ids:
            self.tokens.append(token_id)
            self.num_output_tokens += 1
            prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
            new_text = self._decode(self.tokens[self.prefix_offset :])
            if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
                continue  # an incomplete character, or a token that decodes to nothing yet
            start = len(self.output_text)
            self.output_text += new_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            if self.stop and self.num_output_tokens > self.min_tokens:
                matched = self._find_stop(start)
                if matched is not None:
                    return matched
        return None

    def _find_stop(self, new_text_start: int) -> str | None:
        """Earliest stop string that ends inside the new text; truncates output_text there."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.output_text.find(stop, max(0, new_text_start - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        return stop

    def text(self, finished: bool) -> str:
        """The text to show so far: all of it once finished; before that, less the tail that
        could still become a stop string. It only grows (a stop string starts after it)."""
        if finished or not self.stop:
            return self.output_text
        return self.output_text[: max(0, len(self.output_text) - self._holdback)]
