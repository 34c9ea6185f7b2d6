/* GGUF Q5_K (ggml type 13): super-blocks of 256 columns in 176 bytes: f16 d and dmin, 12
 * bytes of eight 6-bit scales and eight 6-bit minimums (gguf_k_scales), 32 bytes of high bits
 * (byte l, bit g: column l of group g), 128 bytes of low nibbles (bytes 32j..32j+31: groups
 * 2j in the low nibbles, 2j + 1 in the high ones). w_i = d sc_g q_i - dmin m_g. */
#define BLOCK_COLS 256
#define BLOCK_BYTES 176
#define QUANTS_SIGNED 0
#define SCALES_PER_16 0
#define MINS MINS_PER_32
#define AVX512_TILE tile_q5_k_vnni
#include "group_kernels.h"

static void block_head(const uint8_t *block, BlockHead *h) {
    const float d = gguf_f16(block), dmin = gguf_f16(block + 2);
    uint8_t sc[8], mn[8];
    gguf_k_scales(block + 4, sc, mn);
    for (int g = 0; g < GROUPS; g++) {
        h->scale[g] = d * (float)sc[g];
        h->offset[g] = -(dmin * (float)mn[g]);
    }
}

static void group_quants(const uint8_t *block, int g, int8_t q[GROUP]) {
    const uint8_t *high = block + 16, *low = block + 48 + 32 * (g / 2);
    for (int l = 0; l < GROUP; l++) q[l] = (int8_t)(((low[l] >> (4 * (g & 1))) & 15) | ((high[l] >> g) & 1) << 4);
}

#if KV_HAVE_AVX2_FMA
static __m256i group_quants256(const uint8_t *block, int g) {
    const __m256i one = _mm256_set1_epi8(1);
    __m256i low = _mm256_loadu_si256((const __m256i *)(block + 48 + 32 * (g / 2)));
    if (g & 1) low = _mm256_srli_epi16(low, 4);
    low = _mm256_and_si256(low, _mm256_set1_epi8(15));
    __m256i high = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(block + 16)), g), one);
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
}
#endif

#if KV_HAVE_AVX512_VNNI
GGUF_FIXED_FLOAT_BEGIN
/* Per super-block and row: the 8 scales as int32 lanes, the 8 minimums times dmin as floats,
 * the high bits as a byte mask; per 64 columns (groups 2c, 2c + 1) one 32-byte load of low
 * nibbles, the high bits added under the mask, vpdpbusd against the activations (8 lanes per
 * group), times the group's scale (integer), then dx; per super-block times d, less
 * dmin m . sx over the 8 groups. */
GGUF_INLINE void q5_k_vnni(const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH], const int R, const int B) {
    const int64_t nb = t->in / GROUP;
    __m512 acc[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < t->blocks; k++) {
        __m512 dxs[GGUF_TILE_BATCH][4];
        super_block_dx(t, k, B, dxs);
        for (int r = 0; r < R; r++) {
            const uint8_t *block = t->w + r * t->row_bytes + k * BLOCK_BYTES;
            uint64_t scale_word, min_word;
            gguf_k_scale_words(block + 4, &scale_word, &min_word);
            const __m512i scales = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)scale_word));
            const __m512 d = _mm512_set1_ps(gguf_f16(block));
            const __m512 low = _mm512_zextps256_ps512(_mm256_mul_ps(
                _mm256_set1_ps(gguf_f16(block + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)min_word)))));
            const __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(block + 16)));
            __m512i q[4], group_scale[4];
            for (int c = 0; c < 4; c++) {
                const __m512i bits = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * c))),
                                                        _mm256_set1_epi8((char)(1 << (2 * c + 1))), 1);
                const __m512i nibbles = gguf_nibbles64(_mm256_loadu_si256((const __m256i *)(block + 48 + 32 * c)));
                q[c] = _mm512_mask_add_epi8(nibbles, _mm512_test_epi8_mask(high, bits), nibbles, _mm512_set1_epi8(16));
                group_scale[c] = _mm512_permutexvar_epi32(
                    _mm512_inserti64x4(_mm512_set1_epi32(2 * c), _mm256_set1_epi32(2 * c + 1), 1), scales);
            }
            for (int b = 0; b < B; b++) {
                const int8_t *x = t->qx + b * t->in + k * BLOCK_COLS;
                __m512 part = _mm512_setzero_ps();
                for (int c = 0; c < 4; c++) {
                    const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[c], _mm512_loadu_si512(x + 64 * c));
                    part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(sum, group_scale[c])), dxs[b][c], part);
                }
                const __m512 sx = _mm512_zextps256_ps512(_mm256_loadu_ps(t->sx + b * nb + k * GROUPS));
                acc[r][b] = _mm512_fnmadd_ps(low, sx, _mm512_fmadd_ps(part, d, acc[r][b]));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) sums[r][b] = gguf_sum512(acc[r][b]);
}
GGUF_TILE_VARIANTS(tile_q5_k_vnni, q5_k_vnni)
GGUF_FIXED_FLOAT_END
#endif

GGUF_BLOCK_TYPE(gguf_q5_k, 13)
