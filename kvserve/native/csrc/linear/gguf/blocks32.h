/* Tile templates for the GGUF types whose blocks are 32 columns with one scale (and
 * perhaps a minimum) each: Q4_0, Q4_1, Q8_0 here, and the like (Q5_0, Q5_1, IQ4_NL, ...).
 * A type file gives small inline loaders and instantiates a template with them as
 * constants (always_inline: the loaders inline into the loop):
 *   quants512(b0, b1): the quants of blocks b0 and b1 (64 columns, in column order) as
 *       unsigned bytes, each its value plus `offset` (0..255);
 *   quants256(b): one block's quants as signed bytes (the values, -128 < v < 128);
 *   scale(b), minimum(b): the block's float d and m (w = d v + m; minimum NULL: none);
 *       the AVX512 template reads them itself: d the first f16 field, m the second.
 */
#ifndef KVSERVE_GGUF_BLOCKS32_H
#define KVSERVE_GGUF_BLOCKS32_H

#include "gguf_type.h"
#include "sub_block_sums.h"

typedef float (*GgufBlockScale)(const uint8_t *blk);

#if KV_HAVE_AVX2_FMA
/* 16 bytes of a 4-bit block (low nibbles columns 0-15, high ones 16-31) -> 32 quants. */
GGUF_INLINE __m256i gguf_nibbles32(const uint8_t *p) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(15));
}
#endif
#if KV_HAVE_AVX512_VNNI
/* The same for two blocks: 64 quants, p0's 32 then p1's. */
GGUF_INLINE __m512i gguf_nibbles32x2(const uint8_t *p0, const uint8_t *p1) {
    const __m128i a = _mm_loadu_si128((const __m128i *)p0), b = _mm_loadu_si128((const __m128i *)p1);
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(_mm_srli_epi16(a, 4), a)),
                                            _mm256_set_m128i(_mm_srli_epi16(b, 4), b), 1);
    return _mm512_and_si512(both, _mm512_set1_epi8(15));
}
#endif

GGUF_FIXED_FLOAT_BEGIN
#if KV_HAVE_AVX512_VNNI
/* Blocks 2p and 2p + 1 (`single`: block 2p alone, the odd last one, on the lower half with
 * the upper one masked to zero) of every row and batch row of the tile. */
