/* Q5_0's many-row GEMM on AVX-512 VNNI: gemm32.h's, the block's 5-bit values (five_bit.h) less 16. */
#include "five_bit.h"
#include "gemm32.h"

#if KV_HAVE_AVX512_VNNI
GGUF_INLINE __m256i values_q5_0(const uint8_t *blk) {
    return _mm256_sub_epi8(five_bit_quants256(blk + 2, blk + 6), _mm256_set1_epi8(16));
}
#endif
GGUF_GEMM32(gguf_q5_0_gemm_avx512, 6, 22, values_q5_0)
