/* CPU kernels for the engine's memory-bound hot paths, compiled at first use by kernels/cpu_native.py:
 *   sy_decode_attention  paged decode attention, each cached K/V row read once (fp32 or bf16 cache)
 *   sy_prefill_attention paged causal attention of new tokens over their cached prefix and themselves
 *   sy_linear_f32        y = x W^T (+ b) for a few rows of x, streaming W once in memory order
 *   sy_pack_panels_f32   W [N, K] -> column panels for sy_gemm_panels_f32
 *   sy_gemm_panels_f32   y = x W^T (+ b) for any number of rows, from the panels (register-tiled, prefetching)
 *   sy_rotary_f32        HF rotate_half rotary embedding of q and k into new contiguous tensors
 *   sy_store_kv_f32      scatter new K/V rows into their cache slots
 *   sy_rms_norm_f32      RMSNorm fused with the residual add
 *   sy_silu_mul_f32      silu(gate) * up from the fused gate_up projection
 * Math is fp32. Parallel loops use the OpenMP runtime torch itself loaded (the same libgomp.so.1), so
 * they share torch's threads. Written for GCC >= 12 / clang vector extensions; any failure to build
 * makes the engine fall back to the torch reference. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "switchyard_kernels.h" /* the declared interface: prototypes, shared structs and constants */
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float v16 __attribute__((vector_size(64), aligned(4))); /* 16 floats; unaligned loads allowed */
typedef int32_t i16 __attribute__((vector_size(64)));

/* Two-vector lane shuffle: clang and GCC >= 12 have __builtin_shufflevector, older GCC __builtin_shuffle. */
#if defined(__has_builtin) && !defined(SY_USE_BUILTIN_SHUFFLE)
#if __has_builtin(__builtin_shufflevector)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#endif
#endif
#ifndef SHUF
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (i16){__VA_ARGS__})
#endif

#define MAX_CHUNKS 16       /* parts one sequence's attention is split into across threads */

static inline v16 ld(const float *p) { return *(const v16 *)p; }
#ifdef __AVX512F__
#include <immintrin.h>
#endif
/* 16 bf16 values widened to fp32 (exact: a bf16 is the top half of an fp32) */
static inline v16 ld_bf16(const uint16_t *p) {
#ifdef __AVX512F__
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (v16)_mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
#else
    uint32_t u[16];
    for (int i = 0; i < 16; i++) u[i] = (uint32_t)p[i] << 16;
    v16 r;
    memcpy(&r, u, sizeof(r));
    return r;
#endif
}

