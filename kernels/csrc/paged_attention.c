/* Paged attention for CPUs: each query row over its request's paged K/V, decode and prefill alike.
 *
 * Built on first use by parkade.kernels.attention_cpu (cc -O3 -march=native -fopenmp, see there)
 * and called through ctypes, which releases the GIL.
 *
 * A query row is one token's query heads: a decode request has one row, a prefill chunk of q_len
 * tokens has q_len rows, the row at position p seeing keys up to p (its own `seq_lens` entry is
 * p + 1, and `row_seq` maps it to its request's block-table row). Rows are independent, so a
 * prefill chunk reads its request's K/V in place like a decode, with no gathered copy and no mask;
 * its rows re-read the same few blocks, from cache. With AVX512-BF16, a bf16 cache and head_dim 64
 * or 128, paged_attention_units takes a chunk's rows in blocks instead (run_block_dpbf16: each key
 * read once for up to 16 query vectors, a lane each; q.k and P.V on VDPBF16PS), and the step's
 * other rows as here.
 *
 * Work item i = (query row b, a run of `kv_heads_per_item` KV heads starting at h0) serves the query
 * heads that read those KV heads (transformers' repeat_kv order: query head j reads KV head
 * j / group). One pass over the request's keys reads each K/V row once, in the cache dtype, in
 * place (no copy of the pool); a whole token row of all KV heads is contiguous, so an item of every
 * head streams whole blocks:
 *
 *   for each tile of up to TILE keys p in [first, seq_len):       (first > 0 only with a window)
 *       s[j][t] = scale * <q[j], k[p]>                              fp32 accumulation
 *       online softmax: m' = max(m, max_t s), acc = acc * e^(m - m') + sum_t e^(s - m') v[p]
 *   out[j] = acc / l
 *
 * Vector paths, chosen when the library is compiled (-march=native: the build is keyed by the
 * CPU, so the compile-time choice is the runtime one):
 *   - the dot products and the V accumulation run on VL-lane fp32 vectors (GCC vector extensions:
 *     one zmm with AVX-512, one ymm with AVX2), bf16 rows widened by a shift, when head_dim % VL == 0;
 *   - with AVX512-BF16 and a bf16 cache, q.k is VDPBF16PS on bf16 pairs. q is the model's bf16
 *     activation widened to fp32 by the caller, so narrowing it back is exact, and each product of
 *     two bf16 numbers is exact in fp32: only the summation order differs from the fp32 path.
 *     For head_dim 64 and 128 (`run_item_dpbf16`) the loops are blocked for the registers: 16
 *     keys' dot products summed by one transpose-and-add tree, each KV head's V rows widened once
 *     for all the query heads that read them, a head's accumulator held in registers across a
 *     tile (measured on an AVX512-BF16 EPYC, batch 64 at 400 keys: 1.4-1.6x the per-key loop
 *     below), and the scores' online softmax in registers (softmax_tile512: prefill 1.07-1.09x);
 *   - with AMX tiles (`amx_tile`, `amx_bf16`), a bf16 cache, head_dim 64 or 128, block_size a
 *     multiple of 16 and no sliding window, both a decode item and a prefill block run on the
 *     tiles instead (attention_amx.h: S^T = K Q^T, an exact two-pass softmax, O = P V), where
 *     VDPBF16PS retires only one per two cycles;
 *   - otherwise (e.g. head_dim 8 with AVX-512) scalar loops, which the compiler vectorizes as it can.
 * The AMX path first loads a tile's K and V rows in address order (touch_tile), except where the
 * item before on the same thread read the same rows (a prefill chunk's rows: they are in cache).
 * The row paths do so for an item's first tile, and prefetch the thread's next tile a few lines at
 * a time through each tile's arithmetic (Prefetch), so that its misses overlap the arithmetic.
 * Threads: an OpenMP team (the same libgomp that torch loaded, so the same thread pool as torch's
 * own ops and no second set of spinning threads) splits the items by cost, i.e. keys read.
 *
 * Pool layout [num_blocks, block_size, num_kv_heads, head_dim] (kernels/attention_torch.py):
 * the key at position p lives at row block_table[b][p / block_size] * block_size + p % block_size.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif
#if HAVE_DPBF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#define TILE 32
#define MAX_HEAD_DIM 256
#define MAX_HEADS 128 /* query heads served by one work item */
#define MAX_WIDTH 512 /* K/V elements of one token that one work item reads */
/* fp32 lanes of the vector type: one register. A 16-lane type on AVX2 (two ymm per value) compiled
 * to code 5-6x slower than 8 lanes (tiny- and small-llama decode batches, built for x86-64-v3). */
#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };
/* Bits of parkade_attention_features(): what this build uses (AMX: and may use now, see use_amx). */
enum { FEATURE_OPENMP = 1, FEATURE_AVX2 = 2, FEATURE_AVX512 = 4, FEATURE_AVX512_BF16 = 8, FEATURE_AMX = 16 };

typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef uint32_t vline __attribute__((vector_size(64))); /* one cache line */

/* Present since q and out may be bf16 (the io_bf16 argument): older builds take fp32 only. */
int parkade_attention_io_bf16(void) { return 1; }

static int use_amx(void);

int parkade_attention_features(void) {
    int f = 0;
#ifdef _OPENMP
    f |= FEATURE_OPENMP;
#endif
#ifdef __AVX2__
    f |= FEATURE_AVX2;
#endif
#ifdef __AVX512F__
    f |= FEATURE_AVX512;
#endif
    if (HAVE_DPBF16) f |= FEATURE_AVX512_BF16;
    if (use_amx()) f |= FEATURE_AMX;
    return f;
}

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* VL elements at p (fp32 or bf16) as an fp32 vector; memcpy compiles to one unaligned load. */
static inline vf vload(const void *p, int dtype) {
    vf f;
    if (dtype == DTYPE_BF16) {
        vh h;
        memcpy(&h, p, sizeof h);
        vu u = __builtin_convertvector(h, vu) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, p, sizeof f);
    }
    return f;
}

static inline float vsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* exp(x) for x <= 0, to about 2 ulp; branch-free so that loops over it vectorize (libm's expf is a
 * call per element). Below -87 it returns 0 (the online softmax feeds it -inf on its first tile). */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f /* ln 2 = HI - LO (Cody-Waite) */
#define EXP_LN2_LO 2.12194440e-4f
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;
    const float n = __builtin_roundf(clamped * EXP_LOG2E);
    /* Two-constant ln 2 (Cody-Waite) with explicit fmaf: -fassociative-math must not fold them. */
    const float r = fmaf(n, EXP_LN2_LO, fmaf(n, -EXP_LN2_HI, clamped));
    float p = EXP_POLY[0];
    for (int i = 1; i < 6; i++) p = p * r + EXP_POLY[i];
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

