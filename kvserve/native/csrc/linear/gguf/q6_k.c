/* Q6_K (ggml type 14): super-blocks of 256 columns, 210 bytes: 128 bytes of low nibbles
 * (ql), 64 bytes of high bit pairs (qh), 16 int8 scales (one per 16 columns), f16 d.
 * Column c = 128 h + p (h the half, p < 128): low nibble of ql[64 h + p % 64] (p < 64)
 * or its high nibble, high pair bits 2 (p / 32) of qh[32 h + p % 32];
 * w = (d sc_{c / 16}) (q - 32), q the 6-bit value. */
#include "gguf_type.h"
#include "kvserve.h"
#include "sub_block_sums.h"

#define COLS 256
#define BYTES 210

GGUF_INLINE int q6_value(const uint8_t *blk, int c) {
    const int h = c / 128, p = c % 128;
    const uint8_t low = blk[64 * h + p % 64], high = blk[128 + 32 * h + p % 32];
    return ((p < 64 ? low & 15 : low >> 4) | (((high >> (2 * (p / 32))) & 3) << 4)) - 32;
}

GGUF_EXACT static void dequantize_q6_k(const uint8_t *blocks, int64_t n, float *out) {
    for (int64_t b = 0; b < n; b++) {
        const uint8_t *blk = blocks + b * BYTES;
        const float d = gguf_f16(blk + 208);
        float scale[16];
        for (int k = 0; k < 16; k++) scale[k] = d * (float)(int8_t)blk[192 + k];
        /* column 128 h + 32 s + l: the loops run over l, so the compiler vectorizes them */
        for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
            for (int s = 0; s < 4; s++) {
                const uint8_t *ql = blk + 64 * h + 32 * (s & 1), *qh = blk + 128 + 32 * h;
                float *o = out + b * COLS + 128 * h + 32 * s;
                const float *sc = scale + 8 * h + 2 * s;
                for (int l = 0; l < 32; l++) {
                    const int low = s < 2 ? ql[l] & 15 : ql[l] >> 4;
                    o[l] = sc[l / 16] * (float)((low | (((qh[l] >> (2 * s)) & 3) << 4)) - 32);
                }
            }
    }
}

/* d sum_j dx_j (sc_2j isum_2j + sc_2j+1 isum_2j+1) over the eight 32-column blocks: the
 * integer part is at most 32 * 128 * 32 * 127 < 2^24, exact in float. */
GGUF_PORTABLE static float dot_q6_k(const uint8_t *blk, const int8_t *qx, const float *dx, const float *sx) {
    (void)sx;
    float acc = 0.0f;
    for (int j = 0; j < 8; j++) {
        int sum = 0;
        for (int half = 0; half < 2; half++) {
            const int k = 2 * j + half;
            int part = 0;
            for (int i = 0; i < 16; i++) part += q6_value(blk, k * 16 + i) * qx[k * 16 + i];
            sum += (int8_t)blk[192 + k] * part;
        }
        acc += dx[j] * (float)sum;
    }
    return gguf_f16(blk + 208) * acc;
}

GGUF_FIXED_FLOAT_BEGIN
#if KV_HAVE_AVX2_FMA
/* Per half h: two 32-byte loads of ql and one of qh give four groups of 32 columns (low
 * nibbles of each load, then high ones, two bits of qh on top); q - 32 against the int8
 * activations by vpmaddubsw with the sign trick, vpmaddwd by the int8 scales of the two
 * halves of 16 columns, times dx per group, and d per super-block. */
