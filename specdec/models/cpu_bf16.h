/* bfloat16 <-> float32 for the CPU kernels (skinny_gemm.c, cpu_attention.c, cpu_layer.c): one copy of
 * the rounding every kernel must share, or their outputs would differ in the last bit. */
#ifndef SPECDEC_CPU_BF16_H
#define SPECDEC_CPU_BF16_H
#include <stdint.h>
#include <string.h>

/* Exact: a bfloat16 is the top half of a float32. */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, NaN to the quiet NaN: PyTorch's float -> bfloat16. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#endif
