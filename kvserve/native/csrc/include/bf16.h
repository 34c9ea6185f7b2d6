/* Storage types shared by the CPU kernels: the dtype codes the Python side passes
 * (native/abi.py DTYPE_CODES; float16 only for the KV cache, KV_DTYPE_CODES)
 * and bfloat16 / float16 <-> float32 conversion with torch's rounding (to nearest
 * even, NaN kept quiet). */
#ifndef KVSERVE_BF16_H
#define KVSERVE_BF16_H
#include <stdint.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };

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

/* IEEE half precision, portable (the vector paths convert with F16C / AVX-512F). */
static inline float f16_value(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    Bits b;
    if (exponent == 0x1f) {
        b.u = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent) {
        b.u = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else { /* zero or subnormal: mantissa * 2^-24 */
        b.f = (float)mantissa * 5.9604644775390625e-08f;
        b.u |= sign;
    }
    return b.f;
}

static inline uint16_t f16_bits(float f) {
    Bits b = {.f = f};
    const uint32_t sign = (b.u >> 16) & 0x8000u, magnitude = b.u & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
    if (magnitude >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504: inf */
    if (magnitude < 0x38800000u) { /* below 2^-14: a subnormal half, rounded to nearest even */
        Bits m = {.u = magnitude};
        const float scaled = m.f * 16777216.0f; /* units of 2^-24 */
        uint32_t q = (uint32_t)scaled;
        const float rest = scaled - (float)q;
        if (rest > 0.5f || (rest == 0.5f && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
}

/* One stored element (F32, BF16 or F16) as float32, and back. */
static inline float stored_value(const void *base, int64_t i, int dtype) {
    if (dtype == F32) return ((const float *)base)[i];
    const uint16_t bits = ((const uint16_t *)base)[i];
    return dtype == BF16 ? bf16_value(bits) : f16_value(bits);
}

static inline void store_value(void *base, int64_t i, int dtype, float f) {
    if (dtype == F32)
        ((float *)base)[i] = f;
    else
        ((uint16_t *)base)[i] = dtype == BF16 ? bf16_bits(f) : f16_bits(f);
}
#endif
