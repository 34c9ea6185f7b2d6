/* y = x W^T (+ b) with W block-quantized (the layout of quant_linear.c) for steps of
 * many rows: batched decode and mixed serving steps (about 9 to 128 rows).
 *
 * quant_linear.c's integer kernel pays, for every block of 32 columns and every
 * (weight row, batch row) pair, a conversion and a scaled float add on top of the
 * integer dot product: cheap at one to eight rows, where the weight's memory
 * traffic dominates, but at 32 rows it leaves the cores doing bookkeeping. Here
 * each thread instead expands a panel of PANEL_ROWS weight rows once per call
 * into a small dense buffer that stays in its cache (bfloat16 on CPUs with
 * AVX512-BF16, else float32), and multiplies every batch row against it with a
 * register-blocked micro-kernel: MR weight rows x NB batch rows of vector
 * accumulators, each summing along the columns (vdpbf16ps: 32 multiply-adds per
 * instruction, no per-block work), reduced once per output. The expansion is
 * paid once per weight element per call, so its share falls with the batch.
 *
 * Numbers: the panel holds d * q + m (the file's values) rounded to the panel's
 * type, the activations are rounded to it too, the sums are float32: on the
 * bfloat16 path this is what dequantize + oneDNN's bfloat16 GEMM computes (the
 * many-row path of quantized.py), up to the order of the float32 sums.
 * Paths: AVX512-BF16 (bfloat16 panel), AVX2+FMA and portable C (float32 panel),
 * picked by the caller (`isa`, the codes of quant_linear.c).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kvserve.h"

#define QBLOCK 32
#define PANEL_ROWS 16 /* weight rows expanded together; threads split whole panels */
#define MR 4          /* weight rows of one micro-tile */
#define NB 6          /* batch rows of one micro-tile (AVX-512) */
#define NB_NARROW 2   /* ... on the AVX2 and portable paths */
#define PARALLEL_MIN_MACS (1 << 20)

#define INLINE static inline __attribute__((always_inline))

/* Bytes of one element of the panel and of the prepared activations on path `isa`. */
static int64_t element_of(int isa) { return isa == ISA_AVX512 ? 2 : 4; }

typedef struct {
    const uint8_t *qs;
    const float *d, *m;
    int64_t in;
    int bits;
} GemmWeight;

/* ---- panel expansion ------------------------------------------------------------------ */

#if KV_HAVE_AVX512_BF16
/* 32 values d * q + m (q: 32 lanes of int32 in two halves) as bfloat16 at dst. */
INLINE void store_block_bf16(__m512i q_lo, __m512i q_hi, float d, float m, uint16_t *dst) {
    const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
    __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q_lo), dv, mv), hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q_hi), dv, mv);
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* Row r of W as bfloat16 values dst [in], vectorized per block. */
static void row_bf16(const GemmWeight *w, int64_t r, uint16_t *dst) {
    const int64_t nb = w->in / QBLOCK, groups = w->bits == 4 ? nb / 4 : 0;
    const int64_t row_bytes = w->bits == 4 ? w->in / 2 : w->bits == 8 ? w->in : 2 * w->in;
    const uint8_t *row = w->qs + r * row_bytes;
    const float *d = w->d + r * nb, *m = w->m + r * nb;
    const __m128i low = _mm_set1_epi8(15);
    for (int64_t g = 0; g < groups; g++) { /* 64 bytes: blocks 0, 1 in the low nibbles, 2, 3 in the high */
        for (int half = 0; half < 2; half++) {
            __m128i a = _mm_loadu_si128((const __m128i *)(row + g * 64 + half * 32));
            __m128i b = _mm_loadu_si128((const __m128i *)(row + g * 64 + half * 32 + 16));
            int64_t blk = g * 4 + half;
            store_block_bf16(_mm512_cvtepu8_epi32(_mm_and_si128(a, low)), _mm512_cvtepu8_epi32(_mm_and_si128(b, low)),
                             d[blk], m[blk], dst + blk * QBLOCK);
            store_block_bf16(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(a, 4), low)),
                             _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low)), d[blk + 2], m[blk + 2],
                             dst + (blk + 2) * QBLOCK);
        }
    }
    for (int64_t blk = groups * 4; blk < nb; blk++) {
        __m512i q_lo, q_hi;
        if (w->bits == 4) { /* tail blocks, GGUF order: byte k holds columns k and 16 + k */
            __m128i t = _mm_loadu_si128((const __m128i *)(row + groups * 64 + (blk - groups * 4) * 16));
            q_lo = _mm512_cvtepu8_epi32(_mm_and_si128(t, low));
            q_hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(t, 4), low));
        } else if (w->bits == 8) {
            q_lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + blk * QBLOCK)));
            q_hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + blk * QBLOCK + 16)));
        } else {
            const int16_t *q = (const int16_t *)row + blk * QBLOCK;
            q_lo = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)q));
            q_hi = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(q + 16)));
        }
        store_block_bf16(q_lo, q_hi, d[blk], m[blk], dst + blk * QBLOCK);
    }
}
#endif

