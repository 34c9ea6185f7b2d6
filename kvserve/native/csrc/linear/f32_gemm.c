/* y = x W^T (+ b) for float32 weights pre-packed into panels: every step size of a
 * float32 model, from one decode row to a long prefill.
 *
 * oneDNN's packed float32 matmul runs a 32-row decode step of a small model at a
 * fraction of the cores' FMA rate, and a plain-layout dot-product kernel
 * (small_linear.c) pays a horizontal reduction per output. Here the weight is
 * laid out once, at load, in panels of PANEL output rows: panel p holds rows
 * 16p..16p+15 as [in][PANEL], so one vector load gives the 16 weights of one
 * input column. A micro-kernel keeps an MR-token x NP-panel block of y in
 * vector registers and adds, per input column, the outer product of MR
 * broadcast activations and NP weight vectors (AVX-512: 8 tokens x 3 panels,
 * 24 accumulators, 24 FMAs per 3 loads + 8 broadcasts). Each thread takes whole
 * panels; a group of NP panels (at most 3 x 16 x in floats, a few hundred KiB)
 * stays in L2 while every block of tokens passes over it, so the weights come
 * from memory once per call.
 *
 * Numbers: float32 products summed in float32 along the input, in order; only
 * the order of the sums differs from oneDNN's. Paths: AVX-512F (16 lanes, one
 * vector per panel), AVX2 + FMA (two 8-lane vectors per panel), portable C,
 * picked by the caller (`isa`, quant_linear.c's codes, so KVSERVE_QUANT_ISA caps
 * this kernel too). Rows past `out` in the last panel are zeros and never stored.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvserve.h"

#define PANEL 16 /* output rows per panel */
#define MR 8     /* tokens of one micro-tile (AVX-512) */
#define NP 3     /* panels of one micro-tile (AVX-512) */
#define MR_AVX2 6
#define PARALLEL_MIN_MACS (1 << 20)

#define INLINE static inline __attribute__((always_inline))

/* Floats of the packed form of an [out, in] weight. */
int64_t kvserve_f32_packed_size(int64_t out, int64_t in) { return (out + PANEL - 1) / PANEL * PANEL * in; }

/* packed [ceil(out / 16)][in][16] <- w [out, in] (rows w_stride floats apart); rows past
 * `out` are zeros. */
void kvserve_f32_pack(const float *w, int64_t w_stride, int64_t out, int64_t in, float *packed) {
    const int64_t panels = (out + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * in * PANEL;
        for (int r = 0; r < PANEL; r++) {
            const int64_t row = p * PANEL + r;
            for (int64_t i = 0; i < in; i++) dst[i * PANEL + r] = row < out ? w[row * w_stride + i] : 0.0f;
        }
    }
}

/* A block of y: tokens t0..t0+mt, panels p0..p0+np, summed into tile[t][j * PANEL + lane].
 * While it runs, the micro-kernel prefetches `pf_lines` cache lines from `pf` into every
 * cache level, `pf_per_k` of them per input column (prefetch_k; kvserve_f32_gemm_rows
 * points them at the next group of panels). */
typedef struct {
    const float *x;
    int64_t x_stride, in;
    const float *packed;
    const char *pf;
    int64_t pf_lines;
    int pf_per_k;
} GemmIn;

/* The next group of panels streams from memory while this group's tiles compute: at 32
 * tokens the first tile of each group otherwise waits on its weights (~110 KiB) at the
 * memory's speed and the core runs at ~70% of its FMA rate. Prefetches are spread over the
 * group's tiles (one line per input column, more when the group has fewer tiles than
 * it has lines per column), so they never come in a burst. */
INLINE void prefetch_k(const GemmIn *g, int64_t k) {
    for (int l = 0; l < g->pf_per_k; l++) {
        const int64_t line = k * g->pf_per_k + l;
        if (line < g->pf_lines) __builtin_prefetch(g->pf + line * 64, 0, 3);
    }
}

