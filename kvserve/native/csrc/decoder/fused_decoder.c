/* The whole decoder stack for a small step (a few tokens) in one native call.
 *
 * For every layer: RMSNorm -> QKV projection -> Q/K norms -> RoPE -> K/V write
 * into the block-paged cache -> paged attention in place -> O projection ->
 * residual -> norm -> gate/up projection -> SiLU or GELU(tanh) gate -> down
 * projection -> residual (Gemma's sandwich norms where the model has them),
 * then the final norm. Python calls it once per step (kvserve/model/
 * native_decoder.py) instead of ~10 op calls per layer.
 *
 * One OpenMP parallel region covers the whole call: starting a region costs
 * tens of microseconds on a virtual machine, more than a layer's work at batch
 * one. Inside it the threads split each matrix's output rows and the
 * attention's KV heads, and meet at a barrier after each; with fewer_barriers
 * (off by default) they split the O and down
 * projections by input columns and attention by query heads, each computing the
 * QKV rows and K/V writes its heads need, so that SmolLM2 and the Llama-1B shape
 * on 2 threads meet twice a layer.
 * The barrier is a spinning one of our own (spin_barrier below), not OpenMP's:
 * libgomp spins only ~1000 times once its thread pools together hold more
 * threads than there are CPUs (torch's pool and this call's each count), then
 * sleeps on a futex, and waking a sleeping vCPU costs ~100 us per barrier.
 * The element-wise steps between them (norms, residual adds, the gate
 * activation, quantizing the activations) are cheap at these sizes, so every
 * thread computes them itself into its own buffers rather than wait for one.
 *
 * Every step reuses the kernels of the per-op path (quant_linear.c, gguf_rows.c,
 * small_linear.c, fused_ops.c, paged_attention.c) on the same inputs, so the
 * result equals the torch path's up to the order of float32 sums where that
 * path would pick oneDNN instead. Activations are float32; the KV cache may be
 * float32, bfloat16 or float16. Bfloat16 weights go through bf16_rows.c, which rounds
 * each matmul's input to bfloat16 but nothing else: closer to float32 than the
 * per-op bfloat16 path, which rounds every intermediate.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kvserve.h"
#include "phase_timer.h"

#define TOKEN_SPLIT_MIN 8 /* steps of this many tokens split attention by tokens, not KV heads */
#define SPLIT_BLOCKS 8    /* blocks of 32 input columns per run of a matmul split by its input */

/* Buffers each thread keeps for itself. */
typedef struct {
    float *residual, *x, *act; /* [T, hidden], [T, max(hidden, intermediate)], [T, intermediate] */
    void *qx;                  /* quantized activations (or the panel GEMM's prepared ones) */
    float *scales;
    void *panel;      /* the panel GEMM's weight panel */
    float *sum;       /* [T, hidden]: a split matmul's output, its runs added up */
    float *gate_up;   /* [T, 2 * intermediate]: this thread's gate and up columns, side by side */
    float *kv;        /* [T, 2, head_dim]: one KV head's K and V rows */
    float *dn;        /* [2 Dk + 2 Dv]: a Gated DeltaNet head's q, k, scratch and output */
    int64_t *bounds;  /* a split matmul's run bounds, in blocks */
    float *gather;    /* [T, hidden]: the rows of the tokens an expert runs on */
    int64_t *route_id, *pair_token, *expert_end; /* [T, top_k], [T * top_k], [experts] */
    float *route_weight, *pair_weight;           /* [T, top_k], [T * top_k] */
    float *qk_inv;    /* [T, 2]: a Q/K norm over the whole projection: each token's 1 / rms of Q and of K */
    const float *out; /* the last layer's output: Shared.out or sum */
    PhaseTimer timer;
    struct SpinBarrier *barrier;
    int routing_tie; /* this thread found a routing tie (so did every other thread): it stops */
} Private;

/* Threads of one call meet here: arrivals count up, the last one advances `generation`. */
typedef struct SpinBarrier {
    atomic_int arrived, generation;
    int nthreads;
} SpinBarrier;

static void spin_barrier(SpinBarrier *b) {
    if (b->nthreads <= 1) return;
    const int generation = atomic_load_explicit(&b->generation, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == b->nthreads - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->generation, generation + 1, memory_order_release);
        return;
    }
    /* Spin (~1 ms), then yield: with more threads than free cores the late thread needs the core. */
    for (unsigned spins = 0; atomic_load_explicit(&b->generation, memory_order_acquire) == generation; spins++) {
        if (spins < (1u << 15)) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        } else {
            sched_yield();
        }
    }
}

/* Buffers all threads write (disjoint parts) and then read. */
typedef struct {
    float *qkv, *attn, *out, *gate_up; /* [T, qkv width], [T, q size], [T, hidden], [T, 2 * intermediate] */
    float *ba;                         /* Gated DeltaNet: [T, 2 Hv] */
    float *conv_out;                   /* Mamba-2: [T, conv_dim], the step kernel's scratch */
    float *o_runs, *down_runs;         /* a split O / down projection's partial products [runs, T, hidden] */
    float *moe_gate_up, *moe_down;     /* experts' gate/up and down outputs, by (token, expert) pair */
    float *router;                     /* [T, experts]: a MoE router's logits, each thread its share of the experts */
    int reduce_failed;                 /* set by thread 0 when an all-reduce failed: every thread stops */
    int routing_tie;                   /* set by every thread when a token's top k ends in a tie: all stop */
} Shared;

static void split_rows(int64_t out, int64_t unit, int tid, int nthreads, int64_t *begin, int64_t *end) {
    /* Whole tiles of `unit` rows per thread, so each row's sum is the per-op path's. */
    const int64_t tiles = (out + unit - 1) / unit;
    *begin = tiles * tid / nthreads * unit;
    *end = tiles * (tid + 1) / nthreads * unit;
    if (*begin > out) *begin = out;
    if (*end > out) *end = out;
}

/* How a linear multiplies a step's rows; the paths differ in what they prepare from x
 * and in the unit of rows they share out. PATH_SINGLE_ROWS: a verify step whose only plain
 * token is the first, each row multiplied as a step of one token (the single-row kernel's sums).
 * PATH_GGUF: GGUF blocks as stored (gguf_rows.c), whose every row gets the sums a step of one
 * token gives it, whatever the step's size. */
enum { PATH_PANEL, PATH_SINGLE_ROWS, PATH_QUANT, PATH_BF16, PATH_F32, PATH_F32_PANELS, PATH_GGUF };

/* The path of a step of T rows whose kernel is that of a step of `plain_rows` tokens (T less its drafts). */
static int linear_path(const NativeModel *m, const NativeLinear *l, int64_t T, int64_t plain_rows) {
    if (l->num_parts) return PATH_GGUF;
    if (l->qs && l->panel_isa >= 0 && m->panel_rows && plain_rows >= m->panel_rows) return PATH_PANEL;
    if (l->qs && plain_rows == 1 && T > 1 && kvserve_quant_single_row_kernel(l->act_bits, l->isa))
        return PATH_SINGLE_ROWS;
    if (l->qs) return PATH_QUANT;
    if (l->w_dtype == F32_PANELS) return PATH_F32_PANELS;
    return l->w_dtype == BF16 ? PATH_BF16 : PATH_F32;
}

/* Whole tiles of this many rows, so each row's sum is the per-op path's
 * (PANEL_ROWS of quant_gemm.c for the panel GEMM, PANEL of f32_gemm.c for its panels). */
static int64_t path_unit(int path) { return path == PATH_PANEL || path == PATH_F32_PANELS ? 16 : 4; }

/* PATH_SINGLE_ROWS: row t's quantized activations and scales, each row at its own offset. */
static void *single_row_qx(const NativeLinear *l, const Private *p, int64_t t) {
    return (char *)p->qx + t * 2 * l->in;
}
static float *single_row_scales(const NativeLinear *l, const Private *p, int64_t t) {
    return p->scales + t * 2 * (l->in / 32);
}

/* This thread's copy of x prepared for the path's kernel in p->qx (and p->scales):
 * quantized, laid out for the panel GEMM, or rounded to bfloat16. */
static void linear_prepare(const NativeLinear *l, int path, const float *x, int64_t T, Private *p) {
    if (path == PATH_F32 || path == PATH_F32_PANELS) return;
    if (path == PATH_PANEL)
        kvserve_quant_gemm_prepare(x, l->in, T, l->in, F32, l->panel_isa, p->qx);
    else if (path == PATH_SINGLE_ROWS)
        for (int64_t t = 0; t < T; t++)
            kvserve_quant_activations(x + t * l->in, l->in, 1, l->in, l->act_bits, single_row_qx(l, p, t),
                                      single_row_scales(l, p, t));
    else if (path == PATH_QUANT)
        kvserve_quant_activations(x, l->in, T, l->in, l->act_bits, p->qx, p->scales);
    else if (path == PATH_GGUF)
        kvserve_quant_activations(x, l->in, T, l->in, 8, p->qx, p->scales);
    else /* bf16_rows.c: x rounded to bfloat16 into this thread's buffer */
        kvserve_bf16_round_rows(x, l->in, T, l->in, (uint16_t *)p->qx);
    phase_mark(&p->timer, PHASE_QUANTIZE);
}

/* Rows [begin, end) of y [T, out] = x [T, in] W^T (+ bias) for GGUF blocks as stored: each
 * part's share of them, by its own type's kernel. */
static void gguf_range(const NativeLinear *l, const Private *p, int64_t T, float *y, int64_t begin, int64_t end) {
    int64_t first = 0;
    for (int i = 0; i < l->num_parts; first = l->part_end[i++]) {
        const int64_t b = begin > first ? begin : first, e = end < l->part_end[i] ? end : l->part_end[i];
        if (b < e)
            kvserve_gguf_rows((const int8_t *)p->qx, p->scales, T, l->part_blocks[i], l->part_type[i], l->in,
                              l->bias ? l->bias + first : NULL, y + first, l->out, l->isa, b - first, e - first);
    }
}