/* One tile of the online softmax for one query head: the running max *m and sum *l take the
 * tile's n scores s[0..n), which become their weights e^(s - m'); -> the factor e^(m - m') that
 * the head's accumulator must be scaled by (0 on the first tile). */
static inline float softmax_tile(float *s, int n, float *m, float *l) {
    float tile_max = s[0];
    for (int t = 1; t < n; t++) tile_max = s[t] > tile_max ? s[t] : tile_max;
    const float new_m = tile_max > *m ? tile_max : *m;
    const float correction = exp_nonpositive(*m - new_m);
    float sum = 0.0f;
    for (int t = 0; t < n; t++) {
        s[t] = exp_nonpositive(s[t] - new_m);
        sum += s[t];
    }
    *l = *l * correction + sum;
    *m = new_m;
    return correction;
}

typedef struct {
    const void *q; /* io_bf16: q and out are bf16 (a bf16 model's activations), else fp32 */
    const void *k_cache, *v_cache;
    int dtype, elem;
    const int32_t *block_table;
    int64_t table_stride;
    const int32_t *seq_lens, *row_seq;
    void *out;
    int num_q_heads, num_kv_heads, head_dim, block_size, sliding_window, kv_heads_per_item, io_bf16;
    float scale;
    int amx; /* the call runs on AMX tiles (amx_for): granted them, and shapes they take */
} Problem;

/* fp32 -> bf16, rounded to nearest even (NaN -> 0x7FC0): torch's own conversion, bit for bit. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* n query elements from element `offset` of q, as fp32 in dst. */
static inline void load_q(const Problem *pr, int64_t offset, int n, float *dst) {
    if (pr->io_bf16) {
        const uint16_t *src = (const uint16_t *)pr->q + offset;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)pr->q + offset, sizeof(float) * (size_t)n);
    }
}

/* n query elements from element `offset` of q, as bf16 in dst (q holds bf16 values either way:
 * a bf16 cache's model computes in bf16, and the caller widens it exactly, so truncation is exact). */
static inline void load_q_bf16(const Problem *pr, int64_t offset, int n, uint16_t *dst) {
    if (pr->io_bf16) {
        memcpy(dst, (const uint16_t *)pr->q + offset, sizeof(uint16_t) * (size_t)n);
        return;
    }
    const float *src = (const float *)pr->q + offset;
    for (int i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, src + i, sizeof u);
        dst[i] = (uint16_t)(u >> 16);
    }
}

/* out[offset + d] = acc[d] * inv for d < n, in the output's dtype. */
static inline void store_out(const Problem *pr, int64_t offset, const float *acc, float inv, int n) {
    if (pr->io_bf16) {
        uint16_t *dst = (uint16_t *)pr->out + offset;
        for (int d = 0; d < n; d++) dst[d] = f32_to_bf16(acc[d] * inv);
    } else {
        float *dst = (float *)pr->out + offset;
        for (int d = 0; d < n; d++) dst[d] = acc[d] * inv;
    }
}

/* The pool slot (row) of key position p, through its request's block-table row. */
static inline int64_t slot_of(const Problem *pr, const int32_t *table, int p) {
    return (int64_t)table[p / pr->block_size] * pr->block_size + p % pr->block_size;
}

static inline int first_key(const Problem *pr, int seq_len) {
    return pr->sliding_window > 0 && seq_len > pr->sliding_window ? seq_len - pr->sliding_window : 0;
}

/* What work item `item` reads: query row b, KV heads [h0, h0 + kv_heads_per_item), and b's
 * block table row. */
typedef struct {
    int64_t b;
    int h0;
    const int32_t *table;
} ItemAt;

static inline ItemAt item_at(const Problem *pr, int64_t item) {
    const int hpi = pr->kv_heads_per_item, items_per_seq = pr->num_kv_heads / hpi;
    ItemAt at;
    at.b = item / items_per_seq;
    at.h0 = (int)(item % items_per_seq) * hpi;
    at.table = pr->block_table + (pr->row_seq ? pr->row_seq[at.b] : at.b) * pr->table_stride;
    return at;
}

/* Loads every cache line of a tile's K and V rows, in address order, before the tile is computed
 * head by head (which reads each row in strided pieces; the loads then hit the cache). From DRAM
 * the per-head order alone streamed at 16 GB/s on two cores, and software prefetches of the tile
 * in its place did not help (16-17 GB/s); these loads keep many misses in flight: 25 GB/s
 * (small-llama's decode batch over its layers' 2 GiB pool on an AVX512-BF16 EPYC;
 * loadtest/cpu_attention_bench.py's "from DRAM" cases). Whole-line vector loads: one scalar load
 * per line measured 20 GB/s. The row paths touch only an item's first tile: the thread prefetches
 * each later one (Prefetch) while it computes the one before. */
static inline void touch_tile(const char *k_base, const char *v_base, const int64_t *rows, int n, int64_t width_bytes) {
    vline sink = {0};
    for (int t = 0; t < n; t++)
        for (int64_t byte = 0; byte < width_bytes; byte += 64) {
            const char *k = k_base + rows[t] + byte, *v = v_base + rows[t] + byte;
            if (byte + 64 <= width_bytes) {
                vline a, c;
                memcpy(&a, k, sizeof a);
                memcpy(&c, v, sizeof c);
                sink |= a | c;
            } else { /* a row narrower than a line: never load past it (the pool may end there) */
                sink[0] |= (uint32_t)(unsigned char)*k | (uint32_t)(unsigned char)*v;
            }
        }
    static _Thread_local volatile vline touched; /* the loads' only use: the compiler must keep them */
    touched = sink;
}

/* The K and V lines of the tile that a thread reads after the one it computes, prefetched into
 * L2 a few at a time through that tile's arithmetic (prefetch_upto). From DRAM
 * on a Zen 4 EPYC, two threads (loadtest/cpu_attention_bench.py --against, 2026-12-07): all of a
 * tile's prefetches at once before its arithmetic (as this code did) measured about the sum of
 * the load time and the arithmetic: the burst fills the core's miss queue, and the arithmetic
 * behind it waits; spread, the misses overlap it: tiny- and small-llama's decode 1.35-1.5x. Then
 * the tiles past an item's first are in L2 when they are computed, so they skip touch_tile. */
typedef struct {
    const char *k, *v;     /* the tile's K and V bases (the item's first KV head) */
    int64_t rows[TILE];    /* byte offsets of its token rows in the pool */
    int lines;             /* 64-byte lines of one token's K (or V) row in the item */
    int issued, total;     /* lines prefetched so far, of the plan's K and V lines (0: no plan) */
} Prefetch;

