"""Beam search, as vLLM's offline `LLM.beam_search`: `BeamSearchParams` in, one `BeamSearchOutput`
per prompt out, each with the `beam_width` best sequences.

One step of the search is one `LLM.generate` call: every live beam is a request whose prompt is
the beam's whole token sequence, with max_tokens=1 and logprobs=2*beam_width. Each beam becomes
its candidates (the beam + one of the tokens of its logprobs, the cumulative logprob summed), and
the best beam_width candidates of each prompt are its next live beams.

Beams share their prefix blocks through the prefix cache (on by default), not through a special
path: a full block is found by the hash chained over all the blocks before it, so a beam's request
hits every full block of the sequence its parent computed a step earlier, and the sibling beams of
one parent hit the same physical blocks. Each step computes only the tokens after the last full
block of each beam (block_size 4 below):

    prompt + generated  [b0: The dog was a][b1: big red ball .][b2: He|        beam A
                        [b0: The dog was a][b1: big red ball .][b2: She|       beam B
                        '------- cached, shared: hit ---------'  computed this step

Torch-free: `parkade.sampling_params` imports `BeamSearchParams` from here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from parkade.engine.outputs import Logprob
from parkade.schemas.sampling import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from parkade.engine.llm import LLM
    from parkade.services.tokenizer.frontend import PromptType

__all__ = [
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "beam_search",
    "get_beam_search_score",
]

# Each step asks for 2 * beam_width logprobs (transformers' and vLLM's candidate count), and a
# request may ask for at most MAX_LOGPROBS.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


def _check(ok: bool, name: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class BeamSearchParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """vLLM's `BeamSearchParams`: the same fields, defaults and positional order.

    `temperature` only picks the sampled token that joins each beam's candidates (see
    `beam_search`); `include_stop_str_in_output` is accepted and, as in vLLM's offline
    `LLM.beam_search`, changes nothing. A bad value raises ValueError naming the field."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check(
            _is_int(self.beam_width) and 1 <= self.beam_width <= MAX_BEAM_WIDTH,
            "beam_width",
            f"an int in [1, {MAX_BEAM_WIDTH}] (each step asks for 2 * beam_width logprobs, at most "
            f"{MAX_LOGPROBS})",
            self.beam_width,
        )
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an int >= 1", self.max_tokens
        )
        _check(self.temperature >= 0.0, "temperature", ">= 0", self.temperature)
        # NaN or infinity would make every score NaN or 0, and the ranking meaningless.
        _check(math.isfinite(self.length_penalty), "length_penalty", "finite", self.length_penalty)


@dataclass
class BeamSearchSequence:
    """One beam. `tokens` holds the prompt and the generated tokens; `logprobs` one dict per
    generated position (token id -> `Logprob`: every candidate of that step, as vLLM's);
    `cum_logprob` the sum of the generated tokens' logprobs. `text` is set on the returned
    sequences only: as vLLM's offline API, the decoded `tokens`, prompt and special tokens
    included. finish_reason: "stop" (ended with an EOS token, `stop_reason`) or "length"."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The `beam_width` best sequences of one prompt, best (highest `get_beam_search_score`) first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: Sequence[int],
    cumulative_logprob: float,
    eos_token_id: int | Collection[int],
    length_penalty: float = 1.0,
) -> float:
    """vLLM's (and transformers') length-penalized score, vLLM's signature: cumulative_logprob /
    seq_len ** length_penalty, where seq_len counts the prompt too but not a final EOS token
    (`eos_token_id`: one id, or all of a model's)."""
    eos = (eos_token_id,) if isinstance(eos_token_id, int) else eos_token_id
    seq_len = len(tokens) - (1 if tokens and tokens[-1] in eos else 0)
    return cumulative_logprob / (seq_len**length_penalty)


@dataclass
class _Instance:
    """The search of one prompt: its live beams and the ones that ended."""

    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)
    # {"cache_salt": ...} when the prompt has one: every step's requests carry it, so that salted
    # blocks are shared only with the same salt.
    salt: dict[str, str] = field(default_factory=dict)