/* Rows [begin, end) of y [T, out] = x [T, in] W^T (+ bias), after linear_prepare. */
static void linear_range(const NativeLinear *l, int path, const float *x, int64_t T, Private *p, float *y,
                         int64_t begin, int64_t end) {
    if (path == PATH_GGUF) {
        gguf_range(l, p, T, y, begin, end);
    } else if (path == PATH_PANEL) {
        kvserve_quant_gemm_rows(p->qx, T, l->qs, l->d, l->m, l->bits, l->in, l->bias, y, l->out, l->panel_isa, begin,
                                end, p->panel);
    } else if (path == PATH_SINGLE_ROWS) {
        for (int64_t t = 0; t < T; t++)
            kvserve_quant_rows(single_row_qx(l, p, t), single_row_scales(l, p, t), 1, l->qs, l->d,
                               l->zero_min ? NULL : l->m, l->bits, l->in, l->bias, y + t * l->out, l->out,
                               l->act_bits, l->isa, begin, end);
    } else if (path == PATH_QUANT) {
        kvserve_quant_rows(p->qx, p->scales, T, l->qs, l->d, l->zero_min ? NULL : l->m, l->bits, l->in, l->bias, y,
                           l->out, l->act_bits, l->isa, begin, end);
    } else if (path == PATH_F32_PANELS) {
        kvserve_f32_gemm_rows(x, l->in, T, (const float *)l->w, l->bias, l->in, y, l->out, l->isa, begin, end);
    } else if (path == PATH_BF16) {
        kvserve_bf16_linear_rows((const uint16_t *)p->qx, T, (const uint16_t *)l->w, l->bias, l->in, y, l->out,
                                 l->isa, begin, end);
    } else if (!kvserve_small_linear_rows(x, l->in, l->w, l->bias, l->in, y, l->out, T, F32, begin, end)) {
        for (int64_t t = 0; t < T; t++) /* portable fallback */
            for (int64_t r = begin; r < end; r++) {
                const float *wr = (const float *)l->w + r * l->in, *xt = x + t * l->in;
                float s = 0.0f;
                for (int64_t i = 0; i < l->in; i++) s += wr[i] * xt[i];
                y[t * l->out + r] = s + (l->bias ? l->bias[r] : 0.0f);
            }
    }
}

/* This thread's rows of y [T, out] = x [T, in] W^T (+ bias); x is this thread's own copy.
 * The kernel is the one a step of `plain_rows` tokens (T less its drafts) takes. */
static void linear_rows(const NativeModel *m, const NativeLinear *l, const float *x, int64_t T, int64_t plain_rows,
                        Private *p, float *y, int tid, int nthreads) {
    const int path = linear_path(m, l, T, plain_rows);
    int64_t begin, end;
    split_rows(l->out, path_unit(path), tid, nthreads, &begin, &end);
    linear_prepare(l, path, x, T, p);
    linear_range(l, path, x, T, p, y, begin, end);
}

/* ---- matmuls split by their input columns -------------------------------------------
 * A projection whose input each thread holds only in part (its attention heads' output, its
 * columns of the MLP activation) is split by input columns instead of output rows: each
 * thread multiplies its columns into partial products, and every thread adds them up after
 * the next barrier. That saves the barrier before the projection. The columns go in fixed
 * runs, each run's partial products in a buffer of their own, added up in run order: a row's
 * result does not depend on the thread count or on the step's other rows, only its float32
 * summation order differs from the unsplit kernel's (the integer block sums are the same).
 * Taken where the projection runs quant_gemv.c's single-row kernel (int8 activations,
 * AVX512-VNNI, 4- or 8-bit weights; runs of SPLIT_BLOCKS blocks, the last one taking the
 * rest) or is one GGUF tensor as stored (every path; gguf_rows.c's runs: a few runs of
 * whole blocks), on one rank; other paths keep the split by rows and its barrier. */

/* Whether a step of T rows (plain_rows of them not drafts) splits l by its input columns
 * (never by the thread count: the split changes the float32 order of the sums). `granule`:
 * columns a GGUF split's runs are whole multiples of where the width allows (O: the head
 * size, so that threads holding whole heads hold whole runs), or 0. */
static int splits_by_input(const NativeModel *m, const NativeLinear *l, int64_t granule, int64_t T,
                           int64_t plain_rows) {
    const int path = linear_path(m, l, T, plain_rows);
    if (!m->fewer_barriers || m->all_reduce) return 0;
    if (path == PATH_GGUF)
        return l->num_parts == 1 && kvserve_gguf_split_runs(l->part_type[0], l->in, granule) > 1;
    return l->qs && (l->bits == 4 || l->bits == 8) && (path == PATH_QUANT || path == PATH_SINGLE_ROWS) &&
           kvserve_quant_single_row_kernel(l->act_bits, l->isa);
}

static int64_t run_count(const NativeLinear *l, int64_t granule) {
    if (l->num_parts) return kvserve_gguf_split_runs(l->part_type[0], l->in, granule);
    const int64_t runs = l->in / 32 / SPLIT_BLOCKS;
    return runs > 0 ? runs : 1;
}

/* The most runs a split matmul of `in` columns has (its buffers' size). */
static int64_t max_runs(int64_t in) {
    const int64_t runs = in / 32 / SPLIT_BLOCKS;
    return runs > GGUF_SPLIT_RUNS ? runs : GGUF_SPLIT_RUNS;
}

/* The first 32-column block of run c (c = run_count: the end of the row). */
static int64_t run_bound(const NativeLinear *l, int64_t granule, int64_t c) {
    if (l->num_parts) return kvserve_gguf_split_bound(l->part_type[0], l->in, granule, c);
    return c < run_count(l, granule) ? c * SPLIT_BLOCKS : l->in / 32;
}

/* The run that starts at input column `col`, or -1 where none does. */
static int64_t run_at(const NativeLinear *l, int64_t granule, int64_t col) {
    for (int64_t c = 0; c <= run_count(l, granule); c++)
        if (run_bound(l, granule, c) * 32 == col) return c;
    return -1;
}

/* Runs [run_begin, run_end) of x [T, in] W^T into runs [runs, T, out] (run_stride T * out):
 * this thread quantizes the runs' columns of each row and multiplies them (PHASE_QUANTIZE,
 * then `phase`). */
static void split_range(const NativeLinear *l, int64_t granule, const float *x, int64_t T, Private *p, float *runs,
                        int64_t run_begin, int64_t run_end, int phase) {
    if (run_begin >= run_end) return;
    const int64_t nb = l->in / 32, b0 = run_bound(l, granule, run_begin), b1 = run_bound(l, granule, run_end);
    for (int64_t c = run_begin; c <= run_end; c++) p->bounds[c - run_begin] = run_bound(l, granule, c);
    if (l->num_parts) { /* GGUF as stored: the runs' columns of every row into the [T, in] buffers */
        for (int64_t t = 0; t < T; t++)
            kvserve_quant_activation_blocks(x + t * l->in + b0 * 32, (b1 - b0) * 32,
                                            (int8_t *)p->qx + t * l->in + b0 * 32, p->scales + t * nb + b0,
                                            p->scales + T * nb + t * nb + b0);
        phase_mark(&p->timer, PHASE_QUANTIZE);
        kvserve_gguf_partials((const int8_t *)p->qx, p->scales, T, l->part_blocks[0], l->part_type[0], l->in,
                              p->bounds, run_end - run_begin, runs + run_begin * T * l->out, l->out, T * l->out,
                              l->isa, 0, l->out);
        phase_mark(&p->timer, phase);
        return;
    }
    for (int64_t t = 0; t < T; t++) {
        float *dx = single_row_scales(l, p, t);
        kvserve_quantize_row8(x + t * l->in + b0 * 32, (b1 - b0) * 32, (int8_t *)single_row_qx(l, p, t) + b0 * 32,
                              dx + b0, dx + nb + b0);
    }
    phase_mark(&p->timer, PHASE_QUANTIZE);
    for (int64_t t = 0; t < T; t++) {
        const float *dx = single_row_scales(l, p, t);
        kvserve_gemv_partials((const int8_t *)single_row_qx(l, p, t), dx, dx + nb, l->qs, l->d,
                              l->zero_min ? NULL : l->m, l->bits, l->in, p->bounds, run_end - run_begin,
                              runs + run_begin * T * l->out + t * l->out, T * l->out, 0, l->out);
    }
    phase_mark(&p->timer, phase);
}

/* out [T, width] = the sum of runs [runs, T, width] in run order (+ bias). */
static void sum_runs(const float *runs, int64_t num_runs, int64_t T, int64_t width, const float *bias, float *out) {
    const int64_t n = T * width;
    memcpy(out, runs, sizeof(float) * (size_t)n);
    for (int64_t c = 1; c < num_runs; c++)
        for (int64_t i = 0; i < n; i++) out[i] += runs[c * n + i];
    if (bias)
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < width; i++) out[t * width + i] += bias[i];
}

static void norm(const NativeModel *m, const float *x, float *residual, const float *w, float *out, int64_t T) {
    kvserve_rms_norm(x, residual, w, out, T, m->hidden, m->hidden, m->eps, m->adds_one, F32, 1);
}

/* act [T, I] = gelu_tanh(gate) * up, in float32 as torch computes it. */
static void gelu_tanh_mul(const float *gate_up, float *act, int64_t T, int64_t width) {
    const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < width; i++) {
            float g = gate_up[t * 2 * width + i];
            float inner = k * (g + 0.044715f * g * g * g);
            act[t * width + i] = 0.5f * g * (1.0f + tanhf(inner)) * gate_up[t * 2 * width + width + i];
        }
}

/* The query rows of one head in the QKV projection's output: its query, then (output_gate) its gate. */
static int64_t q_stride(const NativeModel *m) { return m->output_gate ? 2 * m->head_dim : m->head_dim; }

/* The width of the QKV projection's output rows. */
static int64_t qkv_width(const NativeModel *m) {
    return m->num_heads * q_stride(m) + 2 * m->num_kv_heads * m->head_dim;
}

/* The dimensions RoPE rotates (the first ones of each head; cos/sin rows hold as many). */
static int64_t rotary_dim(const NativeModel *m) { return m->rotary_dim ? m->rotary_dim : m->head_dim; }

/* RoPE of the step's heads x [T, heads] (token stride `stride`, head stride `head_stride`) with
 * the step's cos/sin rows: the first rotary_dim dimensions of each head. */
static void rope(const NativeModel *m, const NativeStep *st, float *x, int64_t stride, int64_t head_stride,
                 int64_t heads, const float *cos, const float *sin) {
    const int64_t R = rotary_dim(m);
    if (m->no_rope) return;
    if (!st->rope_by_position) {
        kvserve_rotary(x, stride, head_stride, cos, sin, st->num_tokens, heads, R, F32, 1);
        return;
    }
    for (int64_t t = 0; t < st->num_tokens; t++)
        kvserve_rotary(x + t * stride, stride, head_stride, cos + st->positions[t] * R, sin + st->positions[t] * R, 1,
                       heads, R, F32, 1);
}

