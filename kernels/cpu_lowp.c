/* Low-precision projections for the CPU engine, compiled with cpu_native.c into one library:
 *   sy_lowp_features     which of the kernels below this build has (bit 0: int8/int4, bit 1: bf16, bit 2:
 *                        bf16 by AVX512-BF16 dot products)
 *   sy_linear_q8         y = x W^T, W int8 per output row (symmetric), x rounded to int8 per block of 32 in the
 *                        same call (a scale per block, as llama.cpp's q8_0)
 *   sy_linear_q4         likewise for W 4-bit per group along K with a scale and zero point per group
 *   sy_gemm_bf16         y = x W^T, W bf16, x bf16 (or fp32, rounded to bf16 first), fp32 accumulation
 *   sy_quantize_rows_q8, sy_part_*   the same in pieces for the native decode step: rows of x rounded, then
 *                        thread t of n's share of the strips (the step puts the barriers between)
 * Built for AVX-512 (VNNI, BF16) or, without it, AVX2 + FMA + F16C over the same layouts.
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

#include "switchyard_kernels.h" /* the declared interface: prototypes, shared structs and constants */
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SY_HAVE_VNNI 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define SY_HAVE_BF16 1
#endif
/* AVX2 + FMA (most x86 servers without AVX-512, e.g. AMD Zen 2/3): the same layouts, read by 256-bit tiles. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !(defined(SY_HAVE_VNNI) && defined(SY_HAVE_BF16))
#define SY_HAVE_AVX2 1
#endif
#if defined(SY_HAVE_VNNI) || defined(SY_HAVE_AVX2)
#define SY_INT_KERNELS 1
#endif
#if defined(SY_HAVE_BF16) || defined(SY_HAVE_AVX2)
#define SY_BF16_KERNELS 1
#endif
#if defined(SY_INT_KERNELS) || defined(SY_BF16_KERNELS)
#include <immintrin.h>
#endif

/* rows of x per register tile: 6 x 2 strips (int8, int4) or 6 x 4 (bf16) ran 24-30% faster than 4 rows at 64-256
 * rows for int8 and bf16, ~6% for int4 (each weight load feeds more rows); batch 1 is unchanged */
#define ROW_TILE 6
/* strips per tile group and interleaved in memory: SY_GROUP_Q8, SY_GROUP_BF16 (cpu_lowp.py packs with the same
 * widths); int4 strips stay side by side: its decode reads one strip per tile, a single stream either way (and
 * interleaved pairs read one strip at a time measured 10-15% slower) */
#define GROUP_Q4 2 /* tile width only */

#if defined(SY_INT_KERNELS) || defined(SY_BF16_KERNELS)
/* Ask for the weight bytes PREFETCH_AHEAD past the `bytes` about to be read: each thread reads NS strips side
 * by side, more concurrent streams than the hardware prefetcher keeps ahead of.
 * How: prefetchnta 2 KB ahead where it measured best (AMD Zen 5). Intel's prefetchnta fills L1 but not L2, and a
 * line that leaves L1 before its load comes from DRAM again: on a Xeon with AMX (2 vCPUs) the bf16 GEMVs read
 * 10.8 GB/s with it and 43 with prefetcht1 4 KB ahead (int8 19 -> 46; int4 the same either way), measured over
 * SmolLM2's shapes. cpu_native.py defines SY_PREFETCH_INTEL when it builds on a GenuineIntel CPU. */
#ifdef SY_PREFETCH_INTEL
#define PREFETCH_LOCALITY 2
#define PREFETCH_AHEAD 4096
#define LINE_AHEAD 4096 /* prefetch_line, below */
#else
#define PREFETCH_LOCALITY 0
#define PREFETCH_AHEAD 2048
#define LINE_AHEAD 1024
#endif
static inline void prefetch_ahead(const void *p, int bytes) {
    for (int c = 0; c < bytes; c += 64) __builtin_prefetch((const char *)p + PREFETCH_AHEAD + c, 0, PREFETCH_LOCALITY);
}
/* The AVX2 bf16 and int8 tiles ask for one line ahead per weight line they load, spread over the loop: on a Zen 1
 * EPYC (2 vCPUs, AVX2) bf16 read 9-13 GB/s of weights from DRAM with a burst per 16 steps, 15-18 with no software
 * prefetch and 18-21 with one prefetchnta per line 1 KB ahead (int8, which had none in the built code: 11-13 ->
 * 16-21; prefetcht0/t2 and 2-8 KB measured between; a plain 2-thread read got 17-20 there). Intel keeps its hint
 * and distance (not measured on an AVX2-only Intel). */
