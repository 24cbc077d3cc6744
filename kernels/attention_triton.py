"""PagedAttention in Triton: one kernel for a batch that mixes decodes and prefill chunks.

Each request b has a query chunk of q_len_b >= 1 tokens, the last positions of its context of
seqused_k[b] tokens; a query attends causally to every key of its request up to its own position,
found through the request's block table wherever the blocks lie in the pool:

    block_table[b] = [ 7 | 2 | 9 ]     block_size = 4, seqused_k[b] = 11, q_len_b = 3
    keys:   pos 0-3 in block 7, 4-7 in block 2, 8-10 in block 9
    queries: positions 8, 9, 10; query 9 sees keys 0..9

One program handles BLOCK_Q query tokens of one request and the GROUP query heads that share one
KV head (GQA/MQA), as BLOCK_M = BLOCK_Q * GROUP_PAD rows, so each K/V tile is loaded once for the
whole group. It walks the keys in tiles of BLOCK_N positions (any block_size: each key's block id
is looked up on its own) with an fp32 online softmax. Offsets into the pool are 64-bit.

For long contexts with few requests (decode only) the launcher splits each request's keys into
`num_splits` ranges (flash-decoding): each program writes a partial result with its running
max and sum, and a second kernel combines them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64; -1 skips the token
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_PAD)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + h[:, None] * stride_kch + d[None, :]
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + h[:, None] * stride_vch + d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dot(a, b, IEEE_FP32: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with an fp32 result. IEEE_FP32: exact fp32 products, not TF32. UPCAST: multiply in
    fp32 (the CPU interpreter of Triton 3.9 gets bf16 dot operands wrong)."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE_FP32:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim], or with splits the partial sums (below)
    part_m_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS] fp32 running max (splits only)
    part_l_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS] fp32 running sum (splits only)
    part_acc_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS, HEAD_PAD] fp32 (splits only)
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # [num_seqs, max_num_blocks] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    seqused_k_ptr,  # [num_seqs] int32
    softmax_scale,
    block_size,
    sliding_window,  # keys at positions > p - sliding_window are visible from p (USE_WINDOW)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # key positions per tile
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr,  # block_size % BLOCK_N == 0: one block id per key tile
    USE_WINDOW: tl.constexpr,
    IEEE_FP32: tl.constexpr,  # fp32 inputs: exact dots, not TF32
    UPCAST: tl.constexpr,  # dots in fp32 (the CPU interpreter)
):  # fmt: skip
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seqused_k_ptr + seq)
    first_q_pos = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD  # query token within the request
    head = kv_head * GROUP + rows % GROUP_PAD
    row_mask = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = first_q_pos + q_idx
    d = tl.arange(0, HEAD_PAD)
    d_mask = d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q_off = token[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    # Keys this tile needs: up to its last query's position; with a window, from its first
    # query's window start. With splits, this program takes one contiguous range of key tiles.
    last_pos = tl.minimum(first_q_pos + (q_tile + 1) * BLOCK_Q, seq_len) - 1
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_q_pos + q_tile * BLOCK_Q - sliding_window + 1, 0) // BLOCK_N
    hi = last_pos // BLOCK_N + 1
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(hi - lo, NUM_SPLITS)
        lo = lo + split * per_split
        hi = tl.minimum(hi, lo + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(lo, hi):
        k_pos = tile * BLOCK_N + offs_n
        k_valid = k_pos < seq_len
        kv_mask = k_valid[:, None] & d_mask[None, :]
        if TILE_IN_BLOCK:
            # block_size is a multiple of BLOCK_N: the whole tile lies in one block, one id load.
            block = tl.load(table_row + (tile * BLOCK_N) // block_size).to(tl.int64)
            in_block = ((tile * BLOCK_N) % block_size + offs_n).to(tl.int64)
        else:
            block = tl.load(table_row + k_pos // block_size, mask=k_valid, other=0).to(tl.int64)
            in_block = (k_pos % block_size).to(tl.int64)
        k_off = (block * stride_kb + in_block * stride_ks)[:, None] + kv_head * stride_kh + d[None, :]
        v_off = (block * stride_vb + in_block * stride_vs)[:, None] + kv_head * stride_vh + d[None, :]
        k = tl.load(k_cache_ptr + k_off, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_PAD]
        v = tl.load(v_cache_ptr + v_off, mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), IEEE_FP32, UPCAST) * softmax_scale  # [BLOCK_M, BLOCK_N] fp32
        visible = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps -inf; exp() must not see -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE_FP32, UPCAST)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = token[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
    else:
        # Partial results: [token, head, split] for m and l, [token, head, split, :] for acc.
        num_q_heads = tl.num_programs(2) // NUM_SPLITS * GROUP
        part = (token * num_q_heads + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=row_mask)
        tl.store(part_l_ptr + part, l_i, mask=row_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], acc, mask=row_mask[:, None])


@triton.jit
def _combine_splits_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    part_m_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS] fp32
    part_l_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS] fp32
    part_acc_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS, HEAD_PAD] fp32
    stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    row = token * tl.num_programs(1) + head
    s = tl.arange(0, SPLITS_PAD)
    s_mask = s < NUM_SPLITS
    m = tl.load(part_m_ptr + row * NUM_SPLITS + s, mask=s_mask, other=float("-inf"))
    l_part = tl.load(part_l_ptr + row * NUM_SPLITS + s, mask=s_mask, other=0.0)
    d = tl.arange(0, HEAD_PAD)
    acc_off = (row * NUM_SPLITS + s)[:, None] * HEAD_PAD + d[None, :]
    acc = tl.load(part_acc_ptr + acc_off, mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    # Splits that saw no key have m = -inf and weigh nothing.
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    total = tl.sum(l_part * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V [num_tokens, num_kv_heads, head_dim] into its pool slot; -1 skips."""
    _check(
        key.shape == value.shape and key.dim() == 3, "key and value must both be [tokens, kv_heads, head_dim]"
    )
    _check(
        k_cache.shape == v_cache.shape and k_cache.dim() == 4,
        "k_cache/v_cache must be [blocks, bs, heads, dim]",
    )
    _check(k_cache.shape[2:] == key.shape[1:], "key's heads/head_dim differ from the cache's")
    _check(
        slot_mapping.dtype == torch.int64 and slot_mapping.shape == key.shape[:1],
        "slot_mapping: int64 [tokens]",
    )
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check(t.stride(-1) == 1, f"{name} must be contiguous in its last dim")
    if key.shape[0] == 0:
        return
    num_kv_heads, head_dim = key.shape[1:]
    _write_kv_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=_pow2(num_kv_heads), HEAD_DIM=head_dim, HEAD_PAD=_pow2(head_dim),
    )  # fmt: skip


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and the launch's warps and software-pipeline stages for one kernel call."""

    block_q: int  # query tokens per program (times the group's heads = rows of the tile)
    block_n: int  # key positions per tile
    num_warps: int
    num_stages: int


