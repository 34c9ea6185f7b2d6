/* Applies a grammar's packed allowed-token bitmask to float32 logits rows in place:
 * every token whose bit is 0 becomes -inf. The bitmask is the grammar engine's own
 * layout (int32 words, little-endian: token t is bit t % 32 of word t / 32), so it is
 * read as filled, with no unpacking into one byte per token first.
 *
 * Three paths, chosen by the caller (`isa`) among those this build and CPU have:
 * AVX-512 (a masked store of -inf per 16 tokens), AVX2 (a blend per 8 tokens)
 * and portable C. A word with every bit set is skipped, a word of zeros is
 * one plain store on every path.
 * Built with the other kernels by kvserve/model/cpu_kernels.py.
 */
#include <stdint.h>

enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

#if defined(__AVX512F__)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif
#if defined(__AVX2__)
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif
#if HAVE_AVX512 || HAVE_AVX2
#include <immintrin.h>
#endif

/* -inf as float32 bits: the library is built with -ffast-math, which may assume no
 * infinities in float arithmetic, so the value is stored as an integer pattern. */
#define NEG_INF_BITS 0xFF800000u

int kvserve_mask_isa_available(int isa) {
    if (isa == ISA_PORTABLE) return 1;
#if HAVE_AVX2
    if (isa == ISA_AVX2) return __builtin_cpu_supports("avx2");
#endif
#if HAVE_AVX512
    if (isa == ISA_AVX512) return __builtin_cpu_supports("avx512f");
#endif
    return 0;
}

static void fill_neg_inf(uint32_t *out, int64_t count) {
    for (int64_t i = 0; i < count; i++) out[i] = NEG_INF_BITS;
}

/* Tokens [first, end) of the row, bit by bit (the tail the vector paths leave). */
static void mask_bits(uint32_t *row, const uint32_t *words, int64_t first, int64_t end) {
    for (int64_t t = first; t < end; t++)
        if (!((words[t >> 5] >> (t & 31)) & 1u)) row[t] = NEG_INF_BITS;
}

static void mask_words_portable(uint32_t *row, const uint32_t *words, int64_t full_words) {
    for (int64_t w = 0; w < full_words; w++) {
        const uint32_t bits = words[w];
        if (bits == 0xFFFFFFFFu) continue;
        uint32_t *out = row + 32 * w;
        if (bits == 0) {
            fill_neg_inf(out, 32);
            continue;
        }
        for (int i = 0; i < 32; i++)
            if (!((bits >> i) & 1u)) out[i] = NEG_INF_BITS;
    }
}

#if HAVE_AVX2
/* A blend and a plain store: AVX2's masked store (vpmaskmovd) is microcoded and several
 * times slower on some CPUs (AMD Zen). */
__attribute__((target("avx2"))) static void mask_words_avx2(uint32_t *row, const uint32_t *words,
                                                             int64_t full_words) {
    const __m256i neg_inf = _mm256_set1_epi32((int)NEG_INF_BITS);
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (int64_t w = 0; w < full_words; w++) {
        const uint32_t bits = words[w];
        if (bits == 0xFFFFFFFFu) continue;
        __m256i *out = (__m256i *)(row + 32 * w);
        for (int part = 0; part < 4; part++) {
            const __m256i byte = _mm256_set1_epi32((int)((bits >> (8 * part)) & 0xFFu));
            /* all ones in the lanes whose bit is 0: those get -inf */
            const __m256i banned = _mm256_cmpeq_epi32(_mm256_and_si256(byte, lane_bit), _mm256_setzero_si256());
            const __m256i kept = _mm256_loadu_si256(out + part);
            _mm256_storeu_si256(out + part, _mm256_blendv_epi8(kept, neg_inf, banned));
        }
    }
}
#endif

#if HAVE_AVX512
__attribute__((target("avx512f"))) static void mask_words_avx512(uint32_t *row, const uint32_t *words,
                                                                  int64_t full_words) {
    const __m512i neg_inf = _mm512_set1_epi32((int)NEG_INF_BITS);
    for (int64_t w = 0; w < full_words; w++) {
        const uint32_t bits = words[w];
        if (bits == 0xFFFFFFFFu) continue;
        uint32_t *out = row + 32 * w;
        _mm512_mask_storeu_epi32(out, (__mmask16)~bits, neg_inf);
        _mm512_mask_storeu_epi32(out + 16, (__mmask16)~(bits >> 16), neg_inf);
    }
}
#endif

/* Masks the first `count` words of a row. */
static void mask_words(uint32_t *row, const uint32_t *words, int64_t count, int isa) {
#if HAVE_AVX512
    if (isa == ISA_AVX512) { mask_words_avx512(row, words, count); return; }
#endif
#if HAVE_AVX2
    if (isa == ISA_AVX2) { mask_words_avx2(row, words, count); return; }
#endif
    (void)isa;
    mask_words_portable(row, words, count);
}

/* Row r of `bitmask` (`num_words` int32 words, rows `bitmask_stride` words apart) masks
 * logits row `row_index[r]` (r when row_index is NULL); logits rows hold `width` floats,
 * `logits_stride` floats apart. Returns 0, or -1 when `isa` is not available here.
 *
 * It runs on the calling thread: a 49k-token row takes a few microseconds, while
 * waking a thread pool costs more than that, and far more when the pool's threads
 * have lost their cores to other processes. */
int kvserve_apply_token_bitmask(float *logits, int64_t logits_stride, int64_t width, const int32_t *bitmask,
                                int64_t bitmask_stride, int64_t num_words, const int64_t *row_index,
                                int64_t rows, int isa) {
    if (!kvserve_mask_isa_available(isa)) return -1;
    const int64_t covered = width < 32 * num_words ? width : 32 * num_words;
    const int64_t full_words = covered / 32;
    for (int64_t r = 0; r < rows; r++) {
        uint32_t *row = (uint32_t *)(logits + (row_index ? row_index[r] : r) * logits_stride);
        const uint32_t *words = (const uint32_t *)(bitmask + r * bitmask_stride);
        mask_words(row, words, full_words, isa);
        mask_bits(row, words, 32 * full_words, covered);
        fill_neg_inf(row + covered, width - covered); /* tokens the grammar's vocabulary lacks */
    }
    return 0;
}
