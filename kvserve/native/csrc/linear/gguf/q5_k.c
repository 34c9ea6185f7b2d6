/* GGUF Q5_K (ggml type 13): super-blocks of 256 columns in 176 bytes: f16 d and dmin, 12
 * bytes of eight 6-bit scales and eight 6-bit minimums (gguf_k_scales), 32 bytes of high bits
 * (byte l, bit g: column l of group g), 128 bytes of low nibbles (bytes 32j..32j+31: groups
 * 2j in the low nibbles, 2j + 1 in the high ones). w_i = d sc_g q_i - dmin m_g. */
#define BLOCK_COLS 256
#define BLOCK_BYTES 176
#define QUANTS_SIGNED 0
#define SCALES_PER_16 0
#define MINS MINS_PER_32
#include "group_kernels.h"

static void block_head(const uint8_t *block, BlockHead *h) {
    const float d = gguf_f16(block), dmin = gguf_f16(block + 2);
    uint8_t sc[8], mn[8];
    gguf_k_scales(block + 4, sc, mn);
    for (int g = 0; g < GROUPS; g++) {
        h->scale[g] = d * (float)sc[g];
        h->offset[g] = -(dmin * (float)mn[g]);
    }
}

static void group_quants(const uint8_t *block, int g, int8_t q[GROUP]) {
    const uint8_t *high = block + 16, *low = block + 48 + 32 * (g / 2);
    for (int l = 0; l < GROUP; l++) q[l] = (int8_t)(((low[l] >> (4 * (g & 1))) & 15) | ((high[l] >> g) & 1) << 4);
}

#if KV_HAVE_AVX2_FMA
static __m256i group_quants256(const uint8_t *block, int g) {
    const __m256i one = _mm256_set1_epi8(1);
    __m256i low = _mm256_loadu_si256((const __m256i *)(block + 48 + 32 * (g / 2)));
    if (g & 1) low = _mm256_srli_epi16(low, 4);
    low = _mm256_and_si256(low, _mm256_set1_epi8(15));
    __m256i high = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(block + 16)), g), one);
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
}
#endif

GGUF_BLOCK_TYPE(gguf_q5_k, 13)