/* output_gate: the attention output of tokens [t0, t1), query heads [h0, h1) times sigmoid(gate). */
static void gate_output(const NativeModel *m, const Shared *s, int64_t t0, int64_t t1, int64_t h0, int64_t h1) {
    if (!m->output_gate) return;
    const int64_t D = m->head_dim, width = qkv_width(m), q_size = m->num_heads * D;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t h = h0; h < h1; h++) {
            float *out = s->attn + t * q_size + h * D;
            const float *gate = s->qkv + t * width + h * 2 * D + D;
            for (int64_t i = 0; i < D; i++) out[i] *= 1.0f / (1.0f + expf(-gate[i]));
        }
}

/* Q/K norms, RoPE and K/V write of the KV heads this thread owns; with `attend`, also
 * their attention (writing those heads' query rows of s->attn). */
/* Scales x [width] by the RMSNorm factor inv and the weights w as kvserve_rms_norm does. */
static void scale_norm(const NativeModel *m, float *x, int64_t width, float inv, const float *w) {
    for (int64_t i = 0; i < width; i++) x[i] = m->adds_one ? x[i] * inv * (1.0f + w[i]) : w[i] * (x[i] * inv);
}

/* A Q/K norm over the whole projection (OLMoE): p->qk_inv = each token's 1 / rms of its Q row
 * and of its K row, read from the whole s->qkv (after the QKV barrier, before any thread
 * normalizes its heads in place: a barrier follows). */
static void whole_qk_scales(const NativeModel *m, const NativeStep *st, const Shared *s, Private *p) {
    const int64_t q_size = m->num_heads * m->head_dim, kv_size = m->num_kv_heads * m->head_dim;
    for (int64_t t = 0; t < st->num_tokens; t++) {
        const float *row = s->qkv + t * qkv_width(m), *k = row + m->num_heads * q_stride(m);
        float q_sum = 0.0f, k_sum = 0.0f;
        for (int64_t i = 0; i < q_size; i++) q_sum += row[i] * row[i];
        for (int64_t i = 0; i < kv_size; i++) k_sum += k[i] * k[i];
        p->qk_inv[2 * t] = 1.0f / sqrtf(q_sum / (float)q_size + m->eps);
        p->qk_inv[2 * t + 1] = 1.0f / sqrtf(k_sum / (float)kv_size + m->eps);
    }
}

/* The Q/K norms of token t's query heads [first, first + group) and KV head h, in place: per head,
 * or (qk_inv) over the whole projection by the factors whole_qk_scales found. */
static void qk_norms(const NativeModel *m, const NativeLayer *l, float *q, float *k, int64_t QS, int64_t first,
                     int64_t group, int64_t h, const float *qk_inv, int64_t t) {
    const int64_t D = m->head_dim;
    if (!qk_inv) {
        if (l->q_norm) kvserve_rms_norm(q, NULL, l->q_norm, q, group, D, QS, m->eps, m->adds_one, F32, 1);
        if (l->k_norm) kvserve_rms_norm(k, NULL, l->k_norm, k, 1, D, D, m->eps, m->adds_one, F32, 1);
        return;
    }
    for (int64_t j = 0; j < group; j++) scale_norm(m, q + j * QS, D, qk_inv[2 * t], l->q_norm + (first + j) * D);
    scale_norm(m, k, D, qk_inv[2 * t + 1], l->k_norm + h * D);
}

static void attention_heads(const NativeModel *m, const NativeLayer *l, const NativeStep *st, const Shared *s,
                            const float *qk_inv, int attend, int tid, int nthreads) {
    const int64_t T = st->num_tokens, D = m->head_dim, group = m->num_heads / m->num_kv_heads, QS = q_stride(m);
    const int64_t q_size = m->num_heads * D, q_rows = m->num_heads * QS, kv_size = m->num_kv_heads * D;
    const int64_t width = qkv_width(m);
    const float *cos = l->local_rope ? st->cos_local : st->cos, *sin = l->local_rope ? st->sin_local : st->sin;
    const int64_t elem = l->kv_dtype == F32 ? 4 : 2;
    for (int64_t h = tid; h < m->num_kv_heads; h += nthreads) {
        float *q = s->qkv + h * group * QS, *k = s->qkv + q_rows + h * D, *v = s->qkv + q_rows + kv_size + h * D;
        for (int64_t t = 0; t < T; t++)
            qk_norms(m, l, q + t * width, k + t * width, QS, h * group, group, h, qk_inv, t);
        rope(m, st, q, width, QS, group, cos, sin);
        rope(m, st, k, width, D, 1, cos, sin);
        char *k_cache = (char *)l->k_cache + h * l->cache_head_stride * elem;
        char *v_cache = (char *)l->v_cache + h * l->cache_head_stride * elem;
        kvserve_store_kv(k, v, width, D, k_cache, v_cache, l->cache_head_stride, st->slots[l->group], NULL, T, 1, D,
                         F32, l->kv_dtype);
        if (!attend) continue;
        kvserve_paged_attention(q, width, QS, k_cache, v_cache, l->cache_head_stride, s->attn + h * group * D, q_size,
                                D, st->token_index, st->positions, st->block_table[l->group],
                                st->block_table_stride[l->group], st->table_row, T, group, 1, D, l->block_size,
                                l->window, m->scale, m->softcap, l->sinks ? l->sinks + h * group : NULL, F32,
                                l->kv_dtype, l->attention_isa, 1);
        gate_output(m, s, 0, T, h * group, (h + 1) * group);
    }
}

/* Attention of this thread's share of the step's tokens over every head (all K/V rows
 * written before): steps of many tokens split better by tokens than by KV heads. */
static void attention_tokens(const NativeModel *m, const NativeLayer *l, const NativeStep *st, const Shared *s,
                             int tid, int nthreads) {
    const int64_t T = st->num_tokens, D = m->head_dim, q_size = m->num_heads * D;
    const int64_t width = qkv_width(m), begin = T * tid / nthreads, end = T * (tid + 1) / nthreads;
    if (begin == end) return;
    kvserve_paged_attention(s->qkv, width, q_stride(m), l->k_cache, l->v_cache, l->cache_head_stride, s->attn, q_size, D,
                            st->token_index + begin, st->positions + begin, st->block_table[l->group],
                            st->block_table_stride[l->group], st->table_row + begin, end - begin, m->num_heads,
                            m->num_kv_heads, D, l->block_size, l->window, m->scale, m->softcap, l->sinks, F32,
                            l->kv_dtype, l->attention_isa, 1);
    gate_output(m, s, begin, end, 0, m->num_heads);
}

/* A barrier, charged to PHASE_WAIT (the work before it to `phase`). */
static void wait_all(Private *p, int phase) {
    phase_mark(&p->timer, phase);
    spin_barrier(p->barrier);
    phase_mark(&p->timer, PHASE_WAIT);
}

/* The query heads [begin, end) whose attention thread tid attends to in attention_query_heads. */
static void query_head_share(const NativeModel *m, int tid, int nthreads, int64_t *begin, int64_t *end) {
    *begin = m->num_heads * tid / nthreads;
    *end = m->num_heads * (tid + 1) / nthreads;
}

/* Attention of this thread's share of the query heads, every token (all K/V rows written
 * before): when the KV heads do not divide evenly among the threads (SmolLM2: 3 of them
 * on 2 threads), splitting by query heads instead evens the work out for one extra
 * barrier. Each query head's result is the per-KV-head split's exactly. */
static void attention_query_heads(const NativeModel *m, const NativeLayer *l, const NativeStep *st, const Shared *s,
                                  int tid, int nthreads) {
    const int64_t T = st->num_tokens, D = m->head_dim, q_size = m->num_heads * D, QS = q_stride(m);
    const int64_t width = qkv_width(m), group = m->num_heads / m->num_kv_heads;
    const int64_t elem = l->kv_dtype == F32 ? 4 : 2;
    int64_t begin, end;
    query_head_share(m, tid, nthreads, &begin, &end);
    for (int64_t first = begin; first < end;) {
        const int64_t h = first / group, last = (h + 1) * group < end ? (h + 1) * group : end;
        kvserve_paged_attention(s->qkv + first * QS, width, QS, (char *)l->k_cache + h * l->cache_head_stride * elem,
                                (char *)l->v_cache + h * l->cache_head_stride * elem, l->cache_head_stride,
                                s->attn + first * D, q_size, D, st->token_index, st->positions,
                                st->block_table[l->group], st->block_table_stride[l->group], st->table_row, T,
                                last - first, 1, D, l->block_size, l->window, m->scale, m->softcap,
                                l->sinks ? l->sinks + first : NULL, F32, l->kv_dtype, l->attention_isa, 1);
        first = last;
    }
    gate_output(m, s, 0, T, begin, end);
}

/* Before attention_query_heads, without a barrier between: the Q norms and RoPE of this
 * thread's query heads (in place), and the K norm, RoPE and K/V write of every KV head they
 * read (from this thread's copy of the head's K/V rows). A KV head whose query heads two
 * threads share out is computed and written by both, the same values to the same slots, so
 * neither waits for the other's write; each KV head's values are attention_heads' exactly. */
static void query_share_kv(const NativeModel *m, const NativeLayer *l, const NativeStep *st, const Shared *s,
                           Private *p, int tid, int nthreads) {
    const int64_t T = st->num_tokens, D = m->head_dim, group = m->num_heads / m->num_kv_heads, QS = q_stride(m);
    const int64_t q_size = m->num_heads * QS, kv_size = m->num_kv_heads * D, width = qkv_width(m);
    const float *cos = l->local_rope ? st->cos_local : st->cos, *sin = l->local_rope ? st->sin_local : st->sin;
    const int64_t elem = l->kv_dtype == F32 ? 4 : 2;
    int64_t begin, end;
    query_head_share(m, tid, nthreads, &begin, &end);
    if (begin == end) return;
    float *q = s->qkv + begin * QS;
    for (int64_t t = 0; t < T && l->q_norm; t++)
        kvserve_rms_norm(q + t * width, NULL, l->q_norm, q + t * width, end - begin, D, QS, m->eps, m->adds_one, F32,
                         1);
    rope(m, st, q, width, QS, end - begin, cos, sin);
    for (int64_t h = begin / group; h <= (end - 1) / group; h++) {
        for (int64_t t = 0; t < T; t++) {
            float *k = p->kv + t * 2 * D;
            memcpy(k, s->qkv + t * width + q_size + h * D, sizeof(float) * (size_t)D);
            memcpy(k + D, s->qkv + t * width + q_size + kv_size + h * D, sizeof(float) * (size_t)D);
            if (l->k_norm) kvserve_rms_norm(k, NULL, l->k_norm, k, 1, D, D, m->eps, m->adds_one, F32, 1);
        }
        rope(m, st, p->kv, 2 * D, D, 1, cos, sin);
        kvserve_store_kv(p->kv, p->kv + D, 2 * D, D, (char *)l->k_cache + h * l->cache_head_stride * elem,
                         (char *)l->v_cache + h * l->cache_head_stride * elem, l->cache_head_stride,
                         st->slots[l->group], NULL, T, 1, D, F32, l->kv_dtype);
    }
}

