/* Intel AMX tile kernels over the bf16 strips of cpu_lowp.c (compiled into the same library):
 *   sy_amx_ready          1 once the OS lets this process use AMX tile data (asked once, per process)
 *   sy_amx_enable         0: leave the tiles alone (the strip kernels serve every size), 1: use them if allowed
 *   sy_amx_part_bf16      a range of strips of y = x W^T for bf16 x and W (a thread's share), through TDPBF16PS
 * Built where the compiler targets AMX-TILE + AMX-BF16 (-march=native on Sapphire Rapids and later); elsewhere
 * sy_amx_ready is 0 and callers keep the AVX512-BF16 / AVX2 strip kernels.
 *
 * Why: on a Xeon with AMX the AVX512-BF16 dot product (vdpbf16ps) issues at a quarter of an FMA's rate, so the
 * strip kernel is compute-bound from ~4 rows (about 200 GFLOP/s on 2 cores at 64 rows); a tile multiply does a
 * 16 x 16 x 32 block per instruction.
 *
 * The strips already are AMX's B layout: a bf16 strip holds, for each k pair t, the 16 output rows' pairs in one
 * 64-byte line, and a B tile is 16 such lines (16 k pairs x 16 columns x 2). Within a tile group (cpu_lowp.c's
 * GROUP_BF16 strips, interleaved step by step) strip j's line t sits at (t * ns + j) * 64 bytes, so strip j's B tile for
 * k pairs t..t+15 is a tile load with stride ns * 64. One A tile holds 16 rows of x x 32 k (bf16, x's own row
 * stride); four C tiles hold the 16 rows x 64 columns of a whole group, so a group's weights are read in
 * memory order once per 16 rows of x (from L2 after the first block: a group is 4 x 16 x K x 2 bytes). */
#include <stdint.h>
#include <string.h>

#include "switchyard_kernels.h" /* the declared interface: prototypes, shared structs and constants */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#define SY_HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* the strips per tile group (cpu_lowp.c passes SY_GROUP_BF16): one C tile each, so at most 4 */
#define MAX_GROUP 4
_Static_assert(SY_GROUP_BF16 <= MAX_GROUP, "cpu_lowp.c's bf16 tile groups need a C tile per strip");
#ifndef ROW_CHUNK
#define ROW_CHUNK 256
#endif

#ifdef SY_HAVE_AMX
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state; /* 0: not asked yet, 1: granted, -1: refused */

/* on = 0: never use the tiles (SWITCHYARD_CPU_AMX=0, and the tests of the other kernels); 1: ask the OS again */
void sy_amx_enable(int on) { __atomic_store_n(&amx_state, on ? 0 : -1, __ATOMIC_RELEASE); }

int sy_amx_ready(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (!s) { /* process-wide; asking twice from two threads is harmless */
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* tiles 0-3: C (rows x 16 fp32) for the group's strips 0-3; 4: A (rows x 32 bf16); 5-7: B (16 k pairs x 16 x 2) */
static void configure(int rows) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = i < 5 ? (uint8_t)rows : 16;
        c.colsb[i] = 64;
    }
    _tile_loadconfig(&c);
}

/* C tile i (rows x 16) + bias -> y's columns col0.. (the first ncols of them) */
static void store_c(float *tmp, int rows, const float *bias, float *y, int64_t ys, int ncols) {
    const __mmask16 keep = ncols >= 16 ? 0xffff : (__mmask16)((1u << ncols) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++)
        _mm512_mask_storeu_ps(y + (int64_t)r * ys, keep, _mm512_add_ps(_mm512_load_ps(tmp + 16 * r), b));
}

#define STORE(i)                                                                                                 \
    do {                                                                                                         \
        _tile_stored(i, tmp, 64);                                                                                \
        const int64_t col = 16 * (g0 + ja + (i));                                                                \
        store_c(tmp, rows, bias ? bias + col : 0, y + (int64_t)m0 * ys + col, ys, (int)(N - col));               \
    } while (0)

