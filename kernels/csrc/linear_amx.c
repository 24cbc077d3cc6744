/* bf16 linear layers on AMX tiles: out[M, N] = x[M, K] W[N, K]^T (+ bias), fp32 accumulation.
 *
 * Built into the same library as paged_attention.c (parkade.kernels.attention_cpu) and called
 * through ctypes by parkade.kernels.linear_cpu, which packs each weight once, at start.
 *
 * Why: a decode step multiplies a few rows by every weight of the model, so it is bound by reading
 * the weights from DRAM. Over small-llama's 164 MB of weights on a 2 vCPU Xeon (2026-12-06),
 * oneDNN's prepacked bf16 matmul (what inductor's freezing uses) took 9.0 ms for 1-16 rows
 * (18 GB/s) and 14.1 ms for 64; this kernel 6.3-6.4 ms (25-26 GB/s, about what two cores read)
 * and 11.4 ms. In a slower phase of the same machine (loadtest/linear_bench.py): 8.4 against 10.5
 * ms for one row, 14.6 against 15.6 for 64, even at 128.
 *
 * Packed weight (kernels/linear_cpu.py pack_weight): N and K padded with zeros to multiples of 32;
 * panel p holds output columns [32p, 32p + 32) over all of K, contiguous, as K/32 steps of two
 * 1 KB B tiles (columns 32p..+15, then +16..+31), each tile row r holding the bf16 pairs
 * W[n][32s + 2r], W[n][32s + 2r + 1] for its 16 columns n (VNNI order):
 *     packed[p][s][t][r][j][e] = W[32p + 16t + j][32s + 2r + e]
 * so a thread streams its panels front to back, one sequential read of each weight byte.
 *
 * Work: the x rows are first staged as A tiles (16 rows x 32 K, zero padded: rows past M and K past
 * its end multiply zeros, never stale memory). Threads split the panels; each takes its panels
 * one at a time and runs every 32-row pair of A tiles over the panel (2 x 2 tiles: 4 accumulators,
 * 2 A, 2 B), so a panel is read from DRAM once for up to 256 rows and from L2 after that. Rows come
 * in chunks of MAX_ROWS_PER_PASS, so that the staged rows a panel meets stay in L2. Over more than 32
 * rows, the passes after a panel's first (B from L2) fetch the thread's next panel into L2, so that
 * DRAM streams while they compute: small-llama's step at 64 rows 9.2-10.6 ms against 10.8-11.4, at
 * 128 14.5-15.0 against 18.7-19.1, 1-48 rows unchanged (loadtest/linear_bench.py, 2026-12-06; in a
 * real decode step, beside the attention, 11.2-11.7 ms against 11.8-11.9 at 64 rows).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

int parkade_attention_features(void); /* paged_attention.c: bit 16 = AMX built, granted, enabled */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define LINEAR_AMX 1
#else
#define LINEAR_AMX 0
#endif

#define MAX_ROWS_PER_PASS 256
#define PREFETCH_STEPS 4 /* B tiles fetched this many K steps ahead on a panel's first rows */

typedef uint16_t bf16;

/* Whether parkade_linear_amx runs here: built with AMX and allowed to use it now. */
int parkade_linear_amx_available(void) { return LINEAR_AMX && (parkade_attention_features() & 16); }

#if LINEAR_AMX
#include "amx_tiles.h" /* amx_configure: tiles 0-3 accumulate, 4-5 hold A, 6-7 hold B */

/* Stage rows [16 * tile, 16 * tile + 16) of x as K/32 A tiles (zero past m and past k). */
static void stage_rows(const bf16 *x, int64_t ldx, int64_t m, int64_t k, int64_t k_steps, int64_t tile,
                       bf16 *a) {
    for (int64_t s = 0; s < k_steps; s++) {
        bf16 *dst = a + (tile * k_steps + s) * 512;
        const int64_t k0 = 32 * s, width = k - k0 < 32 ? k - k0 : 32;
        for (int r = 0; r < 16; r++) {
            const int64_t row = 16 * tile + r;
            if (row < m) {
                memcpy(dst + 32 * r, x + row * ldx + k0, 2 * width);
                if (width < 32) memset(dst + 32 * r + width, 0, 2 * (32 - width));
            } else {
                memset(dst + 32 * r, 0, 64);
            }
        }
    }
}

/* Accumulators 0-3 (fp32, 16 x 16) -> out rows [row0, row0 + rows) x columns [col0, col0 + 32),
 * plus bias, rounded to bf16 (nearest even); columns past n are not written. */
static void store_tiles(int pairs, int64_t row0, int64_t m, int64_t col0, int64_t n, const bf16 *bias,
                        bf16 *out, int64_t ldo) {
    float acc[4][256] __attribute__((aligned(64)));
    _tile_stored(0, acc[0], 64);
    _tile_stored(1, acc[1], 64);
    if (pairs == 2) {
        _tile_stored(2, acc[2], 64);
        _tile_stored(3, acc[3], 64);
    }
    for (int t = 0; t < 2; t++) {
        const int64_t c0 = col0 + 16 * t;
        if (c0 >= n) break;
        const __mmask16 cols = n - c0 >= 16 ? 0xffff : (__mmask16)((1u << (n - c0)) - 1);
        __m512 b = _mm512_setzero_ps();
        if (bias) b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cols, bias + c0)), 16));
        for (int half = 0; half < pairs; half++) {
            for (int r = 0; r < 16; r++) {
                const int64_t row = row0 + 16 * half + r;
                if (row >= m) break;
                const __m512 v = _mm512_add_ps(_mm512_load_ps(acc[2 * half + t] + 16 * r), b);
                _mm256_mask_storeu_epi16(out + row * ldo + c0, cols, (__m256i)_mm512_cvtneps_pbh(v));
            }
        }
    }
}

