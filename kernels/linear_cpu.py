"""bf16 linear layers on a CPU's AMX tiles (`csrc/linear_amx.c`) or, without them, on AVX512-BF16
vector units (`csrc/linear_dpbf16.c`), for a CPU executor's weights.

A decode step multiplies a few rows by every weight of the model, so it is bound by reading the
weights from DRAM; the kernels stream each weight once, in a layout packed for them at start
(`pack_weight`; both read the same one). `DecoderLM.use_packed_linears` packs a model's matmuls
(q/k/v and gate/up concatenated) and calls them through the op `parkade::linear_amx`, which
torch.compile keeps whole, as it keeps `parkade::paged_attention`. Steps of more rows than the
kernel's `max_rows` (a prefill) go to oneDNN on a copy of the weight prepacked for it at start
(`prepack_onednn`, as inductor's freezing packs the weights it sees: 4-7 % faster than `F.linear`
on the plain weight at 256-4,096 rows of small-llama on a Zen 4 EPYC, 2026-12-07).

It serves where `serves(dtype)` says: bf16 weights, a library built with AMX on a CPU that has it
(Linux grants the tiles; `PARKADE_CPU_AMX=0` turns them off, as for attention) or built with
AVX512-BF16, and OpenMP threads shared with torch. `PARKADE_CPU_PACKED_LINEARS=0` leaves the
matmuls to oneDNN. The kernels live in the attention library (`attention_cpu.library()`): one
build, one load.
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from parkade.kernels import attention_cpu

__all__ = ["Kernel", "kernel", "linear", "pack_weight", "prepack_onednn", "serves"]

TILE_K = 32  # K per tile step: 16 bf16 pairs
PANEL = 32  # output columns per packed panel: two 16-column tiles


@dataclass(frozen=True)
class Kernel:
    """The packed-linear kernel this CPU runs: its name, C function, and the rows it takes (others
    go to oneDNN)."""

    name: str
    run: Callable[..., int]
    max_rows: int


# AMX: rows above which oneDNN's matmul is as fast: a step of more tokens (a prefill) is bound by
# the multiplies, not by reading the weights. Measured on small-llama's weights, two cores of an AMX
# Xeon (loadtest/linear_bench.py): this kernel 21.6 ms against 28.4 at 128 rows, 32.1 against 35.7
# at 256, 46.7 against 45.8 at 384.
AMX_MAX_ROWS = 256
# AVX512-BF16 (no AMX): rows up to which the kernel reads the weights faster than oneDNN's prepacked
# matmul computes: small-llama's step on a Zen 4 EPYC, two threads (loadtest/linear_bench.py,
# 2026-12-07), 8.2 against 9.9 ms at 16 rows, 13.5 / 15.7 at 32, 20.0 / 22.3 at 48, 28.4 / 28.2 at 64;
# in its offline round, decode steps 8.2-8.4 s against 9.2-10.2 (docs/benchmarks.md).
DPBF16_MAX_ROWS = 64


@cache
def kernel() -> Kernel | None:
    """AMX where the tiles run, else AVX512-BF16 where the library has it; None: neither."""
    try:
        lib = attention_cpu.library()
    except attention_cpu.KernelBuildError:
        return None
    if lib.parkade_linear_amx_available():
        return Kernel("amx", lib.parkade_linear_amx, AMX_MAX_ROWS)
    if hasattr(lib, "parkade_linear_dpbf16") and lib.parkade_linear_dpbf16_available():
        return Kernel("avx512_bf16", lib.parkade_linear_dpbf16, DPBF16_MAX_ROWS)
    return None


def serves(dtype: torch.dtype) -> bool:
    """Whether linears of this dtype run on a packed-linear kernel here."""
    if dtype != torch.bfloat16 or os.environ.get("PARKADE_CPU_PACKED_LINEARS", "1") == "0":
        return False
    return kernel() is not None and attention_cpu.shared_openmp()


# oneDNN's own packed copies of weights, for the steps of more rows than the kernel takes, by
# `prepack_onednn`'s handle (an int the compiled graph keeps as a constant, where an opaque oneDNN
# tensor would not trace). An entry lives as long as its owner (the module that calls the op with
# its handle): a model built anew in the same process does not keep the old one's copies.
_ONEDNN: dict[int, torch.Tensor] = {}
_HANDLES = itertools.count()


def prepack_onednn(weight: torch.Tensor, owner: object | None = None) -> int:
    """weight [N, K] -> a handle to oneDNN's packed copy of it, dropped once `owner` is (None: kept
    for the process's life); -1 where oneDNN cannot pack it (the plain weight then serves those
    steps, through F.linear)."""
    try:
        prepacked = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (RuntimeError, AttributeError):
        return -1
    handle = next(_HANDLES)
    _ONEDNN[handle] = prepacked
    if owner is not None:
        weakref.finalize(owner, _ONEDNN.pop, handle, None)
    return handle


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


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_features: int,
    onednn: int = -1,
) -> torch.Tensor:
    """x [M, K] bf16 -> x W^T + bias [M, out_features] bf16: W [out_features, K], `packed` its
    `pack_weight`. Up to the kernel's max_rows rows on the kernel; more (or where no kernel runs) on
    oneDNN: its packed copy `onednn` (`prepack_onednn`'s handle), else F.linear on `weight` (W
    itself, or None where `onednn` is given: its only other use is the check below)."""
    m, k = x.shape
    chosen = kernel()
    if chosen is None or m > chosen.max_rows:
        if onednn >= 0:
            return torch.ops.mkldnn._linear_pointwise(x, _ONEDNN[onednn], bias, "none", [], "")
        if weight is None:
            raise ValueError("a packed linear without a oneDNN copy needs its plain weight")
        return F.linear(x, weight, bias)
    # Checked here, cheaply, because the kernel trusts them: it reads k columns of every packed row.
    fits = weight is None or weight.shape == (out_features, k)
    if not (fits and x.dtype == packed.dtype == torch.bfloat16) or (
        packed.shape != (-(-out_features // PANEL), -(-k // TILE_K) * 1024)
    ):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit packed weights {tuple(packed.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.stride(0) != 1):
        bias = bias.to(torch.bfloat16).contiguous()
    out = x.new_empty((m, out_features))
    rc = chosen.run(
        x.data_ptr(), x.stride(0), m, k, packed.data_ptr(), out_features,
        None if bias is None else bias.data_ptr(), out.data_ptr(), out_features, torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise RuntimeError(f"the {chosen.name} linear kernel cannot run here (no AMX tiles, or no memory)")
    return out


_LIBRARY = torch.library.Library("parkade", "FRAGMENT")
_LIBRARY.define(
    "linear_amx(Tensor x, Tensor packed, Tensor? weight, Tensor? bias, int out_features, int onednn=-1)"
    " -> Tensor"
)
_LIBRARY.impl("linear_amx", linear, "CPU")


@torch.library.register_fake("parkade::linear_amx")
def _(x, packed, weight, bias, out_features, onednn=-1):
    return x.new_empty((x.shape[0], out_features))