/* Strips [first, last) of W: x bf16 [M, K] (row stride xs elements), W bf16 strips (K * 16 elements each, `group`
 * interleaved), y fp32 [M, N] (row stride ys). K % 32 == 0, group <= MAX_GROUP. A range may start or end inside
 * a tile group (the caller cuts at even strips: two strips' lines are one 128-byte pair, which Intel's adjacent-line
 * prefetcher fetches together, so neither thread pulls in the other's lines). */
static void amx_bf16_strips(const uint16_t *x, int64_t xs, int M, int K, const uint16_t *w, int group,
                            const float *bias, float *y, int64_t ys, int64_t N, int64_t first, int64_t last) {
    const int64_t strips = (N + 15) / 16, strip = (int64_t)K * 16;
    float tmp[16 * 16] __attribute__((aligned(64)));
    int configured = -1;
    /* groups outer: a group's weights come from DRAM once (at decode) and from L2 for the next rows; with a
     * partial last block of rows the tiles are reconfigured twice per group (ldtilecfg). Rows go in chunks of
     * ROW_CHUNK so the chunk of x stays in L2 while the groups pass (a prefill's 2048 rows did not). */
    for (int c0 = 0; c0 < M; c0 += ROW_CHUNK)
    for (int64_t gi = first / group; gi * group < last; gi++) {
        const int64_t g0 = gi * group;
        const int ns = strips - g0 < group ? (int)(strips - g0) : group;
        const int ja = first > g0 ? (int)(first - g0) : 0, jb = last - g0 < ns ? (int)(last - g0) : ns;
        const int nc = jb - ja; /* this range's strips of the group: C tiles 0 .. nc - 1 */
        const char *wg = (const char *)(w + g0 * strip) + ja * 64;
        const int64_t bs = (int64_t)ns * 64; /* a strip's next k pair */
        for (int m0 = c0; m0 < M && m0 < c0 + ROW_CHUNK; m0 += 16) {
            const int rows = M - m0 < 16 ? M - m0 : 16;
            if (rows != configured) configure(configured = rows);
            const uint16_t *xa = x + (int64_t)m0 * xs;
            _tile_zero(0);
            if (nc > 1) _tile_zero(1);
            if (nc > 2) _tile_zero(2);
            if (nc > 3) _tile_zero(3);
            for (int k = 0; k < K; k += 32) {
                const char *b = wg + (int64_t)(k / 2) * bs;
                _tile_loadd(4, xa + k, xs * 2);
                _tile_loadd(5, b, bs);
                _tile_dpbf16ps(0, 4, 5);
                if (nc > 1) {
                    _tile_loadd(6, b + 64, bs);
                    _tile_dpbf16ps(1, 4, 6);
                }
                if (nc > 2) {
                    _tile_loadd(7, b + 128, bs);
                    _tile_dpbf16ps(2, 4, 7);
                }
                if (nc > 3) {
                    _tile_loadd(5, b + 192, bs);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            STORE(0);
            if (nc > 1) STORE(1);
            if (nc > 2) STORE(2);
            if (nc > 3) STORE(3);
        }
    }
    _tile_release();
}
#undef STORE

/* Strips [first, last) of y = x W^T (+ bias). Returns 1 when it computed them (AMX usable, K % 32 == 0), 0 when the
 * caller must (nothing written). */
int sy_amx_part_bf16(const uint16_t *x, int64_t xs, int M, int K, const uint16_t *w, int group, const float *bias,
                     float *y, int64_t ys, int64_t N, int64_t first, int64_t last) {
    if (K % 32 || M <= 0 || group < 1 || group > MAX_GROUP || !sy_amx_ready()) return 0;
    if (first < last) amx_bf16_strips(x, xs, M, K, w, group, bias, y, ys, N, first, last);
    return 1;
}
#else
void sy_amx_enable(int on) { (void)on; }

int sy_amx_ready(void) { return 0; }

int sy_amx_part_bf16(const uint16_t *x, int64_t xs, int M, int K, const uint16_t *w, int group, const float *bias,
                     float *y, int64_t ys, int64_t N, int64_t first, int64_t last) {
    (void)x, (void)xs, (void)M, (void)K, (void)w, (void)group, (void)bias, (void)y, (void)ys, (void)N, (void)first,
        (void)last;
    return 0;
}
#endif
