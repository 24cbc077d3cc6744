"""`SamplingParams`: how one request's tokens are chosen and when it stops.

Field names and defaults follow vLLM's `SamplingParams`, so that vLLM scripts run unchanged.
Validation runs in `__post_init__`, which msgspec calls both on construction and on decode:
a bad value raises `ValueError` (construction) or `msgspec.ValidationError` (decode) whose
message names the field and the allowed range.
"""

from __future__ import annotations

import enum

import msgspec

# NOTE: vLLM's default `max_logprobs`; a larger request is refused rather than silently cut.
MAX_LOGPROBS = 20
_SEED_LIMIT = 2**63
# vLLM's clamp of a logit_bias value (OpenAI's documented range).
MAX_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.IntEnum):
    """What a streaming Python API yields (vLLM's values). The tokens topic always carries deltas
    (each event's new tokens and text), except FINAL_ONLY: one event per sample, at its end."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # only what is new
    FINAL_ONLY = 2  # nothing until the end


# vLLM's _SAMPLING_EPS: a temperature below it samples greedily. Dividing by it could overflow
# float32 logits to inf (or, below 1.2e-38, round it to 0), where sampling means nothing.
SAMPLING_EPS = 1e-5


def _check(ok: bool, field: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field} must be {allowed}, got {value!r}")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Sampling and stopping rules of one request.

    A temperature below 1e-5 (0 included) means greedy decoding (argmax), as in vLLM;
    then top_p/top_k/min_p are ignored.
    `logprobs=None` returns no logprobs; `logprobs=k` returns the sampled token's logprob and
    the k most likely tokens' (k may be 0).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until EOS or max_model_len
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # ---- appended fields (the wire evolves by appending) ----
    n: int = 1  # samples of the prompt; they share its KV blocks (see the README)
    prompt_logprobs: int | None = None  # like logprobs, for every prompt token but the first
    spaces_between_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, no text (and no stop strings)
    # Keep only the last k prompt tokens (-1: as many as max_model_len allows).
    truncate_prompt_tokens: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled
    # Words that may not be generated: the front end tokenizes them into `bad_words_token_ids`.
    bad_words: tuple[str, ...] = ()
    # Token sequences that may not be generated (the last token of one is banned when the output
    # ends with the others); filled from `bad_words` by the front end, or given as ids.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # vLLM accepts `stop="x"` and lists; store tuples so the struct stays comparable.
        for name in ("stop", "bad_words"):
            value = getattr(self, name)
            if isinstance(value, str):
                msgspec.structs.force_setattr(self, name, (value,))
            elif not isinstance(value, tuple):
                msgspec.structs.force_setattr(self, name, tuple(value))
        if not isinstance(self.stop_token_ids, tuple):
            msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, tuple):
            msgspec.structs.force_setattr(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if not (
            isinstance(self.bad_words_token_ids, tuple)
            and all(isinstance(w, tuple) for w in self.bad_words_token_ids)
        ):
            msgspec.structs.force_setattr(
                self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids)
            )
        if self.logit_bias is not None:
            # JSON object keys arrive as strings from some clients; the ids are ints.
            msgspec.structs.force_setattr(
                self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()}
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            msgspec.structs.force_setattr(self, "output_kind", RequestOutputKind(self.output_kind))
        _check(self.temperature >= 0.0, "temperature", ">= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", "-1, 0 (disabled) or >= 1", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "> 0", self.repetition_penalty)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        _check(
            -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]", self.frequency_penalty
        )
        if self.seed is not None:
            _check(-_SEED_LIMIT <= self.seed < _SEED_LIMIT, "seed", "a 64-bit signed integer", self.seed)
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", ">= 1 or None", self.max_tokens)
        _check(self.min_tokens >= 0, "min_tokens", ">= 0", self.min_tokens)
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"<= max_tokens ({self.max_tokens})",
                self.min_tokens,
            )
        _check(all(s for s in self.stop), "stop", "non-empty strings", self.stop)
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "ids >= 0", self.stop_token_ids)
        if self.logprobs is not None:
            _check(
                0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"in [0, {MAX_LOGPROBS}] or None",
                self.logprobs,
            )
        _check(self.n >= 1, "n", ">= 1", self.n)
        if self.prompt_logprobs is not None:
            _check(
                0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"in [0, {MAX_LOGPROBS}] or None",
                self.prompt_logprobs,
            )
        if self.truncate_prompt_tokens is not None:
            _check(
                self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1,
                "truncate_prompt_tokens",
                ">= 1, -1 (max_model_len) or None",
                self.truncate_prompt_tokens,
            )
        if self.logit_bias is not None:
            bad = {
                k: v
                for k, v in self.logit_bias.items()
                if k < 0 or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS
            }
            _check(
                not bad,
                "logit_bias",
                f"token ids >= 0 with values in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
                bad,
            )
        if self.allowed_token_ids is not None:
            _check(
                bool(self.allowed_token_ids) and min(self.allowed_token_ids) >= 0,
                "allowed_token_ids",
                "a non-empty list of ids >= 0",
                self.allowed_token_ids,
            )
        _check(all(w for w in self.bad_words), "bad_words", "non-empty strings", self.bad_words)
        _check(
            all(w and min(w) >= 0 for w in self.bad_words_token_ids),
            "bad_words_token_ids",
            "non-empty sequences of ids >= 0",
            self.bad_words_token_ids,
        )
        if not self.detokenize:
            _check(
                not self.stop, "stop", "empty when detokenize is False (stop strings need text)", self.stop
            )

    def clone(self) -> SamplingParams:
        """A copy (vLLM's `clone`; the struct is immutable, so a shallow copy is a deep one, but
        for `logit_bias`, copied too)."""
        bias = None if self.logit_bias is None else dict(self.logit_bias)
        return msgspec.structs.replace(self, logit_bias=bias)

    def vocab_checks(self, vocab_size: int) -> None:
        """Raise ValueError for token ids outside a model's vocabulary (the front end calls it)."""
        for name, ids in (
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("logit_bias", tuple(self.logit_bias or ())),
            ("bad_words_token_ids", tuple(t for w in self.bad_words_token_ids for t in w)),
        ):
            _check(
                all(t < vocab_size for t in ids),
                name,
                f"ids in [0, {vocab_size}) (the model's vocab_size)",
                ids,
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
