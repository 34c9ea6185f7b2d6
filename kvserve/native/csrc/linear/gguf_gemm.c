/* y = x W^T (+ b) for steps of many activation rows, W in a GGUF block type as stored (#27):
 * a real GEMM where gguf_rows.c's tiles read each weight block for four batch rows at a time.
 *
 * The activations (kvserve_quant_activations' int8 format) are packed once per step with the
 * batch rows in the vector lanes (gguf/gemm.h); the weight is unpacked a panel of rows at a
 * time into int8 values and float scales, once per step, and each panel serves every group
 * of batch rows from cache. A type's kernel (gguf/<type>_gemm.c) takes exact int32 sums per
 * 32 columns and applies the float scales in the order of that type's batch-one tile on the
 * same path (gguf/sub_block_sums.h), so each row's result is bit for bit the batch-one one,
 * whatever the batch, the row range or the thread split. Types and paths without a GEMM
 * keep the tiles.
 */
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gguf/gemm.h"
#include "kvserve.h"

/* A panel: the weight rows unpacked together, about PANEL_BYTES (in the core's L2 cache), at
 * most MAX_PANEL_ROWS. Each panel serves every batch group, so the activations stream through
 * once per panel: a prefill-sized step of a wide matrix (2,048 rows of 8,192 columns) read them
 * from memory faster than the kernel used them with panels of 16 rows. */
#define PANEL_BYTES (384 * 1024)
#define MAX_PANEL_ROWS 128
/* The batch goes in slabs of about SLAB_BYTES of packed activations, which the panels of a slab
 * read from the last-level cache (each slab unpacks the weight again: once per 100+ rows). */
#define SLAB_BYTES (2 * 1024 * 1024)
/* A step whose packed activations take at most STRIP_PANEL_X_BYTES (they stay in the core's L2
 * cache from panel to panel) unpacks one strip at a time, each run against every group while it
 * is still in the first-level cache: with few groups to share the unpacking, a strip in an
 * L2-sized panel cost more than its unpacking saved in activation reads (decode-sized steps of
 * Q4_K on Zen 5: 7-10% faster). */
#ifndef STRIP_PANEL_X_BYTES
#define STRIP_PANEL_X_BYTES (256 * 1024)
#endif
/* Steps of up to CHUNK_GROUPS lane groups of a type whose kernels take chunks (Q4_K, Q6_K) go a
 * strip and CHUNK_BLOCKS super-blocks at a time (gemm_chunked): a strip of a wide row (8,192
 * columns) is more than the first-level cache holds (Q4_K's down projection at 16 or 32 rows:
 * about 15% faster than one strip at a time on Zen 5; rows of one chunk keep the strips). */
#ifndef CHUNK_GROUPS
#define CHUNK_GROUPS 2
#endif
#ifndef CHUNK_BLOCKS
#define CHUNK_BLOCKS 8
#endif

/* Rows per panel for a range of `rows` weight rows (no more than the range needs). */
static int64_t panel_rows(int64_t panel_bytes, int64_t rows) {
    int64_t per = PANEL_BYTES / panel_bytes / GGUF_GEMM_ROWS * GGUF_GEMM_ROWS;
    per = per < GGUF_GEMM_ROWS ? GGUF_GEMM_ROWS : per > MAX_PANEL_ROWS ? MAX_PANEL_ROWS : per;
    const int64_t needed = (rows + GGUF_GEMM_ROWS - 1) / GGUF_GEMM_ROWS * GGUF_GEMM_ROWS;
    return needed < per ? needed : per;
}

static const GgufGemmType *const GEMMS[] = {&gguf_q4_k_gemm_avx512, &gguf_q6_k_gemm_avx512, &gguf_q8_0_gemm_avx512,
                                             &gguf_q5_0_gemm_avx512, &gguf_mxfp4_gemm_avx512};

/* The GEMM of `type` matching the tiles of path `isa` where this build and CPU run it, or NULL. */
const GgufGemmType *gguf_gemm_of(int type, int isa) {
    if (isa < 0 || isa >= ISA_COUNT || !kvserve_isa_available(KV_KERNEL_QUANT, isa)) return NULL;
    for (size_t i = 0; i < sizeof GEMMS / sizeof GEMMS[0]; i++)
        if (GEMMS[i]->type == type && GEMMS[i]->isa == isa && GEMMS[i]->kernel) return GEMMS[i];
    return NULL;
}

int kvserve_gguf_gemm_supported(int type, int isa) { return gguf_gemm_of(type, isa) != NULL; }

int kvserve_gguf_gemm_min_batch(void) { return GGUF_GEMM_MIN_BATCH; }

