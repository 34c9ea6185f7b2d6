/* Paged attention for CPU: each query token attends to its request's keys,
 * read in place from the block-paged KV cache (no gather into a contiguous
 * copy). Built and loaded at run time by kvserve/native/cpu_kernels.py.
 *
 * Layout (see kvserve/model/attention/metadata.py): K and V are each
 * [kv_heads, num_blocks, block_size, head_dim]; the key at position p of a
 * request lives in block block_table[p / block_size], slot p % block_size.
 * Every key a token reads (positions lo..pos) must already be in the cache.
 * The cache holds float32, bfloat16 or float16 (kv_dtype); the math is float32.
 *
 * One work item is (query token, KV head): the query heads that share the KV
 * head (GQA) are handled together, so each K/V row is read once per item.
 * Scores are kept exactly (two passes: scores, then softmax and the weighted
 * sum of V). Three paths, picked per call (`isa`, capped by KVSERVE_QUANT_ISA):
 * AVX-512 (16 keys' dot products reduced together, a vector exp, the output
 * rows held in registers), AVX2 + F16C, and portable C.
 *
 * Attention sinks (gpt-oss): a learned logit per query head joins each softmax's
 * denominator (its own probability dropped): out = sum_j e^(s_j - M) v_j / (sum_j
 * e^(s_j - M) + e^(sink - M)), M the largest of the scores and the sink. The sink is
 * neither scaled nor soft-capped (torch_backend.py's _attend).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kvserve.h"
#include "vec_exp.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 32
/* Below this much K/V to read one thread does the step: starting a parallel region
 * costs tens of microseconds on a virtual machine, about what a core reads 256 KiB in. */
#define PARALLEL_MIN_BYTES (256 * 1024)
#define KEY_CHUNK 16 /* keys whose scores the AVX-512 path reduces together */

static inline void load_row(const void *base, int64_t offset, int dtype, int64_t dim, float *dst) {
    if (dtype == F32) {
        memcpy(dst, (const float *)base + offset, (size_t)dim * sizeof(float));
    } else {
        for (int64_t i = 0; i < dim; i++) dst[i] = stored_value(base, offset + i, dtype);
    }
}

static inline void store_row(void *base, int64_t offset, int dtype, int64_t dim, const float *src) {
    if (dtype == F32) {
        memcpy((float *)base + offset, src, (size_t)dim * sizeof(float));
    } else {
        for (int64_t i = 0; i < dim; i++) store_value(base, offset + i, dtype, src[i]);
    }
}

typedef struct {
    const void *q;
    int64_t q_token_stride, q_head_stride;
    const void *k_cache, *v_cache;
    int64_t cache_head_stride; /* elements between KV heads (num_blocks * block_size * head_dim) */
    void *out;
    int64_t out_token_stride, out_head_stride;
    const int64_t *token_index; /* [n] row of q/out */
    const int64_t *positions;   /* [n] position of the token; it reads keys lo..pos */
    const int64_t *block_table; /* [rows, block_table_stride] */
    int64_t block_table_stride;
    const int64_t *table_row;   /* [n] block-table row of the token's request */
    int64_t num_heads, num_kv_heads, head_dim, block_size, window;
    float scale, softcap;
    const float *sinks; /* [num_heads] or NULL: no sinks */
    int q_dtype, kv_dtype, isa;
} Args;

/* One item's keys: the cache offset of each key's row, and the query heads' scores [group][num_keys]. */
typedef struct {
    const int64_t *offsets;
    int64_t num_keys, group;
    float *scores;
} Keys;

/* ---------------------------------------------------------------- portable */

static void scores_portable(const Args *a, const float (*qf)[MAX_HEAD_DIM], const Keys *k, int64_t dim) {
    float row[MAX_HEAD_DIM];
    for (int64_t j = 0; j < k->num_keys; j++) {
        load_row(a->k_cache, k->offsets[j], a->kv_dtype, dim, row);
        for (int64_t g = 0; g < k->group; g++) {
            float s = 0.f;
            for (int64_t i = 0; i < dim; i++) s += qf[g][i] * row[i];
            k->scores[g * k->num_keys + j] = s;
        }
    }
}

/* scores -> exp(score - max) in place; returns 1 / their sum, with a `sink` (NULL: none) also
 * exp(*sink - max) in the sum and the max taken over the scores and the sink. (No sink is no
 * term at all, not exp(-inf): the kernels build with -ffast-math, which assumes no infinities.) */
