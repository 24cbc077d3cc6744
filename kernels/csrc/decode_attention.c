/* Paged decode attention for CPUs: one query token per request over its paged K/V.
 *
 * Built on first use by parkade.kernels.attention_cpu (cc -O3 -march=native, see there) and called
 * through ctypes, which releases the GIL, so Python threads run disjoint work ranges in parallel.
 *
 * Work item i = (request b, a run of `kv_heads_per_item` KV heads starting at h0) serves the query
 * heads that read those KV heads (transformers' repeat_kv order: query head j reads KV head
 * j / group). One pass over the request's keys reads each K/V row once, in the cache dtype, with
 * no copy of the pool; a whole token row of all KV heads is contiguous, so an item of every head
 * streams whole blocks:
 *
 *   for each tile of up to TILE keys p in [first, seq_len):       (first > 0 only with a window)
 *       s[j][t] = scale * <q[j], k[p]>                              fp32
 *       online softmax: m' = max(m, max_t s), acc = acc * e^(m - m') + sum_t e^(s - m') v[p]
 *   out[j] = acc / l
 *
 * Pool layout [num_blocks, block_size, num_kv_heads, head_dim] (kernels/attention_torch.py):
 * the key at position p lives at row block_table[b][p / block_size] * block_size + p % block_size.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE 32
#define MAX_HEAD_DIM 256
#define MAX_HEADS 128 /* query heads served by one work item */
#define MAX_WIDTH 512 /* K/V elements of one token that one work item reads */

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* `n` consecutive cache elements from `offset` as fp32 into dst. */
static inline void load(const void *cache, int dtype, int64_t offset, int n, float *dst) {
    if (dtype == DTYPE_BF16) {
        const uint16_t *src = (const uint16_t *)cache + offset;
        for (int d = 0; d < n; d++) dst[d] = bf16_to_f32(src[d]);
    } else {
        memcpy(dst, (const float *)cache + offset, (size_t)n * sizeof(float));
    }
}

/* exp(x) for x <= 0, to about 2 ulp; branch-free so that loops over it vectorize (libm's expf is a
 * call per element). Below -87 it returns 0 (the online softmax feeds it -inf on its first tile). */
static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;
    const float n = __builtin_roundf(clamped * 1.44269504088896341f);
    /* Two-constant ln 2 (Cody-Waite) with explicit fmaf: -fassociative-math must not fold them. */
    const float r = fmaf(n, 2.12194440e-4f, fmaf(n, -0.693359375f, clamped));
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