/* Per-thread buffers kept between calls (a step's packed activations, a panel): fresh pages
 * would cost again at every matmul. Up to KEEP_BYTES each: a larger one (a prefill step of
 * thousands of rows of a wide matrix) is freed after its call, so a thread holds no more
 * than that between steps, and all of it is freed when the thread ends. */
#define KEEP_BYTES (32u << 20)
typedef struct {
    void *data;
    size_t bytes;
} Scratch;
typedef struct {
    Scratch packed, panel;
} ThreadScratch;
static pthread_key_t scratch_key;
static pthread_once_t scratch_key_once = PTHREAD_ONCE_INIT;
static int scratch_key_made;

static void free_thread_scratch(void *buffers) {
    ThreadScratch *ts = buffers;
    free(ts->packed.data);
    free(ts->panel.data);
    free(ts);
}
static void make_scratch_key(void) { scratch_key_made = !pthread_key_create(&scratch_key, free_thread_scratch); }

/* The calling thread's buffers (freed at its exit), or NULL when out of memory. */
static ThreadScratch *thread_scratch(void) {
    pthread_once(&scratch_key_once, make_scratch_key);
    if (!scratch_key_made) return NULL;
    ThreadScratch *ts = pthread_getspecific(scratch_key);
    if (!ts && (ts = calloc(1, sizeof *ts)) && pthread_setspecific(scratch_key, ts)) {
        free(ts);
        ts = NULL;
    }
    return ts;
}

/* At least `bytes` of this thread's buffer `s` (its old contents lost), or NULL. */
static void *scratch(Scratch *s, size_t bytes) {
    if (s->bytes < bytes) {
        free(s->data);
        s->data = aligned_alloc(64, (bytes + 63) / 64 * 64);
        s->bytes = s->data ? bytes : 0;
    }
    return s->data;
}

/* Frees `s` if it is larger than KEEP_BYTES. */
static void scratch_trim(Scratch *s) {
    if (s->bytes > KEEP_BYTES) {
        free(s->data);
        *s = (Scratch){NULL, 0};
    }
}

/* The layout of `batch` rows of `in` columns packed (gemm.h) in `buffer` (packed_bytes). */
static GgufGemmX packed_layout(const void *buffer, int64_t batch, int64_t in) {
    const int64_t groups = (batch + GGUF_GEMM_LANES - 1) / GGUF_GEMM_LANES, lanes = groups * GGUF_GEMM_LANES;
    const int64_t blocks = gguf_gemm_blocks(in);
    const float *dx = (const float *)((const uint8_t *)buffer + lanes * blocks * 256);
    return (GgufGemmX){buffer, dx, dx + lanes * blocks * 8, blocks, groups};
}
static size_t packed_bytes(int64_t batch, int64_t in) {
    const int64_t lanes = (batch + GGUF_GEMM_LANES - 1) / GGUF_GEMM_LANES * GGUF_GEMM_LANES;
    const int64_t blocks = gguf_gemm_blocks(in);
    return (size_t)(lanes * blocks * 256 + sizeof(float) * 2 * lanes * blocks * 8);
}

/* Lane group g of `batch` rows of qx [batch, in] and their scales (dx [batch, in / 32], then
 * sx) packed into px as gemm.h describes; lanes past the batch get x = 0 (byte 0x80) and no
 * scale. A 16 x 4-byte gather per step, the lanes' rows being `in` bytes apart. */
static void pack_group(const int8_t *qx, const float *scales, int64_t batch, int64_t in, int64_t g,
                       const GgufGemmX *px) {
    const int64_t K = px->blocks, nb32 = in / 32, first = g * GGUF_GEMM_LANES;
    const int lanes = batch - first < GGUF_GEMM_LANES ? (int)(batch - first) : GGUF_GEMM_LANES;
    uint8_t *x = (uint8_t *)px->x;
    float *dx = (float *)px->dx, *sx = (float *)px->sx;
#if KV_HAVE_AVX512_VNNI
    const __mmask16 mask = (__mmask16)((1u << lanes) - 1);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i rows = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)in));
    const __m512i scale_rows = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)nb32));
    const __m512i flip = _mm512_set1_epi32((int)0x80808080u); /* x + 128 as unsigned bytes */
    for (int j = 0; j < 8; j++)
        for (int64_t k = 0; k < K; k++) {
            const int64_t n = k * 8 + j, at = gguf_gemm_scale_at(px, g, j, k);
            const int8_t *src = qx + first * in + n * 32;
            uint8_t *dst = x + at * 32;
            if (n >= nb32) { /* a padding block: x = 0, no scale */
                for (int s = 0; s < 8; s++) _mm512_storeu_si512(dst + 64 * s, _mm512_set1_epi8((char)0x80));
                _mm512_storeu_ps(dx + at, _mm512_setzero_ps());
                _mm512_storeu_ps(sx + at, _mm512_setzero_ps());
                continue;
            }
            for (int s = 0; s < 8; s++) {
                const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, rows, src + 4 * s, 1);
                _mm512_storeu_si512(dst + 64 * s, _mm512_xor_si512(words, flip));
            }
            const float *d = scales + first * nb32 + n;
            _mm512_storeu_ps(dx + at, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, scale_rows, d, 4));
            _mm512_storeu_ps(sx + at, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, scale_rows, d + batch * nb32, 4));
        }
