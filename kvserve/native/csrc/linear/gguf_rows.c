/* y = x W^T (+ b) with W in a GGUF block type exactly as the file stores it (#27): the
 * weight may be a view of the mmapped file, and a step reads each of its bytes once.
 *
 * The framework: the table of block types (one line per type; each type's dequantize,
 * portable dot and per-ISA tile kernels live in csrc/linear/gguf/<type>.c, described in
 * gguf/gguf_type.h), tiles of GGUF_TILE_ROWS weight rows x GGUF_TILE_BATCH activation
 * rows (a batched step reads each weight block once per tile, from cache for the next
 * batch rows), the split of rows over threads, and dequantization to float32/bfloat16
 * (embedding lookups, the dense GEMM of prefill-sized steps).
 *
 * Activations are kvserve_quant_activations' int8 format (act_bits 8). The path `isa`
 * is the caller's choice among those this build and CPU run (KV_KERNEL_QUANT's
 * requirements); a type without a tile for it takes the next narrower one it has.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "gguf/gemm.h"
#include "gguf/gguf_type.h"
#include "kvserve.h"

#define PARALLEL_MIN_BYTES (256 * 1024)
#define PANEL_BYTES (128 * 1024) /* weight rows a many-row step keeps in cache while the batch streams */
#define DEQUANT_PARALLEL_MIN (1 << 18) /* values: below this one thread dequantizes */

/* The block types computed as stored: one line each. */
static const GgufType *const TYPES[] = {
    &gguf_q4_0,
    &gguf_q4_1,
    &gguf_q8_0,
    &gguf_q4_k,
    &gguf_q6_k,
    &gguf_q5_0,
    &gguf_q5_1,
    &gguf_q5_k,
    &gguf_q3_k,
    &gguf_q2_k,
    &gguf_iq4_nl,
    &gguf_iq4_xs,
    &gguf_mxfp4,
};

static const GgufType *type_of(int type) {
    for (size_t i = 0; i < sizeof TYPES / sizeof TYPES[0]; i++)
        if (TYPES[i]->type == type) return TYPES[i];
    return NULL;
}

int kvserve_gguf_supported(int type, int isa) {
    const GgufType *t = type_of(type);
    if (!t || isa < 0 || isa >= ISA_COUNT || !kvserve_isa_available(KV_KERNEL_QUANT, isa)) return 0;
    return isa == ISA_PORTABLE || t->tile[isa] != NULL;
}

/* Bytes of one row of `in` columns, or -1 (unknown type, `in` not whole blocks). */
int64_t kvserve_gguf_row_bytes(int type, int64_t in) {
    const GgufType *t = type_of(type);
    if (!t || in <= 0 || in % t->block_cols) return -1;
    return in / t->block_cols * t->block_bytes;
}

/* ---- tiles ------------------------------------------------------------------------ */

/* The portable tile: the type's dot, block by block. */
static void tile_by_dot(const GgufType *type, const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH]) {
    const int64_t nb32 = t->in / GGUF_QBLOCK, per = type->block_cols / GGUF_QBLOCK;
    for (int r = 0; r < t->rows; r++)
        for (int b = 0; b < t->batch; b++) {
            const uint8_t *row = t->w + r * t->row_bytes;
            float acc = 0.0f;
            for (int64_t k = 0; k < t->blocks; k++)
                acc += type->dot(row + k * type->block_bytes, t->qx + b * t->in + k * type->block_cols,
                                 t->dx + b * nb32 + k * per, t->sx + b * nb32 + k * per);
            sums[r][b] = acc;
        }
}

/* The widest tile of `type` at most `isa`, or NULL: the portable tile by dot. */
static GgufTileFn tile_for(const GgufType *type, int isa) {
    for (int i = isa; i > ISA_PORTABLE; i--)
        if (type->tile[i]) return type->tile[i];
    return type->tile[ISA_PORTABLE];
}

/* Rows row..row_end (at most one panel) against batch rows b0..b0 + 4, tile by tile. */
static void panel_of(const GgufType *type, GgufTileFn tile, const int8_t *qx, const float *scales, int64_t batch,
                     int64_t b0, const uint8_t *w, int64_t in, const float *bias, float *y, int64_t y_stride,
                     int64_t row, int64_t row_end) {
    const int64_t nb32 = in / GGUF_QBLOCK, row_bytes = in / type->block_cols * type->block_bytes;
    float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    while (row < row_end) {
        const int rows = row_end - row >= GGUF_TILE_ROWS ? GGUF_TILE_ROWS : 1;
        GgufTile t = {w + row * row_bytes, row_bytes, in / type->block_cols, qx + b0 * in,
                      scales + b0 * nb32, scales + batch * nb32 + b0 * nb32, in, rows,
                      batch - b0 < GGUF_TILE_BATCH ? (int)(batch - b0) : GGUF_TILE_BATCH};
        if (tile)
            tile(&t, sums);
        else
            tile_by_dot(type, &t, sums);
        for (int r = 0; r < rows; r++)
            for (int b = 0; b < t.batch; b++)
                y[(b0 + b) * y_stride + row + r] = sums[r][b] + (bias ? bias[row + r] : 0.0f);
        row += rows;
    }
}

/* Rows row_begin..row_end for every batch row: panels of rows about PANEL_BYTES of weight,
 * each run against all batch rows four at a time, so a many-row step reads a panel from
 * memory once and the activations stream through the cache (a tile of a batch-one step is
 * its own panel). Tiles start at row_begin + 4k whatever the panels, and compute a row's
 * sums alike whatever the batch, so the results are those of one tile pass. */
