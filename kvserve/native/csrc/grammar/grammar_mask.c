/* Applies a grammar's packed allowed-token bitmask to float32 logits rows in place:
 * every token whose bit is 0 becomes -inf. The bitmask is the grammar engine's own
 * layout (int32 words, little-endian: token t is bit t % 32 of word t / 32), so it is
 * read as filled, with no unpacking into one byte per token first.
 *
 * Three paths, chosen by the caller (`isa`) among those this build and CPU have:
 * AVX-512 (a masked store of -inf per 16 tokens), AVX2 (a blend per 8 tokens)
 * and portable C. A word with every bit set is skipped, a word of zeros is
 * one plain store on every path.
 *
 * The LM head inside the native decoder (fused_decoder.c) masks its own rows with
 * `kvserve_mask_token_range` while they are still in its cache, from a bitmask that
 * another thread fills while the layers run: that thread publishes it through a ready
 * flag (`kvserve_publish_mask_ready`), which the head waits for (`kvserve_wait_mask_ready`).
 * Built with the other kernels by kvserve/native/build.py.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, sched_yield under -std=c11 */
#include <sched.h>
#include <stdint.h>
#include <time.h>

#include "kvserve.h"

/* -inf as float32 bits: the library is built with -ffast-math, which may assume no
 * infinities in float arithmetic, so the value is stored as an integer pattern. */
#define NEG_INF_BITS 0xFF800000u

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

#if KV_HAVE_AVX2
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

#if KV_HAVE_AVX512F
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
#if KV_HAVE_AVX512F
    if (isa == ISA_AVX512) { mask_words_avx512(row, words, count); return; }
#endif
#if KV_HAVE_AVX2
    if (isa == ISA_AVX2) { mask_words_avx2(row, words, count); return; }
#endif
    (void)isa;
    mask_words_portable(row, words, count);
}

/* Tokens [begin, end) of one logits row (begin a multiple of 32) under the bitmask row
 * `words` of `num_words` words; tokens past the bitmask's vocabulary become -inf too. */
void kvserve_mask_token_range(float *logits_row, const int32_t *words, int64_t num_words, int64_t begin, int64_t end,
                              int isa) {
    uint32_t *row = (uint32_t *)logits_row;
    const uint32_t *bits = (const uint32_t *)words;
    const int64_t covered = end < 32 * num_words ? end : 32 * num_words;
    if (covered > begin) {
        const int64_t full_end = begin + (covered - begin) / 32 * 32;
        mask_words(row + begin, bits + begin / 32, (full_end - begin) / 32, isa);
        mask_bits(row, bits, full_end, covered);
    }
    const int64_t past = covered > begin ? covered : begin;
    fill_neg_inf(row + past, end - past);
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
    if (!kvserve_isa_available(KV_KERNEL_MASK, isa)) return -1;
    for (int64_t r = 0; r < rows; r++)
        kvserve_mask_token_range(logits + (row_index ? row_index[r] : r) * logits_stride, bitmask + r * bitmask_stride,
                                 num_words, 0, width, isa);
    return 0;
}

/* The filling thread's last write: `value` (the step's number when the bitmask is filled,
 * its negation when there is none) becomes visible only after every word of the bitmask
 * it wrote before. */
void kvserve_publish_mask_ready(int32_t *ready, int32_t value) { __atomic_store_n(ready, value, __ATOMIC_RELEASE); }

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Waits, at most `timeout_ns`, until `*ready` is `value` (returns 1: filled) or `-value`
 * (returns -1: no mask); returns 0 after the timeout. Adds the time waited to `*waited_ns`.
 * A step's own number, not a plain flag: the late fill of an earlier step (one whose step
 * failed) can never pass for this one's. Spins briefly, then yields its core: on a machine
 * with as many busy threads as cores the filling thread needs one to finish. */
int32_t kvserve_wait_mask_ready(const int32_t *ready, int32_t value, int64_t timeout_ns, int64_t *waited_ns) {
    int32_t seen = __atomic_load_n(ready, __ATOMIC_ACQUIRE);
    if (seen == value || seen == -value) return seen == value ? 1 : -1;
    const int64_t started = now_ns();
    int32_t result = 0;
    for (int64_t spins = 0;; spins++) {
        seen = __atomic_load_n(ready, __ATOMIC_ACQUIRE);
        if (seen == value || seen == -value) {
            result = seen == value ? 1 : -1;
            break;
        }
        if (spins < 256) {
#if KV_HAVE_AVX2 || KV_HAVE_AVX512F
            _mm_pause();
#endif
            continue;
        }
        if ((spins & 63) == 0 && now_ns() - started > timeout_ns) break;
        sched_yield();
    }
    *waited_ns += now_ns() - started;
    return result;
}
