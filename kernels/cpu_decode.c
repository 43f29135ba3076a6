/* One decode step of a Llama-family decoder, every layer in one native call (kernels/cpu_decode.py builds the
 * plan once per model and calls it per step):
 *   sy_decode_layers   for B sequences with one new token each: for every layer, RMSNorm (+ residual), the
 *                      fused QKV projection, rotary, the KV-cache write, paged decode attention, the output
 *                      projection, RMSNorm + residual, gate_up, SiLU-and-multiply, down.
 * It calls the same kernels the per-op path calls one by one from Python (cpu_native.c, cpu_lowp.c), so an
 * fp32 step's results equal that path's; what it removes is the Python between them (~11 calls per layer,
 * each with its argument checks, tensor allocations and ctypes marshalling: ~180 us per layer measured at
 * batch 1, as much as reading an int8 layer's weights). Activations are fp32 throughout; bf16 weights see
 * their input rounded to bf16 (as the per-op path's bf16 model does), a bf16 cache gets its K/V rounded. */
#include <stdint.h>
#include <string.h>

/* The kernels of the other two sources (one library). */
int sy_decode_attention(const float *q, int64_t q_sb, int64_t q_sh, float scale, const void *k_cache,
                        const void *v_cache, int is_bf16, int64_t sb, int64_t so, int64_t sh, int64_t num_blocks,
                        int block_size, const int32_t *tables, int64_t table_stride, int64_t table_width,
                        const int32_t *lens, int B, int Hq, int Hkv, int D, float *out, float *scratch,
                        int64_t scratch_stride, int threads);
void sy_gemm_panels_f32(const float *x, int64_t xs, const float *panels, const float *bias, float *y, int64_t ys,
                        int M, int64_t N, int64_t K, int threads);
int sy_rotary_f32(const float *q, int64_t q_st, int64_t q_sh, int Hq, const float *k, int64_t k_st, int64_t k_sh,
                  int Hkv, int T, int D, const int64_t *pos, const float *cos_sin, int64_t max_position,
                  float *q_out, float *k_out);
int sy_store_kv_f32(const float *key, const float *value, int64_t kst, int64_t ksh, int64_t vst, int64_t vsh,
                    float *k_cache, float *v_cache, int64_t cb, int64_t co, int64_t ch, int64_t num_slots,
                    int block_size, const int64_t *slots, int T, int H, int D);
void sy_rms_norm_f32(const float *x, int64_t x_stride, const float *res, int64_t res_stride, const float *w,
                     float *out, float *new_res, int T, int H, float eps);
void sy_silu_mul_f32(const float *gu, int64_t gs, float *out, int T, int inter, int threads);
int sy_linear_q8(const float *x, int64_t x_stride, int M, int K, void *scratch, const uint8_t *w,
                 const float *scales, const float *bias, float *y, int64_t ys, int64_t N, int threads);
int sy_linear_q4(const float *x, int64_t x_stride, int M, int K, void *scratch, const uint8_t *w, const uint16_t *sz,
                 int gs, const float *bias, float *y, int64_t ys, int64_t N, int threads);
int sy_gemm_bf16(const uint16_t *x, int64_t xs, int M, int K, const uint16_t *w, const float *bias, float *y,
                 int64_t ys, int64_t N, int threads);

/* Layouts shared with cpu_decode.py (ctypes Structures of the same fields, in the same order). */
enum { PROJ_F32_PANELS = 1, PROJ_INT8 = 2, PROJ_INT4 = 3, PROJ_BF16 = 4 };

typedef struct {
    int32_t kind, group_size; /* group_size: int4 only */
    int64_t n, k;
    const void *w;     /* fp32 panels, or int8 / int4 / bf16 strips */
    const void *aux;   /* int8: fp32 scales per row; int4: fp16 (scale, zero) per strip and group; else NULL */
    const float *bias; /* fp32 (padded to the strips' rows for the strip kinds) or NULL */
} sy_proj;

typedef struct {
    const float *input_norm, *post_norm; /* fp32 [hidden] */
    void *k_cache, *v_cache;             /* [num_blocks, block_size, Hkv, D], fp32 or bf16 */
    sy_proj qkv, o, gate_up, down;
} sy_layer;

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter;
    float eps, scale;
    int32_t kv_bf16, block_size;
    int64_t cache_sb, cache_so, cache_sh, num_blocks; /* cache strides in elements (the same for every layer) */
    const float *cos_sin;                            /* [max_position, D] fp32 */
    int64_t max_position;
    const sy_layer *layers;
} sy_model;

