/* MXFP4's blocks (gpt-oss): twice each E2M1 value, indexed by its 4-bit code, and the E8M0
 * exponent's float, shared by its row tiles (mxfp4.c) and many-row GEMM (mxfp4_gemm.c). */
#ifndef KVSERVE_GGUF_MXFP4_VALUES_H
#define KVSERVE_GGUF_MXFP4_VALUES_H

#include <stdint.h>

#include "bf16.h"

static const int8_t FP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(e - 128) as a float (ggml's "e8m0 to fp32 half"): e 0 and 1 give the subnormals 2^-128
 * and 2^-127. */
static inline float half_exponent(uint8_t e) {
    Bits b = {.u = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23};
    return b.f;
}
#endif