GGUF_INLINE void q6_k_avx2(const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH], const int R,
                           const int B) {
    const int64_t nb32 = t->in / GGUF_QBLOCK;
    const __m256i low4 = _mm256_set1_epi8(15), pair = _mm256_set1_epi8(0x30), offset = _mm256_set1_epi8(32);
    /* int16 lanes 0-7 take scale 2g, lanes 8-15 scale 2g + 1, of a dword holding both */
    const __m256i halves = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
                                            2, 3, 2, 3, 2, 3);
    __m256 acc[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < t->blocks; k++)
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = t->w + r * t->row_bytes + k * BYTES;
            gguf_prefetch(blk, BYTES, gguf_prefetch_ahead(t));
            const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
            const __m256 d = _mm256_set1_ps(gguf_f16(blk + 208));
            __m256i q[8], magnitude[8], scs[8];
            for (int h = 0; h < 2; h++) {
                const __m256i a = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
                const __m256i c = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                q[4 * h] = _mm256_or_si256(_mm256_and_si256(a, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), pair));
                q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(c, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), pair));
                q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low4), _mm256_and_si256(qh, pair));
                q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), low4),
                                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), pair));
            }
            for (int g = 0; g < 8; g++) {
                q[g] = _mm256_sub_epi8(q[g], offset);
                magnitude[g] = _mm256_sign_epi8(q[g], q[g]);
                scs[g] = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(sc, _mm256_set1_epi32(g)), halves);
            }
            for (int b = 0; b < B; b++) {
                const int8_t *x = t->qx + b * t->in + k * COLS;
                const float *dx = t->dx + b * nb32 + k * 8;
                __m256 part = _mm256_setzero_ps();
                for (int g = 0; g < 8; g++) {
                    const __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(x + 32 * g)), q[g]);
                    const __m256i sum = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[g], xs), scs[g]);
                    part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(dx[g]), part);
                }
                acc[r][b] = _mm256_fmadd_ps(part, d, acc[r][b]);
            }
        }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) sums[r][b] = gguf_sum256(acc[r][b]);
}
GGUF_TILE_VARIANTS(tile_q6_k_avx2, q6_k_avx2)
#endif

#if KV_HAVE_AVX512_VNNI
/* Per half h (128 columns) one 64-byte load of ql: its low nibbles are columns 0-63, its
 * high ones 64-127, each with two bits of qh on top: 6-bit unsigned quants q against the
 * int8 activations by vpdpbusd, minus 32 sum(qx) (the same vpdpbusd on a vector of 32s, once
 * per batch row and super-block), times the int8 scale of each 16 columns (4 lanes), added
 * up per 32 columns; then the float order of sub_block_sums.h (the GEMM's, gguf_gemm.c). */
GGUF_INLINE void q6_k_avx512(const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH], const int R,
                             const int B) {
    const int64_t nb32 = t->in / GGUF_QBLOCK;
    const __m512i low4 = _mm512_set1_epi8(15), pair = _mm512_set1_epi8(0x30), offset = _mm512_set1_epi8(32);
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    __m256 acc[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < t->blocks; k++) {
        __m512i minus[GGUF_TILE_BATCH][4]; /* -32 sum(qx) per lane */
        for (int b = 0; b < B; b++) {
            const int8_t *x = t->qx + b * t->in + k * COLS;
            for (int c = 0; c < 4; c++)
                minus[b][c] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                               _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset,
                                                                   _mm512_loadu_si512(x + 64 * c)));
        }
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = t->w + r * t->row_bytes + k * BYTES;
            gguf_prefetch(blk, BYTES, gguf_prefetch_ahead(t));
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)));
            const __m256 d = _mm256_set1_ps(gguf_f16(blk + 208));
            __m512i q[4], scs[4];
            for (int h = 0; h < 2; h++) {
                const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                const __m512i high = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
                q[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_and_si512(_mm512_slli_epi16(high, 4), pair));
                q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), _mm512_and_si512(high, pair));
            }
            for (int c = 0; c < 4; c++) {
                const int s = 4 * c; /* the scales of columns 64c..64c+63: s..s+3, four lanes each */
                scs[c] = _mm512_permutexvar_epi32(_mm512_set_epi32(s + 3, s + 3, s + 3, s + 3, s + 2, s + 2, s + 2, s + 2,
                                                                   s + 1, s + 1, s + 1, s + 1, s, s, s, s), sc);
            }
            for (int b = 0; b < B; b++) {
                const int8_t *x = t->qx + b * t->in + k * COLS;
                __m512i p[4];
                for (int c = 0; c < 4; c++)
                    p[c] = _mm512_mullo_epi32(_mm512_dpbusd_epi32(minus[b][c], q[c], _mm512_loadu_si512(x + 64 * c)),
                                              scs[c]);
                const __m256 s = _mm256_mul_ps(d, _mm256_loadu_ps(t->dx + b * nb32 + k * 8));
                acc[r][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(gguf_sub_block_sums(p, order)), s, acc[r][b]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) sums[r][b] = gguf_sum256(acc[r][b]);
}
GGUF_TILE_VARIANTS(tile_q6_k_avx512, q6_k_avx512)
#endif
GGUF_FIXED_FLOAT_END

const GgufType gguf_q6_k = {14, COLS, BYTES, dequantize_q6_k, dot_q6_k, 
                            {NULL, GGUF_AVX2(tile_q6_k_avx2), GGUF_AVX512(tile_q6_k_avx512)}};
