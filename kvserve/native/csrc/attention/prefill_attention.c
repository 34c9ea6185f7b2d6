/* Causal attention of prompt chunks (prefill) for CPU, tiled flash-style, reading K and V
 * in place from the block-paged cache (layout: paged_attention.c's header).
 *
 * A chunk is `len` consecutive tokens of one request (rows chunk_start.. of q and out) at
 * positions pos0..pos0 + len - 1; token i reads the keys max(0, p_i - window + 1)..p_i, all
 * of them already in the cache (this step's K/V written first). A work item is a tile of
 * query rows (token, query head) of one KV head: the query heads sharing that KV head (GQA)
 * are rows of the same tile, so each K/V tile load serves all of them. The item streams its
 * keys a tile of KEY_TILE at a time: scores of every row against the tile, the running
 * (online) softmax in float32 (max, sum, the output rescaled when the max grows), the
 * weighted sum of the tile's V rows. Items are sorted by their keys (the causal triangle
 * makes the last tiles of a chunk the longest) and shared out dynamically over the threads.
 *
 * Layout of a tile: the rows lie in the vector lanes. Queries, scores and outputs are
 * stored transposed ([dim][rows], [keys][rows]), so the scores are broadcasts of one K
 * value times a vector of rows, the softmax's max and sum run across keys lane by lane (no
 * horizontal reductions), and the output update is a broadcast V value times a vector of
 * probabilities. The K and V rows of a tile are converted to float32 once per tile.
 *
 * Two paths, picked per call (`isa`, capped by KVSERVE_QUANT_ISA as every attention path):
 * AVX-512F (register-blocked tiles, a vector exp) where head_dim is whole vectors, else
 * portable C (the same tiles, scalar loops; also taken for the AVX2 path). Soft-capping
 * (tanh) is scalar on both paths.
 *
 * Attention sinks (gpt-oss): a logit per query head joins each row's softmax denominator only
 * (its probability dropped), neither scaled nor capped, as in paged_attention.c. It is folded
 * in once per row after the last key tile, like one more tile holding a single key with no
 * value: with m and l the row's running max and sum and M = max(m, sink), the output is
 * o e^(m - M) / (l e^(m - M) + e^(sink - M)).
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
#define TILE_ROWS 64 /* query rows (token x query head) of a tile: up to four vectors of 16 */
#define KEY_TILE 64  /* keys per tile */
#define LANES 16
/* Below this many multiply-adds one thread does the call (a parallel region costs tens of us). */
#define PARALLEL_MIN_MACS (4 * 1024 * 1024)

typedef struct {
    const void *q;
    int64_t q_token_stride, q_head_stride;
    const void *k_cache, *v_cache;
    int64_t cache_head_stride;
    void *out;
    int64_t out_token_stride, out_head_stride;
    const int64_t *chunk_start, *chunk_len, *chunk_pos, *chunk_row;
    const int64_t *block_table;
    int64_t block_table_stride;
    int64_t num_heads, num_kv_heads, head_dim, block_size, window;
    float scale, softcap;
    const float *sinks; /* [num_heads] or NULL: no sinks */
    int q_dtype, kv_dtype, path;
} Args;

/* Tokens [t0, t1) of a chunk against one KV head; `keys` its cost, for the ordering. */
typedef struct {
    int64_t chunk, kv_head, t0, t1, keys;
} Item;

/* One thread's buffers. Rows r = token * group + query head, in the lanes. */
typedef struct {
    float *qt; /* [head_dim][TILE_ROWS]: query rows times scale */
    float *ot; /* [head_dim][TILE_ROWS]: output rows, not yet divided by their sums */
    float *st; /* [KEY_TILE][TILE_ROWS]: scores, then probabilities */
    float *k;  /* [KEY_TILE][head_dim]: the key tile's K rows as float32 */
    float *v;  /* [KEY_TILE][head_dim]: its V rows */
    float m[TILE_ROWS], l[TILE_ROWS]; /* each row's running max and sum */
    int32_t row_pos[TILE_ROWS], row_lo[TILE_ROWS]; /* each row's position and first key */
    int32_t key_pos[KEY_TILE];
} Tile;

static int64_t tile_tokens(int64_t group) { return TILE_ROWS / group; }