/* The plan while the tile at `start` of `item` is computed: the item's next tile (where it touched
 * its keys: otherwise they are in cache already), or past its last tile the first tile of `next`,
 * the item the thread runs next (-1: none, or one whose keys are in cache). (Two tiles ahead
 * measured the same as one.) */
static inline void plan_next(Prefetch *pf, const Problem *pr, int64_t item, int start, int seq_len, int touch,
                             int64_t next) {
    pf->issued = pf->total = pf->lines = 0;
    pf->k = pf->v = NULL;
    if (start + TILE < seq_len) {
        if (!touch) return;
        start += TILE;
    } else if (next >= 0) {
        item = next;
        seq_len = pr->seq_lens[item_at(pr, item).b];
        start = first_key(pr, seq_len);
    } else {
        return;
    }
    const ItemAt at = item_at(pr, item);
    const int64_t head_bytes = (int64_t)pr->head_dim * pr->elem, row_bytes = pr->num_kv_heads * head_bytes;
    const int n = seq_len - start < TILE ? seq_len - start : TILE;
    pf->k = (const char *)pr->k_cache + at.h0 * head_bytes;
    pf->v = (const char *)pr->v_cache + at.h0 * head_bytes;
    pf->lines = (int)((pr->kv_heads_per_item * head_bytes + 63) / 64);
    for (int t = 0; t < n; t++) pf->rows[t] = slot_of(pr, at.table, start + t) * row_bytes;
    pf->total = 2 * n * pf->lines;
}

/* Prefetches the plan's lines up to the fraction done / of of them, row by row (a K line, then
 * the V line beside it). */
static inline void prefetch_upto(Prefetch *pf, int done, int of) {
    const int want = (int)((int64_t)pf->total * done / of);
    for (; pf->issued < want; pf->issued++) {
        const int t = pf->issued / (2 * pf->lines), line = pf->issued % (2 * pf->lines);
        const char *base = (line & 1) ? pf->v : pf->k;
        __builtin_prefetch(base + pf->rows[t] + (int64_t)(line >> 1) * 64, 0, 2);
    }
}

/* <q, k> over head_dim elements; q fp32, k in the cache dtype. */
static inline float dot(const Problem *pr, const float *q, const char *k, int vector) {
    const int D = pr->head_dim;
    if (vector) {
        vf acc = {0};
        for (int d = 0; d < D; d += VL) acc += vload(q + d, DTYPE_F32) * vload(k + (int64_t)d * pr->elem, pr->dtype);
        return vsum(acc);
    }
    float s = 0.0f;
    if (pr->dtype == DTYPE_BF16) {
        const uint16_t *kh = (const uint16_t *)k;
        for (int d = 0; d < D; d++) s += q[d] * bf16_to_f32(kh[d]);
    } else {
        const float *kf = (const float *)k;
        for (int d = 0; d < D; d++) s += q[d] * kf[d];
    }
    return s;
}

#if HAVE_DPBF16
/* <q, k> with q pre-narrowed to bf16 pairs (exact, see the top comment); head_dim % 32 == 0. */
static inline float dot_bf16(const uint16_t *q, const uint16_t *k, int D) {
    __m512 acc = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
    return _mm512_reduce_add_ps(acc);
}
#endif

/* acc[0..D) += w * v[0..D); v in the cache dtype. */
static inline void axpy(const Problem *pr, float *acc, float w, const char *v, int vector) {
    const int D = pr->head_dim;
    if (vector) {
        const vf zero = {0}, wv = zero + w;
        for (int d = 0; d < D; d += VL) {
            vf a;
            memcpy(&a, acc + d, sizeof a);
            a += wv * vload(v + (int64_t)d * pr->elem, pr->dtype);
            memcpy(acc + d, &a, sizeof a);
        }
    } else if (pr->dtype == DTYPE_BF16) {
        const uint16_t *vh16 = (const uint16_t *)v;
        for (int d = 0; d < D; d++) acc[d] += w * bf16_to_f32(vh16[d]);
    } else {
        const float *vf32 = (const float *)v;
        for (int d = 0; d < D; d++) acc[d] += w * vf32[d];
    }
}


#if HAVE_DPBF16
/* Lane i of the result: the sum of v[i]'s 16 lanes (a transpose-and-add tree: 45 instructions for
 * 16 dot products, where a reduction each would take 8 apiece). */
static inline __m512 hsum16(const __m512 *v) {
    __m512 s2[8], s4[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        s2[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane L: the lane-L sums of v[4i .. 4i+3] */
        s4[i] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], 0x44),
                              _mm512_shuffle_ps(s2[2 * i], s2[2 * i + 1], 0xEE));
    const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(s4[0], s4[1], 0x88), _mm512_shuffle_f32x4(s4[0], s4[1], 0xDD));
    const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2], s4[3], 0x88), _mm512_shuffle_f32x4(s4[2], s4[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xDD));
}

/* exp_nonpositive on 16 lanes (the same steps). */
static inline __m512 exp512_nonpositive(__m512 x) {
    const __m512 clamped = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO),
                                     _mm512_fmadd_ps(n, _mm512_set1_ps(-EXP_LN2_HI), clamped));
    __m512 p = _mm512_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[i]));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    return _mm512_maskz_mul_ps((__mmask16)~underflow, p, _mm512_castsi512_ps(bits));
}

/* softmax_tile on a tile's scores held in registers (-inf past its keys): the weights go to
 * w[0..TILE) (0 past the keys), the running max *m and sum *l are updated; -> the correction. */
static inline float softmax_tile512(const __m512 *s, float *w, float *m, float *l) {
    __m512 mx = s[0];
    for (int i = 1; i < TILE / 16; i++) mx = _mm512_max_ps(mx, s[i]);
    const float tile_max = _mm512_reduce_max_ps(mx);
    const float new_m = tile_max > *m ? tile_max : *m;
    const float correction = exp_nonpositive(*m - new_m);
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < TILE / 16; i++) {
        const __m512 e = exp512_nonpositive(_mm512_sub_ps(s[i], _mm512_set1_ps(new_m)));
        _mm512_store_ps(w + 16 * i, e);
        sum = _mm512_add_ps(sum, e);
    }
    *l = *l * correction + _mm512_reduce_add_ps(sum);
    *m = new_m;
    return correction;
}

