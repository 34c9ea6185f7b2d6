/* The kernels of one GGUF block type, written once for every type that splits into groups of
 * 32 columns: included by the type's file (gguf/q5_k.c, ...) after it has said how its blocks
 * decode, so each type file holds only its layout.
 *
 * Every block type here stands, for each group g of 32 columns (one per block of 32-column
 * types, 8 per super-block of 256), for the values
 *     w_i = scale[g] * (sub_h * q_i) + offset,
 * with q_i small integers (signed where QUANTS_SIGNED), sub_h an integer scale of each half h
 * of 16 columns (1 unless SCALES_PER_16), and the offset either none, offset[g] (MINS_PER_32),
 * or min_scale * min_h (MINS_PER_16, min_h an integer). Every product above is exact in
 * float32 (an f16 scale's 11 bits times at most 13 bits of integers), so w_i has one rounding,
 * the final addition, exactly as gguf-py's dequantize rounds it.
 *
 * The dot product with int8 activations (qx, per 32 columns dx and sx = dx * sum qx, as
 * kvserve_quant_activations makes them) is per group an exact integer sum:
 *     sum_i w_i dx qx_i = scale[g] dx (sub_0 P_0 + sub_1 P_1)    P_h = sum over half h of q_i qx_i
 *                       + offset[g] sx                           (MINS_PER_32)
 *                       + min_scale dx (min_0 X_0 + min_1 X_1)   (MINS_PER_16, X_h = sum qx_i)
 * The paths differ only in how they form P and X (plain C; AVX2 vpmaddubsw; AVX512-VNNI
 * vpdpbusd / vpdpwssd) and in float32 summation order.
 *
 * The including file defines BLOCK_COLS, BLOCK_BYTES, QUANTS_SIGNED, SCALES_PER_16, MINS, and:
 *   static void block_head(const uint8_t *block, BlockHead *h);          the block's scales
 *   static void group_quants(const uint8_t *block, int g, int8_t q[32]);  group g's quants
 *   static __m256i group_quants256(const uint8_t *block, int g);          the same (AVX2 builds)
 * and, where it brings its own tiles, AVX512_TILE / AVX2_TILE, their names, defined after the
 * include: the K types that matter most decode 64 columns at a time in their own AVX512-VNNI
 * tiles, and the 32-column types with one f16 scale run blocks32.h's tiles.
 */
#ifndef KVSERVE_GGUF_GROUP_KERNELS_H
#define KVSERVE_GGUF_GROUP_KERNELS_H

#include <stdint.h>

#include "gguf_type.h"
#include "kvserve.h"

#define GROUP 32
#define GROUPS (BLOCK_COLS / GROUP)
#define MINS_NONE 0
#define MINS_PER_32 1
#define MINS_PER_16 2

typedef struct {
    float scale[GROUPS];      /* the float factor of group g's integer sum */
    float offset[GROUPS];     /* MINS_PER_32: added to every weight of group g */
    int16_t sub[2 * GROUPS];  /* SCALES_PER_16: the integer scale of each 16 columns */
    int16_t min[2 * GROUPS];  /* MINS_PER_16: the integer minimum of each 16 columns */
    float min_scale;          /* MINS_PER_16: the float factor of the minimums */
} BlockHead;

static void block_head(const uint8_t *block, BlockHead *h);
static void group_quants(const uint8_t *block, int g, int8_t q[GROUP]);

/* ---- portable ----------------------------------------------------------------------- */

/* n blocks into n * BLOCK_COLS floats: per 16 columns one factor, (d * sub) as gguf-py
 * multiplies it (which also keeps the sign of a zero), and one offset; loops the compiler
 * vectorizes. */
GGUF_EXACT static void dequantize_blocks(const uint8_t *blocks, int64_t n, float *dst) {
    BlockHead h;
    int8_t q[GROUP];
    for (int64_t k = 0; k < n; k++) {
        const uint8_t *block = blocks + k * BLOCK_BYTES;
        block_head(block, &h);
        for (int g = 0; g < GROUPS; g++) {
            group_quants(block, g, q);
            for (int half = 0; half < 2; half++) {
                const float factor = SCALES_PER_16 ? h.scale[g] * (float)h.sub[2 * g + half] : h.scale[g];
                const float offset = MINS == MINS_PER_32   ? h.offset[g]
                                     : MINS == MINS_PER_16 ? h.min_scale * (float)h.min[2 * g + half]
                                                           : 0.0f;
                const int8_t *qh = q + 16 * half;
                float *v = dst + k * BLOCK_COLS + g * GROUP + 16 * half;
                if (MINS == MINS_NONE)
                    for (int i = 0; i < 16; i++) v[i] = factor * (float)qh[i];
                else
                    for (int i = 0; i < 16; i++) v[i] = factor * (float)qh[i] + offset;
            }
        }
    }
}