#if KV_HAVE_AVX512F
INLINE void micro_avx512(const GemmIn *g, int64_t t0, int64_t p0, int mt, int np, float tile[MR][NP * PANEL]) {
    __m512 acc[MR][NP];
    for (int t = 0; t < mt; t++)
        for (int j = 0; j < np; j++) acc[t][j] = _mm512_setzero_ps();
    const float *w = g->packed + p0 * g->in * PANEL, *x = g->x + t0 * g->x_stride;
    const int64_t panel_floats = g->in * PANEL;
    for (int64_t k = 0; k < g->in; k++) {
        __m512 wv[NP];
        for (int j = 0; j < np; j++) wv[j] = _mm512_loadu_ps(w + j * panel_floats + k * PANEL);
        prefetch_k(g, k);
        for (int t = 0; t < mt; t++) {
            __m512 xv = _mm512_set1_ps(x[t * g->x_stride + k]);
            for (int j = 0; j < np; j++) acc[t][j] = _mm512_fmadd_ps(wv[j], xv, acc[t][j]);
        }
    }
    for (int t = 0; t < mt; t++)
        for (int j = 0; j < np; j++) _mm512_storeu_ps(tile[t] + j * PANEL, acc[t][j]);
}

/* Variants with the tile's shape constant, so the accumulators stay in registers. */
static void tile_avx512(const GemmIn *g, int64_t t0, int64_t p0, int mt, int np, float tile[MR][NP * PANEL]) {
#define CASE(M)                                                     \
    case M:                                                         \
        if (np == 3) micro_avx512(g, t0, p0, M, 3, tile);           \
        else if (np == 2) micro_avx512(g, t0, p0, M, 2, tile);      \
        else micro_avx512(g, t0, p0, M, 1, tile);                   \
        return;
    switch (mt) { CASE(8) CASE(7) CASE(6) CASE(5) CASE(4) CASE(3) CASE(2) CASE(1) }
#undef CASE
}
#endif

#if KV_HAVE_AVX2_FMA
/* One panel (two 8-lane vectors) x up to MR_AVX2 tokens: 12 accumulators of 16 registers. */
INLINE void micro_avx2(const GemmIn *g, int64_t t0, int64_t p, int mt, float tile[MR][NP * PANEL]) {
    __m256 lo[MR_AVX2], hi[MR_AVX2];
    for (int t = 0; t < mt; t++) lo[t] = hi[t] = _mm256_setzero_ps();
    const float *w = g->packed + p * g->in * PANEL, *x = g->x + t0 * g->x_stride;
    for (int64_t k = 0; k < g->in; k++) {
        __m256 w_lo = _mm256_loadu_ps(w + k * PANEL), w_hi = _mm256_loadu_ps(w + k * PANEL + 8);
        prefetch_k(g, k);
        for (int t = 0; t < mt; t++) {
            __m256 xv = _mm256_broadcast_ss(x + t * g->x_stride + k);
            lo[t] = _mm256_fmadd_ps(w_lo, xv, lo[t]);
            hi[t] = _mm256_fmadd_ps(w_hi, xv, hi[t]);
        }
    }
    for (int t = 0; t < mt; t++) {
        _mm256_storeu_ps(tile[t], lo[t]);
        _mm256_storeu_ps(tile[t] + 8, hi[t]);
    }
}

static void tile_avx2(const GemmIn *g, int64_t t0, int64_t p0, int mt, int np, float tile[MR][NP * PANEL]) {
    float part[MR][NP * PANEL];
    GemmIn rest = *g; /* the tile's prefetches go with its first call */
    rest.pf_lines = 0;
    for (int j = 0; j < np; j++) {
        for (int m0 = 0; m0 < mt; m0 += MR_AVX2) {
            int m = mt - m0 < MR_AVX2 ? mt - m0 : MR_AVX2;
            const GemmIn *gj = j == 0 && m0 == 0 ? g : &rest;
#define CASE(M) case M: micro_avx2(gj, t0 + m0, p0 + j, M, part); break;
            switch (m) { CASE(6) CASE(5) CASE(4) CASE(3) CASE(2) CASE(1) }
#undef CASE
            for (int t = 0; t < m; t++) memcpy(tile[m0 + t] + j * PANEL, part[t], sizeof(float) * PANEL);
        }
    }
}
#endif

static void tile_portable(const GemmIn *g, int64_t t0, int64_t p0, int mt, int np, float tile[MR][NP * PANEL]) {
    for (int t = 0; t < mt; t++) {
        const float *x = g->x + (t0 + t) * g->x_stride;
        for (int j = 0; j < np; j++) {
            const float *w = g->packed + (p0 + j) * g->in * PANEL;
            float *sums = tile[t] + j * PANEL;
            for (int lane = 0; lane < PANEL; lane++) sums[lane] = 0.0f;
            for (int64_t k = 0; k < g->in; k++)
                for (int lane = 0; lane < PANEL; lane++) sums[lane] += w[k * PANEL + lane] * x[k];
        }
    }
}

