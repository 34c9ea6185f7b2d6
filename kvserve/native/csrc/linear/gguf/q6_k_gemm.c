/* Q6_K's many-row GEMM on AVX-512 VNNI (gemm.h), in the float order of its batch-one tile
 * (q6_k.c, sub_block_sums.h).
 *
 * Strip (GGUF_GEMM_ROWS rows): the values q - 32 [j][k][row][32] (int8), then per
 * super-block k: -128 sum(q - 32) of each 16-column half [row][half] (int32: the packed
 * activations are x + 128), the halves' int8 scales [row][half] (as int32) and d [row]. The
 * kernel (8 rows against one lane group, or 4 against two): for each position j, over the
 * super-blocks in order, each half's integer sum by vpdpbusd of 4 packed activation bytes
 * against 4 values broadcast, I_j = sc_a isum_a + sc_b isum_b, then A_j = fma(I_j, d dx, A_j). */
#include "gemm.h"
#include "gguf_type.h"
#include "kvserve.h"
#include "sub_block_sums.h"

#define COLS 256
#define BYTES 210

#if KV_HAVE_AVX512_VNNI
enum { R = GGUF_GEMM_ROWS, META = (2 * 16 + 1) * R * 4 /* bytes of super-block k's corrs, scales, d for a strip */ };

static int64_t panel_bytes_q6_k(int64_t blocks) { return blocks * (COLS + 16 * 8 + 4); }

/* The strip's corr of super-block k, 16-column half `at`, row 0 (row r: 64 r bytes on; its
 * scale R * 64 bytes on). */
static uint8_t *meta_q6_k(uint8_t *strip, int64_t blocks, int64_t k, int at) {
    return strip + blocks * COLS * R + k * META + 4 * at;
}
/* The strip's d [row] of super-block k. */
static uint8_t *d_q6_k(uint8_t *strip, int64_t blocks, int64_t k) { return meta_q6_k(strip, blocks, k, 0) + 128 * R; }

/* The 16 half corrs -128 sum(q - 32) = 128 (512 - sum(q)) of a super-block from sad[c], the
 * vpsadbw sums of its 64-column run c's values q (two 8-byte sums per 16 columns): dword
 * 4i + c first gathers run c's 16-column half i, then one permute puts half 4c + i in dword
 * 4c + i. Integer: exact in any order. */
static __m512i half_corrs(const __m512i sad[4]) {
    const __m512i p01 = _mm512_or_si512(sad[0], _mm512_slli_epi64(sad[1], 32));
    const __m512i p23 = _mm512_or_si512(sad[2], _mm512_slli_epi64(sad[3], 32));
    const __m512i s01 = _mm512_add_epi32(p01, _mm512_shuffle_epi32(p01, _MM_PERM_BADC));
    const __m512i s23 = _mm512_add_epi32(p23, _mm512_shuffle_epi32(p23, _MM_PERM_BADC));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i sums = _mm512_permutexvar_epi32(order, _mm512_unpacklo_epi64(s01, s23));
    return _mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(512), sums), 7);
}

static void unpack_q6_k(const uint8_t *row, int64_t in, uint8_t *strip, int r) {
    const int64_t blocks = in / COLS;
    const __m512i low4 = _mm512_set1_epi8(15), pair = _mm512_set1_epi8(0x30), offset = _mm512_set1_epi8(32);
    for (int64_t k = 0; k < blocks; k++) {
        const uint8_t *blk = row + k * BYTES;
        uint8_t *corr = meta_q6_k(strip, blocks, k, 0) + 64 * r;
        __m512i sad[4];
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            const __m512i high = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
            /* columns 128h..128h+63, then 128h+64..128h+127 */
            const __m512i six[2] = {
                _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_and_si512(_mm512_slli_epi16(high, 4), pair)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), _mm512_and_si512(high, pair))};
            for (int n = 0; n < 2; n++) {
                const int c = 2 * h + n; /* 32-column blocks 2c, 2c + 1; 16-column halves 4c..4c+3 */
                const __m512i values = _mm512_sub_epi8(six[n], offset);
                _mm256_storeu_si256((__m256i *)(gguf_gemm_strip_q(strip, blocks, 2 * c, k) + 32 * r),
                                    _mm512_castsi512_si256(values));
                _mm256_storeu_si256((__m256i *)(gguf_gemm_strip_q(strip, blocks, 2 * c + 1, k) + 32 * r),
                                    _mm512_extracti64x4_epi64(values, 1));
                sad[c] = _mm512_sad_epu8(six[n], _mm512_setzero_si512());
            }
        }
        _mm512_storeu_si512(corr, half_corrs(sad));
        _mm512_storeu_si512(corr + 64 * R, _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192))));
        const float d = gguf_f16(blk + 208);
        memcpy(d_q6_k(strip, blocks, k) + 4 * r, &d, 4);
    }
}