/* run_item for a bf16 cache on AVX512-BF16 with head_dim D (a constant where it is inlined, so
 * that a head's accumulator and q live in registers). Per tile and KV head: the scores of 16
 * keys at a time for each query head of the group (VDPBF16PS, then one hsum16), the online
 * softmax, the head's V rows widened to fp32 once, and acc += w * v with acc in registers.
 * Tried on a Zen 4 EPYC (AVX-512 on 256-bit units, no AMX) and slower there (docs/benchmarks.md,
 * 2026-12-06): P.V on VDPBF16PS (0.87-0.95x), and P.V widening each V row once for all the
 * group's heads with the accumulators in registers (0.81-0.93x); without touch_tile, 0.64-0.74x.
 * Its decode rows wait on the memory's latency more than on this arithmetic. */
static inline __attribute__((always_inline)) void run_item_dpbf16(const Problem *pr, int64_t item, const int D, int touch,
                                                                   int64_t next) {
    const int hpi = pr->kv_heads_per_item;
    const int group = pr->num_q_heads / pr->num_kv_heads;
    const int heads = hpi * group;
    const ItemAt at = item_at(pr, item);
    const int64_t b = at.b;
    const int h0 = at.h0;
    const int seq_len = pr->seq_lens[b];
    const int first = first_key(pr, seq_len);
    const int64_t q_offset = (b * pr->num_q_heads + (int64_t)h0 * group) * D;
    const int32_t *table = at.table;
    const int64_t row_bytes = (int64_t)pr->num_kv_heads * D * 2;
    const int64_t width_bytes = (int64_t)hpi * D * 2;
    const char *k_base = (const char *)pr->k_cache + (int64_t)h0 * D * 2;
    const char *v_base = (const char *)pr->v_cache + (int64_t)h0 * D * 2;

    static _Thread_local float acc[MAX_HEADS * MAX_HEAD_DIM] __attribute__((aligned(64)));
    static _Thread_local uint16_t qh[MAX_HEADS * MAX_HEAD_DIM] __attribute__((aligned(64)));
    static _Thread_local float vbuf[TILE * MAX_HEAD_DIM] __attribute__((aligned(64)));
    float scores[MAX_HEADS * TILE] __attribute__((aligned(64)));
    float m[MAX_HEADS], l[MAX_HEADS], corr[MAX_HEADS];
    int64_t rows[TILE];
    load_q_bf16(pr, q_offset, heads * D, qh);
    for (int j = 0; j < heads; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)heads * D);
    const __m512 scale = _mm512_set1_ps(pr->scale);

    for (int start = first; start < seq_len; start += TILE) {
        const int n = seq_len - start < TILE ? seq_len - start : TILE;
        for (int t = 0; t < n; t++) {
            const int p = start + t;
            rows[t] = slot_of(pr, table, p) * row_bytes;
        }
        if (touch && start == first) touch_tile(k_base, v_base, rows, n, width_bytes); /* later tiles: prefetched */
        Prefetch pf;
        plan_next(&pf, pr, item, start, seq_len, touch, next);
        const int points = (2 + TILE / 16) * heads; /* where prefetch_upto runs in this tile */
        int point = 0;

        for (int hh = 0; hh < hpi; hh++) {
            const char *kh = k_base + (int64_t)hh * D * 2, *vh = v_base + (int64_t)hh * D * 2;
            for (int j = hh * group; j < (hh + 1) * group; j++) {
                __m512bh qv[D / 32];
                for (int c = 0; c < D / 32; c++) qv[c] = (__m512bh)_mm512_load_si512(qh + (int64_t)j * D + 32 * c);
                __m512 sv[TILE / 16]; /* the tile's scores; -inf past its n keys */
                for (int half = 0; half < TILE / 16; half++) {
                    const int t0 = 16 * half;
                    if (t0 >= n) {
                        sv[half] = _mm512_set1_ps(-INFINITY);
                        continue;
                    }
                    __m512 part[16];
                    for (int tt = 0; tt < 16; tt++) {
                        __m512 a = _mm512_setzero_ps();
                        if (t0 + tt < n) {
                            const uint16_t *k = (const uint16_t *)(kh + rows[t0 + tt]);
                            for (int c = 0; c < D / 32; c++)
                                a = _mm512_dpbf16_ps(a, qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
                        }
                        part[tt] = a;
                    }
                    const __mmask16 valid = n - t0 >= 16 ? 0xFFFF : (__mmask16)((1u << (n - t0)) - 1);
                    sv[half] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid, hsum16(part), scale);
                    prefetch_upto(&pf, ++point, points);
                }
                /* applied to acc in the PV pass; the weights (0 past n) go to scores */
                corr[j] = softmax_tile512(sv, scores + j * TILE, &m[j], &l[j]);
                prefetch_upto(&pf, ++point, points);
            }
            for (int t = 0; t < n; t++) { /* this head's V rows, widened once */
                const uint16_t *v = (const uint16_t *)(vh + rows[t]);
                for (int c = 0; c < D / 16; c++) {
                    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + 16 * c)));
                    _mm512_store_ps(vbuf + t * D + 16 * c, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
                }
            }
            for (int j = hh * group; j < (hh + 1) * group; j++) {
                const float *sj = scores + j * TILE;
                float *aj = acc + (int64_t)j * D;
                __m512 a[D / 16];
                const __m512 cj = _mm512_set1_ps(corr[j]);
                for (int c = 0; c < D / 16; c++) a[c] = _mm512_mul_ps(_mm512_load_ps(aj + 16 * c), cj);
                for (int t = 0; t < n; t++) {
                    const __m512 w = _mm512_set1_ps(sj[t]);
                    for (int c = 0; c < D / 16; c++) a[c] = _mm512_fmadd_ps(w, _mm512_load_ps(vbuf + t * D + 16 * c), a[c]);
                }
                for (int c = 0; c < D / 16; c++) _mm512_store_ps(aj + 16 * c, a[c]);
                prefetch_upto(&pf, ++point, points);
            }
        }
        prefetch_upto(&pf, points, points); /* the rest: a tile of fewer than TILE keys skips points */
    }
    for (int j = 0; j < heads; j++)
        store_out(pr, q_offset + (int64_t)j * D, acc + (int64_t)j * D, l[j] > 0.0f ? 1.0f / l[j] : 0.0f, D);
}
#endif

#if HAVE_DPBF16
/* A 16 x 16 matrix of 32-bit elements, row k in r[k], transposed in place (r[k] becomes column k). */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
            t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

