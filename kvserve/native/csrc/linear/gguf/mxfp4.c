/* GGUF MXFP4 (ggml type 39, gpt-oss): blocks of 32 columns in 17 bytes: an E8M0 exponent e
 * and 16 bytes of 4-bit FP4 (E2M1) codes (nibble_table.h). The table holds twice each E2M1
 * value, so w_i = 2^(e - 128) t[k_i] (ggml's "e8m0 to fp32 half"). */
#define BLOCK_COLS 32
#define BLOCK_BYTES 17
#define QUANTS_SIGNED 1
#define SCALES_PER_16 0
#define MINS MINS_NONE
#include "group_kernels.h"
#include "nibble_table.h"

static const int8_t FP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(e - 128) as a float: e 0 and 1 give the subnormals 2^-128 and 2^-127. */
static float half_exponent(uint8_t e) {
    Bits b = {.u = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23};
    return b.f;
}

static void block_head(const uint8_t *block, BlockHead *h) { h->scale[0] = half_exponent(block[0]); }

static void group_quants(const uint8_t *block, int g, int8_t q[GROUP]) {
    (void)g;
    table_quants(block + 1, FP4_VALUES, q);
}

#if KV_HAVE_AVX2_FMA
static __m256i group_quants256(const uint8_t *block, int g) {
    (void)g;
    return table_quants256(block + 1, FP4_VALUES);
}
#endif

GGUF_BLOCK_TYPE(gguf_mxfp4, 39)
