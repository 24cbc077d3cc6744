"""The batched sampler: greedy, filters, penalties, min_tokens, per-request seeds and logprobs."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from parkade.schemas import SamplingParams
from parkade.services.executor.sampler import Sampler, _apply_penalties, row_seed


@dataclass
class Row:
    sampling_params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    eos_token_ids: tuple[int, ...] = ()


def row(prompt=(5, 6), outputs=(), eos=(), **params) -> Row:
    return Row(SamplingParams(**params), [*prompt, *outputs], len(prompt), tuple(eos))


sample = Sampler()

# A crafted distribution over 8 tokens, most likely first.
PROBS = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.08, 0.04, 0.02, 0.01])
LOGITS = PROBS.log()


def draw_many(n: int = 4000, seed: int = 0, **params) -> Counter:
    """n independent unseeded draws from PROBS (one batch of n identical rows)."""
    rows = [row(**params) for _ in range(n)]
    tokens, _ = sample(LOGITS.repeat(n, 1), rows, torch.Generator().manual_seed(seed))
    return Counter(tokens)


def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    tokens, logprobs = sample(logits, [row(temperature=0.0) for _ in range(6)], None)
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs == [None] * 6


def test_the_greedy_fast_path_answers_as_the_full_path_and_only_when_it_may():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    plain = [row(temperature=0.0) for _ in range(5)]
    fast, _ = sample(logits, plain, None)
    # One row with logprobs sends the whole batch down the full path: same tokens.
    full, logprobs = sample(logits, [*plain[:4], row(temperature=0.0, logprobs=0)], None)
    assert fast == full == logits.argmax(-1).tolist() and logprobs[4] is not None
    assert torch.equal(logits, before)
    # Rows the fast path must not take: a penalty, or a min_tokens mask in force.
    eos = int(logits[0].argmax())
    masked, _ = sample(logits[:1], [row(temperature=0.0, min_tokens=2, eos=(eos,))], None)
    assert masked != [eos]
    free, _ = sample(logits[:1], [row(temperature=0.0, min_tokens=2, outputs=(1, 2), eos=(eos,))], None)
    assert free == [eos]  # min_tokens reached: the mask is off
    positive = logits[1:2].abs() + 0.01  # a repetition penalty divides positive logits
    seen = int(positive.argmax())
    penalized, _ = sample(positive, [row(temperature=0.0, repetition_penalty=100.0, outputs=(seen,))], None)
    assert penalized != [seen]


def test_top_k_1_equals_greedy():
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(1))
    tokens, _ = sample(logits, [row(temperature=1.3, top_k=1) for _ in range(32)], torch.Generator())
    assert tokens == logits.argmax(-1).tolist()


def test_unfiltered_draws_follow_the_distribution():
    counts = draw_many(8000)
    for token, p in enumerate(PROBS.tolist()):
        assert abs(counts[token] / 8000 - p) < 0.02


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_p": 0.5}, {0, 1}),  # mass before token 2 is 0.55 > 0.5
        ({"min_p": 0.3}, {0, 1, 2, 3}),  # p >= 0.3 * 0.30
        ({"top_k": 5, "top_p": 0.8}, {0, 1, 2}),  # top-p over the top-5 renormalized
        ({"top_k": 6, "min_p": 0.5}, {0, 1, 2}),
        ({"top_k": -1, "top_p": 1.0, "min_p": 0.0}, set(range(8))),
    ],
)
def test_filters_never_choose_filtered_tokens(params, allowed):
    counts = draw_many(**params)
    assert set(counts) == allowed  # nothing outside, and every allowed token does occur
    mass = PROBS[sorted(allowed)].sum()
    for token in allowed:  # the kept tokens keep their relative probabilities
        assert abs(counts[token] / 4000 - PROBS[token] / mass) < 0.04


def test_temperature_sharpens():
    cold, hot = draw_many(temperature=0.25), draw_many(temperature=4.0)
    assert cold[0] > 4000 * 0.5 > hot[0]


def test_seeded_row_is_the_same_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 1000, generator=gen)
    seeded = row(outputs=(9, 9, 9), seed=1234, temperature=1.0)
    others = [row(temperature=1.0), row(seed=99, temperature=0.7), row(temperature=0.0), row(top_p=0.9)]
    alone = [sample(logits[3:4], [seeded], torch.Generator().manual_seed(s))[0][0] for s in range(3)]
    assert len(set(alone)) == 1
    for s in range(3):
        batch = [*others[:3], seeded, *others[3:]]
        tokens, _ = sample(logits, batch, torch.Generator().manual_seed(100 + s))
        assert tokens[3] == alone[0]


def test_seeded_row_depends_on_seed_and_position():
    logits = torch.zeros(1, 1000)  # uniform: every draw is a fresh token
    by_position = {sample(logits, [row(outputs=(1,) * k, seed=5)], None)[0][0] for k in range(10)}
    by_seed = {sample(logits, [row(seed=s)], None)[0][0] for s in range(10)}
    assert len(by_position) > 5 and len(by_seed) > 5
    assert row_seed(5, 3) == row_seed(5, 3) != row_seed(5, 4)
    assert 0 <= row_seed(-(2**63), 0) < 2**64


def test_unseeded_rows_follow_the_passed_generator():
    logits = torch.zeros(4, 1000)
    rows = [row() for _ in range(4)]
    first = sample(logits, rows, torch.Generator().manual_seed(7))[0]
    assert sample(logits, rows, torch.Generator().manual_seed(7))[0] == first
    assert sample(logits, rows, torch.Generator().manual_seed(8))[0] != first


def test_penalty_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    penalties = dict(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    r = row(prompt=(0, 1), outputs=(3, 3, 4), temperature=0.0, **penalties)
    out = _apply_penalties(logits.clone(), [r])
    # repetition over {0, 1, 3, 4}: 2/2, -1*2, 3/2, -2*2; then token 3 (count 2): 1.5 - 2*0.5 - 0.25,
    # token 4 (count 1): -4 - 0.5 - 0.25. Prompt tokens get no frequency/presence penalty.
    expected = torch.tensor([[1.0, -2.0, 0.5, 0.25, -4.75, 0.0]])
    torch.testing.assert_close(out, expected)
    assert sample(logits, [r], None)[0] == [0]  # without penalties it would be token 3


def test_penalties_apply_per_row():
    logits = torch.tensor([[2.0, 1.0, 0.0]] * 3)
    rows = [
        row(prompt=(0,), temperature=0.0),
        row(prompt=(0,), temperature=0.0, repetition_penalty=3.0),
        row(prompt=(1,), outputs=(0, 0), temperature=0.0, frequency_penalty=1.0),
    ]
    out = _apply_penalties(logits.clone(), rows)
    expected = torch.tensor([[2.0, 1.0, 0.0], [2.0 / 3.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    torch.testing.assert_close(out, expected)


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0, 4.0]])  # EOS 2 best, stop id 4 next, then 3
    params = dict(temperature=0.0, min_tokens=3, stop_token_ids=(4,))
    early = row(outputs=(1, 1), eos=(2,), **params)
    done = row(outputs=(1, 1, 1), eos=(2,), **params)
    ignoring = row(outputs=(), eos=(2,), ignore_eos=True, **params)
    tokens, _ = sample(logits.repeat(3, 1), [early, done, ignoring], None)
    assert tokens == [3, 2, 3]
    # Sampled rows too: the masked tokens are never drawn.
    counts = Counter(
        sample(logits.repeat(2000, 1), [row(eos=(2,), min_tokens=1, stop_token_ids=(4,))] * 2000, None)[0]
    )
    assert not {2, 4} & set(counts)


def test_logprobs_are_of_the_raw_logits():
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(4))
    raw = logits.clone()
    rows = [
        row(temperature=0.0, logprobs=5),
        row(temperature=0.0),
        row(temperature=0.5, repetition_penalty=1.5, logprobs=0, outputs=(3, 4), seed=1),
        row(temperature=1.0, top_k=3, min_tokens=2, eos=(int(logits[3].argmax()),), logprobs=2),
    ]
    tokens, logprobs = sample(logits, rows, None)
    assert torch.equal(logits, raw)  # the caller's logits are untouched
    expected = torch.log_softmax(raw, dim=-1)
    assert logprobs[1] is None
    for i in (0, 2, 3):
        lp, k = logprobs[i], rows[i].sampling_params.logprobs
        assert lp is not None and len(lp.token_ids) == len(lp.logprobs) == len(lp.ranks) == k + 1
        assert lp.token_ids[0] == tokens[i]
        assert math.isclose(lp.logprobs[0], expected[i, tokens[i]].item(), rel_tol=1e-6)
        assert lp.ranks[0] == int((expected[i] > expected[i, tokens[i]]).sum()) + 1
        top = expected[i].topk(k)
        assert list(lp.token_ids[1:]) == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(lp.logprobs[1:]), top.values)
        assert list(lp.ranks[1:]) == list(range(1, k + 1))
    assert logprobs[0].ranks[0] == 1  # greedy picks the most likely token
    assert logprobs[3].ranks[0] >= 2  # the most likely token was EOS, masked by min_tokens


def test_empty_batch_and_row_count_mismatch():
    assert sample(torch.zeros(0, 10), [], None) == ([], [])
    with pytest.raises(ValueError, match="rows"):
        sample(torch.zeros(2, 10), [row()], None)


def test_top_k_larger_than_the_vocabulary_keeps_everything():
    rows = [row(top_k=1000, top_p=0.9), row(temperature=0.0)]
    tokens, _ = sample(LOGITS.repeat(2, 1), rows, torch.Generator().manual_seed(0))
    assert 0 <= tokens[0] < 8 and tokens[1] == 0


def test_min_p_applies_before_top_p():
    # min_p=0.3 keeps tokens 0-3 (p >= 0.09), renormalized to (0.35, 0.29, 0.24, 0.12); top_p=0.6
    # over that keeps tokens 0 and 1. Applied the other way round, top_p=0.6 over the full
    # distribution would keep token 2 as well (mass before it is 0.55).
    counts = draw_many(min_p=0.3, top_p=0.6)
    assert set(counts) == {0, 1}
