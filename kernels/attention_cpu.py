"""The CPU backend: one compiled kernel for every query row of a step, decode and prefill alike.

`csrc/paged_attention.c` reads each request's K/V rows in place, in the cache dtype, and skips
padding: no gathered fp32 copy of the cache (which the torch path pays for every layer) and no
mask. A prefill chunk's row at position p is attended like a decode over keys 0..p (on a bf16
model with AVX512-BF16, a chunk's rows go in blocks that read each key once for up to 16 query
vectors: `_units_plan`). It runs on the matrix and vector units the CPU has (AMX tiles,
AVX-512 with VDPBF16PS dot products, AVX-512, AVX2: `features()` says which; $PARKADE_CPU_AMX=0
keeps it off the tiles), built on first use with the system C compiler
(`-O3 -march=native -fopenmp`, about a second; $PARKADE_CPU_MARCH picks another -march) into
`$PARKADE_HOME/kernels/`, keyed by source, flags, compiler and CPU, and called through ctypes,
which releases the GIL. The same library holds
`csrc/race.c`, the sampler's exponential race (`kernels/race.py`), and `csrc/linear_amx.c` and
`csrc/linear_dpbf16.c`, the packed linear layers (`kernels/linear_cpu.py`): one build, one load.

Threads: the kernel splits its work items (query row, KV heads) by cost over an OpenMP team of
`torch.get_num_threads()`. It links the libgomp that torch itself loaded (same soname: the loader
reuses it), so attention and torch's GEMMs share one thread pool; two pools on the same cores
would spin against each other after every op. Where that cannot hold (no OpenMP build, or torch
runs another OpenMP runtime) the items are split over Python threads instead.

`available()` says whether the kernel can be built here (a C compiler); `get_attention_backend('auto')`
picks this backend on a CPU only when it can. Caches of other dtypes than fp32 and bf16 (fp16) and
head dims above 256 take the torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import numpy as np
import torch

from parkade.kernels import attention_torch
from parkade.kernels.metadata import host_lengths

# The op (attention_op.py) leaves the host lengths to this module, which reads them once a step.
READS_LENGTHS_ONCE_PER_STEP = True

__all__ = [
    "available", "build", "decode_attention", "features", "library", "paged_attention_varlen", "set_amx",
    "shared_openmp", "write_kv_cache",
]  # fmt: skip

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
RACE_SOURCE = SOURCE.with_name("race.c")  # compiled into the same library
LINEAR_SOURCE = SOURCE.with_name("linear_amx.c")  # and these two (kernels/linear_cpu.py)
LINEAR_DPBF16_SOURCE = SOURCE.with_name("linear_dpbf16.c")
HEADERS = ("attention_amx.h", "amx_tiles.h")  # included by the sources, beside them: in the build's key
# -fassociative-math (with the two flags it needs) lets the compiler vectorize the dot products'
# reductions; no -ffinite-math-only: the online softmax starts from -inf.
CFLAGS = (
    "-O3", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
    "-fno-signed-zeros",
)  # fmt: skip
OPENMP_FLAGS = ("-fopenmp",)
# Bits of the library's parkade_attention_features() (csrc/paged_attention.c).
_FEATURES = {1: "openmp", 2: "avx2", 4: "avx512", 8: "avx512_bf16", 16: "amx"}
MAX_HEAD_DIM, MAX_HEADS, MAX_WIDTH = 256, 128, 512  # the kernel's fixed buffers
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# Below this many keys x KV heads in a step, one thread does it all: a hand-off costs more.
MIN_PARALLEL_WORK = 16_384


class KernelBuildError(RuntimeError):
    pass


def _march() -> str:
    """The CPU the kernel is built for: this one (`native`), or $PARKADE_CPU_MARCH, e.g. `haswell`
    (AVX2, no AVX-512) for a build that older CPUs share, or to run the AVX2 path on a newer one."""
    return "-march=" + (os.environ.get("PARKADE_CPU_MARCH") or "native")


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


def _build_library(compiler: str, version: str, flags: tuple[str, ...]) -> Path:
    """Compile the kernels with `flags` unless a build of these sources, flags, compiler and CPU exists."""
    sources = (SOURCE, RACE_SOURCE, LINEAR_SOURCE, LINEAR_DPBF16_SOURCE)
    headers = [h for h in (SOURCE.with_name(name) for name in HEADERS) if h.exists()]
    texts = [s.read_text() for s in (*sources, *headers)]
    key = "\0".join([*texts, *flags, compiler, version, _cpu_identity()])
    key = hashlib.sha256(key.encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builders never load a half-written file.
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    try:
        command = [compiler, *flags, *map(str, sources), "-o", tmp, "-lm"]
        names = " and ".join(s.name for s in sources)
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as error:  # e.g. the 300 s timeout
            raise KernelBuildError(f"building {names} failed: {error}") from error
        if result.returncode:
            raise KernelBuildError(f"building {names} failed:\n{result.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built the CPU attention kernel: %s", target)
    return target


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtimes mapped into this process (file names), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return set()
    return {p for p in paths if os.path.basename(p).startswith(("libgomp", "libiomp", "libomp"))}


@cache
def library() -> ctypes.CDLL:
    """Build (once per source, flags, compiler and CPU) and load the kernel library: with OpenMP
    where the compiler has it, else without (the Python threads split the work then)."""
    compiler = _compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise KernelBuildError(f"C compiler {compiler} does not run: {error}") from error
    try:
        target = _build_library(compiler, version, (*CFLAGS, _march(), *OPENMP_FLAGS))
    except KernelBuildError as error:
        if "timed out" in str(error):
            raise
        log.warning("the CPU attention kernel builds without OpenMP: %s", error)
        target = _build_library(compiler, version, (*CFLAGS, _march()))
    lib = ctypes.CDLL(str(target))
    fn = lib.paged_attention_rows
    fn.restype = ctypes.c_int
    i32, i64, ptr, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    fn.argtypes = [
        ptr, ptr, ptr, i32, ptr, i64, ptr, ptr, ptr, i32, i32, i32, i32, f32, i32, i32, i64, i64, i32, i32,
    ]  # fmt: skip
    if hasattr(lib, "paged_attention_units"):  # a build from before it (cpu_attention_bench) has not
        lib.paged_attention_units.restype = ctypes.c_int
        lib.paged_attention_units.argtypes = [
            ptr, ptr, ptr, i32, ptr, i64, ptr, ptr, ptr, i32, i32, i32, i32, f32, i32,
            ptr, ptr, ptr, ptr, i64, i32, i32,
        ]  # fmt: skip
    lib.parkade_attention_features.restype = ctypes.c_int
    lib.parkade_attention_features.argtypes = []
    if hasattr(lib, "parkade_attention_set_amx"):  # a build from before it (cpu_attention_bench) has not
        lib.parkade_attention_set_amx.restype = ctypes.c_int
        lib.parkade_attention_set_amx.argtypes = [ctypes.c_int]
        lib.parkade_attention_set_amx(os.environ.get("PARKADE_CPU_AMX", "1") != "0")
    lib.parkade_write_kv.restype = ctypes.c_int
    lib.parkade_write_kv.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    lib.parkade_race.restype = ctypes.c_int
    lib.parkade_race.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i32]
    lib.parkade_race_log.restype = None
    lib.parkade_race_log.argtypes = [ptr, ptr, i64]
    lib.parkade_linear_amx_available.restype = ctypes.c_int
    lib.parkade_linear_amx_available.argtypes = []
    lib.parkade_linear_amx.restype = ctypes.c_int
    lib.parkade_linear_amx.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, i32]
    if hasattr(lib, "parkade_linear_dpbf16"):  # a build from before it (cpu_attention_bench) has not
        lib.parkade_linear_dpbf16_available.restype = ctypes.c_int
        lib.parkade_linear_dpbf16_available.argtypes = []
        lib.parkade_linear_dpbf16.restype = ctypes.c_int
        lib.parkade_linear_dpbf16.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, i32]
    return lib


@cache
def shared_openmp() -> bool:
    """Whether the kernel's OpenMP team is torch's own: built with OpenMP, and one runtime mapped."""
    return bool(library().parkade_attention_features() & 1) and len(_openmp_runtimes()) == 1


def features() -> list[str]:
    """What the built kernel uses here: `avx2`, `avx512`, `avx512_bf16` (dot products on bf16
    pairs), `amx` (bf16 tiles: built with them, granted them by Linux, not turned off), and
    `openmp` when its threads are torch's pool. Builds the kernel if needed."""
    bits = library().parkade_attention_features()
    names = [name for bit, name in _FEATURES.items() if bits & bit and name != "openmp"]
    return names + (["openmp"] if shared_openmp() else [])


