/* One decode step of a Llama-family decoder, every layer in one native call (kernels/cpu_decode.py builds the
 * plan once per model and calls it per step):
 *   sy_decode_layers   for B sequences with one new token each: for every layer, RMSNorm (+ residual), the
 *                      fused QKV projection, rotary, the KV-cache write, paged decode attention, the output
 *                      projection, RMSNorm + residual, gate_up, SiLU-and-multiply, down; and, when the caller
 *                      asks for logits and the plan has a head, the final RMSNorm and the vocabulary projection
 *                      in the same region (the head is a fifth of SmolLM2's bytes: its stream follows the last
 *                      layer's without a second fork, and without the norm and head calls from Python).
 * It calls the same kernels the per-op path calls one by one from Python (cpu_native.c, cpu_lowp.c), so an
 * fp32 step's results equal that path's; what it removes is the Python between them (~11 calls per layer,
 * each with its argument checks, tensor allocations and ctypes marshalling: ~180 us per layer measured at
 * batch 1, as much as reading an int8 layer's weights). Activations are fp32 throughout; bf16 weights see
 * their input rounded to bf16 (as the per-op path's bf16 model does), a bf16 cache gets its K/V rounded.
 * The step is one parallel region over the kernels' per-thread parts (sy_part_*, sy_team_decode_attention),
 * with barriers between ops. */
#include <stdint.h>
#include <string.h>

#include "switchyard_kernels.h" /* the declared interface: prototypes, shared structs and constants */
#include "cpu_bf16.h" /* bf16_round, bf16_widen */
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

static inline int64_t align64(int64_t bytes) { return (bytes + 63) & ~(int64_t)63; }

static void to_bf16(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = bf16_round(x[i]);
}

/* Whether this build runs projection p (its kind's instructions, its shape). */
static int projection_ok(const sy_proj *p, int features) {
    switch (p->kind) {
    case SY_PROJ_F32_PANELS: return 1;
    case SY_PROJ_INT8: return (features & SY_FEATURE_VNNI) && p->k % SY_QBLOCK == 0;
    case SY_PROJ_INT4:
        return (features & SY_FEATURE_VNNI) && p->group_size > 0 && p->group_size % SY_QBLOCK == 0 &&
               p->k % p->group_size == 0;
    case SY_PROJ_BF16: return (features & SY_FEATURE_BF16) && p->k % 2 == 0;
    default: return 0;
    }
}

/* Rows [r0, r1) of x [M, p->k] (contiguous) rounded into `lowp` as projection p reads them: int8 per block
 * (int8/int4 weights) or bf16; fp32 panels read x itself. `lowp` holds M * K + 8 * M * (K / 32) + 64 bytes
 * (int8/int4) or 2 * M * K (bf16). */
static void round_rows(const sy_proj *p, const float *x, int M, int r0, int r1, void *lowp) {
    const int K = (int)p->k;
    if (p->kind == SY_PROJ_INT8 || p->kind == SY_PROJ_INT4)
        (void)sy_quantize_rows_q8(x, K, M, K, lowp, r0, r1);
    else if (p->kind == SY_PROJ_BF16)
        to_bf16(x + (int64_t)r0 * K, (int64_t)(r1 - r0) * K, (uint16_t *)lowp + (int64_t)r0 * K);
}

