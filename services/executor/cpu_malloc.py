"""glibc's allocator, set for a CPU executor's steps.

Torch has no caching allocator on the CPU: every step allocates its activations anew and frees
them (a 2,048-token prefill step of tiny-llama: tensors of 1 to 16 MiB; of a 7B model, tens of
MiB). With glibc's defaults the next step faults the same pages in again, each one zeroed by the
kernel, for three reasons:

- a block above the mmap threshold (128 KiB at first, raised as such blocks are freed, to 32 MiB
  at most) gets a mapping of its own, unmapped when it is freed;
- the top of the main heap goes back to the kernel whenever more than the trim threshold
  (128 KiB at first) lies free there;
- the executor service runs each step on a worker thread (the event loop stays free), and a
  thread other than the main one allocates from an arena of its own, made of 64 MiB heaps that
  glibc unmaps as soon as they are empty, whatever the trim threshold says.

So `tune_malloc` keeps every thread on the main arena (M_ARENA_MAX 1: the step thread is the
only one that allocates much, so there is no lock to contend for), and raises both thresholds.
Measured on tiny-llama, 64 prompts of 256 tokens (2 cores, AMD EPYC), steps on the main thread:
about 30,000 minor faults a round and prefill steps of 32 to 86 ms; tuned, 0 to 6,000 faults and
26 to 31 ms. vLLM's CPU backend gets the same from tcmalloc, preloaded.

The cost: up to `TRIM_THRESHOLD` of freed memory stays with the process, and blocks up to the mmap
threshold come from the heap, whose free space is reused rather than returned.

That stops a step faulting in what the last step freed, but not the heap's growth. Under the
service the heap grows round after round into fresh pages (in one process, `LLM`, the same rounds
leave it flat after the first: the event loop's allocations, records, plans and results, land
between the steps' blocks, we think; not traced further). Measured under `parkade up`
(tiny-llama, rounds of 64 requests of 256 + 128 tokens, 2 vCPU AMD EPYC VM), the heap grew 206 MB
in rounds 2-14, by 8,000-8,700 faults in the second round and 1,000-2,200 in the 11th to 14th.
The faults land in the prefill steps, and cost more there than their count says: in this VM,
`clear_page_erms` was half of the executor's CPU samples during the first two 2,048-token steps
of a round (115-145 ms each against 50-60 after), where one thread faulting fresh pages alone
takes 2-3.5 us a page (why the steps' faults cost more was not established). So
`reserve_heap` faults a reserve in at start-up and frees it to the top of the heap, where its
pages stay (the main arena returns memory only by trimming its top above `TRIM_THRESHOLD`): the
heap's growth then reuses them. With 240 MiB reserved (the executor's default for tiny-llama), the
same stack took 40-140 faults a round in rounds 2-6, and its heap did not grow.
"""

from __future__ import annotations

import ctypes
import logging
import platform
from collections.abc import Mapping

log = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
# Tried in turn: glibc 2.36 takes 256 MiB; an older one may refuse more than 32 MiB (half its
# heap size on 64-bit), its documented maximum.
MMAP_THRESHOLDS = (256 * 2**20, 32 * 2**20)
TRIM_THRESHOLD = 2**30
# `reserve_heap` allocates in blocks of this size (below both mmap thresholds, so from the heap),
# and never more in all than half the trim threshold (glibc would trim the rest away).
RESERVE_BLOCK = 16 * 2**20
MAX_RESERVE = TRIM_THRESHOLD // 2
# The user's own settings win: glibc's environment knobs, or another allocator preloaded.
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX", "GLIBC_TUNABLES")
OFF = "PARKADE_MALLOC_TUNING"  # "0": leave the allocator as it is
state = "not set"  # what the last `tune_malloc` did, for `cpu_paths`


def tune_malloc(environ: Mapping[str, str]) -> str:
    """One arena, and raised mmap and trim thresholds (see the module), unless `environ` (the
    process's environment) sets the allocator up otherwise; -> what was done, in words (the
    executor logs it with its CPU paths).

    NOTE: call it before the threads that run steps first allocate: a thread keeps the arena it
    was given."""
    global state
    state = _tune(environ)
    return state


def _tune(environ: Mapping[str, str]) -> str:
    if environ.get(OFF) == "0":
        return f"glibc's defaults ({OFF}=0)"
    if any(environ.get(name) for name in USER_SETTINGS) or "malloc" in environ.get("LD_PRELOAD", ""):
        return "as the environment sets it"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "the platform's"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "the platform's (no mallopt)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt answers 1 when it took the value; each setting is reported as it took effect.
    done = []
    if mallopt(M_ARENA_MAX, 1) == 1:
        done.append("one arena")
    mmap = next((t for t in MMAP_THRESHOLDS if mallopt(M_MMAP_THRESHOLD, t) == 1), None)
    if mmap is not None:
        done.append(f"mmap threshold {mmap >> 20} MiB")
    if mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1:
        done.append(f"trim threshold {TRIM_THRESHOLD >> 20} MiB")
    if len(done) < 3:
        log.warning("glibc refused some of the allocator's settings (took: %s)", ", ".join(done) or "none")
    return "glibc, " + ", ".join(done) if done else "glibc's defaults (mallopt refused)"


def reserve_heap(nbytes: int) -> int:
    """Fault `nbytes` (rounded up to `RESERVE_BLOCK`, at most `MAX_RESERVE`) of the main heap in
    now and leave them free at its top, for the steps' blocks to come (see the module); -> bytes
    reserved: 0 unless `tune_malloc` set glibc up (another allocator's pages would not stay).

    NOTE: call it on the main thread after `tune_malloc`, once the start-up's own allocations are
    done (a block allocated after the reserve and kept for good would split it)."""
    global state
    if not state.startswith("glibc, one arena") or nbytes <= 0:
        return 0
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
    blocks: list[int] = []
    try:
        for _ in range(-(-min(nbytes, MAX_RESERVE) // RESERVE_BLOCK)):
            block = libc.malloc(RESERVE_BLOCK)
            if not block:
                break
            blocks.append(block)
            ctypes.memset(block, 0, RESERVE_BLOCK)
    finally:
        for block in reversed(blocks):  # the newest is next to the top: each merges into it
            libc.free(block)
    reserved = len(blocks) * RESERVE_BLOCK
    state += f", {reserved >> 20} MiB of heap faulted in"
    return reserved
