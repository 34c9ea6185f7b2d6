/* The native library's interface, declared once: every struct the Python side shares
 * (mirrored in kvserve/native/abi.py, checked at load through kvserve_abi_layout) and
 * every function one source file exports, to Python or to another source file. Every
 * .c file includes this header; none declares another file's function itself.
 */
#ifndef KVSERVE_H
#define KVSERVE_H

#include <stdint.h>

#include "isa.h"

#define MAX_GROUPS 8 /* KV-cache groups (block tables) one step may carry */
#define F32_PANELS 2 /* NativeLinear.w_dtype: float32 packed in f32_gemm.c's panels of 16 rows */
#define MAX_PARTS 3  /* NativeLinear.num_parts: GGUF tensors stacked as one projection (q, k, v) */

/* ---- shared structs ----------------------------------------------------------------- */

/* One weight matrix [out, in]: block-quantized (qs != NULL, layout of quant_linear.c),
 * plain (w) float32 or bfloat16 (w_dtype), float32 in f32_gemm.c's panels (w_dtype
 * F32_PANELS), or GGUF blocks as stored (num_parts > 0, gguf_rows.c): num_parts tensors
 * stacked by rows, part i of ggml type part_type[i] holding rows [part_end[i - 1],
 * part_end[i]) in part_blocks[i] (isa: gguf_rows.c's path). bias is float32 or NULL. */
typedef struct {
    const uint8_t *qs;
    const float *d, *m;
    const void *w;
    const float *bias;
    int64_t out, in;
    int32_t bits, act_bits, isa, w_dtype; /* isa: the quantized, bf16_rows.c or f32_gemm.c path */
    int32_t panel_isa;                    /* the panel GEMM's path (quant_gemm.c), -1: none */
    int32_t zero_min;                     /* every m is 0 (Q8_0): the row kernels skip reading m */
    int32_t num_parts;                    /* GGUF blocks as stored: how many parts (0: not stored) */
    int32_t part_type[MAX_PARTS];
    const uint8_t *part_blocks[MAX_PARTS];
    int64_t part_end[MAX_PARTS];
} NativeLinear;

/* A Gated DeltaNet token mixer (Qwen3-Next, Qwen3.5) in place of a layer's attention: the
 * projections qkvz (rows [q | k | v | z]) and ba (rows [b | a]) of the normed input, the short
 * causal convolution (+ SiLU) of [q | k | v] over the conv state, q and k L2-normalized (q
 * also by Dk^-1/2), the gated delta rule on the recurrent state (gated_delta_step.c), the
 * RMSNorm of each value head's output gated by SiLU(z), the output projection. Shapes in
 * NativeModel (dn_*). State slots: conv_states [slots, K - 1, conv_dim], delta_states [slots,
 * Hv, Dk, Dv], float32; a step reads NativeStep.state_read and writes state_write (and the
 * copies). */
typedef struct {
    NativeLinear qkvz, ba, out;
    const float *conv_weight;  /* [conv_dim, K] */
    const float *dt_bias;      /* [Hv] */
    const float *neg_a;        /* [Hv]: -exp(A_log) */
    const float *norm;         /* [Dv]: the gated RMSNorm's weight (w, not 1 + w) */
    float *conv_states, *delta_states;
    int32_t isa; /* gated_delta_step.c's path */
    int32_t unused;
} NativeDeltaNet;

/* A Mamba-2 token mixer (Granite 4) in place of a layer's attention: the in-projection (rows
 * [gate (inner) | xBC (conv_dim) | dt (H)]), mamba2_step.c's conv + SSM step on the states,
 * the group-wise RMSNorm of y * SiLU(gate), the out-projection. Shapes in NativeModel (mb_*).
 * State slots: conv_states [slots, K - 1, conv_dim], ssm_states [slots, H, P, N], float32. */
typedef struct {
    NativeLinear in, out;
    const float *conv_weight, *conv_bias; /* [conv_dim, K], [conv_dim] or NULL */
    const float *dt_bias, *a, *d;         /* [H]: dt_bias, A = -exp(A_log), D */
    const float *norm;                    /* [inner]: the gated norm's weight */
    float *conv_states, *ssm_states;
    float dt_min, dt_max;
    int32_t isa; /* mamba2_step.c's path */
    int32_t unused;
} NativeMamba;

