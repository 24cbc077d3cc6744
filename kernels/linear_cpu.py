"""bf16 linear layers on AMX tiles (`csrc/linear_amx.c`), for a CPU executor's weights.

A decode step multiplies a few rows by every weight of the model, so it is bound by reading the
weights from DRAM; the kernel streams each weight once, in a layout packed for the tiles at start
(`pack_weight`), at about what two cores read (see the C file for the numbers). `DecoderLM.use_packed_linears`
packs a model's matmuls (q/k/v and gate/up concatenated) and calls them through the op
`parkade::linear_amx`, which torch.compile keeps whole, as it keeps `parkade::paged_attention`.

It serves where `serves(dtype)` says: bf16 weights, a library built with AMX on a CPU that has it
(Linux grants the tiles; `PARKADE_CPU_AMX=0` turns them off, as for attention), and OpenMP
threads shared with torch. `PARKADE_CPU_PACKED_LINEARS=0` leaves the matmuls to oneDNN.
The kernel lives in the attention library (`attention_cpu.library()`): one build, one load.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

from parkade.kernels import attention_cpu

__all__ = ["linear", "pack_weight", "serves"]

TILE_K = 32  # K per tile step: 16 bf16 pairs
PANEL = 32  # output columns per packed panel: two 16-column tiles
# Rows above which oneDNN's matmul (on the unpacked weight) is as fast: a step of more tokens
# (a prefill) is bound by the multiplies, not by reading the weights. Measured on small-llama's
# weights, two cores of an AMX Xeon (loadtest/linear_bench.py): this kernel 21.6 ms against
# 28.4 at 128 rows, 32.1 against 35.7 at 256, 46.7 against 45.8 at 384.
MAX_ROWS = 256


def serves(dtype: torch.dtype) -> bool:
    """Whether linears of this dtype run on the AMX kernel here."""
    if dtype != torch.bfloat16 or os.environ.get("PARKADE_CPU_PACKED_LINEARS", "1") == "0":
        return False
    try:
        lib = attention_cpu.library()
    except attention_cpu.KernelBuildError:
        return False
    return bool(lib.parkade_linear_amx_available()) and attention_cpu.shared_openmp()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 (nn.Linear's [out, in]) -> the kernel's layout, [ceil(N/32), ceil(K/32) * 1024]:
    zero padded, panels of 32 output columns, each K/32 steps of two VNNI B tiles (csrc/linear_amx.c)."""
    n, k = weight.shape
    n_pad, k_pad = -n % PANEL, -k % TILE_K
    w = F.pad(weight.to(torch.bfloat16), (0, k_pad, 0, n_pad))
    panels, steps = w.shape[0] // PANEL, w.shape[1] // TILE_K
    # [p, t, j, s, r, e] (n = 32p + 16t + j, k = 32s + 2r + e) -> [p, s, t, r, j, e]
    w = w.view(panels, 2, 16, steps, 16, 2).permute(0, 3, 1, 4, 2, 5)
    return w.contiguous().view(panels, steps * 1024)


@cache
def _kernel() -> Callable[..., int]:
    return attention_cpu.library().parkade_linear_amx


def linear(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x [M, K] bf16 -> x W^T + bias [M, out_features] bf16: W = `weight` [out_features, K], and
    `packed` its `pack_weight`. Up to MAX_ROWS rows on the AMX kernel; more go to oneDNN (F.linear)."""
    m, k = x.shape
    if m > MAX_ROWS:
        return F.linear(x, weight, bias)
    # Checked here, cheaply, because the kernel trusts them: it reads k columns of every packed row.
    if not (x.dtype == packed.dtype == torch.bfloat16 and weight.shape == (out_features, k)) or (
        packed.shape != (-(-out_features // PANEL), -(-k // TILE_K) * 1024)
    ):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit packed weights {tuple(packed.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.stride(0) != 1):
        bias = bias.to(torch.bfloat16).contiguous()
    out = x.new_empty((m, out_features))
    rc = _kernel()(
        x.data_ptr(), x.stride(0), m, k, packed.data_ptr(), out_features,
        None if bias is None else bias.data_ptr(), out.data_ptr(), out_features, torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise RuntimeError("the AMX linear kernel cannot run here (no AMX tiles, or out of memory)")
    return out


_LIBRARY = torch.library.Library("parkade", "FRAGMENT")
_LIBRARY.define(
    "linear_amx(Tensor x, Tensor packed, Tensor weight, Tensor? bias, int out_features) -> Tensor"
)
_LIBRARY.impl("linear_amx", linear, "CPU")


@torch.library.register_fake("parkade::linear_amx")
def _(x, packed, weight, bias, out_features):
    return x.new_empty((x.shape[0], out_features))
