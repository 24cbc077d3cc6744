"""`SamplingParams`: how one request's tokens are chosen and when it stops.

Field names and defaults follow vLLM's `SamplingParams`, so that vLLM scripts run unchanged.
Validation runs in `__post_init__`, which msgspec calls both on construction and on decode:
a bad value raises `ValueError` (construction) or `msgspec.ValidationError` (decode) whose
message names the field and the allowed range.
"""

from __future__ import annotations

import msgspec

# NOTE: vLLM's default `max_logprobs`; a larger request is refused rather than silently cut.
MAX_LOGPROBS = 20
_SEED_LIMIT = 2**63


def _check(ok: bool, field: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field} must be {allowed}, got {value!r}")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Sampling and stopping rules of one request.

    temperature == 0 means greedy decoding (argmax); then top_p/top_k/min_p are ignored.
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

    def __post_init__(self) -> None:
        # vLLM accepts `stop="x"` and lists; store a tuple so the struct stays hashable.
        if isinstance(self.stop, str):
            msgspec.structs.force_setattr(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            msgspec.structs.force_setattr(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
