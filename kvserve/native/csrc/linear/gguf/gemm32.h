/* The many-row GEMM of the 32-column block types with one scale d per block (Q8_0, Q5_0: an f16
 * first in the block; MXFP4: an E8M0 exponent) on AVX-512 VNNI (gemm.h), in the float order of
 * their batch-one tiles (blocks32.h's gguf_tile32_exact_avx512). A type's file gives a loader
 * of a block's 32 values as signed bytes (and of its float d) and instantiates GGUF_GEMM32 (or
 * GGUF_GEMM32_SCALED).
 *
 * Strip (GGUF_GEMM_ROWS rows): the values q [j][k][row][32] (int8; 32-column block b at
 * j = b % 8, k = b / 8, blocks past the row's end zero), then per super-block position k:
 * -128 sum(q) [row][j] (int32: the packed activations are x + 128) and d [row][j] (float32).
 * The kernel (8 rows against one lane group, or 4 against two): for each block position j,
 * over k in order, each lane's integer sum I by vpdpbusd of 4 packed activation bytes against
 * 4 values broadcast, then A_j = fma((float)I, d dx, A_j). A padding block adds fma(0, 0, A_j). */
#ifndef KVSERVE_GGUF_GEMM32_H
#define KVSERVE_GGUF_GEMM32_H

#include "gemm.h"
#include "gguf_type.h"
#include "kvserve.h"

#if KV_HAVE_AVX512_VNNI
enum { GEMM32_META = 2 * GGUF_GEMM_ROWS * 8 * 4 /* bytes of position k's corr and d for a strip */ };

static inline int64_t gemm32_panel_bytes(int64_t blocks) { return blocks * (256 + 8 * 8); }

/* The strip's corr of position k, block position j, row 0 (row r: 32 r bytes on; its d:
 * GGUF_GEMM_ROWS * 32 bytes on). */
static inline uint8_t *gemm32_meta(uint8_t *strip, int64_t blocks, int64_t k, int j) {
    return strip + blocks * 256 * GGUF_GEMM_ROWS + k * GEMM32_META + 4 * j;
}

GGUF_INLINE void gemm32_unpack(const uint8_t *row, int64_t in, uint8_t *strip, int r, const int bytes,
                               __m256i (*values)(const uint8_t *), float (*scale)(const uint8_t *)) {
    const int64_t blocks = gguf_gemm_blocks(in), nb32 = in / 32;
    for (int64_t b = 0; b < blocks * 8; b++) {
        const int j = (int)(b % 8);
        const int64_t k = b / 8;
        uint8_t *q = gguf_gemm_strip_q(strip, blocks, j, k) + 32 * r, *meta = gemm32_meta(strip, blocks, k, j) + 32 * r;
        int32_t corr = 0;
        float d = 0.0f;
        if (b < nb32) {
            const uint8_t *blk = row + b * bytes;
            const __m256i v = values(blk);
            _mm256_storeu_si256((__m256i *)q, v);
            /* sum(q) = sum(q + 128) - 32 * 128, the first by vpsadbw */
            const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)), _mm256_setzero_si256());
            const __m128i half = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
            corr = -128 * ((int32_t)(_mm_cvtsi128_si64(half) + _mm_extract_epi64(half, 1)) - 32 * 128);
            d = scale(blk);
        } else {
            memset(q, 0, 32);
        }
        memcpy(meta, &corr, 4);
        memcpy(meta + 32 * GGUF_GEMM_ROWS, &d, 4);
    }
}

GGUF_FIXED_FLOAT_BEGIN
/* `rows` strip rows from row0 against `groups` lane groups from g (constants where inlined). */
GGUF_INLINE void gemm32_tile(const uint8_t *strip, const int row0, const int rows, const int groups, const GgufGemmX *x,
                             int64_t g, const GgufGemmOut *o) {
    const int64_t K = x->blocks;
    __m512 acc[2][GGUF_GEMM_ROWS][8];
    for (int j = 0; j < 8; j++) {
        __m512 a[2][GGUF_GEMM_ROWS];
        for (int c = 0; c < groups; c++)
            for (int r = 0; r < rows; r++) a[c][r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k++) {
            gguf_gemm_prefetch(o, j * K + k);
            const uint8_t *meta = gemm32_meta((uint8_t *)strip, K, k, j) + 32 * row0;
            const int32_t *corr = (const int32_t *)meta;
            const float *scale = (const float *)(meta + 32 * GGUF_GEMM_ROWS);
            __m512i sum[2][GGUF_GEMM_ROWS];
            for (int c = 0; c < groups; c++)
                for (int r = 0; r < rows; r++) sum[c][r] = _mm512_set1_epi32(corr[8 * r]);
            const uint8_t *const xs[2] = {gguf_gemm_x(x, g, j, k), groups > 1 ? gguf_gemm_x(x, g + 1, j, k) : NULL};
            gguf_gemm_steps(sum, xs, gguf_gemm_strip_q(strip, K, j, k) + 32 * row0, rows, groups, 0, 8);
            for (int c = 0; c < groups; c++) {
                const __m512 dx = _mm512_loadu_ps(x->dx + gguf_gemm_scale_at(x, g + c, j, k));
                for (int r = 0; r < rows; r++)
                    a[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[c][r]),
                                              _mm512_mul_ps(_mm512_set1_ps(scale[8 * r]), dx), a[c][r]);
            }
        }
        for (int c = 0; c < groups; c++)
            for (int r = 0; r < rows; r++) acc[c][r][j] = a[c][r];
    }
    for (int c = 0; c < groups; c++) gguf_gemm_store(o + c, (const __m512(*)[8])acc[c]);
}
GGUF_FIXED_FLOAT_END

GGUF_INLINE float gemm32_f16_scale(const uint8_t *blk) { return gguf_f16(blk); }

/* `const GgufGemmType NAME` for ggml type TYPE, blocks of BYTES bytes whose values VALUES(blk)
 * loads and whose float d SCALE(blk) gives. */
#define GGUF_GEMM32_SCALED(NAME, TYPE, BYTES, VALUES, SCALE)                                                \
    static void NAME##_unpack(const uint8_t *row, int64_t in, uint8_t *strip, int r) {                       \
        gemm32_unpack(row, in, strip, r, BYTES, VALUES, SCALE);                                              \
    }                                                                                                        \
    static void NAME##_kernel(const uint8_t *strip, const GgufGemmX *x, int64_t g, const GgufGemmOut *o) {   \
        gemm32_tile(strip, 0, GGUF_GEMM_ROWS, 1, x, g, o);                                                   \
    }                                                                                                        \
    static void NAME##_pair(const uint8_t *strip, int half, const GgufGemmX *x, int64_t g,                   \
                            const GgufGemmOut o[2]) {                                                        \
        gemm32_tile(strip, GGUF_GEMM_ROWS / 2 * half, GGUF_GEMM_ROWS / 2, 2, x, g, o);                        \
    }                                                                                                        \
    const GgufGemmType NAME = {TYPE, ISA_AVX512, gemm32_panel_bytes, NAME##_unpack, NAME##_kernel, NAME##_pair};
#else
#define GGUF_GEMM32_SCALED(NAME, TYPE, BYTES, VALUES, SCALE) \
    const GgufGemmType NAME = {TYPE, ISA_AVX512, NULL, NULL, NULL, NULL};
#endif
/* The types whose d is an f16 first in the block. */
#define GGUF_GEMM32(NAME, TYPE, BYTES, VALUES) GGUF_GEMM32_SCALED(NAME, TYPE, BYTES, VALUES, gemm32_f16_scale)

#endif
