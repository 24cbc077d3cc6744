"""The compiled CPU attention kernel on serving-sized batches, where its own paths switch on.

The small cases of test_attention_torch.py run it against a dense reference; here a batch is big
enough that items hold every KV head of a request and that the work is split over threads, and
the torch path (itself checked against the dense reference) is the expected value. Head dims pick
the kernel's vector paths: 64 and 128 (VDPBF16PS dot products on a bf16 cache where the CPU has
AVX512-BF16, fp32 vectors otherwise), 48 (fp32 vectors only), 8 (scalar loops). The pool
write (`write_kv_cache`, a C loop of row copies) is checked against the torch path's.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_attention_torch import TOLERANCE, dense_reference, make_case, run_paged

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
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (12, 4, 64), (8, 8, 128), (6, 2, 48), (4, 2, 8)]
)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 48, 8])
@pytest.mark.parametrize("window", [None, 50])
def test_mixed_prefill_and_decode_rows_on_threads(two_threads, dtype, head_dim, window):
    # 40 decodes and 6 prefill chunks, 3 of them after a cached context: every row in one call.
    gen = torch.Generator().manual_seed(head_dim)
    seq_lens = torch.randint(200, 500, (46,), generator=gen).tolist()
    query_lens = [1] * 40 + [min(n, q) for n, q in zip(seq_lens[40:], [300, 37, 5, 120, 64, 2], strict=True)]
    case = make_case(
        seq_lens, query_lens, block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=head_dim, dtype=dtype,
        shared_blocks=3,
    )  # fmt: skip
    scale = head_dim**-0.5
    got = run_paged(case, scale, window, backend="cpu")
    assert sum(seq_lens) * 2 >= attention_cpu.MIN_PARALLEL_WORK  # the threaded split runs
    expected = dense_reference(case, scale, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim"),
    # groups of 2 (8 rows a block), 3 (5 rows, a spare lane), 7, 1 (16 rows); 16: one row a block, so
    # the row path, in the same call
    [(4, 2, 64), (12, 4, 64), (28, 4, 128), (8, 8, 128), (16, 1, 64)],
)
def test_prefill_blocks_equal_the_dense_reference(two_threads, num_q_heads, num_kv_heads, head_dim):
    # A bf16 step of prefill chunks (from position 0, after a cached context, one row past a block,
    # two rows) and decodes: the chunks' rows go in blocks of 16 / group rows against each KV head
    # (`paged_attention_units`) where the build has AVX512-BF16, in the same call as the decodes.
    gen = torch.Generator().manual_seed(num_q_heads * head_dim)
    query_lens = [256, 17, 120, 9, 2, 1, 1, 1, 64]
    seq_lens = [256, 17, 400, 300, 2, 350, 90, 1, 64 + 16 * 7]
    case = make_case(
        seq_lens, query_lens, block_size=16, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=torch.bfloat16, seed=int(torch.randint(0, 1000, (1,), generator=gen)),
    )  # fmt: skip
    has_bf16 = "avx512_bf16" in attention_cpu.features()  # this CPU's flag: see the test below
    assert attention_cpu._blocks_handle(case.q, case.k_cache, None) == has_bf16
    scale = head_dim**-0.5
    got = run_paged(case, scale, None, backend="cpu")
    expected = dense_reference(case, scale, None)
    torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=2e-2)
    # The same rows one at a time (the row path): the two differ by the order of their sums and the
    # blocks' P.V on bf16 weights.
    positions = np.concatenate([np.arange(s - n, s) for s, n in zip(seq_lens, query_lens, strict=True)])
    row_seq = np.repeat(np.arange(len(query_lens)), query_lens)
    rows = attention_cpu._attend_rows(
        case.q, case.k_cache, case.v_cache, case.block_table, positions + 1, row_seq, scale, None
    )
    torch.testing.assert_close(got.float(), rows.float(), atol=1e-2, rtol=1e-2)


def test_prefill_blocks_are_not_used_with_a_window_or_an_fp32_cache(two_threads):
    shape = dict(block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=64)
    case = make_case([300], [300], **shape, dtype=torch.float32)
    assert not attention_cpu._blocks_handle(case.q, case.k_cache, None)
    bf16 = make_case([300], [300], **shape, dtype=torch.bfloat16)
    assert not attention_cpu._blocks_handle(bf16.q, bf16.k_cache, 100)
    assert not attention_cpu._blocks_handle(bf16.q.float(), bf16.k_cache, None)  # fp32 activations


@pytest.mark.parametrize("head_dim", [64, 48])  # the VDPBF16PS path (where the CPU has it) and the vector one
def test_bf16_q_in_and_out_equals_the_fp32_call_rounded(two_threads, head_dim):
    # A bf16 q crosses the call as bf16 and the kernel rounds its output: bit for bit what the
    # same call on q widened to fp32 gives, rounded by torch.
    case = decode_case(48, torch.bfloat16, num_q_heads=12, num_kv_heads=4, head_dim=head_dim)
    args = (case.k_cache, case.v_cache, case.block_table, list(case.seq_lens), head_dim**-0.5, None)
    got = attention_cpu.decode_attention(case.q, *args)
    wide = attention_cpu.decode_attention(case.q.float(), *args)
    assert got.dtype == torch.bfloat16 and wide.dtype == torch.float32
    assert torch.equal(got, wide.to(torch.bfloat16))


@pytest.mark.parametrize("block_size", [16, 32, 8])  # 8: not a multiple of 16, so never the tiles
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), [(12, 4, 64), (4, 2, 128)])
def test_the_amx_tiles_agree_with_the_vector_paths(
    two_threads, block_size, num_q_heads, num_kv_heads, head_dim
):
    # A bf16 step of prefill chunks and decodes, on AMX tiles where this CPU has them and on the
    # AVX512-BF16 paths: both near the dense reference and near each other (both round P.V's
    # weights to bf16 in the blocks; the tiles' decodes too). Without AMX the switch is a no-op.
    query_lens, seq_lens = [200, 33, 1, 1, 1, 5], [200, 97, 640, 31, 1, 300]
    case = make_case(
        seq_lens, query_lens, block_size=block_size, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=torch.bfloat16, seed=block_size + head_dim,
    )  # fmt: skip
    scale = head_dim**-0.5
    has_amx = "amx" in attention_cpu.features()
    try:
        assert attention_cpu.set_amx(True) == has_amx
        tiles = run_paged(case, scale, None, backend="cpu")
        assert attention_cpu.set_amx(False) is False and "amx" not in attention_cpu.features()
        vector = run_paged(case, scale, None, backend="cpu")
    finally:
        attention_cpu.set_amx(True)
    expected = dense_reference(case, scale, None)
    torch.testing.assert_close(tiles.double(), expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(vector.double(), expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(tiles.float(), vector.float(), atol=1e-2, rtol=1e-2)
    if not has_amx or block_size % 16:
        assert torch.equal(tiles, vector)
    # The decodes alone (one query row a request): the row path's items.
    shape = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    decode = decode_case(40, torch.bfloat16, **shape)
    args = (decode.q, decode.k_cache, decode.v_cache, decode.block_table, list(decode.seq_lens), scale, None)
    try:
        attention_cpu.set_amx(True)
        tiles = attention_cpu.decode_attention(*args)
        attention_cpu.set_amx(False)
        vector = attention_cpu.decode_attention(*args)
    finally:
        attention_cpu.set_amx(True)
    expected = attention_torch.decode_batch(*args)
    torch.testing.assert_close(tiles.float(), expected.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(tiles.float(), vector.float(), atol=1e-2, rtol=1e-2)


def test_the_amx_tiles_leave_onednn_matmuls_alone(two_threads):
    # oneDNN's bf16 matmuls configure the same tile registers (on AMX CPUs): the kernel loads its
    # own configuration per call and releases it after, so neither disturbs the other's results.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 768, generator=gen).to(torch.bfloat16)
    w = torch.randn(4096, 768, generator=gen).to(torch.bfloat16)
    case = decode_case(48, torch.bfloat16, num_q_heads=12, num_kv_heads=4, head_dim=64)
    args = (case.q, case.k_cache, case.v_cache, case.block_table, list(case.seq_lens), 0.125, None)
    y0, a0 = torch.nn.functional.linear(x, w), attention_cpu.decode_attention(*args)
    for _ in range(20):
        assert torch.equal(attention_cpu.decode_attention(*args), a0)
        assert torch.equal(torch.nn.functional.linear(x, w), y0)
    torch.testing.assert_close(y0.float(), x.float() @ w.float().T, atol=0.5, rtol=2e-2)


def test_the_kernel_reports_what_it_uses():
    names = attention_cpu.features()
    assert set(names) <= {"avx2", "avx512", "avx512_bf16", "amx", "openmp"}
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    # -march=native: the build uses exactly what this CPU has.
    assert ("avx512" in names) == ("avx512f" in flags)
    assert ("avx512_bf16" in names) == ("avx512_bf16" in flags and "avx512f" in flags)
    assert ("avx2" in names) == ("avx2" in flags)
    # AMX tiles: built and granted (Linux >= 5.16 grants them on request) where the CPU has them.
    assert ("amx" in names) == ({"amx_tile", "amx_bf16", "avx512_bf16"} <= set(flags))
    assert "openmp" in names  # CI's gcc has OpenMP, and torch's libgomp is the only runtime loaded


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
    attention_cpu.library.cache_clear()
    try:
        with pytest.raises(ValueError, match="no C compiler"):
            get_attention_backend("cpu", torch.device("cpu"))
    finally:
        attention_cpu.library.cache_clear()


def test_a_compiler_that_hangs_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("PARKADE_HOME", str(tmp_path))  # no cached build: the compiler must run
    real_run = subprocess.run

    def hanging_compile(command, **kwargs):
        if "-shared" in command:
            raise subprocess.TimeoutExpired(command, kwargs.get("timeout"))
        return real_run(command, **kwargs)

    monkeypatch.setattr(attention_cpu.subprocess, "run", hanging_compile)
    attention_cpu.library.cache_clear()
    try:
        with pytest.raises(ValueError, match="timed out"):
            attention_cpu.build()
        assert not list((tmp_path / "kernels").glob("*.so"))  # no half-built library left behind
    finally:
        attention_cpu.library.cache_clear()


ISA_CHILD = """
import json, torch
from test_attention_torch import dense_reference, make_case, run_paged
from parkade.kernels import attention_cpu
torch.set_num_threads(2)
worst = 0.0
for dtype, head_dim in ((torch.bfloat16, 64), (torch.float32, 64), (torch.bfloat16, 8)):
    lens = [300, 17, 250, 90]
    case = make_case(lens, [1, 17, 1, 30], block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=head_dim,
                     dtype=dtype, shared_blocks=1)
    got = run_paged(case, head_dim**-0.5, None, backend="cpu").double()
    worst = max(worst, (got - dense_reference(case, head_dim**-0.5, None)).abs().max().item())
