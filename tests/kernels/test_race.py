"""The exponential race (kernels/race.py, csrc/race.c): the C pass equals its torch twin, draws follow
softmax(z / t), and a row's token depends on its key and logits alone."""

from __future__ import annotations

import random

import pytest
import torch

from parkade.kernels import attention_cpu
from parkade.kernels.race import race, race_torch, uniforms

pytestmark = pytest.mark.skipif(not attention_cpu.available(), reason="no C compiler")


def keys(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


@pytest.mark.parametrize("vocab", [1, 7, 100, 513, 8192])
def test_the_c_pass_equals_the_torch_twin(vocab):
    m = 48
    z = torch.randn(m, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    z[5, : vocab // 2] = float("-inf")  # a filtered row
    z[6] = float("-inf")  # nothing left: id 0, as argmax
    temperatures = [0.0 if i % 4 == 0 else (0.5, 1.0, 1.7)[i % 3] for i in range(m)]
    k = keys(m, vocab)
    assert race(z, temperatures, k).tolist() == race_torch(z, temperatures, k).tolist()


def test_greedy_rows_are_argmax_and_ties_go_to_the_first():
    z = torch.randn(16, 300, generator=torch.Generator().manual_seed(1))
    z[3, [10, 200, 299]] = 50.0
    z[4] = float("-inf")
    tokens = race(z, [0.0] * 16, keys(16)).tolist()
    assert tokens == z.argmax(dim=-1).tolist()
    assert tokens[3] == 10 and tokens[4] == 0


def test_a_row_depends_on_its_key_and_logits_alone():
    z = torch.randn(64, 2000, generator=torch.Generator().manual_seed(2))  # a team's worth of work
    k = keys(64, 2)
    batch = race(z, [1.0] * 64, k).tolist()
    alone = [race(z[i : i + 1], [1.0], [k[i]]).item() for i in range(64)]
    assert batch == alone
    shuffled = list(range(64))
    random.Random(3).shuffle(shuffled)
    assert race(z[shuffled], [1.0] * 64, [k[i] for i in shuffled]).tolist() == [batch[i] for i in shuffled]
    threads = torch.get_num_threads()
    try:  # one thread or a team: the same tokens
        torch.set_num_threads(1)
        assert race(z, [1.0] * 64, k).tolist() == batch
    finally:
        torch.set_num_threads(threads)
    other = race(z, [1.0] * 64, keys(64, 4)).tolist()
    assert sum(a != b for a, b in zip(batch, other, strict=True)) > 32  # the key is the noise


def _fmix32_inverse(h: int) -> int:
    h ^= h >> 16
    h = (h * pow(0xC2B2AE35, -1, 1 << 32)) & 0xFFFFFFFF
    h ^= (h >> 13) ^ (h >> 26)
    h = (h * pow(0x85EBCA6B, -1, 1 << 32)) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_the_extreme_hashes_give_uniforms_strictly_inside_zero_one():
    # Token 0 of a key with lo = 0 hashes to fmix32(fmix32(0) ^ hi) = fmix32(hi): pick hi so that
    # this is every bit set (the largest U), or none (the smallest).
    largest, smallest = (_fmix32_inverse(h) << 32 for h in (0xFFFFFFFF, 0))
    u = uniforms([largest, smallest], 1)[:, 0].tolist()
    assert u == [1.0 - 2.0**-24, 2.0**-24]
    # The largest U must not make its token win against far likelier ones, nor a filtered token win.
    z = torch.full((2, 8), 30.0)
    z[0, 0] = 0.0
    z[1] = 0.0
    z[1, 0] = float("-inf")
    for fn in (race, race_torch):
        assert 0 not in fn(z, [1.0, 1.0], [largest, largest]).tolist()


def test_a_nan_score_wins_as_with_argmax():
    z = torch.randn(4, 600, generator=torch.Generator().manual_seed(10))
    z[1, 5] = z[1, 550] = float("nan")
    z[2, 530] = float("nan")  # in the second chunk of 512
    z[3, :] = float("nan")
    k = keys(4, 10)
    for temperatures in ([1.0] * 4, [0.0] * 4):
        tokens = race(z, temperatures, k).tolist()
        assert tokens[1:] == [5, 530, 0] == race_torch(z, temperatures, k).tolist()[1:]
    assert race(z, [0.0] * 4, k).tolist() == z.argmax(dim=-1).tolist()


def test_strided_and_bf16_logits_are_read_as_their_values():
    wide = torch.randn(8, 600, generator=torch.Generator().manual_seed(5))
    z = wide[:, 50:550]  # rows 600 floats apart
    k = keys(8, 5)
    assert race(z, [1.0] * 8, k).tolist() == race(z.contiguous(), [1.0] * 8, k).tolist()
    b = z.to(torch.bfloat16)
    assert race(b, [0.8] * 8, k).tolist() == race(b.float(), [0.8] * 8, k).tolist()
    z_before = z.clone()
    race(z, [1.0] * 8, k)
    assert torch.equal(z, z_before)
    one = torch.randn(1, 300, generator=torch.Generator().manual_seed(6))
    expanded = one.expand(4, 300)  # every row the same memory (stride 0)
    assert race(expanded, [0.0] * 4, k[:4]).tolist() == [one.argmax().item()] * 4
    assert race(expanded, [1.0] * 4, k[:4]).tolist() == race(one.repeat(4, 1), [1.0] * 4, k[:4]).tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_softmax_of_the_logits_over_temperature(temperature):
    probs = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.08, 0.04, 0.02, 0.01])
    n = 100_000
    counts = torch.bincount(race(probs.log().repeat(n, 1), [temperature] * n, keys(n, 6)), minlength=8)
    expected = torch.softmax(probs.log() / temperature, dim=0) * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 24.3  # chi-square, 7 degrees of freedom: p = 0.001


def test_uniforms_are_uniform_and_unrelated_between_neighbouring_keys():
    u = uniforms(list(range(256)), 4096)  # neighbouring keys: the worst case for a weak hash
    assert u.min().item() > 0.0 and u.max().item() < 1.0
    counts = torch.histc(u, bins=64, min=0.0, max=1.0)
    expected = u.numel() / 64
    assert (((counts - expected) ** 2) / expected).sum().item() < 110  # 63 dof: p ~ 0.0002
    corr_rows = torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1].item()
    corr_cols = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1].item()
    assert abs(corr_rows) < 0.01 and abs(corr_cols) < 0.01


def test_without_the_library_the_torch_twin_answers(monkeypatch):
    z = torch.randn(8, 200, generator=torch.Generator().manual_seed(7))
    k = keys(8, 7)
    expected = race(z, [1.0] * 8, k).tolist()
    monkeypatch.setattr(attention_cpu, "available", lambda: False)
    assert race(z, [1.0] * 8, k).tolist() == expected
    with pytest.raises(ValueError, match="temperatures"):
        race(z, [1.0] * 7, k)


def test_the_c_log_is_exact_to_a_few_ulps():
    # Over the race's whole range: U in [2^-25, 1) and E = -log U in [3e-8, 17.4].
    x = torch.cat([torch.logspace(-25, 4.2, 200_000, base=2.0), torch.rand(100_000) * 18 + 1e-7])
    out = torch.empty_like(x)
    attention_cpu.library().parkade_race_log(x.data_ptr(), out.data_ptr(), x.numel())
    exact = x.double().log()
    ulp = torch.finfo(torch.float32).eps * exact.abs().clamp_min(1.0)  # relative, absolute near 0
    assert ((out.double() - exact).abs() / ulp).max().item() < 4
