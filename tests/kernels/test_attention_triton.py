"""The Triton paged-attention kernels against the pure-torch reference (`attention_torch`).

On a machine without a GPU the kernels run under the Triton interpreter (`TRITON_INTERPRET=1`, set
by `tests/conftest.py` before triton is imported); with CUDA they run on the GPU. The
interpreter costs a few ms per program instance, so every shape here is small.

Each batch is described as `(context_len, q_len)` per sequence: `context_len` tokens already cached,
then `q_len` new tokens whose queries attend to all of them and causally to each other.

    sequence b:  | context_len cached keys | q_len new keys (queries) |
                 0                                        seq_len = context_len + q_len

K/V live in shuffled physical blocks; every slot no sequence owns (unused blocks, the tail of each
last block) holds a large constant, so reading one shows up in the output.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parkade.kernels import attention_torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = (["cpu"] if INTERPRETED else []) + (["cuda"] if torch.cuda.is_available() else [])
if not DEVICES:
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (set before triton is imported)", allow_module_level=True)

from parkade.kernels import attention_triton  # noqa: E402  (after the interpreter check)

GARBAGE = 1e4  # in every slot that no sequence owns
# NOTE: fp32 on the GPU gets a little more room (approximate exp, another summation order); the kernel
# asks for IEEE fp32 dots there, so a TF32 dot (errors ~1e-3) would still fail.
TOLERANCE = {
    ("cpu", torch.float32): 2e-5,
    ("cuda", torch.float32): 1e-4,
    ("cpu", torch.float16): 5e-3,
    ("cuda", torch.float16): 5e-3,
    ("cpu", torch.bfloat16): 3e-2,
    ("cuda", torch.bfloat16): 3e-2,
}


@dataclass
class Batch:
    q: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    seqused_k: torch.Tensor  # [num_seqs] int32
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]

    def kwargs(self, host_lens: bool = True) -> dict:
        return dict(
            cu_seqlens_q=self.cu_seqlens_q,
            max_seqlen_q=max(self.query_lens),
            seqused_k=self.seqused_k,
            max_seqlen_k=max(self.seq_lens),
            softmax_scale=self.q.shape[-1] ** -0.5,
            block_table=self.block_table,
            query_lens=self.query_lens if host_lens else (),
            seq_lens=self.seq_lens if host_lens else (),
        )


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    block_size: int = 8,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    shared_blocks: int = 0,
    first_block_id: int = 0,
    seed: int = 0,
) -> Batch:
    """Inputs for sequences given as `(context_len, q_len)`.

    Block ids are a random permutation of `first_block_id .. num_blocks - 1` (a few left unused).
    Sequences 1.. share their first `shared_blocks` blocks with sequence 0 (ids and contents, as with
    prefix caching), as far as those blocks are full and cached in both.
    """
    gen = torch.Generator().manual_seed(seed)
    query_lens = tuple(q_len for _, q_len in seqs)
    seq_lens = tuple(ctx + q_len for ctx, q_len in seqs)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = first_block_id + sum(blocks_per_seq) + 3
    free = (torch.randperm(num_blocks - first_block_id, generator=gen) + first_block_id).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, GARBAGE, dtype=dtype)
    v_cache = torch.full(shape, GARBAGE, dtype=dtype)
    tables: list[list[int]] = []
    for b, ((ctx, _), n) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
        shared = min(shared_blocks, ctx // block_size, seqs[0][0] // block_size) if b > 0 else 0
        table = (tables[0][:shared] if shared else []) + [free.pop() for _ in range(n - shared)]
        pos = torch.arange(shared * block_size, seq_lens[b])  # shared blocks are written already
        slots = torch.tensor(table, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size
        kv_shape = (len(pos), num_kv_heads, head_dim)
        key = torch.randn(kv_shape, generator=gen).to(dtype)
        value = torch.randn(kv_shape, generator=gen).to(dtype)
        attention_torch.write_kv_cache(key, value, k_cache, v_cache, slots)
        tables.append(table)
    width = max(blocks_per_seq)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(sum(query_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return Batch(
        q.to(device),
        k_cache.to(device),
        v_cache.to(device),
        block_table.to(device),
        cu.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_lens,
        seq_lens,
    )


def reference(batch: Batch, sliding_window: int | None = None) -> torch.Tensor:
    """The torch reference in fp32 on the CPU, over the same (already rounded) inputs."""
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.kwargs().items()}
    return attention_torch.paged_attention_varlen(
        batch.q.float().cpu(),
        batch.k_cache.float().cpu(),
        batch.v_cache.float().cpu(),
        sliding_window=sliding_window,
        **cpu,
    )


def run_triton(
    batch: Batch, sliding_window: int | None = None, num_splits: int | None = None, host_lens: bool = True
) -> torch.Tensor:
    out = attention_triton.paged_attention_varlen(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        sliding_window=sliding_window,
        num_splits=num_splits,
        **batch.kwargs(host_lens),
    )
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype and out.device == batch.q.device
    return out


def check(
    batch: Batch, sliding_window: int | None = None, num_splits: int | None = None, host_lens: bool = True
) -> torch.Tensor:
    out = run_triton(batch, sliding_window, num_splits, host_lens)
    tol = TOLERANCE[batch.q.device.type, batch.q.dtype]
    torch.testing.assert_close(out.float().cpu(), reference(batch, sliding_window), atol=tol, rtol=tol)
    return out


# Each row one batch of (context_len, q_len): decode only, one prefill from scratch, and mixed
# batches of decodes (incl. a first token) and prefill chunks with context before them.
BATCHES = {
    "decode": [(6, 1), (0, 1), (32, 1), (15, 1)],
    "prefill": [(0, 13)],
    "mixed": [(0, 5), (16, 1), (5, 4), (29, 1)],
    "chunks": [(20, 1), (0, 3), (29, 11), (3, 37)],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", BATCHES)
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(2, 2), (4, 2), (4, 1), (8, 1)])
def test_shuffled_blocks_and_gqa(device, layout, num_q_heads, num_kv_heads):
    """GQA ratios 1, 2, 4, 8 (the last two MQA) over every batch layout; lengths not block-aligned."""
    batch = make_batch(BATCHES[layout], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, device=device)
    check(batch)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 24, 80, 128])
def test_dtypes_and_head_sizes(device, dtype, head_dim):
    """8 is stories260K's head size, 128 Llama's; 24 and 80 are not powers of two (masked padding)."""
    batch = make_batch(
        [(18, 1), (0, 6), (26, 9)], block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=head_dim,
        dtype=dtype, device=device,
    )  # fmt: skip
    check(batch)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])  # 64, 128: one block id per key tile
def test_block_sizes(device, block_size):
    batch = make_batch([(45, 1), (3, 20), (139, 1)], block_size=block_size, device=device)
    check(batch)


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_launch_per_head_size(head_dim):
    for group, group_pad in ((1, 1), (3, 4), (8, 8)):
        decode = attention_triton.choose_launch(head_dim, group, max_seqlen_q=1)
        prefill = attention_triton.choose_launch(head_dim, group, max_seqlen_q=37)
        for launch in (decode, prefill):
            assert launch.block_q * group_pad >= 16  # tl.dot's minimum rows
            assert launch.num_warps in (2, 4, 8) and launch.num_stages >= 1
            assert 16 % launch.block_n == 0 or launch.block_n % 16 == 0  # tiles align with pow2 blocks
        assert prefill.block_q >= decode.block_q and prefill.num_warps >= decode.num_warps
    # Wider heads never get larger tiles or more stages (shared memory per stage grows with them).
    narrow, wide = (attention_triton.choose_launch(d, 1, 1) for d in (64, 256))
    assert wide.block_n <= narrow.block_n and wide.num_stages <= narrow.num_stages


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["decode", "chunks"])
def test_every_launch_tiling_gives_the_same_attention(device, layout):
    """What a `--launch-sweep` may try: the tiling changes, the result does not."""
    batch = make_batch(BATCHES[layout], block_size=16, head_dim=16, device=device)
    expected = reference(batch)
    tol = TOLERANCE[batch.q.device.type, batch.q.dtype]
    for block_q, block_n, warps, stages in ((8, 16, 2, 1), (16, 32, 4, 2), (32, 64, 8, 3)):
        launch = attention_triton.LaunchConfig(block_q, block_n, num_warps=warps, num_stages=stages)
        out = attention_triton.paged_attention_varlen(
            batch.q, batch.k_cache, batch.v_cache, launch=launch, **batch.kwargs()
        )
        torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["decode", "chunks"])
def test_shared_prefix_blocks(device, layout):
    seqs = [(33, 1), (27, 1), (40, 1)] if layout == "decode" else [(33, 4), (27, 1), (40, 6)]
    batch = make_batch(seqs, shared_blocks=3, device=device)
    assert batch.block_table[1, :3].tolist() == batch.block_table[0, :3].tolist()
    assert batch.block_table[2, :3].tolist() == batch.block_table[0, :3].tolist()
    check(batch)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["decode", "chunks"])
@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window(device, layout, window):
    check(make_batch(BATCHES[layout], device=device), sliding_window=window)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [5, 16, 100])
def test_sliding_window_long_chunk(device, window):
    """A prefill chunk longer than one key tile: its later queries find whole tiles out of reach."""
    batch = make_batch([(10, 150), (70, 1)], block_size=16, num_q_heads=2, num_kv_heads=2, device=device)
    check(batch, sliding_window=window)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_query(device):
    """q as the query part of a fused QKV projection: rows strided, last dim contiguous."""
    batch = make_batch(BATCHES["mixed"], num_q_heads=4, num_kv_heads=2, device=device)
    qkv = torch.randn(batch.q.shape[0], 8, batch.q.shape[2], device=device)
    qkv[:, :4] = batch.q
    batch.q = qkv[:, :4]
    assert not batch.q.is_contiguous()
    check(batch)


@pytest.mark.parametrize("device", DEVICES)
def test_without_host_lengths(device):
    check(make_batch(BATCHES["mixed"], num_kv_heads=1, device=device), host_lens=False)


# Decode-only batches with a few hundred tokens of context: the split-K (flash-decoding) path.
SPLIT_SEQS = [(300, 1), (256, 1), (411, 1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [2, 4, 7])
def test_split_k_equals_one_split(device, num_splits):
    batch = make_batch(SPLIT_SEQS, block_size=16, num_q_heads=8, num_kv_heads=2, device=device)
    one = run_triton(batch, num_splits=1)
    split = check(batch, num_splits=num_splits)
    torch.testing.assert_close(split, one, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_k_low_precision(device, dtype):
    check(make_batch(SPLIT_SEQS, block_size=16, dtype=dtype, device=device), num_splits=4)


@pytest.mark.parametrize("device", DEVICES)
def test_split_k_with_empty_splits(device):
    """More splits than a short sequence has blocks: some splits see no key at all."""
    check(make_batch([(4, 1), (0, 1), (250, 1)], block_size=16, device=device), num_splits=7)


@pytest.mark.parametrize("device", DEVICES)
def test_split_k_with_sliding_window(device):
    """The window leaves the early splits of each sequence without any key in reach."""
    check(make_batch(SPLIT_SEQS, block_size=16, device=device), sliding_window=40, num_splits=4)


@pytest.mark.parametrize("device", DEVICES)
def test_tile_in_block_with_window_and_splits(device):
    """block_size 128: one block id per key tile, windowed, split over the key range."""
    check(make_batch(SPLIT_SEQS, block_size=128, device=device), sliding_window=40, num_splits=3)


@pytest.mark.parametrize("device", DEVICES)
def test_split_k_falls_back_with_prefill_chunk(device):
    """num_splits > 1 on a batch with a prefill chunk runs (as one split) and stays correct."""
    check(make_batch([(120, 1), (40, 7), (90, 1)], block_size=16, device=device), num_splits=4)


@pytest.mark.parametrize("device", DEVICES)
def test_launcher_chooses_splits(device):
    check(make_batch(SPLIT_SEQS, block_size=16, device=device), num_splits=None)


@pytest.mark.parametrize("device", DEVICES)
def test_pool_over_32k_blocks(device):
    """33_000 blocks, the sequences' blocks all above id 32_768: catches narrow index arithmetic."""
    batch = make_batch(
        [(40, 1), (17, 6), (60, 1)], block_size=8, num_q_heads=2, num_kv_heads=1, head_dim=8,
        device=device, first_block_id=32_800,
    )  # fmt: skip
    assert batch.k_cache.shape[0] > 32_768
    assert int(batch.block_table[:, 0].min()) > 32_768
    check(batch)
    check(batch, num_splits=3)  # decode rows only through split-K when the batch is all decodes
    decodes = make_batch(
        [(40, 1), (70, 1)], block_size=8, num_q_heads=2, num_kv_heads=1, head_dim=8, device=device,
        first_block_id=32_900,
    )  # fmt: skip
    check(decodes, num_splits=3)


