"""`loadtest/kernel_bench.py`: its CPU-side logic, and one dry run of the whole script."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from loadtest_scripts import load_script

kb = load_script("kernel_bench")
SCRIPT = Path(kb.__file__)


def test_case_grid_is_every_batch_for_every_context():
    cases = kb.make_cases(kb.BATCH_SIZES, kb.CONTEXTS)
    assert len(cases) == 5 * 4
    assert cases[:5] == [kb.Case(b, 512) for b in (1, 4, 16, 64, 256)]
    assert cases[-1] == kb.Case(256, 32768)
    # By context, then batch: the first case of each context is its smallest batch.
    assert cases == sorted(cases, key=lambda c: (c.context, c.batch))
    assert kb.make_cases([4, 1, 4], [64]) == [kb.Case(1, 64), kb.Case(4, 64)]


def test_kv_bytes_by_hand():
    # K and V (2) x 4 requests x 2048 tokens x 8 KV heads x 128 dims x 2 bytes (bf16) = 32 MiB.
    assert kb.kv_bytes(kb.Case(4, 2048), kb.LLAMA_8B) == 2 * 4 * 2048 * 8 * 128 * 2 == 32 * 2**20
    assert kb.kv_bytes(kb.Case(256, 32768), kb.LLAMA_8B) == 32 * 2**30
    # fp32, 2 KV heads of 16: 2 x 2 x 64 x 2 x 16 x 4 bytes.
    assert kb.kv_bytes(kb.Case(2, 64), kb.TINY) == 32768


def test_required_bytes_holds_pool_and_contiguous_copy():
    case = kb.Case(16, 8192)
    kv = kb.kv_bytes(case, kb.LLAMA_8B)
    assert 2 * kv < kb.required_bytes(case, kb.LLAMA_8B) < 2.1 * kv
    # The pool holds whole blocks: 20 tokens take 2 blocks of 16, i.e. 32 tokens' worth.
    short, aligned = kb.Case(1, 20), kb.Case(1, 32)
    pool_short = kb.required_bytes(short, kb.LLAMA_8B) - kb.kv_bytes(short, kb.LLAMA_8B)
    pool_aligned = kb.required_bytes(aligned, kb.LLAMA_8B) - kb.kv_bytes(aligned, kb.LLAMA_8B)
    assert pool_short == pool_aligned


def test_fit_check():
    assert kb.fits(90, 100)
    assert not kb.fits(91, 100)
    assert kb.fits(100, 100, headroom=1.0)
    # The largest default case (2 x 32 GiB) fits an H200's free memory, not a 40 GB card's.
    largest = kb.required_bytes(kb.Case(256, 32768), kb.LLAMA_8B)
    assert kb.fits(largest, 139 * 2**30)
    assert not kb.fits(largest, 40 * 2**30)


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 4800.0),
        ("NVIDIA H100 80GB HBM3", 3350.0),
        ("NVIDIA H100 PCIe", 2000.0),
        ("NVIDIA A100-SXM4-80GB", 2039.0),
        ("NVIDIA A100 80GB PCIe", 1935.0),
        ("NVIDIA A100-SXM4-40GB", None),
        ("NVIDIA GeForce RTX 4090", None),
        ("cpu (dry run)", None),
    ],
)
def test_peak_lookup(name, peak):
    assert kb.peak_gbps_for(name) == peak


def test_case_record():
    case = kb.Case(4, 2048)  # 32 MiB of K/V
    record = kb.case_record(
        case, kb.LLAMA_8B, triton_s=0.32e-3, sdpa_s=None, peak_gbps=4800.0, num_splits=4, max_abs_err=0.01
    )
    gbps = 32 * 2**20 / (0.32e-3) / 1e9  # about 104.9 GB/s
    assert record["kv_bytes"] == 32 * 2**20 and record["num_splits"] == 4
    assert record["triton_ms"] == pytest.approx(0.32)
    assert record["triton_GBps"] == pytest.approx(gbps, rel=1e-3)
    assert record["triton_frac_peak"] == pytest.approx(gbps / 4800, rel=1e-3)
    assert record["sdpa_ms"] is None and record["sdpa_GBps"] is None and record["sdpa_frac_peak"] is None
    no_peak = kb.case_record(case, kb.LLAMA_8B, triton_s=1e-3, sdpa_s=2e-3, peak_gbps=None)
    assert "num_splits" not in no_peak and no_peak["triton_frac_peak"] is None
    assert no_peak["sdpa_GBps"] == pytest.approx(no_peak["triton_GBps"] / 2, rel=1e-3)


def test_report_shape():
    timings = dict(triton_s=1e-3, sdpa_s=1e-3, peak_gbps=4800.0)
    ok = kb.case_record(kb.Case(1, 512), kb.LLAMA_8B, max_abs_err=3e-3, **timings)
    other = kb.case_record(kb.Case(4, 512), kb.LLAMA_8B, **timings)
    skipped = kb.skipped_record(kb.Case(256, 32768), kb.LLAMA_8B, "needs more than 90% of free memory")
    doc = kb.report(
        device="NVIDIA H200", peak_gbps=4800.0, shape=kb.LLAMA_8B, timer="t", dry_run=False,
        records=[ok, other, skipped],
    )  # fmt: skip
    assert json.loads(json.dumps(doc)) == doc
    assert doc["cases"] == [ok, other] and doc["skipped"] == [skipped]
    assert doc["max_abs_err"] == 3e-3
    assert doc["shape"] == {
        "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16, "dtype": "bfloat16"
    }  # fmt: skip
    assert skipped["kv_bytes"] == 32 * 2**30 and skipped["required_bytes"] > 2 * skipped["kv_bytes"]


def test_without_cuda_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kb.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--dry-run" in captured.err
