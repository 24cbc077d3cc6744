"""The packed-linear kernels (`kernels/linear_cpu.py`: `csrc/linear_amx.c` on AMX tiles,
`csrc/linear_dpbf16.c` on AVX512-BF16) and the model's packed linears.

Each kernel accumulates each output in fp32 over K in order and rounds once, as oneDNN's bf16
matmul does. The AMX kernel must equal torch's bf16 `F.linear` bit for bit, padding (N and K not
multiples of 32, rows not a multiple of 16) and bias included; the AVX512-BF16 one too where oneDNN
sums K in one pass, and within one bf16 rounding of it where oneDNN splits a long K into parts
(measured on a Zen 4 EPYC: K 768 and 2,048 differ in a few outputs by one unit in the last place).
The layout test runs on every CPU; the kernel tests only where a kernel serves (an AMX or
AVX512-BF16 CPU), since elsewhere nothing calls them. The model on packed linears:
tests/unit/test_model_vs_transformers.py.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from parkade.kernels import linear_cpu

needs_kernel = pytest.mark.skipif(
    not linear_cpu.serves(torch.bfloat16),
    reason="a packed-linear kernel serves only on a CPU with AMX tiles or AVX512-BF16",
)


def assert_matches_torch(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit for bit on AMX; on AVX512-BF16 each output within one bf16 rounding of oneDNN's (see
    the module's docstring), and most of them equal."""
    if linear_cpu.kernel().name == "amx":
        assert torch.equal(out, ref)
        return
    out, ref = out.float(), ref.float()
    assert ((out - ref).abs() <= 2**-7 * ref.abs() + 2**-9 * ref.abs().max()).all()
    assert (out == ref).float().mean() > 0.99


def test_the_packed_layout_holds_each_weight_where_the_tiles_read_it():
    n, k = 40, 70  # both padded: to 64 columns (two panels) and 96 (three K steps)
    w = torch.randn(n, k).bfloat16()
    packed = linear_cpu.pack_weight(w)
    assert packed.shape == (2, 3 * 1024) and packed.dtype == torch.bfloat16
    tiles = packed.view(2, 3, 2, 16, 16, 2)  # [panel, k step, tile, pair row, column, pair element]
    for p, s, t, r, j, e in [(0, 0, 0, 0, 0, 0), (0, 1, 1, 3, 7, 1), (1, 0, 0, 5, 2, 0), (0, 2, 0, 2, 9, 1)]:
        assert tiles[p, s, t, r, j, e] == w[32 * p + 16 * t + j, 32 * s + 2 * r + e]
    assert tiles[1, 0, 0, 0, 8:].abs().sum() == 0  # columns 40.. are zero
    assert tiles[0, 2, :, 3:].abs().sum() == 0  # k 70.. are zero


CASES = [  # (rows, outputs, inputs, bias)
    (1, 32, 32, False),
    (5, 48, 100, True),
    (16, 1280, 768, False),
    (17, 768, 2048, True),
    (33, 4096, 256, False),
    (64, 8192, 256, False),
    (100, 172, 64, True),
    (64, 96, 128, True),  # the most rows both kernels take
]


@needs_kernel
@pytest.mark.parametrize(("m", "n", "k", "with_bias"), CASES)
def test_the_kernel_equals_torch_bf16_linear_bit_for_bit(m, n, k, with_bias):
    gen = torch.Generator().manual_seed(m * 7 + n)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (0.05 * torch.randn(n, k, generator=gen)).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    out = torch.ops.parkade.linear_amx(x, linear_cpu.pack_weight(w), w, bias, n)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert_matches_torch(out, F.linear(x, w, bias))


@needs_kernel
def test_rows_of_a_wider_tensor_and_many_rows_go_right():
    w = (0.05 * torch.randn(96, 64)).bfloat16()
    bias = torch.randn(96).bfloat16()
    packed = linear_cpu.pack_weight(w)
    wide = torch.randn(9, 100).bfloat16()
    x = wide[:, 10:74]  # row stride 100, not 64
    assert_matches_torch(linear_cpu.linear(x, packed, w, None, 96), F.linear(x, w))
    many = torch.randn(linear_cpu.kernel().max_rows + 1, 64).bfloat16()  # oneDNN's side of max_rows
    assert torch.equal(linear_cpu.linear(many, packed, w, None, 96), F.linear(many, w))
    owner = torch.nn.Module()
    onednn = linear_cpu.prepack_onednn(w, owner)  # oneDNN's packed copy serves them where there is one
    assert onednn >= 0
    out = torch.ops.parkade.linear_amx(many, packed, w, bias, 96, onednn)
    prepacked = linear_cpu._ONEDNN[onednn]
    assert torch.equal(out, torch.ops.mkldnn._linear_pointwise(many, prepacked, bias, "none", [], ""))
    torch.testing.assert_close(out, F.linear(many, w, bias), rtol=2**-7, atol=2**-7)
    del owner  # the copy goes with its owner
    gc.collect()
    assert onednn not in linear_cpu._ONEDNN


@needs_kernel
def test_inputs_that_do_not_fit_the_packed_weight_are_refused():
    w = torch.randn(64, 64).bfloat16()
    packed = linear_cpu.pack_weight(w)
    with pytest.raises(ValueError, match="does not fit"):
        linear_cpu.linear(torch.randn(2, 96).bfloat16(), packed, w, None, 64)  # K 96, packed for 64
    with pytest.raises(ValueError, match="does not fit"):
        linear_cpu.linear(torch.randn(2, 64), packed, w, None, 64)  # fp32
    with pytest.raises(ValueError, match="does not fit"):
        linear_cpu.linear(torch.randn(2, 64).bfloat16(), packed, w, None, 96)  # more outputs than packed
