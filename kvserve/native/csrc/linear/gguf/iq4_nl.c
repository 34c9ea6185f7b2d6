/* GGUF IQ4_NL (ggml type 20): blocks of 32 columns in 18 bytes: an f16 scale d and 16 bytes of
 * 4-bit indices (nibble_table.h) into a fixed non-linear table of int8 values. w_i = d t[k_i]. */
#define BLOCK_COLS 32
#define BLOCK_BYTES 18
#define QUANTS_SIGNED 1
#define SCALES_PER_16 0
#define MINS MINS_NONE
#define AVX2_TILE tile_iq4_nl_avx2
#define AVX512_TILE tile_iq4_nl_vnni
#include "group_kernels.h"
#include "blocks32.h"
#include "iq4_values.h"
#include "nibble_table.h"

static void block_head(const uint8_t *block, BlockHead *h) {
    h->scale[0] = gguf_f16(block);
}

static void group_quants(const uint8_t *block, int g, int8_t q[GROUP]) {
    (void)g;
    table_quants(block + 2, IQ4_VALUES, q);
}

#if KV_HAVE_AVX2_FMA
static __m256i group_quants256(const uint8_t *block, int g) {
    (void)g;
    return table_quants256(block + 2, IQ4_VALUES);
}
#endif

/* The vector tiles: blocks32.h's, one f16 scale d first in the block. */
GGUF_INLINE float scale_iq4_nl(const uint8_t *blk) { return gguf_f16(blk); }
GGUF_FIXED_FLOAT_BEGIN
#if KV_HAVE_AVX2_FMA
GGUF_INLINE __m256i quants_iq4_nl(const uint8_t *blk) { return group_quants256(blk, 0); }
#define IQ4_NL_AVX2(t, sums, R, B) gguf_tile32_avx2(t, sums, R, B, BLOCK_BYTES, quants_iq4_nl, scale_iq4_nl, NULL)
GGUF_TILE_VARIANTS(tile_iq4_nl_avx2, IQ4_NL_AVX2)
#endif
#if KV_HAVE_AVX512_VNNI
/* IQ4_VALUES + 128, the unsigned quants blocks32.h's AVX512-VNNI tile takes (offset 128). */
static const uint8_t IQ4_OFFSET_VALUES[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
GGUF_INLINE __m512i quants2_iq4_nl(const uint8_t *b0, const uint8_t *b1) {
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_OFFSET_VALUES));
    return _mm512_shuffle_epi8(table, gguf_nibbles32x2(b0 + 2, b1 + 2));
}
#define IQ4_NL_AVX512(t, sums, R, B) gguf_tile32_avx512(t, sums, R, B, BLOCK_BYTES, 128, quants2_iq4_nl, 0)
GGUF_TILE_VARIANTS(tile_iq4_nl_vnni, IQ4_NL_AVX512)
#endif
GGUF_FIXED_FLOAT_END

GGUF_BLOCK_TYPE(gguf_iq4_nl, 20)