/* Lane sums of 16 vectors: out[t] = sum_i a[t][i], by a shuffle tree (30 shuffles + 15 adds). */
static inline v16 transpose_sum16(const v16 *a) {
    v16 c[8], d[4], e[2];
    for (int i = 0; i < 8; i++)
        c[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUF(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        d[i] = SHUF(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SHUF(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        e[i] = SHUF(d[2 * i], d[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SHUF(d[2 * i], d[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUF(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUF(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

#include "cpu_exp.h" /* EXP_NONPOS_BODY */

#ifdef __AVX512F__
static inline v16 exp_nonpos16(v16 x) { EXP_NONPOS_BODY(v16, i16); }
#else
/* Without AVX-512 the 16-lane compare above is lowered lane by lane (a scalar compare and cmov each, the
 * hottest lines of decode_seq in perf on Zen 3); two 8-lane halves use AVX2's vector compare (in-cache decode
 * attention ~10% faster; through DRAM within noise). */
typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));
static inline v8f exp_nonpos8(v8f x) { EXP_NONPOS_BODY(v8f, v8i); }
static inline v16 exp_nonpos16(v16 x) {
    v8f half[2];
    memcpy(half, &x, sizeof(x));
    half[0] = exp_nonpos8(half[0]);
    half[1] = exp_nonpos8(half[1]);
    memcpy(&x, half, sizeof(x));
    return x;
}
#endif
#undef EXP_NONPOS_BODY

/* A block's rows [block_size, Hkv, D] as fp32: the cache itself for fp32, else converted into buf. */
static inline const float *block_rows(const void *cache, int is_bf16, int64_t blk, int64_t sb, int64_t so,
                                      int64_t sh, int n, int Hkv, int D, float *buf, int64_t *row_stride,
                                      int64_t *head_stride) {
    if (!is_bf16) {
        *row_stride = so;
        *head_stride = sh;
        return (const float *)cache + blk * sb;
    }
    const uint16_t *src = (const uint16_t *)cache + blk * sb;
    for (int o = 0; o < n; o++)
        for (int h = 0; h < Hkv; h++) {
            const uint16_t *s = src + o * so + h * sh;
            uint32_t *d = (uint32_t *)(buf + ((int64_t)o * Hkv + h) * D);
            for (int i = 0; i < D; i++) d[i] = (uint32_t)s[i] << 16;
        }
    *row_stride = (int64_t)Hkv * D;
    *head_stride = D;
    return buf;
}

/* Ask for a block's rows: one block ahead of use, into L1 (prefetcht0), because blocks sit at random places in the
 * pool, too short and too far apart for the hardware prefetchers to follow (measured ~12% faster than into L2 at
 * batch 64; further ahead was slower). into_l2 (prefetcht1) is for asking for a whole unit's rows up front, which
 * would not fit in L1 (decode_seq's ask_all). */
static inline void prefetch_block(const void *cache, int elem, int64_t blk, int64_t sb, int64_t so, int64_t sh,
                                  int n, int Hkv, int D, int into_l2) {
    const char *base = (const char *)cache + blk * sb * elem;
    for (int o = 0; o < n; o++)
        for (int h = 0; h < Hkv; h++) {
            const char *row = base + (o * so + h * sh) * elem;
            for (int c = 0; c < D * elem; c += 64) {
                if (into_l2) __builtin_prefetch(row + c, 0, 2); /* the hint must be a constant */
                else __builtin_prefetch(row + c, 0, 3);
            }
        }
}

/* The two inner loops of decode attention, for a tile of GT query heads sharing one kv head, with head_dim
 * = 16 * CH. Called with literal GT and CH (see the dispatchers) so that, inlined, the q vectors and the
 * accumulators live in registers and every token offers GT * CH independent FMAs. */
#define MAX_GT 4
#define MAX_CH 16

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* AVX2 (16 256-bit registers): the 16-float tiles above spill there (prefill attention ran at ~8 GFLOP/s on Zen
 * 3, decode attention over 64 x 384 tokens read its KV at ~4 GB/s), so these take one query head at a time,
 * 8 tokens' dot products at once reduced by one 8 x 8 transpose-add, and values in passes of 64 dims. */

/* the 8 horizontal sums of p[0..7], in order */
static inline __m256 hsum8(const __m256 *p) {
    const __m256 h01 = _mm256_hadd_ps(p[0], p[1]), h23 = _mm256_hadd_ps(p[2], p[3]);
    const __m256 h45 = _mm256_hadd_ps(p[4], p[5]), h67 = _mm256_hadd_ps(p[6], p[7]);
    const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

static inline __attribute__((always_inline)) void qk_tile(const float *q, int64_t q_sh, const float *k, int64_t rs,
                                                          int m, int GT, int CH, float scale, float *scores,
                                                          int64_t ld_s) {
    if (CH < 1) __builtin_unreachable();
    const int C8 = 2 * CH;
    for (int g = 0; g < GT; g++) {
        const float *qg = q + g * q_sh;
        for (int t0 = 0; t0 < m; t0 += 8) {
            const int mt = m - t0 < 8 ? m - t0 : 8;
            __m256 p[8];
            for (int t = 0; t < 8; t++) p[t] = _mm256_setzero_ps();
            for (int c = 0; c < C8; c++) {
                const __m256 qc = _mm256_loadu_ps(qg + 8 * c);
                for (int t = 0; t < 8; t++)
                    if (t < mt) p[t] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + (t0 + t) * rs + 8 * c), p[t]);
            }
            float out[8];
            _mm256_storeu_ps(out, _mm256_mul_ps(hsum8(p), _mm256_set1_ps(scale)));
            memcpy(scores + g * ld_s + t0, out, sizeof(float) * mt);
        }
    }
}

static inline __attribute__((always_inline)) void pv_tile(const float *p, int64_t ld_s, const float *v, int64_t rs,
                                                          int n, int GT, int CH, float *acc, int D) {
    const int C8 = 2 * CH;
    for (int g = 0; g < GT; g++)
        for (int c0 = 0; c0 < C8; c0 += 8) {
            const int nc = C8 - c0 < 8 ? C8 - c0 : 8;
            float *ag = acc + g * D + 8 * c0;
            __m256 a[8];
            for (int c = 0; c < 8; c++) a[c] = c < nc ? _mm256_loadu_ps(ag + 8 * c) : _mm256_setzero_ps();
            for (int t = 0; t < n; t++) {
                const __m256 w = _mm256_set1_ps(p[g * ld_s + t]);
                const float *vt = v + t * rs + 8 * c0;
                for (int c = 0; c < 8; c++)
                    if (c < nc) a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8 * c), a[c]);
            }
            for (int c = 0; c < nc; c++) _mm256_storeu_ps(ag + 8 * c, a[c]);
        }
}
#else
/* The tiles below read K/V rows of type KT through LOAD (fp32, or a bf16 cache widened in registers: no
 * converted copy of the block, which took a quarter of decode attention's time over a bf16 cache). */
#define DIRECT_BF16_TILES 1
/* scores[g * ld_s + t] = scale * q_g . k_t for the m (<= 16) tokens at k, k + rs, ... */
#define QK_TILE(NAME, KT, LOAD)                                                                                  \
    static inline __attribute__((always_inline)) void NAME(const float *q, int64_t q_sh, const KT *k, int64_t rs,  \
                                                           int m, int GT, int CH, float scale, float *scores,   \
                                                           int64_t ld_s) {                                     \
        if (CH < 1) __builtin_unreachable(); /* head_dim >= 16, checked at entry */                              \
        v16 qv[MAX_GT][MAX_CH], part[MAX_GT][16];                                                                \
        for (int g = 0; g < GT; g++)                                                                             \
            for (int c = 0; c < CH; c++) qv[g][c] = ld(q + g * q_sh + 16 * c);                                   \
        for (int t = 0; t < 16; t++) {                                                                           \
            if (t < m) {                                                                                         \
                v16 kv[MAX_CH];                                                                                  \
                for (int c = 0; c < CH; c++) kv[c] = LOAD(k + t * rs + 16 * c);                                  \
                for (int g = 0; g < GT; g++) {                                                                   \
                    v16 a = qv[g][0] * kv[0];                                                                    \
                    for (int c = 1; c < CH; c++) a += qv[g][c] * kv[c];                                          \
                    part[g][t] = a;                                                                              \
                }                                                                                                \
            } else {                                                                                             \
                for (int g = 0; g < GT; g++) part[g][t] = (v16){0};                                              \
            }                                                                                                    \
        }                                                                                                        \
        for (int g = 0; g < GT; g++) {                                                                           \
            const v16 sc = transpose_sum16(part[g]) * scale;                                                     \
            memcpy(scores + g * ld_s, &sc, sizeof(float) * m);                                                   \
        }                                                                                                        \
    }
QK_TILE(qk_tile, float, ld)
QK_TILE(qk_tile_bf16, uint16_t, ld_bf16)
#undef QK_TILE

/* acc[g * D + 16c ...] += sum_t p[g * ld_s + t] * v_t over the n tokens at v, v + rs, ... */
#define PV_TILE(NAME, VT, LOAD)                                                                                  \
    static inline __attribute__((always_inline)) void NAME(const float *p, int64_t ld_s, const VT *v, int64_t rs, \
                                                           int n, int GT, int CH, float *acc, int D) {         \
        v16 a[MAX_GT][MAX_CH];                                                                                   \
        for (int g = 0; g < GT; g++)                                                                             \
            for (int c = 0; c < CH; c++) a[g][c] = ld(acc + g * D + 16 * c);                                     \
        for (int t = 0; t < n; t++) {                                                                            \
            v16 vv[MAX_CH];                                                                                      \
            for (int c = 0; c < CH; c++) vv[c] = LOAD(v + t * rs + 16 * c);                                      \
            for (int g = 0; g < GT; g++) {                                                                       \
                const float w = p[g * ld_s + t];                                                                 \
                for (int c = 0; c < CH; c++) a[g][c] += w * vv[c];                                               \
            }                                                                                                    \
        }                                                                                                        \
        for (int g = 0; g < GT; g++)                                                                             \
            for (int c = 0; c < CH; c++) *(v16 *)(acc + g * D + 16 * c) = a[g][c];                               \
    }
PV_TILE(pv_tile, float, ld)
PV_TILE(pv_tile_bf16, uint16_t, ld_bf16)
#undef PV_TILE
#endif

/* Query-head tile per head_dim: 4 heads at D = 64, 2 at D = 128 (16 accumulators), else 1 (generic code).
 * With 16 256-bit registers instead of 32 512-bit ones, one head at D >= 64 (a 3-head tile at D = 64 spilled
 * its accumulators every token). */
#if defined(__AVX512F__) || defined(SY_WIDE_ATTENTION_TILES)
static inline int tile_of(int CH) { return CH <= 4 ? MAX_GT : CH <= 8 ? 2 : 1; }
#else
static inline int tile_of(int CH) { return CH <= 2 ? 2 : 1; }
#endif

#define QK_DISPATCH(NAME, TILE, KT)                                                                              \
    static void NAME(const float *q, int64_t q_sh, const KT *k, int64_t rs, int m, int gt, int CH, float scale,  \
                     float *scores, int64_t ld_s) {                                                              \
        if (CH == 4) {                                                                                           \
            switch (gt) {                                                                                        \
            case 1: TILE(q, q_sh, k, rs, m, 1, 4, scale, scores, ld_s); return;                                  \
            case 2: TILE(q, q_sh, k, rs, m, 2, 4, scale, scores, ld_s); return;                                  \
            case 3: TILE(q, q_sh, k, rs, m, 3, 4, scale, scores, ld_s); return;                                  \
            default: TILE(q, q_sh, k, rs, m, 4, 4, scale, scores, ld_s); return;                                 \
            }                                                                                                    \
        }                                                                                                        \
        if (CH == 8) {                                                                                           \
            if (gt == 1) TILE(q, q_sh, k, rs, m, 1, 8, scale, scores, ld_s);                                     \
            else TILE(q, q_sh, k, rs, m, 2, 8, scale, scores, ld_s);                                             \
            return;                                                                                              \
        }                                                                                                        \
        for (int g = 0; g < gt; g++) TILE(q + g * q_sh, q_sh, k, rs, m, 1, CH, scale, scores + g * ld_s, ld_s);  \
    }
#define PV_DISPATCH(NAME, TILE, VT)                                                                              \
    static void NAME(const float *p, int64_t ld_s, const VT *v, int64_t rs, int n, int gt, int CH, float *acc,   \
                     int D) {                                                                                    \
        if (CH == 4) {                                                                                           \
            switch (gt) {                                                                                        \
            case 1: TILE(p, ld_s, v, rs, n, 1, 4, acc, D); return;                                               \
            case 2: TILE(p, ld_s, v, rs, n, 2, 4, acc, D); return;                                               \
            case 3: TILE(p, ld_s, v, rs, n, 3, 4, acc, D); return;                                               \
            default: TILE(p, ld_s, v, rs, n, 4, 4, acc, D); return;                                              \
            }                                                                                                    \
        }                                                                                                        \
        if (CH == 8) {                                                                                           \
            if (gt == 1) TILE(p, ld_s, v, rs, n, 1, 8, acc, D);                                                  \
            else TILE(p, ld_s, v, rs, n, 2, 8, acc, D);                                                          \
            return;                                                                                              \
        }                                                                                                        \
        for (int g = 0; g < gt; g++) TILE(p + g * ld_s, ld_s, v, rs, n, 1, CH, acc + g * D, D);                 \
    }
QK_DISPATCH(qk_dispatch, qk_tile, float)
PV_DISPATCH(pv_dispatch, pv_tile, float)
#ifdef DIRECT_BF16_TILES
QK_DISPATCH(qk_dispatch_bf16, qk_tile_bf16, uint16_t)
PV_DISPATCH(pv_dispatch_bf16, pv_tile_bf16, uint16_t)
#endif
#undef QK_DISPATCH
#undef PV_DISPATCH

/* This thread's row of a [threads, stride] scratch buffer. */
static inline float *thread_scratch(float *scratch, int64_t stride) {
#ifdef _OPENMP
    return scratch + (int64_t)omp_get_thread_num() * stride;
#else
    (void)stride;
    return scratch;
#endif
}

/* max of s[0 .. n), n a positive multiple of 16 */
static inline float row_max16(const float *s, int n) {
#if !defined(__AVX512F__) && defined(__AVX2__)
    /* the 16-lane compare-and-select below became lane-by-lane inserts on AVX2 (~10% of decode attention) */
    __m256 m0 = _mm256_loadu_ps(s), m1 = _mm256_loadu_ps(s + 8);
    for (int t = 16; t < n; t += 16) {
        m0 = _mm256_max_ps(_mm256_loadu_ps(s + t), m0);
        m1 = _mm256_max_ps(_mm256_loadu_ps(s + t + 8), m1);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
    float mx = lanes[0];
    for (int i = 1; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
    return mx;
#else
    v16 mv = ld(s);
    for (int t = 16; t < n; t += 16) {
        const v16 x = ld(s + t);
        mv = (v16)(((i16)(x > mv) & (i16)x) | ((i16)(x <= mv) & (i16)mv));
    }
    float mx = mv[0];
    for (int i = 1; i < 16; i++) mx = mv[i] > mx ? mv[i] : mx;
    return mx;
#endif
}

/* Decode attention for one sequence and all its heads, every cached K/V row read once in block order.
 * q: head j at q + j * q_sh (fp32, contiguous D); scores are scaled by `scale`; out: [Hq, D] contiguous;
 * scores: [Hq, round_up(len, 16)] scratch. D % 16 == 0, D <= 16 * MAX_CH. stats (NULL or [Hq][2]) gets each
 * head's score maximum and sum of exp(score - maximum), for merging attention over parts of a sequence.
 * ask_all: a unit of a few sequences' attention: ask for all its K and V rows (up to ASK_ALL_MAX_BLOCKS blocks)
 * before the first dot product. Such a unit is latency-bound, not bandwidth-bound: with only the next block
 * asked for, each thread read its KV at ~8 GB/s while the weight streams beside it ran at 17. Batch-1 attention
 * per layer on a Zen 4 EPYC (2 vCPUs, SmolLM2 int8, ~384 cached tokens), medians of 6 alternated pairs each:
 * 40.2 -> 36.9 us over an fp32 cache, 24.8 -> 21.3 us over bf16 (10 of the 12 pairs faster, one level, one
 * slower).
 * Returns 0, or 1 if a block id is out of range (nothing is read from it). */
/* Block i's scores (QK_BLOCK) or its values' share of acc (PV_BLOCK) in decode_seq, from rows of fp32 or of a bf16
 * cache (the matching dispatcher) with row stride RS and head stride HS, in elements. */
#define QK_BLOCK(DISPATCH, KEYS, RS, HS)                                                                         \
    do {                                                                                                         \
        const __typeof__(KEYS) keys_ = (KEYS);                                                                   \
        for (int t0 = 0; t0 < n; t0 += 16) {                                                                     \
            const int m = n - t0 < 16 ? n - t0 : 16;                                                             \
            for (int h = 0; h < Hkv; h++)                                                                        \
                for (int g0 = 0; g0 < G; g0 += GT) {                                                             \
                    const int j = h * G + g0, gt = G - g0 < GT ? G - g0 : GT;                                    \
                    DISPATCH(q + (int64_t)j * q_sh, q_sh, keys_ + t0 * (RS) + h * (HS), RS, m, gt, CH, scale,    \
                             scores + (int64_t)j * ld_s + i * block_size + t0, ld_s);                           \
                }                                                                                                \
        }                                                                                                        \
    } while (0)
#define PV_BLOCK(DISPATCH, VALUES, RS, HS)                                                                       \
    do {                                                                                                         \
        const __typeof__(VALUES) values_ = (VALUES);                                                             \
        for (int h = 0; h < Hkv; h++)                                                                            \
            for (int g0 = 0; g0 < G; g0 += GT) {                                                                 \
                const int j = h * G + g0, gt = G - g0 < GT ? G - g0 : GT;                                        \
                DISPATCH(scores + (int64_t)j * ld_s + i * block_size, ld_s, values_ + h * (HS), RS, n, gt, CH,   \
                         acc + (int64_t)j * D, D);                                                               \
            }                                                                                                    \
    } while (0)

#define ASK_ALL_MAX_BLOCKS 16 /* 16 fp32 blocks of K and V at SmolLM2's shape: 384 KB, well inside L2 */
static int decode_seq(const float *q, int64_t q_sh, float scale, const void *kc, const void *vc, int is_bf16,
                      int64_t sb, int64_t so, int64_t sh, const int32_t *table, int64_t num_blocks, int block_size,
                      int len, int Hq, int Hkv, int D, float *scores, float *out, float *stats,
                      int ask_all, int64_t tree_mask, int64_t tree_off) {
    float acc[SY_MAX_Q_HEADS * SY_MAX_HEAD_DIM] __attribute__((aligned(64)));
    float conv[SY_MAX_BLOCK_ROW] __attribute__((aligned(64)));
    const int G = Hq / Hkv, CH = D / 16, GT = tile_of(CH);
    const int nblk = (len + block_size - 1) / block_size, ld_s = (len + 15) & ~15;
    for (int i = 0; i < nblk; i++)
        if (table[i] < 0 || table[i] >= num_blocks) return 1;

    const int elem = is_bf16 ? 2 : 4;
#define NEXT_ROWS(i) (len - (i) * block_size < block_size ? len - (i) * block_size : block_size)
    if (ask_all && nblk <= ASK_ALL_MAX_BLOCKS) {
        for (int i = 0; i < nblk; i++) prefetch_block(kc, elem, table[i], sb, so, sh, NEXT_ROWS(i), Hkv, D, 1);
        for (int i = 0; i < nblk; i++) prefetch_block(vc, elem, table[i], sb, so, sh, NEXT_ROWS(i), Hkv, D, 1);
    }
    /* scores[j, t] = scale * q_j . k_t, 16 tokens at a time. */
    prefetch_block(kc, elem, table[0], sb, so, sh, NEXT_ROWS(0), Hkv, D, 0);
    for (int i = 0; i < nblk; i++) {
        const int n = NEXT_ROWS(i);
        if (i + 1 < nblk) prefetch_block(kc, elem, table[i + 1], sb, so, sh, NEXT_ROWS(i + 1), Hkv, D, 0);
#ifdef DIRECT_BF16_TILES
        if (is_bf16) {
            QK_BLOCK(qk_dispatch_bf16, (const uint16_t *)kc + table[i] * sb, so, sh);
            continue;
        }
#endif
        int64_t rs, hs;
        const float *k = block_rows(kc, is_bf16, table[i], sb, so, sh, n, Hkv, D, conv, &rs, &hs);
        QK_BLOCK(qk_dispatch, k, rs, hs);
    }
    prefetch_block(vc, elem, table[0], sb, so, sh, NEXT_ROWS(0), Hkv, D, 0);
    /* softmax over t, per head; the score rows are padded to a multiple of 16 (pad: -inf -> exp 0) */
    float inv[SY_MAX_Q_HEADS];
    /* a tree row: positions t + tree_off >= 0 of its verify group only where their bit is set (at most 64) */
    const int tree_from = tree_mask == -1 ? len : tree_off >= 0 ? 0 : -tree_off < len ? (int)-tree_off : len;
    for (int j = 0; j < Hq; j++) {
        float *sj = scores + (int64_t)j * ld_s;
        for (int t = len; t < ld_s; t++) sj[t] = -INFINITY;
        for (int t = tree_from; t < len; t++) {
            const int64_t bit = t + tree_off;
            if (bit >= 64 || !(((uint64_t)tree_mask >> bit) & 1)) sj[t] = -INFINITY;
        }
        const float mx = row_max16(sj, ld_s);
        if (mx == -INFINITY) { /* every position masked (a part of tree positions only): no weight, no NaN */
            memset(sj, 0, sizeof(float) * ld_s);
            inv[j] = 0.0f;
            if (stats) stats[2 * j] = -INFINITY, stats[2 * j + 1] = 0.0f;
            continue;
        }
        v16 sum = {0};
        for (int t = 0; t < ld_s; t += 16) {
            const v16 e = exp_nonpos16(ld(sj + t) - mx);
            *(v16 *)(sj + t) = e;
            sum += e;
        }
        float total = 0.0f;
        for (int i = 0; i < 16; i++) total += sum[i];
        inv[j] = 1.0f / total;
        if (stats) stats[2 * j] = mx, stats[2 * j + 1] = total;
    }
    /* out_j = sum_t p[j, t] v_t / sum_t p[j, t] */
    memset(acc, 0, sizeof(float) * Hq * D);
    for (int i = 0; i < nblk; i++) {
        const int n = NEXT_ROWS(i);
        if (i + 1 < nblk) prefetch_block(vc, elem, table[i + 1], sb, so, sh, NEXT_ROWS(i + 1), Hkv, D, 0);
#ifdef DIRECT_BF16_TILES
        if (is_bf16) {
            PV_BLOCK(pv_dispatch_bf16, (const uint16_t *)vc + table[i] * sb, so, sh);
            continue;
        }
#endif
        int64_t rs, hs;
        const float *v = block_rows(vc, is_bf16, table[i], sb, so, sh, n, Hkv, D, conv, &rs, &hs);
        PV_BLOCK(pv_dispatch, v, rs, hs);
    }
    for (int j = 0; j < Hq; j++)
        for (int d = 0; d < D; d++) out[(int64_t)j * D + d] = acc[(int64_t)j * D + d] * inv[j];
    return 0;
#undef NEXT_ROWS
}
#undef QK_BLOCK
#undef PV_BLOCK

/* How decode attention is cut into work units: whole sequences; with fewer sequences than a few per thread,
 * (sequence, kv head) pairs, and with fewer of those than two per thread, each pair's blocks in `chunks` parts
 * merged afterwards -- at batch 1 one sequence on one thread left the other cores idle through every layer's
 * attention. With fewer sequences than two per thread the heads stay together and only the blocks are cut: a
 * block's rows hold every kv head side by side, so a unit of one head read a third of each row's bytes (at
 * SmolLM2's 3 kv heads) and the units of the other heads, on the other core, the lines beside them. Batch 1 on
 * a Zen 4 EPYC (2 vCPUs), int8, 384 tokens of fp32 cache: 53-56 -> 37-45 us of attention per layer. */
typedef struct {
    int split, per_seq, G, pairs, chunks, heads;
    int64_t part_floats; /* per unit when chunks > 1: [heads][D] normalised partial outputs, then [heads][2] stats */
} attn_plan;

static attn_plan plan_attention(int B, int Hq, int Hkv, int D, int threads) {
    attn_plan pl;
    pl.split = B >= 2 * threads && B < 4 * threads && Hkv > 1;
    pl.per_seq = pl.split ? Hkv : 1;
    pl.G = Hq / Hkv;
    pl.pairs = B * pl.per_seq;
    pl.chunks = pl.pairs < 2 * threads ? (2 * threads + pl.pairs - 1) / pl.pairs : 1;
    pl.chunks = pl.chunks > MAX_CHUNKS ? MAX_CHUNKS : pl.chunks;
    pl.heads = pl.split ? pl.G : Hq;
    pl.part_floats = (int64_t)pl.heads * (D + 2);
    return pl;
}

/* Floats of the `parts` buffer a decode attention over B sequences needs (0: none). */
int64_t sy_decode_attention_parts(int B, int Hq, int Hkv, int D, int threads) {
    const attn_plan pl = plan_attention(B, Hq, Hkv, D, threads);
    return pl.chunks > 1 ? pl.part_floats * pl.pairs * pl.chunks : 0;
}

/* The arguments of one decode attention (see sy_decode_attention). */
typedef struct {
    const float *q;
    int64_t q_sb, q_sh;
    float scale;
    const void *k_cache, *v_cache;
    int is_bf16;
    int64_t sb, so, sh, num_blocks;
    int block_size;
    const int32_t *tables;
    int64_t table_stride;
    const int32_t *lens;
    const int64_t *tree_masks; /* NULL: every row plain */
    const int32_t *tree_starts;
    int Hq, Hkv, D;
    float *out, *scratch, *parts;
    int64_t scratch_stride;
} attn_args;

/* One work unit: its pair's blocks [first, last) into out (chunks == 1) or its part. Returns decode_seq's code. */
static int attention_unit(const attn_plan *pl, const attn_args *a, int unit) {
    const int pair = unit / pl->chunks, c = unit % pl->chunks, b = pair / pl->per_seq, h = pair % pl->per_seq;
    const int G = pl->G, D = a->D, heads = pl->heads, block_size = a->block_size;
    const float *qb = a->q + (int64_t)b * a->q_sb + (int64_t)h * G * a->q_sh;
    const int len = a->lens[b] > 0 ? a->lens[b] : 0, nblk = (len + block_size - 1) / block_size;
    const int first = (int)((int64_t)nblk * c / pl->chunks), last = (int)((int64_t)nblk * (c + 1) / pl->chunks);
    const int part_len = last * block_size < len ? (last - first) * block_size : len - first * block_size;
    float *ob = a->parts ? a->parts + unit * pl->part_floats : a->out + (int64_t)b * a->Hq * D + (int64_t)h * G * D;
    float *stats = a->parts ? ob + (int64_t)heads * D : NULL;
    if (part_len <= 0) {
        memset(ob, 0, sizeof(float) * heads * D);
        for (int j = 0; stats && j < heads; j++) stats[2 * j] = -INFINITY, stats[2 * j + 1] = 0.0f;
        return 0;
    }
    float *scores = thread_scratch(a->scratch, a->scratch_stride);
    const int64_t elem = a->is_bf16 ? 2 : 4;
    /* one kv head: the caches from that head on, as if they held only it */
    const char *kc = (const char *)a->k_cache + h * a->sh * elem, *vc = (const char *)a->v_cache + h * a->sh * elem;
    const int64_t mask = a->tree_masks ? a->tree_masks[b] : -1;
    const int64_t off = mask == -1 ? 0 : (int64_t)first * block_size - a->tree_starts[b];
    return decode_seq(qb, a->q_sh, a->scale, kc, vc, a->is_bf16, a->sb, a->so, a->sh,
                      a->tables + (int64_t)b * a->table_stride + first, a->num_blocks, block_size, part_len, heads,
                      pl->split ? 1 : a->Hkv, D, scores, ob, stats, pl->chunks > 1, mask, off);
}

/* A pair's attention over the whole sequence from its parts: part c weighted by exp(max_c - max) * sum_c. */
static void merge_pair(const attn_plan *pl, const attn_args *a, int pair) {
    const int b = pair / pl->per_seq, h = pair % pl->per_seq, chunks = pl->chunks, D = a->D;
    const float *parts = a->parts;
    for (int j = 0; j < pl->heads; j++) {
        float mx = -INFINITY, total = 0.0f, w[MAX_CHUNKS];
        for (int c = 0; c < chunks; c++) {
            const float m = parts[(pair * chunks + c) * pl->part_floats + (int64_t)pl->heads * D + 2 * j];
            mx = m > mx ? m : mx;
        }
        for (int c = 0; c < chunks; c++) {
            const float *st = parts + (pair * chunks + c) * pl->part_floats + (int64_t)pl->heads * D + 2 * j;
            w[c] = st[1] > 0.0f ? expf(st[0] - mx) * st[1] : 0.0f;
            total += w[c];
        }
        float *o = a->out + (int64_t)b * a->Hq * D + ((int64_t)h * pl->G + j) * D;
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int d = 0; d < D; d++) {
            float v = 0.0f;
            for (int c = 0; c < chunks; c++) v += w[c] * parts[(pair * chunks + c) * pl->part_floats + j * D + d];
            o[d] = v * inv;
        }
    }
}

static int attention_shape_ok(int Hq, int Hkv, int D, int block_size, int is_bf16) {
    return !(D % 16 || D < 16 || D > SY_MAX_HEAD_DIM || Hq > SY_MAX_Q_HEADS || Hkv <= 0 || Hq % Hkv ||
             (is_bf16 && (int64_t)block_size * Hkv * D > SY_MAX_BLOCK_ROW));
}

int sy_decode_attention_shape_ok(int Hq, int Hkv, int D, int block_size, int is_bf16) {
    return attention_shape_ok(Hq, Hkv, D, block_size, is_bf16);
}

/* Paged decode attention. q: fp32, element (b, j, d) at b*q_sb + j*q_sh + d; out: [B, Hq, D] fp32 contiguous;
 * softmax(scale * q.k).
 * Caches (fp32, or bf16 when is_bf16): element (block, offset, head, d) at block*sb + offset*so + head*sh + d.
 * tables: int32, row b at tables + b * table_stride, table_width entries used; lens: int32 [B];
 * scratch: [threads, scratch_stride] fp32 with
 * scratch_stride >= Hq * round_up(max len, 16) (checked: the caller may size it from a cached max).
 * len <= 0 gives zeros. tree_masks (int64 [B]) / tree_starts (int32 [B]), or NULL: tree verification rows
 * (hosted/layers/attention.py AttentionMetadata): row b with mask m != -1 sees position p < len only if
 * p < tree_starts[b] or bit p - tree_starts[b] of m is set; a row that sees nothing gives zeros.
 * Returns 0; 1 if a block id was out of range; 2 if the shape is unsupported;
 * 3 if a length needs more table columns than table_width or more scratch than scratch_stride. */
int sy_decode_attention(const float *q, int64_t q_sb, int64_t q_sh, float scale, const void *k_cache,
                        const void *v_cache, int is_bf16, int64_t sb,
                        int64_t so, int64_t sh, int64_t num_blocks, int block_size, const int32_t *tables,
                        int64_t table_stride, int64_t table_width, const int32_t *lens, const int64_t *tree_masks,
                        const int32_t *tree_starts, int B, int Hq, int Hkv, int D, float *out,
                        float *scratch, int64_t scratch_stride, int threads) {
    if (!attention_shape_ok(Hq, Hkv, D, block_size, is_bf16)) return 2;
    for (int b = 0; b < B; b++) {
        const int64_t len = lens[b] > 0 ? lens[b] : 0;
        if ((len + block_size - 1) / block_size > table_width || (len + 15) / 16 * 16 * Hq > scratch_stride)
            return 3;
    }
    attn_plan pl = plan_attention(B, Hq, Hkv, D, threads);
    attn_args a = {q, q_sb, q_sh, scale, k_cache, v_cache, is_bf16, sb, so, sh, num_blocks, block_size, tables,
                   table_stride, lens, tree_masks, tree_starts, Hq, Hkv, D, out, scratch, NULL, scratch_stride};
    if (pl.chunks > 1 && !(a.parts = malloc(sizeof(float) * pl.part_floats * pl.pairs * pl.chunks))) pl.chunks = 1;
    const int units = pl.pairs * pl.chunks;
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(| : bad) if (units > 1)
    for (int unit = 0; unit < units; unit++) bad |= attention_unit(&pl, &a, unit);
    if (a.parts) {
        for (int pair = 0; pair < pl.pairs; pair++) merge_pair(&pl, &a, pair);
        free(a.parts);
    }
    return bad;
}

/* sy_decode_attention called by every thread t of nt of a parallel region (the native decode step), the units
 * shared out among them through `team` (cpu_team.c), with `parts` of sy_decode_attention_parts(B, Hq, Hkv, D,
 * threads) floats from the caller. The shape, lengths and block ids must have been checked (sy_decode_layers
 * checks them before its region); returns with every thread's share done (the team meets at the end). */
void sy_team_decode_attention(const float *q, int64_t q_sb, int64_t q_sh, float scale, const void *k_cache,
                              const void *v_cache, int is_bf16, int64_t sb, int64_t so, int64_t sh,
                              int64_t num_blocks, int block_size, const int32_t *tables, int64_t table_stride,
                              const int32_t *lens, const int64_t *tree_masks, const int32_t *tree_starts, int B,
                              int Hq, int Hkv, int D, float *out, float *scratch, int64_t scratch_stride,
                              float *parts, int threads, void *team, int t, int nt) {
    const attn_plan pl = plan_attention(B, Hq, Hkv, D, threads);
    const attn_args a = {q, q_sb, q_sh, scale, k_cache, v_cache, is_bf16, sb, so, sh, num_blocks, block_size,
                         tables, table_stride, lens, tree_masks, tree_starts, Hq, Hkv, D, out, scratch,
                         pl.chunks > 1 ? parts : NULL, scratch_stride};
    const int units = pl.pairs * pl.chunks;
    for (int unit = sy_team_next(team); unit < units; unit = sy_team_next(team)) (void)attention_unit(&pl, &a, unit);
    sy_team_barrier(team, nt);
    if (t == 0) sy_team_rewind(team); /* nobody takes units again before the next barrier */
    if (pl.chunks > 1) {
        for (int pair = t; pair < pl.pairs; pair += nt) merge_pair(&pl, &a, pair);
        sy_team_barrier(team, nt);
    }
}

/* Paged prefill / extend attention: the new tokens of P sequences packed as q [T, Hq, D] (token t of sequence p
 * is row cu[p] + i, at position lens[p] - (cu[p + 1] - cu[p]) + i), each attending causally to every cached
 * position up to its own (its own K/V already written). Each (token, kv head) is one decode over the
 * positions it sees, so the causal mask costs nothing and each K/V row is read from cache once per query
 * -- the sequence's K/V stay in L2/L3 while its tokens pass over them. torch's SDPA here ran the chunked,
 * masked prefill of a 64-request batch at ~a fifth of its bf16 step time (MKL sgemm on small tiles).
 * out [T, Hq, D] fp32 contiguous; other arguments as sy_decode_attention (scratch_stride >= Hq *
 * round_up(max lens, 16)). tree_masks / tree_starts ([T], numbered as q's rows, or NULL): as sy_decode_attention's,
 * on top of the causal mask. Returns 0; 1 for a block id outside the pool; 2 for an unsupported shape; 3 if a
 * length needs more table columns than table_width or scratch than scratch_stride, or a sequence has more
 * new tokens than its length. */
int sy_prefill_attention(const float *q, int64_t q_st, int64_t q_sh, float scale, const void *k_cache,
                         const void *v_cache, int is_bf16, int64_t sb, int64_t so, int64_t sh, int64_t num_blocks,
                         int block_size, const int32_t *tables, int64_t table_stride, int64_t table_width,
                         const int32_t *cu, const int32_t *lens, const int64_t *tree_masks,
                         const int32_t *tree_starts, int P, int Hq, int Hkv, int D, float *out, float *scratch,
                         int64_t scratch_stride, int threads) {
    if (!attention_shape_ok(Hq, 1, D, block_size, is_bf16) || Hkv <= 0 || Hq % Hkv) return 2;
    if (P <= 0) return 0;
    for (int p = 0; p < P; p++) {
        const int64_t len = lens[p], n_new = (int64_t)cu[p + 1] - cu[p];
        if (n_new < 0 || n_new > len || (len + block_size - 1) / block_size > table_width ||
            (len + 15) / 16 * 16 * Hq > scratch_stride)
            return 3;
    }
    const int T = cu[P] - cu[0], G = Hq / Hkv;
    const int64_t elem = is_bf16 ? 2 : 4;
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads) reduction(| : bad) if ((int64_t)T * Hkv > 1)
    for (int64_t unit = 0; unit < (int64_t)T * Hkv; unit++) {
        /* longest first: walk the tokens from the end (later tokens see more positions) */
        const int t = T - 1 - (int)(unit / Hkv), h = (int)(unit % Hkv), row = cu[0] + t;
        int lo = 0, hi = P - 1; /* the sequence holding row: the last p with cu[p] <= row */
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (cu[mid] <= row) lo = mid;
            else hi = mid - 1;
        }
        const int p = lo, len = lens[p] - (cu[p + 1] - 1 - row); /* positions 0 .. own */
        float *scores = thread_scratch(scratch, scratch_stride);
        const char *kc = (const char *)k_cache + h * sh * elem, *vc = (const char *)v_cache + h * sh * elem;
        const int64_t mask = tree_masks ? tree_masks[t] : -1, off = mask == -1 ? 0 : -(int64_t)tree_starts[t];
        bad |= decode_seq(q + (int64_t)t * q_st + (int64_t)h * G * q_sh, q_sh, scale, kc, vc, is_bf16, sb, so, sh,
                          tables + (int64_t)p * table_stride, num_blocks, block_size, len, G, 1, D, scores,
                          out + ((int64_t)t * Hq + (int64_t)h * G) * D, NULL, 0, mask, off);
    }
    return bad;
}

/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few rows of x: each weight row is read once, in
 * order (one sequential stream per thread, which the hardware prefetcher follows), and dotted with
 * every x row. fp32 throughout. */
void sy_linear_f32(const float *x, int64_t x_stride, const float *w, int64_t w_stride, const float *bias,
                   float *y, int64_t y_stride, int M, int64_t N, int64_t K, int threads) {
    const int64_t kv = K - K % 64;
#pragma omp parallel for schedule(static) num_threads(threads) if (N * K >= 65536)
    for (int64_t n = 0; n < N; n++) {
        const float *wr = w + n * w_stride;
        for (int m = 0; m < M; m++) {
            const float *xm = x + m * x_stride;
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t k = 0; k < kv; k += 64) {
                a0 += ld(wr + k) * ld(xm + k);
                a1 += ld(wr + k + 16) * ld(xm + k + 16);
                a2 += ld(wr + k + 32) * ld(xm + k + 32);
                a3 += ld(wr + k + 48) * ld(xm + k + 48);
            }
            const v16 a = (a0 + a1) + (a2 + a3);
            float s = 0.0f;
            for (int i = 0; i < 16; i++) s += a[i];
            for (int64_t k = kv; k < K; k++) s += wr[k] * xm[k];
            y[m * y_stride + n] = bias ? s + bias[n] : s;
        }
    }
}

/* ---- panel GEMM ----
 * W [N, K] is stored once as panels of SY_PANEL_N output features: panel p holds W[p*SY_PANEL_N + j, k] at
 * [p][k][j] (zero past N), so one k step of a panel is three contiguous vectors. A register tile of up to
 * PANEL_M rows of x times the panel's 48 columns keeps 24 accumulators in registers: per k, 3 vector loads
 * and PANEL_M broadcasts feed 3 * PANEL_M FMAs. Each thread walks a contiguous range of panels and, while
 * computing one, prefetches the next into L2: at decode batch sizes the weights come from DRAM every step
 * and that stream must overlap the arithmetic (oneDNN's packed GEMM did not: 210 vs 320 GFLOPS at 64 rows
 * with cold weights on the SmolLM-135M shapes, measured here). */
#define PANEL_M 8
#define PANEL_ROW_TILES 16 /* 128 rows of x: 288 KiB at K = 576 */

void sy_pack_panels_f32(const float *w, int64_t w_stride, int64_t N, int64_t K, float *out) {
    const int64_t panels = (N + SY_PANEL_N - 1) / SY_PANEL_N;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k++) {
            float *o = out + (p * K + k) * SY_PANEL_N;
            for (int j = 0; j < SY_PANEL_N; j++) {
                const int64_t n = p * SY_PANEL_N + j;
                o[j] = n < N ? w[n * w_stride + k] : 0.0f;
            }
        }
}

/* y[i, j] = sum_k x[i, k] * panel[k][j] (+ bias[j]) for i < mr (<= PANEL_M), j < ncols; while at it, prefetch
 * pf_lines cache lines from pf, spread over the k loop. */
#ifdef __AVX512F__
static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t xs, const float *panel,
                                                             int64_t K, int mr, float *y, int64_t ys, int ncols,
                                                             const float *bias, const char *pf, int64_t pf_lines) {
    v16 a[PANEL_M][3];
    for (int i = 0; i < PANEL_M; i++)
        for (int c = 0; c < 3; c++) a[i][c] = (v16){0};
    const int64_t per_k = (pf_lines + K - 1) / (K > 0 ? K : 1);
    for (int64_t k = 0; k < K; k++) {
        const float *wk = panel + k * SY_PANEL_N;
        const v16 w0 = ld(wk), w1 = ld(wk + 16), w2 = ld(wk + 32);
        for (int64_t l = 0; l < per_k && pf_lines > 0; l++, pf_lines--, pf += 64) __builtin_prefetch(pf, 0, 2);
        for (int i = 0; i < PANEL_M; i++)
            if (i < mr) {
                const float xv = x[i * xs + k];
                a[i][0] += xv * w0;
                a[i][1] += xv * w1;
                a[i][2] += xv * w2;
            }
    }
    for (int i = 0; i < mr; i++) {
        float row[SY_PANEL_N] __attribute__((aligned(64)));
        *(v16 *)row = a[i][0];
        *(v16 *)(row + 16) = a[i][1];
        *(v16 *)(row + 32) = a[i][2];
        float *yr = y + i * ys;
        if (bias)
            for (int j = 0; j < ncols; j++) yr[j] = row[j] + bias[j];
        else
            memcpy(yr, row, sizeof(float) * ncols);
    }
}
#else
/* Without AVX-512 (16 256-bit registers): 8 x 48 accumulators would spill every k (measured ~4 GFLOP/s on Zen 3
 * against oneDNN's ~85), so the tile runs as passes of 4 rows x 24 columns (12 accumulators, 3 weight vectors,
 * one broadcast) over the panel, which stays in L1/L2 between passes. Each output is still one k-ordered sum.
 * One or two rows (decode) take the panel's 48 columns in one pass instead (6 accumulators a row): the weights
 * stream from DRAM once, and twice the independent FMA chains hide their latency -- the batch-1 GEMV read 20 GB/s
 * against 10 in two passes on Zen 3, where a plain streaming read got 14-20 (measured side by side). */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
static inline __attribute__((always_inline)) void panel_tile_narrow(const float *x, int64_t xs, const float *panel,
                                                                    int64_t K, int mr, float *y, int64_t ys,
                                                                    int ncols, const float *bias, const char *pf,
                                                                    int64_t pf_lines) {
    const int64_t per_k = (pf_lines + K - 1) / (K > 0 ? K : 1);
    v8 a[2][6];
    for (int i = 0; i < 2; i++)
        for (int c = 0; c < 6; c++) a[i][c] = (v8){0};
    for (int64_t k = 0; k < K; k++) {
        const float *wk = panel + k * SY_PANEL_N;
        for (int64_t l = 0; l < per_k && pf_lines > 0; l++, pf_lines--, pf += 64) __builtin_prefetch(pf, 0, 2);
        for (int i = 0; i < mr; i++) {
            const float xv = x[i * xs + k];
            for (int c = 0; c < 6; c++) a[i][c] += xv * *(const v8 *)(wk + 8 * c);
        }
    }
    for (int i = 0; i < mr; i++) {
        float row[SY_PANEL_N];
        for (int c = 0; c < 6; c++) *(v8 *)(row + 8 * c) = a[i][c];
        float *yr = y + i * ys;
        if (bias)
            for (int j = 0; j < ncols; j++) yr[j] = row[j] + bias[j];
        else
            memcpy(yr, row, sizeof(float) * ncols);
    }
}

static inline __attribute__((always_inline)) void panel_tile(const float *x, int64_t xs, const float *panel,
                                                             int64_t K, int mr, float *y, int64_t ys, int ncols,
                                                             const float *bias, const char *pf, int64_t pf_lines) {
    if (mr <= 2) { /* a literal row count each, so the unused accumulators vanish */
        if (mr == 1)
            panel_tile_narrow(x, xs, panel, K, 1, y, ys, ncols, bias, pf, pf_lines);
        else
            panel_tile_narrow(x, xs, panel, K, 2, y, ys, ncols, bias, pf, pf_lines);
        return;
    }
    const int64_t per_k = (pf_lines + K - 1) / (K > 0 ? K : 1);
    for (int i0 = 0; i0 < mr; i0 += 4)
        for (int half = 0; half < 2; half++) {
            const int c0 = 24 * half;
            if (c0 >= ncols) break;
            v8 a[4][3];
            for (int i = 0; i < 4; i++)
                for (int c = 0; c < 3; c++) a[i][c] = (v8){0};
            for (int64_t k = 0; k < K; k++) {
                const float *wk = panel + k * SY_PANEL_N + c0;
                const v8 w0 = *(const v8 *)wk, w1 = *(const v8 *)(wk + 8), w2 = *(const v8 *)(wk + 16);
                for (int64_t l = 0; l < per_k && pf_lines > 0; l++, pf_lines--, pf += 64) __builtin_prefetch(pf, 0, 2);
                for (int i = 0; i < 4; i++)
                    if (i0 + i < mr) {
                        const float xv = x[(i0 + i) * xs + k];
                        a[i][0] += xv * w0;
                        a[i][1] += xv * w1;
                        a[i][2] += xv * w2;
                    }
            }
            const int nc = ncols - c0 < 24 ? ncols - c0 : 24;
            for (int i = 0; i < 4 && i0 + i < mr; i++) {
                float row[24];
                *(v8 *)row = a[i][0];
                *(v8 *)(row + 8) = a[i][1];
                *(v8 *)(row + 16) = a[i][2];
                float *yr = y + (i0 + i) * ys + c0;
                if (bias)
                    for (int j = 0; j < nc; j++) yr[j] = row[j] + bias[c0 + j];
                else
                    memcpy(yr, row, sizeof(float) * nc);
            }
        }
}
#endif

/* The vector width the panel GEMM was built for: 512 (AVX-512 tile), 256 (the AVX2 passes) or 0 (generic). */
int sy_panel_vector_bits(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__) && defined(__FMA__)
    return 256;
#else
    return 0;
#endif
}

/* y [M, N] (row stride ys) = x [M, K] (row stride xs, unit column stride) @ W^T (+ bias), W given as panels
 * from sy_pack_panels_f32. fp32. Threads split the panels (decode: each weight byte is read by one core), or
 * the rows when there are many (prefill: both cores then read the same panels from the shared cache while
 * their own rows stay in L2 -- with split panels every core re-read all of x for each of its panels and ran
 * ~5% behind oneDNN in the engine). Rows go in blocks of PANEL_ROW_TILES tiles so that a block of x stays
 * in L2 while the panels pass over it. Each output element is one k-ordered sum, whatever the split. */
static inline int panel_threads(int M, int64_t N, int64_t K, int threads) {
    return (int64_t)M * N * K < 65536 || (N + SY_PANEL_N - 1) / SY_PANEL_N < 2 ? 1 : threads;
}

/* Thread t of nt's share of sy_gemm_panels_f32 (the native decode step calls it inside its parallel region). */
void sy_part_gemm_panels_f32(const float *x, int64_t xs, const float *panels, const float *bias, float *y, int64_t ys,
                             int M, int64_t N, int64_t K, int t, int nt) {
    const int64_t num_panels = (N + SY_PANEL_N - 1) / SY_PANEL_N, panel_floats = K * SY_PANEL_N;
    const int64_t panel_lines = panel_floats * 4 / 64;
    const int row_tiles = (M + PANEL_M - 1) / PANEL_M;
    nt = panel_threads(M, N, K, nt);
    if (t >= nt) return;
    const int split_rows = row_tiles >= 64 * nt;
    const int64_t p_first = split_rows ? 0 : num_panels * t / nt;
    const int64_t p_last = split_rows ? num_panels : num_panels * (t + 1) / nt;
    const int r_first = split_rows ? row_tiles * t / nt : 0;
    const int r_last = split_rows ? row_tiles * (t + 1) / nt : row_tiles;
    for (int r0 = r_first; r0 < r_last; r0 += PANEL_ROW_TILES) {
        const int r1 = r0 + PANEL_ROW_TILES < r_last ? r0 + PANEL_ROW_TILES : r_last;
        for (int64_t p = p_first; p < p_last; p++) {
            const float *panel = panels + p * panel_floats;
            const int ncols = N - p * SY_PANEL_N < SY_PANEL_N ? (int)(N - p * SY_PANEL_N) : SY_PANEL_N;
            const float *b = bias ? bias + p * SY_PANEL_N : NULL;
            /* the next panel is prefetched in equal shares over this block's row tiles */
            const int64_t share = p + 1 < p_last ? (panel_lines + (r1 - r0) - 1) / (r1 - r0) : 0;
            for (int r = r0; r < r1; r++) {
                const int m0 = r * PANEL_M, mr = M - m0 < PANEL_M ? M - m0 : PANEL_M;
                const int64_t done = (int64_t)(r - r0) * share;
                const int64_t lines = done >= panel_lines ? 0 : done + share > panel_lines ? panel_lines - done
                                                                                            : share;
                const char *pf = (const char *)(panel + panel_floats) + done * 64;
                float *yt = y + (int64_t)m0 * ys + p * SY_PANEL_N;
                if (mr == PANEL_M) /* literal row count: the full tile's loop is fully unrolled */
                    panel_tile(x + (int64_t)m0 * xs, xs, panel, K, PANEL_M, yt, ys, ncols, b, pf, lines);
                else
                    panel_tile(x + (int64_t)m0 * xs, xs, panel, K, mr, yt, ys, ncols, b, pf, lines);
            }
        }
    }
}

void sy_gemm_panels_f32(const float *x, int64_t xs, const float *panels, const float *bias, float *y, int64_t ys,
                        int M, int64_t N, int64_t K, int threads) {
    threads = panel_threads(M, N, K, threads);
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        sy_part_gemm_panels_f32(x, xs, panels, bias, y, ys, M, N, K, omp_get_thread_num(), omp_get_num_threads());
#else
        sy_part_gemm_panels_f32(x, xs, panels, bias, y, ys, M, N, K, 0, 1);
#endif
    }
}

