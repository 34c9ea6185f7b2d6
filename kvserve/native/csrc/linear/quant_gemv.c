/* One activation row times block-quantized weights (batch one, int8 activations),
 * AVX512-VNNI: the decode step of a single stream.
 *
 * Same weight layout and activation rounding as quant_linear.c, whose general
 * tile kernel is built for several activation rows and pays per weight row for
 * things a single row cannot share out: a horizontal sum per tail block, a full
 * 16-lane reduction, and a scalar pass over the blocks' minimums. At the default
 * model's widths (576 columns: four groups of four blocks and two tail blocks)
 * those cost more than the multiplies. Here four weight rows go together and
 * everything stays in vectors until the end:
 * - groups of four 4-bit blocks (or pairs of 8-bit blocks) accumulate
 *   d * dx * (integer dot) in one 16-lane float vector per row,
 * - tail 4-bit blocks in an 8-lane vector per row (no per-block reduction),
 * - the minimums' term sum_j m_j sx_j (and d_j sx_j for the 8-bit offset, see
 *   tile8_avx512) in a 4-lane vector per row, four blocks at a time,
 * and the four rows are reduced together into one 4-lane result.
 * The integer sums are the other paths' exactly; only float32 summation order differs.
 */
#include <omp.h>
#include <stdint.h>

#include "kvserve.h"

#if KV_HAVE_AVX512_VNNI

#define QBLOCK 32
#define GROUP_COLS 128
#define ROWS 4
#define PREFETCH_RUNS 2 /* software prefetch of the rows this many runs of four ahead */
#define CHUNK_ROWS 64   /* weight rows taken through every activation row of a batch at a time */

#define INLINE static inline __attribute__((always_inline))

/* One weight matrix as quant_linear.c lays it out, or a run of its blocks (qs, d, m
 * pointing at the run's first block): nb blocks read of each row, rows row_bytes and
 * stride blocks (of d and m) apart; m may be NULL (all minimums zero). */
typedef struct {
    const uint8_t *qs;
    const float *d, *m;
    int64_t row_bytes, nb, stride;
} Rows;

/* The activation row: int8 quants, per-block scale dx and dx * sum(quants) sx. */
typedef struct {
    const int8_t *qx;
    const float *dx, *sx;
} Act;

/* Lanes 0-7 take lane 2k of v, lanes 8-15 lane 2k + 1 (k = 0 or 1). */
INLINE __m512 spread(__m128 v, __m512i idx) { return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v)); }