/* A mixture-of-experts MLP (kvserve/model/moe.py's SparseMoeBlock): the router's float32
 * logits [T, num_experts] = x router^T (+ bias), a softmax over every expert, the top_k
 * (equal logits across the top-k boundary: the call stops, returning 4), renormalized to sum to 1 where `renormalize`;
 * each chosen expert's gated MLP (gate_up[e], down[e]: [2 * width, hidden] and [hidden,
 * width], any NativeLinear kind) on its tokens, times its weight, summed over the experts in
 * ascending id; plus, where shared_down.out > 0, the shared expert's gated MLP times
 * sigmoid(x shared_gate^T) (one row [hidden]). */
typedef struct {
    NativeLinear router;
    const NativeLinear *gate_up, *down; /* [num_experts] each */
    NativeLinear shared_gate_up, shared_down, shared_gate;
    int64_t num_experts, top_k;
    int32_t renormalize;
    int32_t softmax_after_topk;        /* gpt-oss: the top k of the logits, then a softmax over those k */
    int32_t swiglu;                    /* gpt-oss: the experts' clamped SwiGLU (limit, alpha) in place of SiLU */
    float swiglu_limit, swiglu_alpha;
    int32_t split; /* how the threads share the experts' matmuls: MOE_SPLIT_AUTO (0), MOE_SPLIT_ROWS
                    * (each expert's rows split over the threads) or MOE_SPLIT_EXPERTS (whole experts) */
} NativeMoe;

enum { MOE_SPLIT_AUTO, MOE_SPLIT_ROWS, MOE_SPLIT_EXPERTS };

typedef struct {
    NativeLinear qkv, o, gate_up, down; /* gate_up, down: the dense MLP (unused where moe) */
    const NativeMoe *moe;               /* NULL: a dense MLP */
    /* float32 norm weights; the last four NULL where the model has no such norm */
    const float *input_norm, *post_attention_norm, *pre_feedforward_norm, *post_feedforward_norm, *q_norm, *k_norm;
    void *k_cache, *v_cache; /* [kv_heads, blocks * block_size, head_dim] each */
    int64_t cache_head_stride, block_size, window; /* window 0: full attention */
    int32_t group, local_rope, kv_dtype; /* kv_dtype: F32, BF16 or F16 */
    int32_t attention_isa;               /* paged_attention.c's path */
    const NativeDeltaNet *delta_net;     /* non-NULL: a Gated DeltaNet layer (no attention, no KV cache) */
    const NativeMamba *mamba;            /* non-NULL: a Mamba-2 layer (no attention, no KV cache) */
    const float *sinks;                  /* [num_heads] float32: gpt-oss's attention sinks (NULL: none) */
} NativeLayer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    const float *final_norm;
    float eps, scale, softcap;
    int32_t adds_one, sandwich, gelu;
    int32_t panel_rows; /* steps of at least this many tokens use the panel GEMM (0: never) */
    /* The embedding table [embed.out, hidden], quantized, float32 or bfloat16, its rows times
     * embed_scale (0: none); embed.out 0: no table here, the caller embeds the tokens. */
    NativeLinear embed;
    float embed_scale;
    int32_t fewer_barriers; /* 1: O and down split by input columns where splits_by_input allows, and
                             * attention by query heads with query_share_kv on steps of a few tokens;
                             * 0: the matmuls split by rows (for A/B measurements) */
    /* Tensor parallelism (NULL: one rank): the O and down projections give this rank's
     * partial sums into reduce_buffer [T, hidden], and thread 0 calls
     * all_reduce(reduce_ctx, reduce_buffer, T * hidden) to sum them over the ranks in place
     * (nonzero: it failed) while the others wait: shm_all_reduce.c, or Python over gloo. */
    float *reduce_buffer;
    int32_t (*all_reduce)(void *ctx, float *buf, int64_t count);
    void *reduce_ctx;
    int64_t rotary_dim; /* RoPE rotates the first rotary_dim dimensions of each head (partial RoPE: < head_dim) */
    int32_t output_gate; /* Qwen3-Next: each query head's rows followed by as many of a gate; attention
                          * output times sigmoid(gate) */
    int32_t qk_norm_whole; /* the layers' q_norm / k_norm span the whole Q / K projection (OLMoE), not a head */
    /* Gated DeltaNet layers' shapes (0 where the model has none): key heads, value heads, their
     * sizes, the convolution's width K */
    int64_t dn_k_heads, dn_v_heads, dn_k_dim, dn_v_dim, dn_conv_width;
    /* Mamba-2 layers' shapes (0 where the model has none): heads H of P channels, state size N,
     * groups G, the convolution's width K */
    int64_t mb_heads, mb_head_dim, mb_state, mb_groups, mb_conv_width;
    float residual_multiplier; /* Granite: each layer's mixer and MLP outputs times this (1 or 0: none) */
    int32_t no_rope;           /* Granite 4: attention without RoPE */
} NativeModel;