/* Whether each thread's query heads (query_head_share) are whole runs of the O projection's
 * input, so that a thread can multiply its heads' attention output by O without a barrier. */
static int heads_are_runs(const NativeModel *m, const NativeLinear *o, int nthreads) {
    for (int t = 0; t < nthreads; t++) {
        int64_t begin, end;
        query_head_share(m, t, nthreads, &begin, &end);
        if (run_at(o, m->head_dim, begin * m->head_dim) < 0) return 0;
    }
    return 1;
}

/* The runs [begin, end) of a split matmul with `in` columns this thread takes, in its share of
 * the columns: by the thread count, or (`by_heads`) as its query heads. */
static void run_share(const NativeModel *m, const NativeLinear *l, int64_t granule, int by_heads, int tid,
                      int nthreads, int64_t *begin, int64_t *end) {
    if (by_heads) {
        int64_t first, last;
        query_head_share(m, tid, nthreads, &first, &last);
        *begin = run_at(l, granule, first * m->head_dim);
        *end = run_at(l, granule, last * m->head_dim);
    } else {
        *begin = run_count(l, granule) * tid / nthreads;
        *end = run_count(l, granule) * (tid + 1) / nthreads;
    }
}

/* Whether a step of T tokens attends by query heads (attention_query_heads): where the KV
 * heads do not divide evenly among the threads, and with fewer barriers also where they do
 * (each thread's query heads then read KV heads of its own: QKV, attention and, where its
 * heads are whole runs of O's input, O without a barrier between). */
static int by_query_heads(const NativeModel *m, int64_t T, int nthreads) {
    return T < TOKEN_SPLIT_MIN && nthreads > 1 && (m->num_kv_heads % nthreads || m->fewer_barriers);
}

/* The QKV projection of p->x into s->qkv. With fewer barriers where the attention goes by
 * query heads, each thread computes only the rows its heads need (its query heads' Q, the K
 * and V of the KV heads they read: a KV head two threads share, both, the same values) and
 * waits for no one (head_dim a multiple of every path's row unit); else the threads split
 * the rows and meet. */
static void qkv_projection(const NativeModel *m, const NativeLayer *l, int64_t T, int64_t plain, Private *p,
                           const Shared *s, int tid, int nthreads) {
    const int64_t D = m->head_dim, group = m->num_heads / m->num_kv_heads;
    const int64_t q_size = m->num_heads * D, kv_size = m->num_kv_heads * D;
    if (!m->fewer_barriers || !by_query_heads(m, T, nthreads) || D % 16 || m->output_gate || m->qk_norm_whole) {
        linear_rows(m, &l->qkv, p->x, T, plain, p, s->qkv, tid, nthreads);
        wait_all(p, PHASE_QKV);
        return;
    }
    const int path = linear_path(m, &l->qkv, T, plain);
    int64_t begin, end;
    query_head_share(m, tid, nthreads, &begin, &end);
    linear_prepare(&l->qkv, path, p->x, T, p);
    if (begin < end) {
        const int64_t h0 = begin / group, h1 = (end - 1) / group + 1;
        linear_range(&l->qkv, path, p->x, T, p, s->qkv, begin * D, end * D);
        linear_range(&l->qkv, path, p->x, T, p, s->qkv, q_size + h0 * D, q_size + h1 * D);
        linear_range(&l->qkv, path, p->x, T, p, s->qkv, q_size + kv_size + h0 * D, q_size + kv_size + h1 * D);
    }
    phase_mark(&p->timer, PHASE_QKV);
}

/* Tensor parallelism: s->out [T, hidden] summed over the ranks (thread 0 calls out while
 * the others wait at the barrier after it). Returns whether every thread goes on. */
static int all_reduce_out(const NativeModel *m, const NativeStep *st, Private *p, Shared *s, int tid) {
    if (!m->all_reduce) return 1;
    if (tid == 0) {
        phase_mark(&p->timer, PHASE_NORMS);
        if (m->all_reduce(m->reduce_ctx, s->out, st->num_tokens * m->hidden)) s->reduce_failed = 1;
        phase_mark(&p->timer, PHASE_ALL_REDUCE);
    }
    wait_all(p, PHASE_NORMS);
    return !s->reduce_failed;
}

/* Q/K norms, RoPE, K/V write, attention and the O projection; returns the O output [T, hidden]
 * (Shared.out, summed over the ranks under tensor parallelism, or p->sum where O is split by
 * input columns), or NULL when the all-reduce failed. Where O is split and the
 * attention goes by query heads that are whole runs of O's input, each thread multiplies its
 * own heads' output without waiting for the others'. */
static const float *attention_and_o(const NativeModel *m, const NativeLayer *l, const NativeStep *st, Private *p,
                                    Shared *s, int64_t plain, int tid, int nthreads) {
    const int64_t T = st->num_tokens, H = m->hidden;
    const int query_heads = by_query_heads(m, T, nthreads);
    const float *qk_inv = NULL;
    if (m->qk_norm_whole && l->q_norm) {
        whole_qk_scales(m, st, s, p);
        qk_inv = p->qk_inv;
        wait_all(p, PHASE_NORMS);
    }
    if (T >= TOKEN_SPLIT_MIN && nthreads > 1) {
        attention_heads(m, l, st, s, qk_inv, 0, tid, nthreads);
        wait_all(p, PHASE_ATTENTION);
        attention_tokens(m, l, st, s, tid, nthreads);
    } else if (query_heads && m->fewer_barriers && !m->qk_norm_whole) {
        query_share_kv(m, l, st, s, p, tid, nthreads);
        attention_query_heads(m, l, st, s, tid, nthreads);
    } else if (query_heads) {
        attention_heads(m, l, st, s, qk_inv, 0, tid, nthreads);
        wait_all(p, PHASE_ATTENTION);
        attention_query_heads(m, l, st, s, tid, nthreads);
    } else {
        attention_heads(m, l, st, s, qk_inv, 1, tid, nthreads);
    }
    if (!splits_by_input(m, &l->o, m->head_dim, T, plain)) {
        wait_all(p, PHASE_ATTENTION);
        linear_rows(m, &l->o, s->attn, T, plain, p, s->out, tid, nthreads);
        wait_all(p, PHASE_O);
        return all_reduce_out(m, st, p, s, tid) ? s->out : NULL;
    }
    const int by_heads = query_heads && heads_are_runs(m, &l->o, nthreads);
    if (by_heads)
        phase_mark(&p->timer, PHASE_ATTENTION);
    else
        wait_all(p, PHASE_ATTENTION);
    int64_t begin, end;
    run_share(m, &l->o, m->head_dim, by_heads, tid, nthreads, &begin, &end);
    split_range(&l->o, m->head_dim, s->attn, T, p, s->o_runs, begin, end, PHASE_O);
    wait_all(p, PHASE_O);
    sum_runs(s->o_runs, run_count(&l->o, m->head_dim), T, H, l->o.bias, p->sum);
    phase_mark(&p->timer, PHASE_NORMS);
    return p->sum;
}

/* ---- Gated DeltaNet layers (NativeDeltaNet; decode steps: token t is request t's one token) ----- */

#define MAX_CONV_WIDTH 16

/* Its projection rows [q | k | v | z]: the convolved channels [q | k | v] (conv_dim), then z. */
static int64_t dn_conv_dim(const NativeModel *m) {
    return 2 * m->dn_k_heads * m->dn_k_dim + m->dn_v_heads * m->dn_v_dim;
}
static int64_t dn_width(const NativeModel *m) { return dn_conv_dim(m) + m->dn_v_heads * m->dn_v_dim; }

/* The state token t wrote also goes to its copy slots (snapshots): `count` floats `stride` apart
 * from `from`, to `offset` in each copy slot of states [slots, slot_size]. */
static void copy_state(const NativeStep *st, int g, int64_t t, float *states, int64_t slot_size, int64_t offset,
                       const float *from, int64_t stride, int64_t count) {
    for (int64_t i = 0; i < st->state_copies[g]; i++) {
        if (st->state_copy_token[g][i] != t) continue;
        float *to = states + st->state_copy_slot[g][i] * slot_size + offset;
        for (int64_t j = 0; j < count; j++) to[j * stride] = from[j * stride];
    }
}

/* This thread's channels of the short causal convolution (+ SiLU) over each token's conv
 * state, in place in the projection's rows qkv [T, dn_width]; the state (its last K - 1
 * inputs) moved on by the token into the write slot and the copies. Each channel's old state
 * is read before its new one is written: the read and write slots may be one. */
static void dn_conv(const NativeModel *m, const NativeLayer *l, const NativeStep *st, float *qkv, int tid,
                    int nthreads) {
    const NativeDeltaNet *dn = l->delta_net;
    const int64_t K = m->dn_conv_width, rows = K - 1, conv_dim = dn_conv_dim(m), width = dn_width(m);
    const int64_t slot_size = rows * conv_dim;
    const int g = l->group;
    int64_t begin, end;
    split_rows(conv_dim, 1, tid, nthreads, &begin, &end);
    for (int64_t t = 0; t < st->num_tokens; t++) {
        const int64_t read = st->state_read[g][t];
        const float *old = read >= 0 ? dn->conv_states + read * slot_size : NULL;
        float *state = dn->conv_states + st->state_write[g][t] * slot_size;
        float *x = qkv + t * width;
        for (int64_t c = begin; c < end; c++) {
            float window[MAX_CONV_WIDTH];
            for (int64_t j = 0; j < rows; j++) window[j] = old ? old[j * conv_dim + c] : 0.0f;
            window[rows] = x[c];
            float sum = 0.0f;
            for (int64_t j = 0; j < K; j++) sum += dn->conv_weight[c * K + j] * window[j];
            x[c] = sum / (1.0f + expf(-sum));
            for (int64_t j = 0; j < rows; j++) state[j * conv_dim + c] = window[j + 1];
            copy_state(st, g, t, dn->conv_states, slot_size, c, state + c, conv_dim, rows);
        }
    }
}

/* out [n] = x * rsqrt(sum x^2 + 1e-6) * scale (the L2 norm of q and k, as gated_deltanet.py). */
static void l2_normalized(const float *x, int64_t n, float scale, float *out) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum + 1e-6f);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * scale;
}