def set_amx(on: bool) -> bool:
    """Let the kernel use AMX tiles (where it was built with them and Linux grants them), or keep
    it on the vector paths ($PARKADE_CPU_AMX=0 at load does the same); -> whether it now uses them."""
    return bool(library().parkade_attention_set_amx(int(on)))


def build() -> None:
    """Build and load the kernel now; ValueError says why it cannot run here."""
    try:
        library()
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


def _kernel_handles(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, sliding_window: int | None
) -> bool:
    """Whether the kernel computes this (else the torch path does, e.g. for an fp16 cache)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    return (
        k_cache.dtype in _DTYPE_CODES
        and v_cache.dtype == k_cache.dtype
        and head_dim <= MAX_HEAD_DIM
        and num_q_heads // k_cache.shape[2] <= MAX_HEADS
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and (sliding_window is None or sliding_window > 0)
    )


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Each t[i] is one contiguous run (t itself may be a slice of a wider tensor, e.g. of q/k/v)."""
    return (
        t.dim() == 3
        and t.stride(2) == 1
        and t.stride(1) == t.shape[2]
        and t.stride(0) >= t.shape[1] * t.shape[2]
    )


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1: do not write this token
) -> None:
    """`attention_torch.write_kv_cache` (same contract) as one C loop of row copies, where each
    token's row is contiguous and in the pool's dtype (torch's masked index_put took 40 us for a
    decode batch of 64 and 345 us for 2,048 prefill tokens, in every layer; this 11 and 74 us).
    Anything else goes the torch path."""
    row_shape = k_cache.shape[2:]
    if not (
        key.dtype == k_cache.dtype == v_cache.dtype == value.dtype
        and key.shape == value.shape
        and key.shape[1:] == row_shape
        and v_cache.shape == k_cache.shape
        and slot_mapping.dtype == torch.int64
        and slot_mapping.shape == key.shape[:1]
        and all(t.is_contiguous() and t.device.type == "cpu" for t in (k_cache, v_cache, slot_mapping))
        and all(_rows_contiguous(t) and t.device.type == "cpu" for t in (key, value))
        and available()
    ):
        attention_torch.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
        return
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    row_bytes = key[0].numel() * key.element_size() if key.shape[0] else 0
    rc = library().parkade_write_kv(
        key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
        key.shape[0], num_slots, row_bytes,
        key.stride(0) * key.element_size(), value.stride(0) * value.element_size(),
    )  # fmt: skip
    if rc:
        raise IndexError(f"a slot in slot_mapping is past the pool's {num_slots} slots")