/* One block times the activations of its columns (qx [BLOCK_COLS], dx and sx [GROUPS]). */
GGUF_PORTABLE static float dot_block(const uint8_t *block, const int8_t *qx, const float *dx, const float *sx) {
    BlockHead h;
    int8_t q[GROUP];
    float acc = 0.0f;
    block_head(block, &h);
    for (int g = 0; g < GROUPS; g++) {
        const int8_t *x = qx + g * GROUP;
        group_quants(block, g, q);
        int32_t p[2] = {0, 0}, xs[2] = {0, 0};
        for (int i = 0; i < GROUP; i++) {
            p[i / 16] += q[i] * x[i];
            xs[i / 16] += x[i];
        }
        int32_t s = SCALES_PER_16 ? h.sub[2 * g] * p[0] + h.sub[2 * g + 1] * p[1] : p[0] + p[1];
        acc += h.scale[g] * dx[g] * (float)s;
        if (MINS == MINS_PER_32) acc += h.offset[g] * sx[g];
        if (MINS == MINS_PER_16) acc += h.min_scale * dx[g] * (float)(h.min[2 * g] * xs[0] + h.min[2 * g + 1] * xs[1]);
    }
    return acc;
}

/* ---- AVX2 and AVX512-VNNI: one group of 32 columns per 256-bit vector ------------------ */
#if KV_HAVE_AVX2_FMA
GGUF_FIXED_FLOAT_BEGIN /* every tile shape gives a row the same sums (gguf_type.h) */
static __m256i group_quants256(const uint8_t *block, int g);

/* Sixteen int16 lanes: a in lanes 0-7 (the pairs of columns 0-15), b in lanes 8-15. */
GGUF_INLINE __m256i halves16(int16_t a, int16_t b) { return _mm256_set_m128i(_mm_set1_epi16(b), _mm_set1_epi16(a)); }

GGUF_INLINE float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The integer sums of one group, 8 int32 lanes: lanes 0-3 cover columns 0-15, 4-7 columns
 * 16-31, each times its half's integer scale. u: |q| (or q where unsigned), x: qx with q's
 * sign (or qx). vnni: vpdpbusd / vpdpwssd. */
GGUF_INLINE __m256i group_sums(__m256i u, __m256i x, __m256i sub16, int vnni) {
#if KV_HAVE_AVX512_VNNI
    if (vnni) {
        if (!SCALES_PER_16) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
        return _mm256_dpwssd_epi32(_mm256_setzero_si256(), _mm256_maddubs_epi16(u, x), sub16);
    }
#endif
    (void)vnni;
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), SCALES_PER_16 ? sub16 : _mm256_set1_epi16(1));
}

/* Group g of the blocks block[r] (heads h[r]), activation block `at`, into acc (and mins). */
GGUF_INLINE void step256(const GgufTile *t, const uint8_t *const block[], const BlockHead h[], int g, int64_t at,
                         __m256 acc[][GGUF_TILE_BATCH], float mins[][GGUF_TILE_BATCH], const int ROWS,
                         const int BATCH, int vnni) {
    const int64_t nb = t->in / GROUP;
    __m256i u[GGUF_TILE_ROWS], q[GGUF_TILE_ROWS], sub16[GGUF_TILE_ROWS], min16[GGUF_TILE_ROWS];
    for (int r = 0; r < ROWS; r++) {
        q[r] = group_quants256(block[r], g);
        u[r] = QUANTS_SIGNED ? _mm256_abs_epi8(q[r]) : q[r];
        sub16[r] = SCALES_PER_16 ? halves16(h[r].sub[2 * g], h[r].sub[2 * g + 1]) : _mm256_setzero_si256();
        min16[r] = MINS == MINS_PER_16 ? halves16(h[r].min[2 * g], h[r].min[2 * g + 1]) : _mm256_setzero_si256();
    }
    for (int b = 0; b < BATCH; b++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(t->qx + b * t->in + at * GROUP));
        const float dxb = t->dx[b * nb + at];
        __m256i xpairs = _mm256_setzero_si256(); /* MINS_PER_16: sums of pairs of qx */
        if (MINS == MINS_PER_16) xpairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), x);
        for (int r = 0; r < ROWS; r++) {
            __m256i s = group_sums(u[r], QUANTS_SIGNED ? _mm256_sign_epi8(x, q[r]) : x, sub16[r], vnni);
            acc[r][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(h[r].scale[g] * dxb), acc[r][b]);
            if (MINS == MINS_PER_16)
                acc[r][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(xpairs, min16[r])),
                                            _mm256_set1_ps(h[r].min_scale * dxb), acc[r][b]);
            if (MINS == MINS_PER_32) mins[r][b] += h[r].offset[g] * t->sx[b * nb + at];
        }
    }
}

