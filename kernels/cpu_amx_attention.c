/* Prefill attention over a bf16 paged cache through Intel AMX tiles (compiled into the kernels library):
 *   sy_amx_prefill_attention_bf16  causal attention of a batch's new tokens over their cached prefix and
 *                                  themselves, bf16 q and cache, bf16 out, fp32 softmax
 * Built where the compiler targets AMX-TILE + AMX-BF16; elsewhere (or when the OS refuses the tiles) it returns
 * 2 and the caller keeps sy_prefill_attention (cpu_native.c: one query row at a time, fp32 math).
 * No tree masks here: a chunk verifying a speculative tree takes sy_prefill_attention (kernels/cpu_native.py).
 *
 * Why: that kernel treats each new token as a decode query, a dot product per cached row in fp32 FMAs, about
 * 100 GFLOP/s on two cores of an AMX Xeon; a 64-prompt batch of 32-512 tokens spends ~200 GFLOP there in a
 * SmolLM2-sized model. Here 16 queries share every K and V tile a TDPBF16PS multiplies, as flash attention does.
 *
 * Per unit (one sequence, one q head, 16 consecutive new tokens) the keys go by in chunks of 64 positions:
 *   S^T (64 positions x 16 queries, four tiles) = K (16 positions x 32 d, loaded from the cache as it lies) . Q^T
 *       (B tile: the 16 queries' d pairs, repacked once per unit), so one key position is one 16-lane row and
 *       the online softmax's max / sum per query are lane-wise vector ops;
 *   O^T (D x 16 queries, fp32, in memory) = O^T * alpha + V^T (16 d x 32 positions) . P^T (two B tiles: the
 *       probabilities rounded to bf16, position pairs interleaved, as torch's bf16 flash attention rounds them).
 * V^T per (sequence, kv head) is written once into the caller's scratch before the units run (the one repack:
 * the cache holds V position-major and the tile multiply wants a d row's positions side by side). */
#include <stdint.h>
#include <string.h>

#include "switchyard_kernels.h" /* the declared interface: prototypes, shared structs and constants */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#define SY_HAVE_AMX_ATTENTION 1
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "cpu_exp.h"
#endif

#ifdef SY_HAVE_AMX_ATTENTION
#define UNIT_QUERIES 16

/* V^T scratch per sequence: positions rounded up to the key chunk, so a chunk's tile never reads past it */
static int64_t vt_len(int64_t len) { return (len + SY_AMX_KEY_CHUNK - 1) / SY_AMX_KEY_CHUNK * SY_AMX_KEY_CHUNK; }

typedef float f16v __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
static inline __m512 exp_nonpos(__m512 v) {
    f16v x = (f16v)v;
    EXP_NONPOS_BODY(f16v, i16v);
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Every tile is 16 rows x 64 bytes. S^T phase: 0-3 the four 16-position S^T tiles, 4 K, 5 Q^T. PV phase: 0-3 the
 * O^T products of four 16-d blocks, 4 V^T, 5-6 the two P^T halves. */
static void configure_tiles(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 7; i++) {
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
    _tile_loadconfig(&c);
}

/* The cache row of position pos (one kv head's D values), or NULL for a block id outside the pool. */
static inline const uint16_t *cache_row(const uint16_t *cache, const int32_t *table, int64_t num_blocks,
                                        int block_size, int64_t sb, int64_t so, int64_t pos) {
    const int32_t blk = table[pos / block_size];
    if (blk < 0 || blk >= num_blocks) return NULL;
    return cache + (int64_t)blk * sb + (pos % block_size) * so;
}

/* V^T of one (sequence, kv head): vt[d * vt_len(len) + pos], zero past len. 16 positions (one block's rows, as
 * block_size % 16 == 0) at a time: a gather of 16 d pairs gives two d rows. Returns 1 for a bad block id. */
static int repack_vt(const uint16_t *v_cache, const int32_t *table, int64_t num_blocks, int block_size, int64_t sb,
                     int64_t so, int64_t len, int D, uint16_t *vt) {
    const int64_t stride = vt_len(len);
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32((int)(so * 2)));
    for (int64_t pos = 0; pos < len; pos += 16) {
        const uint16_t *row = cache_row(v_cache, table, num_blocks, block_size, sb, so, pos);
        if (!row) return 1;
        for (int d = 0; d < D; d += 2) {
            const __m512i pair = _mm512_i32gather_epi32(rows, row + d, 1);
            _mm256_storeu_si256((__m256i *)(vt + d * stride + pos), _mm512_cvtepi32_epi16(pair));
            _mm256_storeu_si256((__m256i *)(vt + (d + 1) * stride + pos),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(pair, 16)));
        }
    }
    /* the last block's rows past len are not this sequence's: zero, as the chunk's tail P^T is */
    for (int d = 0; d < D; d++) memset(vt + d * stride + len, 0, (size_t)(stride - len) * 2);
    return 0;
}