static int64_t first_key(const Args *a, int64_t pos) {
    return a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
}

/* ---------------------------------------------------------------- loading */

static void load_queries(const Args *a, const Item *it, Tile *w, int64_t rows) {
    const int64_t group = a->num_heads / a->num_kv_heads, dim = a->head_dim;
    const int64_t token0 = a->chunk_start[it->chunk] + it->t0, pos0 = a->chunk_pos[it->chunk] + it->t0;
    for (int64_t r = 0; r < TILE_ROWS; r++) {
        /* rows past the tile's repeat its last one (their lanes compute and are dropped) */
        const int64_t src = r < rows ? r : rows - 1, t = src / group;
        const int64_t head = it->kv_head * group + src % group;
        const int64_t offset = (token0 + t) * a->q_token_stride + head * a->q_head_stride;
        for (int64_t d = 0; d < dim; d++) w->qt[d * TILE_ROWS + r] = stored_value(a->q, offset + d, a->q_dtype) * a->scale;
        w->row_pos[r] = (int32_t)(pos0 + t);
        w->row_lo[r] = (int32_t)first_key(a, pos0 + t);
        w->m[r] = -INFINITY;
        w->l[r] = 0.f;
    }
    memset(w->ot, 0, sizeof(float) * (size_t)(dim * TILE_ROWS));
}

static inline void convert_row(const void *base, int64_t offset, int dtype, int64_t dim, float *dst, int path) {
#if KV_HAVE_AVX512F
    if (path == ISA_AVX512 && dtype != F32) {
        for (int64_t i = 0; i < dim; i += LANES) {
            const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset + i));
            const __m512 x = dtype == F16 ? _mm512_cvtph_ps(half)
                                          : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
            _mm512_storeu_ps(dst + i, x);
        }
        return;
    }
#endif
    (void)path;
    if (dtype == F32) {
        memcpy(dst, (const float *)base + offset, (size_t)dim * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < dim; i++) dst[i] = stored_value(base, offset + i, dtype);
}

/* Keys k0..k0 + n - 1 of the request whose block ids are `table`, KV head at head_base. */
static void load_keys(const Args *a, const int64_t *table, int64_t head_base, int64_t k0, int64_t n, Tile *w) {
    const int64_t bs = a->block_size, dim = a->head_dim;
    for (int64_t j = 0; j < n; j++) {
        const int64_t p = k0 + j, offset = head_base + (table[p / bs] * bs + p % bs) * dim;
        convert_row(a->k_cache, offset, a->kv_dtype, dim, w->k + j * dim, a->path);
        convert_row(a->v_cache, offset, a->kv_dtype, dim, w->v + j * dim, a->path);
        w->key_pos[j] = (int32_t)p;
    }
}

/* Scores of the tile's keys tanh-capped (scalar, both paths), before any mask. */
static void soft_cap(const Args *a, Tile *w, int64_t n, int64_t rows_p) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t r = 0; r < rows_p; r++) {
            float *s = w->st + j * TILE_ROWS + r;
            *s = tanhf(*s / a->softcap) * a->softcap;
        }
}

/* ---------------------------------------------------------------- portable */

static void scores_portable(Tile *w, int64_t n, int64_t dim, int64_t rows_p) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t r = 0; r < rows_p; r++) {
            float s = 0.f;
            for (int64_t d = 0; d < dim; d++) s += w->qt[d * TILE_ROWS + r] * w->k[j * dim + d];
            w->st[j * TILE_ROWS + r] = s;
        }
}

/* Masks keys a row may not read, folds the tile into each row's running max and sum, turns
 * the scores into probabilities and rescales the output rows by exp(old max - new max). */