# --- write_kv_cache --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 8), (2, 24), (2, 128)])
def test_write_kv_cache_matches_reference(device, dtype, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_tokens = 6, 8, 19
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 5, 6, 18]] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    attention_torch.write_kv_cache(key, value, expected_k, expected_v, slots)

    # key and value as views into a fused [num_tokens, 2 * num_kv_heads, head_dim] projection.
    kv = torch.cat([key, value], dim=1).to(device)
    k_dev, v_dev = k_cache.to(device), v_cache.to(device)
    attention_triton.write_kv_cache(
        kv[:, :num_kv_heads], kv[:, num_kv_heads:], k_dev, v_dev, slots.to(device)
    )
    assert torch.equal(k_dev.cpu(), expected_k) and torch.equal(v_dev.cpu(), expected_v)
    # Slots not written (-1 tokens and slots nobody maps to) still hold the old values.
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    flat = k_dev.cpu().view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat[untouched], k_cache.view(-1, num_kv_heads, head_dim)[untouched])


@pytest.mark.parametrize("device", DEVICES)
def test_write_kv_cache_high_slots(device):
    """Slots past 2**18 in a pool of 33_000 blocks of 8."""
    num_blocks, block_size = 33_000, 8
    k_cache = torch.zeros(num_blocks, block_size, 1, 8, device=device)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(3, 1, 8, device=device), torch.randn(3, 1, 8, device=device)
    slots = torch.tensor([32_999 * 8 + 7, -1, 32_769 * 8], device=device)
    attention_triton.write_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[32_999, 7], key[0]) and torch.equal(v_cache[32_769, 0], value[2])
    assert int(k_cache.count_nonzero()) == int(key[[0, 2]].count_nonzero())