/* {sum a[0], sum a[1], sum a[2], sum a[3]} for four 8-lane vectors. */
INLINE __m128 reduce4_256(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* {sum a[0], ..., sum a[3]} for four 4-lane vectors. */
INLINE __m128 reduce4_128(__m128 a0, __m128 a1, __m128 a2, __m128 a3) {
    return _mm_hadd_ps(_mm_hadd_ps(a0, a1), _mm_hadd_ps(a2, a3));
}

INLINE __m256 fold512(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}

/* m_j sx_j (+ scale d_j sx_j) over 4-block runs starting at block `first` of rows r..r+3, into mt. */
INLINE void min_terms(const Rows *w, const Act *a, const int64_t row[ROWS], int64_t first, float d_scale,
                      __m128 mt[ROWS]) {
    __m128 sx = _mm_loadu_ps(a->sx + first);
    for (int r = 0; r < ROWS; r++) {
        if (w->m) mt[r] = _mm_fmadd_ps(_mm_loadu_ps(w->m + row[r] * w->stride + first), sx, mt[r]);
        if (d_scale != 0.0f)
            mt[r] = _mm_fmadd_ps(_mm_mul_ps(_mm_loadu_ps(w->d + row[r] * w->stride + first), _mm_set1_ps(d_scale)), sx,
                                 mt[r]);
    }
}

/* Blocks whose count is not a multiple of four: their minimum terms one at a time. */
static float min_term_block(const Rows *w, const Act *a, int64_t row, int64_t blk, float d_scale) {
    float m = w->m ? w->m[row * w->stride + blk] : 0.0f;
    return (m + d_scale * w->d[row * w->stride + blk]) * a->sx[blk];
}

/* Four rows (indices row[]) of 4-bit weights: their dot products with the activation row. */
INLINE __m128 rows4_q4(const Rows *w, const Act *a, const int64_t row[ROWS]) {
    const __m512i low = _mm512_set1_epi8(15);
    const __m512i idx0 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i idx1 = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
    __m512 acc[ROWS];
    __m256 tail[ROWS];
    __m128 mt[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps(), tail[r] = _mm256_setzero_ps(), mt[r] = _mm_setzero_ps();
    const int64_t groups = w->nb / 4;
    for (int64_t g = 0; g < groups; g++) {
        __m512i x0 = _mm512_loadu_si512(a->qx + g * GROUP_COLS), x1 = _mm512_loadu_si512(a->qx + g * GROUP_COLS + 64);
        __m128 dx = _mm_loadu_ps(a->dx + g * 4);
        for (int r = 0; r < ROWS; r++) {
            const uint8_t *p = w->qs + row[r] * w->row_bytes + g * 64;
            __m512i v = _mm512_loadu_si512(p);
            __m128 s = _mm_mul_ps(_mm_loadu_ps(w->d + row[r] * w->stride + g * 4), dx);
            __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(v, low), x0);
            __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(_mm512_srli_epi16(v, 4), low), x1);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), spread(s, idx0), acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), spread(s, idx1), acc[r]);
        }
        min_terms(w, a, row, g * 4, 0.0f, mt);
    }
    float extra[ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
    const __m128i low16 = _mm_set1_epi8(15);
    for (int64_t blk = groups * 4; blk < w->nb; blk++) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(a->qx + blk * QBLOCK));
        for (int r = 0; r < ROWS; r++) {
            __m128i bytes = _mm_loadu_si128((const __m128i *)(w->qs + row[r] * w->row_bytes + groups * 64 +
                                                              (blk - groups * 4) * 16));
            __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low16), _mm_and_si128(bytes, low16));
            __m256 isum = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x));
            tail[r] = _mm256_fmadd_ps(isum, _mm256_set1_ps(w->d[row[r] * w->stride + blk] * a->dx[blk]), tail[r]);
            extra[r] += min_term_block(w, a, row[r], blk, 0.0f);
        }
    }
    __m128 dots = reduce4_256(_mm256_add_ps(fold512(acc[0]), tail[0]), _mm256_add_ps(fold512(acc[1]), tail[1]),
                              _mm256_add_ps(fold512(acc[2]), tail[2]), _mm256_add_ps(fold512(acc[3]), tail[3]));
    return _mm_add_ps(_mm_add_ps(dots, reduce4_128(mt[0], mt[1], mt[2], mt[3])), _mm_loadu_ps(extra));
}

/* Four rows of 8-bit weights. q is signed, so it is offset by 128 (xor 0x80) to be
 * vpdpbusd's unsigned operand; the 128 * sum(qx) that adds is taken off with -128 d_j sx_j. */