enum { ERR_BLOCK = -1, ERR_SHAPE = -2, ERR_TABLE = -3, ERR_POSITION = -4, ERR_SLOT = -5, ERR_KERNEL = -6 };

static inline int64_t align64(int64_t bytes) { return (bytes + 63) & ~(int64_t)63; }

static inline uint16_t bf16_round(float f) { /* round to nearest even; NaN stays NaN (quiet) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static void to_bf16(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = bf16_round(x[i]);
}

/* y [M, p->n] (contiguous) = x [M, p->k] (contiguous) @ W^T (+ bias). `lowp` is scratch for the rounded
 * activations: M * K + 8 * M * (K / 32) + 64 bytes (int8/int4) or 2 * M * K (bf16). */
static int project(const sy_proj *p, const float *x, int M, float *y, void *lowp, int threads) {
    const int K = (int)p->k;
    switch (p->kind) {
    case PROJ_F32_PANELS:
        sy_gemm_panels_f32(x, K, (const float *)p->w, p->bias, y, p->n, M, p->n, K, threads);
        return 0;
    case PROJ_INT8:
        return sy_linear_q8(x, K, M, K, lowp, (const uint8_t *)p->w, (const float *)p->aux, p->bias, y, p->n, p->n,
                            threads);
    case PROJ_INT4:
        return sy_linear_q4(x, K, M, K, lowp, (const uint8_t *)p->w, (const uint16_t *)p->aux, p->group_size,
                            p->bias, y, p->n, p->n, threads);
    case PROJ_BF16:
        to_bf16(x, (int64_t)M * K, (uint16_t *)lowp);
        return sy_gemm_bf16((const uint16_t *)lowp, K, M, K, (const uint16_t *)p->w, p->bias, y, p->n, p->n, threads);
    default:
        return 2;
    }
}

/* bf16 cache: the KV write with K/V rounded (the fp32 one is sy_store_kv_f32). Slots checked by the caller. */
static void store_kv_bf16(const float *key, const float *value, int64_t kst, int64_t vst, uint16_t *k_cache,
                          uint16_t *v_cache, int64_t cb, int64_t co, int64_t ch, int block_size, const int64_t *slots,
                          int T, int H, int D) {
    for (int t = 0; t < T; t++) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        const int64_t base = (s / block_size) * cb + (s % block_size) * co;
        for (int h = 0; h < H; h++) {
            to_bf16(key + t * kst + (int64_t)h * D, D, k_cache + base + h * ch);
            to_bf16(value + t * vst + (int64_t)h * D, D, v_cache + base + h * ch);
        }
    }
}

static inline void *next_buffer(char *at, int64_t *off, int64_t bytes) {
    void *p = at ? at + *off : NULL;
    *off += align64(bytes);
    return p;
}

/* The step's buffers, carved out of one workspace (base NULL: only the size is computed). */
typedef struct {
    float *x, *qkv, *q_rot, *k_rot, *attn, *gate_up, *act, *scores;
    void *lowp; /* rounded activations of the widest projection input (int8 + block scales, or bf16) */
    int64_t bytes;
} sy_buffers;

static sy_buffers carve(const sy_model *m, int B, int max_len, int threads, char *base) {
    const int64_t H = m->hidden, I = m->inter, qd = (int64_t)m->num_heads * m->head_dim;
    const int64_t kvd = (int64_t)m->num_kv_heads * m->head_dim;
    int64_t k = H > I ? H : I;
    k = k > qd ? k : qd;
    const int64_t q8 = B * k + 8 * B * (k / 32) + 64, b16 = 2 * B * k;
    char *at = base ? (char *)(((uintptr_t)base + 63) & ~(uintptr_t)63) : NULL;
    int64_t off = 0;
#define CARVE(type, bytes) ((type *)next_buffer(at, &off, bytes))
    sy_buffers b;
    b.x = CARVE(float, B * H * 4);
    b.qkv = CARVE(float, B * (qd + 2 * kvd) * 4);
    b.q_rot = CARVE(float, B * qd * 4);
    b.k_rot = CARVE(float, B * kvd * 4);
    b.attn = CARVE(float, B * qd * 4);
    b.gate_up = CARVE(float, B * 2 * I * 4);
    b.act = CARVE(float, B * I * 4);
    b.lowp = CARVE(char, q8 > b16 ? q8 : b16);
    b.scores = CARVE(float, (int64_t)threads * m->num_heads * ((max_len + 15) / 16 * 16) * 4);
#undef CARVE
    b.bytes = off + 64; /* + the base's alignment */
    return b;
}