static void rows_of(const GgufType *type, GgufTileFn tile, const int8_t *qx, const float *scales, int64_t batch,
                    const uint8_t *w, int64_t in, const float *bias, float *y, int64_t y_stride, int64_t row_begin,
                    int64_t row_end) {
    const int64_t row_bytes = in / type->block_cols * type->block_bytes;
    int64_t panel = PANEL_BYTES / row_bytes / GGUF_TILE_ROWS * GGUF_TILE_ROWS;
    if (panel < GGUF_TILE_ROWS || batch <= GGUF_TILE_BATCH) panel = GGUF_TILE_ROWS;
    for (int64_t row = row_begin; row < row_end; row += panel) {
        const int64_t end = row_end - row > panel ? row + panel : row_end;
        for (int64_t b0 = 0; b0 < batch; b0 += GGUF_TILE_BATCH)
            panel_of(type, tile, qx, scales, batch, b0, w, in, bias, y, y_stride, row, end);
    }
}

/* Rows row_begin..row_end of y [batch, y_stride] = x W^T (+ bias), from activations
 * quantized by kvserve_quant_activations (act_bits 8), on the calling thread only (the
 * fused decoder splits a matrix's rows over the threads of its one region). Each row's
 * sums do not depend on the range, the batch or the thread split. An unknown type or
 * `in` that is not whole blocks writes nothing (callers check kvserve_gguf_row_bytes). */
void kvserve_gguf_rows(const int8_t *qx, const float *scales, int64_t batch, const uint8_t *w, int type, int64_t in,
                       const float *bias, float *y, int64_t y_stride, int isa, int64_t row_begin, int64_t row_end) {
    const GgufType *t = type_of(type);
    if (!t || kvserve_gguf_row_bytes(type, in) < 0) return;
    const GgufGemmType *gemm = batch >= GGUF_GEMM_MIN_BATCH ? gguf_gemm_of(type, isa) : NULL;
    if (gemm && !gguf_gemm_rows(gemm, qx, scales, batch, w, in, kvserve_gguf_row_bytes(type, in), bias, y, y_stride,
                                row_begin, row_end))
        return;
    rows_of(t, tile_for(t, isa), qx, scales, batch, w, in, bias, y, y_stride, row_begin, row_end);
}

/* y [batch, out] = x W^T (+ bias): x float32 rows x_stride apart, quantized here, the
 * rows split over the OpenMP threads (contiguous ranges of whole tiles). Returns 0, -1
 * for bad arguments, -2 when `isa` does not run here, -3 when out of memory. */
int kvserve_gguf_linear(const float *x, int64_t x_stride, int64_t batch, const uint8_t *w, int type, int64_t in,
                        const float *bias, float *y, int64_t out, int isa) {
    const GgufType *t = type_of(type);
    const int64_t row_bytes = kvserve_gguf_row_bytes(type, in);
    if (!t || row_bytes < 0 || batch < 0 || out < 0 || x_stride < in) return -1;
    if (isa < 0 || isa >= ISA_COUNT || !kvserve_isa_available(KV_KERNEL_QUANT, isa)) return -2;
    if (batch == 0 || out == 0) return 0;
    const int64_t nb32 = in / GGUF_QBLOCK;
    int8_t *qx = malloc((size_t)(batch * in) + 64);
    float *scales = malloc(sizeof(float) * (size_t)(2 * batch * nb32));
    if (!qx || !scales) {
        free(qx);
        free(scales);
        return -3;
    }
    kvserve_quant_activations(x, x_stride, batch, in, 8, qx, scales);
    const GgufTileFn tile = tile_for(t, isa);
    const int64_t tiles = (out + GGUF_TILE_ROWS - 1) / GGUF_TILE_ROWS;
    const int parallel = out * row_bytes >= PARALLEL_MIN_BYTES;
    const GgufGemmType *gemm = batch >= GGUF_GEMM_MIN_BATCH ? gguf_gemm_of(type, isa) : NULL;
    if (gemm && !gguf_gemm_linear(gemm, qx, scales, batch, w, in, row_bytes, bias, y, out, parallel)) {
        free(qx);
        free(scales);
        return 0;
    }
#pragma omp parallel if (parallel)
    {
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t per = (tiles + threads - 1) / threads;
        int64_t begin = me * per * GGUF_TILE_ROWS, end = (me + 1) * per * GGUF_TILE_ROWS;
        if (end > out) end = out;
        if (begin < end) rows_of(t, tile, qx, scales, batch, w, in, bias, y, out, begin, end);
    }
    free(qx);
    free(scales);
    return 0;
}

/* Rows rows[0..n) of W (rows NULL: 0..n-1) as float32 (dtype F32) or bfloat16 (BF16)
 * rows of `in` values in dst, the file's values bit for bit (then rounded to bfloat16).
 * The caller checks the row indices. Returns 0, or -1 for an unknown type, `in` not
 * whole blocks or another dtype. */
int kvserve_gguf_dequantize(const uint8_t *w, int type, int64_t in, const int64_t *rows, int64_t n, void *dst,
                            int dtype) {
    const GgufType *t = type_of(type);
    const int64_t row_bytes = kvserve_gguf_row_bytes(type, in);
    if (!t || row_bytes < 0 || n < 0 || (dtype != F32 && dtype != BF16)) return -1;
    const int64_t blocks = in / t->block_cols;
#pragma omp parallel for schedule(static) if (n * in >= DEQUANT_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *src = w + (rows ? rows[i] : i) * row_bytes;
        if (dtype == F32) {
            t->dequantize(src, blocks, (float *)dst + i * in);
            continue;
        }
        float values[256];
        uint16_t *row = (uint16_t *)dst + i * in;
        for (int64_t k = 0; k < blocks; k++) {
            t->dequantize(src + k * t->block_bytes, 1, values);
            for (int c = 0; c < t->block_cols; c++) row[k * t->block_cols + c] = bf16_bits(values[c]);
        }
    }
    return 0;
}
