/* Q8_0's many-row GEMM on AVX-512 VNNI: gemm32.h's, the block's 32 int8 values after its f16 d. */
#include "gemm32.h"

#if KV_HAVE_AVX512_VNNI
GGUF_INLINE __m256i values_q8_0(const uint8_t *blk) { return _mm256_loadu_si256((const __m256i *)(blk + 2)); }
#endif
GGUF_GEMM32(gguf_q8_0_gemm_avx512, 8, 34, values_q8_0)