INLINE __m128 rows4_q8(const Rows *w, const Act *a, const int64_t row[ROWS]) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512i idx0 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i idx1 = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
    __m512 acc[ROWS];
    __m128 mt[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps(), mt[r] = _mm_setzero_ps();
    const int64_t quads = w->nb / 4;
    for (int64_t g = 0; g < quads; g++) {
        __m512i x0 = _mm512_loadu_si512(a->qx + g * 128), x1 = _mm512_loadu_si512(a->qx + g * 128 + 64);
        __m128 dx = _mm_loadu_ps(a->dx + g * 4);
        for (int r = 0; r < ROWS; r++) {
            const uint8_t *p = w->qs + row[r] * w->row_bytes + g * 128;
            __m128 s = _mm_mul_ps(_mm_loadu_ps(w->d + row[r] * w->stride + g * 4), dx);
            __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(_mm512_loadu_si512(p), flip), x0);
            __m512i i1 =
                _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(_mm512_loadu_si512(p + 64), flip), x1);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), spread(s, idx0), acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), spread(s, idx1), acc[r]);
        }
        min_terms(w, a, row, g * 4, -128.0f, mt);
    }
    float extra[ROWS] = {0.0f, 0.0f, 0.0f, 0.0f};
    __m256 tail[ROWS];
    const __m256i flip32 = _mm256_set1_epi8((char)0x80);
    for (int r = 0; r < ROWS; r++) tail[r] = _mm256_setzero_ps();
    for (int64_t blk = quads * 4; blk < w->nb; blk++) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(a->qx + blk * QBLOCK));
        for (int r = 0; r < ROWS; r++) {
            __m256i q = _mm256_xor_si256(
                _mm256_loadu_si256((const __m256i *)(w->qs + row[r] * w->row_bytes + blk * QBLOCK)), flip32);
            __m256 isum = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x));
            tail[r] = _mm256_fmadd_ps(isum, _mm256_set1_ps(w->d[row[r] * w->stride + blk] * a->dx[blk]), tail[r]);
            extra[r] += min_term_block(w, a, row[r], blk, -128.0f);
        }
    }
    __m128 dots = reduce4_256(_mm256_add_ps(fold512(acc[0]), tail[0]), _mm256_add_ps(fold512(acc[1]), tail[1]),
                              _mm256_add_ps(fold512(acc[2]), tail[2]), _mm256_add_ps(fold512(acc[3]), tail[3]));
    return _mm_add_ps(_mm_add_ps(dots, reduce4_128(mt[0], mt[1], mt[2], mt[3])), _mm_loadu_ps(extra));
}

/* x [in] float32 rounded per block of 32 to int8 exactly as quant_linear.c's quantize_row
 * does (same amax, same scale and reciprocal, round to nearest even), 16 lanes at a time:
 * qx [in], dx and sx = dx * sum(q) per block. Returns 1 (0 in a build without AVX-512). */
int kvserve_quantize_row8(const float *x, int64_t in, int8_t *qx, float *dx, float *sx) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t b = 0; b < in / QBLOCK; b++) {
        __m512 v0 = _mm512_loadu_ps(x + b * QBLOCK), v1 = _mm512_loadu_ps(x + b * QBLOCK + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(qx + b * QBLOCK), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(qx + b * QBLOCK + 16), _mm512_cvtsepi32_epi8(q1));
        dx[b] = amax / 127.0f;
        sx[b] = dx[b] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
    return 1;
}

/* Asks for `bytes` at p ahead of use, a cache line at a time. */
INLINE void prefetch_span(const void *p, int64_t bytes) {
    for (int64_t k = 0; k < bytes; k += 64) _mm_prefetch((const char *)p + k, _MM_HINT_T0);
}

/* y[row] = x . W[row] (+ bias[row]) for rows row_begin..row_end of one activation row.
 * The weights stream from memory once per step, so each run of four rows first asks for
 * the quants and scales of the run PREFETCH_RUNS later: the rows of a run sit next to
 * each other, and a core's own prefetchers start too late at these short row lengths
 * (measured: the Q8_0 LM head about 1.5x faster single-threaded with it). */
static void gemv_rows(const Rows *w, const Act *a, int bits, const float *bias, float *y, int64_t row_begin,
                      int64_t row_end) {
    const int64_t nb = w->nb;
    for (int64_t r0 = row_begin; r0 < row_end; r0 += ROWS) {
        int64_t row[ROWS];
        for (int r = 0; r < ROWS; r++) row[r] = r0 + r < row_end ? r0 + r : row_end - 1; /* repeat the last row */
        const int64_t ahead = r0 + PREFETCH_RUNS * ROWS;
        if (ahead + ROWS <= row_end) {
            prefetch_span(w->qs + ahead * w->row_bytes, ROWS * w->row_bytes);
            prefetch_span(w->d + ahead * nb, ROWS * nb * 4);
            if (w->m) prefetch_span(w->m + ahead * nb, ROWS * nb * 4);
        }
        float out[ROWS];
        _mm_storeu_ps(out, bits == 4 ? rows4_q4(w, a, row) : rows4_q8(w, a, row));
        for (int r = 0; r < ROWS && r0 + r < row_end; r++) y[r0 + r] = out[r] + (bias ? bias[r0 + r] : 0.0f);
    }
}