/* a macro: GCC 12 drops the prefetch loop of the inline prefetch_ahead inside the AVX2 int8/int4 tiles and the
 * AVX-512 int4 tile (none in their built code, checked with objdump) */
#define prefetch_line(p) __builtin_prefetch((const char *)(p) + LINE_AHEAD, 0, PREFETCH_LOCALITY)

#endif
#if defined(SY_HAVE_VNNI) || defined(SY_HAVE_BF16)
static inline void store_cols(float *y, __m512 v, int ncols) {
    if (ncols >= 16)
        _mm512_storeu_ps(y, v);
    else
        _mm512_mask_storeu_ps(y, (__mmask16)((1u << ncols) - 1), v);
}
#endif
#ifdef SY_HAVE_AVX2
/* 16 outputs held as two 8-lane halves (the 16 rows of a strip): the first ncols of them stored */
static inline void store_cols2(float *y, __m256 lo, __m256 hi, int ncols) {
    if (ncols >= 16) {
        _mm256_storeu_ps(y, lo);
        _mm256_storeu_ps(y + 8, hi);
        return;
    }
    float row[16];
    _mm256_storeu_ps(row, lo);
    _mm256_storeu_ps(row + 8, hi);
    memcpy(y, row, sizeof(float) * (ncols > 0 ? ncols : 0));
}
#endif

/* SY_FEATURE_* bits (switchyard_kernels.h); the AMX one read at run time */
int sy_lowp_features(void) {
    int f = sy_amx_ready() ? SY_FEATURE_AMX_BF16 : 0;
#ifdef SY_INT_KERNELS
    f |= SY_FEATURE_VNNI;
#endif
#ifdef SY_BF16_KERNELS
    f |= SY_FEATURE_BF16;
#endif
#ifdef SY_HAVE_BF16
    f |= SY_FEATURE_AVX512_BF16;
#endif
    return f;
}

/* Products below this many multiply-adds (of 4 int8, 8 int4 or 2 bf16 values) run on one thread: a second costs
 * more than it saves. */
#define MIN_PARALLEL_WORK 65536
static inline int threads_for(int64_t work, int threads) { return work < MIN_PARALLEL_WORK ? 1 : threads; }

#ifdef SY_HAVE_VNNI
/* xq [M, K] int8, xs [M, K/32] scales, xsum [M, K/32] = scale * sum of the block's int8 values:
 * x ~ xq * scale per block (round to nearest, |xq| <= 127). K % 32 == 0. */