/* 16 lanes of fp32 -> bf16 pairs: out[2i] = even[i], out[2i + 1] = odd[i] (a row of a VNNI B tile) */
static inline void store_pairs(uint16_t *out, __m512 even, __m512 odd) {
    static const uint16_t interleave[32] __attribute__((aligned(64))) = {
        0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even); /* even in the low half, odd in the high */
    _mm512_store_si512((__m512i *)out, _mm512_permutexvar_epi16(_mm512_load_si512(interleave), both));
}

typedef struct {
    const uint16_t *q, *k_cache;
    int64_t q_st, q_sh, sb, so, num_blocks, table_stride;
    float scale;
    int block_size, Hq, Hkv, D;
    const int32_t *tables, *cu, *lens;
    const uint16_t *vt;
    const int64_t *vt_off; /* per sequence: where its kv heads' V^T start in vt */
    uint16_t *out;
} prefill_args;

/* C tile `i` (a compile-time constant in each case) */
#define ON_TILE(i, STMT)                                                                                         \
    switch (i) {                                                                                                 \
    case 0: STMT(0); break;                                                                                      \
    case 1: STMT(1); break;                                                                                      \
    case 2: STMT(2); break;                                                                                      \
    default: STMT(3); break;                                                                                     \
    }

/* One unit: sequence p, q head hq, new tokens t0 .. t0 + rows - 1 (of the sequence's own numbering).
 * Returns 1 for a block id outside the pool. */
