/* What a block type's many-row GEMM (csrc/linear/gguf/<type>_gemm.c) gives the framework
 * (csrc/linear/gguf_gemm.c), for steps of many activation rows (#27).
 *
 * The activations are packed once per step with batch rows in the vector lanes: groups of
 * GGUF_GEMM_LANES rows (the last padded with zeros), and for each group, 32-column block
 * position j of a super-block (0..7), super-block k and 4-column step s, the 4 bytes x + 128
 * (unsigned, for vpdpbusd) of each lane's row: x [group][j][k][s][lane][4]; dx and sx per
 * [group][j][k][lane]. A weight panel holds a few rows unpacked once (int8 values and float
 * scales) and serves every group of the step. It is a run of strips of GGUF_GEMM_ROWS rows,
 * the rows of a strip interleaved (laid out by the type): the 32 values of block position
 * (j, k) of the strip's rows side by side, q [j][k][row][32], then the scales of (k, j) for
 * the strip's rows side by side. So one kernel call reads every weight operand at a fixed
 * offset from one pointer, and each vpdpbusd takes its 4 weight bytes as a broadcast memory
 * operand. The float operations per output element are those of the type's batch-one tile
 * (sub_block_sums.h), so every row's result is the same at any batch.
 */
#ifndef KVSERVE_GGUF_GEMM_H
#define KVSERVE_GGUF_GEMM_H

#include <stdint.h>

#include "gguf_type.h"
#include "sub_block_sums.h"

#define GGUF_GEMM_LANES 16 /* activation rows per vector (float32 lanes of a zmm) */
#define GGUF_GEMM_ROWS 8       /* weight rows per kernel call (a panel is padded to whole ones with zeros) */
#define GGUF_GEMM_MIN_BATCH 9 /* steps of this many activation rows or more take the GEMM (at 8 the tiles match it) */

/* Super-blocks of 256 columns that hold a row of `in` columns: 32-column types whose rows are
 * not whole super-blocks (Qwen2.5-0.5B's 896) are padded with zero blocks, 32-column block b
 * at position j = b % 8 of super-block k = b / 8, the batch-one tiles' accumulator order
 * (blocks32.h's gguf_tile32_exact_avx512). */
static inline int64_t gguf_gemm_blocks(int64_t in) { return (in + 255) / 256; }

/* A step's packed activations (see above) for super-blocks of 256 columns. */
typedef struct {
    const uint8_t *x;
    const float *dx, *sx;
    int64_t blocks; /* super-blocks per row */
    int64_t groups; /* lane groups */
} GgufGemmX;

/* Where a kernel call's outputs go: its lane group's tile of the panel, tile[(row + r) * 16 +
 * lane] for the first `rows` of the call's rows, plus bias[r] (bias NULL: plus 0, as the tiles
 * do); gguf_gemm.c copies the tile's real lanes to y. (Scattered straight down y's columns,
 * y_stride apart, the stores of a call hit one cache set when the stride is a power of two.)
 * The call also prefetches `prefetch_lines` cache lines from `prefetch` (the next panel's
 * stored rows), `prefetch_step` of them per step (gguf_gemm_prefetch), so memory and the
 * kernel overlap.
 * A call may cover a chunk of the super-blocks, k0..k0 + blocks (the strip then holds only
 * those, unpacked with `in` = 256 blocks columns): the call's rows' eight accumulators per
 * lane carry over in `state` ([rows][8] zmm, NULL: the whole row in one call) from the call of
 * the chunk before, and the last chunk writes the tile. Each accumulator still takes the
 * super-blocks in column order, so the float order is the one-call order. */
typedef struct {
    float *tile;
    int64_t row;
    int rows;
    const float *bias;
    const uint8_t *prefetch;
    int64_t prefetch_lines, prefetch_step;
    int64_t k0, blocks;
    float *state;
} GgufGemmOut;

/* Bytes of one unpacked row of `blocks` super-blocks (a strip holds GGUF_GEMM_ROWS of them). */
typedef int64_t (*GgufPanelBytesFn)(int64_t blocks);
/* One weight row of `in` columns (as the file stores it) into row r of a strip of
 * gguf_gemm_blocks(in) super-blocks (a 32-column type's blocks past `in`: zero values and
 * scales). */
typedef void (*GgufUnpackFn)(const uint8_t *row, int64_t in, uint8_t *strip, int r);
/* A strip's GGUF_GEMM_ROWS rows against lane group `group`, written to `o`. */
typedef void (*GgufGemmKernelFn)(const uint8_t *strip, const GgufGemmX *x, int64_t group, const GgufGemmOut *o);
/* Half `half` of a strip's rows (GGUF_GEMM_ROWS / 2 from row GGUF_GEMM_ROWS / 2 * half) against
 * lane groups `group` and `group` + 1, written to o[0] and o[1]: each weight broadcast feeds
 * two vpdpbusd, with the same float operations per output as `kernel`. */
typedef void (*GgufGemmPairFn)(const uint8_t *strip, int half, const GgufGemmX *x, int64_t group,
                               const GgufGemmOut o[2]);

typedef struct {
    int type; /* ggml's type id */
    int isa;  /* the path whose batch-one tile the kernel matches (KvIsa) */
    GgufPanelBytesFn panel_bytes;
    GgufUnpackFn unpack;
    GgufGemmKernelFn kernel;
    GgufGemmPairFn pair;
    /* kernel and pair over GgufGemmOut's chunks of super-blocks (NULL: the type has none) */
    GgufGemmKernelFn chunk_kernel;
    GgufGemmPairFn chunk_pair;
} GgufGemmType;