GGUF_INLINE void gguf_step32_avx512(const GgufTile *t, __m512 acc[GGUF_TILE_ROWS][GGUF_TILE_BATCH], const int R,
                                    const int B, const int bytes, const int offset,
                                    __m512i (*quants512)(const uint8_t *, const uint8_t *), const int quant_at,
                                    const int has_min, const int64_t p, const int single) {
    const int64_t nb32 = t->in / GGUF_QBLOCK;
    const __mmask64 columns = single ? 0xffffffffull : ~0ull;
    const __mmask16 lanes = single ? 0x00ff : 0xffff;
    const __m512i first_half = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i minimums = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 1);
    __m512 dxs[GGUF_TILE_BATCH], sxs[GGUF_TILE_BATCH];
    __m512i minus[GGUF_TILE_BATCH];
    for (int b = 0; b < B; b++) {
        const int64_t at = b * nb32 + 2 * p;
        const __m128 dx = single ? _mm_load_ss(t->dx + at) : _mm_castpd_ps(_mm_load_sd((const double *)(t->dx + at)));
        dxs[b] = _mm512_permutexvar_ps(_mm512_srli_epi32(first_half, 1), _mm512_castps128_ps512(dx));
        if (has_min) {
            const __m128 sx = single ? _mm_load_ss(t->sx + at) : _mm_castpd_ps(_mm_load_sd((const double *)(t->sx + at)));
            sxs[b] = _mm512_maskz_permutexvar_ps(lanes, _mm512_srli_epi32(first_half, 1), _mm512_castps128_ps512(sx));
        }
        minus[b] = _mm512_setzero_si512();
        if (offset)
            minus[b] = _mm512_sub_epi32(minus[b], _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)offset),
                                                                      _mm512_maskz_loadu_epi8(columns, t->qx + b * t->in + 64 * p)));
    }
    for (int r = 0; r < R; r++) {
        const uint8_t *b0 = t->w + r * t->row_bytes + 2 * p * bytes, *b1 = single ? b0 : b0 + bytes;
        gguf_prefetch(b0, 2 * bytes, gguf_prefetch_ahead(t));
        __m512i q;
        __m512 d, m = _mm512_setzero_ps();
        if (!quants512) {
            /* 4-bit types: both blocks in one load (masked: never past the row's end), their
             * nibble bytes and f16 fields placed by word permutes (every field is word-aligned) */
            const __m512i raw = _mm512_maskz_loadu_epi8(single ? (1ull << bytes) - 1 : (1ull << (2 * bytes)) - 1, b0);
            const int a = quant_at / 2, c = (bytes + quant_at) / 2;
            const __m512i quants = _mm512_set_epi16(c + 7, c + 6, c + 5, c + 4, c + 3, c + 2, c + 1, c, c + 7, c + 6,
                                                    c + 5, c + 4, c + 3, c + 2, c + 1, c, a + 7, a + 6, a + 5, a + 4,
                                                    a + 3, a + 2, a + 1, a, a + 7, a + 6, a + 5, a + 4, a + 3, a + 2,
                                                    a + 1, a);
            const __m512i shifts = _mm512_set_epi16(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4,
                                                    4, 0, 0, 0, 0, 0, 0, 0, 0);
            q = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi16(quants, raw), shifts),
                                 _mm512_set1_epi8(15));
            const int e = bytes / 2; /* d1's word */
            const __m512i heads = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, e, e, e, e, e, e, e, e,
                                                   0, 0, 0, 0, 0, 0, 0, 0);
            d = _mm512_maskz_mov_ps(lanes, _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(heads, raw))));
            if (has_min)
                m = _mm512_maskz_mov_ps(lanes, _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_maskz_permutexvar_epi16(
                        0x0101, _mm512_add_epi16(heads, _mm512_set1_epi16(1)), raw))));
        } else {
            q = quants512(b0, b1);
            if (single) q = _mm512_maskz_mov_epi8(columns, q);
            /* the f16 fields d (and m) at the start of both blocks: [d0, m0, d1, m1] */
            uint32_t head0, head1;
            memcpy(&head0, b0, 4);
            memcpy(&head1, b1, 4);
            const __m512 heads = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_set_epi32(0, 0, (int)head1, (int)head0)));
            d = _mm512_maskz_permutexvar_ps(lanes, first_half, heads);
            if (has_min) m = _mm512_maskz_permutexvar_ps(lanes & 0x0101, minimums, heads);
        }
        for (int b = 0; b < B; b++) {
            const __m512i x = single ? _mm512_maskz_loadu_epi8(columns, t->qx + b * t->in + 64 * p)
                                     : _mm512_loadu_si512(t->qx + b * t->in + 64 * p);
            const __m512i sum = _mm512_dpbusd_epi32(minus[b], q, x);
            acc[r][b] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), dxs[b]), d, acc[r][b]);
            if (has_min) acc[r][b] = _mm512_fmadd_ps(m, sxs[b], acc[r][b]);
        }
    }
}

/* Two blocks per step: vpdpbusd of the unsigned quants against the int8 activations, the
 * offset taken off in the integer sum (-offset sum(qx), once per batch row and step), then
 * per (row, batch row) lanes times dx d (and m sx). The types' f16 d is their first field
 * and m (has_min) the second. quants512 NULL: 4-bit blocks of at most 32 bytes whose 16
 * nibble bytes start at the even byte quant_at (both blocks read by one load). */
GGUF_INLINE void gguf_tiles32_avx512(const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH], const int R,
                                     const int B, const int bytes, const int offset,
                                     __m512i (*quants512)(const uint8_t *, const uint8_t *), const int quant_at,
                                     const int has_min) {
    __m512 acc[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < t->blocks / 2; p++) gguf_step32_avx512(t, acc, R, B, bytes, offset, quants512, quant_at, has_min, p, 0);
    if (t->blocks % 2) gguf_step32_avx512(t, acc, R, B, bytes, offset, quants512, quant_at, has_min, t->blocks / 2, 1);
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) sums[r][b] = gguf_sum512(acc[r][b]);
}

