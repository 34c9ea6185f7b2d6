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
#define QUANT_PARALLEL_MIN (1 << 18)   /* activations: below this many one thread rounds them */

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

/* One tile: `rows` rows from w (row_bytes apart) over `blocks` blocks from 32-column block
 * `first`, against batch rows b0.. (at most GGUF_TILE_BATCH) into sums; returns its batch rows. */
static int run_tile(const GgufType *type, GgufTileFn tile, const int8_t *qx, const float *scales, int64_t batch,
                    int64_t b0, const uint8_t *w, int64_t row_bytes, int64_t in, int64_t first, int64_t blocks,
                    int rows, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH]) {
    const int64_t nb32 = in / GGUF_QBLOCK;
    GgufTile t = {w + first / (type->block_cols / GGUF_QBLOCK) * type->block_bytes, row_bytes, blocks,
                  qx + b0 * in + first * GGUF_QBLOCK, scales + b0 * nb32 + first,
                  scales + batch * nb32 + b0 * nb32 + first, in, rows,
                  batch - b0 < GGUF_TILE_BATCH ? (int)(batch - b0) : GGUF_TILE_BATCH};
    if (tile)
        tile(&t, sums);
    else
        tile_by_dot(type, &t, sums);
    return t.batch;
}

/* Rows row..row_end (at most one panel) against batch rows b0..b0 + 4, tile by tile. */
static void panel_of(const GgufType *type, GgufTileFn tile, const int8_t *qx, const float *scales, int64_t batch,
                     int64_t b0, const uint8_t *w, int64_t in, const float *bias, float *y, int64_t y_stride,
                     int64_t row, int64_t row_end) {
    const int64_t row_bytes = in / type->block_cols * type->block_bytes;
    float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    while (row < row_end) {
        const int rows = row_end - row >= GGUF_TILE_ROWS ? GGUF_TILE_ROWS : 1;
        const int n = run_tile(type, tile, qx, scales, batch, b0, w + row * row_bytes, row_bytes, in, 0,
                               in / type->block_cols, rows, sums);
        for (int r = 0; r < rows; r++)
            for (int b = 0; b < n; b++) y[(b0 + b) * y_stride + row + r] = sums[r][b] + (bias ? bias[row + r] : 0.0f);
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

/* ---- matmuls split by their input columns ---------------------------------------------
 * The fused decoder may split a projection by input columns (each thread multiplies the
 * columns it holds into partial products, added up in run order): the runs are fixed by the
 * type and `in` alone, so a row's result does not depend on the thread count. GGUF_SPLIT_RUNS
 * runs of whole blocks as even as the blocks allow (few, long runs: each run of each row ends
 * in a horizontal sum); one run where the row has fewer blocks (no split). */

/* The columns a split's runs are whole multiples of: the type's block, or the least common
 * multiple of it and `granule` (columns; 0: none) where `in` is whole multiples of that. */
static int64_t split_unit(const GgufType *t, int64_t in, int64_t granule) {
    int64_t unit = t->block_cols;
    if (granule > 0) {
        int64_t a = unit, b = granule;
        while (b) {
            const int64_t r = a % b;
            a = b, b = r;
        }
        if (in % (unit / a * granule) == 0) unit = unit / a * granule;
    }
    return unit;
}

/* Runs of a split of `in` columns of `type` with runs whole multiples of `granule` columns
 * where `in` allows (0: unknown type or `in` not whole blocks). */
int64_t kvserve_gguf_split_runs(int type, int64_t in, int64_t granule) {
    const GgufType *t = type_of(type);
    if (!t || kvserve_gguf_row_bytes(type, in) < 0) return 0;
    return in / split_unit(t, in, granule) >= GGUF_SPLIT_RUNS ? GGUF_SPLIT_RUNS : 1;
}

/* The first 32-column block of run c (c = the run count: the row's end). */
int64_t kvserve_gguf_split_bound(int type, int64_t in, int64_t granule, int64_t c) {
    const int64_t runs = kvserve_gguf_split_runs(type, in, granule);
    if (runs == 0) return 0;
    const int64_t unit = split_unit(type_of(type), in, granule), units = in / unit;
    return units * c / runs * (unit / GGUF_QBLOCK);
}

/* Partial products of rows row_begin..row_end over runs of the input columns: run c covers
 * the 32-column blocks bounds[c]..bounds[c + 1] (whole blocks of the type, ascending), and
 * y[c * run_stride + b * y_stride + row] = the tile's sum over those blocks of W[row] . x[b]
 * (activations as kvserve_gguf_rows takes them: only the runs' columns are read). Each run's
 * sums do not depend on the other runs, the row range or the batch. Calling thread only. */
void kvserve_gguf_partials(const int8_t *qx, const float *scales, int64_t batch, const uint8_t *w, int type,
                           int64_t in, const int64_t *bounds, int64_t num_runs, float *y, int64_t y_stride,
                           int64_t run_stride, int isa, int64_t row_begin, int64_t row_end) {
    const GgufType *type_info = type_of(type);
    const int64_t row_bytes = kvserve_gguf_row_bytes(type, in);
    if (!type_info || row_bytes < 0) return;
    const GgufTileFn tile = tile_for(type_info, isa);
    const int64_t per = type_info->block_cols / GGUF_QBLOCK;
    float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    for (int64_t row = row_begin; row < row_end;) {
        const int rows = row_end - row >= GGUF_TILE_ROWS ? GGUF_TILE_ROWS : 1;
        for (int64_t c = 0; c < num_runs; c++)
            for (int64_t b0 = 0; b0 < batch; b0 += GGUF_TILE_BATCH) {
                const int n = run_tile(type_info, tile, qx, scales, batch, b0, w + row * row_bytes, row_bytes, in,
                                       bounds[c], (bounds[c + 1] - bounds[c]) / per, rows, sums);
                for (int r = 0; r < rows; r++)
                    for (int b = 0; b < n; b++) y[c * run_stride + (b0 + b) * y_stride + row + r] = sums[r][b];
            }
        row += rows;
    }
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
    /* kvserve_quant_activations' layout (dx of every row, then sx), its rows shared out: each
     * row is rounded by itself, so the split changes no bit (a prefill step's rows would
     * otherwise be rounded by one thread while the others wait). */
#pragma omp parallel for schedule(static) if (batch * in >= QUANT_PARALLEL_MIN)
    for (int64_t b = 0; b < batch; b++)
        kvserve_quant_activation_blocks(x + b * x_stride, in, qx + b * in, scales + b * nb32,
                                        scales + (batch + b) * nb32);
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