GGUF_FIXED_FLOAT_BEGIN
#if KV_HAVE_AVX512_VNNI
/* The packed activations of lane group g, 32-column position j, super-block k (8 steps of 64
 * bytes), and the offset of their dx / sx (16 floats). */
GGUF_INLINE const uint8_t *gguf_gemm_x(const GgufGemmX *x, int64_t g, int j, int64_t k) {
    return x->x + ((g * 8 + j) * x->blocks + k) * 32 * GGUF_GEMM_LANES;
}
GGUF_INLINE int64_t gguf_gemm_scale_at(const GgufGemmX *x, int64_t g, int j, int64_t k) {
    return ((g * 8 + j) * x->blocks + k) * GGUF_GEMM_LANES;
}

/* The strip's values of block position (j, k) of `blocks` super-blocks: GGUF_GEMM_ROWS rows
 * of 32 side by side. */
GGUF_INLINE const uint8_t *gguf_gemm_strip_q(const uint8_t *strip, int64_t blocks, int j, int64_t k) {
    return strip + (j * blocks + k) * GGUF_GEMM_ROWS * 32;
}

/* A 4-byte word at p, any alignment (read as one memory operand). */
typedef int32_t __attribute__((may_alias, aligned(1))) GgufWord;

/* sum[c][r] += lane group c's packed activations' steps s0..s1 (4 columns each) at xs[c]
 * against strip row r's int8 values at qs + 32 r, 4 broadcast at a time (each broadcast
 * serving the `groups` groups): exact int32 sums per lane. `rows` and `groups` are constants
 * where it is inlined. */
GGUF_INLINE void gguf_gemm_steps(__m512i sum[2][GGUF_GEMM_ROWS], const uint8_t *const xs[2], const uint8_t *qs,
                                 const int rows, const int groups, const int s0, const int s1) {
#pragma GCC unroll 8
    for (int s = s0; s < s1; s++) {
        __m512i xv[2];
        for (int c = 0; c < groups; c++) xv[c] = _mm512_loadu_si512(xs[c] + 64 * s);
        for (int r = 0; r < rows; r++) {
            const __m512i word = _mm512_set1_epi32(*(const GgufWord *)(qs + 32 * r + 4 * s));
            for (int c = 0; c < groups; c++) sum[c][r] = _mm512_dpbusd_epi32(sum[c][r], xv[c], word);
        }
    }
}

/* Step `step` of a call (block position (j, k) = j blocks + k): its share of o's prefetches. */
GGUF_INLINE void gguf_gemm_prefetch(const GgufGemmOut *o, int64_t step) {
    const int64_t from = step * o->prefetch_step;
    const int64_t to = from + o->prefetch_step < o->prefetch_lines ? from + o->prefetch_step : o->prefetch_lines;
    for (int64_t i = from; i < to; i++) _mm_prefetch((const char *)(o->prefetch + 64 * i), _MM_HINT_T0);
}

/* The outputs of the call's rows from their eight accumulators (sub_block_sums.h's order), plus
 * the bias, into the tile. */
GGUF_INLINE void gguf_gemm_store(const GgufGemmOut *o, const __m512 (*acc)[8]) {
    for (int r = 0; r < o->rows; r++)
        _mm512_storeu_ps(o->tile + (o->row + r) * GGUF_GEMM_LANES,
                         _mm512_add_ps(gguf_sum8_lanes(acc[r]), _mm512_set1_ps(o->bias ? o->bias[r] : 0.0f)));
}

/* A call's accumulators: o->state where it carries chunks, else `local`. */
GGUF_INLINE __m512 (*gguf_gemm_acc(const GgufGemmOut *o, __m512 (*local)[8]))[8] {
    return o->state ? (__m512(*)[8])o->state : local;
}
/* Accumulator j of row r of a call at its chunk's start: 0 at the row's first super-block. */
GGUF_INLINE __m512 gguf_gemm_acc_start(const GgufGemmOut *o, __m512 (*acc)[8], int r, int j) {
    return o->k0 ? acc[r][j] : _mm512_setzero_ps();
}
/* The call's outputs where its chunk ends the row (else its accumulators wait in o->state). */
GGUF_INLINE void gguf_gemm_finish(const GgufGemmOut *o, int64_t row_blocks, const __m512 (*acc)[8]) {
    if (o->k0 + o->blocks == row_blocks) gguf_gemm_store(o, acc);
}
#endif
GGUF_FIXED_FLOAT_END

extern const GgufGemmType gguf_q4_k_gemm_avx512, gguf_q6_k_gemm_avx512, gguf_q8_0_gemm_avx512, gguf_q5_0_gemm_avx512,
    gguf_mxfp4_gemm_avx512;

/* For gguf_rows.c (gguf_gemm.c): the GEMM of `type` on path `isa` or NULL; rows
 * row_begin..row_end of y [batch, y_stride] on the calling thread; all `out` rows split over
 * the OpenMP threads (`parallel`). Both return 0, or -3 when out of memory (nothing written). */
const GgufGemmType *gguf_gemm_of(int type, int isa);
int gguf_gemm_rows(const GgufGemmType *gt, const int8_t *qx, const float *scales, int64_t batch, const uint8_t *w,
                   int64_t in, int64_t row_bytes, const float *bias, float *y, int64_t y_stride, int64_t row_begin,
                   int64_t row_end);
int gguf_gemm_linear(const GgufGemmType *gt, const int8_t *qx, const float *scales, int64_t batch, const uint8_t *w,
                     int64_t in, int64_t row_bytes, const float *bias, float *y, int64_t out, int parallel);

#endif