/* Rows row_begin..row_end of y [batch, y_stride] = x W^T (+ bias), on the calling thread.
 * qx: int8 activations [batch, in]; scales: dx of every row's blocks, then sx = dx * sum(q)
 * (kvserve_quant_activations' layout). Every activation row gets exactly the sums a
 * batch-one step computes for it, whatever the batch (so a speculative verify step or a
 * batch of a few requests decodes as each request would alone); the weight rows go a
 * chunk at a time so the later activation rows find them in cache. bits 4 or 8; m may be
 * NULL when every minimum is zero. Returns 1, or 0 when this build or `bits` has no such path. */
int kvserve_gemv_rows(const int8_t *qx, const float *scales, int64_t batch, const uint8_t *qs, const float *d,
                      const float *m, int bits, int64_t in, const float *bias, float *y, int64_t y_stride,
                      int64_t row_begin, int64_t row_end) {
    if (bits != 4 && bits != 8) return 0;
    const int64_t nb = in / QBLOCK;
    const Rows w = {qs, d, m, bits == 4 ? in / 2 : in, nb, nb};
    const int64_t chunk = batch == 1 ? row_end - row_begin : CHUNK_ROWS;
    for (int64_t c = row_begin; c < row_end; c += chunk) {
        const int64_t c_end = c + chunk < row_end ? c + chunk : row_end;
        for (int64_t b = 0; b < batch; b++) {
            const Act a = {qx + b * in, scales + b * nb, scales + batch * nb + b * nb};
            gemv_rows(&w, &a, bits, bias, y + b * y_stride, c, c_end);
        }
    }
    return 1;
}

/* Blocks [b0, b1) of every row of w (four-bit weights: b0 a multiple of four, and b1 too
 * or the row's end, so the run holds whole 64-byte groups and then the row's tail blocks). */
static Rows block_run(const Rows *w, int bits, int64_t b0, int64_t b1) {
    const Rows run = {w->qs + b0 * QBLOCK * bits / 8, w->d + b0, w->m ? w->m + b0 : NULL, w->row_bytes, b1 - b0,
                      w->stride};
    return run;
}

/* Partial products of one activation row over runs of blocks: for each run c < num_runs,
 * y[c * run_stride + row] = the sum over blocks [bounds[c], bounds[c + 1]) of x . W[row],
 * for rows row_begin..row_end, on the calling thread. A run's sums are those of the same
 * kernel over the run alone, whichever other runs a call takes with it (so a caller that
 * adds the runs up in a fixed order gets results that do not depend on how it shared the
 * runs out). qx, dx, sx: the row's int8 quants, block scales and dx * sum(q), indexed from
 * the row's first block (only the runs' blocks are read). Four-bit weights: every bound a
 * multiple of four blocks but the last, which may be the row's end (its tail blocks).
 * The rows are walked once, each row's blocks of all the runs together, the run of four
 * rows PREFETCH_RUNS ahead prefetched. Returns 1, or 0 when this build or `bits` has no such path. */
