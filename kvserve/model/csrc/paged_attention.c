/* Paged attention for CPU: each query token attends to its request's keys,
 * read in place from the block-paged KV cache (no gather into a contiguous
 * copy). Built and loaded at run time by kvserve/model/cpu_kernels.py.
 *
 * Layout (see kvserve/model/attention.py): K and V are each
 * [kv_heads, num_blocks, block_size, head_dim]; the key at position p of a
 * request lives in block block_table[p / block_size], slot p % block_size.
 * Every key a token reads (positions lo..pos) must already be in the cache.
 *
 * One work item is (query token, KV head): the query heads that share the KV
 * head (GQA) are handled together, so each K/V row is read once per item.
 * Scores are kept exactly (two passes: scores, then softmax and the weighted
 * sum of V), in float32 whatever the storage type.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 32
/* Below this much K/V to read one thread does the step: starting a parallel region
 * costs tens of microseconds on a virtual machine, about what a core reads 256 KiB in. */
#define PARALLEL_MIN_BYTES (256 * 1024)

static inline void load_row(const void *base, int64_t offset, int dtype, int64_t dim, float *dst) {
    if (dtype == F32) {
        memcpy(dst, (const float *)base + offset, (size_t)dim * sizeof(float));
    } else {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int64_t i = 0; i < dim; i++) dst[i] = bf16_value(src[i]);
    }
}

static inline void store_row(void *base, int64_t offset, int dtype, int64_t dim, const float *src) {
    if (dtype == F32) {
        memcpy((float *)base + offset, src, (size_t)dim * sizeof(float));
    } else {
        uint16_t *dst = (uint16_t *)base + offset;
        for (int64_t i = 0; i < dim; i++) dst[i] = bf16_bits(src[i]);
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
    int q_dtype, kv_dtype;
} Args;

#if defined(__AVX512F__)
#include <immintrin.h>
#define VEC 16

/* 16 consecutive K/V elements as float32. */
static inline __m512 load16(const void *base, int64_t offset, int dtype) {
    if (dtype == F32) return _mm512_loadu_ps((const float *)base + offset);
    __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

static inline float dot_row(const float *q, const void *base, int64_t offset, int dtype, int64_t dim) {
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(q), load16(base, offset, dtype));
    for (int64_t i = VEC; i < dim; i += VEC)
        sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(base, offset + i, dtype), sum);
    return _mm512_reduce_add_ps(sum);
}

static inline void axpy_row(float *acc, float w, const void *base, int64_t offset, int dtype, int64_t dim) {
    __m512 weight = _mm512_set1_ps(w);
    for (int64_t i = 0; i < dim; i += VEC)
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(weight, load16(base, offset + i, dtype), _mm512_loadu_ps(acc + i)));
}
#define VECTOR_ROWS(dim) ((dim) % VEC == 0)
#else
#define VECTOR_ROWS(dim) 0
static inline float dot_row(const float *q, const void *base, int64_t offset, int dtype, int64_t dim) {
    (void)q, (void)base, (void)offset, (void)dtype, (void)dim;
    return 0.f; /* unused: VECTOR_ROWS is 0 */
}
static inline void axpy_row(float *acc, float w, const void *base, int64_t offset, int dtype, int64_t dim) {
    (void)acc, (void)w, (void)base, (void)offset, (void)dtype, (void)dim;
}
#endif

/* Keys lo..pos, block by block: runs `body` with j (key index from lo) and the offset of its row. */
#define FOR_EACH_KEY(a, base, elem, table, lo, pos, head_base, dim, j, offset, body)              \
    for (int64_t blk = (lo) / (a)->block_size; blk <= (pos) / (a)->block_size; blk++) {          \
        int64_t first = blk * (a)->block_size, last = first + (a)->block_size - 1;              \
        if (last > (pos)) last = (pos);                                                         \
        int64_t offset = (head_base) + (table[blk] * (a)->block_size) * (dim);                  \
        /* The next block is elsewhere in memory: fetch it while this one is used. */           \
        if (blk < (pos) / (a)->block_size) {                                                    \
            const char *next_ = (const char *)(base) +                                          \
                ((head_base) + table[blk + 1] * (a)->block_size * (dim)) * (elem);              \
            for (int64_t b_ = 0; b_ < (a)->block_size * (dim) * (elem); b_ += 64)               \
                __builtin_prefetch(next_ + b_);                                                 \
        }                                                                                       \
        if (first < (lo)) {                                                                     \
            offset += ((lo) - first) * (dim);                                                   \
            first = (lo);                                                                       \
        }                                                                                       \
        for (int64_t j = first - (lo); j <= last - (lo); j++, offset += (dim)) {                \
            body                                                                                \
        }                                                                                       \
    }

/* always_inline: the dispatch below calls it with a constant head_dim so the
 * inner loops get fixed trip counts. */