/* Rotary embedding (HF rotate_half / NeoX): for each token t and head h of x (q then k),
 * out[..., :D/2] = x1*cos - x2*sin, out[..., D/2:] = x2*cos + x1*sin, with cos/sin = cos_sin[pos[t]] (first
 * half cos, second half sin). No FMA contraction, so results equal the torch reference's separate
 * multiply and add. x rows: element (t, h, d) at t*x_st + h*x_sh + d; out contiguous [T, H, D].
 * Returns 0, or 1 if a position is outside [0, max_position). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static int rotary_one(const float *x, int64_t x_st, int64_t x_sh, int T, int H, int D, const int64_t *pos,
                      const float *cos_sin, int64_t max_position, float *out) {
    const int half = D / 2;
    for (int t = 0; t < T; t++) {
        if (pos[t] < 0 || pos[t] >= max_position) return 1;
        const float *cs = cos_sin + pos[t] * D;
        for (int h = 0; h < H; h++) {
            const float *xr = x + t * x_st + h * x_sh;
            float *o = out + ((int64_t)t * H + h) * D;
            for (int i = 0; i < half; i++) {
                const float a = xr[i] * cs[i], b = xr[i + half] * cs[half + i];
                const float c = xr[i + half] * cs[i], d = xr[i] * cs[half + i];
                o[i] = a - b;
                o[i + half] = c + d;
            }
        }
    }
    return 0;
}

int sy_rotary_f32(const float *q, int64_t q_st, int64_t q_sh, int Hq, const float *k, int64_t k_st, int64_t k_sh,
                  int Hkv, int T, int D, const int64_t *pos, const float *cos_sin, int64_t max_position,
                  float *q_out, float *k_out) {
    return rotary_one(q, q_st, q_sh, T, Hq, D, pos, cos_sin, max_position, q_out) |
           rotary_one(k, k_st, k_sh, T, Hkv, D, pos, cos_sin, max_position, k_out);
}

/* k_cache/v_cache slot s (= block * block_size + offset) <- key/value row t for s = slots[t] >= 0.
 * Rows: key element (t, h, d) at t*kst + h*ksh + d, value at t*vst + h*vsh + d (k and v usually differ: k is
 * the rotary output, v a view into the fused QKV projection); caches (block, offset, h, d) at
 * block*cb + offset*co + h*ch + d. Returns 0, or 1 (nothing written) if a slot is beyond the pool. */
