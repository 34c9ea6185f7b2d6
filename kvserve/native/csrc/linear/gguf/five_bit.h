/* The 32 five-bit quants of a Q5_0 / Q5_1 block: 4 bytes of high bits (bit i: column i),
 * then 16 bytes of low nibbles (byte i: column i in its low nibble, column 16 + i in its
 * high one). */
#ifndef KVSERVE_GGUF_FIVE_BIT_H
#define KVSERVE_GGUF_FIVE_BIT_H

#include <string.h>

#include "blocks32.h"

static inline void five_bit_quants(const uint8_t *high, const uint8_t *low, int bias, int8_t q[32]) {
    const uint32_t bits = (uint32_t)high[0] | (uint32_t)high[1] << 8 | (uint32_t)high[2] << 16 | (uint32_t)high[3] << 24;
    for (int i = 0; i < 16; i++) {
        q[i] = (int8_t)((low[i] & 15) + (int)((bits >> i) & 1) * 16 + bias);
        q[i + 16] = (int8_t)((low[i] >> 4) + (int)((bits >> (i + 16)) & 1) * 16 + bias);
    }
}

#if KV_HAVE_AVX2
/* Byte i of the result: 16 where bit i of the 32 bits at `high` is set, else 0. */
static inline __m256i bits_to_sixteens(const uint8_t *high) {
    uint32_t bits;
    memcpy(&bits, high, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0x0000000000000000));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

static inline __m256i five_bit_quants256(const uint8_t *high, const uint8_t *low) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)low);
    const __m128i mask = _mm_set1_epi8(15);
    const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
    return _mm256_or_si256(nibbles, bits_to_sixteens(high));
}
#endif
#if KV_HAVE_AVX512_VNNI
/* Two blocks' quants (64 columns, unsigned 0..31): blocks32.h's nibbles, 16 added where a high
 * bit is set (the two 32-bit words of high bits are the byte mask). */
static inline __m512i five_bit_quants512(const uint8_t *high0, const uint8_t *low0, const uint8_t *high1,
                                         const uint8_t *low1) {
    uint32_t bits0, bits1;
    memcpy(&bits0, high0, 4);
    memcpy(&bits1, high1, 4);
    const __m512i nibbles = gguf_nibbles32x2(low0, low1);
    return _mm512_mask_add_epi8(nibbles, (__mmask64)bits0 | (__mmask64)bits1 << 32, nibbles, _mm512_set1_epi8(16));
}
#endif
#endif /* KVSERVE_GGUF_FIVE_BIT_H */