#else
    for (int j = 0; j < 8; j++)
        for (int64_t k = 0; k < K; k++) {
            const int64_t n = k * 8 + j, at = ((g * 8 + j) * K + k) * GGUF_GEMM_LANES;
            for (int lane = 0; lane < GGUF_GEMM_LANES; lane++) {
                const int real = lane < lanes && n < nb32;
                const int8_t *src = qx + (first + lane) * in + n * 32;
                for (int s = 0; s < 8; s++)
                    for (int i = 0; i < 4; i++)
                        x[at * 32 + 64 * s + 4 * lane + i] = real ? (uint8_t)(src[4 * s + i] ^ 0x80) : 0x80;
                dx[at + lane] = real ? scales[(first + lane) * nb32 + n] : 0.0f;
                sx[at + lane] = real ? scales[batch * nb32 + (first + lane) * nb32 + n] : 0.0f;
            }
        }
#endif
}

/* Rows of the panel at weight row `first` of the range [row_begin, row_end) in the slab from
 * lane group g0. The step's first panels grow from one strip (8, 8, 16, 32, ... rows up to
 * per_panel): the first rows come from memory with no prefetch ahead of them, so the kernel
 * starts after a few, and each later panel is prefetched while the one before it is computed. */
static int64_t panel_at(int64_t first, int64_t g0, int64_t row_begin, int64_t row_end, int64_t per_panel) {
    const int64_t done = first - row_begin;
    int64_t rows = per_panel;
    if (g0 == 0 && done < per_panel) rows = done > GGUF_GEMM_ROWS ? done : GGUF_GEMM_ROWS;
    return row_end - first < rows ? row_end - first : rows;
}

/* A lane group's tile of a panel's `rows` outputs (tile [row][16 lanes]) into y [batch, y_stride]
 * (y at the panel's first row): its lanes that are batch rows. */
static void copy_tile(const float *tile, int64_t batch, int64_t g, int64_t rows, float *y, int64_t y_stride) {
    const int64_t first = g * GGUF_GEMM_LANES, lanes = batch - first < GGUF_GEMM_LANES ? batch - first : GGUF_GEMM_LANES;
    for (int64_t lane = 0; lane < lanes; lane++)
        for (int64_t r = 0; r < rows; r++) y[(first + lane) * y_stride + r] = tile[r * GGUF_GEMM_LANES + lane];
}

/* Rows row_begin..row_end of y [batch, y_stride] from packed activations, panel by panel;
 * `panel` holds panel_rows() unpacked rows of the range. While a panel is computed, the next
 * one's stored rows are prefetched a share per kernel call, so memory and the kernel overlap. */
