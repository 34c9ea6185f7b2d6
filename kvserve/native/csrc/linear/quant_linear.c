/* y = x W^T (+ b) with W held in block-quantized form (GGUF Q4_0 / Q4_1 / Q8_0 /
 * Q4_K, repacked at load by kvserve/model/quantized.py).
 *
 * Weight format: every row of W is cut into blocks of 32 columns; block j of a
 * row holds 32 small integers q and two float32 numbers d, m, and stands for
 * the values d * q + m. Four-bit weights keep q unsigned (0..15) and two per
 * byte: the first (in / 128) groups of four blocks take 64 bytes each, byte k
 * holding column k in its low nibble and column 64 + k in its high nibble (so
 * one 64-byte load yields two whole blocks per nibble half); the remaining
 * blocks take 16 bytes each in GGUF's own order (byte k: columns k and 16 + k).
 * Eight-bit weights keep q signed, one per byte, in column order; sixteen-bit
 * weights (Q6_K, whose 6-bit quants times their int8 sub-block scales need up to
 * 13 bits) keep q as int16 in column order and take int16 activations only.
 *
 * The activations are quantized per block of 32 to int8 with one float scale
 * (as llama.cpp's Q8 activations), so each block's dot product is an integer
 * sum: with x ~ dx * qx,  sum_i w_i x_i = d dx sum_i q_i qx_i + m dx sum_i qx_i.
 * The integer sums run on AVX512-VNNI (vpdpbusd), AVX2 (vpmaddubsw) or plain
 * C, chosen by the caller (`isa`) among those this build and CPU have; every
 * path gives the same integer sums, so only the float accumulation order
 * differs between them. Built with the other kernels by cpu_kernels.py.
 *
 * With act_bits = 16 the activations are rounded to int16 per block instead
 * (vpdpwssd / vpmaddwd): about as exact as float32 inputs, at twice the integer
 * work. int8 is the default (quantized.py): SmolLM2's hidden states carry a few
 * large outliers, and int8 rounding of the rest of their blocks flips near-tied
 * greedy choices (llama.cpp's Q8 activations do the same), but it moves the
 * default model's perplexity by only +0.5%. On AVX512-VNNI with int8 activations
 * and float32 outputs every row takes the single-row kernel of quant_gemv.c, which
 * gives each activation row the sums of a batch-one step.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kvserve.h"

#define QBLOCK 32
#define GROUP_COLS 128 /* columns of one 64-byte group of 4-bit blocks */
#define TILE_ROWS 4
#define TILE_BATCH 4
#define PARALLEL_MIN_BYTES (256 * 1024)

#define INLINE static inline __attribute__((always_inline))

/* One quantized weight matrix (see the header comment). */
typedef struct {
    const uint8_t *qs;
    const float *d, *m;
    int64_t row_bytes, nb; /* bytes of quants and blocks per row */
    int bits;
} QWeight;

/* The quantized activations: qx [batch, in] (int8, or int16 in qx16), dx and
 * sx (= dx * sum qx) [batch, nb]. */
typedef struct {
    const int8_t *qx;
    const int16_t *qx16;
    const float *dx, *sx;
    int64_t in, nb;
} QAct;

static int64_t row_bytes_of(int bits, int64_t in) { return bits == 4 ? in / 2 : bits == 8 ? in : 2 * in; }

/* ---- activations ------------------------------------------------------------------ */

static void quantize_row(const void *x, int dtype, int64_t in, int act_bits, void *qx, float *dx, float *sx) {
    if (dtype == F32 && act_bits == 8 && kvserve_quantize_row8(x, in, qx, dx, sx)) return;
    const float top = act_bits == 16 ? 32767.0f : 127.0f;
    float v[QBLOCK];
    for (int64_t b = 0; b < in / QBLOCK; b++) {
        float amax = 0.0f;
        for (int i = 0; i < QBLOCK; i++) {
            int64_t at = b * QBLOCK + i;
            v[i] = dtype == F32 ? ((const float *)x)[at] : bf16_value(((const uint16_t *)x)[at]);
            float a = fabsf(v[i]);
            amax = a > amax ? a : amax;
        }
        float scale = amax / top;
        float inv = amax > 0.0f ? top / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < QBLOCK; i++) {
            int q = (int)lrintf(v[i] * inv);
            if (act_bits == 16)
                ((int16_t *)qx)[b * QBLOCK + i] = (int16_t)q;
            else
                ((int8_t *)qx)[b * QBLOCK + i] = (int8_t)q;
            sum += q;
        }
        dx[b] = scale;
        sx[b] = scale * (float)sum;
    }
}