/* out [n] = w * (x * rsqrt(mean x^2 + eps)) * silu(z): the gated RMSNorm of one value head. */
static void gated_norm(const float *x, const float *z, const float *w, int64_t n, float eps, float *out) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv) * (z[i] / (1.0f + expf(-z[i])));
}

/* torch's softplus (beta 1, threshold 20). */
static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* This thread's value heads of every token: q, k L2-normalized, the gated delta rule on the
 * head's state (read from the read slot into the write slot, then copied to the copies), the
 * gated RMSNorm of its output into attn [T, Hv * Dv]. */
static void dn_heads(const NativeModel *m, const NativeLayer *l, const NativeStep *st, const Shared *s, Private *p,
                     int tid, int nthreads) {
    const NativeDeltaNet *dn = l->delta_net;
    const int64_t Hk = m->dn_k_heads, Hv = m->dn_v_heads, Dk = m->dn_k_dim, Dv = m->dn_v_dim;
    const int64_t key = Hk * Dk, width = dn_width(m), conv_dim = dn_conv_dim(m), group = Hv / Hk;
    const int64_t head_size = Dk * Dv, slot_size = Hv * head_size;
    const float q_scale = (float)(1.0 / sqrt((double)Dk));
    const int g = l->group;
    float *q = p->dn, *k = q + Dk, *scratch = k + Dk, *out = scratch + Dv;
    int64_t begin, end;
    split_rows(Hv, 1, tid, nthreads, &begin, &end);
    for (int64_t t = 0; t < st->num_tokens; t++) {
        const int64_t read = st->state_read[g][t], write = st->state_write[g][t];
        const float *row = s->qkv + t * width, *b = s->ba + t * 2 * Hv, *a = b + Hv;
        for (int64_t h = begin; h < end; h++) {
            const int64_t kh = h / group;
            l2_normalized(row + kh * Dk, Dk, q_scale, q);
            l2_normalized(row + key + kh * Dk, Dk, 1.0f, k);
            float *state = dn->delta_states + write * slot_size + h * head_size;
            if (read < 0)
                memset(state, 0, sizeof(float) * (size_t)head_size);
            else if (read != write)
                memcpy(state, dn->delta_states + read * slot_size + h * head_size, sizeof(float) * (size_t)head_size);
            const float beta = 1.0f / (1.0f + expf(-b[h]));
            const float decay = expf(dn->neg_a[h] * softplus(a[h] + dn->dt_bias[h]));
            kvserve_gated_delta_head(state, k, q, row + 2 * key + h * Dv, decay, beta, Dk, Dv, scratch, out, dn->isa);
            copy_state(st, g, t, dn->delta_states, slot_size, h * head_size, state, 1, head_size);
            gated_norm(out, row + conv_dim + h * Dv, dn->norm, Dv, m->eps, s->attn + t * Hv * Dv + h * Dv);
        }
    }
}

/* A Gated DeltaNet layer's mixer of x = p->x; returns its output [T, hidden] (Shared.out). */
static const float *delta_net(const NativeModel *m, const NativeLayer *l, const NativeStep *st, Private *p,
                              Shared *s, int64_t plain, int tid, int nthreads) {
    const NativeDeltaNet *dn = l->delta_net;
    const int64_t T = st->num_tokens;
    linear_rows(m, &dn->qkvz, p->x, T, plain, p, s->qkv, tid, nthreads);
    linear_rows(m, &dn->ba, p->x, T, plain, p, s->ba, tid, nthreads);
    wait_all(p, PHASE_QKV);
    dn_conv(m, l, st, s->qkv, tid, nthreads);
    wait_all(p, PHASE_ATTENTION);
    dn_heads(m, l, st, s, p, tid, nthreads);
    wait_all(p, PHASE_ATTENTION);
    linear_rows(m, &dn->out, s->attn, T, plain, p, s->out, tid, nthreads);
    wait_all(p, PHASE_O);
    return s->out;
}

/* ---- Mamba-2 layers (NativeMamba; decode steps: token t is request t's one token) --------------- */

static int64_t mb_inner(const NativeModel *m) { return m->mb_heads * m->mb_head_dim; }
static int64_t mb_conv_dim(const NativeModel *m) { return mb_inner(m) + 2 * m->mb_groups * m->mb_state; }
static int64_t mb_width(const NativeModel *m) { return mb_inner(m) + mb_conv_dim(m) + m->mb_heads; }

/* y [inner] = w * groupwise-RMSNorm(y * silu(gate)), in place (mamba2_mixer.py's GatedRMSNorm). */
static void mb_gated_norm(const NativeModel *m, const float *w, const float *gate, float *y) {
    const int64_t inner = mb_inner(m), size = inner / m->mb_groups;
    for (int64_t i = 0; i < inner; i++) y[i] *= gate[i] / (1.0f + expf(-gate[i]));
    for (int64_t g = 0; g < m->mb_groups; g++) {
        float *x = y + g * size;
        float sum = 0.0f;
        for (int64_t i = 0; i < size; i++) sum += x[i] * x[i];
        const float inv = 1.0f / sqrtf(sum / (float)size + m->eps);
        for (int64_t i = 0; i < size; i++) x[i] = w[g * size + i] * (x[i] * inv);
    }
}

/* Thread 0's part of a Mamba-2 layer: the conv + SSM step of every token (mamba2_step.c on one
 * thread: its (request, head) pairs do not depend on the thread count), each token's states
 * copied from its write slot to its copy slots, the gated norm into s->attn [T, inner]. */
static void mb_step(const NativeModel *m, const NativeLayer *l, const NativeStep *st, const Shared *s) {
    const NativeMamba *mb = l->mamba;
    const int64_t T = st->num_tokens, inner = mb_inner(m), conv_dim = mb_conv_dim(m), width = mb_width(m);
    const int64_t conv_slot = (m->mb_conv_width - 1) * conv_dim, ssm_slot = inner * m->mb_state;
    const int g = l->group;
    kvserve_mamba2_decode_step(s->qkv + inner, width, s->qkv + inner + conv_dim, width, mb->conv_states,
                               mb->ssm_states, st->state_read[g], st->state_write[g], mb->conv_weight, mb->conv_bias,
                               mb->dt_bias, mb->a, mb->d, mb->dt_min, mb->dt_max, T, m->mb_heads, m->mb_head_dim,
                               m->mb_state, m->mb_groups, m->mb_conv_width, s->conv_out, s->attn, inner, mb->isa, 1);
    for (int64_t i = 0; i < st->state_copies[g]; i++) {
        const int64_t from = st->state_write[g][st->state_copy_token[g][i]], to = st->state_copy_slot[g][i];
        memcpy(mb->conv_states + to * conv_slot, mb->conv_states + from * conv_slot, sizeof(float) * (size_t)conv_slot);
        memcpy(mb->ssm_states + to * ssm_slot, mb->ssm_states + from * ssm_slot, sizeof(float) * (size_t)ssm_slot);
    }
    for (int64_t t = 0; t < T; t++) mb_gated_norm(m, mb->norm, s->qkv + t * width, s->attn + t * inner);
}

/* A Mamba-2 layer's mixer of x = p->x; returns its output [T, hidden] (Shared.out). */
static const float *mamba(const NativeModel *m, const NativeLayer *l, const NativeStep *st, Private *p, Shared *s,
                          int64_t plain, int tid, int nthreads) {
    const int64_t T = st->num_tokens;
    linear_rows(m, &l->mamba->in, p->x, T, plain, p, s->qkv, tid, nthreads);
    wait_all(p, PHASE_QKV);
    if (tid == 0) mb_step(m, l, st, s);
    wait_all(p, PHASE_ATTENTION);
    linear_rows(m, &l->mamba->out, s->attn, T, plain, p, s->out, tid, nthreads);
    wait_all(p, PHASE_O);
    return s->out;
}

/* x [T, hidden] times the residual multiplier (Granite) into this thread's p->sum (x may be
 * p->sum itself); x itself where the model has none. */
static const float *residual_scaled(const NativeModel *m, const float *x, Private *p, int64_t T) {
    if (m->residual_multiplier == 1.0f || m->residual_multiplier == 0.0f) return x;
    for (int64_t i = 0; i < T * m->hidden; i++) p->sum[i] = x[i] * m->residual_multiplier;
    return p->sum;
}

/* act [T, width] = the gate activation of gate_up [T, 2 * width] (gate, then up, per row). */
static void gate_activation(const NativeModel *m, const float *gate_up, float *act, int64_t T, int64_t width) {
    if (m->gelu)
        gelu_tanh_mul(gate_up, act, T, width);
    else
        kvserve_silu_mul(gate_up, act, T, width, F32, 1);
}

/* An expert's activation: gpt-oss's clamped SwiGLU (fused_ops.c, as the per-op path) or the model's gate. */
static void expert_activation(const NativeModel *m, const NativeMoe *moe, const float *gate_up, float *act, int64_t T,
                              int64_t width) {
    if (moe->swiglu)
        kvserve_swiglu_clamped(gate_up, act, T, width, moe->swiglu_limit, moe->swiglu_alpha, F32, 1);
    else
        gate_activation(m, gate_up, act, T, width);
}

/* ---- mixture of experts (moe.py's SparseMoeBlock) ------------------------------------------
 * The threads share out the router's float32 rows (1 MB a layer for 128 experts of hidden 2,048:
 * as much to read as a few experts' blocks; one barrier), every thread routes each token itself
 * (the same values on each), then the threads share the chosen experts' matmuls one of two ways:
 * - by rows (MOE_SPLIT_ROWS): each chosen expert's rows split over the threads as a dense
 *   MLP's: the gate/up projections of every expert with tokens (and the shared expert's), one
 *   barrier, the activations and down projections;
 * - by experts (MOE_SPLIT_EXPERTS): each thread takes whole experts, a run of them in
 *   ascending id balanced by their work (expert_owner), and runs gate/up, the activation and
 *   down of each itself: no barrier between gate/up and down, and an expert's inputs are
 *   gathered and rounded once instead of by every thread;
 * then a barrier, and each thread adds the weighted outputs up in ascending expert id, as
 * moe.py does. An expert's rows are its tokens' rows gathered (in moe.py's order: by top-k
 * slot, then token), multiplied by the kernel a step of that many tokens takes, as moe.py
 * multiplies them; a row's result depends on neither the split nor the thread count. */

/* MOE_SPLIT_AUTO splits by experts where the step chose at least EXPERT_SPLIT_MIN experts per
 * thread, none of them with more than EXPERT_SPLIT_MAX_ROWS rows (decode steps, whose experts'
 * work is mostly reading them): fewer experts, or a few experts holding most rows (a prompt's
 * tokens tend to pick the same ones), leave whole experts unevenly spread over the threads. */