static void softmax_portable(Tile *w, int64_t n, int masked, int64_t dim, int64_t rows_p) {
    for (int64_t r = 0; r < rows_p; r++) {
        float tile_max = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            float *s = w->st + j * TILE_ROWS + r;
            if (masked && (w->key_pos[j] > w->row_pos[r] || w->key_pos[j] < w->row_lo[r])) *s = -INFINITY;
            tile_max = *s > tile_max ? *s : tile_max;
        }
        const float old = w->m[r], next = old > tile_max ? old : tile_max;
        const float shift = next == -INFINITY ? 0.f : next; /* no key yet: every probability 0 */
        const float alpha = old == -INFINITY ? 0.f : expf(old - shift);
        float sum = 0.f;
        for (int64_t j = 0; j < n; j++) {
            float *s = w->st + j * TILE_ROWS + r;
            *s = *s == -INFINITY ? 0.f : expf(*s - shift);
            sum += *s;
        }
        w->l[r] = w->l[r] * alpha + sum;
        w->m[r] = next;
        if (alpha != 1.f)
            for (int64_t d = 0; d < dim; d++) w->ot[d * TILE_ROWS + r] *= alpha;
    }
}

static void values_portable(Tile *w, int64_t n, int64_t dim, int64_t rows_p) {
    for (int64_t d = 0; d < dim; d++)
        for (int64_t r = 0; r < rows_p; r++) {
            float acc = w->ot[d * TILE_ROWS + r];
            for (int64_t j = 0; j < n; j++) acc += w->st[j * TILE_ROWS + r] * w->v[j * dim + d];
            w->ot[d * TILE_ROWS + r] = acc;
        }
}

/* ---------------------------------------------------------------- AVX-512 */

#if KV_HAVE_AVX512F
#define KEY_BLOCK 4 /* keys whose scores the register block computes together */
#define DIM_BLOCK 4 /* output dimensions the value block updates together */

/* Keeps x in a register: without it the compiler reloads a vector used by KEY_BLOCK (DIM_BLOCK)
 * multiply-adds as each one's memory operand, 20 loads per 16 multiply-adds, which the load
 * ports (not the FMA units) then limit. The multiply-adds and their order are unchanged. */
#if defined(__GNUC__)
#define IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define IN_REGISTER(x) ((void)0)
#endif

/* st[j][rows] = sum_d qt[d][rows] k[j][d]: KEY_BLOCK keys x nv row vectors in registers. */
static inline __attribute__((always_inline)) void scores_avx512(Tile *w, int64_t n, int64_t dim, const int nv) {
    int64_t j = 0;
    for (; j + KEY_BLOCK <= n; j += KEY_BLOCK) {
        __m512 acc[KEY_BLOCK][4];
        for (int b = 0; b < KEY_BLOCK; b++)
            for (int c = 0; c < nv; c++) acc[b][c] = _mm512_setzero_ps();
        const float *k = w->k + j * dim;
        for (int64_t d = 0; d < dim; d++) {
            __m512 q[4];
            for (int c = 0; c < nv; c++) {
                q[c] = _mm512_load_ps(w->qt + d * TILE_ROWS + c * LANES);
                IN_REGISTER(q[c]);
            }
            for (int b = 0; b < KEY_BLOCK; b++) {
                const __m512 kv = _mm512_set1_ps(k[b * dim + d]);
                for (int c = 0; c < nv; c++) acc[b][c] = _mm512_fmadd_ps(q[c], kv, acc[b][c]);
            }
        }
        for (int b = 0; b < KEY_BLOCK; b++)
            for (int c = 0; c < nv; c++) _mm512_store_ps(w->st + (j + b) * TILE_ROWS + c * LANES, acc[b][c]);
    }
    for (; j < n; j++) {
        __m512 acc[4];
        for (int c = 0; c < nv; c++) acc[c] = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d++) {
            const __m512 kv = _mm512_set1_ps(w->k[j * dim + d]);
            for (int c = 0; c < nv; c++)
                acc[c] = _mm512_fmadd_ps(_mm512_load_ps(w->qt + d * TILE_ROWS + c * LANES), kv, acc[c]);
        }
        for (int c = 0; c < nv; c++) _mm512_store_ps(w->st + j * TILE_ROWS + c * LANES, acc[c]);
    }
}