/* ---- portable path ----------------------------------------------------------------- */

/* The 32 quants of block `blk` of one row, in column order. */
static void unpack_block(const QWeight *w, const uint8_t *row, int64_t blk, int q[QBLOCK]) {
    if (w->bits == 16) {
        for (int i = 0; i < QBLOCK; i++) q[i] = ((const int16_t *)row)[blk * QBLOCK + i];
        return;
    }
    if (w->bits == 8) {
        for (int i = 0; i < QBLOCK; i++) q[i] = ((const int8_t *)row)[blk * QBLOCK + i];
        return;
    }
    int64_t groups = w->nb / 4;
    if (blk < groups * 4) {
        const uint8_t *g = row + (blk / 4) * 64;
        int first = (int)(blk % 4) * QBLOCK; /* column of the block within its group */
        for (int i = 0; i < QBLOCK; i++) {
            int col = first + i;
            q[i] = col < 64 ? g[col] & 15 : g[col - 64] >> 4;
        }
        return;
    }
    const uint8_t *t = row + groups * 64 + (blk - groups * 4) * 16;
    for (int i = 0; i < 16; i++) {
        q[i] = t[i] & 15;
        q[i + 16] = t[i] >> 4;
    }
}

static float dot_portable(const QWeight *w, int64_t row, const QAct *a, int64_t b) {
    const uint8_t *qrow = w->qs + row * w->row_bytes;
    const int8_t *qx = a->qx ? a->qx + b * a->in : NULL;
    const int16_t *qx16 = a->qx16 ? a->qx16 + b * a->in : NULL;
    const float *d = w->d + row * w->nb, *dx = a->dx + b * a->nb;
    float acc = 0.0f;
    int q[QBLOCK];
    for (int64_t blk = 0; blk < w->nb; blk++) {
        unpack_block(w, qrow, blk, q);
        int64_t sum = 0; /* 16-bit weights: 32 products can pass 2^31 */
        for (int i = 0; i < QBLOCK; i++) sum += q[i] * (qx ? qx[blk * QBLOCK + i] : qx16[blk * QBLOCK + i]);
        acc += d[blk] * dx[blk] * (float)sum;
    }
    return acc;
}

/* ---- AVX2 path ---------------------------------------------------------------------- */
#if KV_HAVE_AVX2_FMA
INLINE __m256i nibbles_block(__m128i bytes) { /* 16 bytes of a GGUF-order block -> 32 quants */
    const __m128i low = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
}

INLINE __m256 block_dot_avx2(__m256i q, __m256i x, int bits) {
    __m256i pairs;
    if (bits == 8) /* signed x signed through the sign trick: |q| stays <= 128 */
        pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
    else
        pairs = _mm256_maddubs_epi16(q, x);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

/* The quants of block `blk` of a row (4-bit rows: group layout or tail layout). */
INLINE __m256i load_block_avx2(const QWeight *w, const uint8_t *row, int64_t blk) {
    if (w->bits == 8) return _mm256_loadu_si256((const __m256i *)(row + blk * QBLOCK));
    int64_t groups = w->nb / 4;
    if (blk >= groups * 4) return nibbles_block(_mm_loadu_si128((const __m128i *)(row + groups * 64 + (blk - groups * 4) * 16)));
    const uint8_t *g = row + (blk / 4) * 64;
    int part = (int)(blk % 4); /* 0: low nibbles of bytes 0..31, 1: of 32..63, 2/3: high nibbles */
    __m256i v = _mm256_loadu_si256((const __m256i *)(g + (part & 1) * 32));
    if (part >= 2) v = _mm256_srli_epi16(v, 4);
    return _mm256_and_si256(v, _mm256_set1_epi8(15));
}

/* int16 activations: the block's quants widened to int16, vpmaddwd. */
INLINE __m256 block_dot16_avx2(__m256i q, const int16_t *x, int bits) {
    __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    __m256i q0 = bits == 8 ? _mm256_cvtepi8_epi16(lo) : _mm256_cvtepu8_epi16(lo);
    __m256i q1 = bits == 8 ? _mm256_cvtepi8_epi16(hi) : _mm256_cvtepu8_epi16(hi);
    __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(q0, _mm256_loadu_si256((const __m256i *)x)),
                                   _mm256_madd_epi16(q1, _mm256_loadu_si256((const __m256i *)(x + 16))));
    return _mm256_cvtepi32_ps(sum);
}

