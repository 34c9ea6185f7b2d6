/* GGUF Q2_K (ggml type 10): super-blocks of 256 columns in 84 bytes: 16 bytes of 4-bit
 * scales (low nibble) and 4-bit minimums (high nibble), one per 16 columns; 64 bytes of 2-bit
 * quants (bytes 32n..32n+31 hold groups 4n..4n+3, group 4n + j in bits 2j, 2j+1); f16 d and
 * dmin. w_i = d s_h q_i - dmin m_h. */
#define BLOCK_COLS 256
#define BLOCK_BYTES 84
#define QUANTS_SIGNED 0
#define SCALES_PER_16 1
#define MINS MINS_PER_16
#define AVX512_TILE tile_q2_k_vnni
#include "group_kernels.h"

static void block_head(const uint8_t *block, BlockHead *h) {
    const float d = gguf_f16(block + 80);
    for (int i = 0; i < 16; i++) {
        h->sub[i] = block[i] & 15;
        h->min[i] = block[i] >> 4;
    }
    for (int g = 0; g < GROUPS; g++) h->scale[g] = d;
    h->min_scale = -gguf_f16(block + 82);
}

static void group_quants(const uint8_t *block, int g, int8_t q[GROUP]) {
    const uint8_t *bytes = block + 16 + 32 * (g / 4);
    const int shift = 2 * (g % 4);
    for (int l = 0; l < GROUP; l++) q[l] = (int8_t)((bytes[l] >> shift) & 3);
}

#if KV_HAVE_AVX2_FMA
static __m256i group_quants256(const uint8_t *block, int g) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + 16 + 32 * (g / 4)));
    return _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * (g % 4)), _mm256_set1_epi8(3));
}
#endif

#if KV_HAVE_AVX512_VNNI
GGUF_FIXED_FLOAT_BEGIN
/* Per 64 columns (groups 2c, 2c + 1, in the same half of 128) the 2-bit quants of both groups
 * from one 32-byte load: vpdpbusd, times each 16 columns' scale, then dx. The minimums: each
 * lane's sum(qx) times dx, shared by the tile's rows, times the lane's 16-column minimum.
 * Per super-block: d times the first, less dmin times the second. */
GGUF_INLINE void q2_k_vnni(const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH], const int R, const int B) {
    const __m512i lane_sub = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
    __m512 acc[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < t->blocks; k++) {
        __m512 dxs[GGUF_TILE_BATCH][4], xsums[GGUF_TILE_BATCH][4]; /* xsums: dx sum(qx) per lane */
        super_block_dx(t, k, B, dxs);
        for (int b = 0; b < B; b++) {
            const int8_t *x = t->qx + b * t->in + k * BLOCK_COLS;
            for (int c = 0; c < 4; c++) {
                const __m512i lane_sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1),
                                                              _mm512_loadu_si512(x + 64 * c));
                xsums[b][c] = _mm512_mul_ps(_mm512_cvtepi32_ps(lane_sums), dxs[b][c]);
            }
        }
        for (int r = 0; r < R; r++) {
            const uint8_t *block = t->w + r * t->row_bytes + k * BLOCK_BYTES;
            const __m128i packed = _mm_loadu_si128((const __m128i *)block);
            const __m512i scales = _mm512_cvtepu8_epi32(_mm_and_si128(packed, _mm_set1_epi8(15)));
            const __m512 mins = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(15))));
            const __m512 d = _mm512_set1_ps(gguf_f16(block + 80)), dmin = _mm512_set1_ps(gguf_f16(block + 82));
            __m512i q[4], lane_scale[4];
            __m512 lane_min[4];
            for (int c = 0; c < 4; c++) {
                const int shift = 2 * ((2 * c) % 4);
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + 16 + 32 * (c / 2)));
                q[c] = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(bytes, shift)),
                                                           _mm256_srli_epi16(bytes, shift + 2), 1),
                                        _mm512_set1_epi8(3));
                const __m512i sub = _mm512_add_epi32(lane_sub, _mm512_set1_epi32(4 * c));
                lane_scale[c] = _mm512_permutexvar_epi32(sub, scales);
                lane_min[c] = _mm512_permutexvar_ps(sub, mins);
            }
            for (int b = 0; b < B; b++) {
                const int8_t *x = t->qx + b * t->in + k * BLOCK_COLS;
                __m512 part = _mm512_setzero_ps(), low = _mm512_setzero_ps();
                for (int c = 0; c < 4; c++) {
                    const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[c], _mm512_loadu_si512(x + 64 * c));
                    part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(sum, lane_scale[c])), dxs[b][c], part);
                    low = _mm512_fmadd_ps(lane_min[c], xsums[b][c], low);
                }
                acc[r][b] = _mm512_fnmadd_ps(low, dmin, _mm512_fmadd_ps(part, d, acc[r][b]));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) sums[r][b] = gguf_sum512(acc[r][b]);
}
GGUF_TILE_VARIANTS(tile_q2_k_vnni, q2_k_vnni)
GGUF_FIXED_FLOAT_END
#endif

GGUF_BLOCK_TYPE(gguf_q2_k, 10)
