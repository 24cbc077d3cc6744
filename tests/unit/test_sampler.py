"""The batched sampler: greedy, filters, penalties, min_tokens, allowed ids, bad words, logit bias,
per-request seeds and logprobs."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from parkade.schemas import SamplingParams
from parkade.services.executor.sampler import (
    Sampler,
    _apply_penalties,
    _filtered_logits,
    _plain_greedy,
    _process_logits,
    row_seed,
)


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


def test_the_greedy_fast_path_keeps_argmax_rules_for_ties_inf_and_nan():
    # On a CPU the fast path is the race kernel's greedy pass: torch's argmax is the reference.
    logits = torch.randn(4, 700, generator=torch.Generator().manual_seed(4))
    logits[0, [7, 600]] = 50.0  # a tie: the first
    logits[1] = float("-inf")  # nothing finite: id 0
    logits[2, [9, 650]] = float("nan")  # nan wins, the first one
    logits[3, 699] = float("inf")
    tokens, _ = sample(logits, [row(temperature=0.0) for _ in range(4)], None)
    assert tokens == logits.argmax(-1).tolist() == [7, 0, 9, 699]


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


def test_a_temperature_below_1e_5_is_greedy_as_in_vllm():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(11)) * 5
    rows = [row(temperature=t, seed=3) for t in (1e-6, 1e-30, 1e-46, 0.0)]
    tokens, _ = sample(logits, rows, torch.Generator().manual_seed(0))
    assert tokens == logits.argmax(dim=-1).tolist()
    batch = [*rows, row(top_p=0.5)]  # the filtered path: the same answers
    assert sample(logits.repeat(2, 1)[:5], batch, None)[0][:4] == tokens


def test_top_k_alone_keeps_what_a_full_sort_keeps_ties_included():
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(9)).round(decimals=1)  # ties
    top_ks = [3, 0, 45, 1, 7]  # 0 and 45 (> vocab): no top-k for that row
    params = [SamplingParams(temperature=1.0, top_k=k) for k in top_ks]
    expected = x.clone()
    for i, k in enumerate(top_ks):
        if 0 < k < 40:
            kth = x[i].sort(descending=True).values[k - 1]
            expected[i] = x[i].masked_fill(x[i] < kth, float("-inf"))
    assert torch.equal(_filtered_logits(x, params), expected)


def test_temperature_sharpens():
    cold, hot = draw_many(temperature=0.25), draw_many(temperature=4.0)
    assert cold[0] > 4000 * 0.5 > hot[0]


def test_seeded_row_is_the_same_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 1000, generator=gen)
    # 0.7: the batch's top_p row sends it through the torch rules, which divide by 0.7 as the race does
    seeded = row(outputs=(9, 9, 9), seed=1234, temperature=0.7)
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


# ---- allowed_token_ids, bad words, logit_bias (vLLM v1's order: allowed, bans, bias, penalties) ----


def greedy_token(logits: torch.Tensor = LOGITS, **kwargs) -> int:
    return sample(logits[None], [row(temperature=0.0, **kwargs)], None)[0][0]


def test_allowed_token_ids_restrict_greedy_and_sampled_rows():
    assert greedy_token(allowed_token_ids=(7, 3, 5)) == 3  # the most likely allowed id
    counts = draw_many(allowed_token_ids=(1, 4, 6))
    assert set(counts) == {1, 4, 6}
    mass = PROBS[[1, 4, 6]].sum()
    for token in (1, 4, 6):  # the allowed ids keep their relative probabilities
        assert abs(counts[token] / 4000 - PROBS[token] / mass) < 0.04


def test_allowed_token_ids_apply_before_top_k():
    # top_k=2 over the allowed ids {5, 6, 7} keeps 5 and 6; applied to the raw logits first it
    # would keep {0, 1}, which the allowlist then empties.
    assert set(draw_many(allowed_token_ids=(5, 6, 7), top_k=2)) == {5, 6}


def test_ids_past_the_vocabulary_are_ignored():
    assert greedy_token(allowed_token_ids=(3, 100)) == 3
    assert set(draw_many(n=500, allowed_token_ids=(3, 8, 10**9))) == {3}
    assert greedy_token(allowed_token_ids=(8, 100)) == 0  # nothing below the width: no allowlist
    assert greedy_token(bad_words_token_ids=((9,), (0, 12), (50,))) == 0
    assert greedy_token(logit_bias={8: 100.0, 12: -100.0}) == 0
    x = _process_logits(LOGITS[None], [row(logit_bias={8: 5.0}, bad_words_token_ids=((8,),))])
    assert torch.equal(x, LOGITS[None])


def test_one_token_bad_words_are_banned_at_every_step():
    for outputs in [(), (3,), (0, 0)]:
        assert greedy_token(bad_words_token_ids=((0,), (2,)), outputs=outputs) == 1
    counts = draw_many(bad_words_token_ids=((0,), (3,)))
    assert set(counts) == {1, 2, 4, 5, 6, 7}


@pytest.mark.parametrize(
    ("prompt", "outputs", "banned"),
    [
        ((5, 6), (), False),
        ((5, 4), (), False),  # the prompt is never looked at
        ((5, 6), (4,), True),
        ((5, 6), (4, 1), False),  # only the last output id counts for a 2-id word
        ((5, 6), (1, 4), True),
    ],
)
def test_a_two_token_bad_word_bans_its_last_id_only_after_its_prefix(prompt, outputs, banned):
    token = greedy_token(bad_words_token_ids=((4, 0),), prompt=prompt, outputs=outputs)
    assert token == (1 if banned else 0)


@pytest.mark.parametrize(
    ("prompt", "outputs", "banned"),
    [
        ((5, 6), (2, 3), True),
        ((5, 6), (7, 2, 3), True),
        ((5, 2), (3,), False),  # the prefix must lie within the outputs
        ((5, 6), (3,), False),
        ((5, 6), (3, 2), False),
        ((5, 6), (2, 3, 1), False),
    ],
)
def test_a_three_token_bad_word_needs_the_outputs_to_end_with_its_prefix(prompt, outputs, banned):
    token = greedy_token(bad_words_token_ids=((2, 3, 0),), prompt=prompt, outputs=outputs)
    assert token == (1 if banned else 0)


def test_sampled_rows_never_draw_an_active_bad_word():
    words = ((1,), (4, 0), (9, 2))  # 0 banned after 4; 2 is not (9 never came)
    assert set(draw_many(bad_words_token_ids=words, outputs=(4,))) == {2, 3, 4, 5, 6, 7}
    assert set(draw_many(bad_words_token_ids=words, outputs=(3,))) == {0, 2, 3, 4, 5, 6, 7}


def test_logit_bias_values_and_forcing():
    x = _process_logits(LOGITS[None], [row(logit_bias={2: 1.5, 5: -0.25})])
    expected = LOGITS.clone()
    expected[2] += 1.5
    expected[5] -= 0.25
    torch.testing.assert_close(x[0], expected, rtol=0, atol=0)
    assert greedy_token(logit_bias={7: 100.0}) == 7
    assert draw_many(logit_bias={7: 100.0}) == Counter({7: 4000})
    assert 0 not in draw_many(logit_bias={0: -100.0})


def test_logit_bias_never_lifts_a_mask():
    assert greedy_token(allowed_token_ids=(2, 3), logit_bias={0: 100.0}) == 2
    assert greedy_token(bad_words_token_ids=((0,),), logit_bias={0: 100.0}) == 1
    assert greedy_token(min_tokens=1, eos=(0,), logit_bias={0: 100.0}) == 1
    assert set(draw_many(allowed_token_ids=(2, 3), logit_bias={0: 100.0})) == {2, 3}


def test_logit_bias_applies_before_the_repetition_penalty():
    logits = torch.tensor([1.0, 1.2, 0.5])
    r = row(prompt=(1,), outputs=(0, 2), logit_bias={0: 1.0, 2: -1.0}, repetition_penalty=2.0)
    # Bias first: (1 + 1) / 2 = 1.0 and (0.5 - 1) * 2 = -1.0 (1.2 / 2 for the prompt's id 1).
    # Penalty first would give 1.5 and -0.75.
    x = _process_logits(logits[None], [r])
    torch.testing.assert_close(x[0], torch.tensor([1.0, 0.6, -1.0]), rtol=0, atol=0)
    kwargs = dict(prompt=(2,), outputs=(0,), logit_bias={0: 1.0}, repetition_penalty=2.0)
    assert greedy_token(logits, **kwargs) == 1  # 1.0 < 1.2; penalty first: 1.5 > 1.2


def test_masks_apply_before_penalties():
    # A negative frequency penalty raises a repeated id; it must not lift a mask (-inf stays -inf).
    kwargs = dict(outputs=(0, 0, 0), frequency_penalty=-2.0)
    assert greedy_token(**kwargs) == 0
    assert greedy_token(bad_words_token_ids=((0,),), **kwargs) == 1
    assert greedy_token(allowed_token_ids=(3, 4), **kwargs) == 3
    x = _process_logits(LOGITS[None], [row(allowed_token_ids=(3, 4), **kwargs)])
    assert x[0].isfinite().tolist() == [False, False, False, True, True, False, False, False]


def test_the_greedy_fast_path_excludes_rows_with_a_mask_or_bias():
    plain = row(temperature=0.0)
    assert _plain_greedy(plain) and _plain_greedy(row(temperature=0.0, logit_bias={}))
    for kwargs in [
        {"allowed_token_ids": (1,)},
        {"bad_words_token_ids": ((0,),)},
        {"bad_words_token_ids": ((5, 0),)},  # not in force this step, but a fast path must not ask
        {"logit_bias": {1: 10.0}},
    ]:
        featured = row(temperature=0.0, **kwargs)
        assert not _plain_greedy(featured)
    tokens, _ = sample(
        LOGITS.repeat(3, 1), [plain, row(temperature=0.0, allowed_token_ids=(6,)), plain], None
    )
    assert tokens == [0, 6, 0]


def mixed_batch(featured: Row) -> list[Row]:
    """A batch around `featured` (index 2) of rows that use none of the new features."""
    return [
        row(temperature=0.0, logprobs=3),
        row(temperature=0.8, seed=11, outputs=(1, 2)),
        featured,
        row(temperature=1.0, top_p=0.9, repetition_penalty=1.3, outputs=(0, 4)),
        row(temperature=0.0, min_tokens=2, eos=(1,), logprobs=1),
        row(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.5, outputs=(3, 3)),
    ]


@pytest.mark.parametrize(
    "features",
    [
        {"allowed_token_ids": (10, 11, 12)},
        {"bad_words_token_ids": ((0,), (3, 1), (7, 8, 9))},
        {"logit_bias": {3: 50.0, 40: -50.0}},
        {"allowed_token_ids": (3, 4), "bad_words_token_ids": ((3,), (4,)), "logit_bias": {4: 1.0}},
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_rows_without_the_features_are_unaffected_bit_for_bit(features, temperature):
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(5))
    plain = row(temperature=temperature, outputs=(7, 8, 3))
    featured = row(temperature=temperature, outputs=(7, 8, 3), **features)
    with_features, without = mixed_batch(featured), mixed_batch(plain)
    x_with, x_without = _process_logits(logits, with_features), _process_logits(logits, without)
    others = [0, 1, 3, 4, 5]
    assert torch.equal(x_with[others], x_without[others])
    assert not torch.equal(x_with[2], x_without[2])
    t_with, lp_with = sample(logits, with_features, torch.Generator().manual_seed(1))
    t_without, lp_without = sample(logits, without, torch.Generator().manual_seed(1))
    assert [t_with[i] for i in others] == [t_without[i] for i in others]
    assert [lp_with[i] for i in others] == [lp_without[i] for i in others]


def test_a_seeded_row_with_the_features_is_the_same_alone_and_in_any_batch():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(6))
    features = dict(
        allowed_token_ids=tuple(range(0, 300, 3)),
        bad_words_token_ids=((30,), (1, 2, 60)),
        logit_bias={90: 2.0, 99: -3.0},
    )
    seeded = row(temperature=1.0, seed=77, outputs=(1, 2), **features)
    alone = {sample(logits[2:3], [seeded], torch.Generator().manual_seed(s))[0][0] for s in range(3)}
    assert len(alone) == 1
    (token,) = alone
    assert token % 3 == 0 and token not in (30, 60)
    for s in range(3):
        tokens, _ = sample(logits, mixed_batch(seeded), torch.Generator().manual_seed(100 + s))
        assert tokens[2] == token
    # Over many positions (fresh noise each), the masks always hold.
    drawn = {
        sample(logits[2:3], [row(seed=77, outputs=(1, 2) * k, **features)], None)[0][0] for k in range(1, 41)
    }
    assert len(drawn) > 5 and all(t % 3 == 0 and t not in (30, 60) for t in drawn)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bans_that_would_empty_the_row_give_way_to_the_allowlist(temperature):
    # Every allowed id is banned: the row keeps its allowlist and ignores the bans (not id 0, no nan).
    params = dict(temperature=temperature, allowed_token_ids=(2, 5), bad_words_token_ids=((2,), (5,)))
    if temperature == 0.0:
        assert greedy_token(**{k: v for k, v in params.items() if k != "temperature"}) == 2
    counts = draw_many(n=2000, **params)
    assert set(counts) <= {2, 5} and (temperature == 0.0 or set(counts) == {2, 5})
    # min_tokens over an allowlist of stop ids, and a bad word over the only other allowed id.
    tokens, _ = sample(
        LOGITS.repeat(2, 1),
        [
            row(temperature=temperature, allowed_token_ids=(6,), min_tokens=3, eos=(6,)),
            row(allowed_token_ids=(4, 6), bad_words_token_ids=((4,),), min_tokens=3, stop_token_ids=(6,)),
        ],
        torch.Generator().manual_seed(0),
    )
    assert tokens[0] == 6 and tokens[1] in (4, 6)


def test_bans_over_the_whole_vocabulary_leave_the_row_unmasked():
    words = tuple((t,) for t in range(8))
    assert greedy_token(bad_words_token_ids=words) == 0
    x = _process_logits(
        LOGITS.repeat(2, 1), [row(bad_words_token_ids=words), row(bad_words_token_ids=words[1:])]
    )
    assert torch.equal(x[0], LOGITS)  # nothing left: the bans give way
    assert x[1].isfinite().tolist() == [True] + [False] * 7  # one id left: the bans hold
    assert set(draw_many(n=2000, bad_words_token_ids=words)) == set(range(8))


def test_the_new_features_leave_the_callers_logits_and_the_raw_logprobs_alone():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(8))
    raw = logits.clone()
    rows = [
        row(temperature=0.0, allowed_token_ids=(4, 9), logprobs=2),
        row(temperature=0.9, bad_words_token_ids=((int(raw[1].argmax()),),), logprobs=0, seed=3),
        row(temperature=0.0, logit_bias={int(raw[2].argmin()): 100.0}, logprobs=1),
    ]
    tokens, logprobs = sample(logits, rows, None)
    assert torch.equal(logits, raw)
    assert tokens[0] in (4, 9) and tokens[1] != int(raw[1].argmax()) and tokens[2] == int(raw[2].argmin())
    expected = torch.log_softmax(raw, dim=-1)
    for i, lp in enumerate(logprobs):
        assert lp is not None and lp.token_ids[0] == tokens[i]
        assert math.isclose(lp.logprobs[0], expected[i, tokens[i]].item(), rel_tol=1e-6)
    assert logprobs[2].ranks[0] == 30  # the raw distribution's least likely id, forced by the bias