/* One block of sixteen-bit weights (int16 activations only): vpmaddwd on the stored quants. */
INLINE void block16w_avx2(const QWeight *w, int64_t row, int rows, const QAct *a, int64_t b0, int batch, int64_t blk,
                          __m256 acc[TILE_ROWS][TILE_BATCH]) {
    __m256i q0[TILE_ROWS], q1[TILE_ROWS];
    for (int r = 0; r < rows; r++) {
        const int16_t *src = (const int16_t *)(w->qs + (row + r) * w->row_bytes) + blk * QBLOCK;
        q0[r] = _mm256_loadu_si256((const __m256i *)src);
        q1[r] = _mm256_loadu_si256((const __m256i *)(src + 16));
    }
    for (int b = 0; b < batch; b++) {
        const int16_t *x16 = a->qx16 + (b0 + b) * a->in + blk * QBLOCK;
        __m256i x0 = _mm256_loadu_si256((const __m256i *)x16), x1 = _mm256_loadu_si256((const __m256i *)(x16 + 16));
        float dx = a->dx[(b0 + b) * a->nb + blk];
        for (int r = 0; r < rows; r++) {
            __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(q0[r], x0), _mm256_madd_epi16(q1[r], x1));
            acc[r][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(w->d[(row + r) * w->nb + blk] * dx),
                                        acc[r][b]);
        }
    }
}

static void tile_avx2(const QWeight *w, int64_t row, int rows, const QAct *a, int64_t b0, int batch,
                      float sums[TILE_ROWS][TILE_BATCH]) {
    __m256 acc[TILE_ROWS][TILE_BATCH];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < batch; b++) acc[r][b] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < w->nb; blk++) {
        if (w->bits == 16) {
            block16w_avx2(w, row, rows, a, b0, batch, blk, acc);
            continue;
        }
        __m256i q[TILE_ROWS];
        for (int r = 0; r < rows; r++) q[r] = load_block_avx2(w, w->qs + (row + r) * w->row_bytes, blk);
        for (int b = 0; b < batch; b++) {
            float dx = a->dx[(b0 + b) * a->nb + blk];
            if (a->qx16) {
                const int16_t *x16 = a->qx16 + (b0 + b) * a->in + blk * QBLOCK;
                for (int r = 0; r < rows; r++)
                    acc[r][b] = _mm256_fmadd_ps(block_dot16_avx2(q[r], x16, w->bits),
                                                _mm256_set1_ps(w->d[(row + r) * w->nb + blk] * dx), acc[r][b]);
                continue;
            }
            __m256i x = _mm256_loadu_si256((const __m256i *)(a->qx + (b0 + b) * a->in + blk * QBLOCK));
            for (int r = 0; r < rows; r++)
                acc[r][b] = _mm256_fmadd_ps(block_dot_avx2(q[r], x, w->bits),
                                            _mm256_set1_ps(w->d[(row + r) * w->nb + blk] * dx), acc[r][b]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < batch; b++) {
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r][b]), _mm256_extractf128_ps(acc[r][b], 1));
            s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            s = _mm_add_ss(s, _mm_movehdup_ps(s));
            sums[r][b] = _mm_cvtss_f32(s);
        }
}
#endif

/* ---- AVX-512 VNNI path -------------------------------------------------------------- */
#if KV_HAVE_AVX512_VNNI
/* 16 lanes: the first eight take lane `lo` of v, the last eight lane `lo + 1`. */
INLINE __m512 spread_pair(__m128 v, int lo) {
    const __m512i idx = lo ? _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2)
                           : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
}

INLINE float hsum256_epi32_scaled(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return (float)_mm_cvtsi128_si32(s);
}

/* Four-bit weights: groups of four blocks by 64-byte loads, then the tail blocks.
 * q is unsigned, so vpdpbusd takes it as the unsigned operand directly. */
