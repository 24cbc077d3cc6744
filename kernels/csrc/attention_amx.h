/* Paged attention on AMX tiles (Intel Sapphire Rapids and later: `amx_tile`, `amx_bf16`), for a
 * bf16 cache with head_dim 64 or 128, block_size a multiple of 16 and no sliding window.
 * Included by paged_attention.c (its Problem, slot_of, load_q_bf16, store_out, exp512_nonpositive,
 * touch_tile, transpose16).
 *
 * Why: on the AMX machines measured (2 vCPU Xeon, 2026-12-05), VDPBF16PS retires one per two
 * cycles (16 bf16 products a cycle, against four times that on a Zen 5), so the AVX512-BF16 paths
 * spent most of a decode step's attention computing; one TDPBF16PS multiplies a 16x32 by a 32x16
 * bf16 tile (8,192 products) in about 4.9 ns (some 18 cycles), whatever the rows used.
 *
 * The work is a set of up to 16 columns: query vectors of one request, each with its KV head (a
 * decode item's query heads, or a prefill block's rows x its group's heads) and the keys it sees
 * ([0, lens[j]), causal for a prefill row). Three passes over the request's keys:
 *   1. S^T = K Q^T, 16 keys at a time: A = 16 consecutive pool rows of K (a tile straight from the
 *      cache: 16 positions of one block are contiguous rows), B = the columns' q as bf16 pairs,
 *      zero where a column reads another KV head (so one S^T tile holds every column's scores,
 *      column j in lane j of each key's row); stored to a scratch buffer S [key][16].
 *   2. The softmax over each lane, exact and two-pass (the max, then e^(s - max) and its sum):
 *      no online rescaling, so P.V can accumulate in tiles. The weights are rounded to bf16 for
 *      P.V (as FlashAttention rounds P; the run_block_dpbf16 path does the same), transposed to
 *      P [column][key]; the sum stays fp32 and unrounded.
 *   3. O = P V, 32 keys at a time: A = P (for a KV head's own columns; others' rows zero), B = the
 *      head's V rows with consecutive keys interleaved as bf16 pairs (VNNI), 16 head dims per tile
 *      in the order the interleave leaves them (dims_in_order restores it), accumulated in four
 *      tiles (64 dims) across all keys; out[j] = O[j] / l[j].
 * Keys a column does not see weigh 0; pool rows past the last key (read by a last 16-key tile of
 * K, never past its block) score -inf before the softmax, and their V is never read (zero pairs).
 */
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_COLUMNS 16
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux gives a process the AMX tile state only on request (once; any thread). */
static int amx_permitted(void) {
    static int state; /* 0: not asked yet, 1: granted, -1: refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (!s) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
}

/* amx_configure: tiles 0-3 hold O (64 head dims), 4: A, 5: B, 6: S^T. */
#include "amx_tiles.h"

typedef struct {
    int n;                            /* columns, <= 16 */
    int h0, nheads;                   /* the KV heads read: [h0, h0 + nheads) */
    const int32_t *table;             /* the request's block-table row */
    int head[AMX_COLUMNS];            /* column j's KV head, relative to h0 */
    int32_t lens[AMX_COLUMNS];        /* keys column j sees */
    int64_t offset[AMX_COLUMNS];      /* element offset of column j's q and output */
} AmxColumns;

/* Per-thread scratch of at least `bytes` (64-byte aligned), kept between calls; NULL if out of memory. */
static void *amx_scratch(size_t bytes) {
    static _Thread_local void *buf;
    static _Thread_local size_t cap;
    if (bytes > cap) {
        free(buf);
        cap = (bytes + bytes / 2 + 4095) & ~(size_t)4095;
        buf = aligned_alloc(64, cap);
        if (!buf) cap = 0;
    }
    return buf;
}

/* r[i][j] <- r[j][i] for a 16x16 fp32 block (transpose16 on the same bits). */
static inline void transpose16_ps(__m512 r[16]) {
    __m512i x[16];
    for (int i = 0; i < 16; i++) x[i] = _mm512_castps_si512(r[i]);
    transpose16(x);
    for (int i = 0; i < 16; i++) r[i] = _mm512_castsi512_ps(x[i]);
}

/* Pass 3's V pairs come from unpacklo/unpackhi, which pair within 128-bit lanes: of a group of 32
 * dims, the "lo" tile holds dims 8L .. 8L + 3 of each lane L (in its columns 4L .. 4L + 3) and the
 * "hi" tile dims 8L + 4 .. 8L + 7. So O's row comes out as [lo 16 | hi 16] per 32 dims; this puts
 * a row of D fp32 (a multiple of 32) back in dim order, in place. */
static inline void dims_in_order(float *row, int D) {
    /* Per output dim of the first and second 16: its column in [lo | hi] (16+: the hi tile's). */
    static const int32_t first[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
    static const int32_t second[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
    const __m512i a = _mm512_loadu_si512(first), b = _mm512_loadu_si512(second);
    for (int g = 0; g < D; g += 32) {
        const __m512 lo = _mm512_loadu_ps(row + g), hi = _mm512_loadu_ps(row + g + 16);
        _mm512_storeu_ps(row + g, _mm512_permutex2var_ps(lo, a, hi));
        _mm512_storeu_ps(row + g + 16, _mm512_permutex2var_ps(lo, b, hi));
    }
}

/* The three passes above for head_dim D; returns 0 (and writes nothing) when scratch is short. */
static inline __attribute__((always_inline)) int amx_attend(const Problem *pr, const AmxColumns *cs, const int D, int touch) {
    const int chunks = D / 32; /* 32-element pieces of a head: one tile's K side */
    const int64_t row_bytes = (int64_t)pr->num_kv_heads * D * 2;
    int max_len = 0;
    for (int j = 0; j < cs->n; j++) max_len = cs->lens[j] > max_len ? cs->lens[j] : max_len;
    const int keys32 = (max_len + 31) & ~31;
    /* scratch: QK's B tiles (nheads x chunks), S [keys32][16] fp32, P one 32-key tile, the heads'
     * A tiles, V pairs (nheads x 4), O [16][D] fp32: tiles of 1 KiB */
    const size_t tile = 1024;
    char *base = amx_scratch(tile * ((size_t)cs->nheads * chunks + (size_t)keys32 / 16 + 1 + cs->nheads + (size_t)cs->nheads * 4) +
                             sizeof(float) * 16 * (size_t)D);
    if (!base) return 0;
    uint32_t *qb = (uint32_t *)base;
    float *S = (float *)(base + tile * (size_t)cs->nheads * chunks);
    uint16_t *P = (uint16_t *)((char *)S + tile * (size_t)keys32 / 16);
    char *stage = (char *)P + tile;
    char *vb = stage + tile * (size_t)cs->nheads;
    float *obuf = (float *)(vb + tile * (size_t)cs->nheads * 4);

    /* QK's B tiles: tile (h, c) row r, lane j = q_j's elements (32c + 2r, 32c + 2r + 1), or 0. */
    memset(qb, 0, tile * (size_t)cs->nheads * chunks);
    for (int j = 0; j < cs->n; j++) {
        uint32_t q32[MAX_HEAD_DIM / 2];
        load_q_bf16(pr, cs->offset[j], D, (uint16_t *)q32);
        for (int c = 0; c < chunks; c++)
            for (int r = 0; r < 16; r++) qb[((cs->head[j] * chunks + c) * 16 + r) * 16 + j] = q32[16 * c + r];
    }

    /* 1. S^T, 16 keys a tile. */
    const char *k_base = (const char *)pr->k_cache + (int64_t)cs->h0 * D * 2;
    const char *v_base = (const char *)pr->v_cache + (int64_t)cs->h0 * D * 2;
    for (int k0 = 0; k0 < max_len; k0 += 16) {
        const int64_t first_row = slot_of(pr, cs->table, k0) * row_bytes;
        const char *rows = k_base + first_row;
        if (touch) { /* the tile's K and V rows, in address order (touch_tile: many misses in flight) */
            int64_t at[16];
            for (int t = 0; t < 16; t++) at[t] = first_row + t * row_bytes;
            touch_tile(k_base, v_base, at, max_len - k0 < 16 ? max_len - k0 : 16, (int64_t)cs->nheads * D * 2);
        }
        _tile_zero(6);
        for (int h = 0; h < cs->nheads; h++)
            for (int c = 0; c < chunks; c++) {
                _tile_loadd(4, rows + (int64_t)h * D * 2 + 64 * c, row_bytes);
                _tile_loadd(5, qb + (h * chunks + c) * 256, 64);
                _tile_dpbf16ps(6, 4, 5);
            }
        _tile_stored(6, S + 16 * k0, 64);
    }

    /* 2. Each lane's max, over the keys it sees. */
    int32_t lens[16] __attribute__((aligned(64)));
    for (int j = 0; j < 16; j++) lens[j] = j < cs->n ? cs->lens[j] : 0;
    const __m512i lenv = _mm512_load_si512(lens);
    const __m512 scale = _mm512_set1_ps(pr->scale);
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
    for (int k = 0; k < max_len; k++) {
        const __mmask16 valid = _mm512_cmpgt_epi32_mask(lenv, _mm512_set1_epi32(k));
        m = _mm512_mask_max_ps(m, valid, m, _mm512_mul_ps(_mm512_load_ps(S + 16 * k), scale));
    }

    if (cs->nheads > 1) memset(stage, 0, tile * (size_t)cs->nheads);

    for (int d0 = 0; d0 < D; d0 += 64) { /* D is 64 or 128: whole groups of 64 dims */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int k0 = 0; k0 < max_len; k0 += 32) {
            /* 2. The weights of keys k0..k0+31, P [lane][key] in bf16; l sums them (first d0 only). */
            for (int half = 0; half < 2; half++) {
                __m512 p[16];
                for (int t = 0; t < 16; t++) {
                    const int k = k0 + 16 * half + t;
                    const __mmask16 valid = _mm512_cmpgt_epi32_mask(lenv, _mm512_set1_epi32(k));
                    p[t] = k < max_len ? _mm512_maskz_mov_ps(valid, exp512_nonpositive(_mm512_sub_ps(
                                                                      _mm512_mul_ps(_mm512_load_ps(S + 16 * k), scale), m)))
                                       : _mm512_setzero_ps();
                    if (d0 == 0) l = _mm512_add_ps(l, p[t]);
                }
                transpose16_ps(p);
                for (int j = 0; j < 16; j++) _mm256_store_si256((__m256i *)(P + 32 * j + 16 * half), (__m256i)_mm512_cvtneps_pbh(p[j]));
            }
            /* 3. Each head's V pairs for these keys and head dims d0..d0+63, then O += P V. Keys
             * k0..k0+15 and k0+16..k0+31 are each 16 consecutive rows of one block. */
            const int64_t row0 = slot_of(pr, cs->table, k0) * row_bytes;
            const int64_t row16 = k0 + 16 < max_len ? slot_of(pr, cs->table, k0 + 16) * row_bytes : 0;
            for (int h = 0; h < cs->nheads; h++) {
                uint32_t *vh = (uint32_t *)(vb + tile * 4 * (size_t)h);
                for (int r = 0; r < 16; r++) {
                    const int a = k0 + 2 * r, b = a + 1;
                    const int64_t row_a = r < 8 ? row0 + 2 * r * row_bytes : row16 + (2 * r - 16) * row_bytes;
                    for (int c = 0; c < 2; c++) { /* dims d0 + 32c .. d0 + 32c + 31 */
                        const char *va = v_base + row_a + (int64_t)h * D * 2 + (int64_t)(d0 + 32 * c) * 2;
                        const __m512i x = a < max_len ? _mm512_loadu_si512(va) : _mm512_setzero_si512();
                        const __m512i y = b < max_len ? _mm512_loadu_si512(va + row_bytes) : _mm512_setzero_si512();
                        /* (x[i], y[i]) as bf16 pairs, within each 128-bit lane (one cycle each, where
                         * a permute across lanes takes three): the tiles' dims in lane order (see
                         * dims_in_order) */
                        _mm512_store_si512(vh + 256 * (2 * c) + 16 * r, _mm512_unpacklo_epi16(x, y));
                        _mm512_store_si512(vh + 256 * (2 * c + 1) + 16 * r, _mm512_unpackhi_epi16(x, y));
                    }
                }
                const char *a_tile = (const char *)P;
                if (cs->nheads > 1) { /* this head's columns only: the others' rows stay zero */
                    char *st = stage + tile * (size_t)h;
                    for (int j = 0; j < cs->n; j++)
                        if (cs->head[j] == h) memcpy(st + 64 * j, (const char *)P + 64 * j, 64);
                    a_tile = st;
                }
                _tile_loadd(4, a_tile, 64);
                _tile_loadd(5, vh, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(5, vh + 256, 64);
                _tile_dpbf16ps(1, 4, 5);
                _tile_loadd(5, vh + 512, 64);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(5, vh + 768, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, obuf + d0, D * 4);
        _tile_stored(1, obuf + d0 + 16, D * 4);
        _tile_stored(2, obuf + d0 + 32, D * 4);
        _tile_stored(3, obuf + d0 + 48, D * 4);
    }
    float inv[16] __attribute__((aligned(64)));
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
    for (int j = 0; j < cs->n; j++) {
        dims_in_order(obuf + (int64_t)j * D, D);
        store_out(pr, cs->offset[j], obuf + (int64_t)j * D, inv[j], D);
    }
    return 1;
}

/* run_item's item on AMX, its query heads in sets of whole KV heads of at most 16 columns; 0 when
 * a KV head's group alone has more than 16 query heads (or scratch is short). */
static int amx_item(const Problem *pr, int64_t item, int touch) {
    const int hpi = pr->kv_heads_per_item, G = pr->num_q_heads / pr->num_kv_heads, D = pr->head_dim;
    if (G > AMX_COLUMNS) return 0;
    const ItemAt at = item_at(pr, item);
    const int64_t b = at.b;
    const int h_first = at.h0;
    const int per_set = AMX_COLUMNS / G; /* KV heads per column set */
    AmxColumns cs;
    cs.table = at.table;
    for (int h0 = h_first; h0 < h_first + hpi; h0 += per_set) {
        cs.h0 = h0;
        cs.nheads = h_first + hpi - h0 < per_set ? h_first + hpi - h0 : per_set;
        cs.n = cs.nheads * G;
        for (int j = 0; j < cs.n; j++) {
            cs.head[j] = j / G;
            cs.lens[j] = pr->seq_lens[b];
            cs.offset[j] = (b * pr->num_q_heads + (int64_t)h0 * G + j) * D;
        }
        if (!(D == 64 ? amx_attend(pr, &cs, 64, touch) : amx_attend(pr, &cs, 128, touch))) return 0;
    }
    return 1;
}

/* run_units' block (rows row0 .. row0 + nrows - 1 of one request, KV head h) on AMX. */
static int amx_block(const Problem *pr, int64_t row0, int nrows, int h) {
    const int G = pr->num_q_heads / pr->num_kv_heads, D = pr->head_dim;
    AmxColumns cs;
    cs.table = pr->block_table + pr->row_seq[row0] * pr->table_stride;
    cs.h0 = h;
    cs.nheads = 1;
    cs.n = nrows * G;
    for (int j = 0; j < cs.n; j++) {
        const int64_t row = row0 + j / G;
        cs.head[j] = 0;
        cs.lens[j] = pr->seq_lens[row];
        cs.offset[j] = (row * pr->num_q_heads + (int64_t)h * G + j % G) * D;
    }
    return D == 64 ? amx_attend(pr, &cs, 64, 0) : amx_attend(pr, &cs, 128, 0);
}