/* Weight rows row..row+PANEL_ROWS into panel [PANEL_ROWS, in] of the path's type; rows at
 * or past `out` become zeros. */
static void expand_panel(const GemmWeight *w, int64_t row, int64_t out, int isa, void *panel) {
    const int64_t in = w->in;
    for (int r = 0; r < PANEL_ROWS; r++) {
        if (row + r >= out) {
            memset((char *)panel + r * in * element_of(isa), 0, (size_t)(in * element_of(isa)));
            continue;
        }
        if (isa != ISA_AVX512) {
            kvserve_quant_row_values(w->qs, w->d, w->m, w->bits, in, row + r, (float *)panel + r * in);
            continue;
        }
#if KV_HAVE_AVX512_BF16
        row_bf16(w, row + r, (uint16_t *)panel + r * in);
#endif
    }
}

/* ---- micro-kernels: sums[r][b] = panel row r . activation row b ---------------------- */

#if KV_HAVE_AVX512_BF16
INLINE void micro_bf16(const uint16_t *wp, const uint16_t *xp, int batch, int64_t in, float sums[MR][NB]) {
    __m512 acc[MR][NB];
    for (int r = 0; r < MR; r++)
        for (int b = 0; b < batch; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in; k += 32) {
        __m512bh wv[MR];
        for (int r = 0; r < MR; r++) wv[r] = (__m512bh)_mm512_loadu_si512(wp + r * in + k);
        for (int b = 0; b < batch; b++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(xp + b * in + k);
            for (int r = 0; r < MR; r++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], wv[r], xv);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int b = 0; b < batch; b++) sums[r][b] = _mm512_reduce_add_ps(acc[r][b]);
}

/* Variants with `batch` constant, so the accumulators stay in registers. */
static void micro_bf16_dispatch(const uint16_t *wp, const uint16_t *xp, int batch, int64_t in, float sums[MR][NB]) {
    switch (batch) {
    case 6: micro_bf16(wp, xp, 6, in, sums); break;
    case 5: micro_bf16(wp, xp, 5, in, sums); break;
    case 4: micro_bf16(wp, xp, 4, in, sums); break;
    case 3: micro_bf16(wp, xp, 3, in, sums); break;
    case 2: micro_bf16(wp, xp, 2, in, sums); break;
    default: micro_bf16(wp, xp, 1, in, sums); break;
    }
}
#endif

