/* Q4_K's many-row GEMM on AVX-512 VNNI (gemm.h), in the float order of its batch-one tile
 * (q4_k.c, sub_block_sums.h).
 *
 * Strip (GGUF_GEMM_ROWS rows): the quants q [j][k][row][32] (0..15, as int8), then per
 * super-block k: -128 sum(q) [row][j] (int32: the packed activations are x + 128), d sc_j
 * [row][j] and dmin m_j [row][j] (float32, rounded as the tile rounds them). The kernel (8
 * rows against one lane group, or 4 against two): for each sub-block position j, over the
 * super-blocks in order, each lane's integer sum by vpdpbusd of 4 packed activation bytes
 * against 4 quants broadcast, then A_j = fma(I, (d sc_j) dx, A_j), A_j -= (dmin m_j) sx. */
#include "gemm.h"
#include "gguf_type.h"
#include "kvserve.h"
#include "sub_block_sums.h"

#define COLS 256
#define BYTES 144

#if KV_HAVE_AVX512_VNNI
enum { R = GGUF_GEMM_ROWS, META = 3 * R * 8 * 4 /* bytes of super-block k's corr, scale, low for a strip */ };

static int64_t panel_bytes_q4_k(int64_t blocks) { return blocks * (COLS + 8 * 12); }

/* The strip's corr of super-block k, sub-block j, row 0 (row r: 32 r bytes on; its scale and
 * low: R * 32 and 2 R * 32 bytes on). */
static uint8_t *meta_q4_k(uint8_t *strip, int64_t blocks, int64_t k, int j) {
    return strip + blocks * COLS * R + k * META + 4 * j;
}

static void unpack_q4_k(const uint8_t *row, int64_t in, uint8_t *strip, int r) {
    const int64_t blocks = in / COLS;
    const __m512i low4 = _mm512_set1_epi8(15), ones = _mm512_set1_epi8(1);
    /* gguf_sub_block_sums of (sub-blocks 0, 2), (1, 3), (4, 6), (5, 7): j order */
    const __m512i order = _mm512_setr_epi32(0, 8, 4, 12, 1, 9, 5, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int64_t k = 0; k < blocks; k++) {
        const uint8_t *blk = row + k * BYTES;
        __m512i halves[4];
        for (int h = 0; h < 2; h++) {
            const __m512i bytes = _mm512_loadu_si512(blk + 16 + 64 * h);
            /* low nibbles: sub-blocks 4h, 4h + 2; high: 4h + 1, 4h + 3 (32 bytes each) */
            halves[2 * h] = _mm512_and_si512(bytes, low4);
            halves[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
        }
        __m512i counts[4];
        for (int c = 0; c < 4; c++) {
            const int j = 4 * (c / 2) + c % 2;
            _mm256_storeu_si256((__m256i *)(gguf_gemm_strip_q(strip, blocks, j, k) + 32 * r),
                                _mm512_castsi512_si256(halves[c]));
            _mm256_storeu_si256((__m256i *)(gguf_gemm_strip_q(strip, blocks, j + 2, k) + 32 * r),
                                _mm512_extracti64x4_epi64(halves[c], 1));
            counts[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), halves[c], ones);
        }
        uint8_t *meta = meta_q4_k(strip, blocks, k, 0) + 32 * r;
        _mm256_storeu_si256((__m256i *)meta, _mm256_mullo_epi32(gguf_sub_block_sums(counts, order), _mm256_set1_epi32(-128)));
        uint64_t scale_word, min_word;
        gguf_k_scale_words(blk + 4, &scale_word, &min_word);
        /* rounded as the tile rounds them: one product each */
        _mm256_storeu_ps((float *)(meta + 32 * R), _mm256_mul_ps(_mm256_set1_ps(gguf_f16(blk)),
                                              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)scale_word)))));
        _mm256_storeu_ps((float *)(meta + 64 * R), _mm256_mul_ps(_mm256_set1_ps(gguf_f16(blk + 2)),
                                            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)min_word)))));
    }
}

GGUF_FIXED_FLOAT_BEGIN
/* `rows` strip rows from row0 against `groups` lane groups from g, the whole row or (`chunked`) o's
 * chunk of it (constants where inlined: the whole-row kernels compile without the chunks). */