INLINE void tile4_avx512(const QWeight *w, int64_t row, int rows, const QAct *a, int64_t b0, int batch,
                         float sums[TILE_ROWS][TILE_BATCH]) {
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[TILE_ROWS][TILE_BATCH];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < batch; b++) acc[r][b] = _mm512_setzero_ps();
    const int64_t groups = w->nb / 4;
    for (int64_t g = 0; g < groups; g++) {
        __m512i lo[TILE_ROWS], hi[TILE_ROWS];
        __m128 dw[TILE_ROWS];
        for (int r = 0; r < rows; r++) {
            const uint8_t *p = w->qs + (row + r) * w->row_bytes + g * 64;
            _mm_prefetch((const char *)p + 1024, _MM_HINT_T0);
            __m512i v = _mm512_loadu_si512(p);
            lo[r] = _mm512_and_si512(v, low);
            hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            dw[r] = _mm_loadu_ps(w->d + (row + r) * w->nb + g * 4);
        }
        for (int b = 0; b < batch; b++) {
            const int8_t *xp = a->qx + (b0 + b) * a->in + g * GROUP_COLS;
            __m512i x0 = _mm512_loadu_si512(xp), x1 = _mm512_loadu_si512(xp + 64);
            __m128 dx = _mm_loadu_ps(a->dx + (b0 + b) * a->nb + g * 4);
            for (int r = 0; r < rows; r++) {
                __m128 s = _mm_mul_ps(dw[r], dx);
                __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], x0);
                __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[r], x1);
                acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), spread_pair(s, 0), acc[r][b]);
                acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), spread_pair(s, 1), acc[r][b]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < batch; b++) sums[r][b] = _mm512_reduce_add_ps(acc[r][b]);
    for (int64_t blk = groups * 4; blk < w->nb; blk++) {
        const __m128i low16 = _mm_set1_epi8(15);
        for (int r = 0; r < rows; r++) {
            __m128i bytes = _mm_loadu_si128((const __m128i *)(w->qs + (row + r) * w->row_bytes + groups * 64 +
                                                              (blk - groups * 4) * 16));
            __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low16), _mm_and_si128(bytes, low16));
            for (int b = 0; b < batch; b++) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(a->qx + (b0 + b) * a->in + blk * QBLOCK));
                float isum = hsum256_epi32_scaled(_mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x));
                sums[r][b] += w->d[(row + r) * w->nb + blk] * a->dx[(b0 + b) * a->nb + blk] * isum;
            }
        }
    }
}

/* Eight-bit weights: q is signed, so it is offset by 128 (xor 0x80) to be vpdpbusd's
 * unsigned operand; the 128 * sum(qx) it adds is taken off with the m term. */
INLINE void tile8_avx512(const QWeight *w, int64_t row, int rows, const QAct *a, int64_t b0, int batch,
                         float sums[TILE_ROWS][TILE_BATCH]) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[TILE_ROWS][TILE_BATCH];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < batch; b++) acc[r][b] = _mm512_setzero_ps();
    const int64_t pairs = w->nb / 2;
    for (int64_t p = 0; p < pairs; p++) {
        __m512i q[TILE_ROWS];
        __m128 dw[TILE_ROWS];
        for (int r = 0; r < rows; r++) {
            const uint8_t *src = w->qs + (row + r) * w->row_bytes + p * 64;
            _mm_prefetch((const char *)src + 1024, _MM_HINT_T0);
            q[r] = _mm512_xor_si512(_mm512_loadu_si512(src), flip);
            dw[r] = _mm_castpd_ps(_mm_load_sd((const double *)(w->d + (row + r) * w->nb + p * 2)));
        }
        for (int b = 0; b < batch; b++) {
            __m512i x = _mm512_loadu_si512(a->qx + (b0 + b) * a->in + p * 64);
            __m128 dx = _mm_castpd_ps(_mm_load_sd((const double *)(a->dx + (b0 + b) * a->nb + p * 2)));
            for (int r = 0; r < rows; r++) {
                __m512i i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[r], x);
                acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), spread_pair(_mm_mul_ps(dw[r], dx), 0), acc[r][b]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < batch; b++) sums[r][b] = _mm512_reduce_add_ps(acc[r][b]);
    if (w->nb % 2) {
        int64_t blk = w->nb - 1;
        const __m256i flip32 = _mm256_set1_epi8((char)0x80);
        for (int r = 0; r < rows; r++) {
            __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w->qs + (row + r) * w->row_bytes + blk * QBLOCK)), flip32);
            for (int b = 0; b < batch; b++) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(a->qx + (b0 + b) * a->in + blk * QBLOCK));
                float isum = hsum256_epi32_scaled(_mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x));
                sums[r][b] += w->d[(row + r) * w->nb + blk] * a->dx[(b0 + b) * a->nb + blk] * isum;
            }
        }
    }
}

