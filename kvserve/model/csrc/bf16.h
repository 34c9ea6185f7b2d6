/* Storage types shared by the CPU kernels: the dtype codes the Python side passes
 * (cpu_kernels._DTYPE_CODES) and bfloat16 <-> float32 conversion with torch's
 * rounding (to nearest even, NaN kept quiet). */
#ifndef KVSERVE_BF16_H
#define KVSERVE_BF16_H
#include <stdint.h>

enum { F32 = 0, BF16 = 1 };

/* Bit casts through a union: gcc does not vectorize loops around a memcpy pun. */
typedef union {
    float f;
    uint32_t u;
} Bits;

static inline float bf16_value(uint16_t x) {
    Bits b = {.u = (uint32_t)x << 16};
    return b.f;
}

static inline uint16_t bf16_bits(float f) {
    Bits b = {.f = f};
    uint32_t bits = b.u;
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}
#endif