static void quantize_rows_q8(const float *x, int64_t x_stride, int M, int K, int8_t *xq, float *xs, float *xsum) {
    const int nb = K / SY_QBLOCK;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb; b++) {
            const float *src = x + (int64_t)m * x_stride + b * SY_QBLOCK;
            const __m512 v0 = _mm512_loadu_ps(src), v1 = _mm512_loadu_ps(src + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
            int8_t *dst = xq + (int64_t)m * K + b * SY_QBLOCK;
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
    const int nb = K / SY_QBLOCK;
    __m512 acc[ROW_TILE][4], corr[ROW_TILE];
    for (int r = 0; r < MR; r++) {
        corr[r] = _mm512_setzero_ps();
        for (int s = 0; s < NS; s++) acc[r][s] = _mm512_setzero_ps();
    }
    for (int b = 0; b < nb; b++) {
        __m512i dot[ROW_TILE][4];
        for (int r = 0; r < MR; r++)
            for (int s = 0; s < NS; s++) dot[r][s] = _mm512_setzero_si512();
        const uint8_t *wb = w + (int64_t)b * (SY_QBLOCK / 4) * kst;
        prefetch_ahead(wb, (SY_QBLOCK / 4) * kst);
        for (int t = 0; t < SY_QBLOCK / 4; t++) {
            __m512i wv[4];
            for (int s = 0; s < NS; s++) wv[s] = _mm512_loadu_si512(wb + s * sst + t * kst);
            for (int r = 0; r < MR; r++) {
                int32_t x4;
                memcpy(&x4, xq + (int64_t)r * K + b * SY_QBLOCK + 4 * t, 4);
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
    const int nb = K / SY_QBLOCK;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[ROW_TILE][4];
    for (int r = 0; r < MR; r++)
        for (int s = 0; s < NS; s++) acc[r][s] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i dot[ROW_TILE][4];
        for (int r = 0; r < MR; r++)
            for (int s = 0; s < NS; s++) dot[r][s] = _mm512_setzero_si512();
        const uint8_t *wb = w + (int64_t)b * (SY_QBLOCK / 8) * kst;
        for (int s = 0; s < (sst == 64 ? 1 : NS); s++) prefetch_ahead(wb + s * sst, (SY_QBLOCK / 8) * kst);
        for (int t = 0; t < SY_QBLOCK / 8; t++) {
            __m512i lo[4], hi[4];
            for (int s = 0; s < NS; s++) {
                const __m512i v = _mm512_loadu_si512(wb + s * sst + t * kst);
                lo[s] = _mm512_and_si512(v, low);
                hi[s] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            for (int r = 0; r < MR; r++) {
                int32_t x0, x1;
                memcpy(&x0, xq + (int64_t)r * K + b * SY_QBLOCK + 8 * t, 4);
                memcpy(&x1, xq + (int64_t)r * K + b * SY_QBLOCK + 8 * t + 4, 4);
                const __m512i xv0 = _mm512_set1_epi32(x0), xv1 = _mm512_set1_epi32(x1);
                for (int s = 0; s < NS; s++) {
                    dot[r][s] = _mm512_dpbusd_epi32(dot[r][s], lo[s], xv0);
                    dot[r][s] = _mm512_dpbusd_epi32(dot[r][s], hi[s], xv1);
                }
            }
        }
        const int g = b * SY_QBLOCK / gs;
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

#if defined(SY_HAVE_AVX2) && !defined(SY_HAVE_VNNI)
/* AVX2 versions of the three above, same arguments and layouts. Without vpdpbusd a 4-byte dot product is
 * maddubs (u8 x s8 -> pairs summed in int16) then madd with ones (-> int32), as llama.cpp's AVX2 q8_0 path. */
static void quantize_rows_q8(const float *x, int64_t x_stride, int M, int K, int8_t *xq, float *xs, float *xsum) {
    const int nb = K / SY_QBLOCK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int m = 0; m < M; m++)
        for (int b = 0; b < nb; b++) {
            const float *src = x + (int64_t)m * x_stride + b * SY_QBLOCK;
            __m256 v[4], amax = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(src + 8 * i);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float mx = _mm_cvtss_f32(h), scale = mx / 127.0f, inv = mx > 0.0f ? 127.0f / mx : 0.0f;
            __m256i q[4];
            for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
            const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            /* packs works per 128-bit lane: the permute puts the 32 values back in order */
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(xq + (int64_t)m * K + b * SY_QBLOCK), _mm256_permutevar8x32_epi32(p, order));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
            xs[(int64_t)m * nb + b] = scale;
            xsum[(int64_t)m * nb + b] = scale * (float)_mm_cvtsi128_si32(s4);
        }
}

/* int8: the stored W + 128 flipped back to signed W (xor 0x80), then |x| (u8) times W with x's sign (s8) --
 * so no +128 correction is needed (xsum unused) and the int16 pair sums cannot saturate (2 * 127 * 127). */
static inline __attribute__((always_inline)) void q8_tile(const int8_t *xq, const float *xs, const float *xsum,
                                                          int K, int MR, int NS, const uint8_t *w, int64_t sst,
                                                          int64_t kst, const float *scales, const float *bias, float *y,
                                                          int64_t ys, int ncols) {
    (void)xsum;
    const int nb = K / SY_QBLOCK;
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 acc[ROW_TILE][4][2];
    for (int r = 0; r < MR; r++)
        for (int s = 0; s < NS; s++) acc[r][s][0] = acc[r][s][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i dot[ROW_TILE][4][2];
        for (int r = 0; r < MR; r++)
            for (int s = 0; s < NS; s++) dot[r][s][0] = dot[r][s][1] = _mm256_setzero_si256();
        const uint8_t *wb = w + (int64_t)b * (SY_QBLOCK / 4) * kst;
        for (int t = 0; t < SY_QBLOCK / 4; t++) {
            __m256i wv[4][2];
            for (int s = 0; s < NS; s++) prefetch_line(wb + s * sst + t * kst);
            for (int s = 0; s < NS; s++)
                for (int h = 0; h < 2; h++)
                    wv[s][h] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wb + s * sst + t * kst + 32 * h)),
                                                flip);
            for (int r = 0; r < MR; r++) {
                int32_t x4;
                memcpy(&x4, xq + (int64_t)r * K + b * SY_QBLOCK + 4 * t, 4);
                const __m256i xv = _mm256_set1_epi32(x4), ax = _mm256_abs_epi8(xv);
                for (int s = 0; s < NS; s++)
                    for (int h = 0; h < 2; h++)
                        dot[r][s][h] = _mm256_add_epi32(
                            dot[r][s][h],
                            _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[s][h], xv)), ones));
            }
        }
        for (int r = 0; r < MR; r++) {
            const __m256 sc = _mm256_set1_ps(xs[(int64_t)r * nb + b]);
            for (int s = 0; s < NS; s++)
                for (int h = 0; h < 2; h++)
                    acc[r][s][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][s][h]), sc, acc[r][s][h]);
        }
    }
    for (int s = 0; s < NS; s++) {
        __m256 sw[2], bv[2];
        for (int h = 0; h < 2; h++) {
            sw[h] = _mm256_loadu_ps(scales + 16 * s + 8 * h);
            bv[h] = bias ? _mm256_loadu_ps(bias + 16 * s + 8 * h) : _mm256_setzero_ps();
        }
        for (int r = 0; r < MR; r++)
            store_cols2(y + (int64_t)r * ys + 16 * s, _mm256_fmadd_ps(acc[r][s][0], sw[0], bv[0]),
                        _mm256_fmadd_ps(acc[r][s][1], sw[1], bv[1]), ncols - 16 * s);
    }
}