/* A tile with ROWS x BATCH constant (the accumulators stay in registers). Each (row,
 * activation row) pair takes the same float operations whatever the tile's shape. */
GGUF_INLINE void tile256(const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH], const int ROWS,
                         const int BATCH, int vnni) {
    __m256 acc[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    float mins[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < BATCH; b++) {
            acc[r][b] = _mm256_setzero_ps();
            mins[r][b] = 0.0f;
        }
    BlockHead h[GGUF_TILE_ROWS];
    const uint8_t *block[GGUF_TILE_ROWS];
    for (int64_t k = 0; k < t->blocks; k++) {
        for (int r = 0; r < ROWS; r++) {
            block[r] = t->w + r * t->row_bytes + k * BLOCK_BYTES;
            block_head(block[r], &h[r]);
        }
        for (int g = 0; g < GROUPS; g++) step256(t, block, h, g, k * GROUPS + g, acc, mins, ROWS, BATCH, vnni);
    }
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < BATCH; b++) sums[r][b] = hsum256(acc[r][b]) + mins[r][b];
}

#if KV_HAVE_AVX512_VNNI
/* For the super-block tiles of the K types: the dx of groups 2c and 2c + 1 of super-block k,
 * 8 lanes each, for each of the tile's B activation rows. */
GGUF_INLINE void super_block_dx(const GgufTile *t, int64_t k, const int B, __m512 dxs[][4]) {
    for (int b = 0; b < B; b++) {
        const __m256 dx = _mm256_loadu_ps(t->dx + b * (t->in / GROUP) + k * GROUPS);
        for (int c = 0; c < 4; c++) dxs[b][c] = gguf_spread2(dx, 2 * c, 2 * c + 1);
    }
}
#endif

#if KV_HAVE_AVX512_VNNI && !defined(AVX512_TILE)
/* AVX512-VNNI: two groups (64 columns) per 512-bit vector, the group of an odd count last
 * through the 256-bit step. Quants of 32-column types come from two blocks. */
GGUF_INLINE __m512i join256(__m256i low, __m256i high) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

GGUF_INLINE __m512 join_ps(float low, float high) {
    return _mm512_insertf32x8(_mm512_set1_ps(low), _mm256_set1_ps(high), 1);
}