/* softmax_portable's job, 16 rows a vector. */
static void softmax_avx512(Tile *w, int64_t n, int masked, int64_t dim, int nv) {
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY), zero = _mm512_setzero_ps();
    for (int c = 0; c < nv; c++) {
        const __m512i pos = _mm512_loadu_si512(w->row_pos + c * LANES), lo = _mm512_loadu_si512(w->row_lo + c * LANES);
        __m512 tile_max = neg_inf;
        for (int64_t j = 0; j < n; j++) {
            float *s = w->st + j * TILE_ROWS + c * LANES;
            __m512 x = _mm512_load_ps(s);
            if (masked) {
                const __m512i key = _mm512_set1_epi32(w->key_pos[j]);
                const __mmask16 out = _mm512_cmpgt_epi32_mask(key, pos) | _mm512_cmplt_epi32_mask(key, lo);
                x = _mm512_mask_mov_ps(x, out, neg_inf);
                _mm512_store_ps(s, x);
            }
            tile_max = _mm512_max_ps(tile_max, x);
        }
        const __m512 old = _mm512_loadu_ps(w->m + c * LANES), next = _mm512_max_ps(old, tile_max);
        const __m512 shift = _mm512_mask_mov_ps(next, _mm512_cmp_ps_mask(next, neg_inf, _CMP_EQ_OQ), zero);
        const __m512 alpha = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(old, neg_inf, _CMP_NEQ_UQ),
                                                 exp_nonpositive(_mm512_sub_ps(old, shift)));
        __m512 sum = zero;
        for (int64_t j = 0; j < n; j++) {
            float *s = w->st + j * TILE_ROWS + c * LANES;
            const __m512 x = _mm512_load_ps(s);
            const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_UQ),
                                                 exp_nonpositive(_mm512_sub_ps(x, shift)));
            _mm512_store_ps(s, p);
            sum = _mm512_add_ps(sum, p);
        }
        _mm512_storeu_ps(w->l + c * LANES, _mm512_fmadd_ps(_mm512_loadu_ps(w->l + c * LANES), alpha, sum));
        _mm512_storeu_ps(w->m + c * LANES, next);
        if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.f), _CMP_NEQ_UQ))
            for (int64_t d = 0; d < dim; d++) {
                float *o = w->ot + d * TILE_ROWS + c * LANES;
                _mm512_store_ps(o, _mm512_mul_ps(_mm512_load_ps(o), alpha));
            }
    }
}

/* ot[d][rows] += sum_j st[j][rows] v[j][d]: DIM_BLOCK dimensions x nv row vectors in registers. */
static inline __attribute__((always_inline)) void values_avx512(Tile *w, int64_t n, int64_t dim, const int nv) {
    for (int64_t d = 0; d < dim; d += DIM_BLOCK) {
        __m512 acc[DIM_BLOCK][4];
        for (int b = 0; b < DIM_BLOCK; b++)
            for (int c = 0; c < nv; c++) acc[b][c] = _mm512_load_ps(w->ot + (d + b) * TILE_ROWS + c * LANES);
        for (int64_t j = 0; j < n; j++) {
            __m512 p[4];
            for (int c = 0; c < nv; c++) {
                p[c] = _mm512_load_ps(w->st + j * TILE_ROWS + c * LANES);
                IN_REGISTER(p[c]);
            }
            const float *v = w->v + j * dim + d;
            for (int b = 0; b < DIM_BLOCK; b++) {
                const __m512 vv = _mm512_set1_ps(v[b]);
                for (int c = 0; c < nv; c++) acc[b][c] = _mm512_fmadd_ps(p[c], vv, acc[b][c]);
            }
        }
        for (int b = 0; b < DIM_BLOCK; b++)
            for (int c = 0; c < nv; c++) _mm512_store_ps(w->ot + (d + b) * TILE_ROWS + c * LANES, acc[b][c]);
    }
}

/* One key tile on the AVX-512 path, the register blocks specialized for nv row vectors. */
static void key_tile_avx512(const Args *a, Tile *w, int64_t n, int masked, int nv) {
    const int64_t dim = a->head_dim;
    switch (nv) {
    case 1: scores_avx512(w, n, dim, 1); break;
    case 2: scores_avx512(w, n, dim, 2); break;
    case 3: scores_avx512(w, n, dim, 3); break;
    default: scores_avx512(w, n, dim, 4); break;
    }
    if (a->softcap > 0.f) soft_cap(a, w, n, (int64_t)nv * LANES);
    softmax_avx512(w, n, masked, dim, nv);
    switch (nv) {
    case 1: values_avx512(w, n, dim, 1); break;
    case 2: values_avx512(w, n, dim, 2); break;
    case 3: values_avx512(w, n, dim, 3); break;
    default: values_avx512(w, n, dim, 4); break;
    }
}
#endif