static float softmax_portable(float *s, int64_t n, const float *sink) {
    float m = sink ? *sink : -INFINITY, sum = 0.f;
    for (int64_t j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
    for (int64_t j = 0; j < n; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    return 1.f / (sink ? sum + expf(*sink - m) : sum);
}

static void values_portable(const Args *a, const Keys *k, const float *inv_sum, int64_t dim,
                            float (*acc)[MAX_HEAD_DIM]) {
    float row[MAX_HEAD_DIM];
    for (int64_t g = 0; g < k->group; g++)
        for (int64_t i = 0; i < dim; i++) acc[g][i] = 0.f;
    for (int64_t j = 0; j < k->num_keys; j++) {
        load_row(a->v_cache, k->offsets[j], a->kv_dtype, dim, row);
        for (int64_t g = 0; g < k->group; g++) {
            const float w = k->scores[g * k->num_keys + j];
            for (int64_t i = 0; i < dim; i++) acc[g][i] += w * row[i];
        }
    }
    for (int64_t g = 0; g < k->group; g++)
        for (int64_t i = 0; i < dim; i++) acc[g][i] *= inv_sum[g];
}

/* ---------------------------------------------------------------- AVX2 + F16C */

#if KV_HAVE_AVX2_FMA_F16C

static inline __m256 load8(const void *base, int64_t offset, int dtype) {
    if (dtype == F32) return _mm256_loadu_ps((const float *)base + offset);
    __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + offset));
    if (dtype == F16) return _mm256_cvtph_ps(half);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __attribute__((always_inline)) void scores_avx2(const Args *a, const float (*qf)[MAX_HEAD_DIM],
                                                               const Keys *k, const int64_t dim) {
    for (int64_t j = 0; j < k->num_keys; j++) {
        const int64_t offset = k->offsets[j];
        for (int64_t g = 0; g < k->group; g++) {
            __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(qf[g]), load8(a->k_cache, offset, a->kv_dtype));
            for (int64_t i = 8; i < dim; i += 8)
                sum = _mm256_fmadd_ps(_mm256_loadu_ps(qf[g] + i), load8(a->k_cache, offset + i, a->kv_dtype), sum);
            k->scores[g * k->num_keys + j] = hsum8(sum);
        }
    }
}

static inline __attribute__((always_inline)) void values_avx2(const Args *a, const Keys *k, const float *inv_sum,
                                                               const int64_t dim, float (*acc)[MAX_HEAD_DIM]) {
    for (int64_t g = 0; g < k->group; g++)
        for (int64_t i = 0; i < dim; i += 8) _mm256_storeu_ps(acc[g] + i, _mm256_setzero_ps());
    for (int64_t j = 0; j < k->num_keys; j++) {
        const int64_t offset = k->offsets[j];
        for (int64_t i = 0; i < dim; i += 8) {
            const __m256 v = load8(a->v_cache, offset + i, a->kv_dtype);
            for (int64_t g = 0; g < k->group; g++)
                _mm256_storeu_ps(acc[g] + i, _mm256_fmadd_ps(_mm256_set1_ps(k->scores[g * k->num_keys + j]), v,
                                                             _mm256_loadu_ps(acc[g] + i)));
        }
    }
    for (int64_t g = 0; g < k->group; g++)
        for (int64_t i = 0; i < dim; i += 8)
            _mm256_storeu_ps(acc[g] + i, _mm256_mul_ps(_mm256_loadu_ps(acc[g] + i), _mm256_set1_ps(inv_sum[g])));
}
#endif

/* ---------------------------------------------------------------- AVX-512 */

#if KV_HAVE_AVX512F
#define VEC 16

static inline __m512 load16(const void *base, int64_t offset, int dtype) {
    if (dtype == F32) return _mm512_loadu_ps((const float *)base + offset);
    __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset));
    if (dtype == F16) return _mm512_cvtph_ps(half);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* p[0..15] -> one vector whose element j is the sum of p[j]'s elements (a transpose-and-add
 * tree: 45 shuffles and adds for 16 sums, against ~8 dependent ones for each alone). */
static inline __m512 sum16(const __m512 *p) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++) {
        const __m512 x = p[2 * i], y = p[2 * i + 1];
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* quads[i], 128-bit lane L: lane L's partial sums of keys 4i..4i+3 */
    const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __mmask16 tail_mask(int64_t count) {
    return count >= VEC ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u);
}

