"""The CPU backend: a compiled decode-attention kernel; prefill chunks through torch's SDPA.

Decode steps are most of serving, and the torch path pays there for gathering every request's
blocks into padded fp32 copies each layer. `csrc/decode_attention.c` reads each request's K/V rows
in place, in the cache dtype, once per KV head, and skips padding. It is built on first use with
the system C compiler (`-O3 -march=native`, about a second) into `$PARKADE_HOME/kernels/`, keyed by
source, flags, compiler and CPU, and called through ctypes, which releases the GIL: the work items
(request, KV head) are split by cost over `torch.get_num_threads()` Python threads.

`available()` says whether the kernel can be built here (a C compiler); `get_attention_backend('auto')`
picks this backend on a CPU only when it can. Caches of other dtypes than fp32 and bf16 (fp16) and
head dims above 256 take the torch decode path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import numpy as np
import torch

from parkade.kernels import attention_torch
from parkade.kernels.attention_torch import write_kv_cache

__all__ = ["available", "build", "decode_attention", "paged_attention_varlen", "write_kv_cache"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.c"
# -fassociative-math (with the two flags it needs) lets the compiler vectorize the dot products'
# reductions; no -ffinite-math-only: the online softmax starts from -inf.
CFLAGS = (
    "-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
    "-fassociative-math", "-fno-signed-zeros",
)  # fmt: skip
MAX_HEAD_DIM, MAX_HEADS, MAX_WIDTH = 256, 128, 512  # the kernel's fixed buffers
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# Below this many keys x KV heads in a step, one thread does it all: a hand-off costs more.
MIN_PARALLEL_WORK = 16_384


class KernelBuildError(RuntimeError):
    pass


def _cpu_identity() -> str:
    """What -march=native depends on, so that a cache shared between machines cannot mix them up."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise KernelBuildError("no C compiler found (set CC, or install gcc)")
    return compiler


def _cache_dir() -> Path:
    home = os.environ.get("PARKADE_HOME") or "~/.cache/parkade"
    return Path(home).expanduser() / "kernels"


@cache
def _library() -> ctypes.CDLL:
    """Build (once per source, flags, compiler and CPU) and load the kernel library."""
    compiler = _compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelBuildError(f"C compiler {compiler} does not run: {error}") from error
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), *CFLAGS, compiler, version, _cpu_identity()]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"decode_attention-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent builders never load a half-written file.
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
        os.close(fd)
        try:
            command = [compiler, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"]
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as error:  # e.g. the 300 s timeout
                raise KernelBuildError(f"building {SOURCE.name} failed: {error}") from error
            if result.returncode:
                raise KernelBuildError(f"building {SOURCE.name} failed:\n{result.stderr.strip()}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        log.info("built the CPU decode-attention kernel: %s", target)
    lib = ctypes.CDLL(str(target))
    fn = lib.decode_attention
    fn.restype = ctypes.c_int
    i32, i64, ptr, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    fn.argtypes = [ptr, ptr, ptr, i32, ptr, i64, ptr, ptr, i32, i32, i32, i32, f32, i32, i32, i64, i64]
    return lib


def build() -> None:
    """Build and load the kernel now; ValueError says why it cannot run here."""
    try:
        _library()
    except (KernelBuildError, OSError) as error:
        raise ValueError(f"the CPU attention kernel cannot run here: {error}") from error


@cache
def available() -> bool:
    """Whether the compiled kernel builds and loads here (the reason is logged when not)."""
    try:
        build()
    except ValueError as error:
        log.warning("%s; using the torch backend", error)
        return False
    return True


_pool_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}  # by size; never shut down while a caller may hold one


def _thread_pool(size: int) -> ThreadPoolExecutor:
    with _pool_lock:
        if size not in _pools:
            _pools[size] = ThreadPoolExecutor(size, thread_name_prefix="parkade-attn")
        return _pools[size]


def _split_by_cost(costs: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """Contiguous item ranges of about equal total cost."""
    bounds = np.searchsorted(np.cumsum(costs), np.arange(1, parts) * costs.sum() / parts, side="right")
    edges = [0, *sorted(set(bounds.tolist()) - {0, len(costs)}), len(costs)]
    return list(itertools.pairwise(edges))


def decode_attention(
    q: torch.Tensor,  # [num_decodes, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_decodes, max_num_blocks] int32
    seq_lens: list[int],
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One query per request over its paged context (see the C source); -> q's shape and dtype."""
    num_decodes, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if (
        k_cache.dtype not in _DTYPE_CODES
        or head_dim > MAX_HEAD_DIM
        or group > MAX_HEADS
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):  # e.g. an fp16 cache: the torch path computes it
        return attention_torch.decode_batch(q, k_cache, v_cache, block_table, seq_lens, scale, sliding_window)
    threads = torch.get_num_threads()
    # A request's token rows (all KV heads) are contiguous: one item of all its heads streams them.
    # Split heads only when there are too few requests to keep every thread busy.
    heads_per_item = 1
    if num_decodes >= 2 * threads:
        heads_per_item = max(
            k
            for k in range(1, num_kv_heads + 1)
            if num_kv_heads % k == 0 and k * head_dim <= MAX_WIDTH and k * group <= MAX_HEADS
        )
    qf = q.to(torch.float32).contiguous()
    table = block_table.to(torch.int32).contiguous()
    lens = np.asarray(seq_lens, dtype=np.int32)
    out = torch.empty(qf.shape, dtype=torch.float32)
    fn = _library().decode_attention

    def run(begin: int, end: int) -> None:
        rc = fn(
            qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _DTYPE_CODES[k_cache.dtype],
            table.data_ptr(), table.stride(0), lens.ctypes.data, out.data_ptr(),
            num_q_heads, num_kv_heads, head_dim, block_size, scale, sliding_window or 0, heads_per_item,
            begin, end,
        )  # fmt: skip
        if rc:  # the checks above make this unreachable; never run with unchecked buffers
            raise RuntimeError("decode_attention rejected its shapes")

    items_per_seq = num_kv_heads // heads_per_item
    num_items = num_decodes * items_per_seq
    costs = np.repeat(lens.astype(np.int64) * heads_per_item, items_per_seq)  # key rows each item reads
    if threads <= 1 or costs.sum() < MIN_PARALLEL_WORK:
        run(0, num_items)
    else:
        pool = _thread_pool(threads)
        for future in [pool.submit(run, a, b) for a, b in _split_by_cost(costs, threads)]:
            future.result()
    return out.to(q.dtype)


# The torch backend's batch splitting, with the decode rows on the compiled kernel.
paged_attention_varlen = functools.partial(attention_torch.paged_attention_varlen, decode=decode_attention)
