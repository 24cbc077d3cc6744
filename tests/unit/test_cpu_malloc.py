"""The CPU executor's allocator settings (services/executor/cpu_malloc.py)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from parkade.services.executor import cpu_malloc

# A step's allocations, as malloc sees them: blocks of 2 to 16 MiB written and freed, 20 times
# after a first step has set the heap up, on the main thread or (as the executor service runs
# its steps) on a worker thread; -> the minor page faults they took. (Through malloc itself:
# torch's own threads make the count of a torch step vary from run to run.)
FAULTS = """
import ctypes, sys, threading
from parkade.services.executor.cpu_malloc import tune_malloc
mode, where = sys.argv[1:3]
print(tune_malloc({} if mode == "tuned" else {"PARKADE_MALLOC_TUNING": "0"}), file=sys.stderr)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
# On a worker thread, more than one of its arena's 64 MiB heaps: glibc unmaps an emptied one.
SIZES = [n * 2**20 for n in ((2, 16, 2, 4) if where == "main" else (16, 16, 16, 16, 16))]
def step():
    blocks = [libc.malloc(n) for n in SIZES]
    for block, n in zip(blocks, SIZES):
        ctypes.memset(block, 1, n)
    for block in blocks:
        libc.free(block)
def faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])
def steps():
    step()
    before = faults()
    for _ in range(20):
        step()
    print(faults() - before)
if where == "thread":
    worker = threading.Thread(target=steps)
    worker.start()
    worker.join()
else:
    steps()
"""

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's allocator only"
)


def _faults(mode: str, where: str) -> int:
    # Without the allocator settings a CI machine may have in its environment.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (*cpu_malloc.USER_SETTINGS, "LD_PRELOAD", cpu_malloc.OFF)
    }
    done = subprocess.run(
        [sys.executable, "-c", FAULTS, mode, where], capture_output=True, text=True, check=True, env=env
    )
    return int(done.stdout)


@glibc
@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_steps_memory_is_not_faulted_in_anew_once_tuned(where: str) -> None:
    untuned, tuned = _faults("untouched", where), _faults("tuned", where)
    assert untuned > 20 * 200  # measured: 6,120 to 6,143 on the main thread, 409,012 on a worker
    assert tuned < 200  # measured: 0 or 1 (on a worker without the one arena: 163,862)


def test_the_users_settings_win() -> None:
    assert cpu_malloc.tune_malloc({"PARKADE_MALLOC_TUNING": "0"}).endswith("(PARKADE_MALLOC_TUNING=0)")
    assert cpu_malloc.state.endswith("(PARKADE_MALLOC_TUNING=0)")
    for environ in (
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"},
        {"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"},
    ):
        assert cpu_malloc.tune_malloc(environ) == "as the environment sets it"


# The heap's growth: blocks allocated and kept (what the event loop's allocations between a step's
# blocks amount to), each written once; -> the minor page faults they took, after a reserve of
# argv[1] MiB (0: none) made once the process had set up.
GROWTH = """
import ctypes, sys
from parkade.services.executor.cpu_malloc import reserve_heap, tune_malloc
tune_malloc({})
print(reserve_heap(int(sys.argv[1]) << 20), file=sys.stderr)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
def faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])
before = faults()
for _ in range(24):
    block = libc.malloc(2 << 20)
    ctypes.memset(block, 1, 2 << 20)
print(faults() - before)
"""


def _growth_faults(reserve_mib: int) -> tuple[int, int]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (*cpu_malloc.USER_SETTINGS, "LD_PRELOAD", cpu_malloc.OFF)
    }
    done = subprocess.run(
        [sys.executable, "-c", GROWTH, str(reserve_mib)], capture_output=True, text=True, check=True, env=env
    )
    return int(done.stdout), int(done.stderr.strip().splitlines()[-1])


@glibc
def test_the_heap_grows_into_the_reserve_without_faulting() -> None:
    grown, none = _growth_faults(0)
    assert none == 0
    assert grown > 24 * 400  # 48 MiB kept: 12,288 pages, each faulted in as it is first written
    faults, reserved = _growth_faults(64)
    assert reserved == 64 << 20
    assert faults < 200  # measured: a handful
    _, capped = _growth_faults(4096)
    assert capped == cpu_malloc.MAX_RESERVE


def test_no_reserve_where_the_allocator_is_not_tuned() -> None:
    cpu_malloc.tune_malloc({"PARKADE_MALLOC_TUNING": "0"})
    assert cpu_malloc.reserve_heap(64 << 20) == 0
    assert "faulted in" not in cpu_malloc.state


def test_the_executors_reserve_follows_a_full_steps_activations() -> None:
    import dataclasses

    from parkade.models import DEFAULT_MODEL
    from parkade.services.common.model_config import ModelConfig
    from parkade.services.executor.build import MIN_HEAP_RESERVE, heap_reserve_bytes

    stories = ModelConfig.from_pretrained(DEFAULT_MODEL, "float32")  # 64 wide: the floor
    assert heap_reserve_bytes(stories, 2048) == MIN_HEAP_RESERVE
    # tiny-llama's shape (the anchors' benchmark model): 3,072 floats a token, 2,048 tokens, x10.
    shape = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    tiny = dataclasses.replace(stories, **shape, intermediate_size=768)
    assert heap_reserve_bytes(tiny, 2048) == 240 * 2**20
