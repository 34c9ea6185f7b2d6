/* The routed experts of a mixture-of-experts layer in one call (#28): for a step's tokens,
 * already routed (expert ids and gate weights [tokens, top_k]), every chosen expert's
 * gated MLP, down(silu(gate x) * up x) (gpt-oss: its clamped SwiGLU, and biases), on the
 * rows of the tokens that picked it, the outputs scaled by their gate weights and summed
 * into out [tokens, hidden].
 *
 * Each projection is GGUF blocks as stored (gguf_rows.c; the weights may be views of the
 * mmapped file): an expert's gate, up and down matrices are read once per step whatever
 * its row count, and an expert no token picks is never read. The arithmetic is the per-op
 * path's (kvserve/model/moe.py with stored weights): the same activation rounding
 * (kvserve_quant_activations on the expert's rows), the same row sums (gguf_rows.c's sums
 * do not depend on the batch, the range or the thread), kvserve_silu_mul (or
 * kvserve_swiglu_clamped, which the per-op path runs too), the product by
 * the gate weight rounded before it is added, and the sums formed in ascending expert id,
 * an expert's rows ordered by (slot, token). So the result equals the per-op path's bit
 * for bit.
 *
 * The pairs (token, slot) are sorted by expert (a counting sort, stable in slot-major
 * order), then the threads split each phase's work: rounding the rows of each expert's
 * tokens, the gate/up rows of every active expert, SiLU*up and its rounding, the down rows and
 * their weighting (while in cache), and the sum (by output columns). The matmul phases go in work items of an expert's weight
 * rows: CHUNK_ROWS rows for an expert of a few rows, and for one of many rows (the dense
 * GEMM's, which packs its activations once per call) a thread's share of the matrix, so that
 * its rows are packed once per thread and not once per 64 weight rows. Each thread takes a run
 * of consecutive items (its weight reads stream on from one item to the next) of about equal
 * work (item_owner): a prompt's tokens crowd onto a few experts, so the items differ a lot.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kvserve.h"

#define CHUNK_ROWS 64                /* weight rows of one work item (whole GGUF tiles) */
#define PARALLEL_MIN_BYTES (256 * 1024) /* expert weight bytes a step reads: below this one thread */
#define SUM_COLUMNS 256              /* output columns of one summing work item */

/* The table row of expert e: gate blocks, gate type, up blocks, up type, down blocks, down type,
 * then the float32 biases of gate, up and down (0: none). */
enum { GATE_W, GATE_T, UP_W, UP_T, DOWN_W, DOWN_T, GATE_B, UP_B, DOWN_B, TABLE_COLUMNS };

/* One matmul work item: weight rows [begin, end) of active expert a's gate (part 0), up (1) or
 * down (2) projection; `before` the work of the phase's items ahead of it, `work` its own. */
typedef struct {
    int64_t a, begin, end, before, work;
    int part;
} MoeItem;

typedef struct {
    const float *x;
    const int64_t *table;
    float *out;
    int64_t tokens, hidden, width, pairs, active;
    int isa, swiglu;  /* swiglu: gpt-oss's clamped SwiGLU (limit, alpha) in place of SiLU */
    float limit, alpha;
    const int64_t *experts; /* [active] the active expert ids, ascending */
    const int64_t *start;   /* [active + 1] each active expert's first sorted pair */
    const int64_t *token;   /* [pairs] the token of each sorted pair */
    const float *weight;    /* [pairs] its gate weight */
    float *rows;            /* [pairs, hidden] the down outputs, weighted */
    int8_t *qx;             /* [pairs, hidden] */
    float *sx;              /* 2 * pairs * hidden / 32 */
    float *gate_up;         /* [pairs, 2 width] */
    float *h;               /* [pairs, width] */
    int8_t *qh;             /* [pairs, width] */
    float *sh;              /* 2 * pairs * width / 32 */
    const MoeItem *gate_up_items, *down_items;
    int64_t gate_up_count, down_count, gate_up_work, down_work;
} MoeStep;

static const uint8_t *blocks_of(const MoeStep *s, int64_t e, int column) {
    return (const uint8_t *)(intptr_t)s->table[e * TABLE_COLUMNS + column];
}

static const float *bias_of(const MoeStep *s, int64_t e, int column) {
    return (const float *)(intptr_t)s->table[e * TABLE_COLUMNS + column];
}

/* Round the rows of active expert a's tokens, laid out for a batch of its rows (as
 * kvserve_quant_activations lays out a batch: row i's dx at i * blocks, its sx at (n + i) * blocks),
 * each straight from its token's row of x. */
