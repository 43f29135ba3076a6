/* The softmax exponential shared by the attention kernels (cpu_native.c, cpu_amx_attention.c): a macro over
 * GCC vector types, so each file instantiates it for its own lane counts. */
#ifndef SY_CPU_EXP_H
#define SY_CPU_EXP_H

/* exp(x) for x <= 0 (softmax arguments after subtracting the max), 16 lanes, within ~2 ulp:
 * x = n ln2 + r with |r| <= ln2/2 (n rounded to nearest with the 1.5 * 2^23 trick), exp(r) by its
 * degree-7 Taylor polynomial (truncation < 1e-8 relative), times 2^n built in the exponent bits.
 * x < -87 (beyond fp32's normal range) gives 0. */
#define EXP_NONPOS_BODY(VF, VI)                                                                                  \
    const VI under = x < -87.0f;                                                                                 \
    x = (VF)((under & (VI)((VF){0} - 87.0f)) | (~under & (VI)x));                                               \
    const VF magic = (VF){0} + 12582912.0f;                                                                      \
    const VF n = (x * 1.44269504088896341f + magic) - magic;                                                     \
    VF r = x - n * 0.693145751953125f;                                                                           \
    r = r - n * 1.42860682030941723212e-6f;                                                                      \
    VF p = r * (1.0f / 5040.0f) + 1.0f / 720.0f;                                                                 \
    p = p * r + 1.0f / 120.0f;                                                                                   \
    p = p * r + 1.0f / 24.0f;                                                                                    \
    p = p * r + 1.0f / 6.0f;                                                                                     \
    p = p * r + 0.5f;                                                                                            \
    p = p * r + 1.0f;                                                                                            \
    p = p * r + 1.0f;                                                                                            \
    const VI two_n = (__builtin_convertvector(n, VI) + 127) << 23;                                               \
    return (VF)(~under & (VI)(p * (VF)two_n))

#endif