int sy_store_kv_f32(const float *key, const float *value, int64_t kst, int64_t ksh, int64_t vst, int64_t vsh,
                    float *k_cache, float *v_cache, int64_t cb, int64_t co, int64_t ch, int64_t num_slots,
                    int block_size, const int64_t *slots, int T, int H, int D) {
    for (int t = 0; t < T; t++)
        if (slots[t] >= num_slots) return 1;
    for (int t = 0; t < T; t++) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        const int64_t base = (s / block_size) * cb + (s % block_size) * co;
        for (int h = 0; h < H; h++) {
            memcpy(k_cache + base + h * ch, key + t * kst + h * ksh, sizeof(float) * D);
            memcpy(v_cache + base + h * ch, value + t * vst + h * vsh, sizeof(float) * D);
        }
    }
    return 0;
}

/* RMSNorm, optionally fused with the residual add: s = x (+ res), out = w * (s * (1 / sqrt(mean(s^2) + eps))),
 * new_res = s when res is given. Rows: element (t, i) at t*stride + i (x and res), contiguous outputs.
 * fp32; the mean is summed in 16 lanes then across them (not torch's exact order: ~1 ulp apart). */
void sy_rms_norm_f32(const float *x, int64_t x_stride, const float *res, int64_t res_stride, const float *w,
                     float *out, float *new_res, int T, int H, float eps) {
    const int hv = H - H % 16;
    for (int t = 0; t < T; t++) {
        const float *xr = x + t * x_stride;
        const float *s = xr;
        if (res) {
            const float *rr = res + t * res_stride;
            float *nr = new_res + (int64_t)t * H;
            for (int i = 0; i < hv; i += 16) *(v16 *)(nr + i) = ld(xr + i) + ld(rr + i);
            for (int i = hv; i < H; i++) nr[i] = xr[i] + rr[i];
            s = nr;
        }
        v16 acc = {0};
        for (int i = 0; i < hv; i += 16) acc += ld(s + i) * ld(s + i);
        float sum = 0.0f;
        for (int i = 0; i < 16; i++) sum += acc[i];
        for (int i = hv; i < H; i++) sum += s[i] * s[i];
        const float inv = 1.0f / sqrtf(sum / (float)H + eps);
        float *o = out + (int64_t)t * H;
        for (int i = 0; i < hv; i += 16) *(v16 *)(o + i) = ld(w + i) * (ld(s + i) * inv);
        for (int i = hv; i < H; i++) o[i] = w[i] * (s[i] * inv);
    }
}

