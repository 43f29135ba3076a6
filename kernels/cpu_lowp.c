/* Low-precision projections for the CPU engine, compiled with cpu_native.c into one library:
 *   sy_lowp_features     which of the kernels below this build has (bit 0: int8/int4 VNNI, bit 1: bf16)
 *   sy_linear_q8         y = x W^T, W int8 per output row (symmetric), x rounded to int8 per block of 32 in the
 *                        same call (a scale per block, as llama.cpp's q8_0)
 *   sy_linear_q4         likewise for W 4-bit per group along K with a scale and zero point per group
 *   sy_gemm_bf16         y = x W^T, W bf16, x bf16 (or fp32, rounded to bf16 first), fp32 accumulation
 *
 * Weights are stored in strips of 16 output rows, interleaved so that one 64-byte load holds the next few k
 * of all 16 rows (the layout VNNI / AVX512-BF16 dot products consume): a broadcast of x's k-group against
 * it accumulates 16 outputs at once, with no horizontal sums. cpu_lowp.py builds the strips with torch.
 *   int8  strip s, k4 step t: byte 4j + i = W[16s + j, 4t + i] + 128 (as unsigned: vpdpbusd takes u8 x s8)
 *   int4  strip s, k8 step t: byte 4j + i = q[16s + j, 8t + i] | q[16s + j, 8t + 4 + i] << 4 (nibbles 0..15)
 *   bf16  strip s, k2 step t: bf16 pair j = (W[16s + j, 2t], W[16s + j, 2t + 1])
 * and (int8, bf16) the strips of one tile group (GROUP_*: the tile's width) are interleaved step by step, so a
 * thread reads its weights as one sequential stream: group g's step t of strip j is the 64-byte line at
 * g * GROUP * strip_bytes + (t * ns + j) * 64, ns the group's strips (the last group may have fewer). With
 * the strips side by side instead (two or four streams 9-18 KB apart per thread) the GEMVs read 35-45 GB/s
 * where a plain sequential read got 60-70 (measured here).
 * The +128 of int8 weights is taken back per activation block (128 * sum of the block's int8 x), and the
 * int4 zero points likewise (zero * sum of the block's x), so the inner loops are dot products only.
 * Outputs are fp32 (caller converts). Threads split the strips: at decode each weight byte is read by one
 * core, once; rows of x are walked inside a strip group so a group's weights stay in L1/L2 for prefill. */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SY_HAVE_VNNI 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define SY_HAVE_BF16 1
#endif
#if defined(SY_HAVE_VNNI) || defined(SY_HAVE_BF16)
#include <immintrin.h>
#endif

#define QBLOCK 32 /* activation quantization block (k values per scale) */
/* rows of x per register tile: 6 x 2 strips (int8, int4) or 6 x 4 (bf16) ran 24-30% faster than 4 rows at 64-256
 * rows for int8 and bf16, ~6% for int4 (each weight load feeds more rows); batch 1 is unchanged */
#define ROW_TILE 6
/* strips per tile group and interleaved in memory (cpu_lowp.py packs with the same widths); int4 strips stay
 * side by side: its decode reads one strip per tile, a single stream either way (and interleaved pairs read
 * one strip at a time measured 10-15% slower) */
#define GROUP_Q8 2
#define GROUP_Q4 2 /* tile width only */
#define GROUP_BF16 4

#if defined(SY_HAVE_VNNI) || defined(SY_HAVE_BF16)
/* Ask for the weight bytes PREFETCH_AHEAD past the `bytes` about to be read: each thread reads NS strips side
 * by side, more concurrent streams than the hardware prefetcher keeps ahead of. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 2048
#endif
static inline void prefetch_ahead(const void *p, int bytes) {
    for (int c = 0; c < bytes; c += 64) __builtin_prefetch((const char *)p + PREFETCH_AHEAD + c, 0, 0);
}

static inline void store_cols(float *y, __m512 v, int ncols) {
    if (ncols >= 16)
        _mm512_storeu_ps(y, v);
    else
        _mm512_mask_storeu_ps(y, (__mmask16)((1u << ncols) - 1), v);
}
#endif

int sy_lowp_features(void) {
    int f = 0;
#ifdef SY_HAVE_VNNI
    f |= 1;
#endif
#ifdef SY_HAVE_BF16
    f |= 2;
#endif
    return f;
}

static inline int threads_for(int64_t work, int threads) { return work < 65536 ? 1 : threads; }

#ifdef SY_HAVE_VNNI
/* xq [M, K] int8, xs [M, K/32] scales, xsum [M, K/32] = scale * sum of the block's int8 values:
 * x ~ xq * scale per block (round to nearest, |xq| <= 127). K % 32 == 0. */
