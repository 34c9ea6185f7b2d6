/* GGUF Q2_K (ggml type 10): super-blocks of 256 columns in 84 bytes: 16 bytes of 4-bit
 * scales (low nibble) and 4-bit minimums (high nibble), one per 16 columns; 64 bytes of 2-bit
 * quants (bytes 32n..32n+31 hold groups 4n..4n+3, group 4n + j in bits 2j, 2j+1); f16 d and
 * dmin. w_i = d s_h q_i - dmin m_h. */
#define BLOCK_COLS 256
#define BLOCK_BYTES 84
#define QUANTS_SIGNED 0
#define SCALES_PER_16 1
#define MINS MINS_PER_16
#include "group_kernels.h"

static void block_head(const uint8_t *block, BlockHead *h) {
    const float d = gguf_f16(block + 80);
    for (int i = 0; i < 16; i++) {
        h->sub[i] = block[i] & 15;
        h->min[i] = block[i] >> 4;
    }
    for (int g = 0; g < GROUPS; g++) h->scale[g] = d;
    h->min_scale = -gguf_f16(block + 82);
}

static void group_quants(const uint8_t *block, int g, int8_t q[GROUP]) {
    const uint8_t *bytes = block + 16 + 32 * (g / 4);
    const int shift = 2 * (g % 4);
    for (int l = 0; l < GROUP; l++) q[l] = (int8_t)((bytes[l] >> shift) & 3);
}

#if KV_HAVE_AVX2_FMA
static __m256i group_quants256(const uint8_t *block, int g) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + 16 + 32 * (g / 4)));
    return _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * (g % 4)), _mm256_set1_epi8(3));
}
#endif

GGUF_BLOCK_TYPE(gguf_q2_k, 10)
