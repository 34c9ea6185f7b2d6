/* Q4_0 (ggml type 2): blocks of 32 columns, 18 bytes: f16 d, then 16 bytes whose low
 * nibbles hold columns 0-15 and high nibbles columns 16-31; w = d * (q - 8). */
#include "blocks32.h"
#include "gguf_type.h"
#include "kvserve.h"

#define COLS 32
#define BYTES 18

GGUF_EXACT static void dequantize_q4_0(const uint8_t *blocks, int64_t n, float *out) {
    for (int64_t b = 0; b < n; b++) {
        const uint8_t *blk = blocks + b * BYTES;
        const float d = gguf_f16(blk);
        float *o = out + b * COLS;
        for (int i = 0; i < 16; i++) {
            o[i] = d * (float)((blk[2 + i] & 15) - 8);
            o[16 + i] = d * (float)((blk[2 + i] >> 4) - 8);
        }
    }
}

/* d dx sum(q qx) - 8 d sx: the unsigned quants' sum, as the vector paths form it. */
GGUF_PORTABLE static float dot_q4_0(const uint8_t *blk, const int8_t *qx, const float *dx, const float *sx) {
    int sum = 0;
    for (int i = 0; i < 16; i++) sum += (blk[2 + i] & 15) * qx[i] + (blk[2 + i] >> 4) * qx[16 + i];
    const float d = gguf_f16(blk);
    return d * dx[0] * (float)sum - 8.0f * d * sx[0];
}

GGUF_INLINE float scale_q4_0(const uint8_t *blk) { return gguf_f16(blk); }

GGUF_FIXED_FLOAT_BEGIN
#if KV_HAVE_AVX2_FMA
GGUF_INLINE __m256i quants_q4_0(const uint8_t *blk) { return _mm256_sub_epi8(gguf_nibbles32(blk + 2), _mm256_set1_epi8(8)); }
#define Q4_0_AVX2(t, sums, R, B) gguf_tile32_avx2(t, sums, R, B, BYTES, quants_q4_0, scale_q4_0, NULL)
GGUF_TILE_VARIANTS(tile_q4_0_avx2, Q4_0_AVX2)
#endif
#if KV_HAVE_AVX512_VNNI
#define Q4_0_AVX512(t, sums, R, B) gguf_tile32_nibbles_avx512(t, sums, R, B, BYTES, 8, 2, 0)
GGUF_TILE_VARIANTS(tile_q4_0_avx512, Q4_0_AVX512)
#endif
GGUF_FIXED_FLOAT_END

const GgufType gguf_q4_0 = {2, COLS, BYTES, dequantize_q4_0, dot_q4_0,
                            {NULL, GGUF_AVX2(tile_q4_0_avx2), GGUF_AVX512(tile_q4_0_avx512)}};