#define EXPERT_SPLIT_MIN 4
#define EXPERT_SPLIT_MAX_ROWS 4
#define ROUTER_UNIT 8 /* router rows the threads share out in */
/* An expert's work in expert_owner's units: reading its weights costs about as much as
 * multiplying them by 1.25 rows (a 15B-A2B Q4_K_M expert on one Zen 5 core: ~90 us for one
 * row, ~40 us more per row), so work = EXPERT_READ_COST + EXPERT_ROW_COST * rows. */
#define EXPERT_READ_COST 5
#define EXPERT_ROW_COST 4

/* Whether expert a comes before expert b in the order the call picks them: the higher logit
 * first, of equal logits the lower id. Where equal logits straddle the top-k boundary that order
 * is not route()'s: torch.topk's order of equal values is its algorithm's (on CPU,
 * torch.topk(torch.zeros(8), 2) gives experts 6 and 5), so route_token reports such a tie and
 * the step goes to the per-op path. Equal logits both inside the top k pick the same experts
 * either way (summed in ascending id), so they run here. */
static int routes_before(const float *logits, int64_t a, int64_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
}

/* Token t's top_k experts (p->route_id) and gate weights (p->route_weight): a softmax over
 * every expert in float32, its top_k, renormalized to sum to 1 where moe->renormalize; or
 * (softmax_after_topk, gpt-oss) a softmax over the top_k logits alone. The softmax keeps the
 * logits' order, so the experts are picked by their logits. Returns 1 where an expert left out
 * has the logit of the last one picked (a tie route() may break otherwise). */
static int route_token(const NativeMoe *moe, const float *logits, int64_t *ids, float *weights) {
    const int64_t E = moe->num_experts, K = moe->top_k;
    float top = logits[0];
    for (int64_t e = 1; e < E; e++) top = logits[e] > top ? logits[e] : top;
    float total = 0.0f; /* the softmax's denominator: over every expert, or (softmax_after_topk) the top k */
    for (int64_t e = 0; e < E && !moe->softmax_after_topk; e++) total += expf(logits[e] - top);
    for (int64_t j = 0; j < K; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if ((j == 0 || routes_before(logits, ids[j - 1], e)) && (best < 0 || routes_before(logits, e, best)))
                best = e;
        ids[j] = best;
        weights[j] = expf(logits[best] - top);
        if (moe->softmax_after_topk) total += weights[j];
    }
    float picked = 0.0f;
    for (int64_t j = 0; j < K; j++) {
        weights[j] /= total;
        picked += weights[j];
    }
    if (moe->renormalize && !moe->softmax_after_topk)
        for (int64_t j = 0; j < K; j++) weights[j] /= picked;
    int64_t at_least_last = 0;
    for (int64_t e = 0; e < E; e++) at_least_last += logits[e] >= logits[ids[K - 1]];
    return at_least_last > K;
}

/* Routes the step's tokens and groups the (token, expert) pairs by expert: expert e's pairs are
 * [expert_end[e - 1], expert_end[e]) of p->pair_token / p->pair_weight, by slot, then token.
 * Returns 1, grouping nothing, where a token's top k ends in a tie (route_token). */
static int route_step(const NativeMoe *moe, int64_t T, Private *p, Shared *s, int tid, int nthreads) {
    const int64_t E = moe->num_experts, K = moe->top_k;
    int64_t begin, end; /* the router's float32 rows are a read as long as a few experts' blocks: shared out */
    split_rows(E, ROUTER_UNIT, tid, nthreads, &begin, &end);
    linear_range(&moe->router, PATH_F32, p->x, T, p, s->router, begin, end);
    wait_all(p, PHASE_NORMS);
    int tie = 0;
    for (int64_t t = 0; t < T; t++)
        tie |= route_token(moe, s->router + t * E, p->route_id + t * K, p->route_weight + t * K);
    if (tie) return 1;
    for (int64_t e = 0; e < E; e++) p->expert_end[e] = 0;
    for (int64_t i = 0; i < T * K; i++) p->expert_end[p->route_id[i]]++;
    for (int64_t e = 0, start = 0; e < E; e++) { /* expert_end: each expert's first pair, then its cursor */
        const int64_t count = p->expert_end[e];
        p->expert_end[e] = start;
        start += count;
    }
    for (int64_t j = 0; j < K; j++)
        for (int64_t t = 0; t < T; t++) {
            const int64_t at = p->expert_end[p->route_id[t * K + j]]++;
            p->pair_token[at] = t;
            p->pair_weight[at] = p->route_weight[t * K + j];
        }
    return 0;
}

static int64_t expert_begin(const Private *p, int64_t e) { return e ? p->expert_end[e - 1] : 0; }

/* This thread's rows of y [rows, l->out] = x [rows, l->in] W^T for `rows` rows multiplied as a
 * step of that many tokens; `*prepared` is the linear whose preparation of the same x p->qx
 * holds (NULL: none; the caller passes one only where x is that linear's x: a one-token step's
 * experts all take its one row). */
static void expert_rows(const NativeModel *m, const NativeLinear *l, const float *x, int64_t rows, Private *p,
                        float *y, const NativeLinear **prepared, int tid, int nthreads) {
    const int path = linear_path(m, l, rows, rows);
    const NativeLinear *before = *prepared;
    if (!before || linear_path(m, before, rows, rows) != path || before->in != l->in ||
        before->act_bits != l->act_bits || before->panel_isa != l->panel_isa)
        linear_prepare(l, path, x, rows, p);
    *prepared = l;
    int64_t begin, end;
    split_rows(l->out, path_unit(path), tid, nthreads, &begin, &end);
    linear_range(l, path, x, rows, p, y, begin, end);
}

/* Whether the step's chosen experts go to the threads whole (see above). */
static int splits_by_expert(const NativeMoe *moe, const Private *p, int nthreads) {
    if (moe->shared_down.out || moe->split == MOE_SPLIT_ROWS) return 0; /* a shared expert: split by rows */
    if (moe->split == MOE_SPLIT_EXPERTS) return 1;
    int64_t active = 0;
    for (int64_t e = 0; e < moe->num_experts; e++) {
        const int64_t rows = p->expert_end[e] - expert_begin(p, e);
        if (rows > EXPERT_SPLIT_MAX_ROWS) return 0;
        active += rows > 0;
    }
    return nthreads > 1 && active >= EXPERT_SPLIT_MIN * nthreads;
}

/* The thread that runs expert e of the step (`work_before`: the work of the chosen experts below
 * e, `total` of all): the one whose share of the total holds the middle of e's work, so the
 * threads take runs of experts in ascending id, of about equal work. The same on every thread. */
static int expert_owner(int64_t work_before, int64_t work, int64_t total, int nthreads) {
    const int owner = (int)((2 * work_before + work) * nthreads / (2 * total));
    return owner < nthreads ? owner : nthreads - 1;
}

static int64_t expert_work(int64_t rows) { return EXPERT_READ_COST + EXPERT_ROW_COST * rows; }

/* By experts: this thread's experts' gate/up, activation and down, all rows of each, outputs in
 * s->moe_gate_up / s->moe_down at the expert's pairs (as the split by rows writes them). */
static void own_experts(const NativeModel *m, const NativeMoe *moe, Private *p, Shared *s, int tid, int nthreads) {
    const int64_t E = moe->num_experts, H = m->hidden, width = moe->down[0].in;
    int64_t total = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t rows = p->expert_end[e] - expert_begin(p, e);
        total += rows ? expert_work(rows) : 0;
    }
    for (int64_t e = 0, before = 0; e < E; e++) {
        const int64_t first = expert_begin(p, e), rows = p->expert_end[e] - first;
        if (!rows) continue;
        const int64_t work = expert_work(rows);
        const int owner = expert_owner(before, work, total, nthreads);
        before += work;
        if (owner != tid) continue;
        for (int64_t i = 0; i < rows; i++)
            memcpy(p->gather + i * H, p->x + p->pair_token[first + i] * H, sizeof(float) * (size_t)H);
        const NativeLinear *gate_up = &moe->gate_up[e], *down = &moe->down[e];
        const int gate_up_path = linear_path(m, gate_up, rows, rows), down_path = linear_path(m, down, rows, rows);
        linear_prepare(gate_up, gate_up_path, p->gather, rows, p);
        linear_range(gate_up, gate_up_path, p->gather, rows, p, s->moe_gate_up + first * 2 * width, 0, gate_up->out);
        phase_mark(&p->timer, PHASE_GATE_UP);
        expert_activation(m, moe, s->moe_gate_up + first * 2 * width, p->act, rows, width);
        phase_mark(&p->timer, PHASE_NORMS);
        linear_prepare(down, down_path, p->act, rows, p);
        linear_range(down, down_path, p->act, rows, p, s->moe_down + first * H, 0, down->out);
        phase_mark(&p->timer, PHASE_DOWN);
    }
}

/* After the barrier that follows the down projections: the weighted sum of the experts' outputs
 * (and the gated shared expert's) into p->sum, and under tensor parallelism its all-reduce. */
static const float *moe_sum(const NativeModel *m, const NativeMoe *moe, const NativeStep *st, Private *p, Shared *s,
                            int tid) {
    const int64_t T = st->num_tokens, H = m->hidden, pairs = T * moe->top_k;
    const int64_t shared_width = moe->shared_down.out ? moe->shared_down.in : 0;
    const float *shared_down = s->moe_down + pairs * H;
    memset(p->sum, 0, sizeof(float) * (size_t)(T * H));
    for (int64_t i = 0; i < pairs; i++) { /* pairs are grouped by ascending expert id */
        const float *y = s->moe_down + i * H, w = p->pair_weight[i];
        float *out = p->sum + p->pair_token[i] * H;
        for (int64_t h = 0; h < H; h++) out[h] += y[h] * w;
    }
    if (shared_width)
        for (int64_t t = 0; t < T; t++) {
            const float *x = p->x + t * H, *g = (const float *)moe->shared_gate.w;
            float dot = moe->shared_gate.bias ? moe->shared_gate.bias[0] : 0.0f;
            for (int64_t h = 0; h < H; h++) dot += x[h] * g[h];
            const float gate = 1.0f / (1.0f + expf(-dot));
            for (int64_t h = 0; h < H; h++) p->sum[t * H + h] += gate * shared_down[t * H + h];
        }
    phase_mark(&p->timer, PHASE_NORMS);
    if (!m->all_reduce) return p->sum;
    if (tid == 0) memcpy(s->out, p->sum, sizeof(float) * (size_t)(T * H));
    return all_reduce_out(m, st, p, s, tid) ? s->out : NULL;
}

