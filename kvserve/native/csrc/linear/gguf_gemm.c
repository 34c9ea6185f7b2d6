/* y = x W^T (+ b) for steps of many activation rows, W in a GGUF block type as stored (#27):
 * a real GEMM where gguf_rows.c's tiles read each weight block for four batch rows at a time.
 *
 * The activations (kvserve_quant_activations' int8 format) are packed once per step with the
 * batch rows in the vector lanes (gguf/gemm.h); the weight is unpacked a panel of rows at a
 * time into int8 values and float scales, once per step, and each panel serves every group
 * of batch rows from cache. A type's kernel (gguf/<type>_gemm.c) takes exact int32 sums per
 * 32 columns and applies the float scales in the order of that type's batch-one tile on the
 * same path (gguf/sub_block_sums.h), so each row's result is bit for bit the batch-one one,
 * whatever the batch, the row range or the thread split. Types and paths without a GEMM
 * keep the tiles.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "gguf/gemm.h"
#include "kvserve.h"

/* A panel: the weight rows unpacked together, about PANEL_BYTES (in the core's L2 cache), at
 * most MAX_PANEL_ROWS. Each panel serves every batch group, so the activations stream through
 * once per panel: a prefill-sized step of a wide matrix (2,048 rows of 8,192 columns) read them
 * from memory faster than the kernel used them with panels of 16 rows. */
#define PANEL_BYTES (384 * 1024)
#define MAX_PANEL_ROWS 128
/* The batch goes in slabs of about SLAB_BYTES of packed activations, which the panels of a slab
 * read from the last-level cache (each slab unpacks the weight again: once per 100+ rows). */
#define SLAB_BYTES (2 * 1024 * 1024)

/* Rows per panel for a range of `rows` weight rows (no more than the range needs). */
static int64_t panel_rows(int64_t panel_bytes, int64_t rows) {
    int64_t per = PANEL_BYTES / panel_bytes / GGUF_GEMM_ROWS * GGUF_GEMM_ROWS;
    per = per < GGUF_GEMM_ROWS ? GGUF_GEMM_ROWS : per > MAX_PANEL_ROWS ? MAX_PANEL_ROWS : per;
    const int64_t needed = (rows + GGUF_GEMM_ROWS - 1) / GGUF_GEMM_ROWS * GGUF_GEMM_ROWS;
    return needed < per ? needed : per;
}

static const GgufGemmType *const GEMMS[] = {&gguf_q4_k_gemm_avx512, &gguf_q6_k_gemm_avx512};

/* The GEMM of `type` matching the tiles of path `isa` where this build and CPU run it, or NULL. */
const GgufGemmType *gguf_gemm_of(int type, int isa) {
    if (isa < 0 || isa >= ISA_COUNT || !kvserve_isa_available(KV_KERNEL_QUANT, isa)) return NULL;
    for (size_t i = 0; i < sizeof GEMMS / sizeof GEMMS[0]; i++)
        if (GEMMS[i]->type == type && GEMMS[i]->isa == isa && GEMMS[i]->kernel) return GEMMS[i];
    return NULL;
}

int kvserve_gguf_gemm_supported(int type, int isa) { return gguf_gemm_of(type, isa) != NULL; }

int kvserve_gguf_gemm_min_batch(void) { return GGUF_GEMM_MIN_BATCH; }

/* Packs `batch` rows of qx [batch, in] and their scales (dx [batch, in / 32], then sx) as
 * gemm.h describes. Returns 0, or -3 when out of memory (px then holds nothing). */
static int pack_activations(const int8_t *qx, const float *scales, int64_t batch, int64_t in, GgufGemmX *px) {
    const int64_t K = in / 256, nb32 = in / 32, groups = (batch + GGUF_GEMM_LANES - 1) / GGUF_GEMM_LANES;
    const int64_t lanes = groups * GGUF_GEMM_LANES;
    uint8_t *x = aligned_alloc(64, (size_t)(lanes * in));
    float *dx = aligned_alloc(64, sizeof(float) * (size_t)(2 * lanes * nb32));
    if (!x || !dx) {
        free(x);
        free(dx);
        return -3;
    }
    float *sx = dx + lanes * nb32;
    if (lanes > batch) { /* padding lanes: x = 0, no scale */
        memset(x, 0x80, (size_t)(lanes * in));
        memset(dx, 0, sizeof(float) * (size_t)(2 * lanes * nb32));
    }
    for (int64_t b = 0; b < batch; b++) {
        const int64_t g = b / GGUF_GEMM_LANES, lane = b % GGUF_GEMM_LANES;
        for (int64_t n = 0; n < nb32; n++) {
            const int64_t k = n / 8, j = n % 8, block = ((g * 8 + j) * K + k);
            const int8_t *src = qx + b * in + n * 32;
            uint8_t *dst = x + block * 32 * GGUF_GEMM_LANES + 4 * lane;
            for (int s = 0; s < 8; s++) {
                uint32_t word;
                memcpy(&word, src + 4 * s, 4);
                word ^= 0x80808080u; /* x + 128 as unsigned bytes */
                memcpy(dst + s * 4 * GGUF_GEMM_LANES, &word, 4);
            }
            dx[block * GGUF_GEMM_LANES + lane] = scales[b * nb32 + n];
            sx[block * GGUF_GEMM_LANES + lane] = scales[batch * nb32 + b * nb32 + n];
        }
    }
    *px = (GgufGemmX){x, dx, sx, K, groups};
    return 0;
}

