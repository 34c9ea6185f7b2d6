/* Rows of y = x W^T (+ b) for bfloat16 weights and float32 activations: the
 * matmul of the native decoder (fused_decoder.c) on a bfloat16 model.
 *
 * The decoder keeps its activations in float32; each matmul rounds its input
 * rows to bfloat16 once (kvserve_bf16_round_rows, as the per-op bfloat16 path
 * holds them) and sums the exact bfloat16 products in float32. Three paths give
 * the same products, so only the order of the float32 sums differs between them:
 * AVX512-BF16 dot products (vdpbf16ps, 32 columns at a time), AVX2 + FMA on
 * weights widened to float32 (8 columns), and plain C. The caller picks one
 * among those this build and CPU run (kvserve_isa_available(KV_KERNEL_BF16, isa)); the codes
 * are quant_linear.c's, so one switch (KVSERVE_QUANT_ISA) caps both.
 *
 * Each call covers output rows row_begin..row_end on the calling thread: the
 * decoder shares the rows of every matrix out over its threads itself. Rows go
 * four at a time so that the weights of a tile stay in L1 while every row of x
 * passes over them.
 */
#include <stdint.h>

#include "bf16.h"
#include "kvserve.h"

#define TILE_ROWS 4
#define TILE_BATCH 4
#define PREFETCH_BYTES 4096 /* as small_linear.c: a few KiB ahead of the current load */

#define INLINE static inline __attribute__((always_inline))


/* xb [batch, in] = x rounded to bfloat16 (x rows x_stride floats apart). */
void kvserve_bf16_round_rows(const float *x, int64_t x_stride, int64_t batch, int64_t in, uint16_t *xb) {
    for (int64_t b = 0; b < batch; b++)
        for (int64_t i = 0; i < in; i++) xb[b * in + i] = bf16_bits(x[b * x_stride + i]);
}

/* sums[r][b] = W[row + r, :] . xb[b0 + b, :] for a tile of `rows` x `batch`. */
typedef void (*TileFn)(const uint16_t *w, int64_t in, const uint16_t *xb, int rows, int batch,
                       float sums[TILE_ROWS][TILE_BATCH]);

static void tile_portable(const uint16_t *w, int64_t in, const uint16_t *xb, int rows, int batch,
                          float sums[TILE_ROWS][TILE_BATCH]) {
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < batch; b++) {
            float s = 0.0f;
            for (int64_t i = 0; i < in; i++) s += bf16_value(w[r * in + i]) * bf16_value(xb[b * in + i]);
            sums[r][b] = s;
        }
}

#if KV_HAVE_AVX2_FMA
INLINE __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ROWS x BATCH constants after inlining: 8 accumulators and the loads fit in 16 registers. */
INLINE void tile_avx2_fixed(const uint16_t *w, int64_t in, const uint16_t *xb, int rows, int batch,
                            float sums[TILE_ROWS][TILE_BATCH]) {
    __m256 acc[TILE_ROWS][2];
    const int64_t body = in & ~(int64_t)7;
    for (int b0 = 0; b0 < batch; b0 += 2) {
        const int nb = batch - b0 < 2 ? batch - b0 : 2;
        for (int r = 0; r < rows; r++)
            for (int b = 0; b < nb; b++) acc[r][b] = _mm256_setzero_ps();
        for (int64_t i = 0; i < body; i += 8) {
            __m256 xv[2];
            for (int b = 0; b < nb; b++) xv[b] = widen8(xb + (b0 + b) * in + i);
            for (int r = 0; r < rows; r++) {
                __m256 wv = widen8(w + r * in + i);
                for (int b = 0; b < nb; b++) acc[r][b] = _mm256_fmadd_ps(wv, xv[b], acc[r][b]);
            }
        }
        for (int r = 0; r < rows; r++)
            for (int b = 0; b < nb; b++) {
                float s = hsum8(acc[r][b]);
                for (int64_t i = body; i < in; i++) s += bf16_value(w[r * in + i]) * bf16_value(xb[(b0 + b) * in + i]);
                sums[r][b0 + b] = s;
            }
    }
}

__attribute__((noinline)) static void tile_avx2(const uint16_t *w, int64_t in, const uint16_t *xb, int rows,
                                                int batch, float sums[TILE_ROWS][TILE_BATCH]) {
    if (rows == TILE_ROWS && batch == TILE_BATCH)
        tile_avx2_fixed(w, in, xb, TILE_ROWS, TILE_BATCH, sums);
    else
        tile_avx2_fixed(w, in, xb, rows, batch, sums);
}
#endif

#if KV_HAVE_AVX512_BF16
#include "bf16_tile.h"

__attribute__((noinline)) static void tile_avx512(const uint16_t *w, int64_t in, const uint16_t *xb, int rows,
                                                  int batch, float sums[TILE_ROWS][TILE_BATCH]) {
#define CASE(R, B) \
    if (rows == R && batch == B) { bf16_tile_avx512(w, in, xb, in, R, B, sums); return; }
    CASE(4, 4) CASE(4, 3) CASE(4, 2) CASE(4, 1)
    CASE(1, 4) CASE(1, 3) CASE(1, 2) CASE(1, 1)
#undef CASE
    bf16_tile_avx512(w, in, xb, in, rows, batch, sums);
}
#endif

static TileFn tile_for(int isa) {
#if KV_HAVE_AVX512_BF16
    if (isa == ISA_AVX512) return tile_avx512;
#endif
#if KV_HAVE_AVX2_FMA
    if (isa >= ISA_AVX2) return tile_avx2;
#endif
    (void)isa;
    return tile_portable;
}

/* Rows row_begin..row_end of y [batch, out] (rows y_stride apart) = xb W^T + bias, with
 * xb [batch, in] bfloat16 (kvserve_bf16_round_rows), W [out, in] bfloat16 contiguous,
 * bias float32 or NULL; `isa` must be one kvserve_isa_available(KV_KERNEL_BF16, isa) accepts. */
void kvserve_bf16_linear_rows(const uint16_t *xb, int64_t batch, const uint16_t *w, const float *bias, int64_t in,
                              float *y, int64_t y_stride, int isa, int64_t row_begin, int64_t row_end) {
    const TileFn tile = tile_for(isa);
    float sums[TILE_ROWS][TILE_BATCH];
    for (int64_t row = row_begin; row < row_end;) {
        const int rows = row_end - row >= TILE_ROWS ? TILE_ROWS : 1;
        for (int64_t b0 = 0; b0 < batch; b0 += TILE_BATCH) {
            const int chunk = batch - b0 < TILE_BATCH ? (int)(batch - b0) : TILE_BATCH;
            tile(w + row * in, in, xb + b0 * in, rows, chunk, sums);
            for (int r = 0; r < rows; r++)
                for (int b = 0; b < chunk; b++)
                    y[(b0 + b) * y_stride + row + r] = sums[r][b] + (bias ? bias[row + r] : 0.0f);
        }
        row += rows;
    }
}
