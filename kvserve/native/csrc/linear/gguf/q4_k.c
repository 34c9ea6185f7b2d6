/* Q4_K (ggml type 12): super-blocks of 256 columns, 144 bytes: f16 d, f16 dmin, 12
 * bytes of 6-bit sub-block scales and minimums (gguf_k_scales), then 128 bytes of
 * nibbles: per 64 columns 32 bytes, the low nibbles columns 0-31 and the high nibbles
 * columns 32-63. Sub-block j (32 columns): w = (d sc_j) q - (dmin m_j). */
#include "gguf_type.h"
#include "kvserve.h"

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

#if KV_HAVE_AVX512_VNNI
/* Per 64 columns one 32-byte load: its low nibbles are sub-block 2c, its high ones 2c + 1,
 * together the 64 activation bytes in column order; vpdpbusd (unsigned quants x int8
 * activations) gives 8 lanes per sub-block. Per (row, batch row) and super-block:
 * sum_c cvt(sc-scaled integer lanes) * dx lanes, times d, minus dmin m . sx. */
GGUF_INLINE void q4_k_avx512(const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH], const int R,
                             const int B) {
    const int64_t nb32 = t->in / GGUF_QBLOCK;
    __m512 acc[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < t->blocks; k++) {
        __m512 dxs[GGUF_TILE_BATCH][4]; /* dx of sub-blocks 2c, 2c + 1 over 8 lanes each */
        for (int b = 0; b < B; b++) {
            const __m256 dx = _mm256_loadu_ps(t->dx + b * nb32 + k * 8);
            for (int c = 0; c < 4; c++) dxs[b][c] = gguf_spread2(dx, 2 * c, 2 * c + 1);
        }
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = t->w + r * t->row_bytes + k * BYTES;
            _mm_prefetch((const char *)blk + 4 * BYTES, _MM_HINT_T0);
            uint64_t scale_word, min_word;
            gguf_k_scale_words(blk + 4, &scale_word, &min_word);
            const __m512i sc = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)scale_word));
            const __m512 d = _mm512_set1_ps(gguf_f16(blk));
            const __m256 low = _mm256_mul_ps(_mm256_set1_ps(gguf_f16(blk + 2)),
                                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)min_word))));
            __m512i q[4], scs[4];
            for (int c = 0; c < 4; c++) {
                q[c] = gguf_nibbles64(_mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c)));
                scs[c] = _mm512_permutexvar_epi32(_mm512_set_epi32(2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1,
                                                                   2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c, 2 * c, 2 * c,
                                                                   2 * c, 2 * c, 2 * c, 2 * c, 2 * c), sc);
            }
            for (int b = 0; b < B; b++) {
                const int8_t *x = t->qx + b * t->in + k * COLS;
                __m512 part = _mm512_setzero_ps();
                for (int c = 0; c < 4; c++) {
                    const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[c], _mm512_loadu_si512(x + 64 * c));
                    part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(sum, scs[c])), dxs[b][c], part);
                }
                const __m512 sx = _mm512_zextps256_ps512(_mm256_loadu_ps(t->sx + b * nb32 + k * 8));
                acc[r][b] = _mm512_fnmadd_ps(_mm512_zextps256_ps512(low), sx, _mm512_fmadd_ps(part, d, acc[r][b]));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) sums[r][b] = gguf_sum512(acc[r][b]);
}
GGUF_TILE_VARIANTS(tile_q4_k_avx512, q4_k_avx512)
#endif

const GgufType gguf_q4_k = {12, COLS, BYTES, dequantize_q4_k, dot_q4_k, {NULL, NULL, GGUF_AVX512(tile_q4_k_avx512)}};