# --- launcher validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_mismatched_dtypes(device):
    batch = make_batch([(5, 1)], device=device)
    with pytest.raises(ValueError, match=r"(?i)dtype"):
        attention_triton.paged_attention_varlen(
            batch.q.half(), batch.k_cache, batch.v_cache, **batch.kwargs()
        )


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_unsupported_dtype(device):
    batch = make_batch([(5, 1)], device=device)
    q, k, v = batch.q.double(), batch.k_cache.double(), batch.v_cache.double()
    with pytest.raises(ValueError, match=r"(?i)dtype"):
        attention_triton.paged_attention_varlen(q, k, v, **batch.kwargs())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["block_table", "cu_seqlens_q", "seqused_k"])
def test_rejects_int64_metadata(device, name):
    batch = make_batch([(5, 1), (9, 3)], device=device)
    kwargs = batch.kwargs() | {name: getattr(batch, name).long()}
    with pytest.raises(ValueError, match=name):
        attention_triton.paged_attention_varlen(batch.q, batch.k_cache, batch.v_cache, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_non_contiguous_last_dim(device):
    batch = make_batch([(5, 1), (9, 3)], device=device)
    q = batch.q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, stride(-1) != 1
    assert q.stride(-1) != 1
    with pytest.raises(ValueError, match=r"(?i)contiguous|stride"):
        attention_triton.paged_attention_varlen(q, batch.k_cache, batch.v_cache, **batch.kwargs())


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_inconsistent_shapes(device):
    batch = make_batch([(5, 1), (9, 3)], num_q_heads=4, num_kv_heads=2, device=device)
    v_cache = batch.v_cache[..., :4]  # head_dim differs from q's and k's
    with pytest.raises(ValueError):
        attention_triton.paged_attention_varlen(batch.q, batch.k_cache, v_cache, **batch.kwargs())
    q = batch.q[:, :3]  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError):
        attention_triton.paged_attention_varlen(q, batch.k_cache, batch.v_cache, **batch.kwargs())


# --- property ----------------------------------------------------------------------------------------


@st.composite
def batches(draw):
    num_seqs = draw(st.integers(1, 4))
    decode_only = draw(st.booleans())
    seqs = []
    for _ in range(num_seqs):
        q_len = 1 if decode_only else draw(st.sampled_from([1, 1, 2, 5, 17]))
        seqs.append((draw(st.integers(0, 70)), q_len))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    kwargs = dict(
        block_size=draw(st.sampled_from([8, 16, 32])),
        num_q_heads=num_kv_heads * draw(st.sampled_from([1, 2, 4, 8])),
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from([8, 24])),
        shared_blocks=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**16)),
    )
    kwargs["dtype"] = draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))
    window = draw(st.one_of(st.none(), st.integers(1, 40)))
    num_splits = draw(st.sampled_from([None, 1, 3]))
    return seqs, kwargs, window, num_splits


@settings(max_examples=15, deadline=None)
@given(batches())
def test_property_matches_reference(params):
    seqs, kwargs, window, num_splits = params
    for device in DEVICES:
        check(make_batch(seqs, device=device, **kwargs), sliding_window=window, num_splits=num_splits)