/* A block of a prefill chunk's rows against one KV head, for a bf16 cache on AVX512-BF16 with
 * head_dim D (64 or 128): the query vectors that read KV head h (the group's G heads of each of
 * the block's nrows rows, nrows <= 16 / G) sit in the 16 lanes of one register, lane i holding
 * (row i / G, query head h * G + i % G); lanes past nrows * G repeat lane 0 and are not stored.
 * Where the row path (run_item_dpbf16) reads a key's row once per query row and sums each score
 * across lanes, this reads it once per block: the scores of 16 keys are 16 registers, one per
 * key (q . k by VDPBF16PS: k's bf16 pair broadcast against the lanes' q pairs, no horizontal sum);
 * the online softmax runs lane by lane (a lane's max and sum are its own); and acc[d] (lanes:
 * the query vectors) += w[key] * v[key][d] + w[key'] * v[key'][d], a pair of keys per VDPBF16PS
 * (the lanes' weights as bf16 pairs, the keys' V at d broadcast). Row i sees keys
 * [0, seq_lens[row0 + i]) (no sliding window here): a key past a lane's length scores -inf.
 * The scores are the row path's (exact bf16 products, fp32 sums, in another order); the weights
 * are rounded to bf16 for P.V, as FlashAttention rounds P (relative 2^-9, the size of the
 * output's own bf16 rounding): the largest error against a float64 reference is the row path's
 * within 1.3x (five head shapes). Measured on an AVX512-BF16 EPYC (Zen 5), one thread, 8 prompts
 * of 256 tokens: 2.4-2.9x the row path (fp32 FMAs for P.V and the scores' loop over keys kept in
 * memory: 1.5-1.9x). The lanes' q vectors come in, and their bf16 outputs go out, by 16 x 16
 * transposes of 32-bit pairs, and a tile's 16 keys (block_size a multiple of 16) share one block-
 * table lookup, where each lane's elements were copied and converted one by one and each key
 * looked up: the same bits out, in 14-15 % less time on one thread of a Zen 4 EPYC (8 prompts of
 * 256 tokens at tiny- and small-llama's heads), 7 % less on two. */
/* 16-bit lane indices for _mm512_permutex(2)var_epi16 that put elements a + i and b + i side by
 * side as a bf16 pair, i < 16 (b >= 32: the second operand's element b - 32 + i). */
static inline __m512i pair_index(int a, int b) {
    uint16_t idx[32];
    for (int i = 0; i < 16; i++) {
        idx[2 * i] = (uint16_t)(a + i);
        idx[2 * i + 1] = (uint16_t)(b + i);
    }
    return _mm512_loadu_si512(idx);
}