/* hidden [B, H] fp32 (the embedded tokens) -> hidden, residual [B, H]: the last layer's output and the residual
 * stream before it, as LlamaForCausalLM's layer loop leaves them (the final norm and the head stay in Python).
 * positions, slots int64 [B]; tables int32 [B, table_width]; lens int32 [B] (context including the new token).
 * Returns 0; a positive number of workspace bytes when `workspace_size` is smaller (nothing done); or a
 * negative ERR_*. Slots and positions are checked before the first KV write, block ids before any read. */
int64_t sy_decode_layers(const sy_model *m, const float *hidden_in, int B, const int64_t *positions,
                         const int64_t *slots, const int32_t *tables, int64_t table_width, const int32_t *lens,
                         float *hidden, float *residual, void *workspace, int64_t workspace_size, int threads) {
    if (B <= 0) return 0;
    const int H = m->hidden, Hq = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim, I = m->inter;
    const int64_t qd = (int64_t)Hq * D, kvd = (int64_t)Hkv * D, nqkv = qd + 2 * kvd;
    const int64_t num_slots = m->num_blocks * m->block_size;
    int max_len = 1;
    for (int b = 0; b < B; b++) {
        if (positions[b] < 0 || positions[b] >= m->max_position) return ERR_POSITION;
        if (slots[b] >= num_slots) return ERR_SLOT;
        if (lens[b] > max_len) max_len = lens[b];
    }
    const int64_t need = carve(m, B, max_len, threads, NULL).bytes;
    if (workspace_size < need) return need;
    const sy_buffers w = carve(m, B, max_len, threads, (char *)workspace);
    float *x = w.x, *qkv = w.qkv, *q_rot = w.q_rot, *k_rot = w.k_rot, *attn = w.attn, *gate_up = w.gate_up;
    float *act = w.act, *scores = w.scores;
    void *lowp = w.lowp;
    const int64_t score_stride = (int64_t)Hq * ((max_len + 15) / 16 * 16);

    for (int l = 0; l < m->num_layers; l++) {
        const sy_layer *L = &m->layers[l];
        /* residual += hidden; x = norm(residual) (layer 0: residual = the embedded tokens) */
        sy_rms_norm_f32(l ? hidden : hidden_in, H, l ? residual : NULL, H, L->input_norm, x, l ? residual : NULL, B,
                        H, m->eps);
        if (!l) memcpy(residual, hidden_in, sizeof(float) * B * H);
        if (project(&L->qkv, x, B, qkv, lowp, threads)) return ERR_KERNEL;
        if (sy_rotary_f32(qkv, nqkv, D, Hq, qkv + qd, nqkv, D, Hkv, B, D, positions, m->cos_sin, m->max_position,
                          q_rot, k_rot))
            return ERR_POSITION;
        if (m->kv_bf16)
            store_kv_bf16(k_rot, qkv + qd + kvd, kvd, nqkv, (uint16_t *)L->k_cache, (uint16_t *)L->v_cache,
                          m->cache_sb, m->cache_so, m->cache_sh, m->block_size, slots, B, Hkv, D);
        else if (sy_store_kv_f32(k_rot, qkv + qd + kvd, kvd, D, nqkv, D, (float *)L->k_cache, (float *)L->v_cache,
                                 m->cache_sb, m->cache_so, m->cache_sh, num_slots, m->block_size, slots, B, Hkv, D))
            return ERR_SLOT;
        const int rc = sy_decode_attention(q_rot, qd, D, m->scale, L->k_cache, L->v_cache, m->kv_bf16, m->cache_sb,
                                           m->cache_so, m->cache_sh, m->num_blocks, m->block_size, tables,
                                           table_width, table_width, lens, B, Hq, Hkv, D, attn, scores, score_stride,
                                           threads);
        if (rc == 1) return ERR_BLOCK;
        if (rc == 3) return ERR_TABLE;
        if (rc) return ERR_SHAPE;
        if (project(&L->o, attn, B, hidden, lowp, threads)) return ERR_KERNEL;
        sy_rms_norm_f32(hidden, H, residual, H, L->post_norm, x, residual, B, H, m->eps);
        if (project(&L->gate_up, x, B, gate_up, lowp, threads)) return ERR_KERNEL;
        sy_silu_mul_f32(gate_up, 2 * (int64_t)I, act, B, I, threads);
        if (project(&L->down, act, B, hidden, lowp, threads)) return ERR_KERNEL;
    }
    return 0;
}