/* The MoE MLP of x = p->x; returns its output [T, hidden] (p->sum; under tensor parallelism
 * Shared.out summed over the ranks), or NULL when that all-reduce failed or a routing tie
 * stops the call (s->routing_tie). Every thread routes alike, so all of them stop there. */
static const float *moe_mlp(const NativeModel *m, const NativeMoe *moe, const NativeStep *st, Private *p, Shared *s,
                            int tid, int nthreads) {
    const int64_t T = st->num_tokens, H = m->hidden, E = moe->num_experts, pairs = T * moe->top_k;
    const int64_t width = moe->down[0].in, shared_width = moe->shared_down.out ? moe->shared_down.in : 0;
    float *shared_gate_up = s->moe_gate_up + pairs * 2 * width, *shared_down = s->moe_down + pairs * H;
    if (route_step(moe, T, p, s, tid, nthreads)) {
#pragma omp atomic write
        s->routing_tie = 1;
        p->routing_tie = 1;
        return NULL;
    }
    phase_mark(&p->timer, PHASE_NORMS);
    if (splits_by_expert(moe, p, nthreads)) {
        own_experts(m, moe, p, s, tid, nthreads);
        wait_all(p, PHASE_DOWN);
        return moe_sum(m, moe, st, p, s, tid);
    }
    const NativeLinear *prepared = NULL;
    for (int64_t e = 0; e < E; e++) {
        const int64_t first = expert_begin(p, e), rows = p->expert_end[e] - first;
        if (!rows) continue;
        for (int64_t i = 0; i < rows; i++)
            memcpy(p->gather + i * H, p->x + p->pair_token[first + i] * H, sizeof(float) * (size_t)H);
        if (T > 1) prepared = NULL;
        expert_rows(m, &moe->gate_up[e], p->gather, rows, p, s->moe_gate_up + first * 2 * width, &prepared, tid,
                    nthreads);
        phase_mark(&p->timer, PHASE_GATE_UP); /* (linear_prepare marks the rounding before it) */
    }
    if (T > 1) prepared = NULL;
    if (shared_width) expert_rows(m, &moe->shared_gate_up, p->x, T, p, shared_gate_up, &prepared, tid, nthreads);
    wait_all(p, PHASE_GATE_UP);
    for (int64_t e = 0; e < E; e++) {
        const int64_t first = expert_begin(p, e), rows = p->expert_end[e] - first;
        if (!rows) continue;
        expert_activation(m, moe, s->moe_gate_up + first * 2 * width, p->act, rows, width);
        phase_mark(&p->timer, PHASE_NORMS);
        prepared = NULL;
        expert_rows(m, &moe->down[e], p->act, rows, p, s->moe_down + first * H, &prepared, tid, nthreads);
        phase_mark(&p->timer, PHASE_DOWN);
    }
    if (shared_width) {
        gate_activation(m, shared_gate_up, p->act, T, shared_width);
        prepared = NULL;
        expert_rows(m, &moe->shared_down, p->act, T, p, shared_down, &prepared, tid, nthreads);
    }
    wait_all(p, PHASE_DOWN);
    return moe_sum(m, moe, st, p, s, tid);
}

/* The MLP of x = p->x; returns its output [T, hidden] (as attention_and_o's, NULL when the
 * all-reduce failed; where the down projection is split by input columns, each thread computes
 * the gate and up columns of its runs of the down projection's input, their activation and
 * their partial products, with one barrier instead of two). */
static const float *mlp(const NativeModel *m, const NativeLayer *l, const NativeStep *st, Private *p, Shared *s,
                        int tid, int nthreads) {
    const int64_t T = st->num_tokens, plain = T - st->num_draft_tokens;
    const int64_t H = m->hidden, I = l->down.in;
    if (l->moe) return moe_mlp(m, l->moe, st, p, s, tid, nthreads);
    if (!splits_by_input(m, &l->down, 0, T, plain)) {
        linear_rows(m, &l->gate_up, p->x, T, plain, p, s->gate_up, tid, nthreads);
        wait_all(p, PHASE_GATE_UP);
        gate_activation(m, s->gate_up, p->act, T, I);
        phase_mark(&p->timer, PHASE_NORMS);
        linear_rows(m, &l->down, p->act, T, plain, p, s->out, tid, nthreads);
        wait_all(p, PHASE_DOWN);
        return all_reduce_out(m, st, p, s, tid) ? s->out : NULL;
    }
    int64_t begin, end;
    run_share(m, &l->down, 0, 0, tid, nthreads, &begin, &end);
    const int64_t c0 = run_bound(&l->down, 0, begin) * 32, c1 = run_bound(&l->down, 0, end) * 32, w = c1 - c0;
    if (w > 0) {
        const int path = linear_path(m, &l->gate_up, T, plain);
        linear_prepare(&l->gate_up, path, p->x, T, p);
        linear_range(&l->gate_up, path, p->x, T, p, s->gate_up, c0, c1);
        linear_range(&l->gate_up, path, p->x, T, p, s->gate_up, I + c0, I + c1);
        phase_mark(&p->timer, PHASE_GATE_UP);
        for (int64_t t = 0; t < T; t++) {
            memcpy(p->gate_up + t * 2 * w, s->gate_up + t * 2 * I + c0, sizeof(float) * (size_t)w);
            memcpy(p->gate_up + t * 2 * w + w, s->gate_up + t * 2 * I + I + c0, sizeof(float) * (size_t)w);
        }
        gate_activation(m, p->gate_up, p->act, T, w);
        /* act's columns [c0, c1) where split_range reads them: row t at p->act + t * I */
        for (int64_t t = T - 1; t >= 0; t--) memmove(p->act + t * I + c0, p->act + t * w, sizeof(float) * (size_t)w);
        phase_mark(&p->timer, PHASE_NORMS);
    }
    split_range(&l->down, 0, p->act, T, p, s->down_runs, begin, end, PHASE_DOWN);
    wait_all(p, PHASE_DOWN);
    sum_runs(s->down_runs, run_count(&l->down, 0), T, H, l->down.bias, p->sum);
    phase_mark(&p->timer, PHASE_NORMS);
    return p->sum;
}

/* One decoder layer. The stream is p->residual (sandwich norms), or p->residual + p->out
 * (pre-norm: p->out is the previous layer's MLP output, added in by the first norm; the
 * first layer's stream is p->residual alone). */
static void layer(const NativeModel *m, const NativeLayer *l, const NativeStep *st, Private *p, Shared *s,
                  int first, int tid, int nthreads) {
    const int64_t T = st->num_tokens, H = m->hidden, plain = T - st->num_draft_tokens;
    if (m->sandwich) {
        norm(m, p->residual, NULL, l->input_norm, p->x, T);
    } else {
        norm(m, first ? p->residual : p->out, first ? NULL : p->residual, l->input_norm, p->x, T);
    }
    phase_mark(&p->timer, PHASE_NORMS);
    const float *o_out;
    if (l->delta_net) {
        o_out = delta_net(m, l, st, p, s, plain, tid, nthreads);
    } else if (l->mamba) {
        o_out = mamba(m, l, st, p, s, plain, tid, nthreads);
    } else {
        qkv_projection(m, l, T, plain, p, s, tid, nthreads);
        o_out = attention_and_o(m, l, st, p, s, plain, tid, nthreads);
    }
    if (!o_out) return;
    o_out = residual_scaled(m, o_out, p, T);
    if (m->sandwich) {
        norm(m, o_out, NULL, l->post_attention_norm, p->x, T);
        for (int64_t i = 0; i < T * H; i++) p->residual[i] += p->x[i];
        norm(m, p->residual, NULL, l->pre_feedforward_norm, p->x, T);
    } else {
        norm(m, o_out, p->residual, l->post_attention_norm, p->x, T);
    }
    phase_mark(&p->timer, PHASE_NORMS);
    p->out = mlp(m, l, st, p, s, tid, nthreads);
    if (!p->out) return;
    p->out = residual_scaled(m, p->out, p, T);
    if (m->sandwich) {
        norm(m, p->out, NULL, l->post_feedforward_norm, p->x, T);
        for (int64_t i = 0; i < T * H; i++) p->residual[i] += p->x[i];
    }
}

/* The element counts of the MoE buffers a step of T tokens needs (at least 1 each). */
typedef struct {
    int64_t experts, pairs, gate_up, down;
} MoeSizes;

static MoeSizes moe_sizes(const NativeModel *m, const NativeLayer *layers, int64_t T) {
    MoeSizes size = {1, 1, 1, 1};
    for (int64_t i = 0; i < m->num_layers; i++) {
        const NativeMoe *moe = layers[i].moe;
        if (!moe) continue;
        const int64_t pairs = T * moe->top_k, shared = moe->shared_down.out ? moe->shared_down.in : 0;
        const int64_t gate_up = pairs * 2 * moe->down[0].in + T * 2 * shared, down = (pairs + T) * m->hidden;
        size.experts = size.experts > moe->num_experts ? size.experts : moe->num_experts;
        size.pairs = size.pairs > pairs ? size.pairs : pairs;
        size.gate_up = size.gate_up > gate_up ? size.gate_up : gate_up;
        size.down = size.down > down ? size.down : down;
    }
    return size;
}

static int64_t max2(int64_t a, int64_t b) { return a > b ? a : b; }

/* The widest input of any projection (the Gated DeltaNet output projection's: Hv * Dv). */
static int64_t max_width(const NativeModel *m) {
    return max2(max2(max2(m->hidden, m->intermediate), max2(m->num_heads * m->head_dim, m->dn_v_heads * m->dn_v_dim)),
                mb_inner(m));
}

/* This thread's vocabulary rows of the logits (after a barrier: `hidden` is complete). */
/* Whether no logits row may pick any token of bitmask word w (past the bitmask: none may). */
static int word_banned_everywhere(const NativeTokenMask *mask, int64_t w) {
    if (w >= mask->num_words) return 1;
    for (int64_t r = 0; r < mask->num_mask_rows; r++)
        if (mask->bitmask[r * mask->num_words + w]) return 0;
    return 1;
}

/* This thread's share of the vocabulary in whole bitmask words (32 rows, a multiple of
 * every path's tile, so each computed row's sum is the unmasked head's), the words no row
 * may pick skipped when every row is masked; then -inf over the banned tokens. */