static void gemm_range(const GgufGemmType *gt, const GgufGemmX *px, int64_t batch, const uint8_t *w, int64_t in,
                       int64_t row_bytes, const float *bias, float *y, int64_t y_stride, int64_t row_begin,
                       int64_t row_end, uint8_t *panel) {
    const int64_t strip = GGUF_GEMM_ROWS * gt->panel_bytes(px->blocks);
    const int64_t x_bytes = px->groups * GGUF_GEMM_LANES * px->blocks * 256;
    const int64_t per_panel =
        x_bytes <= STRIP_PANEL_X_BYTES ? GGUF_GEMM_ROWS : panel_rows(strip / GGUF_GEMM_ROWS, row_end - row_begin);
    float tile[2][MAX_PANEL_ROWS * GGUF_GEMM_LANES] __attribute__((aligned(64))); /* a lane group's outputs */
    int64_t slab = SLAB_BYTES / (GGUF_GEMM_LANES * px->blocks * 256);
    if (slab < 1) slab = 1;
    for (int64_t g0 = 0; g0 < px->groups; g0 += slab) {
        const int64_t g1 = px->groups - g0 < slab ? px->groups : g0 + slab;
        for (int64_t first = row_begin, rows; first < row_end; first += rows) {
            rows = panel_at(first, g0, row_begin, row_end, per_panel);
            const int64_t strips = (rows + GGUF_GEMM_ROWS - 1) / GGUF_GEMM_ROWS;
            if (rows % GGUF_GEMM_ROWS) memset(panel + (strips - 1) * strip, 0, (size_t)strip);
            for (int64_t i = 0; i < rows; i++)
                gt->unpack(w + (first + i) * row_bytes, in, panel + i / GGUF_GEMM_ROWS * strip,
                           (int)(i % GGUF_GEMM_ROWS));
            /* the next panel's rows (or the next slab's first panel), a share per call */
            const int64_t next = first + rows < row_end ? first + rows : g1 < px->groups ? row_begin : row_end;
            const int64_t next_rows = panel_at(next, next == row_begin ? g1 : g0, row_begin, row_end, per_panel);
            /* kernel calls: two per strip for each pair of lane groups, one for a group left over */
            const int64_t lines = (next_rows * row_bytes + 63) / 64, calls = (g1 - g0) * strips;
            int64_t call = 0;
            for (int64_t g = g0; g < g1;) {
                const int pair = g + 1 < g1 && gt->pair ? 2 : 1;
                for (int64_t s = 0; s < strips; s++)
                    for (int half = 0; half < pair; half++, call++) {
                        const int64_t r = s * GGUF_GEMM_ROWS + (pair == 2 ? GGUF_GEMM_ROWS / 2 * half : 0);
                        const int64_t from = lines * call / calls, to = lines * (call + 1) / calls;
                        const int n = (int)(rows - r < GGUF_GEMM_ROWS / pair ? rows - r : GGUF_GEMM_ROWS / pair);
                        if (n <= 0) continue; /* the padding half of the last strip */
                        GgufGemmOut o[2];
                        for (int c = 0; c < pair; c++)
                            o[c] = (GgufGemmOut){tile[c], r, n, bias ? bias + first + r : NULL,
                                                 w + next * row_bytes + 64 * from, to - from,
                                                 (to - from + 8 * px->blocks - 1) / (8 * px->blocks), 0, px->blocks,
                                                 NULL};
                        if (pair == 2)
                            gt->pair(panel + s * strip, half, px, g, o);
                        else
                            gt->kernel(panel + s * strip, px, g, o);
                    }
                for (int c = 0; c < pair; c++, g++) copy_tile(tile[c], batch, g, rows, y + first, y_stride);
            }
        }
    }
}

/* Rows row_begin..row_end of y for a step of few lane groups (CHUNK_GROUPS at most), a strip at a
 * time in chunks of CHUNK_BLOCKS super-blocks: each chunk of a strip's rows is unpacked into
 * `chunk` (small enough for the core's first-level cache) and runs against every group at
 * once, the accumulators carried from chunk to chunk (gemm.h). The next strip's stored rows
 * are prefetched a share per call. */