print(json.dumps({"features": attention_cpu.features(), "worst": worst}))
"""


@pytest.mark.parametrize(("march", "expected"), [("haswell", ["avx2", "openmp"]), ("x86-64", ["openmp"])])
def test_the_avx2_and_generic_builds_on_this_cpu(tmp_path, march, expected):
    # $PARKADE_CPU_MARCH builds the kernel for an older CPU: its AVX2 and generic paths run here
    # as on a machine that has nothing newer.
    if platform.machine() != "x86_64":
        pytest.skip("x86 -march names")
    env = {**os.environ, "PARKADE_CPU_MARCH": march, "PARKADE_HOME": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", ISA_CHILD], env=env, capture_output=True, text=True, check=True, timeout=300
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["features"] == expected
    assert result["worst"] < 2e-2  # bf16 tolerance, as test_attention_torch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_pool_write_is_the_torch_paths_and_never_writes_past_the_pool(dtype):
    gen = torch.Generator().manual_seed(5)
    pools = [torch.zeros(40, 16, 2, 64, dtype=dtype) for _ in range(4)]  # C: k, v; torch: k, v
    for num_tokens in (1, 65, 300):
        key, value = (torch.randn(num_tokens, 2, 64, generator=gen).to(dtype) for _ in range(2))
        slots = torch.randperm(40 * 16, generator=gen)[:num_tokens]
        slots[::7] = -1  # padding rows (the compiled step's dummy request): not written
        attention_cpu.write_kv_cache(key, value, pools[0], pools[1], slots)
        attention_torch.write_kv_cache(key, value, pools[2], pools[3], slots)
        assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    # K and V as slices of one fused tensor (rows contiguous, the tensors not): strided copies.
    fused = torch.randn(5, 3, 2, 64, generator=gen).to(dtype)
    slots = torch.tensor([9, -1, 100, 101, 7])
    attention_cpu.write_kv_cache(fused[:, 0], fused[:, 2], pools[0], pools[1], slots)
    attention_torch.write_kv_cache(fused[:, 0], fused[:, 2], pools[2], pools[3], slots)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    before = [p.clone() for p in pools[:2]]
    slots = torch.tensor([3, 40 * 16])  # the second is one past the last slot
    with pytest.raises(IndexError, match="past the pool"):
        attention_cpu.write_kv_cache(key[:2], value[:2], pools[0], pools[1], slots)
    assert torch.equal(pools[0], before[0]) and torch.equal(pools[1], before[1])  # nothing written
    # Rows in another dtype than the pool's: the torch path casts them.
    wide = torch.randn(3, 2, 64, generator=gen, dtype=torch.float64)
    attention_cpu.write_kv_cache(wide, wide, pools[0], pools[1], torch.tensor([0, 1, 2]))
    assert torch.equal(pools[0].view(-1, 2, 64)[:3], wide.to(dtype))


def test_a_steps_plan_serves_its_layers_and_never_a_step_of_other_lengths():
    """`_step_plan` reuses the last plan while the lengths and the block table hold the same
    values (the other layers of a step), and makes a new one when they differ, also when the
    caller refilled the same tensors in place, or the table it was planned with changed later."""
    kw = dict(block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    first = make_case([40, 70, 9], [1, 1, 1], **kw)
    scale = 64**-0.5
    cu = torch.arange(4, dtype=torch.int32)
    lens = torch.tensor(first.seq_lens, dtype=torch.int32)
    table = first.block_table.clone()

    def attend(case):
        return attention_cpu.paged_attention_varlen(
            case.q, case.k_cache, case.v_cache, cu_seqlens_q=cu, max_seqlen_q=0, seqused_k=lens,
            max_seqlen_k=0, softmax_scale=scale, block_table=table,
        )  # fmt: skip

    out = attend(first)
    plan = attention_cpu._last_plan
    assert torch.equal(attend(first), out) and attention_cpu._last_plan is plan  # the next layer
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.double(), dense_reference(first, scale, None), atol=tol, rtol=tol)
    # The next step refills the same tensors in place: other lengths and other blocks.
    second = make_case([33, 5, 90], [1, 1, 1], seed=1, **kw)
    lens.copy_(torch.tensor(second.seq_lens, dtype=torch.int32))
    table.resize_(second.block_table.shape).copy_(second.block_table)
    got = attend(second)
    assert attention_cpu._last_plan is not plan
    torch.testing.assert_close(got.double(), dense_reference(second, scale, None), atol=tol, rtol=tol)