/* The next chunk's K or V rows are elsewhere in memory: fetch them while this one is used. */
static inline void prefetch_rows(const void *base, const int64_t *offsets, int64_t count, int64_t row_bytes,
                                 int64_t elem) {
    for (int64_t j = 0; j < count; j++) {
        const char *row = (const char *)base + offsets[j] * elem;
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b);
    }
}

static inline __attribute__((always_inline)) void scores_avx512(const Args *a, const float (*qf)[MAX_HEAD_DIM],
                                                                 const Keys *k, const int64_t dim) {
    const int64_t elem = a->kv_dtype == F32 ? 4 : 2;
    for (int64_t j0 = 0; j0 < k->num_keys; j0 += KEY_CHUNK) {
        const int64_t count = k->num_keys - j0 < KEY_CHUNK ? k->num_keys - j0 : KEY_CHUNK;
        const int64_t *offsets = k->offsets + j0;
        if (j0 + KEY_CHUNK < k->num_keys) {
            const int64_t next = k->num_keys - j0 - KEY_CHUNK;
            prefetch_rows(a->k_cache, offsets + KEY_CHUNK, next < KEY_CHUNK ? next : KEY_CHUNK, dim * elem, elem);
        }
        for (int64_t g = 0; g < k->group; g++) {
            __m512 partial[KEY_CHUNK];
            for (int64_t j = 0; j < KEY_CHUNK; j++) {
                if (j >= count) {
                    partial[j] = _mm512_setzero_ps();
                    continue;
                }
                __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qf[g]), load16(a->k_cache, offsets[j], a->kv_dtype));
                for (int64_t i = VEC; i < dim; i += VEC)
                    sum = _mm512_fmadd_ps(_mm512_loadu_ps(qf[g] + i), load16(a->k_cache, offsets[j] + i, a->kv_dtype),
                                          sum);
                partial[j] = sum;
            }
            _mm512_mask_storeu_ps(k->scores + g * k->num_keys + j0, tail_mask(count), sum16(partial));
        }
    }
}

static float softmax_avx512(float *s, int64_t n, const float *sink) {
    __m512 m = _mm512_set1_ps(sink ? *sink : -INFINITY);
    for (int64_t j = 0; j < n; j += VEC)
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(n - j), s + j));
    const float top = _mm512_reduce_max_ps(m);
    const __m512 max = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += VEC) {
        const __mmask16 mask = tail_mask(n - j);
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j), max));
        _mm512_mask_storeu_ps(s + j, mask, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
    }
    const float total = _mm512_reduce_add_ps(sum);
    return 1.f / (sink ? total + expf(*sink - top) : total);
}

/* Query heads [g0, g0 + SUB) (those below k->group) of the item, their output rows held in
 * registers while every V row streams by once. */
#define VALUE_SUB(dim) ((dim) <= 64 ? 4 : (dim) <= 128 ? 2 : 1)
static inline __attribute__((always_inline)) void values_sub_avx512(const Args *a, const Keys *k,
                                                                     const float *inv_sum, const int64_t dim,
                                                                     int64_t g0, float (*acc_out)[MAX_HEAD_DIM]) {
    enum { MAX_CHUNKS = MAX_HEAD_DIM / VEC };
    const int64_t sub = VALUE_SUB(dim), chunks = dim / VEC;
    const int64_t elem = a->kv_dtype == F32 ? 4 : 2;
    __m512 acc[4][MAX_CHUNKS];
    for (int64_t g = 0; g < sub; g++)
        for (int64_t c = 0; c < chunks; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k->num_keys; j++) {
        if (j % KEY_CHUNK == 0 && j + KEY_CHUNK < k->num_keys) {
            const int64_t next = k->num_keys - j - KEY_CHUNK;
            prefetch_rows(a->v_cache, k->offsets + j + KEY_CHUNK, next < KEY_CHUNK ? next : KEY_CHUNK, dim * elem,
                          elem);
        }
        __m512 v[MAX_CHUNKS];
        for (int64_t c = 0; c < chunks; c++) v[c] = load16(a->v_cache, k->offsets[j] + c * VEC, a->kv_dtype);
        for (int64_t g = 0; g < sub; g++) {
            if (g0 + g >= k->group) break;
            const __m512 w = _mm512_set1_ps(k->scores[(g0 + g) * k->num_keys + j]);
            for (int64_t c = 0; c < chunks; c++) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
        }
    }
    for (int64_t g = 0; g < sub && g0 + g < k->group; g++)
        for (int64_t c = 0; c < chunks; c++)
            _mm512_storeu_ps(acc_out[g0 + g] + c * VEC, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv_sum[g0 + g])));
}