static inline __attribute__((always_inline)) void run_block_dpbf16(const Problem *pr, int64_t row0, int nrows, int h, const int D) {
    const int G = pr->num_q_heads / pr->num_kv_heads;
    const int used = nrows * G;
    const int32_t *table = pr->block_table + pr->row_seq[row0] * pr->table_stride;
    const int64_t row_bytes = (int64_t)pr->num_kv_heads * D * 2;
    const char *k_base = (const char *)pr->k_cache + (int64_t)h * D * 2;
    const char *v_base = (const char *)pr->v_cache + (int64_t)h * D * 2;

    static _Thread_local uint32_t qt[MAX_HEAD_DIM / 2 * 16] __attribute__((aligned(64))); /* [pair][lane] */
    static _Thread_local float acc[MAX_HEAD_DIM * 16] __attribute__((aligned(64)));       /* [d][lane] */
    static _Thread_local uint32_t vp[8 * MAX_HEAD_DIM] __attribute__((aligned(64)));     /* [pair][d] */
    /* (x[i], x[16 + i]) side by side; (x[i], y[i]) and (x[16 + i], y[16 + i]) of two rows x, y. */
    const __m512i pair_lanes = pair_index(0, 16), pair_lo = pair_index(0, 32), pair_hi = pair_index(16, 48);
    int32_t lens[16] __attribute__((aligned(64)));
    int max_len = 0;
    int64_t q_at[16]; /* each lane's query vector: its element offset in q */
    for (int i = 0; i < 16; i++) {
        const int src = i < used ? i : 0;
        const int64_t row = row0 + src / G;
        lens[i] = pr->seq_lens[row];
        max_len = lens[i] > max_len ? lens[i] : max_len;
        q_at[i] = (row * pr->num_q_heads + (int64_t)h * G + src % G) * D;
    }
    if (pr->io_bf16) { /* qt = the lanes' query pairs transposed, 16 pairs at a time */
        for (int c0 = 0; c0 < D / 2; c0 += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512((const uint16_t *)pr->q + q_at[i] + 2 * c0);
            transpose16(r);
            for (int k = 0; k < 16; k++) _mm512_store_si512(qt + 16 * (c0 + k), r[k]);
        }
    } else {
        for (int i = 0; i < 16; i++) {
            uint16_t pairs[MAX_HEAD_DIM];
            load_q_bf16(pr, q_at[i], D, pairs);
            for (int c = 0; c < D / 2; c++) memcpy(qt + 16 * c + i, pairs + 2 * c, 4);
        }
    }
    const __m512i lenv = _mm512_load_si512(lens);
    const __m512 scale = _mm512_set1_ps(pr->scale);
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
    memset(acc, 0, sizeof(float) * 16 * (size_t)D);
    int64_t rows[16];

    /* Every loop over a tile's keys runs all 16 (unrolled: the scores stay in registers); a last
     * tile's keys past max_len read key `start` again and score -inf in every lane. A tile starts
     * at a multiple of 16, so with a block size that is one too its keys are consecutive slots of
     * one block (one table lookup). */
    const int tile_in_one_block = pr->block_size % 16 == 0;
    for (int start = 0; start < max_len; start += 16) {
        const int n = max_len - start < 16 ? max_len - start : 16;
        if (tile_in_one_block) {
            const int64_t first = slot_of(pr, table, start) * row_bytes;
            for (int t = 0; t < 16; t++) rows[t] = first + (t < n ? t : 0) * row_bytes;
        } else {
            for (int t = 0; t < 16; t++) rows[t] = slot_of(pr, table, start + (t < n ? t : 0)) * row_bytes;
        }
        __m512 s[16];
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++) s[t] = _mm512_setzero_ps();
        for (int c = 0; c < D / 2; c++) {
            const __m512bh qc = (__m512bh)_mm512_load_si512(qt + 16 * c);
#pragma GCC unroll 16
            for (int t = 0; t < 16; t++) {
                int32_t pair;
                memcpy(&pair, k_base + rows[t] + 4 * c, 4);
                s[t] = _mm512_dpbf16_ps(s[t], (__m512bh)_mm512_set1_epi32(pair), qc);
            }
        }
        __m512 mx = _mm512_set1_ps(-INFINITY);
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++) {
            const __mmask16 valid = _mm512_cmpgt_epi32_mask(lenv, _mm512_set1_epi32(start + t));
            s[t] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid, s[t], scale);
            mx = _mm512_max_ps(mx, s[t]);
        }
        /* Every lane sees key 0, so after the first tile m is finite; e^(-inf) is 0 (first tile). */
        const __m512 new_m = _mm512_max_ps(m, mx);
        const __m512 corr = exp512_nonpositive(_mm512_sub_ps(m, new_m));
        __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++) {
            s[t] = exp512_nonpositive(_mm512_sub_ps(s[t], new_m));
            sum = _mm512_add_ps(sum, s[t]);
        }
        l = _mm512_fmadd_ps(l, corr, sum);
        m = new_m;
        /* P.V on VDPBF16PS, keys in pairs (2j, 2j+1): pp[j] holds each lane's two weights as a
         * bf16 pair, vp[j][d] the two keys' V at d. Rounding the weights to bf16 (relative 2^-9)
         * is as FlashAttention does, and of the size of the output's own bf16 rounding; l sums
         * them unrounded. */
        __m512bh pp[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            pp[j] = (__m512bh)_mm512_permutexvar_epi16(pair_lanes, (__m512i)_mm512_cvtne2ps_pbh(s[2 * j + 1], s[2 * j]));
        for (int j = 0; j < 8; j++) {
            const uint16_t *a = (const uint16_t *)(v_base + rows[2 * j]), *b = (const uint16_t *)(v_base + rows[2 * j + 1]);
            for (int c = 0; c < D / 32; c++) {
                const __m512i x = _mm512_loadu_si512(a + 32 * c), y = _mm512_loadu_si512(b + 32 * c);
                _mm512_store_si512(vp + j * D + 32 * c, _mm512_permutex2var_epi16(x, pair_lo, y));
                _mm512_store_si512(vp + j * D + 32 * c + 16, _mm512_permutex2var_epi16(x, pair_hi, y));
            }
        }
        for (int d0 = 0; d0 < D; d0 += 8) {
            __m512 a[8];
            for (int dd = 0; dd < 8; dd++) a[dd] = _mm512_mul_ps(_mm512_load_ps(acc + 16 * (d0 + dd)), corr);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++)
                for (int dd = 0; dd < 8; dd++)
                    a[dd] = _mm512_dpbf16_ps(a[dd], pp[j], (__m512bh)_mm512_set1_epi32((int)vp[j * D + d0 + dd]));
            for (int dd = 0; dd < 8; dd++) _mm512_store_ps(acc + 16 * (d0 + dd), a[dd]);
        }
    }
    const __m512 invv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
    if (pr->io_bf16) { /* acc * inv as bf16 (round to nearest even, as f32_to_bf16), transposed to rows */
        for (int c0 = 0; c0 < D / 2; c0 += 16) {
            __m512i r[16]; /* r[k] lane i: the bf16 pair (d, d + 1) = (2 (c0 + k), 2 (c0 + k) + 1) */
            for (int k = 0; k < 16; k++) {
                const int d = 2 * (c0 + k);
                const __m512 lo = _mm512_mul_ps(_mm512_load_ps(acc + 16 * d), invv);
                const __m512 hi = _mm512_mul_ps(_mm512_load_ps(acc + 16 * (d + 1)), invv);
                r[k] = _mm512_permutexvar_epi16(pair_lanes, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
            transpose16(r);
            for (int i = 0; i < used; i++) _mm512_storeu_si512((uint16_t *)pr->out + q_at[i] + 2 * c0, r[i]);
        }
        return;
    }
    float inv[16] __attribute__((aligned(64)));
    _mm512_store_ps(inv, invv);
    for (int i = 0; i < used; i++) {
        float col[MAX_HEAD_DIM];
        for (int d = 0; d < D; d++) col[d] = acc[16 * d + i];
        store_out(pr, q_at[i], col, inv[i], D);
    }
}
#endif

#if HAVE_AMX
#include "attention_amx.h"
#endif

static void run_item(const Problem *pr, int64_t item, int touch, int64_t next) {
#if HAVE_AMX
    if (pr->amx && amx_item(pr, item, touch)) return;
#endif
#if HAVE_DPBF16
    if (pr->dtype == DTYPE_BF16 && pr->head_dim == 64) {
        run_item_dpbf16(pr, item, 64, touch, next);
        return;
    }
    if (pr->dtype == DTYPE_BF16 && pr->head_dim == 128) {
        run_item_dpbf16(pr, item, 128, touch, next);
        return;
    }
#endif
    const int D = pr->head_dim, hpi = pr->kv_heads_per_item;
    const int group = pr->num_q_heads / pr->num_kv_heads;
    const int heads = hpi * group; /* query heads of this item */
    const int width = hpi * D;     /* K/V elements of one token, this item */
    const int vector = D % VL == 0;
    const ItemAt at = item_at(pr, item);
    const int64_t b = at.b;
    const int h0 = at.h0; /* first KV head */
    const int seq_len = pr->seq_lens[b];
    const int first = first_key(pr, seq_len);
    const int64_t q_offset = (b * pr->num_q_heads + (int64_t)h0 * group) * D;
    const int32_t *table = at.table;
    const int64_t row_bytes = (int64_t)pr->num_kv_heads * D * pr->elem;
    const int64_t head_bytes = (int64_t)D * pr->elem;
    const char *k_base = (const char *)pr->k_cache + (int64_t)h0 * head_bytes;
    const char *v_base = (const char *)pr->v_cache + (int64_t)h0 * head_bytes;

    static _Thread_local float acc[MAX_HEADS * MAX_HEAD_DIM] __attribute__((aligned(64)));
    static _Thread_local float qb[MAX_HEADS * MAX_HEAD_DIM] __attribute__((aligned(64)));
    float scores[MAX_HEADS * TILE];
    float m[MAX_HEADS], l[MAX_HEADS];
    int64_t rows[TILE]; /* byte offsets of this tile's token rows in the pool */
#if HAVE_DPBF16
    static _Thread_local uint16_t qh[MAX_HEADS * MAX_HEAD_DIM] __attribute__((aligned(64)));
    const int use_dpbf16 = pr->dtype == DTYPE_BF16 && D % 32 == 0;
    if (use_dpbf16) load_q_bf16(pr, q_offset, heads * D, qh);
    else
#endif
        load_q(pr, q_offset, heads * D, qb);
    for (int j = 0; j < heads; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)heads * D);

    for (int start = first; start < seq_len; start += TILE) {
        const int n = seq_len - start < TILE ? seq_len - start : TILE;
        for (int t = 0; t < n; t++) {
            const int p = start + t;
            rows[t] = slot_of(pr, table, p) * row_bytes;
        }
        if (touch && start == first) touch_tile(k_base, v_base, rows, n, (int64_t)width * pr->elem);
        Prefetch pf;
        plan_next(&pf, pr, item, start, seq_len, touch, next);
        const int points = heads + n; /* where prefetch_upto runs in this tile */
        int point = 0;

        for (int j = 0; j < heads; j++) {
            const int64_t kv_off = (int64_t)(j / group) * head_bytes;
            const float *qj = qb + (int64_t)j * D;
            for (int t = 0; t < n; t++) {
                const char *k = k_base + rows[t] + kv_off;
#if HAVE_DPBF16
                if (use_dpbf16) {
                    scores[j * TILE + t] = dot_bf16(qh + (int64_t)j * D, (const uint16_t *)k, D) * pr->scale;
                    continue;
                }
#endif
                scores[j * TILE + t] = dot(pr, qj, k, vector) * pr->scale;
            }
            prefetch_upto(&pf, ++point, points);
        }
        for (int j = 0; j < heads; j++) {
            const float correction = softmax_tile(scores + j * TILE, n, &m[j], &l[j]);
            float *aj = acc + (int64_t)j * D;
            for (int d = 0; d < D; d++) aj[d] *= correction;
        }
        for (int t = 0; t < n; t++) {
            const char *row = v_base + rows[t];
            for (int j = 0; j < heads; j++)
                axpy(pr, acc + (int64_t)j * D, scores[j * TILE + t], row + (int64_t)(j / group) * head_bytes, vector);
            prefetch_upto(&pf, ++point, points);
        }
    }
    for (int j = 0; j < heads; j++)
        store_out(pr, q_offset + (int64_t)j * D, acc + (int64_t)j * D, l[j] > 0.0f ? 1.0f / l[j] : 0.0f, D);
}