static void quantize_rows_q8(const float *x, int64_t x_stride, int M, int K, int8_t *xq, float *xs, float *xsum) {
    const int nb = K / QBLOCK;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb; b++) {
            const float *src = x + (int64_t)m * x_stride + b * QBLOCK;
            const __m512 v0 = _mm512_loadu_ps(src), v1 = _mm512_loadu_ps(src + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
            int8_t *dst = xq + (int64_t)m * K + b * QBLOCK;
            _mm_storeu_si128((__m128i *)dst, _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(dst + 16), _mm512_cvtsepi32_epi8(q1));
            const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            xs[(int64_t)m * nb + b] = scale;
            xsum[(int64_t)m * nb + b] = scale * (float)sum;
        }
}

/* One register tile of the int8 GEMM: MR rows of x times NS strips (16 outputs each). */
static inline __attribute__((always_inline)) void q8_tile(const int8_t *xq, const float *xs, const float *xsum,
                                                          int K, int MR, int NS, const uint8_t *w, int64_t sst,
                                                          int64_t kst, const float *scales, const float *bias, float *y,
                                                          int64_t ys, int ncols) {
    const int nb = K / QBLOCK;
    __m512 acc[ROW_TILE][4], corr[ROW_TILE];
    for (int r = 0; r < MR; r++) {
        corr[r] = _mm512_setzero_ps();
        for (int s = 0; s < NS; s++) acc[r][s] = _mm512_setzero_ps();
    }
    for (int b = 0; b < nb; b++) {
        __m512i dot[ROW_TILE][4];
        for (int r = 0; r < MR; r++)
            for (int s = 0; s < NS; s++) dot[r][s] = _mm512_setzero_si512();
        const uint8_t *wb = w + (int64_t)b * (QBLOCK / 4) * kst;
        prefetch_ahead(wb, (QBLOCK / 4) * kst);
        for (int t = 0; t < QBLOCK / 4; t++) {
            __m512i wv[4];
            for (int s = 0; s < NS; s++) wv[s] = _mm512_loadu_si512(wb + s * sst + t * kst);
            for (int r = 0; r < MR; r++) {
                int32_t x4;
                memcpy(&x4, xq + (int64_t)r * K + b * QBLOCK + 4 * t, 4);
                const __m512i xv = _mm512_set1_epi32(x4);
                for (int s = 0; s < NS; s++) dot[r][s] = _mm512_dpbusd_epi32(dot[r][s], wv[s], xv);
            }
        }
        for (int r = 0; r < MR; r++) {
            const __m512 sc = _mm512_set1_ps(xs[(int64_t)r * nb + b]);
            for (int s = 0; s < NS; s++) acc[r][s] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][s]), sc, acc[r][s]);
            corr[r] = _mm512_add_ps(corr[r], _mm512_set1_ps(xsum[(int64_t)r * nb + b]));
        }
    }
    for (int s = 0; s < NS; s++) {
        const __m512 sw = _mm512_loadu_ps(scales + 16 * s);
        const __m512 bv = bias ? _mm512_loadu_ps(bias + 16 * s) : _mm512_setzero_ps();
        for (int r = 0; r < MR; r++) {
            /* sum_b sx (dot(W + 128, xq)) - 128 sum_b sx sum(xq) = sum_b sx dot(W, xq) */
            const __m512 v = _mm512_fnmadd_ps(corr[r], _mm512_set1_ps(128.0f), acc[r][s]);
            store_cols(y + (int64_t)r * ys + 16 * s, _mm512_fmadd_ps(v, sw, bv), ncols - 16 * s);
        }
    }
}

/* One register tile of the int4 GEMM; `gs` is the weight group size (a multiple of 32), sz the per-strip
 * [groups][2][16] table of fp16 scale and zero point (one 64-byte line per group and strip; fp16 as GGUF's
 * Q4 blocks store them). */
