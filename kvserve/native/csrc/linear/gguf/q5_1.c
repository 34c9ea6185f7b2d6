/* GGUF Q5_1 (ggml type 7): blocks of 32 columns in 24 bytes: f16 scale d and minimum m,
 * 32 high bits (bit i: column i), 16 bytes of low nibbles (byte i: column i low, column
 * 16 + i high). w_i = d * q_i + m, q_i the 5-bit value. */
#define BLOCK_COLS 32
#define BLOCK_BYTES 24
#define QUANTS_SIGNED 0
#define SCALES_PER_16 0
#define MINS MINS_PER_32
#define AVX2_TILE tile_q5_1_avx2
#define AVX512_TILE tile_q5_1_vnni
#include "group_kernels.h"
#include "blocks32.h"
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

/* The vector tiles: blocks32.h's, one f16 scale d first in the block and the minimum m second. */
GGUF_INLINE float scale_q5_1(const uint8_t *blk) { return gguf_f16(blk); }
GGUF_INLINE float minimum_q5_1(const uint8_t *blk) { return gguf_f16(blk + 2); }
GGUF_FIXED_FLOAT_BEGIN
#if KV_HAVE_AVX2_FMA
GGUF_INLINE __m256i quants_q5_1(const uint8_t *blk) { return group_quants256(blk, 0); }
#define Q5_1_AVX2(t, sums, R, B) gguf_tile32_avx2(t, sums, R, B, BLOCK_BYTES, quants_q5_1, scale_q5_1, minimum_q5_1)
GGUF_TILE_VARIANTS(tile_q5_1_avx2, Q5_1_AVX2)
#endif
#if KV_HAVE_AVX512_VNNI
GGUF_INLINE __m512i quants2_q5_1(const uint8_t *b0, const uint8_t *b1) { return five_bit_quants512(b0 + 4, b0 + 8, b1 + 4, b1 + 8); }
#define Q5_1_AVX512(t, sums, R, B) gguf_tile32_avx512(t, sums, R, B, BLOCK_BYTES, 0, quants2_q5_1, 1)
GGUF_TILE_VARIANTS(tile_q5_1_vnni, Q5_1_AVX512)
#endif
GGUF_FIXED_FLOAT_END

GGUF_BLOCK_TYPE(gguf_q5_1, 7)