/* One step: T tokens; token t sits at positions[t] of the request whose blocks are
 * row table_row[t] of each group's block table, and its K/V go to slots[g][t].
 * num_draft_tokens of them are speculative drafts being verified: the matmul kernel is
 * chosen by the step's tokens without them, so that every row of a verify step goes
 * through the kernel (and activation rounding) plain decoding would use, and greedy
 * speculative decoding emits exactly the tokens plain decoding does. */
typedef struct {
    int64_t num_tokens, num_draft_tokens;
    const int64_t *positions, *table_row, *token_index;
    const int64_t *block_table[MAX_GROUPS];
    int64_t block_table_stride[MAX_GROUPS];
    const int64_t *slots[MAX_GROUPS];
    const float *cos, *sin, *cos_local, *sin_local; /* [T, head_dim]; rope_by_position: [positions, head_dim] */
    const int64_t *token_ids; /* non-NULL: the step's tokens, embedded here from NativeModel.embed */
    int64_t rope_by_position; /* cos/sin are tables: token t takes their row positions[t] */
    /* A recurrent-state group g (Gated DeltaNet layers; decode steps only: token t is request t's
     * one token): state_read[g][t] the slot its state is read from (-1: zeros), state_write[g][t]
     * the slot its new state goes to; the state also goes to slot state_copy_slot[g][i] for
     * token state_copy_token[g][i], i < state_copies[g] (a snapshot kept at a block boundary). */
    const int64_t *state_read[MAX_GROUPS], *state_write[MAX_GROUPS];
    const int64_t *state_copy_token[MAX_GROUPS], *state_copy_slot[MAX_GROUPS];
    int64_t state_copies[MAX_GROUPS];
} NativeStep;

/* A grammar's allowed-token bitmask for some logits rows (grammar_mask.c's layout: bit
 * t % 32 of word t / 32), filled by another thread while the layers run and published
 * through `ready`. The head waits for it, masks its rows while they are still in its cache
 * and, where every row is masked, does not compute the vocabulary words no row may pick. */
typedef struct {
    const int32_t *bitmask;    /* [num_mask_rows, num_words] */
    const int64_t *logits_row; /* the logits row bitmask row r masks (all distinct) */
    int64_t num_mask_rows, num_words;
    const int32_t *ready; /* becomes ready_value once filled, -ready_value when there is none */
    int64_t timeout_ns;   /* waits no longer than this for `ready` */
    int32_t ready_value;  /* this step's number */
    int32_t isa;          /* grammar_mask.c's path */
    int32_t applied;      /* out: 1 when the logits came back masked */
    int32_t unused;
    int64_t wait_ns;      /* out: time spent waiting for `ready` */
    int64_t mask_ns;      /* out: time thread 0 spent writing -inf */
} NativeTokenMask;

/* The LM head inside the call (NULL: none): logits [num_rows, head.out] of the step's
 * tokens rows[0..num_rows), computed from the final norm's output once every layer is done;
 * the threads split the vocabulary rows. */
typedef struct {
    NativeLinear head;
    const int64_t *rows;
    int64_t num_rows;
    float *logits;
    NativeTokenMask *mask; /* NULL: none */
} NativeLogits;


/* One rank's view of the segment (filled by shm_all_reduce.py). */
typedef struct {
    char *base;         /* the mapped segment */
    int64_t capacity;   /* floats per slot */
    int64_t seq;        /* this rank's all-reduces so far */
    int64_t timeout_ns; /* waits no longer than this for the other ranks */
    int32_t rank, world;
    int32_t error;      /* out: the latest failure's code (below), sticky: a failed segment is out of step */
    int32_t unused;
} ShmAllReduce;

/* ---- cpu/features.c: the run-time probe ---------------------------------------------- */