static void round_inputs(const MoeStep *s, int64_t a) {
    const int64_t first = s->start[a], n = s->start[a + 1] - first, blocks = s->hidden / 32;
    float *scales = s->sx + 2 * first * blocks;
    for (int64_t i = 0; i < n; i++)
        kvserve_quant_activation_blocks(s->x + s->token[first + i] * s->hidden, s->hidden,
                                        s->qx + (first + i) * s->hidden, scales + i * blocks, scales + (n + i) * blocks);
}

/* Rows [begin, end) of active expert a's gate (0) or up (1) projection. */
static void gate_up_rows(const MoeStep *s, int64_t a, int up, int64_t begin, int64_t end) {
    const int64_t e = s->experts[a], first = s->start[a], n = s->start[a + 1] - first;
    kvserve_gguf_rows(s->qx + first * s->hidden, s->sx + 2 * first * (s->hidden / 32), n,
                      blocks_of(s, e, up ? UP_W : GATE_W), (int)s->table[e * TABLE_COLUMNS + (up ? UP_T : GATE_T)],
                      s->hidden, bias_of(s, e, up ? UP_B : GATE_B), s->gate_up + first * 2 * s->width + (up ? s->width : 0), 2 * s->width, s->isa,
                      begin, end);
}

static void gated_item(const MoeStep *s, int64_t a) {
    const int64_t first = s->start[a], n = s->start[a + 1] - first;
    if (s->swiglu)
        kvserve_swiglu_clamped(s->gate_up + first * 2 * s->width, s->h + first * s->width, n, s->width, s->limit,
                               s->alpha, F32, 1);
    else
        kvserve_silu_mul(s->gate_up + first * 2 * s->width, s->h + first * s->width, n, s->width, F32, 1);
    kvserve_quant_activations(s->h + first * s->width, s->width, n, s->width, 8, s->qh + first * s->width,
                              s->sh + 2 * first * (s->width / 32));
}

/* Rows [begin, end) of active expert a's down projection (output columns [begin, end) of its
 * pairs), each pair's scaled by its gate weight while still in cache: the product rounded and
 * stored, as the per-op path's y * w before it is added. */
static void down_rows(const MoeStep *s, int64_t a, int64_t begin, int64_t end) {
    const int64_t e = s->experts[a], first = s->start[a], n = s->start[a + 1] - first;
    float *y = s->rows + first * s->hidden;
    kvserve_gguf_rows(s->qh + first * s->width, s->sh + 2 * first * (s->width / 32), n, blocks_of(s, e, DOWN_W),
                      (int)s->table[e * TABLE_COLUMNS + DOWN_T], s->width, bias_of(s, e, DOWN_B), y, s->hidden,
                      s->isa, begin, end);
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = begin; c < end; c++) y[i * s->hidden + c] *= s->weight[first + i];
}

/* The rows of one item of a projection of `rows` weight rows for active expert a of n tokens:
 * CHUNK_ROWS, or from the GEMM's batch on, a thread's share in whole CHUNK_ROWS. */
static int64_t item_rows(int64_t n, int64_t rows, int threads) {
    if (n < kvserve_gguf_gemm_min_batch() || threads <= 1) return n < kvserve_gguf_gemm_min_batch() ? CHUNK_ROWS : rows;
    const int64_t share = (rows + threads - 1) / threads;
    return (share + CHUNK_ROWS - 1) / CHUNK_ROWS * CHUNK_ROWS;
}

/* Appends active expert a's items of projection `part` (`rows` weight rows) to items, adding
 * their work to *total; returns the new count. An item's work: its weight rows times the cost of
 * reading one (about that of multiplying it by 1.25 activation rows) plus multiplying it by n. */
static int64_t add_items(MoeItem *items, int64_t count, int64_t a, int64_t n, int part, int64_t rows, int threads,
                         int64_t *total) {
    const int64_t step = item_rows(n, rows, threads);
    for (int64_t begin = 0; begin < rows; begin += step) {
        const int64_t end = begin + step < rows ? begin + step : rows, work = (end - begin) * (5 + 4 * n);
        items[count++] = (MoeItem){a, begin, end, *total, work, part};
        *total += work;
    }
    return count;
}

/* The thread that runs an item: the one whose share of the phase's work holds the item's middle. */
static int item_owner(const MoeItem *item, int64_t total, int threads) {
    const int owner = (int)((2 * item->before + item->work) * threads / (2 * total));
    return owner < threads ? owner : threads - 1;
}

