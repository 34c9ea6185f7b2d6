/* y = x W^T (+ b) for a few rows of x: the decode-step matmul of a small batch.
 *
 * With one to a few tokens per step a linear layer is a stream over its weight
 * matrix, bound by memory bandwidth; oneDNN's packed bfloat16 path reaches
 * about half of it at these shapes. This kernel reads W in its plain [out, in]
 * layout once: each thread takes a slice of the output rows, a tile of four
 * rows at a time, and dots each with every row of x (x stays in L1), with
 * AVX512-BF16 dot products (float32 accumulation) for bfloat16 and FMAs for
 * float32. The rows of a tile are read side by side, so the hardware prefetcher
 * sees short interleaved streams; prefetching a few KiB ahead by hand is what
 * takes the kernel from ~11 to ~18 GB/s on the machine it was tuned on.
 * Results are rounded to the storage type once, as oneDNN does; only the order
 * of the float32 sum differs. Built with the other kernels by
 * kvserve/native/cpu_kernels.py.
 */
#include <stdint.h>

#include "bf16.h"
#include "kvserve.h"

#define TILE_ROWS 4 /* output rows per tile */
#define TILE_BATCH 4 /* rows of x per pass over a tile */
#define PREFETCH_BYTES 4096 /* how far ahead of the current load the weights are prefetched */
/* Smaller weights are read by one thread: a parallel region costs about as much as
 * reading this many bytes. */
#define PARALLEL_MIN_BYTES (256 * 1024)

#define INLINE static inline __attribute__((always_inline))

#if KV_HAVE_AVX512F

/* sums[r][b] = W[r, :] . x[b, :] for `rows` weight rows and `batch` x rows (both
 * constants after inlining, so the accumulators live in registers). Prefetches
 * never fault, so reading ahead past the last row is harmless. */
INLINE void tile_f32(const float *w, int64_t in, const float *x, int64_t x_stride, int rows, int batch,
                     float sums[TILE_ROWS][TILE_BATCH]) {
    __m512 acc[TILE_ROWS][TILE_BATCH];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < batch; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 16) {
        __mmask16 mask = in - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (in - i)) - 1);
        __m512 wv[TILE_ROWS];
        for (int r = 0; r < rows; r++) {
            _mm_prefetch((const char *)(w + r * in + i) + PREFETCH_BYTES, _MM_HINT_T0);
            wv[r] = _mm512_maskz_loadu_ps(mask, w + r * in + i);
        }
        for (int b = 0; b < batch; b++) {
            __m512 xv = _mm512_maskz_loadu_ps(mask, x + b * x_stride + i);
            for (int r = 0; r < rows; r++) acc[r][b] = _mm512_fmadd_ps(wv[r], xv, acc[r][b]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < batch; b++) sums[r][b] = _mm512_reduce_add_ps(acc[r][b]);
}

#if KV_HAVE_AVX512_BF16
#include "bf16_tile.h"
#endif
#endif /* KV_HAVE_AVX512F */

/* Whether this build has the kernel for the dtype (else the caller keeps oneDNN). */
int kvserve_small_linear_supported(int dtype) {
#if KV_HAVE_AVX512F
    return dtype == F32 || (dtype == BF16 && KV_HAVE_AVX512_BF16);
#else
    (void)dtype;
    return 0;
#endif
}

#if KV_HAVE_AVX512F
INLINE void tile_sums(const void *w, int64_t row, int64_t in, const void *x, int64_t x_stride, int rows, int batch,
                      int dtype, float sums[TILE_ROWS][TILE_BATCH]) {
#if KV_HAVE_AVX512_BF16
    if (dtype == BF16) {
        bf16_tile_avx512((const uint16_t *)w + row * in, in, (const uint16_t *)x, x_stride, rows, batch, sums);
        return;
    }
#endif
    tile_f32((const float *)w + row * in, in, (const float *)x, x_stride, rows, batch, sums);
}

/* Dispatch to a variant with `rows` and `batch` as constants. */
static void tile(const void *w, int64_t row, int64_t in, const void *x, int64_t x_stride, int rows, int batch,
                 int dtype, float sums[TILE_ROWS][TILE_BATCH]) {
#define CASE(R, B) \
    if (rows == R && batch == B) { tile_sums(w, row, in, x, x_stride, R, B, dtype, sums); return; }
    CASE(4, 4) CASE(4, 3) CASE(4, 2) CASE(4, 1)
    CASE(1, 4) CASE(1, 3) CASE(1, 2) CASE(1, 1)
#undef CASE
}