uint64_t kvserve_cpuid_features(void);
uint64_t kvserve_xcr0(void);
int kvserve_request_amx_permission(void);
uint64_t kvserve_os_enabled_features(uint64_t cpuid_features, uint64_t xcr0, int amx_permitted);
uint64_t kvserve_usable_features(void);
int64_t kvserve_isa_requirement(int kernel, int isa);
int kvserve_isa_available(int kernel, int isa);

/* ---- cpu/abi_layout.c: the layout handshake -------------------------------------------- */

int64_t kvserve_abi_layout(int64_t *out, int64_t capacity);

/* ---- attention/paged_attention.c ------------------------------------------------------- */

int kvserve_paged_attention(const void *q, int64_t q_token_stride, int64_t q_head_stride, const void *k_cache,
                            const void *v_cache, int64_t cache_head_stride, void *out, int64_t out_token_stride,
                            int64_t out_head_stride, const int64_t *token_index, const int64_t *positions,
                            const int64_t *block_table, int64_t block_table_stride, const int64_t *table_row,
                            int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t window, float scale, float softcap, const float *sinks,
                            int q_dtype, int kv_dtype, int isa, int num_threads);
void kvserve_store_kv(const void *k, const void *v, int64_t token_stride, int64_t head_stride, void *k_cache,
                      void *v_cache, int64_t cache_head_stride, const int64_t *slots, const int64_t *tokens,
                      int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int in_dtype, int cache_dtype);

/* ---- attention/prefill_attention.c --------------------------------------------------------- */

int kvserve_prefill_attention(const void *q, int64_t q_token_stride, int64_t q_head_stride, const void *k_cache,
                              const void *v_cache, int64_t cache_head_stride, void *out, int64_t out_token_stride,
                              int64_t out_head_stride, const int64_t *chunk_start, const int64_t *chunk_len,
                              const int64_t *chunk_pos, const int64_t *chunk_row, const int64_t *block_table,
                              int64_t block_table_stride, int64_t num_chunks, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, int64_t block_size, int64_t window, float scale, float softcap,
                              const float *sinks, int q_dtype, int kv_dtype, int isa, int num_threads);

/* ---- decoder/fused_ops.c ----------------------------------------------------------------- */

void kvserve_rms_norm(const void *x, void *residual, const float *weight, void *out, int64_t rows, int64_t dim,
                      int64_t row_stride, float eps, int adds_one, int dtype, int num_threads);
void kvserve_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int dtype, int num_threads);
void kvserve_silu_mul_parts(const void *gate, const void *up, void *out, int64_t rows, int64_t width, int dtype,
                            int num_threads);
void kvserve_swiglu_clamped(const void *gate_up, void *out, int64_t rows, int64_t width, float limit, float alpha,
                            int dtype, int num_threads);
void kvserve_rotary(void *x, int64_t token_stride, int64_t head_stride, const void *cos, const void *sin,
                    int64_t tokens, int64_t heads, int64_t dim, int dtype, int num_threads);

/* ---- ssm/mamba2_step.c --------------------------------------------------------------------- */

int kvserve_mamba2_decode_step(const float *xbc, int64_t xbc_stride, const float *dt_raw, int64_t dt_stride,
                               float *conv_states, float *ssm_states, const int64_t *read_slot,
                               const int64_t *write_slot, const float *conv_weight, const float *conv_bias,
                               const float *dt_bias, const float *a, const float *d, float dt_min, float dt_max,
                               int64_t batch, int64_t num_heads, int64_t head_dim, int64_t n_state,
                               int64_t n_groups, int64_t kernel, float *scratch, float *y, int64_t y_stride,
                               int isa, int num_threads);

/* ---- ssm/gated_delta_step.c ---------------------------------------------------------------- */

int kvserve_gated_delta_step(const float *q, const float *k, int64_t qk_stride, const float *v, int64_t v_stride,
                             const float *g, const float *beta, int64_t gate_stride, float *states,
                             const int64_t *read_slot, const int64_t *write_slot, int64_t batch,
                             int64_t num_k_heads, int64_t num_v_heads, int64_t dk, int64_t dv, float *scratch,
                             float *out, int64_t out_stride, int isa);
void kvserve_gated_delta_head(float *state, const float *k, const float *q, const float *v, float decay, float beta,
                              int64_t dk, int64_t dv, float *scratch, float *out, int isa);

/* ---- decoder/fused_decoder.c --------------------------------------------------------------- */