/* ---------------------------------------------------------------- one item */

/* What a row's output (not yet divided) is multiplied by, its sink in the denominator: the
 * row's max m is finite (every row reads its own key). */
static float sink_scale(float m, float l, float sink) {
    const float top = m > sink ? m : sink, alpha = expf(m - top);
    return alpha / (l * alpha + expf(sink - top));
}

static void attend_item(const Args *a, const Item *it, Tile *w) {
    const int64_t group = a->num_heads / a->num_kv_heads, dim = a->head_dim;
    const int64_t rows = (it->t1 - it->t0) * group, nv = (rows + LANES - 1) / LANES, rows_p = nv * LANES;
    load_queries(a, it, w, rows);
    const int64_t pos0 = a->chunk_pos[it->chunk] + it->t0, pos_last = a->chunk_pos[it->chunk] + it->t1 - 1;
    const int64_t lo_first = first_key(a, pos0), lo_last = first_key(a, pos_last);
    const int64_t *table = a->block_table + a->chunk_row[it->chunk] * a->block_table_stride;
    const int64_t head_base = it->kv_head * a->cache_head_stride;
    for (int64_t k0 = lo_first; k0 <= pos_last; k0 += KEY_TILE) {
        const int64_t n = pos_last - k0 + 1 < KEY_TILE ? pos_last - k0 + 1 : KEY_TILE;
        load_keys(a, table, head_base, k0, n, w);
        /* every row reads every key of the tile: no mask (padding rows copy a real one) */
        const int masked = k0 + n - 1 > pos0 || k0 < lo_last;
#if KV_HAVE_AVX512F
        if (a->path == ISA_AVX512) {
            key_tile_avx512(a, w, n, masked, (int)nv);
            continue;
        }
#endif
        scores_portable(w, n, dim, rows_p);
        if (a->softcap > 0.f) soft_cap(a, w, n, rows_p);
        softmax_portable(w, n, masked, dim, rows_p);
        values_portable(w, n, dim, rows_p);
    }
    const int64_t token0 = a->chunk_start[it->chunk] + it->t0;
    float row[MAX_HEAD_DIM];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t head = it->kv_head * group + r % group;
        const float inv = a->sinks ? sink_scale(w->m[r], w->l[r], a->sinks[head]) : 1.f / w->l[r];
        for (int64_t d = 0; d < dim; d++) row[d] = w->ot[d * TILE_ROWS + r] * inv;
        const int64_t offset = (token0 + r / group) * a->out_token_stride + head * a->out_head_stride;
        if (a->q_dtype == F32) {
            memcpy((float *)a->out + offset, row, sizeof(float) * (size_t)dim);
        } else {
            for (int64_t d = 0; d < dim; d++) store_value(a->out, offset + d, a->q_dtype, row[d]);
        }
    }
}

/* ---------------------------------------------------------------- the call */

static Tile *tile_alloc(int64_t dim) {
    Tile *w = aligned_alloc(64, (sizeof(Tile) + 63) / 64 * 64);
    const size_t floats = (size_t)(2 * dim * TILE_ROWS + KEY_TILE * TILE_ROWS + 2 * KEY_TILE * dim);
    float *buffer = w ? aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64) : NULL;
    if (!buffer) {
        free(w);
        return NULL;
    }
    w->qt = buffer;
    w->ot = w->qt + dim * TILE_ROWS;
    w->st = w->ot + dim * TILE_ROWS;
    w->k = w->st + KEY_TILE * TILE_ROWS;
    w->v = w->k + KEY_TILE * dim;
    return w;
}

static void tile_free(Tile *w) {
    if (w) free(w->qt);
    free(w);
}

static int by_keys_descending(const void *x, const void *y) {
    const int64_t a = ((const Item *)x)->keys, b = ((const Item *)y)->keys;
    return a < b ? 1 : a > b ? -1 : 0;
}