int kvserve_gemv_partials(const int8_t *qx, const float *dx, const float *sx, const uint8_t *qs, const float *d,
                          const float *m, int bits, int64_t in, const int64_t *bounds, int64_t num_runs, float *y,
                          int64_t run_stride, int64_t row_begin, int64_t row_end) {
    if (bits != 4 && bits != 8) return 0;
    const int64_t nb = in / QBLOCK, first = bounds[0], blocks = bounds[num_runs] - first;
    const Rows w = {qs, d, m, bits == 4 ? in / 2 : in, nb, nb};
    const int64_t span_bytes = blocks * QBLOCK * bits / 8, span_offset = first * QBLOCK * bits / 8;
    for (int64_t r0 = row_begin; r0 < row_end; r0 += ROWS) {
        int64_t row[ROWS];
        for (int r = 0; r < ROWS; r++) row[r] = r0 + r < row_end ? r0 + r : row_end - 1; /* repeat the last row */
        const int64_t ahead = r0 + PREFETCH_RUNS * ROWS;
        for (int r = 0; r < ROWS && ahead + ROWS <= row_end; r++) {
            prefetch_span(w.qs + (ahead + r) * w.row_bytes + span_offset, span_bytes);
            prefetch_span(w.d + (ahead + r) * nb + first, blocks * 4);
            if (w.m) prefetch_span(w.m + (ahead + r) * nb + first, blocks * 4);
        }
        for (int64_t c = 0; c < num_runs; c++) {
            const Rows run = block_run(&w, bits, bounds[c], bounds[c + 1]);
            const Act a = {qx + bounds[c] * QBLOCK, dx + bounds[c], sx + bounds[c]};
            float out[ROWS];
            _mm_storeu_ps(out, bits == 4 ? rows4_q4(&run, &a, row) : rows4_q8(&run, &a, row));
            for (int r = 0; r < ROWS && r0 + r < row_end; r++) y[c * run_stride + r0 + r] = out[r];
        }
    }
    return 1;
}

/* All `out` rows of y = x W^T (+ bias), the rows shared out over num_threads threads in
 * whole runs of four. Same arguments and result as kvserve_gemv_rows. */
int kvserve_gemv(const int8_t *qx, const float *scales, int64_t batch, const uint8_t *qs, const float *d,
                 const float *m, int bits, int64_t in, const float *bias, float *y, int64_t y_stride, int64_t out,
                 int num_threads) {
    if (bits != 4 && bits != 8) return 0;
    const int64_t runs = (out + ROWS - 1) / ROWS;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        const int64_t tid = omp_get_thread_num(), n = omp_get_num_threads();
        int64_t begin = runs * tid / n * ROWS, end = runs * (tid + 1) / n * ROWS;
        kvserve_gemv_rows(qx, scales, batch, qs, d, m, bits, in, bias, y, y_stride, begin, end < out ? end : out);
    }
    return 1;
}
#else
int kvserve_gemv_rows(const int8_t *qx, const float *scales, int64_t batch, const uint8_t *qs, const float *d,
                      const float *m, int bits, int64_t in, const float *bias, float *y, int64_t y_stride,
                      int64_t row_begin, int64_t row_end) {
    (void)qx, (void)scales, (void)batch, (void)qs, (void)d, (void)m, (void)bits, (void)in, (void)bias, (void)y,
        (void)y_stride, (void)row_begin, (void)row_end;
    return 0;
}

int kvserve_quantize_row8(const float *x, int64_t in, int8_t *qx, float *dx, float *sx) {
    (void)x, (void)in, (void)qx, (void)dx, (void)sx;
    return 0;
}

int kvserve_gemv_partials(const int8_t *qx, const float *dx, const float *sx, const uint8_t *qs, const float *d,
                          const float *m, int bits, int64_t in, const int64_t *bounds, int64_t num_runs, float *y,
                          int64_t run_stride, int64_t row_begin, int64_t row_end) {
    (void)qx, (void)dx, (void)sx, (void)qs, (void)d, (void)m, (void)bits, (void)in, (void)bounds, (void)num_runs,
        (void)y, (void)run_stride, (void)row_begin, (void)row_end;
    return 0;
}

int kvserve_gemv(const int8_t *qx, const float *scales, int64_t batch, const uint8_t *qs, const float *d,
                 const float *m, int bits, int64_t in, const float *bias, float *y, int64_t y_stride, int64_t out,
                 int num_threads) {
    (void)qx, (void)scales, (void)batch, (void)qs, (void)d, (void)m, (void)bits, (void)in, (void)bias, (void)y,
        (void)y_stride, (void)out, (void)num_threads;
    return 0;
}
#endif