/* int16 activations, one block at a time: quants widened to int16, vpdpwssd. */
INLINE void tile16_avx512(const QWeight *w, int64_t row, int rows, const QAct *a, int64_t b0, int batch,
                          float sums[TILE_ROWS][TILE_BATCH]) {
    __m512 acc[TILE_ROWS][TILE_BATCH];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < batch; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < w->nb; blk++) {
        __m512i q[TILE_ROWS];
        for (int r = 0; r < rows; r++) {
            const uint8_t *src = w->qs + (row + r) * w->row_bytes;
            _mm_prefetch((const char *)src + blk * (w->bits * 4) + 1024, _MM_HINT_T0);
            if (w->bits == 16) {
                q[r] = _mm512_loadu_si512(src + blk * QBLOCK * 2);
                continue;
            }
            __m256i bytes = load_block_avx2(w, src, blk);
            q[r] = w->bits == 8 ? _mm512_cvtepi8_epi16(bytes) : _mm512_cvtepu8_epi16(bytes);
        }
        for (int b = 0; b < batch; b++) {
            __m512i x = _mm512_loadu_si512(a->qx16 + (b0 + b) * a->in + blk * QBLOCK);
            float dx = a->dx[(b0 + b) * a->nb + blk];
            for (int r = 0; r < rows; r++) {
                __m512i i = _mm512_dpwssd_epi32(_mm512_setzero_si512(), q[r], x);
                acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(w->d[(row + r) * w->nb + blk] * dx),
                                            acc[r][b]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < batch; b++) sums[r][b] = _mm512_reduce_add_ps(acc[r][b]);
}

INLINE void tile_avx512(const QWeight *w, int64_t row, int rows, const QAct *a, int64_t b0, int batch,
                        float sums[TILE_ROWS][TILE_BATCH]) {
    if (a->qx16)
        tile16_avx512(w, row, rows, a, b0, batch, sums);
    else if (w->bits == 8)
        tile8_avx512(w, row, rows, a, b0, batch, sums);
    else
        tile4_avx512(w, row, rows, a, b0, batch, sums);
}

/* Variants with `rows` and `batch` constant, so the accumulators live in registers. */
static void tile_avx512_dispatch(const QWeight *w, int64_t row, int rows, const QAct *a, int64_t b0, int batch,
                                 float sums[TILE_ROWS][TILE_BATCH]) {
#define CASE(R, B) \
    if (rows == R && batch == B) { tile_avx512(w, row, R, a, b0, B, sums); return; }
    CASE(4, 4) CASE(4, 3) CASE(4, 2) CASE(4, 1)
    CASE(1, 4) CASE(1, 3) CASE(1, 2) CASE(1, 1)
#undef CASE
}
#endif

/* ---- driver ------------------------------------------------------------------------- */

static void tile_sums(const QWeight *w, int64_t row, int rows, const QAct *a, int64_t b0, int batch, int isa,
                      float sums[TILE_ROWS][TILE_BATCH]) {
#if KV_HAVE_AVX512_VNNI
    if (isa == ISA_AVX512) { tile_avx512_dispatch(w, row, rows, a, b0, batch, sums); return; }
#endif
#if KV_HAVE_AVX2_FMA
    if (isa == ISA_AVX2) { tile_avx2(w, row, rows, a, b0, batch, sums); return; }
#endif
    (void)isa;
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < batch; b++) sums[r][b] = dot_portable(w, row + r, a, b0 + b);
}

