/* bf16 <-> fp32 for single values, shared by the kernels that round (cpu_decode.c, cpu_bf16_rows.c): one rounding
 * rule everywhere, so a value rounded in the decode step and in the per-op forward is the same bf16. */
#ifndef SY_CPU_BF16_H
#define SY_CPU_BF16_H

#include <stdint.h>
#include <string.h>

/* exact: a bf16 is the top half of an fp32 */
static inline float bf16_widen(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even; NaN becomes the quiet NaN 0x7fc0, as c10::BFloat16 does */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#endif
