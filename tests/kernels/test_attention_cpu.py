"""The compiled CPU decode kernel on serving-sized batches, where its own paths switch on.

The small cases of test_attention_torch.py run it against a dense reference; here a batch is big
enough that items hold every KV head of a request and that the work is split over threads, and
the torch decode path (itself checked against the dense reference) is the expected value.
"""

from __future__ import annotations

import itertools
import subprocess

import pytest
import torch
from test_attention_torch import make_case

from parkade.kernels import attention_cpu, attention_torch
from parkade.kernels.backends import AttentionBackend, get_attention_backend


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def decode_case(num_seqs: int, dtype: torch.dtype, *, num_q_heads: int, num_kv_heads: int, head_dim: int):
    gen = torch.Generator().manual_seed(num_seqs)
    seq_lens = torch.randint(1, 700, (num_seqs,), generator=gen).tolist()
    return make_case(
        seq_lens, [1] * num_seqs, block_size=16, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype, shared_blocks=2,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (12, 4, 64), (8, 8, 128)])
@pytest.mark.parametrize("num_seqs", [3, 48])  # 3: one KV head per item; 48: whole rows per item
@pytest.mark.parametrize("window", [None, 100])
def test_batched_decode_equals_the_torch_path(
    two_threads, dtype, num_q_heads, num_kv_heads, head_dim, num_seqs, window
):
    case = decode_case(num_seqs, dtype, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    seq_lens = list(case.seq_lens)
    if num_seqs > 3:
        assert sum(seq_lens) * num_kv_heads >= attention_cpu.MIN_PARALLEL_WORK  # the threaded split runs
    args = (case.q, case.k_cache, case.v_cache, case.block_table, seq_lens, head_dim**-0.5, window)
    got = attention_cpu.decode_attention(*args)
    expected = attention_torch.decode_batch(*args)
    assert got.dtype == dtype and got.shape == case.q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_an_fp16_cache_takes_the_torch_path():
    case = decode_case(5, torch.float16, num_q_heads=4, num_kv_heads=2, head_dim=16)
    args = (case.q, case.k_cache, case.v_cache, case.block_table, list(case.seq_lens), 0.25, None)
    torch.testing.assert_close(attention_cpu.decode_attention(*args), attention_torch.decode_batch(*args))


def test_split_by_cost_covers_every_item_once():
    costs = torch.randint(1, 900, (101,)).numpy()
    for parts in (1, 2, 3, 8, 200):
        ranges = attention_cpu._split_by_cost(costs, parts)
        assert ranges[0][0] == 0 and ranges[-1][1] == len(costs)
        assert all(a < b for a, b in ranges) and all(b == c for (_, b), (c, _) in itertools.pairwise(ranges))
        assert len(ranges) <= parts


def test_auto_picks_the_compiled_kernel_on_a_cpu():
    assert attention_cpu.available()  # CI machines have a C compiler: the fast path must be tested
    assert get_attention_backend(AttentionBackend.AUTO, torch.device("cpu")) is attention_cpu
    assert get_attention_backend("torch", torch.device("cpu")) is attention_torch


def test_a_missing_compiler_is_reported(monkeypatch):
    def no_compiler() -> str:
        raise attention_cpu.KernelBuildError("no C compiler found")

    monkeypatch.setattr(attention_cpu, "_compiler", no_compiler)
    attention_cpu._library.cache_clear()
    try:
        with pytest.raises(ValueError, match="no C compiler"):
            get_attention_backend("cpu", torch.device("cpu"))
    finally:
        attention_cpu._library.cache_clear()


def test_a_compiler_that_hangs_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("PARKADE_HOME", str(tmp_path))  # no cached build: the compiler must run
    real_run = subprocess.run

    def hanging_compile(command, **kwargs):
        if "-shared" in command:
            raise subprocess.TimeoutExpired(command, kwargs.get("timeout"))
        return real_run(command, **kwargs)

    monkeypatch.setattr(attention_cpu.subprocess, "run", hanging_compile)
    attention_cpu._library.cache_clear()
    try:
        with pytest.raises(ValueError, match="timed out"):
            attention_cpu.build()
        assert not list((tmp_path / "kernels").glob("*.so"))  # no half-built library left behind
    finally:
        attention_cpu._library.cache_clear()