/* sum_j (m_j - offset d_j) sx_j over the blocks of one row: the part of the dot product
 * that the blocks' minimums (and, for the VNNI 8-bit path, the +128 offset) contribute.
 * m may be NULL: every minimum zero (Q8_0), not read. */
static float min_term(const QWeight *w, int64_t row, const QAct *a, int64_t b, float offset) {
    const float *d = w->d + row * w->nb, *sx = a->sx + b * a->nb;
    float acc = 0.0f;
    if (!w->m) {
        for (int64_t j = 0; j < w->nb; j++) acc -= offset * d[j] * sx[j];
        return acc;
    }
    const float *m = w->m + row * w->nb;
    for (int64_t j = 0; j < w->nb; j++) acc += (m[j] - offset * d[j]) * sx[j];
    return acc;
}

/* y[b, o] = sum_i x[b, i] W[o, i] (+ bias[o]) for b < batch, o < out.
 * x and y rows are x_stride / y_stride elements of `dtype` apart; bias (or NULL) is of
 * `dtype`. `in` must be a multiple of 32. Returns 0, or -1 for bad arguments, -2 when
 * `isa` is not available, -3 when out of memory (nothing written then). */
int kvserve_quant_linear(const void *x, int64_t x_stride, int64_t batch, const uint8_t *qs, const float *d,
                         const float *m, int bits, int64_t out, int64_t in, const void *bias, void *y,
                         int64_t y_stride, int dtype, int act_bits, int isa, int num_threads) {
    if (in % QBLOCK || (bits != 4 && bits != 8 && bits != 16) || (act_bits != 8 && act_bits != 16) ||
        (bits == 16 && act_bits != 16) || batch < 0 || out < 0)
        return -1;
    if (!kvserve_isa_available(KV_KERNEL_QUANT, isa)) return -2;
    const int64_t nb = in / QBLOCK;
    const int element = dtype == F32 ? 4 : 2;
    void *qx = malloc((size_t)(batch * in * (act_bits / 8)) + 64);
    float *scales = malloc(sizeof(float) * (size_t)(2 * batch * nb + 1));
    if (!qx || !scales) {
        free(qx);
        free(scales);
        return -3;
    }
    QWeight w = {qs, d, m, row_bytes_of(bits, in), nb, bits};
    QAct a = {act_bits == 8 ? qx : NULL, act_bits == 16 ? qx : NULL, scales, scales + batch * nb, in, nb};
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && batch >= 16)
    for (int64_t b = 0; b < batch; b++)
        quantize_row((const char *)x + b * x_stride * element, dtype, in, act_bits,
                     (char *)qx + b * in * (act_bits / 8), scales + b * nb,
                     scales + batch * nb + b * nb);
    const float offset = (isa == ISA_AVX512 && bits == 8 && act_bits == 8) ? 128.0f : 0.0f;
    const int64_t full_tiles = out / TILE_ROWS;
    const int64_t tiles = full_tiles + out % TILE_ROWS;
    if (out * w.row_bytes * (batch > 4 ? 4 : 1) < PARALLEL_MIN_BYTES) num_threads = 1;
    if (act_bits == 8 && isa == ISA_AVX512 && dtype == F32 &&
        kvserve_gemv(qx, scales, batch, qs, d, m, bits, in, bias, y, y_stride, out, num_threads)) {
        free(qx);
        free(scales);
        return 0;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t row = t < full_tiles ? t * TILE_ROWS : full_tiles * TILE_ROWS + (t - full_tiles);
        int rows = t < full_tiles ? TILE_ROWS : 1;
        float sums[TILE_ROWS][TILE_BATCH];
        for (int64_t b0 = 0; b0 < batch; b0 += TILE_BATCH) {
            int chunk = batch - b0 < TILE_BATCH ? (int)(batch - b0) : TILE_BATCH;
            tile_sums(&w, row, rows, &a, b0, chunk, isa, sums);
            for (int r = 0; r < rows; r++) {
                float add = 0.0f;
                if (bias) add = dtype == F32 ? ((const float *)bias)[row + r] : bf16_value(((const uint16_t *)bias)[row + r]);
                for (int b = 0; b < chunk; b++) {
                    float v = sums[r][b] + min_term(&w, row + r, &a, b0 + b, offset) + add;
                    int64_t at = (b0 + b) * y_stride + row + r;
                    if (dtype == F32)
                        ((float *)y)[at] = v;
                    else
                        ((uint16_t *)y)[at] = bf16_bits(v);
                }
            }
        }
    }
    free(qx);
    free(scales);
    return 0;
}

