/* GGUF Q3_K (ggml type 11): super-blocks of 256 columns in 110 bytes: 32 bytes of high bits
 * (byte l, bit g: column l of group g), 64 bytes of 2-bit lows (bytes 32n..32n+31 hold
 * groups 4n..4n+3, group 4n + j in bits 2j, 2j+1), 12 bytes of sixteen 6-bit scales (one
 * per 16 columns, stored +32), f16 d. w_i = d (s_h - 32) q_i with q_i = low + 4 high - 4. */
#define BLOCK_COLS 256
#define BLOCK_BYTES 110
#define QUANTS_SIGNED 1
#define SCALES_PER_16 1
#define MINS MINS_NONE
#include "group_kernels.h"

static void block_head(const uint8_t *block, BlockHead *h) {
    const uint8_t *s = block + 96;
    const float d = gguf_f16(block + 108);
    for (int i = 0; i < 16; i++) {
        int low = i < 8 ? s[i] & 15 : s[i - 8] >> 4, high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        h->sub[i] = (int16_t)((low | high << 4) - 32);
    }
    for (int g = 0; g < GROUPS; g++) h->scale[g] = d;
}

static void group_quants(const uint8_t *block, int g, int8_t q[GROUP]) {
    const uint8_t *high = block, *low = block + 32 + 32 * (g / 4);
    const int shift = 2 * (g % 4);
    for (int l = 0; l < GROUP; l++) q[l] = (int8_t)(((low[l] >> shift) & 3) + 4 * ((high[l] >> g) & 1) - 4);
}

#if KV_HAVE_AVX2_FMA
static __m256i group_quants256(const uint8_t *block, int g) {
    __m256i low = _mm256_loadu_si256((const __m256i *)(block + 32 + 32 * (g / 4)));
    low = _mm256_and_si256(_mm256_srli_epi16(low, 2 * (g % 4)), _mm256_set1_epi8(3));
    __m256i high = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)block), g), _mm256_set1_epi8(1));
    return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 2)), _mm256_set1_epi8(4));
}
#endif

GGUF_BLOCK_TYPE(gguf_q3_k, 11)
