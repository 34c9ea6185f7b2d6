/* GGUF block types computed as stored: what one type file (csrc/linear/gguf/<type>.c)
 * gives the framework (csrc/linear/gguf_rows.c), which holds one table line per type.
 *
 * Weights: W [out, in] exactly as the GGUF file stores it, row r at w + r * row_bytes,
 * each row `in / block_cols` blocks of `block_bytes` (ggml's layouts, ids and formulas).
 * Activations: the int8 format of kvserve_quant_activations (act_bits 8): qx int8 [batch,
 * in], and per 32 columns dx (the scale: x ~ dx * qx) and sx = dx * sum(qx), so a block
 * type's dot product is an integer sum per 32 columns (or per 16, inside them) times
 * float scales, and a block's minimum or offset times sx.
 *
 * Adding a type: write <type>.c defining one `const GgufType gguf_<type>` (below) and
 * add `&gguf_<type>,` to the table in gguf_rows.c plus its extern line here. A type
 * needs `dequantize` (GGUF_EXACT) and `dot` (GGUF_PORTABLE); each ISA's `tile` is
 * optional (NULL: the framework takes the next narrower path that the type has, ending
 * at a tile built on `dot`).
 *
 * Every path of a type must compute each (weight row, activation row) sum with float
 * operations that do not depend on the tile's size or on the other rows in it: then a
 * batched step gives every row exactly what a batch-one step gives it (speculative
 * verify steps rely on this), whatever the thread split.
 */
#ifndef KVSERVE_GGUF_TYPE_H
#define KVSERVE_GGUF_TYPE_H

#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kvserve.h"

#define GGUF_QBLOCK 32    /* columns per activation scale dx */
#define GGUF_TILE_ROWS 4  /* weight rows one tile reads together */
#define GGUF_TILE_BATCH 4 /* activation rows each weight block is applied to while loaded */

/* Dequantization must give the file's values bit for bit, as ggml computes them
 * (tests compare with gguf-py): no fused multiply-add where ggml rounds twice. */
#define GGUF_EXACT __attribute__((optimize("fp-contract=off")))
#define GGUF_INLINE static inline __attribute__((always_inline))
/* Around the vector tiles: every (row, batch row) sum must take the same float operations in
 * every tile shape, so no reassociation or contraction by the compiler (-ffast-math would do
 * them differently in each shape's variant); the fused multiply-adds are explicit. */
#define GGUF_FIXED_FLOAT_BEGIN \
    _Pragma("GCC push_options") _Pragma("GCC optimize(\"no-associative-math\", \"fp-contract=off\")")
#define GGUF_FIXED_FLOAT_END _Pragma("GCC pop_options")
/* The portable dots are not auto-vectorized: gcc 12 at -O3 on AVX-VNNI CPUs turns a loop
 * summing int8 x int8 products into vpdpbusd, which takes one operand as unsigned (wrong
 * sums for negative weights). They are the reference; the vector paths are written out. */
#define GGUF_PORTABLE __attribute__((optimize("no-tree-vectorize")))

/* One tile: `rows` weight rows times `batch` activation rows. */
typedef struct {
    const uint8_t *w;     /* the tile's first weight row; the next ones row_bytes apart */
    int64_t row_bytes;    /* bytes of one weight row */
    int64_t blocks;       /* blocks per row: in / block_cols */
    const int8_t *qx;     /* the tile's first activation row; the next ones `in` apart */
    const float *dx, *sx; /* its scales and dx * sum(qx); the next rows in / 32 apart */
    int64_t in;           /* columns */
    int rows, batch;      /* GGUF_TILE_ROWS or 1, 1..GGUF_TILE_BATCH */
} GgufTile;

/* sums[r][b] = sum over the row of W[r] . x[b] (minimums and offsets included). */
typedef void (*GgufTileFn)(const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH]);
/* One block against the activations of its columns: qx [block_cols], dx and sx
 * [block_cols / 32]. The portable reference every tile must agree with. */
typedef float (*GgufDotFn)(const uint8_t *block, const int8_t *qx, const float *dx, const float *sx);
/* n blocks -> n * block_cols float32 values (GGUF_EXACT). */
typedef void (*GgufDequantizeFn)(const uint8_t *blocks, int64_t n, float *out);

typedef struct {
    int type;        /* ggml's type id (Q4_0 2, Q4_K 12, ...) */
    int block_cols;  /* columns per block (32 or 256) */
    int block_bytes; /* bytes per block */
    GgufDequantizeFn dequantize;
    GgufDotFn dot;
    GgufTileFn tile[ISA_COUNT]; /* by KvIsa; NULL where the type has no such path */
} GgufType;

/* A path's tile where this build has it, else NULL (for the table entries). */
#if KV_HAVE_AVX2_FMA
#define GGUF_AVX2(fn) fn
#else
#define GGUF_AVX2(fn) NULL
#endif
#if KV_HAVE_AVX512_VNNI
#define GGUF_AVX512(fn) fn
#else
#define GGUF_AVX512(fn) NULL
#endif