/* The exact-sums template (the float order gemm.h's 32-column GEMMs share, #27): per
 * (weight row, activation row) eight float32 accumulators A_0..A_7 (the lanes of a ymm), A_j
 * taking the blocks j, j + 8, j + 16, ... of the tile's run in order: for each block its exact
 * int32 sum I (vpdpbusd of the unsigned quants against qx, minus offset sum(qx)), then
 * A_j = fma((float)I, d dx, A_j), d dx rounded once. Blocks past the run's end (its last group
 * of 8) add fma(0, 0, A_j) = A_j. The output is gguf_sum256's sum of the eight. Eight blocks'
 * lanes are reduced together (gguf_sub_block_sums), one float update per block.
 * The block's float scale d is its first field, an f16, unless the type gives scales8: the
 * scales of the run's n blocks (row, row + bytes, ...) as 8 float lanes, lanes past n zero
 * (MXFP4's E8M0 exponents). */
/* Blocks k0..k0 + n of the tile (n = 8 a constant on the full steps) into acc. */
GGUF_INLINE void gguf_step32_exact_avx512(const GgufTile *t, __m256 acc[GGUF_TILE_ROWS][GGUF_TILE_BATCH], const int R,
                                          const int B, const int bytes, const int offset,
                                          __m512i (*quants512)(const uint8_t *, const uint8_t *),
                                          __m256 (*scales8)(const uint8_t *, int), const int64_t k0, const int n) {
    const int64_t nb32 = t->in / GGUF_QBLOCK;
    /* gguf_sub_block_sums of block pairs (0, 1), (2, 3), (4, 5), (6, 7): block j to lane j */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    const __mmask8 real = (__mmask8)((1u << n) - 1);
    __m512i x[GGUF_TILE_BATCH][4], minus[GGUF_TILE_BATCH][4];
    __m256 dx[GGUF_TILE_BATCH];
    for (int b = 0; b < B; b++) {
        const int8_t *xb = t->qx + b * t->in + 32 * k0;
        for (int c = 0; c < 4; c++) {
            const int left = n - 2 * c; /* blocks of pair c inside the run */
            const __mmask64 columns = left >= 2 ? ~0ull : left == 1 ? 0xffffffffull : 0;
            x[b][c] = n == 8 ? _mm512_loadu_si512(xb + 64 * c) : _mm512_maskz_loadu_epi8(columns, xb + 64 * c);
            minus[b][c] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                           _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)offset),
                                                               x[b][c]));
        }
        dx[b] = n == 8 ? _mm256_loadu_ps(t->dx + b * nb32 + k0) : _mm256_maskz_loadu_ps(real, t->dx + b * nb32 + k0);
    }
    for (int r = 0; r < R; r++) {
        const uint8_t *row = t->w + r * t->row_bytes + k0 * bytes;
        gguf_prefetch(row, n * bytes, gguf_prefetch_ahead(t));
        __m512i q[4];
        for (int c = 0; c < 4; c++) {
            const int left = n - 2 * c;
            const uint8_t *b0 = row + 2 * c * bytes;
            q[c] = left >= 2 ? quants512(b0, b0 + bytes)
                   : left == 1 ? _mm512_maskz_mov_epi8(0xffffffffull, quants512(b0, b0))
                               : _mm512_setzero_si512();
        }
        __m256 d;
        if (scales8) {
            d = scales8(row, n);
        } else { /* the blocks' f16 d (their first field), packed in two 64-bit words */
            uint64_t words[2] = {0, 0};
            for (int j = 0; j < n; j++) {
                uint16_t h;
                memcpy(&h, row + j * bytes, 2);
                words[j / 4] |= (uint64_t)h << (16 * (j % 4));
            }
            d = _mm256_cvtph_ps(_mm_set_epi64x((int64_t)words[1], (int64_t)words[0]));
        }
        for (int b = 0; b < B; b++) {
            __m512i p[4];
            for (int c = 0; c < 4; c++)
                p[c] = 2 * c < n ? _mm512_dpbusd_epi32(minus[b][c], q[c], x[b][c]) : _mm512_setzero_si512();
            const __m256 integer = _mm256_cvtepi32_ps(gguf_sub_block_sums(p, order));
            acc[r][b] = _mm256_fmadd_ps(integer, _mm256_mul_ps(d, dx[b]), acc[r][b]);
        }
    }
}