static void tile_sums(const GemmIn *g, int64_t t0, int64_t p0, int mt, int np, int isa, float tile[MR][NP * PANEL]) {
#if KV_HAVE_AVX512F
    if (isa == ISA_AVX512) { tile_avx512(g, t0, p0, mt, np, tile); return; }
#endif
#if KV_HAVE_AVX2_FMA
    if (isa == ISA_AVX2) { tile_avx2(g, t0, p0, mt, np, tile); return; }
#endif
    (void)isa;
    tile_portable(g, t0, p0, mt, np, tile);
}

/* Rows row_begin..row_end (row_begin a multiple of 16, row_end at most the weight's
 * rows) of y = x W^T (+ bias) for `batch` rows of x (x_stride floats apart), W packed
 * by kvserve_f32_pack; y rows y_stride floats apart. Runs on the calling thread only
 * (the fused decoder splits rows over its own threads). */
void kvserve_f32_gemm_rows(const float *x, int64_t x_stride, int64_t batch, const float *packed, const float *bias,
                           int64_t in, float *y, int64_t y_stride, int isa, int64_t row_begin, int64_t row_end) {
    if (batch <= 0) return; /* no rows (e.g. no logits wanted this step) */
    GemmIn g = {x, x_stride, in, packed, NULL, 0, 1};
    float tile[MR][NP * PANEL];
    const int64_t tiles = (batch + MR - 1) / MR;
    for (int64_t row = row_begin; row < row_end; row += NP * PANEL) {
        const int64_t rows = row_end - row < NP * PANEL ? row_end - row : NP * PANEL;
        const int np = (int)((rows + PANEL - 1) / PANEL);
        /* the next group's panels (in this range), one line per 16 floats of a panel */
        const int64_t next_rows = row_end - row - rows < NP * PANEL ? row_end - row - rows : NP * PANEL;
        const int64_t next_panels = (next_rows + PANEL - 1) / PANEL;
        int64_t pf_left = next_panels * in;
        g.pf = (const char *)(packed + (row / PANEL + np) * in * PANEL);
        g.pf_per_k = (int)((next_panels + tiles - 1) / tiles);
        for (int64_t t0 = 0; t0 < batch; t0 += MR) {
            const int mt = batch - t0 < MR ? (int)(batch - t0) : MR;
            g.pf_lines = pf_left < in * g.pf_per_k ? pf_left : in * g.pf_per_k;
            tile_sums(&g, t0, row / PANEL, mt, np, isa, tile);
            g.pf += g.pf_lines * 64;
            pf_left -= g.pf_lines;
            for (int t = 0; t < mt; t++) {
                float *dst = y + (t0 + t) * y_stride + row;
                for (int64_t r = 0; r < rows; r++) dst[r] = tile[t][r] + (bias ? bias[row + r] : 0.0f);
            }
        }
    }
}

/* y[b, o] = sum_i x[b, i] W[o, i] (+ bias[o]) for b < batch, o < out, W packed by
 * kvserve_f32_pack; the threads split whole panels. Returns 0, or -2 when `isa` is not
 * available (nothing written). */
int kvserve_f32_gemm(const float *x, int64_t x_stride, int64_t batch, const float *packed, const float *bias,
                     int64_t out, int64_t in, float *y, int64_t y_stride, int isa, int num_threads) {
    if (!kvserve_isa_available(KV_KERNEL_F32_GEMM, isa)) return -2;
    const int64_t panels = (out + PANEL - 1) / PANEL;
    if (batch * out * in < PARALLEL_MIN_MACS || panels < 2) num_threads = 1;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        const int64_t nthreads = omp_get_num_threads(), tid = omp_get_thread_num();
        int64_t begin = panels * tid / nthreads * PANEL, end = panels * (tid + 1) / nthreads * PANEL;
        if (end > out) end = out;
        if (begin < end) kvserve_f32_gemm_rows(x, x_stride, batch, packed, bias, in, y, y_stride, isa, begin, end);
    }
    return 0;
}