GGUF_INLINE void tile512(const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH], const int ROWS,
                         const int BATCH) {
    const int64_t nb = t->in / GROUP, groups = t->blocks * GROUPS; /* activation stride; the tile's groups */
    __m512 acc[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    float mins[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < BATCH; b++) {
            acc[r][b] = _mm512_setzero_ps();
            mins[r][b] = 0.0f;
        }
    BlockHead ha[GGUF_TILE_ROWS], hb[GGUF_TILE_ROWS]; /* the blocks of groups at and at + 1 */
    for (int64_t at = 0; at + 1 < groups; at += 2) {
        const int ga = (int)(at % GROUPS), gb = (int)((at + 1) % GROUPS);
        __m512i u[GGUF_TILE_ROWS], sub16[GGUF_TILE_ROWS], min16[GGUF_TILE_ROWS];
        __m512 scale[GGUF_TILE_ROWS], min_scale[GGUF_TILE_ROWS];
        __mmask64 negative[GGUF_TILE_ROWS];
        for (int r = 0; r < ROWS; r++) {
            const uint8_t *row = t->w + r * t->row_bytes;
            const uint8_t *block_a = row + at / GROUPS * BLOCK_BYTES, *block_b = row + (at + 1) / GROUPS * BLOCK_BYTES;
            if (ga == 0) block_head(block_a, &ha[r]);
            if (GROUPS == 1) block_head(block_b, &hb[r]);
            const BlockHead *b_head = GROUPS == 1 ? &hb[r] : &ha[r];
            const __m512i q = join256(group_quants256(block_a, ga), group_quants256(block_b, gb));
            negative[r] = _mm512_movepi8_mask(q);
            u[r] = QUANTS_SIGNED ? _mm512_abs_epi8(q) : q;
            scale[r] = join_ps(ha[r].scale[ga], b_head->scale[gb]);
            sub16[r] = SCALES_PER_16 ? join256(halves16(ha[r].sub[2 * ga], ha[r].sub[2 * ga + 1]),
                                               halves16(b_head->sub[2 * gb], b_head->sub[2 * gb + 1]))
                                     : _mm512_setzero_si512();
            min16[r] = MINS == MINS_PER_16 ? join256(halves16(ha[r].min[2 * ga], ha[r].min[2 * ga + 1]),
                                                     halves16(b_head->min[2 * gb], b_head->min[2 * gb + 1]))
                                           : _mm512_setzero_si512();
            min_scale[r] = MINS == MINS_PER_16 ? join_ps(ha[r].min_scale, b_head->min_scale) : _mm512_setzero_ps();
            if (MINS == MINS_PER_32)
                for (int b = 0; b < BATCH; b++) {
                    mins[r][b] += ha[r].offset[ga] * t->sx[b * nb + at];
                    mins[r][b] += b_head->offset[gb] * t->sx[b * nb + at + 1];
                }
        }
        for (int b = 0; b < BATCH; b++) {
            const __m512i x = _mm512_loadu_si512(t->qx + b * t->in + at * GROUP);
            const __m512 dx = join_ps(t->dx[b * nb + at], t->dx[b * nb + at + 1]);
            __m512i xpairs = _mm512_setzero_si512();
            if (MINS == MINS_PER_16) xpairs = _mm512_maddubs_epi16(_mm512_set1_epi8(1), x);
            for (int r = 0; r < ROWS; r++) {
                const __m512i xs = QUANTS_SIGNED ? _mm512_mask_sub_epi8(x, negative[r], _mm512_setzero_si512(), x) : x;
                const __m512i s = SCALES_PER_16
                                      ? _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(u[r], xs), sub16[r])
                                      : _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[r], xs);
                acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(scale[r], dx), acc[r][b]);
                if (MINS == MINS_PER_16)
                    acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(xpairs, min16[r])),
                                                _mm512_mul_ps(min_scale[r], dx), acc[r][b]);
            }
        }
    }
    __m256 last[GGUF_TILE_ROWS][GGUF_TILE_BATCH]; /* the last group of an odd count */
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < BATCH; b++) last[r][b] = _mm256_setzero_ps();
    if (groups % 2) { /* 32-column types only: K-types have 8 groups per block */
        const uint8_t *block[GGUF_TILE_ROWS];
        for (int r = 0; r < ROWS; r++) {
            block[r] = t->w + r * t->row_bytes + (groups - 1) * BLOCK_BYTES;
            block_head(block[r], &ha[r]);
        }
        step256(t, block, ha, 0, groups - 1, last, mins, ROWS, BATCH, 1);
    }
    for (int r = 0; r < ROWS; r++)
        for (int b = 0; b < BATCH; b++) sums[r][b] = _mm512_reduce_add_ps(acc[r][b]) + hsum256(last[r][b]) + mins[r][b];
}
#endif

#ifndef AVX2_TILE
#define TILE256_AVX2(t, sums, R, B) tile256(t, sums, R, B, 0)
GGUF_TILE_VARIANTS(tile_avx2, TILE256_AVX2)
#undef TILE256_AVX2
#endif
#if KV_HAVE_AVX512_VNNI && !defined(AVX512_TILE)
GGUF_TILE_VARIANTS(tile_vnni, tile512)
#endif
GGUF_FIXED_FLOAT_END
#endif /* KV_HAVE_AVX2_FMA */

/* The type's entry for gguf_rows.c's table (the portable tile: the framework's, by dot_block).
 * A type with its own AVX512-VNNI tile defines AVX512_TILE (its name) before including this. */
#ifndef AVX512_TILE
#define AVX512_TILE tile_vnni
#endif
#ifndef AVX2_TILE
#define AVX2_TILE tile_avx2
#endif
#define GGUF_BLOCK_TYPE(NAME, TYPE) \
    const GgufType NAME = {TYPE, BLOCK_COLS, BLOCK_BYTES, dequantize_blocks, dot_block, \
                           {NULL, GGUF_AVX2(AVX2_TILE), GGUF_AVX512(AVX512_TILE)}};

#endif /* KVSERVE_GGUF_GROUP_KERNELS_H */