GGUF_FIXED_FLOAT_BEGIN
/* `rows` strip rows from row0 against `groups` lane groups from g, the whole row or (`chunked`) o's
 * chunk of it (constants where inlined: the whole-row kernels compile without the chunks). */
GGUF_INLINE void tile_q6_k(const uint8_t *strip, const int row0, const int rows, const int groups, const GgufGemmX *x,
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
            const uint8_t *const xs[2] = {gguf_gemm_x(x, g, j, k0 + k), groups > 1 ? gguf_gemm_x(x, g + 1, j, k0 + k) : NULL};
            const uint8_t *qs = gguf_gemm_strip_q(strip, K, j, k) + 32 * row0;
            __m512i total[2][R];
            for (int c = 0; c < groups; c++)
                for (int r = 0; r < rows; r++) total[c][r] = _mm512_setzero_si512();
            for (int half = 0; half < 2; half++) { /* 16 columns each, with their own scale */
                const int32_t *corr = (const int32_t *)meta_q6_k((uint8_t *)strip, K, k, 2 * j + half) + 16 * row0,
                              *scale = corr + 16 * R;
                __m512i sum[2][R];
                for (int c = 0; c < groups; c++)
                    for (int r = 0; r < rows; r++) sum[c][r] = _mm512_set1_epi32(corr[16 * r]);
                gguf_gemm_steps(sum, xs, qs, rows, groups, 4 * half, 4 * half + 4);
                for (int c = 0; c < groups; c++)
                    for (int r = 0; r < rows; r++) {
                        const __m512i scaled = _mm512_mullo_epi32(sum[c][r], _mm512_set1_epi32(scale[16 * r]));
                        total[c][r] = _mm512_add_epi32(total[c][r], scaled);
                    }
            }
            const float *d = (const float *)d_q6_k((uint8_t *)strip, K, k) + row0;
            for (int c = 0; c < groups; c++) {
                const __m512 dx = _mm512_loadu_ps(x->dx + gguf_gemm_scale_at(x, g + c, j, k0 + k));
                for (int r = 0; r < rows; r++)
                    a[c][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[c][r]), _mm512_mul_ps(_mm512_set1_ps(d[r]), dx),
                                              a[c][r]);
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

static void kernel_q6_k(const uint8_t *strip, const GgufGemmX *x, int64_t g, const GgufGemmOut *o) {
    tile_q6_k(strip, 0, R, 1, x, g, o, 0);
}
static void pair_q6_k(const uint8_t *strip, int half, const GgufGemmX *x, int64_t g, const GgufGemmOut o[2]) {
    tile_q6_k(strip, R / 2 * half, R / 2, 2, x, g, o, 0);
}
static void chunk_kernel_q6_k(const uint8_t *strip, const GgufGemmX *x, int64_t g, const GgufGemmOut *o) {
    tile_q6_k(strip, 0, R, 1, x, g, o, 1);
}
static void chunk_pair_q6_k(const uint8_t *strip, int half, const GgufGemmX *x, int64_t g, const GgufGemmOut o[2]) {
    tile_q6_k(strip, R / 2 * half, R / 2, 2, x, g, o, 1);
}
GGUF_FIXED_FLOAT_END

const GgufGemmType gguf_q6_k_gemm_avx512 = {14, ISA_AVX512, panel_bytes_q6_k, unpack_q6_k, kernel_q6_k, pair_q6_k,
                                           chunk_kernel_q6_k, chunk_pair_q6_k};
#else
const GgufGemmType gguf_q6_k_gemm_avx512 = {14, ISA_AVX512, NULL, NULL, NULL, NULL, NULL, NULL};
#endif
