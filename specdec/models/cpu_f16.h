/* float16 -> float32 for the CPU kernels' GGUF blocks (skinny_gemm.c, int_dot.c): the portable code's
 * conversion (the AVX2 code converts with F16C, to the same values). */
#ifndef SPECDEC_CPU_F16_H
#define SPECDEC_CPU_F16_H
#include <stdint.h>
#include <string.h>

/* Exact float16 -> float32. */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t u = sign | ((exponent + 112u) << 23) | (mantissa << 13); /* normal */
    if (exponent == 0x1f) u = sign | 0x7f800000u | (mantissa << 13);   /* inf, NaN */
    float f;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24, exact in float32 */
        f = (float)mantissa * 0x1p-24f;
        return sign ? -f : f;
    }
    memcpy(&f, &u, 4);
    return f;
}

/* The float16 at p (unaligned). */
static inline float load_f16(const uint8_t *p) {
    uint16_t bits;
    memcpy(&bits, p, 2);
    return f16_to_f32(bits);
}
#endif