static inline __attribute__((always_inline)) void q4_tile(const int8_t *xq, const float *xs, const float *xsum,
                                                          int K, int MR, int NS, const uint8_t *w, int64_t sst,
                                                          int64_t kst, const uint16_t *sz, int64_t sz_strip, int gs,
                                                          const float *bias, float *y, int64_t ys, int ncols) {
    const int nb = K / QBLOCK;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[ROW_TILE][4];
    for (int r = 0; r < MR; r++)
        for (int s = 0; s < NS; s++) acc[r][s] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i dot[ROW_TILE][4];
        for (int r = 0; r < MR; r++)
            for (int s = 0; s < NS; s++) dot[r][s] = _mm512_setzero_si512();
        const uint8_t *wb = w + (int64_t)b * (QBLOCK / 8) * kst;
        for (int s = 0; s < (sst == 64 ? 1 : NS); s++) prefetch_ahead(wb + s * sst, (QBLOCK / 8) * kst);
        for (int t = 0; t < QBLOCK / 8; t++) {
            __m512i lo[4], hi[4];
            for (int s = 0; s < NS; s++) {
                const __m512i v = _mm512_loadu_si512(wb + s * sst + t * kst);
                lo[s] = _mm512_and_si512(v, low);
                hi[s] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            for (int r = 0; r < MR; r++) {
                int32_t x0, x1;
                memcpy(&x0, xq + (int64_t)r * K + b * QBLOCK + 8 * t, 4);
                memcpy(&x1, xq + (int64_t)r * K + b * QBLOCK + 8 * t + 4, 4);
                const __m512i xv0 = _mm512_set1_epi32(x0), xv1 = _mm512_set1_epi32(x1);
                for (int s = 0; s < NS; s++) {
                    dot[r][s] = _mm512_dpbusd_epi32(dot[r][s], lo[s], xv0);
                    dot[r][s] = _mm512_dpbusd_epi32(dot[r][s], hi[s], xv1);
                }
            }
        }
        const int g = b * QBLOCK / gs;
        for (int s = 0; s < NS; s++) {
            const uint16_t *line = sz + s * sz_strip + g * 32;
            const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)line));
            const __m512 scz = _mm512_mul_ps(sc, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(line + 16))));
            for (int r = 0; r < MR; r++) {
                /* + scale * (sx dot(q, xq)) - scale * zero * (sx sum(xq)) */
                const __m512 d = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][s]), _mm512_set1_ps(xs[(int64_t)r * nb + b]));
                acc[r][s] = _mm512_fmadd_ps(sc, d, acc[r][s]);
                acc[r][s] = _mm512_fnmadd_ps(scz, _mm512_set1_ps(xsum[(int64_t)r * nb + b]), acc[r][s]);
            }
        }
    }
    for (int s = 0; s < NS; s++) {
        const __m512 bv = bias ? _mm512_loadu_ps(bias + 16 * s) : _mm512_setzero_ps();
        for (int r = 0; r < MR; r++)
            store_cols(y + (int64_t)r * ys + 16 * s, _mm512_add_ps(acc[r][s], bv), ncols - 16 * s);
    }
}
#endif /* SY_HAVE_VNNI */