/* The items of every chunk, longest first; NULL when out of memory. *macs: the call's work. */
static Item *make_items(const Args *a, int64_t num_chunks, int64_t *count, int64_t *macs) {
    const int64_t per_tile = tile_tokens(a->num_heads / a->num_kv_heads);
    int64_t n = 0;
    for (int64_t c = 0; c < num_chunks; c++) n += (a->chunk_len[c] + per_tile - 1) / per_tile * a->num_kv_heads;
    Item *items = malloc(sizeof(Item) * (size_t)(n > 0 ? n : 1));
    if (!items) return NULL;
    int64_t i = 0, work = 0;
    for (int64_t c = 0; c < num_chunks; c++)
        for (int64_t t0 = 0; t0 < a->chunk_len[c]; t0 += per_tile) {
            const int64_t t1 = t0 + per_tile < a->chunk_len[c] ? t0 + per_tile : a->chunk_len[c];
            const int64_t keys = a->chunk_pos[c] + t1 - first_key(a, a->chunk_pos[c] + t0);
            for (int64_t h = 0; h < a->num_kv_heads; h++) items[i++] = (Item){c, h, t0, t1, keys};
            work += keys * (t1 - t0) * a->num_kv_heads;
        }
    qsort(items, (size_t)n, sizeof(Item), by_keys_descending);
    *count = n;
    *macs = work * (a->num_heads / a->num_kv_heads) * a->head_dim * 2;
    return items;
}

/* Returns 0 on success, 1 for arguments the kernel cannot take, 2 when out of memory, 3
 * when path `isa` does not run here. `sinks`: float32 [num_heads], a logit per query head
 * joining its softmax (NULL: none). */
int kvserve_prefill_attention(const void *q, int64_t q_token_stride, int64_t q_head_stride, const void *k_cache,
                              const void *v_cache, int64_t cache_head_stride, void *out, int64_t out_token_stride,
                              int64_t out_head_stride, const int64_t *chunk_start, const int64_t *chunk_len,
                              const int64_t *chunk_pos, const int64_t *chunk_row, const int64_t *block_table,
                              int64_t block_table_stride, int64_t num_chunks, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, int64_t block_size, int64_t window, float scale, float softcap,
                              const float *sinks, int q_dtype, int kv_dtype, int isa, int num_threads) {
    if (head_dim <= 0 || head_dim > MAX_HEAD_DIM || num_kv_heads <= 0 || num_heads % num_kv_heads != 0
        || num_heads / num_kv_heads > MAX_GROUP || block_size <= 0 || num_chunks < 0)
        return 1;
    for (int64_t c = 0; c < num_chunks; c++)
        if (chunk_len[c] < 0 || chunk_pos[c] < 0 || chunk_pos[c] + chunk_len[c] >= INT32_MAX) return 1;
    if (!kvserve_isa_available(KV_KERNEL_ATTENTION, isa)) return 3;
    const int path = isa >= ISA_AVX512 && KV_HAVE_AVX512F && head_dim % LANES == 0 ? ISA_AVX512 : ISA_PORTABLE;
    const Args a = {q, q_token_stride, q_head_stride, k_cache, v_cache, cache_head_stride, out, out_token_stride,
                    out_head_stride, chunk_start, chunk_len, chunk_pos, chunk_row, block_table, block_table_stride,
                    num_heads, num_kv_heads, head_dim, block_size, window, scale, softcap, sinks, q_dtype, kv_dtype, path};
    int64_t num_items = 0, macs = 0;
    Item *items = make_items(&a, num_chunks, &num_items, &macs);
    if (!items) return 2;
    if (macs < PARALLEL_MIN_MACS || num_items < 2) num_threads = 1;
    int failed = 0;
    if (num_threads <= 1) { /* no parallel region: a caller inside its own may call with one thread */
        Tile *w = tile_alloc(head_dim);
        for (int64_t i = 0; w && i < num_items; i++) attend_item(&a, &items[i], w);
        failed = w ? 0 : 2;
        tile_free(w);
    } else {
#pragma omp parallel num_threads(num_threads)
        {
            Tile *w = tile_alloc(head_dim);
            if (!w) {
#pragma omp atomic write
                failed = 2;
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < num_items; i++)
                if (w) attend_item(&a, &items[i], w);
            tile_free(w);
        }
    }
    free(items);
    return failed;
}