/* Thread t of nt's share of y [M, p->n] (contiguous) = x [M, p->k] @ W^T (+ bias), x rounded by round_rows. */
static void project_part(const sy_proj *p, const float *x, int M, float *y, const void *lowp, int t, int nt) {
    const int K = (int)p->k;
    switch (p->kind) {
    case SY_PROJ_F32_PANELS:
        sy_part_gemm_panels_f32(x, K, (const float *)p->w, p->bias, y, p->n, M, p->n, K, t, nt);
        break;
    case SY_PROJ_INT8:
        sy_part_linear_q8(M, K, lowp, (const uint8_t *)p->w, (const float *)p->aux, p->bias, y, p->n, p->n, t, nt);
        break;
    case SY_PROJ_INT4:
        sy_part_linear_q4(M, K, lowp, (const uint8_t *)p->w, (const uint16_t *)p->aux, p->group_size, p->bias, y,
                          p->n, p->n, t, nt);
        break;
    case SY_PROJ_BF16:
        sy_part_gemm_bf16((const uint16_t *)lowp, K, M, K, (const uint16_t *)p->w, p->bias, y, p->n, p->n, t, nt);
        break;
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
    float *x, *qkv, *q_rot, *k_rot, *attn, *gate_up, *act, *scores, *parts;
    void *team; /* the region's barrier and shared counter (cpu_team.c) */
    void *lowp; /* rounded activations of the widest projection input (int8 + block scales, or bf16) */
    int64_t bytes;
} sy_buffers;

static sy_buffers carve(const sy_model *m, int B, int max_len, int threads, char *base) {
    const int64_t H = m->hidden, I = m->inter, qd = (int64_t)m->num_heads * m->head_dim;
    const int64_t kvd = (int64_t)m->num_kv_heads * m->head_dim;
    int64_t k = H > I ? H : I;
    k = k > qd ? k : qd;
    const int64_t q8 = B * k + 8 * B * (k / SY_QBLOCK) + 64, b16 = 2 * B * k;
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
    b.parts = CARVE(float, sy_decode_attention_parts(B, m->num_heads, m->num_kv_heads, m->head_dim, threads) * 4);
    b.team = CARVE(char, sy_team_bytes());
#undef CARVE
    b.bytes = off + 64; /* + the base's alignment */
    return b;
}

/* Whether this build's kernels take the plan (attention shape, each projection's kind and shape): 1 or 0.
 * Fixed for the model's life, so cpu_decode.py asks once when it builds the plan, not every step. */
int sy_decode_plan_ok(const sy_model *m) {
    if (!sy_decode_attention_shape_ok(m->num_heads, m->num_kv_heads, m->head_dim, m->block_size, m->kv_bf16))
        return 0;
    const int features = sy_lowp_features();
    for (int l = 0; l < m->num_layers; l++) {
        const sy_layer *L = &m->layers[l];
        if (!projection_ok(&L->qkv, features) || !projection_ok(&L->o, features) ||
            !projection_ok(&L->gate_up, features) || !projection_ok(&L->down, features))
            return 0;
    }
    if (m->final_norm && (!m->head.w || m->head.k != m->hidden || !projection_ok(&m->head, features))) return 0;
    return 1;
}

/* Everything a step's inputs could fail on, checked before its region starts (so nothing is written when it
 * fails): positions, slots, each sequence's block ids and table width. */
static int64_t check_step(const sy_model *m, int B, const int64_t *positions, const int64_t *slots,
                          const int32_t *tables, int64_t table_width, const int32_t *lens, int *max_len) {
    const int64_t num_slots = m->num_blocks * m->block_size;
    *max_len = 1;
    for (int b = 0; b < B; b++) {
        if (positions[b] < 0 || positions[b] >= m->max_position) return SY_ERR_POSITION;
        if (slots[b] >= num_slots) return SY_ERR_SLOT;
        if (lens[b] > *max_len) *max_len = lens[b];
    }
    for (int b = 0; b < B; b++) {
        const int64_t len = lens[b] > 0 ? lens[b] : 0, nblk = (len + m->block_size - 1) / m->block_size;
        if (nblk > table_width) return SY_ERR_TABLE;
        for (int64_t i = 0; i < nblk; i++) {
            const int32_t blk = tables[b * table_width + i];
            if (blk < 0 || blk >= m->num_blocks) return SY_ERR_BLOCK;
        }
    }
    return 0;
}

/* This thread's rows [*r0, *r1) of B (the row-wise ops: norms, rotary, KV writes, rounding). */
static inline void row_share(int B, int t, int nt, int *r0, int *r1) {
    *r0 = (int)((int64_t)B * t / nt);
    *r1 = (int)((int64_t)B * (t + 1) / nt);
}

/* the step's own barrier (cpu_team.c): it spins where libgomp's may sleep */
#define BARRIER sy_team_barrier(team, nt)

/* hidden [B, H] fp32 (the embedded tokens) -> hidden, residual [B, H]: the last layer's output and the residual
 * stream before it, as LlamaForCausalLM's layer loop leaves them. With `logits` (only for a plan with a head)
 * also logits [B, head rows] fp32 = head(final_norm(hidden + residual)); residual then holds that sum.
 * positions, slots int64 [B]; tables int32 [B, table_width]; lens int32 [B] (context including the new token).
 * Returns 0; a positive number of workspace bytes when `workspace_size` is smaller (nothing done); or a
 * negative SY_ERR_* (nothing done: check_step runs first). The plan must have passed sy_decode_plan_ok.
 * The whole step is one parallel region: each op's share on every thread, a barrier where the next op reads
 * what another thread wrote. A step used to open ~10 regions per layer (300 at 30 layers); each fork and
 * join costs microseconds and the weight stream ramps up again behind it. The barriers are cpu_team.c's, not
 * OpenMP's (which sleep on a futex in a process with more OpenMP threads than cores, as a server has). */
int64_t sy_decode_layers(const sy_model *m, const float *hidden_in, int B, const int64_t *positions,
                         const int64_t *slots, const int32_t *tables, int64_t table_width, const int32_t *lens,
                         float *hidden, float *residual, float *logits, void *workspace, int64_t workspace_size,
                         int threads) {
    if (B <= 0) return 0;
    if (logits && !m->final_norm) return SY_ERR_NO_HEAD;
    int max_len;
    const int64_t bad = check_step(m, B, positions, slots, tables, table_width, lens, &max_len);
    if (bad) return bad;
    const int64_t need = carve(m, B, max_len, threads, NULL).bytes;
    if (workspace_size < need) return need;
    const sy_buffers w = carve(m, B, max_len, threads, (char *)workspace);
    const int H = m->hidden, Hq = m->num_heads, Hkv = m->num_kv_heads, D = m->head_dim, I = m->inter;
    const int64_t qd = (int64_t)Hq * D, kvd = (int64_t)Hkv * D, nqkv = qd + 2 * kvd;
    const int64_t num_slots = m->num_blocks * m->block_size;
    const int64_t score_stride = (int64_t)Hq * ((max_len + 15) / 16 * 16);
    void *const team = sy_team_reset(w.team);

#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int t = 0, nt = 1;
#endif
        int r0, r1;
        row_share(B, t, nt, &r0, &r1);
        const int rows = r1 - r0;
        for (int l = 0; l < m->num_layers; l++) {
            const sy_layer *L = &m->layers[l];
            /* residual += hidden; x = norm(residual) (layer 0: residual = the embedded tokens) */
            if (rows) {
                if (l)
                    sy_rms_norm_f32(hidden + (int64_t)r0 * H, H, residual + (int64_t)r0 * H, H, L->input_norm,
                                    w.x + (int64_t)r0 * H, residual + (int64_t)r0 * H, rows, H, m->eps);
                else {
                    sy_rms_norm_f32(hidden_in + (int64_t)r0 * H, H, NULL, H, L->input_norm, w.x + (int64_t)r0 * H,
                                    NULL, rows, H, m->eps);
                    memcpy(residual + (int64_t)r0 * H, hidden_in + (int64_t)r0 * H, sizeof(float) * rows * H);
                }
                round_rows(&L->qkv, w.x, B, r0, r1, w.lowp);
            }
            BARRIER;
            project_part(&L->qkv, w.x, B, w.qkv, w.lowp, t, nt);
            BARRIER;
            if (rows) {
                const float *q = w.qkv + r0 * nqkv;
                (void)sy_rotary_f32(q, nqkv, D, Hq, q + qd, nqkv, D, Hkv, rows, D, positions + r0, m->cos_sin,
                                    m->max_position, w.q_rot + r0 * qd, w.k_rot + r0 * kvd);
                if (m->kv_bf16)
                    store_kv_bf16(w.k_rot + r0 * kvd, q + qd + kvd, kvd, nqkv, (uint16_t *)L->k_cache,
                                  (uint16_t *)L->v_cache, m->cache_sb, m->cache_so, m->cache_sh, m->block_size,
                                  slots + r0, rows, Hkv, D);
                else
                    (void)sy_store_kv_f32(w.k_rot + r0 * kvd, q + qd + kvd, kvd, D, nqkv, D, (float *)L->k_cache,
                                          (float *)L->v_cache, m->cache_sb, m->cache_so, m->cache_sh, num_slots,
                                          m->block_size, slots + r0, rows, Hkv, D);
            }
            BARRIER;
            sy_team_decode_attention(w.q_rot, qd, D, m->scale, L->k_cache, L->v_cache, m->kv_bf16, m->cache_sb,
                                     m->cache_so, m->cache_sh, m->num_blocks, m->block_size, tables, table_width,
                                     lens, NULL, NULL, B, Hq, Hkv, D, w.attn, w.scores, score_stride, w.parts,
                                     threads, team, t, nt);
            if (rows) round_rows(&L->o, w.attn, B, r0, r1, w.lowp);
            BARRIER;
            project_part(&L->o, w.attn, B, hidden, w.lowp, t, nt);
            BARRIER;
            if (rows) {
                sy_rms_norm_f32(hidden + (int64_t)r0 * H, H, residual + (int64_t)r0 * H, H, L->post_norm,
                                w.x + (int64_t)r0 * H, residual + (int64_t)r0 * H, rows, H, m->eps);
                round_rows(&L->gate_up, w.x, B, r0, r1, w.lowp);
            }
            BARRIER;
            project_part(&L->gate_up, w.x, B, w.gate_up, w.lowp, t, nt);
            BARRIER;
            if (rows) {
                sy_silu_mul_rows_f32(w.gate_up, 2 * (int64_t)I, w.act, I, r0, r1);
                round_rows(&L->down, w.act, B, r0, r1, w.lowp);
            }
            BARRIER;
            project_part(&L->down, w.act, B, hidden, w.lowp, t, nt);
            BARRIER;
        }
        if (logits) {
            if (rows) {
                sy_rms_norm_f32(hidden + (int64_t)r0 * H, H, residual + (int64_t)r0 * H, H, m->final_norm,
                                w.x + (int64_t)r0 * H, residual + (int64_t)r0 * H, rows, H, m->eps);
                round_rows(&m->head, w.x, B, r0, r1, w.lowp);
            }
            BARRIER;
            project_part(&m->head, w.x, B, logits, w.lowp, t, nt); /* the region's end joins the threads */
        }
    }
    return 0;
}