static int unit(const prefill_args *a, int p, int hq, int t0, int rows) {
    const int D = a->D, h = hq / (a->Hq / a->Hkv);
    const int64_t len = a->lens[p], first_new = len - (a->cu[p + 1] - a->cu[p]);
    const int64_t q_pos0 = first_new + t0, kend = q_pos0 + rows; /* keys 0 .. kend - 1 */
    const int64_t row0 = a->cu[p] - a->cu[0] + t0;                /* q / out row of token t0 */
    const int32_t *table = a->tables + (int64_t)p * a->table_stride;
    const uint16_t *kc = a->k_cache + (int64_t)h * D;
    const int64_t vts = vt_len(len);
    const uint16_t *vt = a->vt + a->vt_off[p] + (int64_t)h * D * vts;
    uint16_t qt[SY_MAX_HEAD_DIM / 2 * UNIT_QUERIES * 2] __attribute__((aligned(64)));
    uint16_t pt[SY_AMX_KEY_CHUNK * UNIT_QUERIES] __attribute__((aligned(64)));
    float s[SY_AMX_KEY_CHUNK * UNIT_QUERIES] __attribute__((aligned(64)));
    float o[SY_MAX_HEAD_DIM * UNIT_QUERIES] __attribute__((aligned(64)));
    float pv[64 * UNIT_QUERIES] __attribute__((aligned(64)));

    /* Q^T as B tiles: for d pair j, query i: (q[i][2j], q[i][2j + 1]); queries past `rows` are zero */
    memset(qt, 0, (size_t)D * UNIT_QUERIES * 2);
    for (int i = 0; i < rows; i++) {
        const uint32_t *qi = (const uint32_t *)(a->q + (row0 + i) * a->q_st + (int64_t)hq * a->q_sh);
        for (int j = 0; j < D / 2; j++) ((uint32_t *)qt)[j * UNIT_QUERIES + i] = qi[j];
    }
    memset(o, 0, (size_t)D * UNIT_QUERIES * 4);
    const __m512 scale = _mm512_set1_ps(a->scale), neg_inf = _mm512_set1_ps(-__builtin_inff());
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 m = neg_inf, l = _mm512_setzero_ps();

    for (int64_t c0 = 0; c0 < kend; c0 += SY_AMX_KEY_CHUNK) {
        const int quarters = kend - c0 >= SY_AMX_KEY_CHUNK ? 4 : (int)((kend - c0 + 15) / 16);
        for (int qq = 0; qq < quarters; qq++) {
            const uint16_t *k = cache_row(kc, table, a->num_blocks, a->block_size, a->sb, a->so, c0 + 16 * qq);
            if (!k) return 1;
#define S_ZERO(i) _tile_zero(i)
            ON_TILE(qq, S_ZERO)
            for (int d0 = 0; d0 < D; d0 += 32) {
                _tile_loadd(4, k + d0, a->so * 2);
                _tile_loadd(5, qt + d0 * UNIT_QUERIES, 64);
#define S_DP(i) _tile_dpbf16ps(i, 4, 5)
                ON_TILE(qq, S_DP)
            }
        }
        for (int qq = 0; qq < quarters; qq++) {
#define S_STORE(i) _tile_stored(i, s + (i) * 16 * UNIT_QUERIES, 64)
            ON_TILE(qq, S_STORE)
        }
        /* row r is position c0 + r for the 16 queries; query i sees positions <= q_pos0 + i */
        const int live = (int)(kend - c0 < SY_AMX_KEY_CHUNK ? kend - c0 : SY_AMX_KEY_CHUNK);
        __m512 row_max = neg_inf;
        for (int r = 0; r < live; r++) {
            const int64_t pos = c0 + r;
            __m512 x = _mm512_mul_ps(_mm512_load_ps(s + r * 16), scale);
            if (pos > q_pos0) {
                const __mmask16 future = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32((int)(pos - q_pos0)));
                x = _mm512_mask_mov_ps(x, future, neg_inf);
            }
            _mm512_store_ps(s + r * 16, x);
            row_max = _mm512_max_ps(row_max, x);
        }
        for (int r = live; r < SY_AMX_KEY_CHUNK; r++) _mm512_store_ps(s + r * 16, neg_inf); /* past every query */
        const __m512 m_new = _mm512_max_ps(m, row_max); /* finite: position 0 is in every query's first chunk */
        const __m512 alpha = exp_nonpos(_mm512_sub_ps(m, m_new));
        m = m_new;
        __m512 sum = _mm512_setzero_ps();
        for (int r = 0; r < SY_AMX_KEY_CHUNK; r += 2) {
            const __m512 e0 = exp_nonpos(_mm512_sub_ps(_mm512_load_ps(s + r * 16), m));
            const __m512 e1 = exp_nonpos(_mm512_sub_ps(_mm512_load_ps(s + (r + 1) * 16), m));
            sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
            store_pairs(pt + r * UNIT_QUERIES, e0, e1);
        }
        l = _mm512_fmadd_ps(l, alpha, sum);
        const int rescale = _mm512_cmpneq_ps_mask(alpha, _mm512_set1_ps(1.0f)) != 0;
        _tile_loadd(5, pt, 64);
        _tile_loadd(6, pt + 32 * UNIT_QUERIES, 64);
        for (int g0 = 0; g0 < D; g0 += 64) { /* four 16-d blocks at a time, in tiles 0-3 */
            const int blocks = D - g0 < 64 ? (D - g0) / 16 : 4;
            for (int db = 0; db < blocks; db++) {
                const uint16_t *v = vt + (int64_t)(g0 + 16 * db) * vts + c0;
#define PV_DP(i)                                                                                                 \
    do {                                                                                                         \
        _tile_zero(i);                                                                                           \
        _tile_loadd(4, v, vts * 2);                                                                              \
        _tile_dpbf16ps(i, 4, 5);                                                                                        \
        _tile_loadd(4, v + 32, vts * 2);                                                                         \
        _tile_dpbf16ps(i, 4, 6);                                                                                        \
    } while (0)
                ON_TILE(db, PV_DP)
            }
            for (int db = 0; db < blocks; db++) {
#define PV_STORE(i) _tile_stored(i, pv + (i) * 16 * UNIT_QUERIES, 64)
                ON_TILE(db, PV_STORE)
            }
            for (int r = 0; r < 16 * blocks; r++) {
                float *od = o + (g0 + r) * UNIT_QUERIES;
                const __m512 prev = _mm512_load_ps(od), add = _mm512_load_ps(pv + r * 16);
                _mm512_store_ps(od, rescale ? _mm512_fmadd_ps(prev, alpha, add) : _mm512_add_ps(prev, add));
            }
        }
    }
    /* out[token][hq][d] = O^T[d][token] / l, rounded to bf16 */
    float inv[UNIT_QUERIES] __attribute__((aligned(64)));
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l));
    const __m512i down = _mm512_mullo_epi32(lane, _mm512_set1_epi32(UNIT_QUERIES));
    for (int i = 0; i < rows; i++) {
        uint16_t *dst = a->out + ((row0 + i) * a->Hq + hq) * D;
        const __m512 w = _mm512_set1_ps(inv[i]);
        for (int d0 = 0; d0 < D; d0 += 16) {
            const __m512 col = _mm512_i32gather_ps(down, o + d0 * UNIT_QUERIES + i, 4);
            _mm256_storeu_si256((__m256i *)(dst + d0), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(col, w)));
        }
    }
    return 0;
}
#undef S_ZERO
#undef S_DP
#undef S_STORE
#undef PV_DP
#undef PV_STORE

