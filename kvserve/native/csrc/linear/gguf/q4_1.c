/* Q4_1 (ggml type 3): blocks of 32 columns, 20 bytes: f16 d, f16 m, then 16 bytes of
 * nibbles as Q4_0's; w = d * q + m. */
#include "blocks32.h"
#include "gguf_type.h"
#include "kvserve.h"

#define COLS 32
#define BYTES 20

GGUF_EXACT static void dequantize_q4_1(const uint8_t *blocks, int64_t n, float *out) {
    for (int64_t b = 0; b < n; b++) {
        const uint8_t *blk = blocks + b * BYTES;
        const float d = gguf_f16(blk), m = gguf_f16(blk + 2);
        float *o = out + b * COLS;
        for (int i = 0; i < 16; i++) {
            o[i] = d * (float)(blk[4 + i] & 15) + m;
            o[16 + i] = d * (float)(blk[4 + i] >> 4) + m;
        }
    }
}

GGUF_PORTABLE static float dot_q4_1(const uint8_t *blk, const int8_t *qx, const float *dx, const float *sx) {
    int sum = 0;
    for (int i = 0; i < 16; i++) sum += (blk[4 + i] & 15) * qx[i] + (blk[4 + i] >> 4) * qx[16 + i];
    return gguf_f16(blk) * dx[0] * (float)sum + gguf_f16(blk + 2) * sx[0];
}

GGUF_INLINE float scale_q4_1(const uint8_t *blk) { return gguf_f16(blk); }
GGUF_INLINE float minimum_q4_1(const uint8_t *blk) { return gguf_f16(blk + 2); }

GGUF_FIXED_FLOAT_BEGIN
#if KV_HAVE_AVX2_FMA
GGUF_INLINE __m256i quants_q4_1(const uint8_t *blk) { return gguf_nibbles32(blk + 4); }
#define Q4_1_AVX2(t, sums, R, B) gguf_tile32_avx2(t, sums, R, B, BYTES, quants_q4_1, scale_q4_1, minimum_q4_1)
GGUF_TILE_VARIANTS(tile_q4_1_avx2, Q4_1_AVX2)
#endif
#if KV_HAVE_AVX512_VNNI
#define Q4_1_AVX512(t, sums, R, B) gguf_tile32_nibbles_avx512(t, sums, R, B, BYTES, 0, 4, 1)
GGUF_TILE_VARIANTS(tile_q4_1_avx512, Q4_1_AVX512)
#endif
GGUF_FIXED_FLOAT_END

const GgufType gguf_q4_1 = {3, COLS, BYTES, dequantize_q4_1, dot_q4_1,
                            {NULL, GGUF_AVX2(tile_q4_1_avx2), GGUF_AVX512(tile_q4_1_avx512)}};