/* out[t, i] = silu(g) * u with g = gu[t, i], u = gu[t, inter + i] (the fused gate_up projection's two halves),
 * silu(g) = g / (1 + exp(-g)). Evaluated with e = exp(-|g|) <= 1 (no overflow): g / (1 + e) for g >= 0,
 * g * e / (1 + e) below. fp32; within a few ulp of torch's silu-then-multiply. Rows of gu at t * gs, out
 * contiguous [T, inter]. */
static void silu_mul_row(const float *g, float *o, int inter) {
    const int iv = inter - inter % 16;
    const float *u = g + inter;
    for (int i = 0; i < iv; i += 16) {
        const v16 x = ld(g + i);
        const i16 neg = x < 0.0f;
        const v16 ax = (v16)((i16)x & 0x7fffffff); /* |x|: clear the sign bit */
        const v16 e = exp_nonpos16((v16){0} - ax);
        const v16 num = (v16)((neg & (i16)(x * e)) | (~neg & (i16)x));
        *(v16 *)(o + i) = num / (1.0f + e) * ld(u + i);
    }
    for (int i = iv; i < inter; i++) {
        const float x = g[i], e = expf(-fabsf(x));
        o[i] = (x < 0.0f ? x * e : x) / (1.0f + e) * u[i];
    }
}

/* Rows [r0, r1) of sy_silu_mul_f32, on the calling thread. */
void sy_silu_mul_rows_f32(const float *gu, int64_t gs, float *out, int inter, int r0, int r1) {
    for (int t = r0; t < r1; t++) silu_mul_row(gu + (int64_t)t * gs, out + (int64_t)t * inter, inter);
}

void sy_silu_mul_f32(const float *gu, int64_t gs, float *out, int T, int inter, int threads) {
    if ((int64_t)T * inter < 65536) threads = 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < T; t++) silu_mul_row(gu + (int64_t)t * gs, out + (int64_t)t * inter, inter);
}