def beam_search(
    llm: LLM,
    prompts: PromptType | Sequence[PromptType],
    params: BeamSearchParams,
    *,
    use_tqdm: bool | Callable[..., Any] = False,
    concurrency_limit: int | None = None,
) -> list[BeamSearchOutput]:
    """Beam search over `prompts` (text, {"prompt": text} or {"prompt_token_ids": [...]}), in
    steps of `llm.generate`; one output per prompt, in the prompts' order.

    A beam grows until it ends with an EOS token (unless `ignore_eos`), has `max_tokens` tokens,
    or reaches the engine's length limit (max_model_len, or the whole KV pool if that is less).
    `concurrency_limit` searches that many prompts at a time (all by default). Raises ValueError,
    before anything runs, for a prompt that leaves no room for one generated token."""
    if isinstance(prompts, str | Mapping):
        prompts = [prompts]
    if concurrency_limit is not None:
        _check(
            _is_int(concurrency_limit) and concurrency_limit >= 1,
            "concurrency_limit",
            ">= 1",
            concurrency_limit,
        )
    instances = [_instance(llm, prompt) for prompt in prompts]
    # NOTE: the scheduler's limit, the one `generate` stops a request at; a beam stops there too.
    max_len = llm.engine.core.scheduler.max_request_len
    for i, instance in enumerate(instances):
        num_prompt = len(instance.beams[0].tokens)
        _check(
            num_prompt < max_len, f"prompt {i}", f"shorter than the length limit {max_len} tokens", num_prompt
        )
    eos_token_ids = frozenset(llm.engine.frontend.eos_token_ids)
    # NOTE: `Logprob`s are the model's raw log-softmax, before temperature, as vLLM v1's default
    # (logprobs_mode="raw_logprobs") that its beam search reads: the temperature changes which
    # token is sampled, and so may add that one to a beam's candidates, never a candidate's score.
    step_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature)
    batch = concurrency_limit or max(len(instances), 1)
    progress = _progress(use_tqdm, params.max_tokens * math.ceil(len(instances) / batch))
    try:
        for start in range(0, len(instances), batch):
            for _ in range(params.max_tokens):
                if not _step(
                    llm, instances[start : start + batch], params, step_params, eos_token_ids, max_len
                ):
                    break
                if progress is not None:
                    progress.update(1)
    finally:
        if progress is not None:
            progress.close()
    return [_finish(llm, instance, params, eos_token_ids) for instance in instances]


def _instance(llm: LLM, prompt: PromptType) -> _Instance:
    """The search of one prompt, its tokens made as `generate` makes them (the front end's
    tokenization and checks)."""
    from parkade.services.tokenizer.frontend import prompt_fields

    fields = prompt_fields(prompt)
    salt = {"cache_salt": fields.pop("cache_salt")} if "cache_salt" in fields else {}
    tokens = list(llm.engine.frontend.prompt_token_ids(**fields))
    return _Instance([BeamSearchSequence(tokens)], salt=salt)


def _step(
    llm: LLM,
    instances: list[_Instance],
    params: BeamSearchParams,
    step_params: SamplingParams,
    eos_token_ids: frozenset[int],
    max_len: int,
) -> bool:
    """Grow every live beam of `instances` by one token. False when none was left to grow."""
    for instance in instances:  # a beam at the length limit is done
        for beam in instance.beams:
            if len(beam.tokens) >= max_len:
                beam.finish_reason = "length"
                instance.completed.append(beam)
        instance.beams = [beam for beam in instance.beams if beam.finish_reason is None]
    requests = [
        {"prompt_token_ids": beam.tokens, **instance.salt}
        for instance in instances
        for beam in instance.beams
    ]
    if not requests:
        return False
    outputs = iter(llm.generate(requests, step_params, use_tqdm=False))
    for instance in instances:
        candidates = []
        for beam in instance.beams:
            completion = next(outputs).outputs[0]
            if not completion.logprobs:  # aborted, or failed without raising
                raise RuntimeError(f"a beam search step ended with finish_reason={completion.finish_reason}")
            top = completion.logprobs[0]  # the sampled token first, then the most likely ones
            for token_id, logprob in top.items():
                child = BeamSearchSequence(
                    [*beam.tokens, token_id], [*beam.logprobs, top], beam.cum_logprob + logprob.logprob
                )
                if token_id in eos_token_ids and not params.ignore_eos:
                    child.finish_reason, child.stop_reason = "stop", token_id
                    instance.completed.append(child)
                else:
                    candidates.append(child)
        # NOTE: vLLM ranks by the length-penalized score; a prompt's candidates all have the same
        # length, so that order is the cum_logprob order. The sort is stable: on a tie the sampled
        # token (first in its dict) wins, as in greedy decoding.
        candidates.sort(key=lambda beam: beam.cum_logprob, reverse=True)
        instance.beams = candidates[: params.beam_width]
    return True


def _finish(
    llm: LLM, instance: _Instance, params: BeamSearchParams, eos_token_ids: frozenset[int]
) -> BeamSearchOutput:
    """The best beam_width of the ended and the live beams, by the length-penalized score."""
    for beam in instance.beams:
        beam.finish_reason = "length"
    ranked = sorted(
        instance.completed + instance.beams,
        key=lambda beam: get_beam_search_score(
            beam.tokens, beam.cum_logprob, eos_token_ids, params.length_penalty
        ),
        reverse=True,
    )
    best = ranked[: params.beam_width]
    tokenizer = llm.get_tokenizer()
    if tokenizer is not None:
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens)
    return BeamSearchOutput(sequences=best)


def _progress(use_tqdm: bool | Callable[..., Any], total: int) -> Any | None:
    """vLLM's beam search bar: token steps, an upper bound (beams may all end sooner)."""
    if not use_tqdm:
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Beam search", unit="token")
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Beam search", unit="token")
