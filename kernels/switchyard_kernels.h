/* The declared interface of the CPU kernels. Every .c file of kernels/ is compiled into one library
 * (kernels/cpu_native.py builds it) and includes this header, which holds, once each:
 *   - the shared constants (limits the Python side checks before a call, packing layouts, feature bits, codes);
 *   - the structs of the decode plan (mirrored by the ctypes Structures of kernels/cpu_decode.py);
 *   - the prototype of every function the library exports, whether Python calls it or another .c file does.
 * kernels/native_interface.py reads this file and sets the ctypes signatures from the prototypes, so keep them in
 * its format: one declaration per prototype, `return_type sy_name(type name, ...);`, parameter types void, int,
 * int32_t, int64_t, float, or a pointer (an address to Python; a returned `const char *` a string). cpu_abi.c
 * reports the structs' sizes and offsets and the constants' values as compiled, and
 * tests/kernels/test_kernel_c_interface.py compares them with the Python side. */
#ifndef SWITCHYARD_KERNELS_H
#define SWITCHYARD_KERNELS_H

#include <stdint.h>

/* ------------------------------------------------------------------------------------------------ constants */

/* Attention (cpu_native.c): the largest shapes its per-thread buffers take. */
#define SY_MAX_Q_HEADS 128
#define SY_MAX_HEAD_DIM 256
#define SY_MAX_BLOCK_ROW 16384 /* block_size * Hkv * D values converted per block for bf16 caches */
/* AMX prefill attention (cpu_amx_attention.c): positions per softmax step; V^T holds each sequence's length
 * rounded up to it. */
#define SY_AMX_KEY_CHUNK 64

/* Packed layouts: output features per panel of sy_pack_panels_f32; k values per activation scale of
 * sy_quantize_rows_q8; strips per tile group, interleaved step by step (int8, bf16; int4: none). */
#define SY_PANEL_N 48
#define SY_QBLOCK 32
#define SY_GROUP_Q8 2
#define SY_GROUP_BF16 4

/* sy_lowp_features bits: int8/int4 kernels, bf16 kernels, the bf16 ones on AVX512-BF16 dot products, bf16
 * products on AMX tiles (CPU, OS and sy_amx_enable allowing; read at run time). */
#define SY_FEATURE_VNNI 1
#define SY_FEATURE_BF16 2
#define SY_FEATURE_AVX512_BF16 4
#define SY_FEATURE_AMX_BF16 8

/* sy_proj.kind */
enum { SY_PROJ_F32_PANELS = 1, SY_PROJ_INT8 = 2, SY_PROJ_INT4 = 3, SY_PROJ_BF16 = 4 };

/* sy_decode_layers / sy_decode_greedy failures (nothing done); -2 and -6 retired */
enum {
    SY_ERR_BLOCK = -1,
    SY_ERR_TABLE = -3,
    SY_ERR_POSITION = -4,
    SY_ERR_SLOT = -5,
    SY_ERR_NO_HEAD = -7,
    SY_ERR_TOKEN = -8
};

/* ---------------------------------------------------------------------------- the decode plan (cpu_decode.c) */

typedef struct {
    int32_t kind, group_size; /* SY_PROJ_*; group_size: int4 only */
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
    const float *final_norm; /* fp32 [hidden], or NULL: no head in the plan (the caller projects) */
    sy_proj head;            /* [vocab rows, hidden]; w NULL when final_norm is */
} sy_model;

/* --------------------------------------------------------------------------------------------- functions */

/* cpu_native.c: fp32 attention (0, 1: a block id outside the pool, 2: not taken, 3: a length the table cannot
 * hold), the few-row GEMV, the panel GEMM, rotary, KV write, RMSNorm, SiLU-and-multiply */
int64_t sy_decode_attention_parts(int B, int Hq, int Hkv, int D, int threads);
int sy_decode_attention_shape_ok(int Hq, int Hkv, int D, int block_size, int is_bf16);
int sy_decode_attention(const float *q, int64_t q_sb, int64_t q_sh, float scale, const void *k_cache,
                        const void *v_cache, int is_bf16, int64_t sb, int64_t so, int64_t sh, int64_t num_blocks,
                        int block_size, const int32_t *tables, int64_t table_stride, int64_t table_width,
                        const int32_t *lens, const int64_t *tree_masks, const int32_t *tree_starts, int B, int Hq,
                        int Hkv, int D, float *out, float *scratch, int64_t scratch_stride, int threads);
void sy_team_decode_attention(const float *q, int64_t q_sb, int64_t q_sh, float scale, const void *k_cache,
                              const void *v_cache, int is_bf16, int64_t sb, int64_t so, int64_t sh,
                              int64_t num_blocks, int block_size, const int32_t *tables, int64_t table_stride,
                              const int32_t *lens, const int64_t *tree_masks, const int32_t *tree_starts, int B,
                              int Hq, int Hkv, int D, float *out, float *scratch, int64_t scratch_stride,
                              float *parts, int threads, void *team, int t, int nt);
int sy_prefill_attention(const float *q, int64_t q_st, int64_t q_sh, float scale, const void *k_cache,
                         const void *v_cache, int is_bf16, int64_t sb, int64_t so, int64_t sh, int64_t num_blocks,
                         int block_size, const int32_t *tables, int64_t table_stride, int64_t table_width,
                         const int32_t *cu, const int32_t *lens, const int64_t *tree_masks,
                         const int32_t *tree_starts, int P, int Hq, int Hkv, int D, float *out, float *scratch,
                         int64_t scratch_stride, int threads);
