/* Q8_0 (ggml type 8): blocks of 32 columns, 34 bytes: f16 d, then 32 int8 quants;
 * w = d * q. */
#include "blocks32.h"
#include "gguf_type.h"
#include "kvserve.h"

#define COLS 32
#define BYTES 34

GGUF_EXACT static void dequantize_q8_0(const uint8_t *blocks, int64_t n, float *out) {
    for (int64_t b = 0; b < n; b++) {
        const uint8_t *blk = blocks + b * BYTES;
        const float d = gguf_f16(blk);
        for (int i = 0; i < COLS; i++) out[b * COLS + i] = (float)(int8_t)blk[2 + i] * d;
    }
}

GGUF_PORTABLE static float dot_q8_0(const uint8_t *blk, const int8_t *qx, const float *dx, const float *sx) {
    (void)sx;
    int sum = 0;
    for (int i = 0; i < COLS; i++) sum += (int8_t)blk[2 + i] * qx[i];
    return gguf_f16(blk) * dx[0] * (float)sum;
}

GGUF_INLINE float scale_q8_0(const uint8_t *blk) { return gguf_f16(blk); }

GGUF_FIXED_FLOAT_BEGIN
#if KV_HAVE_AVX2_FMA
GGUF_INLINE __m256i quants_q8_0(const uint8_t *blk) { return _mm256_loadu_si256((const __m256i *)(blk + 2)); }
#define Q8_0_AVX2(t, sums, R, B) gguf_tile32_avx2(t, sums, R, B, BYTES, quants_q8_0, scale_q8_0, NULL)
GGUF_TILE_VARIANTS(tile_q8_0_avx2, Q8_0_AVX2)
#endif
#if KV_HAVE_AVX512_VNNI
/* Signed quants plus 128: unsigned bytes for vpdpbusd. */
GGUF_INLINE __m512i quants2_q8_0(const uint8_t *b0, const uint8_t *b1) {
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                                            _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
    return _mm512_xor_si512(both, _mm512_set1_epi8((char)0x80));
}
#define Q8_0_AVX512(t, sums, R, B) gguf_tile32_exact_avx512(t, sums, R, B, BYTES, 128, quants2_q8_0, NULL)
GGUF_TILE_VARIANTS(tile_q8_0_avx512, Q8_0_AVX512)
#endif
GGUF_FIXED_FLOAT_END

const GgufType gguf_q8_0 = {8, COLS, BYTES, dequantize_q8_0, dot_q8_0,
                            {NULL, GGUF_AVX2(tile_q8_0_avx2), GGUF_AVX512(tile_q8_0_avx512)}};