#ifdef SY_HAVE_BF16
static inline __attribute__((always_inline)) void bf16_tile(const uint16_t *x, int64_t xs, int K, int MR, int NS,
                                                            const uint16_t *w, int64_t kst, const float *bias,
                                                            float *y, int64_t ys, int ncols) {
    __m512 acc[ROW_TILE][4];
    for (int r = 0; r < MR; r++)
        for (int s = 0; s < NS; s++) acc[r][s] = _mm512_setzero_ps();
    for (int t = 0; t < K / 2; t++) {
        if (t % 16 == 0) prefetch_ahead(w + t * kst, 16 * 2 * kst);
        __m512i wv[4];
        for (int s = 0; s < NS; s++) wv[s] = _mm512_loadu_si512(w + s * 32 + t * kst);
        for (int r = 0; r < MR; r++) {
            int32_t x2;
            memcpy(&x2, x + (int64_t)r * xs + 2 * t, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(x2);
            for (int s = 0; s < NS; s++) acc[r][s] = _mm512_dpbf16_ps(acc[r][s], (__m512bh)wv[s], xv);
        }
    }
    for (int s = 0; s < NS; s++) {
        const __m512 bv = bias ? _mm512_loadu_ps(bias + 16 * s) : _mm512_setzero_ps();
        for (int r = 0; r < MR; r++)
            store_cols(y + (int64_t)r * ys + 16 * s, _mm512_add_ps(acc[r][s], bv), ncols - 16 * s);
    }
}
#endif

/* The strip-group x row-tile walk shared by the three GEMMs. TILE(mr, ns, m0, g0, j, ng, ncols) runs one tile
 * with literal mr (1..ROW_TILE) and ns: rows m0.., strips g0 + j.. of the group starting at strip g0 (ng strips,
 * interleaved); groups of NSG strips per thread-chunk, the last group may be narrower; tiles TS strips wide
 * (TS divides NSG). */
#define WALK(NSG, TS, TILE)                                                                                      \
    do {                                                                                                         \
        const int64_t strips = (N + 15) / 16, groups = (strips + (NSG)-1) / (NSG);                             \
        _Pragma("omp parallel for schedule(static) num_threads(threads)") for (int64_t gi = 0; gi < groups; gi++) { \
            const int64_t g0 = gi * (NSG);                                                                       \
            const int ns = strips - g0 < (NSG) ? (int)(strips - g0) : (NSG);                                     \
            const int ncols = N - g0 * 16 < 16 * ns ? (int)(N - g0 * 16) : 16 * ns;                              \
            for (int m0 = 0; m0 < M; m0 += ROW_TILE) {                                                           \
                const int mr = M - m0 < ROW_TILE ? M - m0 : ROW_TILE;                                            \
                if (ns == (NSG)) {                                                                               \
                    for (int j = 0; j < (NSG); j += (TS)) {                                                      \
                        const int nc = ncols - 16 * j < 16 * (TS) ? ncols - 16 * j : 16 * (TS);                  \
                        switch (mr) {                                                                            \
                        case 1: TILE(1, TS, m0, g0, j, NSG, nc); break;                                          \
                        case 2: TILE(2, TS, m0, g0, j, NSG, nc); break;                                          \
                        case 3: TILE(3, TS, m0, g0, j, NSG, nc); break;                                          \
                        case 4: TILE(4, TS, m0, g0, j, NSG, nc); break;                                          \
                        case 5: TILE(5, TS, m0, g0, j, NSG, nc); break;                                          \
                        default: TILE(6, TS, m0, g0, j, NSG, nc); break;                                         \
                        }                                                                                        \
                    }                                                                                            \
                } else {                                                                                         \
                    for (int j = 0; j < ns; j++) {                                                               \
                        const int nc = ncols - 16 * j < 16 ? ncols - 16 * j : 16;                                \
                        switch (mr) {                                                                            \
                        case 1: TILE(1, 1, m0, g0, j, ns, nc); break;                                            \
                        case 2: TILE(2, 1, m0, g0, j, ns, nc); break;                                            \
                        case 3: TILE(3, 1, m0, g0, j, ns, nc); break;                                            \
                        case 4: TILE(4, 1, m0, g0, j, ns, nc); break;                                            \
                        case 5: TILE(5, 1, m0, g0, j, ns, nc); break;                                            \
                        default: TILE(6, 1, m0, g0, j, ns, nc); break;                                           \
                        }                                                                                        \
                    }                                                                                            \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
    } while (0)

/* The entry points return 0, or 2 when this build lacks the instructions or the shape does not fit (the caller
 * then uses the torch reference). */

#ifdef SY_HAVE_VNNI
/* The int8 rows of x at the start of scratch, then their block scales and scaled sums (64-byte aligned); the
 * caller sizes scratch as M * K + 8 * M * (K / 32) + 64 bytes (cpu_lowp.py). */
static inline void q8_split(void *scratch, int M, int K, int8_t **xq, float **xs, float **xsum) {
    *xq = (int8_t *)scratch;
    *xs = (float *)(((uintptr_t)scratch + (uintptr_t)M * K + 63) & ~(uintptr_t)63);
    *xsum = *xs + (int64_t)M * (K / QBLOCK);
}
#endif

/* y [M, N] (row stride ys) = x dequant(W)^T from fp32 x [M, K] (row stride x_stride), rounded into scratch
 * first; W packed int8 strips [strips][K/4][64] (K * 16 bytes per strip; groups of GROUP_Q8 interleaved), scales [strips * 16] fp32 and bias
 * [strips * 16] or NULL (both zero-padded past N). One call per layer. */
int sy_linear_q8(const float *x, int64_t x_stride, int M, int K, void *scratch, const uint8_t *w,
                 const float *scales, const float *bias, float *y, int64_t ys, int64_t N, int threads) {
#ifdef SY_HAVE_VNNI
    if (K % QBLOCK) return 2;
    int8_t *xq;
    float *xs, *xsum;
    q8_split(scratch, M, K, &xq, &xs, &xsum);
    quantize_rows_q8(x, x_stride, M, K, xq, xs, xsum);
    const int64_t strip = (int64_t)K * 16, nb = K / QBLOCK;
    threads = threads_for((int64_t)M * N * K / 4, threads);
#define Q8(MR, NS, m0, g0, j, ng, nc)                                                                            \
    q8_tile(xq + (int64_t)(m0)*K, xs + (int64_t)(m0)*nb, xsum + (int64_t)(m0)*nb, K, MR, NS,                   \
            w + (g0)*strip + (j)*64, 64, (ng)*64, scales + ((g0) + (j)) * 16, bias ? bias + ((g0) + (j)) * 16 : NULL,  \
            y + (int64_t)(m0)*ys + ((g0) + (j)) * 16, ys, nc)
    WALK(GROUP_Q8, GROUP_Q8, Q8);
#undef Q8
    return 0;
#else
    (void)x, (void)x_stride, (void)M, (void)K, (void)scratch, (void)w, (void)scales, (void)bias, (void)y, (void)ys,
        (void)N, (void)threads;
    return 2;
#endif
}

/* As sy_linear_q8 for 4-bit weights: strips [strips][K/8][64] (K * 8 bytes per strip, GROUP_Q4), sz [strips][K/gs][2][16]
 * fp16 (scale, zero point), group size gs a multiple of 32 dividing K. */
int sy_linear_q4(const float *x, int64_t x_stride, int M, int K, void *scratch, const uint8_t *w, const uint16_t *sz,
                 int gs, const float *bias, float *y, int64_t ys, int64_t N, int threads) {
#ifdef SY_HAVE_VNNI
    if (gs <= 0 || gs % QBLOCK || K % gs) return 2;
    int8_t *xq;
    float *xs, *xsum;
    q8_split(scratch, M, K, &xq, &xs, &xsum);
    quantize_rows_q8(x, x_stride, M, K, xq, xs, xsum);
    const int64_t strip = (int64_t)K * 8, sz_strip = (int64_t)(K / gs) * 32, nb = K / QBLOCK;
    threads = threads_for((int64_t)M * N * K / 8, threads);
#define Q4(MR, NS, m0, g0, j, ng, nc)                                                                            \
    q4_tile(xq + (int64_t)(m0)*K, xs + (int64_t)(m0)*nb, xsum + (int64_t)(m0)*nb, K, MR, NS,                   \
            w + ((g0) + (j)) * strip, strip, 64, sz + ((g0) + (j)) * sz_strip, sz_strip, gs,                     \
            bias ? bias + ((g0) + (j)) * 16 : NULL, y + (int64_t)(m0)*ys + ((g0) + (j)) * 16, ys, nc)
    /* A few rows (decode): one strip at a time read 25-29 GB/s over SmolLM2's int4 layers against 18-20 with two
     * side by side (measured here); more rows are compute-bound and want the wider tile. */
    if (M <= 4)
        WALK(GROUP_Q4, 1, Q4);
    else
        WALK(GROUP_Q4, GROUP_Q4, Q4);
#undef Q4
    return 0;
#else
    (void)x, (void)x_stride, (void)M, (void)K, (void)scratch, (void)w, (void)sz, (void)gs, (void)bias, (void)y,
        (void)ys, (void)N, (void)threads;
    return 2;
#endif
}

/* y [M, N] fp32 (row stride ys) = x W^T (+ bias fp32); x bf16 [M, K] (row stride xs, in elements); W packed bf16
 * strips [strips][K/2][32] (K * 16 elements per strip, GROUP_BF16). K even. */
int sy_gemm_bf16(const uint16_t *x, int64_t xs, int M, int K, const uint16_t *w, const float *bias, float *y,
                 int64_t ys, int64_t N, int threads) {
#ifdef SY_HAVE_BF16
    const int64_t strip = (int64_t)K * 16;
    threads = threads_for((int64_t)M * N * K / 2, threads);
#define BF(MR, NS, m0, g0, j, ng, nc)                                                                            \
    bf16_tile(x + (int64_t)(m0)*xs, xs, K, MR, NS, w + (g0)*strip + (j)*32, (ng)*32,                             \
              bias ? bias + ((g0) + (j)) * 16 : NULL, y + (int64_t)(m0)*ys + ((g0) + (j)) * 16, ys, nc)
    WALK(GROUP_BF16, GROUP_BF16, BF);
#undef BF
    return 0;
#else
    (void)x, (void)xs, (void)M, (void)K, (void)w, (void)bias, (void)y, (void)ys, (void)N, (void)threads;
    return 2;
#endif
}
