/* Blocks of 32 four-bit indices into a table of 16 int8 values (IQ4_NL, IQ4_XS, MXFP4): 16
 * bytes, byte i holding column i in its low nibble and column 16 + i in its high one. */
#ifndef KVSERVE_GGUF_NIBBLE_TABLE_H
#define KVSERVE_GGUF_NIBBLE_TABLE_H

static inline void table_quants(const uint8_t *bytes, const int8_t table[16], int8_t q[32]) {
    for (int i = 0; i < 16; i++) {
        q[i] = table[bytes[i] & 15];
        q[i + 16] = table[bytes[i] >> 4];
    }
}

#if KV_HAVE_AVX2
/* The same with a byte shuffle: the table in both 128-bit lanes, indexed by the nibbles. */
static inline __m256i table_quants256(const uint8_t *bytes, const int8_t table[16]) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)bytes), mask = _mm_set1_epi8(15);
    const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table)), nibbles);
}
#endif
#endif /* KVSERVE_GGUF_NIBBLE_TABLE_H */