/* int4: nibbles (0..15, u8) times x (s8): both nibbles' pair sums fit one int16 (4 * 15 * 127). */
static inline __attribute__((always_inline)) void q4_tile(const int8_t *xq, const float *xs, const float *xsum,
                                                          int K, int MR, int NS, const uint8_t *w, int64_t sst,
                                                          int64_t kst, const uint16_t *sz, int64_t sz_strip, int gs,
                                                          const float *bias, float *y, int64_t ys, int ncols) {
    const int nb = K / SY_QBLOCK;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[ROW_TILE][4][2];
    for (int r = 0; r < MR; r++)
        for (int s = 0; s < NS; s++) acc[r][s][0] = acc[r][s][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i dot[ROW_TILE][4][2];
        for (int r = 0; r < MR; r++)
            for (int s = 0; s < NS; s++) dot[r][s][0] = dot[r][s][1] = _mm256_setzero_si256();
        const uint8_t *wb = w + (int64_t)b * (SY_QBLOCK / 8) * kst;
        for (int s = 0; s < (sst == 64 ? 1 : NS); s++) prefetch_ahead(wb + s * sst, (SY_QBLOCK / 8) * kst);
        for (int t = 0; t < SY_QBLOCK / 8; t++) {
            __m256i lo[4][2], hi[4][2];
            for (int s = 0; s < NS; s++)
                for (int h = 0; h < 2; h++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + s * sst + t * kst + 32 * h));
                    lo[s][h] = _mm256_and_si256(v, low);
                    hi[s][h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
            for (int r = 0; r < MR; r++) {
                int32_t x0, x1;
                memcpy(&x0, xq + (int64_t)r * K + b * SY_QBLOCK + 8 * t, 4);
                memcpy(&x1, xq + (int64_t)r * K + b * SY_QBLOCK + 8 * t + 4, 4);
                const __m256i xv0 = _mm256_set1_epi32(x0), xv1 = _mm256_set1_epi32(x1);
                for (int s = 0; s < NS; s++)
                    for (int h = 0; h < 2; h++) {
                        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[s][h], xv0),
                                                           _mm256_maddubs_epi16(hi[s][h], xv1));
                        dot[r][s][h] = _mm256_add_epi32(dot[r][s][h], _mm256_madd_epi16(p, ones));
                    }
            }
        }
        const int g = b * SY_QBLOCK / gs;
        for (int s = 0; s < NS; s++) {
            const uint16_t *line = sz + s * sz_strip + g * 32;
            for (int h = 0; h < 2; h++) {
                const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(line + 8 * h)));
                const __m256 scz =
                    _mm256_mul_ps(sc, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(line + 16 + 8 * h))));
                for (int r = 0; r < MR; r++) {
                    /* + scale * (sx dot(q, xq)) - scale * zero * (sx sum(xq)) */
                    const __m256 d =
                        _mm256_mul_ps(_mm256_cvtepi32_ps(dot[r][s][h]), _mm256_set1_ps(xs[(int64_t)r * nb + b]));
                    acc[r][s][h] = _mm256_fmadd_ps(sc, d, acc[r][s][h]);
                    acc[r][s][h] = _mm256_fnmadd_ps(scz, _mm256_set1_ps(xsum[(int64_t)r * nb + b]), acc[r][s][h]);
                }
            }
        }
    }
    for (int s = 0; s < NS; s++) {
        __m256 bv[2];
        for (int h = 0; h < 2; h++) bv[h] = bias ? _mm256_loadu_ps(bias + 16 * s + 8 * h) : _mm256_setzero_ps();
        for (int r = 0; r < MR; r++)
            store_cols2(y + (int64_t)r * ys + 16 * s, _mm256_add_ps(acc[r][s][0], bv[0]),
                        _mm256_add_ps(acc[r][s][1], bv[1]), ncols - 16 * s);
    }
}
#endif /* AVX2 int kernels */

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
#elif defined(SY_HAVE_AVX2)
/* AVX2: each bf16 pair widened to two fp32 vectors (a bf16 is the top half of an fp32), then two FMAs. */
static inline __attribute__((always_inline)) void bf16_tile(const uint16_t *x, int64_t xs, int K, int MR, int NS,
                                                            const uint16_t *w, int64_t kst, const float *bias,
                                                            float *y, int64_t ys, int ncols) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    __m256 acc[ROW_TILE][4][2];
    for (int r = 0; r < MR; r++)
        for (int s = 0; s < NS; s++) acc[r][s][0] = acc[r][s][1] = _mm256_setzero_ps();
    for (int t = 0; t < K / 2; t++) {
        for (int s = 0; s < NS; s++) prefetch_line(w + s * 32 + t * kst);
        __m256 xe[ROW_TILE], xo[ROW_TILE];
        for (int r = 0; r < MR; r++) {
            uint32_t x2, e, o;
            memcpy(&x2, x + (int64_t)r * xs + 2 * t, 4);
            e = x2 << 16, o = x2 & 0xffff0000u;
            float fe, fo;
            memcpy(&fe, &e, 4);
            memcpy(&fo, &o, 4);
            xe[r] = _mm256_set1_ps(fe), xo[r] = _mm256_set1_ps(fo);
        }
        for (int s = 0; s < NS; s++)
            for (int h = 0; h < 2; h++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + s * 32 + t * kst + 16 * h));
                const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                for (int r = 0; r < MR; r++)
                    acc[r][s][h] = _mm256_fmadd_ps(odd, xo[r], _mm256_fmadd_ps(even, xe[r], acc[r][s][h]));
            }
    }
    for (int s = 0; s < NS; s++) {
        __m256 bv[2];
        for (int h = 0; h < 2; h++) bv[h] = bias ? _mm256_loadu_ps(bias + 16 * s + 8 * h) : _mm256_setzero_ps();
        for (int r = 0; r < MR; r++)
            store_cols2(y + (int64_t)r * ys + 16 * s, _mm256_add_ps(acc[r][s][0], bv[0]),
                        _mm256_add_ps(acc[r][s][1], bv[1]), ncols - 16 * s);
    }
}
#endif