static inline __attribute__((always_inline)) void attend_item(const Args *a, int64_t item, const int64_t dim,
                                                             float *scores) {
    const int64_t token = item / a->num_kv_heads, kv_head = item % a->num_kv_heads;
    const int64_t group = a->num_heads / a->num_kv_heads;
    const int64_t pos = a->positions[token];
    const int64_t lo = (a->window > 0 && pos - a->window + 1 > 0) ? pos - a->window + 1 : 0;
    const int64_t num_keys = pos - lo + 1;
    const int64_t *table = a->block_table + a->table_row[token] * a->block_table_stride;
    const int64_t q_row = a->token_index[token];
    const int vector = VECTOR_ROWS(dim);
    const int64_t elem = a->kv_dtype == F32 ? 4 : 2;
    float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], row[MAX_HEAD_DIM];

    for (int64_t g = 0; g < group; g++) {
        int64_t head = kv_head * group + g;
        load_row(a->q, q_row * a->q_token_stride + head * a->q_head_stride, a->q_dtype, dim, qf[g]);
        for (int64_t i = 0; i < dim; i++) qf[g][i] *= a->scale;
    }
    const int64_t head_base = kv_head * a->cache_head_stride;
    FOR_EACH_KEY(a, a->k_cache, elem, table, lo, pos, head_base, dim, j, offset, {
        if (vector) {
            for (int64_t g = 0; g < group; g++) scores[g * num_keys + j] = dot_row(qf[g], a->k_cache, offset,
                                                                                  a->kv_dtype, dim);
        } else {
            load_row(a->k_cache, offset, a->kv_dtype, dim, row);
            for (int64_t g = 0; g < group; g++) {
                float s = 0.f;
                for (int64_t i = 0; i < dim; i++) s += qf[g][i] * row[i];
                scores[g * num_keys + j] = s;
            }
        }
    })
    float inv_sum[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * num_keys, m = -INFINITY, sum = 0.f;
        if (a->softcap > 0.f)
            for (int64_t j = 0; j < num_keys; j++) s[j] = tanhf(s[j] / a->softcap) * a->softcap;
        for (int64_t j = 0; j < num_keys; j++) m = s[j] > m ? s[j] : m;
        for (int64_t j = 0; j < num_keys; j++) {
            s[j] = expf(s[j] - m);
            sum += s[j];
        }
        inv_sum[g] = 1.f / sum;
        for (int64_t i = 0; i < dim; i++) acc[g][i] = 0.f;
    }
    FOR_EACH_KEY(a, a->v_cache, elem, table, lo, pos, head_base, dim, j, offset, {
        if (vector) {
            for (int64_t g = 0; g < group; g++) axpy_row(acc[g], scores[g * num_keys + j], a->v_cache, offset,
                                                         a->kv_dtype, dim);
        } else {
            load_row(a->v_cache, offset, a->kv_dtype, dim, row);
            for (int64_t g = 0; g < group; g++) {
                float w = scores[g * num_keys + j];
                for (int64_t i = 0; i < dim; i++) acc[g][i] += w * row[i];
            }
        }
    })
    for (int64_t g = 0; g < group; g++) {
        int64_t head = kv_head * group + g;
        for (int64_t i = 0; i < dim; i++) acc[g][i] *= inv_sum[g];
        store_row(a->out, q_row * a->out_token_stride + head * a->out_head_stride, a->q_dtype, dim, acc[g]);
    }
}

static void attend_range(const Args *a, int64_t item, float *scores) {
    switch (a->head_dim) {
    case 64: attend_item(a, item, 64, scores); break;
    case 128: attend_item(a, item, 128, scores); break;
    default: attend_item(a, item, a->head_dim, scores); break;
    }
}

/* Returns 0 on success, a positive code for arguments the kernel cannot take. */
int kvserve_paged_attention(const void *q, int64_t q_token_stride, int64_t q_head_stride,
                            const void *k_cache, const void *v_cache, int64_t cache_head_stride,
                            void *out, int64_t out_token_stride, int64_t out_head_stride,
                            const int64_t *token_index, const int64_t *positions,
                            const int64_t *block_table, int64_t block_table_stride, const int64_t *table_row,
                            int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t window, float scale, float softcap,
                            int q_dtype, int kv_dtype, int num_threads) {
    if (head_dim > MAX_HEAD_DIM || num_kv_heads <= 0 || num_heads % num_kv_heads != 0
        || num_heads / num_kv_heads > MAX_GROUP)
        return 1;
    Args a = {q, q_token_stride, q_head_stride, k_cache, v_cache, cache_head_stride, out, out_token_stride,
              out_head_stride, token_index, positions, block_table, block_table_stride, table_row,
              num_heads, num_kv_heads, head_dim, block_size, window, scale, softcap, q_dtype, kv_dtype};
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
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *scores = malloc((size_t)(max_keys * group) * sizeof(float));
        if (!scores) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; item++)
            if (scores) attend_range(&a, item, scores);
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
