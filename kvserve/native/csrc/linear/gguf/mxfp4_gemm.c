/* MXFP4's many-row GEMM on AVX-512 VNNI: gemm32.h's, the block's doubled E2M1 values
 * (mxfp4_values.h) and its scale 2^(e - 128), in the order of mxfp4.c's batch-one tile. */
#include "gemm32.h"
#include "mxfp4_values.h"
#include "nibble_table.h"

#if KV_HAVE_AVX512_VNNI
GGUF_INLINE __m256i values_mxfp4(const uint8_t *blk) { return table_quants256(blk + 1, FP4_VALUES); }
GGUF_INLINE float scale_mxfp4(const uint8_t *blk) { return half_exponent(blk[0]); }
#endif
GGUF_GEMM32_SCALED(gguf_mxfp4_gemm_avx512, 39, 17, values_mxfp4, scale_mxfp4)