static void masked_head_rows(const NativeModel *m, const NativeLogits *lg, int64_t plain_rows, Private *p, int tid,
                             int nthreads) {
    const NativeLinear *l = &lg->head;
    NativeTokenMask *mask = lg->mask;
    const int64_t T = lg->num_rows, V = l->out;
    const int path = linear_path(m, l, T, plain_rows), skip = mask->num_mask_rows == T;
    int64_t begin, end;
    split_rows(V, 32, tid, nthreads, &begin, &end);
    linear_prepare(l, path, p->x, T, p);
    int64_t run = begin; /* first row not computed or skipped yet */
    for (int64_t w0 = begin; skip && w0 < end; w0 += 32) {
        if (!word_banned_everywhere(mask, w0 / 32)) continue;
        if (run < w0) linear_range(l, path, p->x, T, p, lg->logits, run, w0);
        run = w0 + 32 < end ? w0 + 32 : end;
    }
    if (run < end) linear_range(l, path, p->x, T, p, lg->logits, run, end);
    const double started = tid == 0 ? phase_now() : 0.0;
    for (int64_t r = 0; r < mask->num_mask_rows; r++)
        kvserve_mask_token_range(lg->logits + mask->logits_row[r] * V, mask->bitmask + r * mask->num_words,
                                 mask->num_words, begin, end, mask->isa);
    if (tid == 0) mask->mask_ns = (int64_t)(1e9 * (phase_now() - started));
}

/* On thread 0, before the barrier ahead of the head: whether the head masks its logits
 * (the bitmask got filled in time, on a path this CPU runs). */
static void await_token_mask(NativeTokenMask *mask) {
    mask->wait_ns = 0;
    mask->applied = kvserve_wait_mask_ready(mask->ready, mask->ready_value, mask->timeout_ns, &mask->wait_ns) == 1 &&
                    kvserve_isa_available(KV_KERNEL_MASK, mask->isa);
}

static void head_rows(const NativeModel *m, const NativeLogits *lg, const NativeStep *st, const float *hidden,
                      Private *p, int tid, int nthreads) {
    const int64_t H = m->hidden;
    for (int64_t i = 0; i < lg->num_rows; i++)
        memcpy(p->x + i * H, hidden + lg->rows[i] * H, sizeof(float) * (size_t)H);
    /* every draft token has a logits row (its target distribution) */
    if (lg->mask && lg->mask->applied)
        masked_head_rows(m, lg, lg->num_rows - st->num_draft_tokens, p, tid, nthreads);
    else
        linear_rows(m, &lg->head, p->x, lg->num_rows, lg->num_rows - st->num_draft_tokens, p, lg->logits, tid,
                    nthreads);
    phase_mark(&p->timer, PHASE_HEAD);
}

/* The step's embeddings into out [T, hidden] (as the per-op path's lookup computes them). */
static void embed_tokens(const NativeModel *m, const NativeStep *st, float *out) {
    const NativeLinear *e = &m->embed;
    const int64_t H = m->hidden;
    for (int64_t t = 0; t < st->num_tokens; t++) {
        float *row = out + t * H;
        const int64_t id = st->token_ids[t];
        if (e->num_parts)
            kvserve_gguf_dequantize(e->part_blocks[0], e->part_type[0], H, &id, 1, row, F32);
        else if (e->qs)
            kvserve_quant_row_values(e->qs, e->d, e->m, e->bits, H, id, row);
        else if (e->w_dtype == BF16)
            for (int64_t i = 0; i < H; i++) row[i] = bf16_value(((const uint16_t *)e->w)[id * H + i]);
        else
            memcpy(row, (const float *)e->w + id * H, sizeof(float) * (size_t)H);
        if (m->embed_scale != 0.0f)
            for (int64_t i = 0; i < H; i++) row[i] *= m->embed_scale;
    }
}

/* After the last layer: the final norm into hidden (thread 0), then the LM head's rows. */
static void finish(const NativeModel *m, const NativeLogits *lg, const NativeStep *st, float *hidden, Private *p,
                   int tid, int nthreads) {
    const int64_t T = st->num_tokens;
    if (tid == 0) {
        if (m->sandwich)
            norm(m, p->residual, NULL, m->final_norm, hidden, T);
        else
            norm(m, p->out, p->residual, m->final_norm, hidden, T);
        if (lg && lg->mask) {
            phase_mark(&p->timer, PHASE_NORMS);
            await_token_mask(lg->mask);
            phase_mark(&p->timer, PHASE_WAIT);
        }
    }
    if (lg) {
        wait_all(p, PHASE_NORMS);
        head_rows(m, lg, st, hidden, p, tid, nthreads);
    }
}

/* hidden [T, hidden]: the scaled embeddings in (unless st->token_ids: then the call embeds
 * the tokens itself), the final norm's output out; with `lg` also the LM head's logits of
 * some of the tokens. Returns 0, 1 when out of memory (hidden unchanged then), 2 for a
 * token id outside the embedding table (nothing done), 3 when an all-reduce failed
 * (hidden unchanged; the KV cache holds the layers' rows up to that one), or 4 when a
 * token's top-k experts end in a tie (route_token; hidden unchanged, the KV cache as for 3:
 * the per-op path's run of the step writes the same slots again). */
int kvserve_decoder_forward_logits(const NativeModel *m, const NativeLayer *layers, const NativeStep *st,
                                   float *hidden, const NativeLogits *lg, int num_threads) {
    const int64_t T = st->num_tokens, H = m->hidden, I = m->intermediate, W = max_width(m);
    const int64_t mixer_in = max2(max2(qkv_width(m), dn_width(m)), mb_width(m));
    const int64_t mixer_out = max2(max2(m->num_heads * m->head_dim, m->dn_v_heads * m->dn_v_dim), mb_inner(m));
    if (m->dn_conv_width > MAX_CONV_WIDTH) return 1;
    if (st->token_ids)
        for (int64_t t = 0; t < T; t++)
            if (st->token_ids[t] < 0 || st->token_ids[t] >= m->embed.out) return 2;
    MoeSizes moe = moe_sizes(m, layers, T);
    Shared s = {malloc(sizeof(float) * (size_t)(T * mixer_in)),
                malloc(sizeof(float) * (size_t)(T * mixer_out)),
                m->all_reduce ? m->reduce_buffer : malloc(sizeof(float) * (size_t)(T * H)),
                malloc(sizeof(float) * (size_t)(T * 2 * I)),
                malloc(sizeof(float) * (size_t)(T * 2 * m->dn_v_heads + 1)),
                malloc(sizeof(float) * (size_t)(T * mb_conv_dim(m) + 1)),
                malloc(sizeof(float) * (size_t)(max_runs(m->num_heads * m->head_dim) * T * H)),
                malloc(sizeof(float) * (size_t)(max_runs(I) * T * H)),
                malloc(sizeof(float) * (size_t)moe.gate_up), malloc(sizeof(float) * (size_t)moe.down),
                malloc(sizeof(float) * (size_t)(T * moe.experts)), 0, 0};
    int failed = !s.qkv || !s.attn || !s.out || !s.gate_up || !s.ba || !s.conv_out || !s.o_runs || !s.down_runs ||
                 !s.moe_gate_up || !s.moe_down || !s.router;
    SpinBarrier barrier = {0, 0, 1};
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && !failed)
    {
        const int tid = omp_get_thread_num(), nthreads = omp_get_num_threads();
        if (tid == 0) barrier.nthreads = nthreads; /* published by the OpenMP barrier below */
        Private p = {malloc(sizeof(float) * (size_t)(T * H)), malloc(sizeof(float) * (size_t)(T * W)),
                     malloc(sizeof(float) * (size_t)(T * I)), malloc((size_t)(T * W * 4) + 64),
                     malloc(sizeof(float) * (size_t)(2 * T * (W / 32 + 1))),
                     malloc((size_t)kvserve_quant_gemm_panel_bytes(W)), malloc(sizeof(float) * (size_t)(T * H)),
                     malloc(sizeof(float) * (size_t)(T * 2 * I)), malloc(sizeof(float) * (size_t)(T * 2 * m->head_dim)),
                     malloc(sizeof(float) * (size_t)(2 * m->dn_k_dim + 2 * m->dn_v_dim + 1)),
                     malloc(sizeof(int64_t) * (size_t)(max_runs(W) + 1)), malloc(sizeof(float) * (size_t)(T * H)),
                     malloc(sizeof(int64_t) * (size_t)moe.pairs),
                     malloc(sizeof(int64_t) * (size_t)moe.pairs), malloc(sizeof(int64_t) * (size_t)moe.experts),
                     malloc(sizeof(float) * (size_t)moe.pairs), malloc(sizeof(float) * (size_t)moe.pairs),
                     malloc(sizeof(float) * (size_t)(2 * T)), s.out};
        int ok = p.residual && p.x && p.act && p.qx && p.scales && p.panel && p.sum && p.gate_up && p.kv && p.dn &&
                 p.bounds && p.gather && p.route_id && p.pair_token && p.expert_end && p.route_weight &&
                 p.pair_weight && p.qk_inv;
        p.barrier = &barrier;
        phase_start(&p.timer);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        /* the wait for the region's other threads to start (waking a sleeping one is most of it) */
        phase_mark(&p.timer, PHASE_WAIT);
        if (!failed) {
            if (st->token_ids)
                embed_tokens(m, st, p.residual);
            else
                memcpy(p.residual, hidden, sizeof(float) * (size_t)(T * H));
            for (int64_t i = 0; i < m->num_layers && !s.reduce_failed && !p.routing_tie; i++)
                layer(m, &layers[i], st, &p, &s, i == 0, tid, nthreads);
            /* a failed all-reduce: every thread saw the flag after the same barrier and stops */
            if (!s.reduce_failed && !p.routing_tie) finish(m, lg, st, hidden, &p, tid, nthreads);
            phase_mark(&p.timer, PHASE_NORMS);
            phase_finish(&p.timer, tid);
        }
        free(p.residual), free(p.x), free(p.act), free(p.qx), free(p.scales), free(p.panel), free(p.sum),
            free(p.gate_up), free(p.kv), free(p.dn), free(p.bounds), free(p.gather), free(p.route_id),
            free(p.pair_token), free(p.expert_end), free(p.route_weight), free(p.pair_weight),
            free(p.qk_inv);
    }
    free(s.qkv), free(s.attn), free(s.gate_up), free(s.ba), free(s.conv_out), free(s.o_runs), free(s.down_runs),
        free(s.moe_gate_up), free(s.moe_down), free(s.router);
    if (!m->all_reduce) free(s.out);
    return failed ? 1 : s.reduce_failed ? 3 : s.routing_tie ? 4 : 0;
}

int kvserve_decoder_forward(const NativeModel *m, const NativeLayer *layers, const NativeStep *st, float *hidden,
                            int num_threads) {
    return kvserve_decoder_forward_logits(m, layers, st, hidden, NULL, num_threads);
}