/* Whether items a and c read the same K/V rows (up to c's extra keys): two rows of one prefill
 * chunk, each item all KV heads. Then c's rows are in cache after a's, and c skips touch_tile. */
static inline int same_keys(const Problem *pr, int64_t a, int64_t c) {
    return pr->kv_heads_per_item == pr->num_kv_heads && pr->row_seq && pr->row_seq[a] == pr->row_seq[c];
}

/* Items [lo, hi) in order, on one thread. */
static void run_items(const Problem *pr, int64_t lo, int64_t hi) {
#if HAVE_AMX
    if (pr->amx) amx_configure();
#endif
    for (int64_t item = lo; item < hi; item++) {
        const int64_t next = item + 1 < hi && !same_keys(pr, item, item + 1) ? item + 1 : -1;
        run_item(pr, item, item == lo || !same_keys(pr, item - 1, item), next);
    }
#if HAVE_AMX
    if (pr->amx) _tile_release();
#endif
}

/* Keys an item reads: its cost for the split between threads. */
static inline int64_t item_cost(const Problem *pr, int64_t item) {
    const int64_t b = item / (pr->num_kv_heads / pr->kv_heads_per_item);
    const int seq_len = pr->seq_lens[b];
    return (int64_t)(seq_len - first_key(pr, seq_len)) * pr->kv_heads_per_item + 1;
}

/* The cost of item (or unit) i: costs[i] where the caller gave costs, else item_cost. */
static inline int64_t cost_of(const Problem *pr, const int64_t *costs, int64_t i) {
    return costs ? costs[i] : item_cost(pr, i);
}

/* Items [begin, end) split into `parts` contiguous ranges of about equal cost; range `part`. */
static void cost_range(const Problem *pr, const int64_t *costs, int64_t begin, int64_t end, int parts, int part,
                       int64_t *lo, int64_t *hi) {
    int64_t total = 0;
    for (int64_t i = begin; i < end; i++) total += cost_of(pr, costs, i);
    const int64_t from = total * part / parts, to = total * (part + 1) / parts;
    int64_t seen = 0;
    *lo = *hi = end;
    int lo_set = 0;
    for (int64_t i = begin; i < end; i++) {
        /* An item belongs to the range its cost's midpoint falls in. */
        const int64_t mid = seen + cost_of(pr, costs, i) / 2;
        if (!lo_set && mid >= from) {
            *lo = i;
            lo_set = 1;
        }
        if (mid >= to && part < parts - 1) {
            *hi = i;
            break;
        }
        seen += cost_of(pr, costs, i);
    }
    if (*hi < *lo) *hi = *lo;
}

static int amx_enabled = 1; /* parkade_attention_set_amx */

/* Turns the AMX paths off (0) or on again (where built and granted): the tests and benchmarks
 * compare them with the AVX512-BF16 paths in one process. -> whether AMX is now in use. */
int parkade_attention_set_amx(int on) {
    __atomic_store_n(&amx_enabled, on != 0, __ATOMIC_RELAXED);
    return use_amx();
}

/* Whether a call may use AMX tiles: built with them, granted them, and not turned off. */
static int use_amx(void) {
#if HAVE_AMX
    return __atomic_load_n(&amx_enabled, __ATOMIC_RELAXED) && amx_permitted();
#else
    return 0;
#endif
}

/* Whether a call runs on AMX tiles: use_amx(), and shapes the tiles take (a bf16 cache, head_dim
 * 64 or 128, no sliding window, block_size a multiple of 16: see attention_amx.h). Decided once
 * per call, so that a call the tiles cannot serve neither loads nor releases their configuration. */
static int amx_for(int dtype, int head_dim, int sliding_window, int block_size) {
    return dtype == DTYPE_BF16 && (head_dim == 64 || head_dim == 128) && sliding_window == 0 &&
           block_size % 16 == 0 && use_amx();
}

/* The row path's shapes fit its fixed buffers: a work item's heads and K/V width, head_dim. */
static int items_fit(int num_q_heads, int num_kv_heads, int head_dim, int kv_heads_per_item) {
    const int group = num_q_heads / num_kv_heads;
    return head_dim <= MAX_HEAD_DIM && kv_heads_per_item * group <= MAX_HEADS &&
           kv_heads_per_item * head_dim <= MAX_WIDTH && num_kv_heads % kv_heads_per_item == 0;
}

/* Returns 0, or -1 when the shapes exceed the fixed buffers (checked in Python first).
 * num_threads > 1: split [item_begin, item_end) over an OpenMP team of that many (when built with
 * OpenMP; the caller splits otherwise). */
