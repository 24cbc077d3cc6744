/* Sampling for CPUs: one token id per row of logits, by the exponential race, in one pass.
 *
 * Compiled into the same library as paged_attention.c (see parkade.kernels.attention_cpu) and
 * called through parkade.kernels.race, which holds the torch twin of everything here. Row i's token:
 *
 *     t[i] > 0:   argmax_j  z[i][j] / t[i] - log(E[i][j]),   E = -log(U),  U ~ U(0, 1)
 *     t[i] == 0:  argmax_j  z[i][j]                           (greedy)
 *
 * The first is argmax_j p_j / E_j with p = softmax(z / t), E ~ Exp(1): an exact draw from
 * Categorical(p) (-log E is a Gumbel variable). Taken in the log domain it needs no max, no
 * normalization and no exp, and a token of finite logit always has its (tiny) chance.
 *
 * U[i][j] is a counter-based hash of the row's 64-bit key and j (race_uniform), not a stateful
 * generator: a row's token is a pure function of (key, z[i], t[i]), the same alone or in any batch
 * and on any number of threads, and the whole row's noise costs a few integer ops per token (torch's
 * CPU uniform_ took 1.0 ms for 64 rows of 8,192 tokens; this pass takes about 0.2).
 * Ties and rows with no finite score go to the lowest index (row of -inf: id 0), and a nan score
 * wins (the first one), as with torch's argmax.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CHUNK 512 /* scores computed (vectorized) before the chunk's max is looked for */
#if defined(__AVX512F__)
#define RACE_VL 16
#elif defined(__AVX__)
#define RACE_VL 8
#else
#define RACE_VL 4
#endif

typedef float race_vf __attribute__((vector_size(RACE_VL * 4)));
typedef int32_t race_vi __attribute__((vector_size(RACE_VL * 4)));

/* murmur3's 32-bit finalizer: a bijection with full avalanche. */
static inline uint32_t fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

/* U in (0, 1) for token j of the row keyed (lo, hi): the hash's top 23 bits, centred in their
 * interval: (k + 1/2) 2^-23 for k < 2^23 is exact in float32 and lies in [2^-24, 1 - 2^-24], so U
 * is never 0 or 1 and -log(U) lies in [6e-8, 16.7] (normal floats). (24 bits centred would not be:
 * (2^24 - 1/2) 2^-24 rounds to 1.0.) */
static inline float race_uniform(uint32_t lo, uint32_t hi, uint32_t j) {
    const uint32_t h = fmix32(fmix32(j * 0x9E3779B9u + lo) ^ hi);
    return ((float)(int32_t)(h >> 9) + 0.5f) * 0x1p-23f;
}

/* log(x) for a normal x > 0, to about 1 ulp of the result's scale; branch-free so that the loop over
 * it vectorizes. x = m 2^e with m in [sqrt(1/2), sqrt(2)); log(m) = log(1 + f) by a minimax
 * polynomial in f (the classic single-precision one), ln 2 split in two (Cody-Waite). */
static inline float log_positive(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    int32_t e = (int32_t)(u >> 23) - 126; /* x = m 2^e with m in [0.5, 1) */
    u = (u & 0x007FFFFFu) | 0x3F000000u;
    float m;
    memcpy(&m, &u, sizeof m);
    const int32_t below = m < 0.70710678f;
    e -= below;
    const float f = below ? m + m - 1.0f : m - 1.0f;
    const float z = f * f;
    float p = 7.0376836292e-2f;
    p = p * f - 1.1514610310e-1f;
    p = p * f + 1.1676998740e-1f;
    p = p * f - 1.2420140846e-1f;
    p = p * f + 1.4249322787e-1f;
    p = p * f - 1.6668057665e-1f;
    p = p * f + 2.0000714765e-1f;
    p = p * f - 2.4999993993e-1f;
    p = p * f + 3.3333331174e-1f;
    const float fe = (float)e;
    const float y = p * f * z + fe * -2.12194440e-4f - 0.5f * z;
    return f + y + fe * 0.693359375f;
}

/* max of s[0 .. n), n a multiple of RACE_VL, ignoring nan; *has_nan says whether there was one.
 * -inf when every entry is -inf or nan. */
static inline float chunk_max(const float *s, int n, int *has_nan) {
    race_vf m = {0};
    m -= INFINITY;
    race_vi nan = {0};
    for (int j = 0; j < n; j += RACE_VL) {
        race_vf v;
        memcpy(&v, s + j, sizeof v);
        const race_vi gt = v > m; /* false for nan */
        m = (race_vf)((gt & (race_vi)v) | (~gt & (race_vi)m));
        nan |= v != v;
    }
    float best = -INFINITY;
    int any = 0;
    for (int l = 0; l < RACE_VL; l++) {
        best = m[l] > best ? m[l] : best;
        any |= nan[l];
    }
    *has_nan = any;
    return best;
}

static int64_t race_row(const float *z, int64_t vocab, float t, uint64_t key) {
    float s[CHUNK];
    const uint32_t lo = (uint32_t)key, hi = (uint32_t)(key >> 32);
    float best = -INFINITY;
    int64_t best_j = 0;
    for (int64_t c = 0; c < vocab; c += CHUNK) {
        const int n = vocab - c < CHUNK ? (int)(vocab - c) : CHUNK;
        const float *zc = z + c;
        if (t == 0.0f) {
            memcpy(s, zc, (size_t)n * sizeof *s);
        } else {
            for (int j = 0; j < n; j++) {
                const float u = race_uniform(lo, hi, (uint32_t)(c + j));
                s[j] = zc[j] / t - log_positive(-log_positive(u));
            }
        }
        const int padded = (n + RACE_VL - 1) / RACE_VL * RACE_VL;
        for (int j = n; j < padded; j++) s[j] = -INFINITY;
        int has_nan;
        const float m = chunk_max(s, padded, &has_nan);
        if (has_nan) { /* as torch's argmax: the first nan wins (a broken row stays visible) */
            int j = 0;
            while (s[j] == s[j]) j++;
            return c + j;
        }
        if (m > best) { /* strictly: an equal score later in the row never displaces the first */
            int j = 0;
            while (s[j] != m) j++;
            best = m;
            best_j = c + j;
        }
    }
    return best_j;
}

/* out[i] = log(x[i]) for normal x[i] > 0: the race's log, exported for its accuracy test. */
void parkade_race_log(const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = log_positive(x[i]);
}

/* out[i] = the token of row i (see the top of this file); rows are `stride` floats apart.
 * -> 0, or 1 when the shapes are invalid (nothing written). */
int parkade_race(const float *z, int64_t rows, int64_t vocab, int64_t stride, const float *temperature,
                 const uint64_t *keys, int64_t *out, int num_threads) {
    if (rows < 0 || vocab < 1 || vocab > INT32_MAX || stride < vocab) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1)
    for (int64_t i = 0; i < rows; i++) out[i] = race_row(z + i * stride, vocab, temperature[i], keys[i]);
    return 0;
}