static void store_tile(float sums[TILE_ROWS][TILE_BATCH], int64_t row, int rows, int64_t b0, int batch,
                       const void *bias, void *y, int64_t y_stride, int dtype) {
    for (int r = 0; r < rows; r++) {
        float add = 0.0f;
        if (bias) add = dtype == F32 ? ((const float *)bias)[row + r] : bf16_value(((const uint16_t *)bias)[row + r]);
        for (int b = 0; b < batch; b++) {
            float v = sums[r][b] + add;
            int64_t at = (b0 + b) * y_stride + row + r;
            if (dtype == F32)
                ((float *)y)[at] = v;
            else
                ((uint16_t *)y)[at] = bf16_bits(v);
        }
    }
}
#endif

/* y[b, o] = sum_i x[b, i] w[o, i] (+ bias[o]) for b < batch, o < out; x and y rows are
 * x_stride / y_stride elements apart, w is contiguous [out, in], all of `dtype`.
 * Returns 0 when unsupported in this build (nothing written). */
int kvserve_small_linear(const void *x, int64_t x_stride, const void *w, const void *bias, int64_t out, int64_t in,
                         void *y, int64_t y_stride, int64_t batch, int dtype, int num_threads) {
    if (!kvserve_small_linear_supported(dtype)) return 0;
#if KV_HAVE_AVX512F
    const int64_t full_tiles = out / TILE_ROWS;
    const int64_t tiles = full_tiles + (out % TILE_ROWS);
    const int element = dtype == F32 ? 4 : 2;
    if (out * in * element < PARALLEL_MIN_BYTES) num_threads = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t row = t < full_tiles ? t * TILE_ROWS : full_tiles * TILE_ROWS + (t - full_tiles);
        int rows = t < full_tiles ? TILE_ROWS : 1;
        float sums[TILE_ROWS][TILE_BATCH];
        for (int64_t b0 = 0; b0 < batch; b0 += TILE_BATCH) {
            int chunk = batch - b0 < TILE_BATCH ? (int)(batch - b0) : TILE_BATCH;
            const char *xb = (const char *)x + b0 * x_stride * element;
            tile(w, row, in, xb, x_stride, rows, chunk, dtype, sums);
            store_tile(sums, row, rows, b0, chunk, bias, y, y_stride, dtype);
        }
    }
    return 1;
#else
    (void)x; (void)x_stride; (void)w; (void)bias; (void)out; (void)in; (void)y; (void)y_stride; (void)batch;
    (void)num_threads;
    return 0;
#endif
}

/* Rows row_begin..row_end of y = x W^T (+ bias), as kvserve_small_linear computes them,
 * on the calling thread only (the fused decoder splits rows over its own threads).
 * Returns 0 when unsupported in this build (nothing written). */
int kvserve_small_linear_rows(const void *x, int64_t x_stride, const void *w, const void *bias, int64_t in, void *y,
                              int64_t y_stride, int64_t batch, int dtype, int64_t row_begin, int64_t row_end) {
    if (!kvserve_small_linear_supported(dtype)) return 0;
#if KV_HAVE_AVX512F
    const int element = dtype == F32 ? 4 : 2;
    float sums[TILE_ROWS][TILE_BATCH];
    for (int64_t row = row_begin; row < row_end;) {
        int rows = row_end - row >= TILE_ROWS ? TILE_ROWS : 1;
        for (int64_t b0 = 0; b0 < batch; b0 += TILE_BATCH) {
            int chunk = batch - b0 < TILE_BATCH ? (int)(batch - b0) : TILE_BATCH;
            tile(w, row, in, (const char *)x + b0 * x_stride * element, x_stride, rows, chunk, dtype, sums);
            store_tile(sums, row, rows, b0, chunk, bias, y, y_stride, dtype);
        }
        row += rows;
    }
    return 1;
#else
    (void)x; (void)x_stride; (void)w; (void)bias; (void)in; (void)y; (void)y_stride; (void)batch;
    (void)row_begin; (void)row_end;
    return 0;
#endif
}