/* Index of row x's largest value, the first one on ties; a row with a NaN gives its first NaN (as numpy's and
 * torch's argmax do: hosted/sampler.py greedy_tokens). Two vector passes: the maximum (and whether a NaN is
 * there), then the first index holding it; the scalar loop it replaced took ~40 us over 49,152 logits. */
static int64_t argmax_row(const float *x, int64_t n) {
    int64_t i = 0;
    float v = x[0];
    int nan = 0;
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 m = _mm512_loadu_ps(x);
        __mmask16 unordered = 0;
        for (i = 0; i + 16 <= n; i += 16) {
            const __m512 y = _mm512_loadu_ps(x + i);
            unordered |= _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
            m = _mm512_max_ps(m, y);
        }
        nan = unordered != 0;
        v = _mm512_reduce_max_ps(m);
    }
#elif defined(__AVX2__)
    if (n >= 8) {
        __m256 m = _mm256_loadu_ps(x), unordered = _mm256_setzero_ps();
        for (i = 0; i + 8 <= n; i += 8) {
            const __m256 y = _mm256_loadu_ps(x + i);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
            m = _mm256_max_ps(m, y);
        }
        nan = _mm256_movemask_ps(unordered) != 0;
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        v = lanes[0];
        for (int l = 1; l < 8; l++) v = lanes[l] > v ? lanes[l] : v;
    }