/* Columns c0..c1 of out: zero, then each pair's weighted row (down_rows) added, experts ascending. */
static void sum_item(const MoeStep *s, int64_t c0, int64_t c1) {
    for (int64_t t = 0; t < s->tokens; t++) memset(s->out + t * s->hidden + c0, 0, sizeof(float) * (size_t)(c1 - c0));
    for (int64_t r = 0; r < s->pairs; r++) {
        float *dst = s->out + s->token[r] * s->hidden;
        const float *src = s->rows + r * s->hidden;
        for (int64_t c = c0; c < c1; c++) dst[c] += src[c];
    }
}

/* Every phase, the work split over the calling team (or run alone outside a parallel region). */
static void run_step(const MoeStep *s) {
    const int64_t sum_items = (s->hidden + SUM_COLUMNS - 1) / SUM_COLUMNS;
    const int tid = omp_get_thread_num(), threads = omp_get_num_threads();
#pragma omp for schedule(static)
    for (int64_t a = 0; a < s->active; a++) round_inputs(s, a);
    for (int64_t i = 0; i < s->gate_up_count; i++) {
        const MoeItem *item = &s->gate_up_items[i];
        if (item_owner(item, s->gate_up_work, threads) == tid) gate_up_rows(s, item->a, item->part, item->begin, item->end);
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t a = 0; a < s->active; a++) gated_item(s, a);
    for (int64_t i = 0; i < s->down_count; i++) {
        const MoeItem *item = &s->down_items[i];
        if (item_owner(item, s->down_work, threads) == tid) down_rows(s, item->a, item->begin, item->end);
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t i = 0; i < sum_items; i++)
        sum_item(s, i * SUM_COLUMNS, (i + 1) * SUM_COLUMNS < s->hidden ? (i + 1) * SUM_COLUMNS : s->hidden);
}

/* Whether every expert some pair picks has blocks the kernels take at these widths; adds up
 * the bytes a step reads. */
static int check_experts(const int64_t *table, const int64_t *experts, int64_t active, int64_t hidden, int64_t width,
                         int isa, int64_t *bytes) {
    *bytes = 0;
    for (int64_t a = 0; a < active; a++) {
        const int64_t *row = table + experts[a] * TABLE_COLUMNS;
        const int64_t gate = kvserve_gguf_row_bytes((int)row[GATE_T], hidden);
        const int64_t up = kvserve_gguf_row_bytes((int)row[UP_T], hidden);
        const int64_t down = kvserve_gguf_row_bytes((int)row[DOWN_T], width);
        if (gate < 0 || up < 0 || down < 0 || !row[GATE_W] || !row[UP_W] || !row[DOWN_W]) return 0;
        if (!kvserve_gguf_supported((int)row[GATE_T], isa) || !kvserve_gguf_supported((int)row[UP_T], isa) ||
            !kvserve_gguf_supported((int)row[DOWN_T], isa))
            return 0;
        *bytes += (gate + up) * width + down * hidden;
    }
    return 1;
}

/* out [tokens, hidden] = sum over each token's top_k picks (ids [tokens, top_k] int64, gate
 * weights float32 alike) of weight * expert(x row), x float32 [tokens, hidden] contiguous.
 * table [num_experts, 9] int64: per expert its gate, up and down blocks (addresses) and ggml
 * types (gate and up [width, hidden], down [hidden, width]), then its gate, up and down
 * biases (float32 addresses, 0: none). The gated product is SiLU(gate) * up, or with
 * `swiglu` gpt-oss's clamped SwiGLU of `limit` and `alpha`. isa: gguf_rows.c's path.
 * workspace: kvserve_moe_experts_workspace() bytes the call may use for its intermediates
 * (NULL or fewer bytes: it allocates them itself).
 * Returns 0; -1 for bad arguments (an id out of range, a type or width the kernels do not
 * take), -2 when `isa` does not run here, -3 when out of memory. */
/* The float32 intermediates of a step of `pairs` (token, slot) pairs, in floats. */
static size_t step_floats(int64_t pairs, int64_t hidden, int64_t width) {
    return (size_t)(pairs * (hidden + 2 * (hidden / 32) + 3 * width + 2 * (width / 32) + 1));
}

/* Bytes of the workspace kvserve_moe_experts takes for a step of `tokens` tokens: its float32
 * intermediates, then its int8 ones. */
int64_t kvserve_moe_experts_workspace(int64_t tokens, int64_t top_k, int64_t hidden, int64_t width) {
    const int64_t pairs = tokens * top_k;
    return (int64_t)((sizeof(float) * step_floats(pairs, hidden, width) + 63) / 64 * 64) + pairs * (hidden + width) + 64;
}