int sy_amx_prefill_attention_bf16(const uint16_t *q, int64_t q_st, int64_t q_sh, float scale, const uint16_t *k_cache,
                                  const uint16_t *v_cache, int64_t sb, int64_t so, int64_t sh, int64_t num_blocks,
                                  int block_size, const int32_t *tables, int64_t table_stride, int64_t table_width,
                                  const int32_t *cu, const int32_t *lens, int P, int Hq, int Hkv, int D, uint16_t *out,
                                  uint16_t *vt, int64_t vt_capacity, int64_t *vt_off, int threads) {
    if (D % 32 || D > SY_MAX_HEAD_DIM || block_size % 16 || Hkv <= 0 || Hq % Hkv || sh != D || !sy_amx_ready())
        return 2;
    int64_t total = 0, units = 0;
    for (int p = 0; p < P; p++) {
        const int64_t len = lens[p], n_new = (int64_t)cu[p + 1] - cu[p];
        if (n_new < 0 || n_new > len || (len + block_size - 1) / block_size > table_width) return 3;
        vt_off[p] = total;
        total += vt_len(len) * Hkv * D;
        units += (n_new + UNIT_QUERIES - 1) / UNIT_QUERIES * Hq;
    }
    if (total > vt_capacity) return 3;
    if (P <= 0 || units == 0) return 0;
    const prefill_args a = {q, k_cache, q_st, q_sh, sb, so, num_blocks, table_stride, scale, block_size, Hq, Hkv, D,
                            tables, cu, lens, vt, vt_off, out};
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(| : bad)
    for (int64_t ph = 0; ph < (int64_t)P * Hkv; ph++) {
        const int p = (int)(ph / Hkv), h = (int)(ph % Hkv);
        bad |= repack_vt(v_cache + (int64_t)h * D, tables + (int64_t)p * table_stride, num_blocks, block_size, sb, so,
                         lens[p], D, vt + vt_off[p] + (int64_t)h * D * vt_len(lens[p]));
    }
    if (bad) return 1;
#pragma omp parallel num_threads(threads) reduction(| : bad)
    {
        configure_tiles();
        /* units walk each sequence's query blocks from its last (the longest rows) to its first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++) {
            int64_t rest = u;
            int p = 0;
            for (;; p++) {
                const int64_t n = (int64_t)((cu[p + 1] - cu[p]) + UNIT_QUERIES - 1) / UNIT_QUERIES * Hq;
                if (rest < n) break;
                rest -= n;
            }
            const int n_new = cu[p + 1] - cu[p], blocks = (n_new + UNIT_QUERIES - 1) / UNIT_QUERIES;
            const int qb = blocks - 1 - (int)(rest / Hq), hq = (int)(rest % Hq);
            const int t0 = qb * UNIT_QUERIES, rows = n_new - t0 < UNIT_QUERIES ? n_new - t0 : UNIT_QUERIES;
            bad |= unit(&a, p, hq, t0, rows);
        }
        _tile_release();
    }
    return bad;
}
#else
int sy_amx_prefill_attention_bf16(const uint16_t *q, int64_t q_st, int64_t q_sh, float scale, const uint16_t *k_cache,
                                  const uint16_t *v_cache, int64_t sb, int64_t so, int64_t sh, int64_t num_blocks,
                                  int block_size, const int32_t *tables, int64_t table_stride, int64_t table_width,
                                  const int32_t *cu, const int32_t *lens, int P, int Hq, int Hkv, int D, uint16_t *out,
                                  uint16_t *vt, int64_t vt_capacity, int64_t *vt_off, int threads) {
    (void)q, (void)q_st, (void)q_sh, (void)scale, (void)k_cache, (void)v_cache, (void)sb, (void)so, (void)sh,
        (void)num_blocks, (void)block_size, (void)tables, (void)table_stride, (void)table_width, (void)cu, (void)lens,
        (void)P, (void)Hq, (void)Hkv, (void)D, (void)out, (void)vt, (void)vt_capacity, (void)vt_off, (void)threads;
    return 2;
}
#endif