def _attend_rows(
    q: torch.Tensor,  # [num_rows, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_seqs, max_num_blocks]
    row_lens: np.ndarray,  # [num_rows] int32: keys each row sees (its position + 1)
    row_seq: np.ndarray | None,  # [num_rows] int32: each row's block-table row; None: the same index
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """The kernel over every query row; -> [num_rows, num_q_heads, head_dim] in q's dtype."""
    return _rows_plan(q, k_cache, block_table, row_lens, row_seq, sliding_window)(q, k_cache, v_cache, scale)


# A step's plan: what its lengths decide for the kernel, the same in every layer (_step_plan).
# Called with one layer's (q, k_cache, v_cache, softmax_scale) -> its attention output.
Plan = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def _rows_plan(
    q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, row_lens: np.ndarray,
    row_seq: np.ndarray | None, sliding_window: int | None,
) -> Plan:  # fmt: skip
    """`_attend_rows` up to the call: items, their costs, the split (q and k_cache for shapes)."""
    num_rows, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    threads = torch.get_num_threads()
    heads_per_item = _heads_per_item(num_rows, num_kv_heads, head_dim, group, threads)
    # A bf16 model's q goes in and its output comes out as bf16: no fp32 copies around the call
    # (a build from before io_bf16, which cpu_attention_bench may load, takes fp32 only).
    io_bf16 = q.dtype == torch.bfloat16 and _io_bf16()
    table = block_table.to(torch.int32).contiguous()
    lens = np.ascontiguousarray(row_lens, dtype=np.int32)
    seqs = None if row_seq is None else np.ascontiguousarray(row_seq, dtype=np.int32)
    fn = library().paged_attention_rows
    items_per_row = num_kv_heads // heads_per_item
    num_items = num_rows * items_per_row
    # Keys each item reads: what the split between threads balances.
    visible = lens.astype(np.int64) if not sliding_window else np.minimum(lens, sliding_window)
    costs = np.repeat(visible * heads_per_item, items_per_row)
    if threads <= 1 or costs.sum() < MIN_PARALLEL_WORK:
        parts = [(0, num_items, 1)]
    elif shared_openmp():
        parts = [(0, num_items, threads)]  # the kernel splits by cost over torch's own OpenMP threads
    else:
        parts = [(a, b, 1) for a, b in _split_by_cost(costs, threads)]  # over Python threads

    def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        qf = q.contiguous() if io_bf16 else q.to(torch.float32).contiguous()
        out = torch.empty(qf.shape, dtype=qf.dtype)
        seqs_ptr = None if seqs is None else seqs.ctypes.data  # NOTE: read here, so that seqs lives on

        def run(begin: int, end: int, num_threads: int) -> None:
            rc = fn(
                qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _DTYPE_CODES[k_cache.dtype],
                table.data_ptr(), table.stride(0), lens.ctypes.data, seqs_ptr, out.data_ptr(), num_q_heads,
                num_kv_heads, head_dim, block_size, scale, sliding_window or 0, heads_per_item, begin, end,
                num_threads, io_bf16,
            )  # fmt: skip
            if rc:  # the checks above make this unreachable; never run with unchecked buffers
                raise RuntimeError("paged_attention_rows rejected its shapes")

        if len(parts) == 1:
            run(*parts[0])
        else:
            pool = _thread_pool(threads)
            for future in [pool.submit(run, *part) for part in parts]:
                future.result()
        return out if out.dtype == q.dtype else out.to(q.dtype)

    return attend


def _blocks_handle(q: torch.Tensor, k_cache: torch.Tensor, sliding_window: int | None) -> bool:
    """Whether a step's prefill rows can go in blocks (`paged_attention_units`): a bf16 cache and
    activations, head_dim 64 or 128, no window, a group of at most 16 query heads per KV head, and
    a build that has the block path."""
    return (
        q.dtype == k_cache.dtype == torch.bfloat16
        and q.shape[2] in (64, 128)
        and not sliding_window
        and q.shape[1] // k_cache.shape[2] <= 16
        and _blocks_built()
    )


@cache
def _blocks_built() -> bool:
    """The build has the block path: AVX512-BF16, bf16 q in and out, and torch's OpenMP team (the
    units are split over it only; a build from before them, which cpu_attention_bench may load,
    has not)."""
    return (
        "avx512_bf16" in features()
        and shared_openmp()
        and _io_bf16()
        and hasattr(library(), "paged_attention_units")
    )


# How much faster a block computes a row's keys than the row path, for the split between threads:
# 2.4-2.9x measured on an AVX512-BF16 EPYC, one thread, 8 prompts of 256 tokens (groups 2, 3, 4).
# (Not measured again for the AMX paths, where blocks and rows both changed speed.)
BLOCK_SPEEDUP = 2.5


def _units_plan(
    q: torch.Tensor,  # [num_rows, num_q_heads, head_dim] bf16 (for its shape)
    k_cache: torch.Tensor,  # (for its shape)
    block_table: torch.Tensor,
    q_lens: np.ndarray,  # [num_seqs] query rows per request
    row_lens: np.ndarray,  # [num_rows] keys each row sees
    row_seq: np.ndarray,  # [num_rows] each row's request
) -> Plan:
    """Prefill chunks in blocks of rows against each KV head (all the query vectors of a KV head
    in one register: `run_block_dpbf16`; the columns of one tile where AMX is in use:
    `amx_block`), decode rows on the row path, in one call."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    per_block = 16 // group
    starts = np.cumsum(q_lens) - q_lens
    decode = q_lens == 1
    chunk_start, chunk_len = starts[~decode], q_lens[~decode]
    # Blocks: the prefill chunks' rows, cut every `per_block` rows, each against every KV head.
    chunk_rows = [np.arange(s, s + n, per_block) for s, n in zip(chunk_start, chunk_len, strict=True)]
    block_row = np.concatenate(chunk_rows) if chunk_rows else np.zeros(0, dtype=np.int64)
    chunk_end = np.repeat(chunk_start + chunk_len, [len(c) for c in chunk_rows])
    block_rows = np.minimum(per_block, chunk_end - block_row)
    # A block of one row (a chunk's last, or every row with a group of 16) is a row like a decode's.
    single = block_rows == 1
    decode_row = np.concatenate([starts[decode], block_row[single]])
    block_row, block_rows = block_row[~single], block_rows[~single]
    # A block's cost in the row path's unit (keys read, per KV head): its rows' keys, all of them
    # reading the last row's (the longest), at the block's speed.
    block_cost = block_rows * row_lens[block_row + block_rows - 1] / BLOCK_SPEEDUP
    # Single rows: the row path's items (all KV heads in one when there are enough rows).
    heads_per_item = _heads_per_item(len(decode_row), num_kv_heads, head_dim, group, torch.get_num_threads())
    items = num_kv_heads // heads_per_item
    unit_row = np.concatenate([np.repeat(block_row, num_kv_heads), np.repeat(decode_row, items)])
    decode_ones = np.ones(len(decode_row) * items, np.int64)
    unit_rows = np.concatenate([np.repeat(block_rows, num_kv_heads), decode_ones])
    block_heads = np.tile(np.arange(num_kv_heads), len(block_row))
    unit_head = np.concatenate([block_heads, np.tile(np.arange(items) * heads_per_item, len(decode_row))])
    unit_cost = (
        np.concatenate(
            [np.repeat(block_cost, num_kv_heads), np.repeat(row_lens[decode_row] * heads_per_item, items)]
        ).astype(np.int64)
        + 1
    )
    lens, seqs, *as_i32 = [
        np.ascontiguousarray(a, dtype=np.int32) for a in (row_lens, row_seq, unit_row, unit_rows, unit_head)
    ]
    table = block_table.to(torch.int32).contiguous()
    threads = torch.get_num_threads() if unit_cost.sum() >= MIN_PARALLEL_WORK else 1
    fn = library().paged_attention_units

    def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        qc = q.contiguous()
        out = torch.empty(qc.shape, dtype=qc.dtype)
        rc = fn(
            qc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _DTYPE_CODES[k_cache.dtype],
            table.data_ptr(), table.stride(0), lens.ctypes.data, seqs.ctypes.data, out.data_ptr(),
            num_q_heads, num_kv_heads, head_dim, block_size, scale, heads_per_item,
            *(a.ctypes.data for a in as_i32), unit_cost.ctypes.data, len(unit_cost), threads, 1,
        )  # fmt: skip
        if rc:  # _blocks_handle and the shapes above make this unreachable
            raise RuntimeError("paged_attention_units rejected its shapes")
        return out

    return attend


def _heads_per_item(num_rows: int, num_kv_heads: int, head_dim: int, group: int, threads: int) -> int:
    """KV heads per work item of the row path: all that fit (a row's token rows, all KV heads, are
    contiguous: one item of all its heads streams them), unless too few rows keep every thread busy."""
    if num_rows < 2 * threads:
        return 1
    return max(
        k
        for k in range(1, num_kv_heads + 1)
        if num_kv_heads % k == 0 and k * head_dim <= MAX_WIDTH and k * group <= MAX_HEADS
    )


def _io_bf16() -> bool:
    return hasattr(library(), "parkade_attention_io_bf16")


def decode_attention(
    q: torch.Tensor,  # [num_decodes, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_decodes, max_num_blocks] int32
    seq_lens: list[int],
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One query per request over its paged context; -> q's shape and dtype."""
    if not _kernel_handles(q, k_cache, v_cache, sliding_window):
        return attention_torch.decode_batch(q, k_cache, v_cache, block_table, seq_lens, scale, sliding_window)
    lens = np.asarray(seq_lens, dtype=np.int32)
    return _attend_rows(q, k_cache, v_cache, block_table, lens, None, scale, sliding_window)


def paged_attention_varlen(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    seqused_k: torch.Tensor,
    max_seqlen_k: int,
    softmax_scale: float,
    block_table: torch.Tensor,
    sliding_window: int | None = None,
    query_lens: tuple[int, ...] = (),
    seq_lens: tuple[int, ...] = (),
) -> torch.Tensor:
    """`attention_torch.paged_attention_varlen` (same contract), every row of the batch (prefill
    chunks and decodes) in one kernel call over the pool, in place."""
    if not _kernel_handles(q, k_cache, v_cache, sliding_window):
        return attention_torch.paged_attention_varlen(
            q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, seqused_k=seqused_k,
            max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, block_table=block_table,
            sliding_window=sliding_window, query_lens=query_lens, seq_lens=seq_lens,
        )  # fmt: skip
    plan = _step_plan(q, k_cache, cu_seqlens_q, seqused_k, block_table, sliding_window, query_lens, seq_lens)
    return plan(q, k_cache, v_cache, softmax_scale)


# (key, copies of the step's length and table tensors, plan): the last step's plan (_step_plan).
_last_plan: tuple[tuple, tuple[torch.Tensor, ...], Plan] | None = None


def _step_plan(
    q: torch.Tensor, k_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor,
    block_table: torch.Tensor, sliding_window: int | None, query_lens: tuple[int, ...],
    seq_lens: tuple[int, ...],
) -> Plan:  # fmt: skip
    """The plan for this step's lengths: the last one when the tensors hold the same values and the
    shapes agree (every layer of a step after the first: reading the lengths and planning the
    items cost about 130 us a layer, measured for a decode of 64), else a new one.

    NOTE: compared by value against copies, never by identity: a caller may refill the same
    tensors in place for the next step, or free them for new ones at the same address. The plan
    keeps its own copy of the block table for the same reason."""
    global _last_plan
    key = (
        q.shape, q.dtype, k_cache.shape[1:], k_cache.dtype, sliding_window, torch.get_num_threads(),
        query_lens, seq_lens,
    )  # fmt: skip
    tensors = (cu_seqlens_q, seqused_k, block_table)
    last = _last_plan
    if (
        last is not None
        and last[0] == key
        and all(
            a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
            for a, b in zip(last[1], tensors, strict=True)
        )
    ):
        return last[2]
    copies = tuple(t.clone() for t in tensors)
    query_lens, seq_lens = host_lengths(copies[0], copies[1], query_lens, seq_lens)
    q_lens, s_lens = np.asarray(query_lens, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64)
    if q.shape[0] != q_lens.sum():
        raise ValueError(f"q has {q.shape[0]} rows but the query lengths add up to {int(q_lens.sum())}")
    table = copies[2]
    if len(q_lens) == q.shape[0]:  # a pure decode step: rows and requests line up
        plan = _rows_plan(q, k_cache, table, s_lens, None, sliding_window)
    else:
        # Row r of request b sits at position s_b - q_b + r and sees that many keys plus itself.
        row_seq = np.repeat(np.arange(len(q_lens)), q_lens)
        starts = np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
        row_lens = np.repeat(s_lens - q_lens, q_lens) + (np.arange(q.shape[0]) - starts) + 1
        if _blocks_handle(q, k_cache, sliding_window):
            plan = _units_plan(q, k_cache, table, q_lens, row_lens, row_seq)
        else:
            plan = _rows_plan(q, k_cache, table, row_lens, row_seq, sliding_window)
    _last_plan = (key, copies, plan)
    return plan