/* One panel (32 output columns) over staged row tiles [tile0, tile1). `next` (or NULL): the panel
 * this thread runs next, fetched into L2 a slice per K step over the passes after the first, whose
 * B tiles come from L2 (without it DRAM idles while they compute). */
static void run_panel(const bf16 *panel, const bf16 *next, const bf16 *a, int64_t k_steps, int64_t tile0,
                      int64_t tile1, int64_t m, int64_t col0, int64_t n, const bf16 *bias, bf16 *out,
                      int64_t ldo) {
    const int64_t later = ((tile1 - tile0 + 1) / 2 - 1) * k_steps; /* K steps of the later passes */
    /* bf16 elements of `next` fetched per K step of the later passes, in whole lines */
    const int64_t ahead = next && later > 0 ? ((k_steps * 1024 + later - 1) / later + 31) / 32 * 32 : 0;
    const char *fetch = (const char *)next, *fetch_end = next ? (const char *)(next + k_steps * 1024) : NULL;
    for (int64_t tile = tile0; tile < tile1; tile += 2) {
        const int pairs = tile + 1 < tile1 ? 2 : 1;
        const bf16 *a0 = a + tile * k_steps * 512, *a1 = a0 + k_steps * 512, *b = panel;
        const int prefetch = tile == tile0;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < k_steps; s++, b += 1024) {
            if (prefetch)
                for (int line = 0; line < 1024; line += 32)
                    _mm_prefetch((const char *)(b + PREFETCH_STEPS * 1024 + line), _MM_HINT_T0);
            else if (ahead > 0)
                for (int64_t line = 0; line < ahead && fetch < fetch_end; line += 32, fetch += 64)
                    _mm_prefetch(fetch, _MM_HINT_T1);
            _tile_loadd(4, a0 + 512 * s, 64);
            _tile_loadd(6, b, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b + 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (pairs == 2) {
                _tile_loadd(5, a1 + 512 * s, 64);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        store_tiles(pairs, 16 * tile, m, col0, n, bias, out, ldo);
    }
}

/* The staged rows' buffer, kept between calls and grown as needed: a fresh one per call would be
 * mmap'ed and page-faulted anew past glibc's mmap threshold (256 KB for 64 rows of K = 2048). One
 * call holds it at a time; a concurrent call (another executor in the process) allocates its own. */
static bf16 *kept_rows;
static size_t kept_bytes;
static int kept_busy;

static bf16 *take_rows_buffer(size_t bytes) {
    if (__atomic_exchange_n(&kept_busy, 1, __ATOMIC_ACQUIRE)) return aligned_alloc(64, bytes);
    if (bytes > kept_bytes) {
        free(kept_rows);
        kept_rows = aligned_alloc(64, bytes);
        kept_bytes = kept_rows ? bytes : 0;
        if (!kept_rows) {
            __atomic_store_n(&kept_busy, 0, __ATOMIC_RELEASE);
            return NULL;
        }
    }
    return kept_rows;
}

static void give_rows_buffer(bf16 *a) {
    if (a == kept_rows) __atomic_store_n(&kept_busy, 0, __ATOMIC_RELEASE);
    else free(a);
}
#endif

/* out[m, n] (row stride ldo) = x[m, k] (row stride ldx) . W^T + bias, all bf16; `packed` as above
 * (n and k padded to multiples of 32), bias NULL or [n]. -> 0, or -1 where AMX does not run (see
 * parkade_linear_amx_available) or the staging buffer cannot be allocated. */
int parkade_linear_amx(const bf16 *x, int64_t ldx, int64_t m, int64_t k, const bf16 *packed, int64_t n,
                       const bf16 *bias, bf16 *out, int64_t ldo, int num_threads) {
#if LINEAR_AMX
    if (!parkade_linear_amx_available()) return -1;
    if (m <= 0 || n <= 0) return 0;
    const int64_t k_steps = (k + 31) / 32, panels = (n + 31) / 32, row_tiles = (m + 15) / 16;
    bf16 *a = take_rows_buffer((size_t)(row_tiles * k_steps * 1024));
    if (!a) return -1;
    if (num_threads < 1) num_threads = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(num_threads)
#endif
    {
#ifdef _OPENMP
        const int threads = omp_get_num_threads(), id = omp_get_thread_num();
#else
        const int threads = 1, id = 0;
#endif
        for (int64_t tile = id; tile < row_tiles; tile += threads) stage_rows(x, ldx, m, k, k_steps, tile, a);
#ifdef _OPENMP
#pragma omp barrier
#endif
        amx_configure();
        const int64_t first = panels * id / threads, last = panels * (id + 1) / threads;
        const int64_t chunk = MAX_ROWS_PER_PASS / 16;
        for (int64_t tile0 = 0; tile0 < row_tiles; tile0 += chunk) {
            const int64_t tile1 = tile0 + chunk < row_tiles ? tile0 + chunk : row_tiles;
            for (int64_t p = first; p < last; p++)
                run_panel(packed + p * k_steps * 1024, p + 1 < last ? packed + (p + 1) * k_steps * 1024 : NULL,
                          a, k_steps, tile0, tile1, m, 32 * p, n, bias, out, ldo);
        }
        _tile_release();
    }
    give_rows_buffer(a);
    return 0;
#else
    (void)x, (void)ldx, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)out, (void)ldo,
        (void)num_threads;
    return -1;
#endif
}
