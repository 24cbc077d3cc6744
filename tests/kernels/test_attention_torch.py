"""The pure-torch and the CPU paged attention against a dense reference that knows nothing about blocks.

Each case builds contiguous K/V per sequence, scatters them into randomly permuted physical blocks
(sequences may share their first blocks, as with prefix caching), and checks that paged attention
over the block table equals plain causal attention over the contiguous K/V.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parkade.kernels import attention_cpu, attention_torch
from parkade.kernels.attention_torch import write_kv_cache

# Both CPU backends: the compiled decode kernel must agree with the same reference as torch.
BACKENDS = {"torch": attention_torch, "cpu": attention_cpu}
with_backends = pytest.mark.parametrize("backend", list(BACKENDS))

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@dataclass
class Case:
    q: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    dense_k: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    dense_v: list[torch.Tensor]
    block_table: torch.Tensor  # [num_seqs, max_num_blocks] int32
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]


def make_case(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    shared_blocks: int = 0,
    seed: int = 0,
) -> Case:
    """Sequences 1.. share their first `shared_blocks` blocks (ids and contents) with sequence 0."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody uses
    free = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Unused slots hold garbage that would show up in the output if read.
    k_cache = torch.full(shape, 1e4).to(dtype)
    v_cache = torch.full(shape, 1e4).to(dtype)
    tables, dense_k, dense_v = [], [], []
    for b, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        shared = min(shared_blocks, n - 1, blocks_per_seq[0] - 1) if b > 0 else 0
        if shared:  # same physical blocks and the same tokens' K/V as sequence 0
            k[: shared * block_size] = dense_k[0][: shared * block_size]
            v[: shared * block_size] = dense_v[0][: shared * block_size]
        table = tables[0][:shared] + [free.pop() for _ in range(n - shared)] if b > 0 else free[-n:]
        if b == 0:
            del free[-n:]
        pos = torch.arange(seq_len)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        write_kv_cache(k, v, k_cache, v_cache, slots)
        tables.append(table)
        dense_k.append(k)
        dense_v.append(v)
    width = max(blocks_per_seq)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(sum(query_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    return Case(q, k_cache, v_cache, dense_k, dense_v, block_table, tuple(query_lens), tuple(seq_lens))


def dense_reference(case: Case, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Causal attention per sequence over contiguous K/V, in float64, with an explicit mask."""
    outs, start = [], 0
    group = case.q.shape[1] // case.dense_k[0].shape[1]
    for q_len, seq_len, k, v in zip(case.query_lens, case.seq_lens, case.dense_k, case.dense_v, strict=True):
        q = case.q[start : start + q_len].double()  # [q_len, Hq, D]
        start += q_len
        k = k.double().repeat_interleave(group, dim=1)  # [seq_len, Hq, D]
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        mask = torch.zeros(q_len, seq_len, dtype=torch.bool)
        for i in range(q_len):
            p = seq_len - q_len + i
            lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
            mask[i, lo : p + 1] = True
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def run_paged(
    case: Case, scale: float, sliding_window: int | None, host_lens: bool = True, backend: str = "torch"
) -> torch.Tensor:
    cu = torch.tensor([0, *torch.tensor(case.query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return BACKENDS[backend].paged_attention_varlen(
        case.q,
        case.k_cache,
        case.v_cache,
        cu_seqlens_q=cu,
        max_seqlen_q=max(case.query_lens),
        seqused_k=torch.tensor(case.seq_lens, dtype=torch.int32),
        max_seqlen_k=max(case.seq_lens),
        softmax_scale=scale,
        block_table=case.block_table,
        sliding_window=sliding_window,
        query_lens=case.query_lens if host_lens else (),
        seq_lens=case.seq_lens if host_lens else (),
    )


def check(case: Case, backend: str, sliding_window: int | None = None, host_lens: bool = True) -> None:
    scale = case.q.shape[-1] ** -0.5
    out = run_paged(case, scale, sliding_window, host_lens, backend)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    ref = dense_reference(case, scale, sliding_window)
    tol = TOLERANCE[case.q.dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


# (seq_lens, query_lens): pure decode, pure prefill, mixed batches with chunked prefills.
BATCHES = [
    ([7, 1, 33, 16], [1, 1, 1, 1]),
    ([13], [13]),
    ([5, 17, 9, 30], [5, 1, 4, 1]),
    ([21, 3, 40], [1, 3, 11]),
]


@pytest.mark.parametrize(("seq_lens", "query_lens"), BATCHES)
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2), (8, 1)])
@with_backends
def test_matches_dense_reference(seq_lens, query_lens, num_q_heads, num_kv_heads, backend):
    case = make_case(
        seq_lens, query_lens, block_size=4, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=8, dtype=torch.float32,
    )  # fmt: skip
    check(case, backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 128])
@with_backends
def test_dtypes_and_head_sizes(dtype, head_dim, backend):
    case = make_case(
        [19, 6, 35], [1, 6, 9], block_size=16, num_q_heads=8, num_kv_heads=2, head_dim=head_dim, dtype=dtype
    )
    check(case, backend)


@pytest.mark.parametrize(("seq_lens", "query_lens"), BATCHES)
@pytest.mark.parametrize("window", [1, 3, 8])
@with_backends
def test_sliding_window(seq_lens, query_lens, window, backend):
    case = make_case(
        seq_lens, query_lens, block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32
    )
    check(case, backend, sliding_window=window)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [6, 1, 2]])
@with_backends
def test_shared_prefix_blocks(query_lens, backend):
    case = make_case(
        [18, 21, 13], query_lens, block_size=4, num_q_heads=4, num_kv_heads=2, head_dim=8,
        dtype=torch.float32, shared_blocks=3,
    )  # fmt: skip
    assert case.block_table[1, :3].tolist() == case.block_table[0, :3].tolist()
    check(case, backend)


@with_backends
def test_without_host_lengths(backend):
    case = make_case(
        [5, 17, 9], [5, 1, 4], block_size=4, num_q_heads=4, num_kv_heads=1, head_dim=8, dtype=torch.float32
    )
    check(case, backend, host_lens=False)


def test_write_kv_cache_skips_negative_slots():
    num_blocks, block_size, heads, dim = 4, 2, 2, 8
    k_cache = torch.zeros(num_blocks, block_size, heads, dim)
    v_cache = torch.zeros(num_blocks, block_size, heads, dim)
    key, value = torch.randn(4, heads, dim), torch.randn(4, heads, dim)
    slots = torch.tensor([5, -1, 0, 6])
    write_kv_cache(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, heads, dim), v_cache.view(-1, heads, dim)
    for token, slot in [(0, 5), (2, 0), (3, 6)]:
        assert torch.equal(flat_k[slot], key[token]) and torch.equal(flat_v[slot], value[token])
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[[5, 0, 6]] = True
    assert not flat_k[~written].any() and not flat_v[~written].any()


def test_write_kv_cache_casts_to_cache_dtype():
    k_cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    v_cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    key = torch.randn(3, 1, 8)
    write_kv_cache(key, key, k_cache, v_cache, torch.tensor([7, 1, 2]))
    assert torch.equal(k_cache.view(-1, 1, 8)[7], key[0].bfloat16())


@st.composite
def batches(draw):
    num_seqs = draw(st.integers(1, 4))
    seq_lens = draw(st.lists(st.integers(1, 40), min_size=num_seqs, max_size=num_seqs))
    query_lens = [draw(st.sampled_from([1, s, max(1, s // 3)])) for s in seq_lens]
    num_kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 4]))
    return dict(
        seq_lens=seq_lens,
        query_lens=query_lens,
        block_size=draw(st.sampled_from([1, 2, 4, 16])),
        num_q_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        shared_blocks=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**16)),
    ), draw(st.one_of(st.none(), st.integers(1, 12)))


@with_backends
@settings(max_examples=40, deadline=None)
@given(batches())
def test_property_matches_dense_reference(backend, params):
    kwargs, window = params
    case = make_case(head_dim=8, dtype=torch.float32, **kwargs)
    check(case, backend, sliding_window=window)
