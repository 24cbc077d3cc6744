"""The exponential race: one token id per row of logits, sampled or greedy, from a 64-bit key per row.

    t > 0:   argmax_j  z[j] / t - log(E[j]),  E = -log(U[j])    a draw from softmax(z / t)
    t == 0:  argmax_j  z[j]                                      greedy

U[j] is a counter-based hash of (key, j), not a stateful generator's output, so a row's token is a
pure function of (key, z, t): a seeded request samples the same token alone, in any batch, and when
recomputed after preemption, and no generator state is shared between rows. `csrc/race.c` runs it in
one vectorized pass over CPU rows (in the CPU kernels' library, `attention_cpu.library()`); the torch
code here is its exact twin in integer arithmetic (GPU tensors; CPUs without a C compiler), with
torch's log in place of the C one: the two agree token for token except where two scores tie to
within a float's last bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from parkade.kernels import attention_cpu

__all__ = ["race", "race_torch", "uniforms"]

MASK32 = 0xFFFFFFFF
# Rows x tokens below which one thread does the whole race: a hand-off to the team costs more.
MIN_PARALLEL_WORK = 65_536


def _signed(key: int) -> int:
    """A 64-bit key as the int64 that holds the same bits."""
    key &= (1 << 64) - 1
    return key - (1 << 64) if key >= 1 << 63 else key


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2^32 for h in [0, 2^32), in 16-bit halves of c: no int64 product overflows."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """csrc/race.c's fmix32 (murmur3's finalizer) on int64 tensors holding 32-bit values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _key_tensor(keys: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(keys)] int64 holding the 64-bit keys' bits."""
    return torch.tensor([_signed(key) for key in keys], dtype=torch.int64, device=device)


def uniforms(keys: Sequence[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(keys), vocab] float32: U of every (row, token), bit for bit csrc/race.c's race_uniform."""
    k = _key_tensor(keys, device)[:, None]
    lo, hi = k & MASK32, (k >> 32) & MASK32
    j = torch.arange(vocab, dtype=torch.int64, device=device)
    h = _fmix32(_fmix32((_mul32(j, 0x9E3779B9)[None, :] + lo) & MASK32) ^ hi)
    return ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23


def race_torch(z: torch.Tensor, temperature: Sequence[float], keys: Sequence[int]) -> torch.Tensor:
    """The race in torch ops on z's device: z [m, vocab] float -> [m] int64."""
    if not any(temperature):  # all greedy: no noise to draw
        return z.argmax(dim=-1)
    vocab = z.shape[1]
    t = torch.tensor(temperature, dtype=torch.float32, device=z.device)[:, None]
    gumbel = -uniforms(keys, vocab, z.device).log().neg_().log_()
    z = z.to(torch.float32)
    scores = torch.where(t > 0, z / torch.where(t > 0, t, 1.0) + gumbel, z)
    return scores.argmax(dim=-1)


def race(z: torch.Tensor, temperature: Sequence[float], keys: Sequence[int]) -> torch.Tensor:
    """z [m, vocab] (logits, or filtered logits with -inf), temperature[i] >= 0 and keys[i] (64-bit)
    per row -> [m] int64 token ids on z's device. z is not modified."""
    m, vocab = z.shape
    if len(temperature) != m or len(keys) != m:
        raise ValueError(f"{len(temperature)} temperatures and {len(keys)} keys for {m} rows")
    if z.device.type != "cpu" or m == 0 or vocab == 0 or not attention_cpu.available():
        return (
            race_torch(z, temperature, keys)
            if m and vocab
            else torch.zeros(m, dtype=torch.int64, device=z.device)
        )
    if z.dtype != torch.float32 or z.stride(1) != 1 or z.stride(0) < vocab:  # e.g. expanded rows
        z = z.to(torch.float32).contiguous()
    t = torch.tensor(temperature, dtype=torch.float32)
    k = _key_tensor(keys)
    out = torch.empty(m, dtype=torch.int64)
    team = m * vocab >= MIN_PARALLEL_WORK and attention_cpu.shared_openmp()  # torch's own threads
    threads = torch.get_num_threads() if team else 1
    rc = attention_cpu.library().parkade_race(
        z.data_ptr(), m, vocab, z.stride(0), t.data_ptr(), k.data_ptr(), out.data_ptr(), threads
    )
    if rc:  # z is 2-D with unit stride here, so this cannot happen; never run on unchecked buffers
        raise RuntimeError("parkade_race rejected its shapes")
    return out