GGUF_INLINE void gguf_tile32_exact_avx512(const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH], const int R,
                                          const int B, const int bytes, const int offset,
                                          __m512i (*quants512)(const uint8_t *, const uint8_t *),
                                          __m256 (*scales8)(const uint8_t *, int)) {
    __m256 acc[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm256_setzero_ps();
    const int64_t full = t->blocks / 8 * 8;
    for (int64_t k0 = 0; k0 < full; k0 += 8) gguf_step32_exact_avx512(t, acc, R, B, bytes, offset, quants512, scales8, k0, 8);
    switch (t->blocks - full) { /* the last blocks, their count a constant */
#define GGUF_TAIL32(n) \
    case n: gguf_step32_exact_avx512(t, acc, R, B, bytes, offset, quants512, scales8, full, n); break;
        GGUF_TAIL32(1) GGUF_TAIL32(2) GGUF_TAIL32(3) GGUF_TAIL32(4) GGUF_TAIL32(5) GGUF_TAIL32(6) GGUF_TAIL32(7)
#undef GGUF_TAIL32
    default: break;
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) sums[r][b] = gguf_sum256(acc[r][b]);
}

/* The template for a type that gives quants512. */
GGUF_INLINE void gguf_tile32_avx512(const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH], const int R,
                                    const int B, const int bytes, const int offset,
                                    __m512i (*quants512)(const uint8_t *, const uint8_t *), const int has_min) {
    gguf_tiles32_avx512(t, sums, R, B, bytes, offset, quants512, 0, has_min);
}

/* The template for 4-bit blocks (nibble bytes at quant_at, as Q4_0's and Q4_1's). */
GGUF_INLINE void gguf_tile32_nibbles_avx512(const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH],
                                            const int R, const int B, const int bytes, const int offset,
                                            const int quant_at, const int has_min) {
    gguf_tiles32_avx512(t, sums, R, B, bytes, offset, NULL, quant_at, has_min);
}
#endif

#if KV_HAVE_AVX2_FMA
/* One block per step: vpmaddubsw of |v| against the activations signed by v (pairs stay
 * within int16: 2 * 128 * 127), vpmaddwd to int32 lanes, times d dx (and m sx in lane 0). */
GGUF_INLINE void gguf_tile32_avx2(const GgufTile *t, float sums[GGUF_TILE_ROWS][GGUF_TILE_BATCH], const int R,
                                  const int B, const int bytes, __m256i (*quants256)(const uint8_t *),
                                  GgufBlockScale scale, GgufBlockScale minimum) {
    const int64_t nb32 = t->in / GGUF_QBLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[GGUF_TILE_ROWS][GGUF_TILE_BATCH];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) acc[r][b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < t->blocks; k++)
        for (int r = 0; r < R; r++) {
            const uint8_t *blk = t->w + r * t->row_bytes + k * bytes;
            gguf_prefetch(blk, bytes, gguf_prefetch_ahead(t));
            const __m256i q = quants256(blk), magnitude = _mm256_sign_epi8(q, q);
            const float d = scale(blk);
            const __m256 m = minimum ? _mm256_setr_ps(minimum(blk), 0, 0, 0, 0, 0, 0, 0) : _mm256_setzero_ps();
            for (int b = 0; b < B; b++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(t->qx + b * t->in + 32 * k));
                const __m256i sum = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, q)), ones);
                acc[r][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d * t->dx[b * nb32 + k]), acc[r][b]);
                if (minimum) acc[r][b] = _mm256_fmadd_ps(m, _mm256_set1_ps(t->sx[b * nb32 + k]), acc[r][b]);
            }
        }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) sums[r][b] = gguf_sum256(acc[r][b]);
}
#endif
GGUF_FIXED_FLOAT_END

#endif
