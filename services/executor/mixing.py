"""`splitmix64`: 64 well-mixed bits of an integer, the seeds of seeded sampling and of the
simulated executor's tokens. Torch-free, so that the simulated executor stays without torch."""

from __future__ import annotations

MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """splitmix64's step and finalizer (Steele et al.): a bijection of 64-bit integers."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)
