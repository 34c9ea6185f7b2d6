/* The AVX512-BF16 tile shared by small_linear.c and bf16_rows.c: `rows` (<= 4) bfloat16
 * weight rows of width `in` times `batch` (<= 4) bfloat16 rows of x (row stride
 * `x_stride`), float32 sums in sums[r][b]. Include it where AVX512F/BW/BF16 are enabled. */
#ifndef KVSERVE_BF16_TILE_H
#define KVSERVE_BF16_TILE_H
#include <immintrin.h>
#include <stdint.h>

#define BF16_TILE_ROWS 4
#define BF16_TILE_BATCH 4
#define BF16_TILE_PREFETCH_BYTES 4096 /* how far ahead of the current load the weights are prefetched */

static inline __attribute__((always_inline)) void bf16_tile_avx512(
    const uint16_t *w, int64_t in, const uint16_t *x, int64_t x_stride, int rows, int batch,
    float sums[BF16_TILE_ROWS][BF16_TILE_BATCH]) {
    __m512 acc[BF16_TILE_ROWS][BF16_TILE_BATCH];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < batch; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 32) {
        __mmask32 mask = in - i >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (in - i)) - 1);
        __m512bh wv[BF16_TILE_ROWS];
        for (int r = 0; r < rows; r++) {
            _mm_prefetch((const char *)(w + r * in + i) + BF16_TILE_PREFETCH_BYTES, _MM_HINT_T0);
            wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * in + i);
        }
        for (int b = 0; b < batch; b++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + b * x_stride + i);
            for (int r = 0; r < rows; r++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], wv[r], xv);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < batch; b++) sums[r][b] = _mm512_reduce_add_ps(acc[r][b]);
}
#endif
