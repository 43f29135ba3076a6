/* The row-wise ops of a bf16 model's per-op forward (prefill and mixed steps), compiled into the kernels library:
 *   sy_rms_norm_bf16   RMSNorm fused with the residual add
 *   sy_rotary_bf16     HF rotate_half rotary embedding of q and k into new contiguous tensors
 *   sy_silu_mul_bf16   silu(gate) * up from the fused gate_up projection
 * Each rounds to bf16 where HF's bf16 modules (and kernels/reference.py) do, with fp32 math in between, so the
 * results are the reference's up to the order of the RMS mean's sum and exp's last ulp. Why: torch runs each of
 * these as 4-8 elementwise passes over bf16 tensors with a conversion in each; at a 64-prompt batch they were ~10%
 * of a bf16 server's samples on a Xeon. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "switchyard_kernels.h" /* the declared interface: prototypes, shared structs and constants */
#include "cpu_bf16.h" /* bf16_round, bf16_widen */
#include "cpu_exp.h"

typedef float f16v __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline f16v exp_nonpos(f16v x) { EXP_NONPOS_BODY(f16v, i16v); }

/* f rounded to bf16 (as bf16_round, 16 lanes) and widened back: an intermediate the reference keeps in bf16 */
static inline f16v round16(f16v f) {
    const u32x16 u = (u32x16)f;
    const u32x16 nan = (u32x16)((u & 0x7fffffffu) > 0x7f800000u);
    const u32x16 r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return (f16v)((nan & 0x7fc00000u) | (~nan & r));
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
/* -march=native may prefer 256-bit vectors, which split the generic 16-lane conversions below into halves */
static inline f16v load16(const uint16_t *p) {
    return (f16v)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline void store16(uint16_t *p, f16v f) { _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh((__m512)f)); }
#else
static inline f16v load16(const uint16_t *p) {
    const u16x16 h = *(const u16x16 *)p;
    return (f16v)(__builtin_convertvector(h, u32x16) << 16);
}
static inline void store16(uint16_t *p, f16v f) { *(u16x16 *)p = __builtin_convertvector((u32x16)round16(f) >> 16, u16x16); }
#endif

/* s = bf16(x + res) (kept as new_res) or x; out = bf16(w * bf16(s * (1 / sqrt(mean(s^2) + eps)))).
 * Rows of x and res at t * stride, outputs contiguous [T, H]. */
void sy_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *res, int64_t res_stride,
                      const uint16_t *w, uint16_t *out, uint16_t *new_res, int T, int H, float eps, int threads) {
    const int hv = H - H % 16;
    if ((int64_t)T * H < 65536) threads = 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < T; t++) {
        const uint16_t *s = x + t * x_stride;
        if (res) {
            const uint16_t *rr = res + t * res_stride;
            uint16_t *nr = new_res + (int64_t)t * H;
            for (int i = 0; i < hv; i += 16) store16(nr + i, load16(s + i) + load16(rr + i));
            for (int i = hv; i < H; i++) nr[i] = bf16_round(bf16_widen(s[i]) + bf16_widen(rr[i]));
            s = nr;
        }
        f16v acc = {0};
        for (int i = 0; i < hv; i += 16) acc += load16(s + i) * load16(s + i);
        float sum = 0.0f;
        for (int i = 0; i < 16; i++) sum += acc[i];
        for (int i = hv; i < H; i++) sum += bf16_widen(s[i]) * bf16_widen(s[i]);
        const float inv = 1.0f / sqrtf(sum / (float)H + eps);
        uint16_t *o = out + (int64_t)t * H;
        for (int i = 0; i < hv; i += 16) store16(o + i, load16(w + i) * round16(load16(s + i) * inv));
        for (int i = hv; i < H; i++)
            o[i] = bf16_round(bf16_widen(w[i]) * bf16_widen(bf16_round(bf16_widen(s[i]) * inv)));
    }
}

/* out[..., :D/2] = bf16(x1*cos - x2*sin), out[..., D/2:] = bf16(x2*cos + x1*sin) in fp32 without FMA contraction
 * (the reference's separate multiplies and add). Returns 0, or 1 if a position is outside [0, max_position). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static int rotary_one(const uint16_t *x, int64_t x_st, int64_t x_sh, int T, int H, int D, const int64_t *pos,
                      const float *cos_sin, int64_t max_position, uint16_t *out) {
    const int half = D / 2;
    for (int t = 0; t < T; t++) {
        if (pos[t] < 0 || pos[t] >= max_position) return 1;
        const float *cs = cos_sin + pos[t] * D;
        for (int h = 0; h < H; h++) {
            const uint16_t *xr = x + t * x_st + h * x_sh;
            uint16_t *o = out + ((int64_t)t * H + h) * D;
            for (int i = 0; i < half; i++) {
                const float x1 = bf16_widen(xr[i]), x2 = bf16_widen(xr[i + half]);
                const float a = x1 * cs[i], b = x2 * cs[half + i], c = x2 * cs[i], d = x1 * cs[half + i];
                o[i] = bf16_round(a - b);
                o[i + half] = bf16_round(c + d);
            }
        }
    }
    return 0;
}

int sy_rotary_bf16(const uint16_t *q, int64_t q_st, int64_t q_sh, int Hq, const uint16_t *k, int64_t k_st,
                   int64_t k_sh, int Hkv, int T, int D, const int64_t *pos, const float *cos_sin, int64_t max_position,
                   uint16_t *q_out, uint16_t *k_out) {
    return rotary_one(q, q_st, q_sh, T, Hq, D, pos, cos_sin, max_position, q_out) |
           rotary_one(k, k_st, k_sh, T, Hkv, D, pos, cos_sin, max_position, k_out);
}

/* out = bf16(bf16(silu(g)) * u) for g, u the two halves of a gate_up row (F.silu on bf16, then the bf16
 * multiply); silu(g) = g / (1 + e) for g >= 0, g e / (1 + e) below, e = exp(-|g|) (no overflow). */
static void silu_mul_row(const uint16_t *g, uint16_t *o, int inter) {
    const int iv = inter - inter % 16;
    const uint16_t *u = g + inter;
    for (int i = 0; i < iv; i += 16) {
        const f16v x = load16(g + i);
        const i16v neg = x < 0.0f;
        const f16v e = exp_nonpos((f16v){0} - (f16v)((i16v)x & 0x7fffffff));
        const f16v num = (f16v)((neg & (i16v)(x * e)) | (~neg & (i16v)x));
        store16(o + i, round16(num / (1.0f + e)) * load16(u + i));
    }
    for (int i = iv; i < inter; i++) {
        const float x = bf16_widen(g[i]), e = expf(-fabsf(x));
        o[i] = bf16_round(bf16_widen(bf16_round((x < 0.0f ? x * e : x) / (1.0f + e))) * bf16_widen(u[i]));
    }
}

void sy_silu_mul_bf16(const uint16_t *gu, int64_t gs, uint16_t *out, int T, int inter, int threads) {
    if ((int64_t)T * inter < 65536) threads = 1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < T; t++) silu_mul_row(gu + (int64_t)t * gs, out + (int64_t)t * inter, inter);
}