#if KV_HAVE_AVX2_FMA
INLINE float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE void micro_avx2(const float *wp, const float *xp, int batch, int64_t in, float sums[MR][NB]) {
    __m256 acc[MR][NB_NARROW];
    for (int r = 0; r < MR; r++)
        for (int b = 0; b < batch; b++) acc[r][b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < in; k += 8) {
        __m256 wv[MR];
        for (int r = 0; r < MR; r++) wv[r] = _mm256_loadu_ps(wp + r * in + k);
        for (int b = 0; b < batch; b++) {
            __m256 xv = _mm256_loadu_ps(xp + b * in + k);
            for (int r = 0; r < MR; r++) acc[r][b] = _mm256_fmadd_ps(wv[r], xv, acc[r][b]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int b = 0; b < batch; b++) sums[r][b] = hsum256(acc[r][b]);
}
#endif

static void micro_portable(const float *wp, const float *xp, int batch, int64_t in, float sums[MR][NB]) {
    for (int r = 0; r < MR; r++)
        for (int b = 0; b < batch; b++) {
            float s = 0.0f;
            for (int64_t k = 0; k < in; k++) s += wp[r * in + k] * xp[b * in + k];
            sums[r][b] = s;
        }
}

static void micro(const void *wp, const void *xp, int batch, int64_t in, int isa, float sums[MR][NB]) {
#if KV_HAVE_AVX512_BF16
    if (isa == ISA_AVX512) { micro_bf16_dispatch(wp, xp, batch, in, sums); return; }
#endif
#if KV_HAVE_AVX2_FMA
    if (isa == ISA_AVX2) {
        if (batch == 2) micro_avx2(wp, xp, 2, in, sums);
        else micro_avx2(wp, xp, 1, in, sums);
        return;
    }
#endif
    micro_portable(wp, xp, batch, in, sums);
}

/* ---- one panel against every batch row ---------------------------------------------- */

typedef struct {
    float *y;
    int64_t y_stride;
    int dtype; /* of y and bias */
    const void *bias;
} GemmOut;

static void store(const GemmOut *o, int64_t b, int64_t row, float v) {
    if (o->bias) v += o->dtype == F32 ? ((const float *)o->bias)[row] : bf16_value(((const uint16_t *)o->bias)[row]);
    if (o->dtype == F32)
        o->y[b * o->y_stride + row] = v;
    else
        ((uint16_t *)o->y)[b * o->y_stride + row] = bf16_bits(v);
}

static void gemm_panel(const GemmWeight *w, int64_t row, int64_t out, const void *xa, int64_t batch, int isa,
                       void *panel, const GemmOut *o) {
    expand_panel(w, row, out, isa, panel);
    const int64_t in = w->in, element = element_of(isa);
    const int tile = isa == ISA_AVX512 ? NB : NB_NARROW;
    float sums[MR][NB];
    for (int64_t b0 = 0; b0 < batch; b0 += tile) {
        int chunk = batch - b0 < tile ? (int)(batch - b0) : tile;
        const char *xp = (const char *)xa + b0 * in * element;
        for (int r0 = 0; r0 < PANEL_ROWS && row + r0 < out; r0 += MR) {
            micro((const char *)panel + r0 * in * element, xp, chunk, in, isa, sums);
            for (int r = 0; r < MR && row + r0 + r < out; r++)
                for (int b = 0; b < chunk; b++) store(o, b0 + b, row + r0 + r, sums[r][b]);
        }
    }
}

/* ---- entry points ------------------------------------------------------------------------ */

/* Bytes of the per-thread buffer kvserve_quant_gemm_rows needs for a weight of width `in`. */
int64_t kvserve_quant_gemm_panel_bytes(int64_t in) { return PANEL_ROWS * in * 4 + 64; }

/* The activations as the path multiplies them: x [batch, in] (float32 or bfloat16 rows
 * x_stride elements apart) -> xa [batch, in] contiguous, bfloat16 on the AVX-512 path,
 * float32 otherwise. */
void kvserve_quant_gemm_prepare(const void *x, int64_t x_stride, int64_t batch, int64_t in, int dtype, int isa,
                                void *xa) {
    for (int64_t b = 0; b < batch; b++) {
        const char *src = (const char *)x + b * x_stride * (dtype == F32 ? 4 : 2);
        if (isa == ISA_AVX512) {
            uint16_t *dst = (uint16_t *)xa + b * in;
            if (dtype == F32)
                for (int64_t i = 0; i < in; i++) dst[i] = bf16_bits(((const float *)src)[i]);
            else
                memcpy(dst, src, (size_t)in * 2);
        } else {
            float *dst = (float *)xa + b * in;
            if (dtype == F32)
                memcpy(dst, src, (size_t)in * 4);
            else
                for (int64_t i = 0; i < in; i++) dst[i] = bf16_value(((const uint16_t *)src)[i]);
        }
    }
}

/* Rows row_begin..row_end (row_begin a multiple of 16) of y = xa W^T (+ bias), float32,
 * from activations prepared by kvserve_quant_gemm_prepare, on the calling thread only
 * (the fused decoder splits rows over its own threads). `buffer` holds
 * kvserve_quant_gemm_panel_bytes(in) bytes. */
void kvserve_quant_gemm_rows(const void *xa, int64_t batch, const uint8_t *qs, const float *d, const float *m,
                             int bits, int64_t in, const float *bias, float *y, int64_t y_stride, int isa,
                             int64_t row_begin, int64_t row_end, void *buffer) {
    GemmWeight w = {qs, d, m, in, bits};
    GemmOut o = {y, y_stride, F32, bias};
    for (int64_t row = row_begin; row < row_end; row += PANEL_ROWS)
        gemm_panel(&w, row, row_end, xa, batch, isa, buffer, &o);
}

/* y[b, o] = sum_i x[b, i] W[o, i] (+ bias[o]) for b < batch, o < out; x and y rows
 * x_stride / y_stride elements of `dtype` apart, bias (or NULL) of `dtype`. `in` must
 * be a multiple of 32. Returns 0, or -1 for bad arguments, -2 when `isa` is not
 * available, -3 when out of memory (nothing written then). */
int kvserve_quant_gemm(const void *x, int64_t x_stride, int64_t batch, const uint8_t *qs, const float *d,
                       const float *m, int bits, int64_t out, int64_t in, const void *bias, void *y, int64_t y_stride,
                       int dtype, int isa, int num_threads) {
    if (in % QBLOCK || (bits != 4 && bits != 8 && bits != 16) || batch < 0 || out < 0) return -1;
    if (!kvserve_isa_available(KV_KERNEL_QUANT_GEMM, isa)) return -2;
    void *xa = malloc((size_t)(batch * in * element_of(isa)) + 64);
    if (!xa) return -3;
    const int64_t panels = (out + PANEL_ROWS - 1) / PANEL_ROWS;
    if (batch * out * in < PARALLEL_MIN_MACS || panels < 2) num_threads = 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        void *buffer = malloc((size_t)kvserve_quant_gemm_panel_bytes(in));
        if (!buffer) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; b++) kvserve_quant_gemm_prepare((const char *)x + b * x_stride * (dtype == F32 ? 4 : 2),
                                                                       x_stride, 1, in, dtype, isa,
                                                                       (char *)xa + b * in * element_of(isa));
        /* the implicit barrier above also publishes `failed` */
        if (!failed) {
            GemmWeight w = {qs, d, m, in, bits};
            GemmOut o = {y, y_stride, dtype, bias};
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) gemm_panel(&w, p * PANEL_ROWS, out, xa, batch, isa, buffer, &o);
        }
        free(buffer);
    }
    free(xa);
    return failed ? -3 : 0;
}
