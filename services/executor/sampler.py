"""Batched sampling: one token for every request that reached the end of its known tokens.

Per row, in this order (vLLM v1's semantics and order):

    raw logits ──> logprobs (log_softmax of the RAW logits, if requested)
      │
      ├─ allowed_token_ids: every other id -> -inf
      ├─ bans -> -inf: bad words (a word's last id, when the outputs end with the rest of it)
      │  and, while fewer than min_tokens outputs, EOS ids and stop_token_ids
      │  (unless they would leave the row no token at all: see the NOTE below)
      ├─ logit_bias: logit += bias (-inf stays -inf: a bias never lifts a mask)
      ├─ repetition penalty over prompt + output ids (logit > 0: divided; < 0: multiplied)
      ├─ frequency / presence penalties over output ids: logit -= f * count + p * (count > 0)
      ├─ temperature < 1e-5 (greedy): argmax                         (greedy rows end here)
      └─ / temperature -> min_p -> top_k -> top_p -> sample (the exponential race, below)

Token ids at or past the logits' width (allowed ids, bias keys, bad words' last ids) are ignored:
the front end refuses them (`SamplingParams.vocab_checks`), so this is only a guard.

Bad words follow vLLM's `apply_bad_words`: for a word [t1 .. tk], tk is banned when the last k-1
OUTPUT ids are t1 .. t(k-1); the prompt is never looked at, so a word whose prefix is longer than
the outputs so far bans nothing. A one-id word bans its id at every step.

NOTE: the masks can leave a row no finite logit (its allowed ids all banned by bad words, or all EOS
or stop ids under min_tokens). vLLM lets such a row through as all -inf: argmax then answers id 0
and softmax gives nan, which sampling also resolves to id 0, a token the request may have ruled out
(vLLM issue #57986). Here the row stays deterministic and inside its allowlist instead: for that row
and that step the bans give way (as though no word were banned and min_tokens were met), the
allowlist being the request's hard contract. Likewise an allowlist with no id below the width keeps
every id rather than none. Only raw logits that are -inf everywhere the row may go still reach
argmax as all -inf (greedy and sampled alike: id 0); real logits are never so.

NOTE: sampling uses the exponential race (`parkade.kernels.race`): argmax(z / t - log E) with
E ~ Exponential(1) i.i.d. per token draws exactly from softmax(z / t) (the Gumbel-max trick). Unlike
`torch.multinomial` it needs no host sync and no normalization, and the noise is a hash of a 64-bit
key per row and the token id, not a generator's stream: a seeded row's key is a pure function of
(seed, number of output tokens so far), so it samples the same token alone, in any batch, and after
being preempted and recomputed; unseeded rows take keys from one draw of `generator` per call. When
no row changes or filters its logits (the common case), the race reads the raw logits in place, one
C pass over the batch (64 rows of 8,192: 0.27 ms, where this sampler took 3.1 ms with torch's
uniforms); else the rules run in torch first and the race takes their result with t = 1, the
division by t done the same way. NOTE: not by inverse transform (one uniform per row against the
prefix sum of probs): the prefix sum carries every token's rounding, so logits that differ in their
last bits (the same request in another batch, or recomputed) pick another token far more often
(measured: 2e-3 of draws at 1e-5 relative logit noise; the race: none of 20,000).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from parkade.kernels.race import race
from parkade.schemas.engine import TokenLogprobs
from parkade.schemas.sampling import SamplingParams
from parkade.services.executor.mixing import MASK64, splitmix64

__all__ = ["Sampler", "SamplingRow", "row_seed", "token_logprobs"]


class SamplingRow(Protocol):
    """One request that samples this step (the executor's per-request state satisfies it)."""

    sampling_params: SamplingParams
    token_ids: Sequence[int]  # prompt + outputs so far
    num_prompt_tokens: int
    eos_token_ids: tuple[int, ...]


def row_seed(seed: int, num_output_tokens: int) -> int:
    """The generator seed of a seeded request at one output position: a pure function of both."""
    return splitmix64(splitmix64(seed & MASK64) ^ num_output_tokens)


class Sampler:
    """Chooses one token per row; see the module docstring for the order of operations."""

    def __call__(
        self,
        logits: torch.Tensor,  # [n, vocab] float32, row i belongs to rows[i]
        rows: Sequence[SamplingRow],
        generator: torch.Generator | None = None,
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """-> (sampled token id per row, logprobs per row or None where not requested).

        Unseeded rows draw from `generator` (torch's default generator when None).
        """
        if len(rows) != logits.shape[0]:
            raise ValueError(f"{len(rows)} rows for {logits.shape[0]} rows of logits")
        if not rows:
            return [], []
        if all(_plain_greedy(r) for r in rows):
            # The greedy fast path: nothing changes the logits and nobody wants logprobs, so the
            # answer is the raw argmax (no copy, no per-row masks): the race with every temperature
            # 0, which on a CPU is its kernel's greedy pass (argmax's ties and nan rule: 0.06 ms for
            # 64 rows of 8,192, torch's argmax 0.38) and elsewhere torch's argmax.
            n = len(rows)
            return race(logits, [0.0] * n, [0] * n).tolist(), [None] * n
        params = [r.sampling_params for r in rows]
        keys = _race_keys(rows, generator)
        if all(_logits_as_they_are(r, logits.shape[1]) for r in rows):
            # Nothing to apply before the race: it reads the raw logits in place, greedy rows too.
            temperatures = [0.0 if p.greedy else p.temperature for p in params]
            sampled = race(logits, temperatures, keys)
        else:
            x = _process_logits(logits, rows)
            sampled = x.argmax(dim=-1)  # [n]: the answer for greedy rows
            random_rows = [i for i, p in enumerate(params) if not p.greedy]
            if random_rows:
                idx = torch.tensor(random_rows, device=x.device)
                z = _filtered_logits(x[idx], [params[i] for i in random_rows])
                sampled[idx] = race(z, [1.0] * len(random_rows), [keys[i] for i in random_rows])
        token_ids = sampled.tolist()
        return token_ids, token_logprobs(logits, sampled, params)


def _race_keys(rows: Sequence[SamplingRow], generator: torch.Generator | None) -> list[int]:
    """Each row's 64-bit race key: a seeded row's from its seed and position alone (`row_seed`), the
    others from one draw of `generator` (torch's default generator when None) and their index."""
    base: int | None = None
    keys = []
    for i, r in enumerate(rows):
        seed = r.sampling_params.seed
        if r.sampling_params.greedy:
            keys.append(0)  # not used: a greedy row draws nothing (nor takes from `generator`)
            continue
        if seed is not None:
            keys.append(row_seed(seed, len(r.token_ids) - r.num_prompt_tokens))
            continue
        if base is None:
            device = generator.device if generator is not None else "cpu"
            base = int(torch.empty((), dtype=torch.int64, device=device).random_(generator=generator))
        keys.append(splitmix64(base + i))
    return keys


def _logits_as_they_are(row: SamplingRow, vocab: int) -> bool:
    """Nothing changes this row's logits and no filter drops tokens: temperature alone applies."""
    p = row.sampling_params
    return _unchanged(row) and (p.greedy or (p.min_p == 0.0 and not 0 < p.top_k < vocab and p.top_p >= 1.0))


def _plain_greedy(row: SamplingRow) -> bool:
    """Greedy, no logprobs, and nothing in force that changes logits: argmax of the raw logits."""
    p = row.sampling_params
    return p.greedy and p.logprobs is None and _unchanged(row)


def _unchanged(row: SamplingRow) -> bool:
    """No rule before temperature (masks, bias, penalties) is in force for this row this step."""
    p = row.sampling_params
    return (
        p.allowed_token_ids is None
        and not p.bad_words_token_ids
        and not p.logit_bias
        and p.repetition_penalty == 1.0
        and not p.frequency_penalty
        and not p.presence_penalty
        and (not p.min_tokens or len(row.token_ids) - row.num_prompt_tokens >= p.min_tokens)
    )


def _process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """[n, vocab] raw logits -> a float32 copy with every rule before temperature applied, in the
    module docstring's order. `logits` is not modified; a row that uses none of the rules comes out
    bit for bit as it went in."""
    # A private copy: penalties and masks must not leak into the caller's (raw) logits.
    x = logits.to(torch.float32, copy=True)
    _mask_allowed(x, rows)
    _mask_banned(x, rows)
    _add_logit_bias(x, rows)
    return _apply_penalties(x, rows)


def _row_mask(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(ids), vocab] bool: True at ids[j] in row j (every id < vocab)."""
    mask = torch.zeros(len(ids), vocab, dtype=torch.bool, device=device)
    rows = torch.tensor([j for j, r in enumerate(ids) for _ in r], dtype=torch.int64, device=device)
    cols = torch.tensor([t for r in ids for t in r], dtype=torch.int64, device=device)
    mask[rows, cols] = True
    return mask


def _mask_allowed(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: a row with allowed_token_ids keeps only those ids (others -> -inf)."""
    vocab = x.shape[1]
    want: list[int] = []
    kept: list[list[int]] = []
    for i, r in enumerate(rows):
        allowed = r.sampling_params.allowed_token_ids
        ids = list({t for t in allowed if t < vocab}) if allowed is not None else []
        if ids:  # none below vocab: the allowlist is ignored whole (module NOTE)
            want.append(i)
            kept.append(ids)
    if want:
        idx = torch.tensor(want, device=x.device)
        x[idx] = x[idx].masked_fill(~_row_mask(kept, vocab, x.device), float("-inf"))


def _banned_ids(row: SamplingRow, vocab: int) -> list[int]:
    """The ids `row` may not sample this step (all < vocab): bad words and the min_tokens mask."""
    p = row.sampling_params
    n, num_outputs = len(row.token_ids), len(row.token_ids) - row.num_prompt_tokens
    banned: set[int] = set()
    for word in p.bad_words_token_ids:
        k = len(word) - 1  # the prefix, which must end the outputs (never reaching into the prompt)
        if k == 0 or (k <= num_outputs and tuple(row.token_ids[n - k : n]) == word[:-1]):
            banned.add(word[-1])
    if num_outputs < p.min_tokens:
        banned.update(row.eos_token_ids, p.stop_token_ids)
    return [t for t in banned if t < vocab]


def _mask_banned(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: banned ids -> -inf, except in a row they would leave no finite logit (module NOTE)."""
    vocab = x.shape[1]
    want: list[int] = []
    banned: list[list[int]] = []
    for i, r in enumerate(rows):
        p = r.sampling_params
        if p.bad_words_token_ids or len(r.token_ids) - r.num_prompt_tokens < p.min_tokens:
            ids = _banned_ids(r, vocab)
            if ids:
                want.append(i)
                banned.append(ids)
    if want:
        idx = torch.tensor(want, device=x.device)
        sub = x[idx]  # [w, vocab]
        ban = _row_mask(banned, vocab, x.device)
        # Decided on the device (no host sync): a row with nothing left keeps its logits.
        emptied = (ban | sub.isneginf()).all(dim=-1, keepdim=True)
        x[idx] = sub.masked_fill(ban & ~emptied, float("-inf"))


def _add_logit_bias(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place: logit += logit_bias[id] for the ids of each row's logit_bias."""
    vocab = x.shape[1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    bias: list[float] = []
    for i, r in enumerate(rows):
        for t, b in (r.sampling_params.logit_bias or {}).items():
            if t < vocab:
                row_idx.append(i)
                tok_idx.append(t)
                bias.append(b)
    if row_idx:
        dev = x.device
        index = (torch.tensor(row_idx, device=dev), torch.tensor(tok_idx, device=dev))
        x.index_put_(index, torch.tensor(bias, dtype=x.dtype, device=dev), accumulate=True)


def _padded_ids(rows: list[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[n, longest] int64, short rows padded with `pad` (at least one column)."""
    width = max([1, *map(len, rows)])
    return torch.tensor([[*r, *[pad] * (width - len(r))] for r in rows], dtype=torch.int64, device=device)


def _token_counts(rows: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[n, vocab] float32: how often each token id occurs in each row."""
    ids = _padded_ids(rows, vocab, device)  # the pad lands in a spare column, dropped below
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def _apply_penalties(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition, then frequency/presence penalties. x [n, vocab] is not modified."""
    vocab = x.shape[1]
    params = [r.sampling_params for r in rows]
    # Rows without a penalty contribute no ids, so they pay nothing for their context length.
    if any(p.repetition_penalty != 1.0 for p in params):
        ids = [r.token_ids if p.repetition_penalty != 1.0 else () for r, p in zip(rows, params, strict=True)]
        seen = _token_counts(ids, vocab, x.device) > 0
        rp = torch.tensor([p.repetition_penalty for p in params], device=x.device)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        outputs = [
            r.token_ids[r.num_prompt_tokens :] if p.frequency_penalty or p.presence_penalty else ()
            for r, p in zip(rows, params, strict=True)
        ]
        counts = _token_counts(outputs, vocab, x.device)
        freq = torch.tensor([p.frequency_penalty for p in params], device=x.device)[:, None]
        pres = torch.tensor([p.presence_penalty for p in params], device=x.device)[:, None]
        x = x - freq * counts - pres * (counts > 0)
    return x


def _filtered_logits(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """x [m, vocab] penalized logits of non-greedy rows -> x / temperature, filtered tokens -inf."""
    vocab = x.shape[1]
    dev = x.device
    x = x / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    if any(p.min_p > 0.0 for p in params):
        # vLLM's order: min_p first (relative to the most likely token), then top-k and top-p.
        min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    filtered_k = [k for k in top_k if k < vocab]
    if filtered_k and all(p.top_p >= 1.0 for p in params):
        # Top-k alone needs each row's k-th largest value, not a sorted row: torch's topk of the
        # largest k, where a full sort of 64 rows of 8,192 took 20 ms (the same tokens are kept).
        largest = x.topk(max(filtered_k), dim=-1).values
        k = torch.tensor(top_k, device=dev)[:, None]
        kth = largest.gather(1, k.clamp(max=largest.shape[1]) - 1)
        kth = kth.masked_fill(k >= vocab, float("-inf"))  # rows without top-k keep everything
        return x.masked_fill(x < kth, float("-inf"))
    if filtered_k or any(p.top_p < 1.0 for p in params):
        # One descending sort serves both: top-k keeps values >= the k-th largest (ties kept),
        # top-p keeps the smallest prefix whose mass (after top-k) reaches top_p.
        sorted_x, order = x.sort(dim=-1, descending=True)
        kth = sorted_x.gather(1, torch.tensor(top_k, device=dev)[:, None] - 1)
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        # top_p == 1 must keep everything, even where the cumulative sum rounds above 1.
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=dev)
        probs = sorted_x.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the first token always stays
        sorted_x = sorted_x.masked_fill(mass_before > top_p[:, None], float("-inf"))
        x = torch.empty_like(x).scatter_(1, order, sorted_x)
    return x


def token_logprobs(
    logits: torch.Tensor, sampled: torch.Tensor, params: list[SamplingParams]
) -> list[TokenLogprobs | None]:
    """Logprobs of the raw logits: the sampled token with its rank, then the top-k tokens (the
    executor also asks it for prompt tokens, with each prompt token as the "sampled" one)."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return out
    idx = torch.tensor(want, device=logits.device)
    lp = torch.log_softmax(logits[idx].float(), dim=-1)  # [w, vocab]
    chosen = sampled[idx][:, None]
    chosen_lp = lp.gather(1, chosen)  # [w, 1]
    ranks = ((lp > chosen_lp).sum(dim=-1) + 1).tolist()  # rank 1 = most likely
    k = max(params[i].logprobs or 0 for i in want)
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], chosen[:, :0])
    chosen_l, chosen_lp_l = chosen[:, 0].tolist(), chosen_lp[:, 0].tolist()
    top_lp_l, top_ids_l = top_lp.tolist(), top_ids.tolist()
    for j, i in enumerate(want):
        ki = params[i].logprobs or 0
        out[i] = TokenLogprobs(
            token_ids=(chosen_l[j], *top_ids_l[j][:ki]),
            logprobs=(chosen_lp_l[j], *top_lp_l[j][:ki]),
            ranks=(ranks[j], *range(1, ki + 1)),
        )
    return out