int kvserve_moe_experts(const float *x, int64_t tokens, int64_t hidden, const int64_t *ids, const float *weights,
                        int64_t top_k, const int64_t *table, int64_t num_experts, int64_t width, int swiglu,
                        float limit, float alpha, float *out, int isa, int num_threads, void *workspace,
                        int64_t workspace_bytes) {
    if (tokens < 0 || top_k <= 0 || num_experts <= 0 || hidden <= 0 || width <= 0 || hidden % 32 || width % 32)
        return -1;
    if (isa < 0 || isa >= ISA_COUNT || !kvserve_isa_available(KV_KERNEL_QUANT, isa)) return -2;
    if (tokens == 0) return 0;
    const int64_t pairs = tokens * top_k;
    for (int64_t p = 0; p < pairs; p++)
        if (ids[p] < 0 || ids[p] >= num_experts) return -1;
    /* index: count [E], experts [E] (the active ones, ascending), start [E + 1], token [pairs] */
    int64_t *index = calloc((size_t)(3 * num_experts + 1 + pairs), sizeof(int64_t));
    const size_t floats = step_floats(pairs, hidden, width);
    /* The intermediates: in the caller's workspace where it is large enough (a many-token step's
     * are hundreds of MB, whose fresh pages would fault and be zeroed on every call), else fresh. */
    const int owned = !workspace || workspace_bytes < kvserve_moe_experts_workspace(tokens, top_k, hidden, width);
    float *buffer = owned ? malloc(sizeof(float) * floats) : workspace;
    int8_t *quantized = owned ? malloc((size_t)(pairs * (hidden + width)) + 64)
                              : (int8_t *)workspace + (sizeof(float) * floats + 63) / 64 * 64;
    if (!index || !buffer || !quantized) {
        free(index);
        if (owned) {
            free(buffer);
            free(quantized);
        }
        return -3;
    }
    int64_t *count = index, *experts = count + num_experts, *start = experts + num_experts;
    int64_t *token = start + num_experts + 1;
    float *weight = buffer + floats - (size_t)pairs;
    /* A counting sort of the pairs (slot * tokens + token) by expert, stable: within an expert
     * in (slot, token) order, as the per-op path's stable argsort. */
    for (int64_t p = 0; p < pairs; p++) count[ids[p]]++;
    int64_t active = 0;
    for (int64_t e = 0, at = 0; e < num_experts; e++) {
        const int64_t n = count[e];
        count[e] = at; /* from here: the next free sorted position of expert e */
        if (n) {
            start[active] = at;
            experts[active++] = e;
        }
        at += n;
    }
    start[active] = pairs;
    for (int64_t slot = 0; slot < top_k; slot++)
        for (int64_t t = 0; t < tokens; t++) {
            const int64_t at = count[ids[t * top_k + slot]]++;
            token[at] = t;
            weight[at] = weights[t * top_k + slot];
        }
    int64_t bytes;
    int code = 0;
    if (!check_experts(table, experts, active, hidden, width, isa, &bytes)) {
        code = -1;
    } else {
        float *rows = buffer, *sx = rows + pairs * hidden, *gate_up = sx + 2 * pairs * (hidden / 32);
        float *h = gate_up + 2 * pairs * width, *sh = h + pairs * width;
        const int threads = bytes >= PARALLEL_MIN_BYTES && num_threads > 1 ? num_threads : 1;
        const int64_t most = active * (2 * ((width + CHUNK_ROWS - 1) / CHUNK_ROWS) + (hidden + CHUNK_ROWS - 1) / CHUNK_ROWS);
        MoeItem *items = malloc(sizeof(MoeItem) * (size_t)most);
        if (!items) {
            code = -3;
        } else {
            int64_t gate_up_count = 0, down_count = 0, gate_up_work = 0, down_work = 0;
            for (int64_t a = 0; a < active; a++) {
                const int64_t n = start[a + 1] - start[a];
                gate_up_count = add_items(items, gate_up_count, a, n, 0, width, threads, &gate_up_work);
                gate_up_count = add_items(items, gate_up_count, a, n, 1, width, threads, &gate_up_work);
            }
            MoeItem *down_items = items + gate_up_count;
            for (int64_t a = 0; a < active; a++)
                down_count = add_items(down_items, down_count, a, start[a + 1] - start[a], 2, hidden, threads,
                                       &down_work);
            MoeStep step = {x, table, out, tokens, hidden, width, pairs, active, isa, swiglu, limit, alpha, experts,
                            start, token, weight, rows, quantized, sx, gate_up, h, quantized + pairs * hidden, sh,
                            items, down_items, gate_up_count, down_count, gate_up_work, down_work};
#pragma omp parallel num_threads(threads) if (threads > 1)
            run_step(&step);
            free(items);
        }
    }
    free(index);
    if (owned) {
        free(buffer);
        free(quantized);
    }
    return code;
}
