/* GGUF MXFP4 (ggml type 39, gpt-oss): blocks of 32 columns in 17 bytes: an E8M0 exponent e
 * and 16 bytes of 4-bit FP4 (E2M1) codes (nibble_table.h). The table holds twice each E2M1
 * value, so w_i = 2^(e - 128) t[k_i] (ggml's "e8m0 to fp32 half").
 *
 * The AVX-512 VNNI tile is blocks32.h's exact-sums one (Q8_0's and Q5_0's order): per block
 * the exact int32 sum I = sum t[k_i] qx_i (vpdpbusd of t + 12, 0..24, against qx, less
 * 12 sum qx; |I| <= 32 * 12 * 128), then A_(b % 8) = fma((float)I, 2^(e - 128) dx, A_(b % 8)),
 * the scale product exact but for underflow, and the eight accumulators summed at the end.
 * The many-row GEMM (mxfp4_gemm.c) takes the same float operations, so a row's result is the
 * same at any batch. The portable and AVX2 paths are group_kernels.h's. */
#define BLOCK_COLS 32
#define BLOCK_BYTES 17
#define QUANTS_SIGNED 1
#define SCALES_PER_16 0
#define MINS MINS_NONE
#define AVX512_TILE tile_mxfp4_vnni
#include "group_kernels.h"
#include "blocks32.h"
#include "mxfp4_values.h"
#include "nibble_table.h"

static void block_head(const uint8_t *block, BlockHead *h) { h->scale[0] = half_exponent(block[0]); }

static void group_quants(const uint8_t *block, int g, int8_t q[GROUP]) {
    (void)g;
    table_quants(block + 1, FP4_VALUES, q);
}

#if KV_HAVE_AVX2_FMA
static __m256i group_quants256(const uint8_t *block, int g) {
    (void)g;
    return table_quants256(block + 1, FP4_VALUES);
}
#endif

GGUF_FIXED_FLOAT_BEGIN
#if KV_HAVE_AVX512_VNNI
#define FP4_OFFSET 12 /* added to the table's values: unsigned bytes for vpdpbusd */
static const int8_t FP4_PLUS_OFFSET[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

/* Blocks b0 and b1's 64 values plus FP4_OFFSET, in column order. */
GGUF_INLINE __m512i quants2_mxfp4(const uint8_t *b0, const uint8_t *b1) {
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)FP4_PLUS_OFFSET));
    return _mm512_shuffle_epi8(table, gguf_nibbles32x2(b0 + 1, b1 + 1));
}

/* half_exponent of the n blocks from row on, lanes past n zero. */
GGUF_INLINE __m256 scales_mxfp4(const uint8_t *row, const int n) {
    uint64_t exponents = 0;
    for (int j = 0; j < n; j++) exponents |= (uint64_t)row[j * BLOCK_BYTES] << (8 * j);
    const __m256i e = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)exponents));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __mmask8 small = _mm256_cmplt_epu32_mask(e, _mm256_set1_epi32(2));
    return _mm256_maskz_mov_ps((__mmask8)((1u << n) - 1),
                               _mm256_castsi256_ps(_mm256_mask_blend_epi32(small, normal, subnormal)));
}
#define MXFP4_AVX512(t, sums, R, B) \
    gguf_tile32_exact_avx512(t, sums, R, B, BLOCK_BYTES, FP4_OFFSET, quants2_mxfp4, scales_mxfp4)
GGUF_TILE_VARIANTS(tile_mxfp4_vnni, MXFP4_AVX512)
#endif
GGUF_FIXED_FLOAT_END

GGUF_BLOCK_TYPE(gguf_mxfp4, 39)