/* A tile function `name` running BODY(t, sums, R, B) with the tile's rows (R: 4 or 1) and
 * batch (B: 1..4) as constants, so that its accumulators live in registers. */
#define GGUF_TILE_VARIANTS(name, BODY)                                                   \
    static void name(const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH]) {  \
        const int one = t->rows == 1;                                                    \
        switch (t->batch) {                                                              \
        case 1: if (one) BODY(t, sums, 1, 1); else BODY(t, sums, GGUF_TILE_ROWS, 1); return; \
        case 2: if (one) BODY(t, sums, 1, 2); else BODY(t, sums, GGUF_TILE_ROWS, 2); return; \
        case 3: if (one) BODY(t, sums, 1, 3); else BODY(t, sums, GGUF_TILE_ROWS, 3); return; \
        default: if (one) BODY(t, sums, 1, 4); else BODY(t, sums, GGUF_TILE_ROWS, 4); return; \
        }                                                                                \
    }

#if KV_HAVE_AVX2_FMA
/* The sum of the 8 float lanes of a ymm accumulator, in one fixed order. */
GGUF_INLINE float gguf_sum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

#if KV_HAVE_AVX512_VNNI
/* The sum of the 8 + 8 float lanes of a zmm accumulator, in one fixed order. */
GGUF_INLINE float gguf_sum512(__m512 v) { return _mm512_reduce_add_ps(v); }

/* Sixteen lanes: lanes 0-7 take element `a` of v, lanes 8-15 element `b`. */
GGUF_INLINE __m512 gguf_spread2(__m256 v, int a, int b) {
    const __m512i idx = _mm512_set_epi32(b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a);
    return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(v));
}

/* 32 bytes of nibbles -> 64 quants: the low nibbles (lanes 0-31), then the high ones. */
GGUF_INLINE __m512i gguf_nibbles64(__m256i bytes) {
    const __m512i wide = _mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1);
    return _mm512_and_si512(wide, _mm512_set1_epi8(15));
}
#endif

/* How far ahead a tile asks for its rows: the same place in a later tile (its rows follow
 * this tile's), the first one at least 8 KB ahead. The tiles stream four rows at once and the
 * cores' own prefetchers fall far behind on that (measured on Zen 5, one thread, from memory:
 * without it the 32-column types ran at a fifth of the speed; 2 KB ahead in the row, a half).
 * One tile ahead left short rows waiting on memory (2,048 columns: a Q4_K tile is 4.6 KB):
 * two tiles ran Q4_K, Q6_K and Q8_0 rows of 2,048 and 576 columns 1.1-1.3x faster (medians of
 * 16 alternating rounds, one thread, on a machine loaded by other work); no change at 8,192. */
GGUF_INLINE int64_t gguf_prefetch_ahead(const GgufTile *t) {
    const int64_t tile = GGUF_TILE_ROWS * t->row_bytes;
    return (8192 + tile - 1) / tile * tile;
}

/* Asks for every cache line of the `bytes` at p + ahead. */
GGUF_INLINE void gguf_prefetch(const uint8_t *p, const int bytes, const int64_t ahead) {
    for (int k = 0; k < bytes; k += 64) __builtin_prefetch(p + ahead + k, 0, 3);
}

/* ---- shared by the K-quant types -------------------------------------------------- */

/* The 6-bit scales and minimums of the eight sub-blocks of a Q4_K / Q5_K super-block,
 * from its 12 bytes: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7
 * (minimums); sub-blocks 4-7 in the nibbles of bytes 8-11 plus the top two bits of
 * bytes 0-3 / 4-7. */
GGUF_INLINE void gguf_k_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[4 + j] & 63;
        sc[4 + j] = (uint8_t)((s[8 + j] & 15) | ((s[j] >> 6) << 4));
        mn[4 + j] = (uint8_t)((s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4));
    }
}

/* An f16 field of a block (exact: every half is a float). */
GGUF_INLINE float gguf_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return f16_value(h);
#endif
}

/* gguf_k_scales as two 8-byte words: the scales (byte j: sub-block j), then the minimums. */
GGUF_INLINE void gguf_k_scale_words(const uint8_t *s, uint64_t *scales, uint64_t *mins) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, two = 0x03030303u;
    *scales = (a & six) | (uint64_t)((c & four) | (((a >> 6) & two) << 4)) << 32;
    *mins = (b & six) | (uint64_t)(((c >> 4) & four) | (((b >> 6) & two) << 4)) << 32;
}

/* ---- the types (one file each) --------------------------------------------------- */

extern const GgufType gguf_q4_0, gguf_q4_1, gguf_q8_0, gguf_q4_k, gguf_q6_k;
extern const GgufType gguf_q5_0, gguf_q5_1, gguf_q5_k, gguf_q3_k, gguf_q2_k, gguf_iq4_nl, gguf_iq4_xs, gguf_mxfp4;

#endif