/* ---- row ranges, for callers that run their own parallel region ------------------- */

/* Quantizes x [batch, in] (float32 rows x_stride apart) as kvserve_quant_linear does:
 * qx [batch, in] (int8, or int16 with act_bits 16), scales [2 * batch * in / 32]
 * (dx of every block, then dx * sum qx). */
void kvserve_quant_activations(const float *x, int64_t x_stride, int64_t batch, int64_t in, int act_bits, void *qx,
                               float *scales) {
    const int64_t nb = in / QBLOCK;
    for (int64_t b = 0; b < batch; b++)
        quantize_row(x + b * x_stride, F32, in, act_bits, (char *)qx + b * in * (act_bits / 8), scales + b * nb,
                     scales + batch * nb + b * nb);
}

/* One row's columns x [in] quantized to int8 as kvserve_quant_activations does, each
 * 32-column block by itself: dx and sx of its blocks to dx [in / 32] and sx [in / 32] (so a
 * caller can quantize part of a row into its place in a batch's buffers). */
void kvserve_quant_activation_blocks(const float *x, int64_t in, int8_t *qx, float *dx, float *sx) {
    quantize_row(x, F32, in, 8, qx, dx, sx);
}

/* Whether a batch-one call takes the single-row kernel of quant_gemv.c, whose float sums
 * differ from the tile kernel's: a caller that must reproduce batch-one steps row for row
 * (the speculative verify steps of fused_decoder.c) then runs its rows one at a time. */
int kvserve_quant_single_row_kernel(int act_bits, int isa) { return act_bits == 8 && isa == ISA_AVX512; }

/* Rows row_begin..row_end of y = x W^T (+ bias), float32, from activations quantized by
 * kvserve_quant_activations. Runs on the calling thread only: the fused decoder
 * (csrc/decoder/fused_decoder.c) splits a matrix's rows over the threads of its one region.
 * The sums are the ones kvserve_quant_linear computes for these rows. */
void kvserve_quant_rows(const void *qx, const float *scales, int64_t batch, const uint8_t *qs, const float *d,
                        const float *m, int bits, int64_t in, const float *bias, float *y, int64_t y_stride,
                        int act_bits, int isa, int64_t row_begin, int64_t row_end) {
    const int64_t nb = in / QBLOCK;
    QWeight w = {qs, d, m, row_bytes_of(bits, in), nb, bits};
    QAct a = {act_bits == 8 ? (const int8_t *)qx : NULL, act_bits == 16 ? (const int16_t *)qx : NULL, scales,
              scales + batch * nb, in, nb};
    if (act_bits == 8 && isa == ISA_AVX512 &&
        kvserve_gemv_rows(qx, scales, batch, qs, d, m, bits, in, bias, y, y_stride, row_begin, row_end))
        return;
    const float offset = (isa == ISA_AVX512 && bits == 8 && act_bits == 8) ? 128.0f : 0.0f;
    float sums[TILE_ROWS][TILE_BATCH];
    for (int64_t row = row_begin; row < row_end;) {
        int rows = row_end - row >= TILE_ROWS ? TILE_ROWS : 1;
        for (int64_t b0 = 0; b0 < batch; b0 += TILE_BATCH) {
            int chunk = batch - b0 < TILE_BATCH ? (int)(batch - b0) : TILE_BATCH;
            tile_sums(&w, row, rows, &a, b0, chunk, isa, sums);
            for (int r = 0; r < rows; r++)
                for (int b = 0; b < chunk; b++)
                    y[(b0 + b) * y_stride + row + r] = sums[r][b] + min_term(&w, row + r, &a, b0 + b, offset) +
                                                       (bias ? bias[row + r] : 0.0f);
        }
        row += rows;
    }
}

/* ---- dequantization, for the many-token steps ------------------------------------------ */

/* Rows of W as floats: w [out, in] of `dtype` (float32 or bfloat16), the values d * q + m
 * (exactly the file's, before any bfloat16 rounding). Prefill-sized steps dequantize a
 * weight this way and multiply with a dense GEMM: at hundreds of tokens the matmul is
 * compute-bound and a tuned float GEMM beats the integer kernel above, while the cost
 * of rebuilding the weight is spread over all the tokens. Returns 0 or -1. */