int paged_attention_rows(
    const void *q,               /* [num_rows, num_q_heads, head_dim], fp32 or (io_bf16) bf16 */
    const void *k_cache,         /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const void *v_cache,
    int dtype,
    const int32_t *block_table,  /* [num_seqs, table_stride] */
    int64_t table_stride,
    const int32_t *seq_lens,     /* [num_rows]: keys each row sees (its position + 1) */
    const int32_t *row_seq,      /* [num_rows]: each row's block-table row; NULL: row b uses row b */
    void *out,                   /* [num_rows, num_q_heads, head_dim], q's dtype */
    int num_q_heads, int num_kv_heads, int head_dim, int block_size,
    float scale, int sliding_window, /* 0: none */
    int kv_heads_per_item,       /* divides num_kv_heads */
    int64_t item_begin, int64_t item_end, int num_threads, int io_bf16) {
    if (!items_fit(num_q_heads, num_kv_heads, head_dim, kv_heads_per_item)) return -1;
    const Problem pr = {
        q, k_cache, v_cache, dtype, dtype == DTYPE_BF16 ? 2 : 4, block_table, table_stride, seq_lens, row_seq, out,
        num_q_heads, num_kv_heads, head_dim, block_size, sliding_window, kv_heads_per_item, io_bf16, scale,
        amx_for(dtype, head_dim, sliding_window, block_size),
    };
#ifdef _OPENMP
    if (num_threads > 1) {
#pragma omp parallel num_threads(num_threads)
        {
            int64_t lo, hi;
            cost_range(&pr, NULL, item_begin, item_end, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);
            run_items(&pr, lo, hi);
        }
        return 0;
    }
#endif
    (void)num_threads;
    run_items(&pr, item_begin, item_end);
    return 0;
}

/* A step's units (see paged_attention_units): unit u is rows [row[u], row[u] + rows[u]) from KV
 * head head[u]. */
typedef struct {
    const int32_t *row, *rows, *head;
} Units;

/* The row path's item of a unit of one row. */
static inline int64_t unit_item(const Problem *pr, const Units *un, int64_t u) {
    return un->row[u] * (pr->num_kv_heads / pr->kv_heads_per_item) + un->head[u] / pr->kv_heads_per_item;
}

/* Units [lo, hi) in order, on one thread: a block (rows > 1) or one row's item of the row path. */
static void run_units(const Problem *pr, const Units *un, int64_t lo, int64_t hi) {
#if HAVE_AMX
    if (pr->amx) amx_configure();
#endif
    for (int64_t u = lo; u < hi; u++) {
#if HAVE_AMX
        if (un->rows[u] > 1 && pr->amx && amx_block(pr, un->row[u], un->rows[u], un->head[u])) continue;
#endif
#if HAVE_DPBF16
        if (un->rows[u] > 1) {
            if (pr->head_dim == 64) run_block_dpbf16(pr, un->row[u], un->rows[u], un->head[u], 64);
            else run_block_dpbf16(pr, un->row[u], un->rows[u], un->head[u], 128);
            continue;
        }
#endif
        const int64_t next = u + 1 < hi && un->rows[u + 1] == 1 ? unit_item(pr, un, u + 1) : -1;
        run_item(pr, unit_item(pr, un, u), 1, next);
    }
#if HAVE_AMX
    if (pr->amx) _tile_release();
#endif
}

/* A step's rows as units of work, split over the threads by the caller's costs: a unit of nrows > 1
 * is a block of a prefill chunk's rows (consecutive rows of one request, nrows <= 16 / group)
 * against KV head `head` (run_block_dpbf16: a bf16 cache, head_dim 64 or 128, no sliding window,
 * on a build with AVX512-BF16; amx_block where the tiles are in use); a unit of one row is the row path's item for that row and its
 * `kv_heads_per_item` heads from `head` (run_item). Returns -1 where the shapes do not fit, as
 * paged_attention_rows, and also where a block cannot run on this build. */
int paged_attention_units(
    const void *q, const void *k_cache, const void *v_cache, int dtype, const int32_t *block_table,
    int64_t table_stride, const int32_t *seq_lens, const int32_t *row_seq, void *out,
    int num_q_heads, int num_kv_heads, int head_dim, int block_size, float scale, int kv_heads_per_item,
    const int32_t *unit_row, const int32_t *unit_rows, const int32_t *unit_head, const int64_t *unit_cost,
    int64_t num_units, int num_threads, int io_bf16) {
    const int group = num_q_heads / num_kv_heads;
    if (!items_fit(num_q_heads, num_kv_heads, head_dim, kv_heads_per_item) || !row_seq) return -1;
    for (int64_t u = 0; u < num_units; u++)
        if (unit_rows[u] > 1 && (!HAVE_DPBF16 || dtype != DTYPE_BF16 || (head_dim != 64 && head_dim != 128) ||
                                 unit_rows[u] * group > 16))
            return -1;
    const Problem pr = {
        q, k_cache, v_cache, dtype, dtype == DTYPE_BF16 ? 2 : 4, block_table, table_stride, seq_lens, row_seq, out,
        num_q_heads, num_kv_heads, head_dim, block_size, 0, kv_heads_per_item, io_bf16, scale,
        amx_for(dtype, head_dim, 0, block_size),
    };
    const Units units = {unit_row, unit_rows, unit_head};
#ifdef _OPENMP
    if (num_threads > 1) {
#pragma omp parallel num_threads(num_threads)
        {
            int64_t lo, hi;
            cost_range(&pr, unit_cost, 0, num_units, omp_get_num_threads(), omp_get_thread_num(), &lo, &hi);
            run_units(&pr, &units, lo, hi);
        }
        return 0;
    }
#endif
    (void)num_threads;
    run_units(&pr, &units, 0, num_units);
    return 0;
}

/* The pool write: token i's K and V rows (`row_bytes` each, all its KV heads; token i's at byte
 * i * key_stride of `key`, i * value_stride of `value`) to slot slots[i] of the pools, skipped where
 * slots[i] < 0. Returns -1, having written nothing, when a slot is past the pool's `num_slots`
 * (checked first: an index is never trusted blindly into a raw copy). */
int parkade_write_kv(const void *key, const void *value, void *k_cache, void *v_cache, const int64_t *slots,
                     int64_t num_tokens, int64_t num_slots, int64_t row_bytes, int64_t key_stride,
                     int64_t value_stride) {
    for (int64_t i = 0; i < num_tokens; i++)
        if (slots[i] >= num_slots) return -1;
    for (int64_t i = 0; i < num_tokens; i++) {
        if (slots[i] < 0) continue;
        memcpy((char *)k_cache + slots[i] * row_bytes, (const char *)key + i * key_stride, (size_t)row_bytes);
        memcpy((char *)v_cache + slots[i] * row_bytes, (const char *)value + i * value_stride, (size_t)row_bytes);
    }
    return 0;
}