static inline __attribute__((always_inline)) void values_avx512(const Args *a, const Keys *k, const float *inv_sum,
                                                                 const int64_t dim, float (*acc)[MAX_HEAD_DIM]) {
    for (int64_t g0 = 0; g0 < k->group; g0 += VALUE_SUB(dim)) values_sub_avx512(a, k, inv_sum, dim, g0, acc);
}
#endif

/* ---------------------------------------------------------------- one item */

/* The offsets of the keys lo..pos of one KV head, block by block. */
static void key_offsets(const Args *a, const int64_t *table, int64_t lo, int64_t pos, int64_t head_base,
                        int64_t *offsets) {
    const int64_t bs = a->block_size, dim = a->head_dim;
    int64_t j = 0;
    for (int64_t blk = lo / bs; blk <= pos / bs; blk++) {
        const int64_t first = blk * bs > lo ? blk * bs : lo, last = blk * bs + bs - 1 < pos ? blk * bs + bs - 1 : pos;
        const int64_t base = head_base + (table[blk] * bs + first - blk * bs) * dim;
        for (int64_t p = first; p <= last; p++) offsets[j++] = base + (p - first) * dim;
    }
}

/* The item's path: the vector ones need whole vectors of head_dim. */
static int item_path(const Args *a) {
    if (a->isa >= ISA_AVX512 && KV_HAVE_AVX512F && a->head_dim % 16 == 0) return ISA_AVX512;
    if (a->isa >= ISA_AVX2 && KV_HAVE_AVX2_FMA_F16C && a->head_dim % 8 == 0) return ISA_AVX2;
    return ISA_PORTABLE;
}

/* always_inline: the dispatch below calls it with a constant head_dim so the
 * inner loops get fixed trip counts. */
static inline __attribute__((always_inline)) void attend_item(const Args *a, int64_t item, const int64_t dim,
                                                             float *scores, int64_t *offsets) {
    const int64_t token = item / a->num_kv_heads, kv_head = item % a->num_kv_heads;
    const int64_t group = a->num_heads / a->num_kv_heads;
    const int64_t pos = a->positions[token];
    const int64_t lo = (a->window > 0 && pos - a->window + 1 > 0) ? pos - a->window + 1 : 0;
    const int64_t q_row = a->token_index[token];
    const int path = item_path(a);
    float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], inv_sum[MAX_GROUP];

    for (int64_t g = 0; g < group; g++) {
        const int64_t head = kv_head * group + g;
        load_row(a->q, q_row * a->q_token_stride + head * a->q_head_stride, a->q_dtype, dim, qf[g]);
        for (int64_t i = 0; i < dim; i++) qf[g][i] *= a->scale;
    }
    key_offsets(a, a->block_table + a->table_row[token] * a->block_table_stride, lo, pos,
                kv_head * a->cache_head_stride, offsets);
    const Keys keys = {offsets, pos - lo + 1, group, scores};
    const float(*q)[MAX_HEAD_DIM] = (const float(*)[MAX_HEAD_DIM])qf;
#if KV_HAVE_AVX512F
    if (path == ISA_AVX512) scores_avx512(a, q, &keys, dim);
#endif
#if KV_HAVE_AVX2_FMA_F16C
    if (path == ISA_AVX2) scores_avx2(a, q, &keys, dim);
#endif
    if (path == ISA_PORTABLE) scores_portable(a, q, &keys, dim);
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * keys.num_keys;
        const float *sink = a->sinks ? a->sinks + kv_head * group + g : NULL;
        if (a->softcap > 0.f)
            for (int64_t j = 0; j < keys.num_keys; j++) s[j] = tanhf(s[j] / a->softcap) * a->softcap;
#if KV_HAVE_AVX512F
        if (path == ISA_AVX512) {
            inv_sum[g] = softmax_avx512(s, keys.num_keys, sink);
            continue;
        }
#endif
        inv_sum[g] = softmax_portable(s, keys.num_keys, sink);
    }
#if KV_HAVE_AVX512F
    if (path == ISA_AVX512) values_avx512(a, &keys, inv_sum, dim, acc);
#endif
#if KV_HAVE_AVX2_FMA_F16C
    if (path == ISA_AVX2) values_avx2(a, &keys, inv_sum, dim, acc);
