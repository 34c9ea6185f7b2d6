/* GGUF Q5_0 (ggml type 6): blocks of 32 columns in 22 bytes: an f16 scale d, 32 high bits
 * (bit i: column i), 16 bytes of low nibbles (byte i: column i low, column 16 + i high).
 * w_i = d * (q_i - 16), q_i the 5-bit value. */
#define BLOCK_COLS 32
#define BLOCK_BYTES 22
#define QUANTS_SIGNED 1
#define SCALES_PER_16 0
#define MINS MINS_NONE
#include "group_kernels.h"
#include "five_bit.h"

static void block_head(const uint8_t *block, BlockHead *h) {
    h->scale[0] = gguf_f16(block);
}

static void group_quants(const uint8_t *block, int g, int8_t q[GROUP]) {
    (void)g;
    five_bit_quants(block + 2, block + 6, -16, q);
}

#if KV_HAVE_AVX2_FMA
static __m256i group_quants256(const uint8_t *block, int g) {
    (void)g;
    return _mm256_sub_epi8(five_bit_quants256(block + 2, block + 6), _mm256_set1_epi8(16));
}
#endif

GGUF_BLOCK_TYPE(gguf_q5_0, 6)
