/* bf16 linear layers on AVX512-BF16 vector units (VDPBF16PS), for a CPU without AMX tiles:
 * out[M, N] = x[M, K] W[N, K]^T (+ bias), fp32 accumulation, for the few rows of a decode step.
 *
 * Built into the same library as paged_attention.c and linear_amx.c, whose packed weight layout it
 * reads (kernels/linear_cpu.py pack_weight): panel p holds output columns [32p, 32p + 32) over all
 * of K as K/32 steps of two 16-column halves, each half 16 rows of bf16 pairs,
 *     packed[p][s][t][r][j][e] = W[32p + 16t + j][32s + 2r + e],
 * so row r of a half is one 64-byte vector: lane j holds the pair (k = 32s + 2r, +1) of column
 * 16t + j, which VDPBF16PS multiplies by the same pair of an x row broadcast to every lane. The
 * accumulators (a block of up to BLOCK rows x 32 columns: 2 * BLOCK registers) stay in registers
 * over all of K, and each output is rounded to bf16 once.
 *
 * Why: a decode step multiplies a few rows by every weight, which (small-llama: 164 MB) comes from
 * DRAM. oneDNN's prepacked matmul (what inductor's freezing uses) streams them and then computes;
 * here a thread streams its panels front to back, the first block of rows reading a panel from
 * DRAM (prefetched PREFETCH_STEPS K steps ahead) and the later blocks from L2 while they fetch the
 * thread's next panel into L2, so that the memory works while the arithmetic does. The prefetches
 * go into L2, two per pair row of a K step: issued in a burst at each step's start into L1, they
 * stalled the few-row steps behind the core's full miss queue (4 and 8 rows: 9.5 and 10.1 ms,
 * against 6.2 and 5.8 spread; 1 row 8.4 against 6.4: same machine, alternated). Small-llama's
 * step on a Zen 4 EPYC, two threads (loadtest/linear_bench.py, 2026-12-07), against oneDNN's
 * prepacked matmul: 7.58 / 9.2 ms at 1 row, 6.24 / 11.0 at 8, 9.38 / 10.9 at 16, 13.0 / 16.2 at 32,
 * 19.6 / 22.0 at 48, 26.0 / 28.9 at 64 (where the multiplies bound both: kernels/linear_cpu.py
 * DPBF16_MAX_ROWS).
 *
 * Threads split the panels; K past the weight's end is zero in the packed layout, and x's last
 * partial K step is staged zero padded, so that no lane reads past a row or multiplies stale data.
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LINEAR_DPBF16 1
#else
#define LINEAR_DPBF16 0
#endif

#define BLOCK 12         /* rows per register block: 24 accumulators, 2 weight vectors, 1 broadcast */
#define PREFETCH_STEPS 8 /* K steps (2 KB of a panel each) fetched ahead on a panel's first block */

typedef uint16_t bf16;

/* Whether parkade_linear_dpbf16 runs here: built for a CPU with AVX512-BF16. */
int parkade_linear_dpbf16_available(void) { return LINEAR_DPBF16; }

#if LINEAR_DPBF16
/* This thread's share [*first, *last) of `total` panels, in an OpenMP team (or alone). */
static inline void team_share(int64_t total, int64_t *first, int64_t *last) {
#ifdef _OPENMP
    const int threads = omp_get_num_threads(), id = omp_get_thread_num();
#else
    const int threads = 1, id = 0;
#endif
    *first = total * id / threads;
    *last = total * (id + 1) / threads;
}

/* acc[i][t] += the 16 pair rows of one K step of a panel (`b`, 1024 bf16) times rows i < R of x at
 * `xs` (row stride ldx, 32 bf16 of each row read); meanwhile prefetches (into L2) `lines` (<= 32)
 * lines from `pf`, two per pair row: spread, they leave the arithmetic room, where a burst of them
 * before it filled the core's miss queue and stalled it (see the header). */
static inline __attribute__((always_inline)) void k_step(const bf16 *b, const bf16 *xs, int64_t ldx, const int R,
                                                         __m512 acc[BLOCK][2], const char *pf, int lines) {
    for (int r = 0; r < 16; r++) {
        if (2 * r < lines) _mm_prefetch(pf + 128 * r, _MM_HINT_T1);
        if (2 * r + 1 < lines) _mm_prefetch(pf + 128 * r + 64, _MM_HINT_T1);
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + 32 * r);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + 512 + 32 * r);
        for (int i = 0; i < R; i++) {
            int32_t pair;
            memcpy(&pair, xs + i * ldx + 2 * r, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, b1);
        }
    }
}

/* Where a thread's next panel is fetched into L2 over the later blocks of this one. */
typedef struct {
    const char *at, *end;
    int64_t per_step; /* bytes per K step of the later blocks, whole lines */
} Fetch;

/* Rows [0, R) of x (R a constant where inlined) times one panel of k_full whole K steps plus, if
 * tail > 0, one step of `tail` K values; -> acc. `first`: this block reads the panel from DRAM. */
