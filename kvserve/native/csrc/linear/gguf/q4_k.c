/* Q4_K (ggml type 12): super-blocks of 256 columns, 144 bytes: f16 d, f16 dmin, 12
 * bytes of 6-bit sub-block scales and minimums (gguf_k_scales), then 128 bytes of
 * nibbles: per 64 columns 32 bytes, the low nibbles columns 0-31 and the high nibbles
 * columns 32-63. Sub-block j (32 columns): w = (d sc_j) q - (dmin m_j). */
#include "gguf_type.h"
#include "kvserve.h"
#include "sub_block_sums.h"

#define COLS 256
#define BYTES 144

GGUF_EXACT static void dequantize_q4_k(const uint8_t *blocks, int64_t n, float *out) {
    for (int64_t b = 0; b < n; b++) {
        const uint8_t *blk = blocks + b * BYTES;
        const float d = gguf_f16(blk), dmin = gguf_f16(blk + 2);
        uint8_t sc[8], mn[8];
        gguf_k_scales(blk + 4, sc, mn);
        for (int j = 0; j < 8; j++) {
            const float scale = d * (float)sc[j], low = dmin * (float)mn[j];
            const uint8_t *q = blk + 16 + (j / 2) * 32;
            const int shift = (j & 1) * 4;
            float *o = out + b * COLS + j * 32;
            for (int i = 0; i < 32; i++) o[i] = scale * (float)((q[i] >> shift) & 15) - low;
        }
    }
}

/* d sum_j dx_j (sc_j isum_j) - dmin sum_j m_j sx_j: integer sums per sub-block times
 * their 6-bit scale stay exact (at most 63 * 15 * 127 * 32 < 2^22). */
GGUF_PORTABLE static float dot_q4_k(const uint8_t *blk, const int8_t *qx, const float *dx, const float *sx) {
    uint8_t sc[8], mn[8];
    gguf_k_scales(blk + 4, sc, mn);
    float scaled = 0.0f, mins = 0.0f;
    for (int j = 0; j < 8; j++) {
        const uint8_t *q = blk + 16 + (j / 2) * 32;
        const int shift = (j & 1) * 4;
        int sum = 0;
        for (int i = 0; i < 32; i++) sum += ((q[i] >> shift) & 15) * qx[j * 32 + i];
        scaled += dx[j] * (float)(sc[j] * sum);
        mins += sx[j] * (float)mn[j];
    }
    return gguf_f16(blk) * scaled - gguf_f16(blk + 2) * mins;
}

GGUF_FIXED_FLOAT_BEGIN
#if KV_HAVE_AVX2_FMA
/* Sub-block j: the low (j even) or high nibbles of 32 bytes against 32 activation bytes by
 * vpmaddubsw, vpmaddwd by its 6-bit scale (int32 lanes, exact), times dx_j; then per
 * super-block times d, minus (dmin m) . sx over the eight sub-blocks' lanes. */
GGUF_INLINE void q4_k_avx2(const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH], const int R,
                           const int B) {
    const int64_t nb32 = t->in / GGUF_QBLOCK;
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256 acc[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < t->blocks; k++)
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = t->w + r * t->row_bytes + k * BYTES;
            gguf_prefetch(blk, BYTES, gguf_prefetch_ahead(t));
            uint64_t scale_word, min_word;
            gguf_k_scale_words(blk + 4, &scale_word, &min_word);
            /* the eight scales as int16, in both 128-bit halves */
            const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)scale_word)));
            const __m256 d = _mm256_set1_ps(gguf_f16(blk));
            const __m256 low = _mm256_mul_ps(_mm256_set1_ps(gguf_f16(blk + 2)),
                                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)min_word))));
            __m256i q[8], scs[8];
            for (int c = 0; c < 4; c++) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
                q[2 * c] = _mm256_and_si256(bytes, low4);
                q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
            }
            for (int j = 0; j < 8; j++) scs[j] = _mm256_shuffle_epi8(sc, _mm256_set1_epi16((short)(2 * j | (2 * j + 1) << 8)));
            for (int b = 0; b < B; b++) {
                const int8_t *x = t->qx + b * t->in + k * COLS;
                const float *dx = t->dx + b * nb32 + k * 8;
                __m256 part = _mm256_setzero_ps();
                for (int j = 0; j < 8; j++) {
                    const __m256i pairs = _mm256_maddubs_epi16(q[j], _mm256_loadu_si256((const __m256i *)(x + 32 * j)));
                    part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, scs[j])), _mm256_set1_ps(dx[j]), part);
                }
                const __m256 sx = _mm256_loadu_ps(t->sx + b * nb32 + k * 8);
                acc[r][b] = _mm256_fnmadd_ps(low, sx, _mm256_fmadd_ps(part, d, acc[r][b]));
            }
        }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) sums[r][b] = gguf_sum256(acc[r][b]);
}
GGUF_TILE_VARIANTS(tile_q4_k_avx2, q4_k_avx2)
#endif

#if KV_HAVE_AVX512_VNNI
/* The sub-block scales and minimums of the tile's rows' super-block k, unpacked together (at
 * batch one, in cache about 1.1x the scalar unpacking per row): one 128-bit lane per row (its
 * 16-byte head: f16 d, f16 dmin, the 12 bytes gguf_k_scales reads), bytes 0-7 the eight 6-bit
 * scales and 8-15 the eight 6-bit minimums, into out [64]. */
