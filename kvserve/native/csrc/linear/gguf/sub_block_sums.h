/* The float order the AVX-512 paths of the 256-column K types (Q4_K, Q6_K) share between
 * their batch-one tiles (<type>.c) and their many-row GEMM (gguf_gemm.c, <type>_gemm.c),
 * so that a row's outputs are bit for bit the same whatever the batch (#27).
 *
 * Per (weight row, activation row) eight float32 accumulators A_0..A_7, one per 32-column
 * sub-block position j of a super-block. For each super-block in column order, its integer
 * sum over sub-block j, I_j (exact in int32 and in float32: below 2^24), updates A_j:
 *   Q4_K: A_j = fma((float)I_j, (d sc_j) dx_j, A_j), then A_j = fma(-(dmin m_j), sx_j, A_j)
 *   Q6_K: I_j = sc_2j isum_2j + sc_2j+1 isum_2j+1 (its two 16-column halves), then
 *         A_j = fma((float)I_j, d dx_j, A_j)
 * each product in parentheses rounded to float32 once, left to right. The output is
 * ((A_0 + A_4) + (A_2 + A_6)) + ((A_1 + A_5) + (A_3 + A_7)) (gguf_sum256's order), plus
 * the bias. The integer sums take one float operation per 32 columns, which is what lets
 * the GEMM put batch rows in the vector lanes and stay compute-bound on integer products.
 */
#ifndef KVSERVE_GGUF_SUB_BLOCK_SUMS_H
#define KVSERVE_GGUF_SUB_BLOCK_SUMS_H

#include "gguf_type.h"

GGUF_FIXED_FLOAT_BEGIN
#if KV_HAVE_AVX512_VNNI
/* Four int32 vectors p[c], lanes 0-7 summing toward sub-block a_c and lanes 8-15 toward b_c,
 * to the eight sums a_0, a_2, b_0, b_2, a_1, a_3, b_1, b_3 at lanes 0, 1, 4, 5, 8, 9, 12, 13
 * of the result; `order` (an index vector) then moves them where the caller wants them in
 * the low eight lanes. Integer adds: exact in any order. */
GGUF_INLINE __m256i gguf_sub_block_sums(const __m512i p[4], const __m512i order) {
    const __m512i s01 = _mm512_add_epi32(_mm512_shuffle_i32x4(p[0], p[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                         _mm512_shuffle_i32x4(p[0], p[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i s23 = _mm512_add_epi32(_mm512_shuffle_i32x4(p[2], p[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                         _mm512_shuffle_i32x4(p[2], p[3], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi32(s01, s23), _mm512_unpackhi_epi32(s01, s23));
    const __m512i v = _mm512_add_epi32(u, _mm512_shuffle_epi32(u, _MM_PERM_BADC));
    return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, v));
}

/* The output of eight accumulators of 16 lanes each (one per sub-block position j), lane by
 * lane, in gguf_sum256's order. */
GGUF_INLINE __m512 gguf_sum8_lanes(const __m512 a[8]) {
    return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                         _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])));
}
#endif
GGUF_FIXED_FLOAT_END

#endif