int kvserve_decoder_forward(const NativeModel *m, const NativeLayer *layers, const NativeStep *st, float *hidden,
                            int num_threads);
int kvserve_decoder_forward_logits(const NativeModel *m, const NativeLayer *layers, const NativeStep *st,
                                   float *hidden, const NativeLogits *lg, int num_threads);
void kvserve_decoder_profile_enable(int on);
int64_t kvserve_decoder_profile_read(double *out, int max_threads);

/* ---- linear/small_linear.c ------------------------------------------------------------------- */

int kvserve_small_linear_supported(int dtype);
int kvserve_small_linear(const void *x, int64_t x_stride, const void *w, const void *bias, int64_t out, int64_t in,
                         void *y, int64_t y_stride, int64_t batch, int dtype, int num_threads);
int kvserve_small_linear_rows(const void *x, int64_t x_stride, const void *w, const void *bias, int64_t in, void *y,
                              int64_t y_stride, int64_t batch, int dtype, int64_t row_begin, int64_t row_end);

/* ---- linear/quant_linear.c -------------------------------------------------------------------- */

int kvserve_quant_linear(const void *x, int64_t x_stride, int64_t batch, const uint8_t *qs, const float *d,
                         const float *m, int bits, int64_t out, int64_t in, const void *bias, void *y, int64_t y_stride,
                         int dtype, int act_bits, int isa, int num_threads);
void kvserve_quant_activations(const float *x, int64_t x_stride, int64_t batch, int64_t in, int act_bits, void *qx,
                               float *scales);
void kvserve_quant_activation_blocks(const float *x, int64_t in, int8_t *qx, float *dx, float *sx);
int kvserve_quant_single_row_kernel(int act_bits, int isa);
void kvserve_quant_rows(const void *qx, const float *scales, int64_t batch, const uint8_t *qs, const float *d,
                        const float *m, int bits, int64_t in, const float *bias, float *y, int64_t y_stride,
                        int act_bits, int isa, int64_t row_begin, int64_t row_end);
int kvserve_quant_dequantize(const uint8_t *qs, const float *d, const float *m, int bits, int64_t out, int64_t in,
                             void *w, int dtype, int num_threads);
void kvserve_quant_row_values(const uint8_t *qs, const float *d, const float *m, int bits, int64_t in, int64_t r,
                              float *v);
int kvserve_quant_embed(const uint8_t *qs, const float *d, const float *m, int bits, int64_t rows, int64_t in,
                        const int64_t *ids, int64_t n, float *out);

/* ---- linear/quant_gemv.c: the single-row kernels (1 when they took the call) -------------------- */

int kvserve_quantize_row8(const float *x, int64_t in, int8_t *qx, float *dx, float *sx);
int kvserve_gemv_rows(const int8_t *qx, const float *scales, int64_t batch, const uint8_t *qs, const float *d,
                      const float *m, int bits, int64_t in, const float *bias, float *y, int64_t y_stride,
                      int64_t row_begin, int64_t row_end);
int kvserve_gemv_partials(const int8_t *qx, const float *dx, const float *sx, const uint8_t *qs, const float *d,
                          const float *m, int bits, int64_t in, const int64_t *bounds, int64_t num_runs, float *y,
                          int64_t run_stride, int64_t row_begin, int64_t row_end);
int kvserve_gemv(const int8_t *qx, const float *scales, int64_t batch, const uint8_t *qs, const float *d,
                 const float *m, int bits, int64_t in, const float *bias, float *y, int64_t y_stride, int64_t out,
                 int num_threads);

/* ---- linear/quant_gemm.c --------------------------------------------------------------------- */

int64_t kvserve_quant_gemm_panel_bytes(int64_t in);
void kvserve_quant_gemm_prepare(const void *x, int64_t x_stride, int64_t batch, int64_t in, int dtype, int isa,
                                void *xa);
void kvserve_quant_gemm_rows(const void *xa, int64_t batch, const uint8_t *qs, const float *d, const float *m,
                             int bits, int64_t in, const float *bias, float *y, int64_t y_stride, int isa,
                             int64_t row_begin, int64_t row_end, void *buffer);
int kvserve_quant_gemm(const void *x, int64_t x_stride, int64_t batch, const uint8_t *qs, const float *d,
                       const float *m, int bits, int64_t out, int64_t in, const void *bias, void *y, int64_t y_stride,
                       int dtype, int isa, int num_threads);

