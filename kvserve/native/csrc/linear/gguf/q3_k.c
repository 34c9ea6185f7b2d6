/* GGUF Q3_K (ggml type 11): super-blocks of 256 columns in 110 bytes: 32 bytes of high bits
 * (byte l, bit g: column l of group g), 64 bytes of 2-bit lows (bytes 32n..32n+31 hold
 * groups 4n..4n+3, group 4n + j in bits 2j, 2j+1), 12 bytes of sixteen 6-bit scales (one
 * per 16 columns, stored +32), f16 d. w_i = d (s_h - 32) q_i with q_i = low + 4 high - 4. */
#define BLOCK_COLS 256
#define BLOCK_BYTES 110
#define QUANTS_SIGNED 1
#define SCALES_PER_16 1
#define MINS MINS_NONE
#define AVX512_TILE tile_q3_k_vnni
#include "group_kernels.h"

static void block_head(const uint8_t *block, BlockHead *h) {
    const uint8_t *s = block + 96;
    const float d = gguf_f16(block + 108);
    for (int i = 0; i < 16; i++) {
        int low = i < 8 ? s[i] & 15 : s[i - 8] >> 4, high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        h->sub[i] = (int16_t)((low | high << 4) - 32);
    }
    for (int g = 0; g < GROUPS; g++) h->scale[g] = d;
}

static void group_quants(const uint8_t *block, int g, int8_t q[GROUP]) {
    const uint8_t *high = block, *low = block + 32 + 32 * (g / 4);
    const int shift = 2 * (g % 4);
    for (int l = 0; l < GROUP; l++) q[l] = (int8_t)(((low[l] >> shift) & 3) + 4 * ((high[l] >> g) & 1) - 4);
}

#if KV_HAVE_AVX2_FMA
static __m256i group_quants256(const uint8_t *block, int g) {
    __m256i low = _mm256_loadu_si256((const __m256i *)(block + 32 + 32 * (g / 4)));
    low = _mm256_and_si256(_mm256_srli_epi16(low, 2 * (g % 4)), _mm256_set1_epi8(3));
    __m256i high = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)block), g), _mm256_set1_epi8(1));
    return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 2)), _mm256_set1_epi8(4));
}
#endif

#if KV_HAVE_AVX512_VNNI
GGUF_FIXED_FLOAT_BEGIN
/* The 16 scales (s - 32) of a super-block as int32 lanes: low nibbles from bytes 0-7 (scales
 * 0-7 the low ones, 8-15 the high ones), top 2 bits of scale i at bit 8 (i % 4) + 2 (i / 4)
 * of bytes 8-11. */
GGUF_INLINE __m512i q3_k_scales(const uint8_t *s) {
    const __m128i raw = _mm_loadl_epi64((const __m128i *)s);
    const __m128i low = _mm_and_si128(_mm_unpacklo_epi64(raw, _mm_srli_epi16(raw, 4)), _mm_set1_epi8(15));
    uint32_t top;
    memcpy(&top, s + 8, 4);
    const __m512i shifts = _mm512_setr_epi32(0, 8, 16, 24, 2, 10, 18, 26, 4, 12, 20, 28, 6, 14, 22, 30);
    const __m512i high = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)top), shifts), _mm512_set1_epi32(3));
    return _mm512_sub_epi32(_mm512_or_si512(_mm512_cvtepu8_epi32(low), _mm512_slli_epi32(high, 4)), _mm512_set1_epi32(32));
}

/* Per 64 columns (groups 2c, 2c + 1, in the same half of 128): the 2-bit lows of both groups
 * from one 32-byte load, plus 4 under the high-bit mask, are q + 4 (0..7): vpdpbusd, less 4
 * sum(qx) per lane (sums shared by the tile's rows), times each 16 columns' scale, then dx;
 * per super-block times d. */
GGUF_INLINE void q3_k_vnni(const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH], const int R, const int B) {
    __m512 acc[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < t->blocks; k++) {
        __m512 dxs[GGUF_TILE_BATCH][4];
        __m512i offsets[GGUF_TILE_BATCH][4]; /* 4 sum(qx) over each lane's 4 columns */
        super_block_dx(t, k, B, dxs);
        for (int b = 0; b < B; b++) {
            const int8_t *x = t->qx + b * t->in + k * BLOCK_COLS;
            for (int c = 0; c < 4; c++) {
                offsets[b][c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(4),
                                                    _mm512_loadu_si512(x + 64 * c));
            }
        }
        for (int r = 0; r < R; r++) {
            const uint8_t *block = t->w + r * t->row_bytes + k * BLOCK_BYTES;
            const __m512i scales = q3_k_scales(block + 96);
            const __m512 d = _mm512_set1_ps(gguf_f16(block + 108));
            const __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)block));
            __m512i u[4], lane_scale[4];
            for (int c = 0; c < 4; c++) {
                const int g = 2 * c, shift = 2 * (g % 4);
                const __m256i lows = _mm256_loadu_si256((const __m256i *)(block + 32 + 32 * (g / 4)));
                const __m512i both = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(lows, shift)),
                                                                         _mm256_srli_epi16(lows, shift + 2), 1),
                                                      _mm512_set1_epi8(3));
                const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << g)), _mm256_set1_epi8((char)(1 << (g + 1))), 1);
                u[c] = _mm512_mask_add_epi8(both, _mm512_test_epi8_mask(high, bits), both, _mm512_set1_epi8(4));
                /* lane i covers columns 4i..4i+3 of the 64: 16-column scale 4c + i / 4 */
                lane_scale[c] = _mm512_permutexvar_epi32(
                    _mm512_add_epi32(_mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2),
                                     _mm512_set1_epi32(4 * c)),
                    scales);
            }
            for (int b = 0; b < B; b++) {
                const int8_t *x = t->qx + b * t->in + k * BLOCK_COLS;
                __m512 part = _mm512_setzero_ps();
                for (int c = 0; c < 4; c++) {
                    const __m512i sum = _mm512_sub_epi32(
                        _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[c], _mm512_loadu_si512(x + 64 * c)), offsets[b][c]);
                    part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(sum, lane_scale[c])), dxs[b][c], part);
                }
                acc[r][b] = _mm512_fmadd_ps(part, d, acc[r][b]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) sums[r][b] = gguf_sum512(acc[r][b]);
}
GGUF_TILE_VARIANTS(tile_q3_k_vnni, q3_k_vnni)
GGUF_FIXED_FLOAT_END
#endif

GGUF_BLOCK_TYPE(gguf_q3_k, 11)