/* The strip-group x row-tile walk shared by the three GEMMs, over strips [S_FIRST, S_LAST) of the NSG-strip
 * groups (the last group may be narrower; a range may start or end inside a group). TILE(mr, ns, m0, g0, j, ng,
 * ncols) runs one tile with literal mr (1..ROW_TILE) and ns: rows m0.., strips g0 + j.. of the group starting at
 * strip g0 (ng strips, interleaved); tiles TS strips wide (TS divides NSG) over whole groups, one strip wide over
 * the rest. */
#define WALK(NSG, TS, TILE, S_FIRST, S_LAST)                                                                     \
    do {                                                                                                         \
        const int64_t strips = (N + 15) / 16;                                                                    \
        for (int64_t gi = (S_FIRST) / (NSG); gi * (NSG) < (S_LAST); gi++) {                                      \
            const int64_t g0 = gi * (NSG);                                                                       \
            const int ns = strips - g0 < (NSG) ? (int)(strips - g0) : (NSG);                                     \
            const int ja = (S_FIRST) > g0 ? (int)((S_FIRST) - g0) : 0;                                           \
            const int jb = (S_LAST) - g0 < ns ? (int)((S_LAST) - g0) : ns;                                       \
            const int ncols = N - g0 * 16 < 16 * ns ? (int)(N - g0 * 16) : 16 * ns;                              \
            for (int m0 = 0; m0 < M; m0 += ROW_TILE) {                                                           \
                const int mr = M - m0 < ROW_TILE ? M - m0 : ROW_TILE;                                            \
                if (ns == (NSG) && ja == 0 && jb == ns) {                                                        \
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
                    for (int j = ja; j < jb; j++) {                                                              \
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

/* Thread t of nt takes a contiguous range [first, last) of the ceil(N / 16) strips (each weight byte read by one
 * core at decode), cut at even strips: a pair's lines share a 128-byte block, which Intel's adjacent-line
 * prefetcher fetches together. Cut in tile groups instead, SmolLM2's 576-wide projections (9 groups of 4 bf16
 * strips) went 4 / 5 and one thread waited ~830 us of a 10 ms batch-1 step at the barriers (AMX Xeon). Small
 * products run on thread 0 alone. */
static inline void strip_share(int64_t N, int64_t work, int t, int nt, int64_t *first, int64_t *last) {
    const int64_t strips = (N + 15) / 16;
    nt = threads_for(work, nt);
    *first = t < nt ? (strips * t / nt) & ~(int64_t)1 : 0;
    *last = t < nt ? (t == nt - 1 ? strips : (strips * (t + 1) / nt) & ~(int64_t)1) : 0;
}

/* Run PART(t, nt) on `threads` threads (the per-op entry points; the decode step calls the parts inside its
 * own parallel region). */
#ifdef _OPENMP
#define ON_THREADS(threads, PART)                                                                                \
    do {                                                                                                         \
        _Pragma("omp parallel num_threads(threads)") PART(omp_get_thread_num(), omp_get_num_threads());         \
    } while (0)
#else
#define ON_THREADS(threads, PART) PART(0, 1)
#endif

/* The entry points return 0, or 2 when this build lacks the instructions or the shape does not fit (the caller
 * then uses the torch reference). Each has a part (sy_part_*: thread t of nt does its share of the strip
 * groups, x already rounded into scratch; no synchronisation) for the native decode step. */

/* The int8 rows of x at the start of scratch, then their block scales and scaled sums (64-byte aligned); the
 * caller sizes scratch as M * K + 8 * M * (K / 32) + 64 bytes (cpu_lowp.py). */
static inline void q8_split(void *scratch, int M, int K, int8_t **xq, float **xs, float **xsum) {
    *xq = (int8_t *)scratch;
    *xs = (float *)(((uintptr_t)scratch + (uintptr_t)M * K + 63) & ~(uintptr_t)63);
    *xsum = *xs + (int64_t)M * (K / SY_QBLOCK);
}

/* Rows [r0, r1) of fp32 x [M, K] (row stride x_stride) rounded into scratch as sy_part_linear_q8/q4 read them
 * (int8 per block of 32 with a scale). Returns 0, or 2 without VNNI or with K % 32 != 0. */
int sy_quantize_rows_q8(const float *x, int64_t x_stride, int M, int K, void *scratch, int r0, int r1) {
#ifdef SY_INT_KERNELS
    if (K % SY_QBLOCK) return 2;
    int8_t *xq;
    float *xs, *xsum;
    q8_split(scratch, M, K, &xq, &xs, &xsum);
    const int nb = K / SY_QBLOCK;
    quantize_rows_q8(x + (int64_t)r0 * x_stride, x_stride, r1 - r0, K, xq + (int64_t)r0 * K, xs + (int64_t)r0 * nb,
                     xsum + (int64_t)r0 * nb);
    return 0;
#else
    (void)x, (void)x_stride, (void)M, (void)K, (void)scratch, (void)r0, (void)r1;
    return 2;
#endif
}

/* y [M, N] (row stride ys) = x dequant(W)^T, x [M, K] as sy_quantize_rows_q8 left it in scratch; W packed int8
 * strips [strips][K/4][64] (K * 16 bytes per strip; groups of SY_GROUP_Q8 interleaved), scales [strips * 16] fp32
 * and bias [strips * 16] or NULL (both zero-padded past N). Thread t of nt's share. */
void sy_part_linear_q8(int M, int K, const void *scratch, const uint8_t *w, const float *scales, const float *bias,
                       float *y, int64_t ys, int64_t N, int t, int nt) {
#ifdef SY_INT_KERNELS
    int8_t *xq;
    float *xs, *xsum;
    q8_split((void *)scratch, M, K, &xq, &xs, &xsum);
    const int64_t strip = (int64_t)K * 16, nb = K / SY_QBLOCK;
    int64_t first, last;
    strip_share(N, (int64_t)M * N * K / 4, t, nt, &first, &last);
#define Q8(MR, NS, m0, g0, j, ng, nc)                                                                            \
    q8_tile(xq + (int64_t)(m0)*K, xs + (int64_t)(m0)*nb, xsum + (int64_t)(m0)*nb, K, MR, NS,                   \
            w + (g0)*strip + (j)*64, 64, (ng)*64, scales + ((g0) + (j)) * 16, bias ? bias + ((g0) + (j)) * 16 : NULL,  \
            y + (int64_t)(m0)*ys + ((g0) + (j)) * 16, ys, nc)
    WALK(SY_GROUP_Q8, SY_GROUP_Q8, Q8, first, last);
#undef Q8
#else
    (void)M, (void)K, (void)scratch, (void)w, (void)scales, (void)bias, (void)y, (void)ys, (void)N, (void)t, (void)nt;
#endif
}

/* sy_part_linear_q8 from fp32 x [M, K] (row stride x_stride), rounded into scratch first. One call per layer. */
int sy_linear_q8(const float *x, int64_t x_stride, int M, int K, void *scratch, const uint8_t *w,
                 const float *scales, const float *bias, float *y, int64_t ys, int64_t N, int threads) {
    if (sy_quantize_rows_q8(x, x_stride, M, K, scratch, 0, M)) return 2;
    threads = threads_for((int64_t)M * N * K / 4, threads);
#define PART(t, nt) sy_part_linear_q8(M, K, scratch, w, scales, bias, y, ys, N, t, nt)
    ON_THREADS(threads, PART);
#undef PART
    return 0;
}

/* As sy_part_linear_q8 for 4-bit weights: strips [strips][K/8][64] (K * 8 bytes per strip, GROUP_Q4),
 * sz [strips][K/gs][2][16] fp16 (scale, zero point), group size gs a multiple of 32 dividing K (checked by
 * sy_linear_q4 / the decode step's plan). */
void sy_part_linear_q4(int M, int K, const void *scratch, const uint8_t *w, const uint16_t *sz, int gs,
                       const float *bias, float *y, int64_t ys, int64_t N, int t, int nt) {
#ifdef SY_INT_KERNELS
    int8_t *xq;
    float *xs, *xsum;
    q8_split((void *)scratch, M, K, &xq, &xs, &xsum);
    const int64_t strip = (int64_t)K * 8, sz_strip = (int64_t)(K / gs) * 32, nb = K / SY_QBLOCK;
    int64_t first, last;
    strip_share(N, (int64_t)M * N * K / 8, t, nt, &first, &last);
#define Q4(MR, NS, m0, g0, j, ng, nc)                                                                            \
    q4_tile(xq + (int64_t)(m0)*K, xs + (int64_t)(m0)*nb, xsum + (int64_t)(m0)*nb, K, MR, NS,                   \
            w + ((g0) + (j)) * strip, strip, 64, sz + ((g0) + (j)) * sz_strip, sz_strip, gs,                     \
            bias ? bias + ((g0) + (j)) * 16 : NULL, y + (int64_t)(m0)*ys + ((g0) + (j)) * 16, ys, nc)
    /* A few rows (decode): one strip at a time read 25-29 GB/s over SmolLM2's int4 layers against 18-20 with two
     * side by side (measured here); more rows are compute-bound and want the wider tile. */
    if (M <= 4)
        WALK(GROUP_Q4, 1, Q4, first, last);
    else
        WALK(GROUP_Q4, GROUP_Q4, Q4, first, last);
#undef Q4
#else
    (void)M, (void)K, (void)scratch, (void)w, (void)sz, (void)gs, (void)bias, (void)y, (void)ys, (void)N, (void)t,
        (void)nt;
#endif
}

int sy_linear_q4(const float *x, int64_t x_stride, int M, int K, void *scratch, const uint8_t *w, const uint16_t *sz,
                 int gs, const float *bias, float *y, int64_t ys, int64_t N, int threads) {
    if (gs <= 0 || gs % SY_QBLOCK || K % gs || sy_quantize_rows_q8(x, x_stride, M, K, scratch, 0, M)) return 2;
    threads = threads_for((int64_t)M * N * K / 8, threads);
#define PART(t, nt) sy_part_linear_q4(M, K, scratch, w, sz, gs, bias, y, ys, N, t, nt)
    ON_THREADS(threads, PART);
#undef PART
    return 0;
}

/* y [M, N] fp32 (row stride ys) = x W^T (+ bias fp32); x bf16 [M, K] (row stride xs, in elements); W packed bf16
 * strips [strips][K/2][32] (K * 16 elements per strip, SY_GROUP_BF16). K even. Thread t of nt's share. */
void sy_part_gemm_bf16(const uint16_t *x, int64_t xs, int M, int K, const uint16_t *w, const float *bias, float *y,
                       int64_t ys, int64_t N, int t, int nt) {
#ifdef SY_BF16_KERNELS
    const int64_t strip = (int64_t)K * 16, work = (int64_t)M * N * K / 2;
    int64_t first, last;
    strip_share(N, work, t, nt, &first, &last);
    /* AMX at every row count: at batch 1 it reads the weights as fast as the strips (measured) */
    if (sy_amx_part_bf16(x, xs, M, K, w, SY_GROUP_BF16, bias, y, ys, N, first, last)) return;
#define BF(MR, NS, m0, g0, j, ng, nc)                                                                            \
    bf16_tile(x + (int64_t)(m0)*xs, xs, K, MR, NS, w + (g0)*strip + (j)*32, (ng)*32,                             \
              bias ? bias + ((g0) + (j)) * 16 : NULL, y + (int64_t)(m0)*ys + ((g0) + (j)) * 16, ys, nc)
    WALK(SY_GROUP_BF16, SY_GROUP_BF16, BF, first, last);
#undef BF
#else
    (void)x, (void)xs, (void)M, (void)K, (void)w, (void)bias, (void)y, (void)ys, (void)N, (void)t, (void)nt;
#endif
}

int sy_gemm_bf16(const uint16_t *x, int64_t xs, int M, int K, const uint16_t *w, const float *bias, float *y,
                 int64_t ys, int64_t N, int threads) {
#ifdef SY_BF16_KERNELS
    threads = threads_for((int64_t)M * N * K / 2, threads);
#define PART(t, nt) sy_part_gemm_bf16(x, xs, M, K, w, bias, y, ys, N, t, nt)
    ON_THREADS(threads, PART);
#undef PART
    return 0;
#else
    (void)x, (void)xs, (void)M, (void)K, (void)w, (void)bias, (void)y, (void)ys, (void)N, (void)threads;
    return 2;
#endif
}