/* ---- linear/gguf_rows.c: GGUF block types as stored (types: csrc/linear/gguf/) -------------- */

int kvserve_gguf_supported(int type, int isa);
int64_t kvserve_gguf_row_bytes(int type, int64_t in);
void kvserve_gguf_rows(const int8_t *qx, const float *scales, int64_t batch, const uint8_t *w, int type, int64_t in,
                       const float *bias, float *y, int64_t y_stride, int isa, int64_t row_begin, int64_t row_end);
int kvserve_gguf_linear(const float *x, int64_t x_stride, int64_t batch, const uint8_t *w, int type, int64_t in,
                        const float *bias, float *y, int64_t out, int isa);
int kvserve_gguf_dequantize(const uint8_t *w, int type, int64_t in, const int64_t *rows, int64_t n, void *dst,
                            int dtype);
#define GGUF_SPLIT_RUNS 4 /* runs of a GGUF matmul split by input columns (kvserve_gguf_split_runs) */
int64_t kvserve_gguf_split_runs(int type, int64_t in, int64_t granule);
int64_t kvserve_gguf_split_bound(int type, int64_t in, int64_t granule, int64_t c);
void kvserve_gguf_partials(const int8_t *qx, const float *scales, int64_t batch, const uint8_t *w, int type,
                           int64_t in, const int64_t *bounds, int64_t num_runs, float *y, int64_t y_stride,
                           int64_t run_stride, int isa, int64_t row_begin, int64_t row_end);

/* ---- linear/gguf_gemm.c: many-row steps of GGUF blocks as stored ------------------------------ */

int kvserve_gguf_gemm_supported(int type, int isa);
int kvserve_gguf_gemm_min_batch(void);

/* ---- linear/moe_experts.c: a mixture of experts' routed experts, GGUF blocks as stored ------- */

int64_t kvserve_moe_experts_workspace(int64_t tokens, int64_t top_k, int64_t hidden, int64_t width);
int kvserve_moe_experts(const float *x, int64_t tokens, int64_t hidden, const int64_t *ids, const float *weights,
                        int64_t top_k, const int64_t *table, int64_t num_experts, int64_t width, int swiglu,
                        float limit, float alpha, float *out, int isa, int num_threads, void *workspace,
                        int64_t workspace_bytes);

/* ---- linear/bf16_rows.c ------------------------------------------------------------------------ */

void kvserve_bf16_round_rows(const float *x, int64_t x_stride, int64_t batch, int64_t in, uint16_t *xb);
void kvserve_bf16_linear_rows(const uint16_t *xb, int64_t batch, const uint16_t *w, const float *bias, int64_t in,
                              float *y, int64_t y_stride, int isa, int64_t row_begin, int64_t row_end);

/* ---- linear/f32_gemm.c -------------------------------------------------------------------------- */

int64_t kvserve_f32_packed_size(int64_t out, int64_t in);
void kvserve_f32_pack(const float *w, int64_t w_stride, int64_t out, int64_t in, float *packed);
void kvserve_f32_gemm_rows(const float *x, int64_t x_stride, int64_t batch, const float *packed, const float *bias,
                           int64_t in, float *y, int64_t y_stride, int isa, int64_t row_begin, int64_t row_end);
int kvserve_f32_gemm(const float *x, int64_t x_stride, int64_t batch, const float *packed, const float *bias,
                     int64_t out, int64_t in, float *y, int64_t y_stride, int isa, int num_threads);

/* ---- grammar/grammar_mask.c ------------------------------------------------------------------- */

void kvserve_mask_token_range(float *logits_row, const int32_t *words, int64_t num_words, int64_t begin, int64_t end,
                              int isa);
int kvserve_apply_token_bitmask(float *logits, int64_t logits_stride, int64_t width, const int32_t *bitmask,
                                int64_t bitmask_stride, int64_t num_words, const int64_t *row_index, int64_t rows,
                                int isa);
void kvserve_publish_mask_ready(int32_t *ready, int32_t value);
int32_t kvserve_wait_mask_ready(const int32_t *ready, int32_t value, int64_t timeout_ns, int64_t *waited_ns);

/* ---- comm/shm_all_reduce.c: ctx is a ShmAllReduce (NativeModel.all_reduce's signature) -------- */

int32_t kvserve_shm_all_reduce(void *ctx, float *buf, int64_t count);

#endif /* KVSERVE_H */