#endif
    for (; i < n; i++) { /* the tail (or the whole row without vectors) */
        nan |= x[i] != x[i];
        v = x[i] > v ? x[i] : v;
    }
    for (int64_t j = 0; j < n; j++)
        if (nan ? x[j] != x[j] : x[j] == v) return j;
    return 0;
}

/* Up to `steps` greedy decode steps of B sequences in one call, each step's tokens fed to the next: the
 * per-token work the engine does in Python between steps (scheduling, input tensors, sampling, the embedding
 * lookup) stays here. Row b feeds tokens_in[b] at position positions_in[b] (its block table must hold the
 * positions of every step: the caller allocates them first), then its argmax, and so on. After each step the
 * call ends if a row's new token is one of its stop ids (stop_ids [B, n_stop], -1 = none) or the row has made
 * budget[b] tokens: *done says how many steps ran, tokens_out [B, steps] holds their tokens (row-major, the
 * first *done of each row). It also ends after any step once *interrupt (if given) is nonzero: another thread
 * sets it when work arrives that should not wait for the rest of the call. `embed` [vocab, hidden] fp32, or
 * bf16 when embed_bf16 (the model's embedding table); logits [B, head rows] is scratch. The plan needs a head.
 * Returns as sy_decode_layers (0, the workspace bytes needed, or a negative SY_ERR_*), and SY_ERR_TOKEN for a token
 * outside the table. */