def choose_launch(head_dim: int, group: int, max_seqlen_q: int) -> LaunchConfig:
    """The launch for a head size, following FlashAttention's Triton heuristics.

    NOTE: not yet tuned on a GPU (`loadtest/kernel_bench.py --launch-sweep` measures the others).
    tl.dot wants >= 16 rows: decodes fill them with the group's heads, prefills with tokens. A
    decode tile streams K/V (bandwidth-bound): 4 warps and 3 stages keep loads in flight; wider heads
    halve the key tile and the stages so that a stage's K and V still fit in shared memory. A
    prefill tile is compute-bound: more warps for wider heads.
    """
    decode = max_seqlen_q == 1
    group_pad = _pow2(group)  # query heads per KV head, as the kernel pads them
    block_q = max(1, 16 // group_pad) if decode else max(1, 64 // group_pad)
    if head_dim <= 64:
        return LaunchConfig(block_q, 64, num_warps=4, num_stages=3)
    if head_dim <= 128:
        return LaunchConfig(block_q, 64, num_warps=4 if decode else 8, num_stages=3 if decode else 2)
    return LaunchConfig(block_q, 32, num_warps=4 if decode else 8, num_stages=2)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seqlen_q: int, max_seqlen_k: int) -> int:
    """Flash-decoding splits: only for pure decode batches whose (request, KV head) programs
    would leave most of the GPU idle, and only when each split still gets >= 256 keys."""
    if max_seqlen_q != 1 or max_seqlen_k < 1024:
        return 1
    programs = num_seqs * num_kv_heads
    target = 256  # about two programs per streaming multiprocessor on an H100/H200
    if programs >= target:
        return 1
    return max(1, min(target // programs, max_seqlen_k // 256, 32))


def paged_attention_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    seqused_k: torch.Tensor,
    max_seqlen_k: int,
    softmax_scale: float,
    block_table: torch.Tensor,
    sliding_window: int | None = None,
    query_lens: tuple[int, ...] = (),
    seq_lens: tuple[int, ...] = (),
    num_splits: int | None = None,
    launch: LaunchConfig | None = None,
) -> torch.Tensor:
    """Attention of a varlen query batch over the paged pool; shaped like FlashAttention's varlen
    function (see kernels/metadata.py for the arguments). `num_splits` None lets the launcher
    choose; more than 1 applies to pure decode batches only. `launch` None: `choose_launch`.
    Returns [num_tokens, Hq, head_dim]."""
    del query_lens, seq_lens  # the kernel reads lengths on the device
    _check(q.dtype in _DTYPES, f"q dtype must be one of {_DTYPES}, got {q.dtype}")
    _check(k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "q, k_cache and v_cache must share a dtype")
    _check(
        q.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
        "q [T,H,D], caches [N,bs,Hkv,D]",
    )
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kv_head_dim = k_cache.shape
    _check(kv_head_dim == head_dim, f"head_dim of q ({head_dim}) and the cache ({kv_head_dim}) differ")
    _check(
        num_q_heads % num_kv_heads == 0,
        f"{num_q_heads} query heads are no multiple of {num_kv_heads} KV heads",
    )
    for name, t in (("block_table", block_table), ("cu_seqlens_q", cu_seqlens_q), ("seqused_k", seqused_k)):
        _check(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    _check(
        block_table.dim() == 2 and block_table.stride(1) == 1, "block_table must be [seqs, blocks], row-major"
    )
    num_seqs = seqused_k.shape[0]
    _check(cu_seqlens_q.shape == (num_seqs + 1,) and block_table.shape[0] == num_seqs, "num_seqs disagree")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check(t.stride(-1) == 1, f"{name} must be contiguous in its last dim")
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out

    group = num_q_heads // num_kv_heads
    group_pad = _pow2(group)
    launch = launch or choose_launch(head_dim, group, max_seqlen_q)
    block_q, block_n = launch.block_q, launch.block_n
    head_pad = max(16, _pow2(head_dim))
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seqlen_q, max_seqlen_k)
    if max_seqlen_q != 1:
        num_splits = 1
    num_splits = max(1, int(num_splits))
    f32 = dict(dtype=torch.float32, device=q.device)
    if num_splits > 1:
        part_m = torch.empty((num_tokens, num_q_heads, num_splits), **f32)
        part_l = torch.empty((num_tokens, num_q_heads, num_splits), **f32)
        part_acc = torch.empty((num_tokens, num_q_heads, num_splits, head_pad), **f32)
    else:
        part_m = part_l = part_acc = out  # unused
    grid = (num_seqs, triton.cdiv(max_seqlen_q, block_q), num_kv_heads * num_splits)
    _paged_attention_kernel[grid](
        out, part_m, part_l, part_acc, q, k_cache, v_cache, block_table, cu_seqlens_q, seqused_k,
        softmax_scale, block_size, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n,
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, NUM_SPLITS=num_splits, TILE_IN_BLOCK=block_size % block_n == 0,
        USE_WINDOW=sliding_window is not None, IEEE_FP32=q.dtype == torch.float32,
        UPCAST=q.device.type == "cpu", num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_q_heads)](
            out, part_m, part_l, part_acc, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, SPLITS_PAD=_pow2(num_splits), HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        )  # fmt: skip
    return out