GGUF_INLINE void tile_q4_k(const uint8_t *strip, const int row0, const int rows, const int groups, const GgufGemmX *x,
                           int64_t g, const GgufGemmOut *o, const int chunked) {
    /* the strip's super-blocks, the first one's in the row */
    const int64_t K = chunked ? o->blocks : x->blocks, k0 = chunked ? o->k0 : 0;
    __m512 local[2][R][8];
    __m512(*acc[2])[8] = {chunked ? gguf_gemm_acc(o, local[0]) : local[0],
                           chunked && groups > 1 ? gguf_gemm_acc(o + 1, local[1]) : local[1]};
    for (int j = 0; j < 8; j++) {
        __m512 a[2][R];
        for (int c = 0; c < groups; c++)
            for (int r = 0; r < rows; r++) a[c][r] = chunked ? gguf_gemm_acc_start(o + c, acc[c], r, j) : _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k++) {
            gguf_gemm_prefetch(o, j * K + k);
            const uint8_t *meta = meta_q4_k((uint8_t *)strip, K, k, j) + 32 * row0;
            const int32_t *corr = (const int32_t *)meta;
            const float *scale = (const float *)(meta + 32 * R), *low = (const float *)(meta + 64 * R);
            __m512i sum[2][R];
            for (int c = 0; c < groups; c++)
                for (int r = 0; r < rows; r++) sum[c][r] = _mm512_set1_epi32(corr[8 * r]);
            const uint8_t *const xs[2] = {gguf_gemm_x(x, g, j, k0 + k), groups > 1 ? gguf_gemm_x(x, g + 1, j, k0 + k) : NULL};
            gguf_gemm_steps(sum, xs, gguf_gemm_strip_q(strip, K, j, k) + 32 * row0, rows, groups, 0, 8);
            for (int c = 0; c < groups; c++) {
                const int64_t at = gguf_gemm_scale_at(x, g + c, j, k0 + k);
                const __m512 dx = _mm512_loadu_ps(x->dx + at), sx = _mm512_loadu_ps(x->sx + at);
                for (int r = 0; r < rows; r++) {
                    const __m512 s = _mm512_mul_ps(_mm512_set1_ps(scale[8 * r]), dx);
                    a[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[c][r]), s, a[c][r]);
                    a[c][r] = _mm512_fnmadd_ps(_mm512_set1_ps(low[8 * r]), sx, a[c][r]);
                }
            }
        }
        for (int c = 0; c < groups; c++)
            for (int r = 0; r < rows; r++) acc[c][r][j] = a[c][r];
    }
    for (int c = 0; c < groups; c++)
        if (chunked)
            gguf_gemm_finish(o + c, x->blocks, (const __m512(*)[8])acc[c]);
        else
            gguf_gemm_store(o + c, (const __m512(*)[8])acc[c]);
}

static void kernel_q4_k(const uint8_t *strip, const GgufGemmX *x, int64_t g, const GgufGemmOut *o) {
    tile_q4_k(strip, 0, R, 1, x, g, o, 0);
}
static void pair_q4_k(const uint8_t *strip, int half, const GgufGemmX *x, int64_t g, const GgufGemmOut o[2]) {
    tile_q4_k(strip, R / 2 * half, R / 2, 2, x, g, o, 0);
}
static void chunk_kernel_q4_k(const uint8_t *strip, const GgufGemmX *x, int64_t g, const GgufGemmOut *o) {
    tile_q4_k(strip, 0, R, 1, x, g, o, 1);
}
static void chunk_pair_q4_k(const uint8_t *strip, int half, const GgufGemmX *x, int64_t g, const GgufGemmOut o[2]) {
    tile_q4_k(strip, R / 2 * half, R / 2, 2, x, g, o, 1);
}
GGUF_FIXED_FLOAT_END

const GgufGemmType gguf_q4_k_gemm_avx512 = {12, ISA_AVX512, panel_bytes_q4_k, unpack_q4_k, kernel_q4_k, pair_q4_k,
                                           chunk_kernel_q4_k, chunk_pair_q4_k};
#else
const GgufGemmType gguf_q4_k_gemm_avx512 = {12, ISA_AVX512, NULL, NULL, NULL, NULL, NULL, NULL};
#endif