int64_t sy_decode_greedy(const sy_model *m, const void *embed, int embed_bf16, int64_t vocab, int B,
                         const int64_t *tokens_in, const int64_t *positions_in, const int32_t *tables,
                         int64_t table_width, const int32_t *stop_ids, int n_stop, const int32_t *budget, int steps,
                         const volatile int32_t *interrupt, int64_t *tokens_out, int *done, float *hidden_in,
                         float *hidden, float *residual, float *logits, void *workspace, int64_t workspace_size,
                         int threads) {
    *done = 0;
    if (B <= 0 || steps <= 0) return 0;
    if (!m->final_norm) return SY_ERR_NO_HEAD;
    int64_t pos[B], slots[B], tok[B];
    int32_t lens[B];
    /* Every step's inputs checked before the first runs, so a call that fails writes nothing: the last step's
     * positions and contexts cover all the blocks the earlier ones use (its slots are looked up only later). */
    for (int b = 0; b < B; b++) {
        if (tokens_in[b] < 0 || tokens_in[b] >= vocab) return SY_ERR_TOKEN;
        if (positions_in[b] < 0) return SY_ERR_POSITION;
        pos[b] = positions_in[b] + steps - 1;
        lens[b] = (int32_t)(pos[b] + 1);
        slots[b] = -1;
    }
    int max_len;
    const int64_t bad = check_step(m, B, pos, slots, tables, table_width, lens, &max_len);
    if (bad) return bad;
    const int64_t need = carve(m, B, max_len, threads, NULL).bytes;
    if (workspace_size < need) return need;
    const int H = m->hidden, bs = m->block_size;
    memcpy(tok, tokens_in, sizeof(tok));
    for (int s = 0; s < steps; s++) {
        for (int b = 0; b < B; b++) {
            pos[b] = positions_in[b] + s;
            lens[b] = (int32_t)(pos[b] + 1);
            slots[b] = (int64_t)tables[b * table_width + pos[b] / bs] * bs + pos[b] % bs;
            float *row = hidden_in + (int64_t)b * H;
            if (embed_bf16) {
                const uint16_t *e = (const uint16_t *)embed + tok[b] * H;
                for (int i = 0; i < H; i++) row[i] = bf16_widen(e[i]);
            } else {
                memcpy(row, (const float *)embed + tok[b] * H, sizeof(float) * H);
            }
        }
        const int64_t rc = sy_decode_layers(m, hidden_in, B, pos, slots, tables, table_width, lens, hidden, residual,
                                            logits, workspace, workspace_size, threads);
        if (rc) return rc;
        int stop = 0;
        for (int b = 0; b < B; b++) {
            tok[b] = argmax_row(logits + b * m->head.n, m->head.n);
            tokens_out[(int64_t)b * steps + s] = tok[b];
            for (int j = 0; j < n_stop; j++) stop |= stop_ids[b * n_stop + j] == tok[b];
            stop |= s + 1 >= budget[b];
            if (tok[b] >= vocab) stop = 1; /* a head wider than the table: no row to feed next */
        }
        *done = s + 1;
        if (stop || (interrupt && *interrupt)) break;
    }
    return 0;
}