static void store_values(const float *v, int n, void *w, int64_t at, int dtype) {
    if (dtype == F32)
        memcpy((float *)w + at, v, sizeof(float) * (size_t)n);
    else
        for (int i = 0; i < n; i++) ((uint16_t *)w)[at + i] = bf16_bits(v[i]);
}

/* Row r of W into w_row [in] of `dtype`. */
static void dequantize_row(const QWeight *q, int64_t r, void *w_row, int dtype) {
    const uint8_t *row = q->qs + r * q->row_bytes;
    const float *dr = q->d + r * q->nb, *mr = q->m + r * q->nb;
    const int64_t groups = q->bits == 4 ? q->nb / 4 : 0;
    float v[GROUP_COLS];
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *bytes = row + g * 64;
        const float *dg = dr + g * 4, *mg = mr + g * 4;
        for (int k = 0; k < 64; k++) {
            v[k] = dg[k / QBLOCK] * (float)(bytes[k] & 15) + mg[k / QBLOCK];
            v[64 + k] = dg[2 + k / QBLOCK] * (float)(bytes[k] >> 4) + mg[2 + k / QBLOCK];
        }
        store_values(v, GROUP_COLS, w_row, g * GROUP_COLS, dtype);
    }
    for (int64_t blk = groups * 4; blk < q->nb; blk++) {
        if (q->bits == 16) {
            const int16_t *values = (const int16_t *)row + blk * QBLOCK;
            for (int i = 0; i < QBLOCK; i++) v[i] = dr[blk] * (float)values[i] + mr[blk];
        } else if (q->bits == 8) {
            const int8_t *bytes = (const int8_t *)row + blk * QBLOCK;
            for (int i = 0; i < QBLOCK; i++) v[i] = dr[blk] * (float)bytes[i] + mr[blk];
        } else {
            const uint8_t *bytes = row + groups * 64 + (blk - groups * 4) * 16;
            for (int i = 0; i < 16; i++) {
                v[i] = dr[blk] * (float)(bytes[i] & 15) + mr[blk];
                v[16 + i] = dr[blk] * (float)(bytes[i] >> 4) + mr[blk];
            }
        }
        store_values(v, QBLOCK, w_row, blk * QBLOCK, dtype);
    }
}

int kvserve_quant_dequantize(const uint8_t *qs, const float *d, const float *m, int bits, int64_t out, int64_t in,
                             void *w, int dtype, int num_threads) {
    if (in % QBLOCK || (bits != 4 && bits != 8 && bits != 16) || out < 0) return -1;
    QWeight q = {qs, d, m, row_bytes_of(bits, in), in / QBLOCK, bits};
    if (out * q.row_bytes < PARALLEL_MIN_BYTES) num_threads = 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t r = 0; r < out; r++) dequantize_row(&q, r, (char *)w + r * in * (dtype == F32 ? 4 : 2), dtype);
    return 0;
}

/* Row r of W as float32 values v [in] (the panels of quant_gemm.c). */
void kvserve_quant_row_values(const uint8_t *qs, const float *d, const float *m, int bits, int64_t in, int64_t r,
                              float *v) {
    QWeight q = {qs, d, m, row_bytes_of(bits, in), in / QBLOCK, bits};
    dequantize_row(&q, r, v, F32);
}

/* An embedding lookup: rows ids[0..n) of W [rows, in] as float32 rows of out [n, in], the
 * values `QuantizedWeight.dequantize(ids)` computes. Returns -1, writing nothing, for an id
 * outside [0, rows) or a shape this layout does not have. */
int kvserve_quant_embed(const uint8_t *qs, const float *d, const float *m, int bits, int64_t rows, int64_t in,
                        const int64_t *ids, int64_t n, float *out) {
    if (in % QBLOCK || (bits != 4 && bits != 8 && bits != 16)) return -1;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= rows) return -1;
    QWeight q = {qs, d, m, row_bytes_of(bits, in), in / QBLOCK, bits};
    for (int64_t i = 0; i < n; i++) dequantize_row(&q, ids[i], out + i * in, F32);
    return 0;
}
