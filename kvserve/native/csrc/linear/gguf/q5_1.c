/* GGUF Q5_1 (ggml type 7): blocks of 32 columns in 24 bytes: f16 scale d and minimum m,
 * 32 high bits (bit i: column i), 16 bytes of low nibbles (byte i: column i low, column
 * 16 + i high). w_i = d * q_i + m, q_i the 5-bit value. */
#define BLOCK_COLS 32
#define BLOCK_BYTES 24
#define QUANTS_SIGNED 0
#define SCALES_PER_16 0
#define MINS MINS_PER_32
#include "group_kernels.h"
#include "five_bit.h"

static void block_head(const uint8_t *block, BlockHead *h) {
    h->scale[0] = gguf_f16(block);
    h->offset[0] = gguf_f16(block + 2);
}

static void group_quants(const uint8_t *block, int g, int8_t q[GROUP]) {
    (void)g;
    five_bit_quants(block + 4, block + 8, 0, q);
}

#if KV_HAVE_AVX2_FMA
static __m256i group_quants256(const uint8_t *block, int g) {
    (void)g;
    return five_bit_quants256(block + 4, block + 8);
}
#endif

GGUF_BLOCK_TYPE(gguf_q5_1, 7)