#endif
    if (path == ISA_PORTABLE) values_portable(a, &keys, inv_sum, dim, acc);
    for (int64_t g = 0; g < group; g++)
        store_row(a->out, q_row * a->out_token_stride + (kv_head * group + g) * a->out_head_stride, a->q_dtype, dim,
                  acc[g]);
}

static void attend_range(const Args *a, int64_t item, float *scores, int64_t *offsets) {
    switch (a->head_dim) {
    case 64: attend_item(a, item, 64, scores, offsets); break;
    case 128: attend_item(a, item, 128, scores, offsets); break;
    default: attend_item(a, item, a->head_dim, scores, offsets); break;
    }
}

/* Returns 0 on success, a positive code for arguments the kernel cannot take. `sinks`:
 * float32 [num_heads], a logit per query head joining its softmax (NULL: none). */
int kvserve_paged_attention(const void *q, int64_t q_token_stride, int64_t q_head_stride,
                            const void *k_cache, const void *v_cache, int64_t cache_head_stride,
                            void *out, int64_t out_token_stride, int64_t out_head_stride,
                            const int64_t *token_index, const int64_t *positions,
                            const int64_t *block_table, int64_t block_table_stride, const int64_t *table_row,
                            int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t window, float scale, float softcap, const float *sinks,
                            int q_dtype, int kv_dtype, int isa, int num_threads) {
    if (head_dim > MAX_HEAD_DIM || num_kv_heads <= 0 || num_heads % num_kv_heads != 0
        || num_heads / num_kv_heads > MAX_GROUP)
        return 1;
    if (!kvserve_isa_available(KV_KERNEL_ATTENTION, isa)) return 3;
    Args a = {q, q_token_stride, q_head_stride, k_cache, v_cache, cache_head_stride, out, out_token_stride,
              out_head_stride, token_index, positions, block_table, block_table_stride, table_row,
              num_heads, num_kv_heads, head_dim, block_size, window, scale, softcap, sinks, q_dtype, kv_dtype, isa};
    int64_t max_keys = 0, total_keys = 0;
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t keys = positions[t] + 1;
        if (window > 0 && keys > window) keys = window;
        if (keys > max_keys) max_keys = keys;
        total_keys += keys;
    }
    const int64_t group = num_heads / num_kv_heads, num_items = num_tokens * num_kv_heads;
    const int64_t kv_bytes = total_keys * num_kv_heads * head_dim * 2 * (kv_dtype == F32 ? 4 : 2);
    if (kv_bytes < PARALLEL_MIN_BYTES) num_threads = 1;
    /* scores padded to whole vectors: the AVX-512 path stores 16 at a time under a mask */
    const int64_t scores_len = (max_keys * group + KEY_CHUNK + 1) & ~(int64_t)1; /* the offsets after it aligned */
    const size_t buffer_bytes = (size_t)scores_len * sizeof(float) + (size_t)max_keys * sizeof(int64_t);
    if (num_threads <= 1) { /* no parallel region: the native decoder calls from inside its own */
        float *scores = malloc(buffer_bytes);
        if (!scores) return 2;
        for (int64_t item = 0; item < num_items; item++)
            attend_range(&a, item, scores, (int64_t *)(scores + scores_len));
        free(scores);
        return 0;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(buffer_bytes);
        if (!scores) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; item++)
            if (scores) attend_range(&a, item, scores, (int64_t *)(scores + scores_len));
        free(scores);
    }
    return failed;
}

/* Writes this step's K and V rows into the cache: token t's head h goes to row
 * slots[t] of head h (K into k_cache, V into v_cache, each [kv_heads, rows, dim]).
 * k/v rows are strided ([tokens, heads, dim] views of the QKV projection); tokens
 * lists which of them to write (NULL: all, in order). */
void kvserve_store_kv(const void *k, const void *v, int64_t token_stride, int64_t head_stride, void *k_cache,
                      void *v_cache, int64_t cache_head_stride, const int64_t *slots, const int64_t *tokens,
                      int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int in_dtype, int cache_dtype) {
    float row[MAX_HEAD_DIM];
    for (int64_t i = 0; i < num_tokens; i++) {
        const int64_t t = tokens ? tokens[i] : i;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t src = t * token_stride + h * head_stride;
            const int64_t dst = h * cache_head_stride + slots[i] * head_dim;
            load_row(k, src, in_dtype, head_dim, row);
            store_row(k_cache, dst, cache_dtype, head_dim, row);
            load_row(v, src, in_dtype, head_dim, row);
            store_row(v_cache, dst, cache_dtype, head_dim, row);
        }
    }
}