static void gemm_chunked(const GgufGemmType *gt, const GgufGemmX *px, int64_t batch, const uint8_t *w, int64_t row_bytes, const float *bias, float *y, int64_t y_stride, int64_t row_begin,
                         int64_t row_end, uint8_t *chunk) {
    enum { R = GGUF_GEMM_ROWS, L = GGUF_GEMM_LANES };
    const int64_t K = px->blocks, block_bytes = row_bytes / K, groups = px->groups;
    const int64_t chunks = (K + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS, pairs = gt->chunk_pair ? groups / 2 : 0;
    const int64_t calls = chunks * groups; /* per strip: a pair's two halves are two calls over its two groups */
    float tile[CHUNK_GROUPS][R * L] __attribute__((aligned(64)));
    float state[CHUNK_GROUPS][R][8][L] __attribute__((aligned(64)));
    for (int64_t first = row_begin; first < row_end; first += R) {
        const int rows = row_end - first < R ? (int)(row_end - first) : R;
        const int64_t next_rows = row_end - first - rows < R ? row_end - first - rows : R;
        const int64_t lines = (next_rows * row_bytes + 63) / 64;
        const uint8_t *next = w + (first + rows) * row_bytes;
        int64_t call = 0;
        for (int64_t k0 = 0; k0 < K; k0 += CHUNK_BLOCKS) {
            const int64_t n = K - k0 < CHUNK_BLOCKS ? K - k0 : CHUNK_BLOCKS;
            if (rows < R) memset(chunk, 0, (size_t)(R * gt->panel_bytes(n)));
            for (int i = 0; i < rows; i++) gt->unpack(w + (first + i) * row_bytes + k0 * block_bytes, n * 256, chunk, i);
            for (int64_t g = 0; g < groups;) {
                const int pair = g < 2 * pairs ? 2 : 1;
                for (int half = 0; half < pair; half++, call++) {
                    const int r = pair == 2 ? R / 2 * half : 0, count = pair == 2 ? R / 2 : R;
                    const int64_t from = lines * call / calls, to = lines * (call + 1) / calls;
                    GgufGemmOut o[2];
                    for (int c = 0; c < pair; c++)
                        o[c] = (GgufGemmOut){tile[g + c], r, rows - r < count ? rows - r : count,
                                             bias ? bias + first + r : NULL, next + 64 * from, to - from,
                                             (to - from + 8 * n - 1) / (8 * n), k0, n, &state[g + c][r][0][0]};
                    if (o[0].rows <= 0) continue; /* the padding half of the last strip */
                    if (pair == 2)
                        gt->chunk_pair(chunk, half, px, g, o);
                    else
                        gt->chunk_kernel(chunk, px, g, o);
                }
                g += pair;
            }
        }
        for (int64_t g = 0; g < groups; g++) copy_tile(tile[g], batch, g, rows, y + first, y_stride);
    }
}

/* Rows row_begin..row_end of y: chunked where the step has few lane groups, the rows more than
 * one chunk and the type's kernels take chunks, else by panels (`panel`, panel_rows() unpacked rows, holds a chunk). */
static void gemm_rows_of(const GgufGemmType *gt, const GgufGemmX *px, int64_t batch, const uint8_t *w, int64_t in,
                         int64_t row_bytes, const float *bias, float *y, int64_t y_stride, int64_t row_begin,
                         int64_t row_end, uint8_t *panel) {
    if (gt->chunk_kernel && px->groups <= CHUNK_GROUPS && px->blocks > CHUNK_BLOCKS)
        gemm_chunked(gt, px, batch, w, row_bytes, bias, y, y_stride, row_begin, row_end, panel);
    else
        gemm_range(gt, px, batch, w, in, row_bytes, bias, y, y_stride, row_begin, row_end, panel);
}

/* This thread's panel buffer for `rows` weight rows, or NULL. */
static uint8_t *thread_panel(const GgufGemmType *gt, int64_t blocks, int64_t rows) {
    ThreadScratch *ts = thread_scratch();
    const int64_t pb = gt->panel_bytes(blocks);
    return ts ? scratch(&ts->panel, (size_t)(panel_rows(pb, rows) * pb)) : NULL;
}

int gguf_gemm_rows(const GgufGemmType *gt, const int8_t *qx, const float *scales, int64_t batch, const uint8_t *w,
                   int64_t in, int64_t row_bytes, const float *bias, float *y, int64_t y_stride, int64_t row_begin,
                   int64_t row_end) {
    ThreadScratch *ts = thread_scratch();
    const void *packed = ts ? scratch(&ts->packed, packed_bytes(batch, in)) : NULL;
    uint8_t *panel = thread_panel(gt, gguf_gemm_blocks(in), row_end - row_begin);
    if (!packed || !panel) return -3;
    const GgufGemmX px = packed_layout(packed, batch, in);
    for (int64_t g = 0; g < px.groups; g++) pack_group(qx, scales, batch, in, g, &px);
    gemm_rows_of(gt, &px, batch, w, in, row_bytes, bias, y, y_stride, row_begin, row_end, panel);
    scratch_trim(&ts->packed);
    return 0;
}

int gguf_gemm_linear(const GgufGemmType *gt, const int8_t *qx, const float *scales, int64_t batch, const uint8_t *w,
                     int64_t in, int64_t row_bytes, const float *bias, float *y, int64_t out, int parallel) {
    ThreadScratch *ts = thread_scratch();
    const void *packed = ts ? scratch(&ts->packed, packed_bytes(batch, in)) : NULL;
    if (!packed) return -3;
    const GgufGemmX px = packed_layout(packed, batch, in);
    int failed = 0;
    const int64_t units = (out + GGUF_GEMM_ROWS - 1) / GGUF_GEMM_ROWS;
#pragma omp parallel if (parallel) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < px.groups; g++) pack_group(qx, scales, batch, in, g, &px);
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t begin = units * me / threads * GGUF_GEMM_ROWS, end = units * (me + 1) / threads * GGUF_GEMM_ROWS;
        if (end > out) end = out;
        if (begin < end) {
            uint8_t *panel = thread_panel(gt, px.blocks, end - begin);
            if (panel)
                gemm_rows_of(gt, &px, batch, w, in, row_bytes, bias, y, out, begin, end, panel);
            else
                failed = 1;
        }
    }
    scratch_trim(&ts->packed);
    return failed ? -3 : 0;
}
