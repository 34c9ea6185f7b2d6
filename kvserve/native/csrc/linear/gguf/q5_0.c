/* GGUF Q5_0 (ggml type 6): blocks of 32 columns in 22 bytes: an f16 scale d, 32 high bits
 * (bit i: column i), 16 bytes of low nibbles (byte i: column i low, column 16 + i high).
 * w_i = d * (q_i - 16), q_i the 5-bit value. */
#define BLOCK_COLS 32
#define BLOCK_BYTES 22
#define QUANTS_SIGNED 1
#define SCALES_PER_16 0
#define MINS MINS_NONE
#define AVX2_TILE tile_q5_0_avx2
#define AVX512_TILE tile_q5_0_vnni
#include "group_kernels.h"
#include "blocks32.h"
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

/* The vector tiles: blocks32.h's, one f16 scale d first in the block. */
GGUF_INLINE float scale_q5_0(const uint8_t *blk) { return gguf_f16(blk); }
GGUF_FIXED_FLOAT_BEGIN
#if KV_HAVE_AVX2_FMA
GGUF_INLINE __m256i quants_q5_0(const uint8_t *blk) { return group_quants256(blk, 0); }
#define Q5_0_AVX2(t, sums, R, B) gguf_tile32_avx2(t, sums, R, B, BLOCK_BYTES, quants_q5_0, scale_q5_0, NULL)
GGUF_TILE_VARIANTS(tile_q5_0_avx2, Q5_0_AVX2)
#endif
#if KV_HAVE_AVX512_VNNI
GGUF_INLINE __m512i quants2_q5_0(const uint8_t *b0, const uint8_t *b1) { return five_bit_quants512(b0 + 2, b0 + 6, b1 + 2, b1 + 6); }
#define Q5_0_AVX512(t, sums, R, B) gguf_tile32_exact_avx512(t, sums, R, B, BLOCK_BYTES, 16, quants2_q5_0, NULL)
GGUF_TILE_VARIANTS(tile_q5_0_vnni, Q5_0_AVX512)
#endif
GGUF_FIXED_FLOAT_END

GGUF_BLOCK_TYPE(gguf_q5_0, 6)