void sy_linear_f32(const float *x, int64_t x_stride, const float *w, int64_t w_stride, const float *bias, float *y,
                   int64_t y_stride, int M, int64_t N, int64_t K, int threads);
void sy_pack_panels_f32(const float *w, int64_t w_stride, int64_t N, int64_t K, float *out);
int sy_panel_vector_bits(void);
void sy_part_gemm_panels_f32(const float *x, int64_t xs, const float *panels, const float *bias, float *y, int64_t ys,
                             int M, int64_t N, int64_t K, int t, int nt);
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
void sy_silu_mul_rows_f32(const float *gu, int64_t gs, float *out, int inter, int r0, int r1);
void sy_silu_mul_f32(const float *gu, int64_t gs, float *out, int T, int inter, int threads);

/* cpu_lowp.c: int8 / int4 / bf16 projections over packed strips (sy_part_*: thread t of nt's share) */
int sy_lowp_features(void);
int sy_quantize_rows_q8(const float *x, int64_t x_stride, int M, int K, void *scratch, int r0, int r1);
void sy_part_linear_q8(int M, int K, const void *scratch, const uint8_t *w, const float *scales, const float *bias,
                       float *y, int64_t ys, int64_t N, int t, int nt);
int sy_linear_q8(const float *x, int64_t x_stride, int M, int K, void *scratch, const uint8_t *w,
                 const float *scales, const float *bias, float *y, int64_t ys, int64_t N, int threads);
void sy_part_linear_q4(int M, int K, const void *scratch, const uint8_t *w, const uint16_t *sz, int gs,
                       const float *bias, float *y, int64_t ys, int64_t N, int t, int nt);
int sy_linear_q4(const float *x, int64_t x_stride, int M, int K, void *scratch, const uint8_t *w, const uint16_t *sz,
                 int gs, const float *bias, float *y, int64_t ys, int64_t N, int threads);
void sy_part_gemm_bf16(const uint16_t *x, int64_t xs, int M, int K, const uint16_t *w, const float *bias, float *y,
                       int64_t ys, int64_t N, int t, int nt);
int sy_gemm_bf16(const uint16_t *x, int64_t xs, int M, int K, const uint16_t *w, const float *bias, float *y,
                 int64_t ys, int64_t N, int threads);

/* cpu_amx.c: AMX tiles (1: ready / done, 0: not) */
void sy_amx_enable(int on);
int sy_amx_ready(void);
int sy_amx_part_bf16(const uint16_t *x, int64_t xs, int M, int K, const uint16_t *w, int group, const float *bias,
                     float *y, int64_t ys, int64_t N, int64_t first, int64_t last);

/* cpu_amx_attention.c: bf16 prefill attention on AMX tiles (codes as sy_prefill_attention) */
int sy_amx_prefill_attention_bf16(const uint16_t *q, int64_t q_st, int64_t q_sh, float scale,
                                  const uint16_t *k_cache, const uint16_t *v_cache, int64_t sb, int64_t so,
                                  int64_t sh, int64_t num_blocks, int block_size, const int32_t *tables,
                                  int64_t table_stride, int64_t table_width, const int32_t *cu,
                                  const int32_t *lens, int P, int Hq, int Hkv, int D, uint16_t *out, uint16_t *vt,
                                  int64_t vt_capacity, int64_t *vt_off, int threads);

/* cpu_bf16_rows.c: the bf16 RMSNorm, rotary and SiLU-and-multiply of the per-op forward */
void sy_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *res, int64_t res_stride,
                      const uint16_t *w, uint16_t *out, uint16_t *new_res, int T, int H, float eps, int threads);
int sy_rotary_bf16(const uint16_t *q, int64_t q_st, int64_t q_sh, int Hq, const uint16_t *k, int64_t k_st,
                   int64_t k_sh, int Hkv, int T, int D, const int64_t *pos, const float *cos_sin,
                   int64_t max_position, uint16_t *q_out, uint16_t *k_out);
void sy_silu_mul_bf16(const uint16_t *gu, int64_t gs, uint16_t *out, int T, int inter, int threads);

/* cpu_decode.c: a decode step's layers in one call (0, the workspace bytes needed, or SY_ERR_*) */
int sy_decode_plan_ok(const sy_model *m);
int64_t sy_decode_layers(const sy_model *m, const float *hidden_in, int B, const int64_t *positions,
                         const int64_t *slots, const int32_t *tables, int64_t table_width, const int32_t *lens,
                         float *hidden, float *residual, float *logits, void *workspace, int64_t workspace_size,
                         int threads);
int64_t sy_decode_greedy(const sy_model *m, const void *embed, int embed_bf16, int64_t vocab, int B,
                         const int64_t *tokens_in, const int64_t *positions_in, const int32_t *tables,
                         int64_t table_width, const int32_t *stop_ids, int n_stop, const int32_t *budget, int steps,
                         const volatile int32_t *interrupt, int64_t *tokens_out, int *done, float *hidden_in,
                         float *hidden, float *residual, float *logits, void *workspace, int64_t workspace_size,
                         int threads);

/* cpu_team.c: the decode step's spinning barrier and shared loop counter */
int64_t sy_team_bytes(void);
void *sy_team_reset(void *buf);
void sy_team_barrier(void *team, int nt);
int sy_team_next(void *team);
void sy_team_rewind(void *team);

/* cpu_abi.c: this build's layout, entry by entry ("sizeof(sy_proj)", "offsetof(sy_proj, n)", "SY_QBLOCK"...):
 * i in [0, sy_abi_count()) */
int sy_abi_count(void);
const char *sy_abi_name(int i);
int64_t sy_abi_value(int i);

#endif