static inline __attribute__((always_inline)) void run_block(const bf16 *x, int64_t ldx, const int R, const bf16 *panel,
                                                            int64_t k_full, int tail, int first, Fetch *fetch,
                                                            __m512 acc[BLOCK][2]) {
    for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const bf16 *b = panel;
    for (int64_t s = 0; s < k_full; s++, b += 1024) {
        const char *pf = (const char *)(b + PREFETCH_STEPS * 1024);
        int lines = 32; /* a K step of the panel, PREFETCH_STEPS ahead */
        if (!first) {   /* this step's share of the next panel */
            pf = fetch->at;
            const int64_t left = (fetch->end - fetch->at) / 64;
            lines = (int)(left < fetch->per_step / 64 ? left : fetch->per_step / 64);
            lines = lines < 32 ? lines : 32; /* (more only where K has a partial step: those go unfetched) */
            fetch->at += 64 * (int64_t)lines;
        }
        k_step(b, x + 32 * s, ldx, R, acc, pf, lines);
    }
    if (tail) { /* the last K values, zero padded to a step as the packed weight is */
        bf16 staged[BLOCK][32];
        for (int i = 0; i < R; i++) {
            memset(staged[i], 0, sizeof staged[i]);
            memcpy(staged[i], x + i * ldx + 32 * k_full, 2 * (size_t)tail);
        }
        k_step(b, staged[0], 32, R, acc, NULL, 0);
    }
}

/* acc rows [0, R) -> out rows [row0, row0 + R) x columns [col0, col0 + 32) (those below n), plus
 * bias, rounded to bf16 (nearest even). */
static void store_block(int R, __m512 acc[BLOCK][2], int64_t row0, int64_t col0, int64_t n, const bf16 *bias,
                        bf16 *out, int64_t ldo) {
    for (int t = 0; t < 2; t++) {
        const int64_t c0 = col0 + 16 * t;
        if (c0 >= n) break;
        const __mmask16 cols = n - c0 >= 16 ? 0xffff : (__mmask16)((1u << (n - c0)) - 1);
        __m512 bv = _mm512_setzero_ps();
        if (bias)
            bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cols, bias + c0)), 16));
        for (int i = 0; i < R; i++)
            _mm256_mask_storeu_epi16(out + (row0 + i) * ldo + c0, cols,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][t], bv)));
    }
}

#define BLOCK_CASE(RR)                                                                              \
    case RR:                                                                                        \
        run_block(x + row0 * ldx, ldx, RR, panel, k_full, tail, block == 0, &fetch, acc);          \
        break;

/* One thread's panels [first, last), every block of rows over each. */
static void run_panels(const bf16 *x, int64_t ldx, int64_t m, int64_t k, const bf16 *packed, int64_t n,
                       const bf16 *bias, bf16 *out, int64_t ldo, int64_t first, int64_t last) {
    const int64_t k_steps = (k + 31) / 32, k_full = k / 32, blocks = (m + BLOCK - 1) / BLOCK;
    const int tail = (int)(k % 32);
    __m512 acc[BLOCK][2];
    for (int64_t p = first; p < last; p++) {
        const bf16 *panel = packed + p * k_steps * 1024;
        Fetch fetch = {NULL, NULL, 0};
        if (p + 1 < last && blocks > 1) { /* spread over the later blocks' K steps, in whole lines */
            const int64_t bytes = k_steps * 2048, later_steps = (blocks - 1) * k_full;
            fetch.at = (const char *)(panel + k_steps * 1024);
            fetch.end = fetch.at + bytes;
            fetch.per_step = later_steps > 0 ? (bytes / later_steps + 63) / 64 * 64 : 0; /* <= 2 KB */
        }
        for (int64_t block = 0; block < blocks; block++) {
            const int64_t row0 = m * block / blocks, row1 = m * (block + 1) / blocks;
            switch ((int)(row1 - row0)) { /* a constant R for each: the accumulators in registers */
                BLOCK_CASE(1) BLOCK_CASE(2) BLOCK_CASE(3) BLOCK_CASE(4) BLOCK_CASE(5) BLOCK_CASE(6)
                BLOCK_CASE(7) BLOCK_CASE(8) BLOCK_CASE(9) BLOCK_CASE(10) BLOCK_CASE(11) BLOCK_CASE(12)
            default: break; /* not reached: blocks split m into at most BLOCK rows each */
            }
            store_block((int)(row1 - row0), acc, row0, 32 * p, n, bias, out, ldo);
        }
    }
}
#endif

/* out[m, n] (row stride ldo) = x[m, k] (row stride ldx) . W^T + bias, all bf16; `packed` as above
 * (n and k padded to multiples of 32), bias NULL or [n]. -> 0, or -1 where the kernel is not built
 * (no AVX512-BF16). */
int parkade_linear_dpbf16(const bf16 *x, int64_t ldx, int64_t m, int64_t k, const bf16 *packed, int64_t n,
                          const bf16 *bias, bf16 *out, int64_t ldo, int num_threads) {
#if LINEAR_DPBF16
    if (m <= 0 || n <= 0) return 0;
    const int64_t panels = (n + 31) / 32;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > panels) num_threads = (int)panels;
#ifdef _OPENMP
#pragma omp parallel num_threads(num_threads)
#endif
    {
        int64_t first, last;
        team_share(panels, &first, &last);
        run_panels(x, ldx, m, k, packed, n, bias, out, ldo, first, last);
    }
    return 0;
#else
    (void)x, (void)ldx, (void)m, (void)k, (void)packed, (void)n;
    (void)bias, (void)out, (void)ldo, (void)num_threads;
    return -1; /* not built for AVX512-BF16 */
#endif
}