/* Rows row_begin..row_end of y [batch, y_stride] from packed activations, panel by panel;
 * `panel` holds panel_rows() unpacked rows of the range. */
static void gemm_range(const GgufGemmType *gt, const GgufGemmX *px, int64_t batch, const uint8_t *w,
                       int64_t row_bytes, const float *bias, float *y, int64_t y_stride, int64_t row_begin,
                       int64_t row_end, uint8_t *panel) {
    const int64_t pb = gt->panel_bytes(px->blocks);
    const int64_t per_panel = panel_rows(pb, row_end - row_begin);
    int64_t slab = SLAB_BYTES / (GGUF_GEMM_LANES * px->blocks * 256);
    if (slab < 1) slab = 1;
    for (int64_t g0 = 0; g0 < px->groups; g0 += slab) {
        const int64_t g1 = px->groups - g0 < slab ? px->groups : g0 + slab;
        for (int64_t first = row_begin; first < row_end; first += per_panel) {
            const int64_t rows = row_end - first < per_panel ? row_end - first : per_panel;
            const int64_t padded = (rows + GGUF_GEMM_ROWS - 1) / GGUF_GEMM_ROWS * GGUF_GEMM_ROWS;
            for (int64_t i = 0; i < rows; i++) gt->unpack(w + (first + i) * row_bytes, px->blocks, panel + i * pb);
            if (padded > rows) memset(panel + rows * pb, 0, (size_t)((padded - rows) * pb));
            for (int64_t g = g0; g < g1; g++) {
                const int64_t lanes = batch - g * GGUF_GEMM_LANES;
                for (int64_t r = 0; r < padded; r += GGUF_GEMM_ROWS) {
                    const GgufGemmOut o = {y + g * GGUF_GEMM_LANES * y_stride, y_stride, first + r,
                                           (int)(rows - r < GGUF_GEMM_ROWS ? rows - r : GGUF_GEMM_ROWS),
                                           (int)(lanes < GGUF_GEMM_LANES ? lanes : GGUF_GEMM_LANES),
                                           bias ? bias + first + r : NULL};
                    gt->kernel(panel + r * pb, pb, px, g, &o);
                }
            }
        }
    }
}

static uint8_t *alloc_panel(const GgufGemmType *gt, int64_t blocks, int64_t rows) {
    const int64_t pb = gt->panel_bytes(blocks);
    return aligned_alloc(64, (size_t)((panel_rows(pb, rows) * pb + 63) / 64 * 64));
}

int gguf_gemm_rows(const GgufGemmType *gt, const int8_t *qx, const float *scales, int64_t batch, const uint8_t *w,
                   int64_t in, int64_t row_bytes, const float *bias, float *y, int64_t y_stride, int64_t row_begin,
                   int64_t row_end) {
    GgufGemmX px;
    if (pack_activations(qx, scales, batch, in, &px)) return -3;
    uint8_t *panel = alloc_panel(gt, px.blocks, row_end - row_begin);
    if (panel) gemm_range(gt, &px, batch, w, row_bytes, bias, y, y_stride, row_begin, row_end, panel);
    free(panel);
    free((void *)px.x);
    free((void *)px.dx);
    return panel ? 0 : -3;
}

int gguf_gemm_linear(const GgufGemmType *gt, const int8_t *qx, const float *scales, int64_t batch, const uint8_t *w,
                     int64_t in, int64_t row_bytes, const float *bias, float *y, int64_t out, int parallel) {
    GgufGemmX px;
    if (pack_activations(qx, scales, batch, in, &px)) return -3;
    int failed = 0;
    const int64_t units = (out + GGUF_GEMM_ROWS - 1) / GGUF_GEMM_ROWS;
#pragma omp parallel if (parallel) reduction(| : failed)
    {
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t begin = units * me / threads * GGUF_GEMM_ROWS, end = units * (me + 1) / threads * GGUF_GEMM_ROWS;
        if (end > out) end = out;
        if (begin < end) {
            uint8_t *panel = alloc_panel(gt, px.blocks, end - begin);
            if (panel)
                gemm_range(gt, &px, batch, w, row_bytes, bias, y, out, begin, end, panel);
            else
                failed = 1;
            free(panel);
        }
    }
    free((void *)px.x);
    free((void *)px.dx);
    return failed ? -3 : 0;
}