GGUF_INLINE void q4_k_head_scales(const GgufTile *t, int64_t k, const int R, uint8_t out[64]) {
    __m512i heads = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(t->w + k * BYTES)));
    for (int r = 1; r < R; r++) /* R: 1 or 4 */
        heads = _mm512_mask_broadcast_i32x4(heads, (__mmask16)(15u << (4 * r)),
                                            _mm_loadu_si128((const __m128i *)(t->w + r * t->row_bytes + k * BYTES)));
    /* low bits: scales 0-3 and minimums 0-3 (6 bits of bytes 4-7, 8-11), scales 4-7 and minimums
     * 4-7 (the low and high nibbles of bytes 12-15); high bits: the top two of bytes 4-7, 8-11 */
    const __m512i low_from = _mm512_broadcast_i32x4(_mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13,
                                                                  14, 15));
    const __m512i high_from = _mm512_broadcast_i32x4(_mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9,
                                                                   10, 11));
    const __m512i six_or_four = _mm512_broadcast_i32x4(_mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63,
                                                                      0, 0, 0, 0));
    const __m512i a = _mm512_shuffle_epi8(heads, low_from);
    const __m512i low = _mm512_mask_blend_epi8(0xf000f000f000f000ull, _mm512_and_si512(a, six_or_four),
                                               _mm512_and_si512(_mm512_srli_epi16(a, 4), _mm512_set1_epi8(15)));
    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(_mm512_shuffle_epi8(heads, high_from), 2),
                                          _mm512_set1_epi8(0x30));
    _mm512_storeu_si512(out, _mm512_or_si512(low, high));
}

/* Per 128 columns one 64-byte load: its low nibbles are sub-blocks 4c and 4c + 2 (bytes
 * 0-31, 32-63), its high ones 4c + 1 and 4c + 3; the activations are gathered once per batch
 * row and super-block into that order. vpdpbusd (unsigned quants x int8 activations) gives
 * 8 lanes per sub-block, added up to each sub-block's integer sum; then the float order of
 * sub_block_sums.h (the GEMM's, gguf_gemm.c), eight lanes, one per sub-block. */
GGUF_INLINE void q4_k_avx512(const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH], const int R,
                             const int B) {
    const int64_t nb32 = t->in / GGUF_QBLOCK;
    const __m512i low4 = _mm512_set1_epi8(15);
    const __m512i order = _mm512_setr_epi32(0, 8, 4, 12, 1, 9, 5, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i d_then_dmin = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m256 acc[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < t->blocks; k++) {
        __m512i xs[GGUF_TILE_BATCH][4]; /* activations of sub-blocks (0, 2), (1, 3), (4, 6), (5, 7) */
        for (int b = 0; b < B; b++) {
            const int8_t *x = t->qx + b * t->in + k * COLS;
            for (int c = 0; c < 4; c++) {
                const int8_t *first = x + 128 * (c / 2) + 32 * (c % 2);
                xs[b][c] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)first)),
                                              _mm256_loadu_si256((const __m256i *)(first + 64)), 1);
            }
        }
        uint8_t scale_bytes[64];
        if (B == 1) q4_k_head_scales(t, k, R, scale_bytes);
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = t->w + r * t->row_bytes + k * BYTES;
            gguf_prefetch(blk, BYTES, gguf_prefetch_ahead(t));
            __m256 scale, low; /* d sc_j, dmin m_j: the same products either way */
            if (B == 1) {
                uint32_t d_bits;
                memcpy(&d_bits, blk, 4);
                const __m512 both = _mm512_mul_ps(
                    _mm512_permutexvar_ps(d_then_dmin,
                                          _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)d_bits)))),
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(scale_bytes + 16 * r)))));
                scale = _mm512_castps512_ps256(both);
                low = _mm512_castps512_ps256(_mm512_shuffle_f32x4(both, both, _MM_SHUFFLE(3, 2, 3, 2)));
            } else { /* fewer registers where the batch rows hold many */
                uint64_t scale_word, min_word;
                gguf_k_scale_words(blk + 4, &scale_word, &min_word);
                scale = _mm256_mul_ps(_mm256_set1_ps(gguf_f16(blk)),
                                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)scale_word))));
                low = _mm256_mul_ps(_mm256_set1_ps(gguf_f16(blk + 2)),
                                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)min_word))));
            }
            __m512i q[4];
            for (int h = 0; h < 2; h++) {
                const __m512i bytes = _mm512_loadu_si512(blk + 16 + 64 * h);
                q[2 * h] = _mm512_and_si512(bytes, low4);
                q[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
            }
            for (int b = 0; b < B; b++) {
                __m512i p[4];
                for (int c = 0; c < 4; c++) p[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[c], xs[b][c]);
                const __m256 s = _mm256_mul_ps(scale, _mm256_loadu_ps(t->dx + b * nb32 + k * 8));
                const __m256 sx = _mm256_loadu_ps(t->sx + b * nb32 + k * 8);
                const __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(gguf_sub_block_sums(p, order)), s, acc[r][b]);
                acc[r][b] = _mm256_fnmadd_ps(low, sx, a);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) sums[r][b] = gguf_sum256(acc[r][b]);
}
GGUF_TILE_VARIANTS(tile_q4_k_avx512, q4_k_avx512)
#endif
GGUF_FIXED_FLOAT_END

const GgufType gguf_q4_k = {12, COLS, BYTES, dequantize_q4_k, dot_q4_k, 
                            {NULL, GGUF_AVX2(tile_q4_k_avx2), GGUF_AVX512(tile_q4_k_avx512)}};