/* Returns 0, or -1 when the shapes exceed the fixed buffers (checked in Python first). */
int decode_attention(
    const float *q,              /* [num_seqs, num_q_heads, head_dim] */
    const void *k_cache,         /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const void *v_cache,
    int dtype,
    const int32_t *block_table,  /* [num_seqs, table_stride] */
    int64_t table_stride,
    const int32_t *seq_lens,     /* [num_seqs] */
    float *out,                  /* [num_seqs, num_q_heads, head_dim] */
    int num_q_heads, int num_kv_heads, int head_dim, int block_size,
    float scale, int sliding_window, /* 0: none */
    int kv_heads_per_item,       /* divides num_kv_heads */
    int64_t item_begin, int64_t item_end) {
    const int group = num_q_heads / num_kv_heads;
    const int heads = kv_heads_per_item * group; /* query heads of one item */
    const int width = kv_heads_per_item * head_dim; /* K/V elements of one token, one item */
    if (head_dim > MAX_HEAD_DIM || heads > MAX_HEADS || width > MAX_WIDTH || num_kv_heads % kv_heads_per_item)
        return -1;
    const int items_per_seq = num_kv_heads / kv_heads_per_item;
    static _Thread_local float kv[TILE * MAX_WIDTH];
    static _Thread_local float acc[MAX_HEADS * MAX_HEAD_DIM];
    float scores[MAX_HEADS * TILE];
    float m[MAX_HEADS], l[MAX_HEADS];
    const int64_t row_stride = (int64_t)num_kv_heads * head_dim;

    for (int64_t item = item_begin; item < item_end; item++) {
        const int64_t b = item / items_per_seq;
        const int h0 = (int)(item % items_per_seq) * kv_heads_per_item; /* first KV head */
        const int seq_len = seq_lens[b];
        const int first = sliding_window > 0 && seq_len > sliding_window ? seq_len - sliding_window : 0;
        const float *qb = q + (b * num_q_heads + (int64_t)h0 * group) * head_dim;
        const int32_t *table = block_table + b * table_stride;
        for (int j = 0; j < heads; j++) {
            m[j] = -INFINITY;
            l[j] = 0.0f;
        }
        memset(acc, 0, sizeof(float) * (size_t)heads * head_dim);

        const int elem = dtype == DTYPE_BF16 ? 2 : 4;
        for (int start = first; start < seq_len; start += TILE) {
            const int n = seq_len - start < TILE ? seq_len - start : TILE;
            /* The rows are scattered over blocks the hardware prefetcher cannot guess: ask for this
             * tile's V rows and the next tile's K rows while this tile's keys are computed. */
            for (int p = start; p < start + 2 * TILE && p < seq_len; p++) {
                const int64_t row = (int64_t)table[p / block_size] * block_size + p % block_size;
                const int64_t offset = (row * row_stride + (int64_t)h0 * head_dim) * elem;
                const char *rows = (const char *)(p < start + TILE ? v_cache : k_cache) + offset;
                for (int byte = 0; byte < width * elem; byte += 64) __builtin_prefetch(rows + byte);
            }
            /* The tile's keys, all of this item's heads, as fp32 rows kv[t][kv_head][d]. */
            for (int t = 0; t < n; t++) {
                const int p = start + t;
                const int64_t row = (int64_t)table[p / block_size] * block_size + p % block_size;
                load(k_cache, dtype, row * row_stride + (int64_t)h0 * head_dim, width, kv + t * width);
            }
            for (int j = 0; j < heads; j++) {
                const float *qj = qb + (int64_t)j * head_dim;
                const int kv_offset = (j / group) * head_dim;
                for (int t = 0; t < n; t++) {
                    const float *kt = kv + t * width + kv_offset;
                    float s = 0.0f;
                    for (int d = 0; d < head_dim; d++) s += qj[d] * kt[d];
                    scores[j * TILE + t] = s * scale;
                }
            }
            for (int j = 0; j < heads; j++) {
                float *sj = scores + j * TILE;
                float tile_max = sj[0];
                for (int t = 1; t < n; t++) tile_max = sj[t] > tile_max ? sj[t] : tile_max;
                const float new_m = tile_max > m[j] ? tile_max : m[j];
                const float correction = exp_nonpositive(m[j] - new_m); /* 0 on the first tile */
                float sum = 0.0f;
                for (int t = 0; t < n; t++) {
                    sj[t] = exp_nonpositive(sj[t] - new_m);
                    sum += sj[t];
                }
                l[j] = l[j] * correction + sum;
                m[j] = new_m;
                float *aj = acc + (int64_t)j * head_dim;
                for (int d = 0; d < head_dim; d++) aj[d] *= correction;
            }
            for (int t = 0; t < n; t++) {
                const int p = start + t;
                const int64_t row = (int64_t)table[p / block_size] * block_size + p % block_size;
                load(v_cache, dtype, row * row_stride + (int64_t)h0 * head_dim, width, kv + t * width);
            }
            for (int j = 0; j < heads; j++) {
                float *aj = acc + (int64_t)j * head_dim;
                const int kv_offset = (j / group) * head_dim;
                for (int t = 0; t < n; t++) {
                    const float w = scores[j * TILE + t];
                    const float *vt = kv + t * width + kv_offset;
                    for (int d = 0; d < head_dim; d++) aj[d] += w * vt[d];
                }
            }
        }
        for (int j = 0; j < heads; j++) {
            float *dst = out + (b * num_q_heads + (int64_t)h0 * group + j) * head_dim;
            const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
            for (int d = 0; d < head_dim; d++) dst[d] = acc[(int64_t)j * head_dim + d] * inv;
        }
    }
    return 0;
}
