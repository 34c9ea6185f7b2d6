/* GGUF IQ4_XS (ggml type 23): super-blocks of 256 columns in 136 bytes: f16 d; the eight
 * groups' 6-bit scales (stored +32) as their top 2 bits in a little-endian uint16 (bits 2g,
 * 2g+1) and their low 4 bits in 4 bytes (group g: byte g / 2, low nibble for even g); then
 * 16 bytes of 4-bit indices per group (nibble_table.h). w_i = d (s_g - 32) t[k_i]. */
#define BLOCK_COLS 256
#define BLOCK_BYTES 136
#define QUANTS_SIGNED 1
#define SCALES_PER_16 0
#define MINS MINS_NONE
#define AVX512_TILE tile_iq4_xs_vnni
#include "group_kernels.h"
#include "iq4_values.h"
#include "nibble_table.h"

static void block_head(const uint8_t *block, BlockHead *h) {
    const float d = gguf_f16(block);
    const unsigned high = (unsigned)(block[2] | block[3] << 8);
    for (int g = 0; g < GROUPS; g++) {
        int s = ((block[4 + g / 2] >> (4 * (g % 2))) & 15) | ((high >> (2 * g)) & 3) << 4;
        h->scale[g] = d * (float)(s - 32);
    }
}

static void group_quants(const uint8_t *block, int g, int8_t q[GROUP]) {
    table_quants(block + 8 + 16 * g, IQ4_VALUES, q);
}

#if KV_HAVE_AVX2_FMA
static __m256i group_quants256(const uint8_t *block, int g) {
    return table_quants256(block + 8 + 16 * g, IQ4_VALUES);
}
#endif

#if KV_HAVE_AVX512_VNNI
GGUF_FIXED_FLOAT_BEGIN
/* Per super-block and row: the 8 scales (s - 32) as int32 lanes; per 64 columns (groups 2c,
 * 2c + 1: 32 contiguous bytes) the indices in column order, |t[k]| by a byte shuffle and the
 * activations negated where t[k] < 0 (k < 8), vpdpbusd, times the group's scale, then dx;
 * per super-block times d. */
GGUF_INLINE void iq4_xs_vnni(const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH], const int R,
                             const int B) {
    static const int8_t magnitudes[16] = {127, 104, 83, 65, 49, 35, 22, 10, 1, 13, 25, 38, 53, 69, 89, 113};
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)magnitudes));
    const __m256i low_shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i high_shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    __m512 acc[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < t->blocks; k++) {
        __m512 dxs[GGUF_TILE_BATCH][4];
        super_block_dx(t, k, B, dxs);
        for (int r = 0; r < R; r++) {
            const uint8_t *block = t->w + r * t->row_bytes + k * BLOCK_BYTES;
            uint32_t low;
            memcpy(&low, block + 4, 4);
            const __m256i low4 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)low), low_shifts), _mm256_set1_epi32(15));
            const __m256i high2 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(block[2] | block[3] << 8), high_shifts),
                                                   _mm256_set1_epi32(3));
            const __m512i scales = _mm512_castsi256_si512(
                _mm256_sub_epi32(_mm256_or_si256(low4, _mm256_slli_epi32(high2, 4)), _mm256_set1_epi32(32)));
            const __m512 d = _mm512_set1_ps(gguf_f16(block));
            __m512i u[4], group_scale[4];
            __mmask64 negative[4];
            for (int c = 0; c < 4; c++) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + 8 + 32 * c));
                const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1);
                /* 128-bit lanes: group 2c's low nibbles, its high ones, then group 2c + 1's */
                const __m512i index = _mm512_and_si512(_mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0)),
                                                       _mm512_set1_epi8(15));
                u[c] = _mm512_shuffle_epi8(table, index);
                negative[c] = _mm512_testn_epi8_mask(index, _mm512_set1_epi8(8));
                group_scale[c] = _mm512_permutexvar_epi32(
                    _mm512_inserti64x4(_mm512_set1_epi32(2 * c), _mm256_set1_epi32(2 * c + 1), 1), scales);
            }
            for (int b = 0; b < B; b++) {
                const int8_t *x = t->qx + b * t->in + k * BLOCK_COLS;
                __m512 part = _mm512_setzero_ps();
                for (int c = 0; c < 4; c++) {
                    const __m512i xc = _mm512_loadu_si512(x + 64 * c);
                    const __m512i signed_x = _mm512_mask_sub_epi8(xc, negative[c], _mm512_setzero_si512(), xc);
                    const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[c], signed_x);
                    part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(sum, group_scale[c])), dxs[b][c], part);
                }
                acc[r][b] = _mm512_fmadd_ps(part, d, acc[r][b]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) sums[r][b] = gguf_sum512(acc[r][b]);
}
GGUF_TILE_VARIANTS(tile_iq4_xs_vnni, iq4_xs_vnni)
GGUF_FIXED_FLOAT_END
#endif

GGUF_BLOCK_TYPE(gguf_iq4_xs, 23)
