/* The layout handshake: the sizes and field offsets of every struct the Python side
 * mirrors (kvserve/native/abi.py), and the constants both sides share, as this
 * compiler laid them out. abi.py compares them with ctypes' at load and refuses a
 * library that differs: a mismatch would otherwise be silent memory corruption.
 *
 * The order is the contract: each struct's sizeof, then the offset of each field in
 * the order abi.py lists them, struct after struct; then the constants.
 */
#include <stddef.h>

#include "kvserve.h"

#define SIZE(T) (int64_t) sizeof(T)
#define AT(T, f) (int64_t) offsetof(T, f)

static const int64_t LAYOUT[] = {
    SIZE(NativeLinear), AT(NativeLinear, qs), AT(NativeLinear, d), AT(NativeLinear, m), AT(NativeLinear, w),
    AT(NativeLinear, bias), AT(NativeLinear, out), AT(NativeLinear, in), AT(NativeLinear, bits),
    AT(NativeLinear, act_bits), AT(NativeLinear, isa), AT(NativeLinear, w_dtype), AT(NativeLinear, panel_isa),
    AT(NativeLinear, zero_min), AT(NativeLinear, num_parts), AT(NativeLinear, part_type),
    AT(NativeLinear, part_blocks), AT(NativeLinear, part_end),

    SIZE(NativeMoe), AT(NativeMoe, router), AT(NativeMoe, gate_up), AT(NativeMoe, down),
    AT(NativeMoe, shared_gate_up), AT(NativeMoe, shared_down), AT(NativeMoe, shared_gate), AT(NativeMoe, num_experts),
    AT(NativeMoe, top_k), AT(NativeMoe, renormalize), AT(NativeMoe, softmax_after_topk), AT(NativeMoe, swiglu),
    AT(NativeMoe, swiglu_limit), AT(NativeMoe, swiglu_alpha), AT(NativeMoe, split),

    SIZE(NativeDeltaNet), AT(NativeDeltaNet, qkvz), AT(NativeDeltaNet, ba), AT(NativeDeltaNet, out),
    AT(NativeDeltaNet, conv_weight), AT(NativeDeltaNet, dt_bias), AT(NativeDeltaNet, neg_a), AT(NativeDeltaNet, norm),
    AT(NativeDeltaNet, conv_states), AT(NativeDeltaNet, delta_states), AT(NativeDeltaNet, isa),
    AT(NativeDeltaNet, unused),

    SIZE(NativeMamba), AT(NativeMamba, in), AT(NativeMamba, out), AT(NativeMamba, conv_weight),
    AT(NativeMamba, conv_bias), AT(NativeMamba, dt_bias), AT(NativeMamba, a), AT(NativeMamba, d),
    AT(NativeMamba, norm), AT(NativeMamba, conv_states), AT(NativeMamba, ssm_states), AT(NativeMamba, dt_min),
    AT(NativeMamba, dt_max), AT(NativeMamba, isa), AT(NativeMamba, unused),

    SIZE(NativeLayer), AT(NativeLayer, qkv), AT(NativeLayer, o), AT(NativeLayer, gate_up), AT(NativeLayer, down),
    AT(NativeLayer, moe),
    AT(NativeLayer, input_norm), AT(NativeLayer, post_attention_norm), AT(NativeLayer, pre_feedforward_norm),
    AT(NativeLayer, post_feedforward_norm), AT(NativeLayer, q_norm), AT(NativeLayer, k_norm),
    AT(NativeLayer, k_cache), AT(NativeLayer, v_cache), AT(NativeLayer, cache_head_stride),
    AT(NativeLayer, block_size), AT(NativeLayer, window), AT(NativeLayer, group), AT(NativeLayer, local_rope),
    AT(NativeLayer, kv_dtype), AT(NativeLayer, attention_isa), AT(NativeLayer, delta_net), AT(NativeLayer, mamba),
    AT(NativeLayer, sinks),

    SIZE(NativeModel), AT(NativeModel, num_layers), AT(NativeModel, hidden), AT(NativeModel, num_heads),
    AT(NativeModel, num_kv_heads), AT(NativeModel, head_dim), AT(NativeModel, intermediate),
    AT(NativeModel, final_norm), AT(NativeModel, eps), AT(NativeModel, scale), AT(NativeModel, softcap),
    AT(NativeModel, adds_one), AT(NativeModel, sandwich), AT(NativeModel, gelu), AT(NativeModel, panel_rows),
    AT(NativeModel, embed), AT(NativeModel, embed_scale), AT(NativeModel, fewer_barriers),
    AT(NativeModel, reduce_buffer), AT(NativeModel, all_reduce), AT(NativeModel, reduce_ctx),
    AT(NativeModel, rotary_dim), AT(NativeModel, output_gate), AT(NativeModel, qk_norm_whole), AT(NativeModel, dn_k_heads),
    AT(NativeModel, dn_v_heads), AT(NativeModel, dn_k_dim), AT(NativeModel, dn_v_dim), AT(NativeModel, dn_conv_width),
    AT(NativeModel, mb_heads), AT(NativeModel, mb_head_dim), AT(NativeModel, mb_state), AT(NativeModel, mb_groups),
    AT(NativeModel, mb_conv_width), AT(NativeModel, residual_multiplier), AT(NativeModel, no_rope),

    SIZE(NativeStep), AT(NativeStep, num_tokens), AT(NativeStep, num_draft_tokens), AT(NativeStep, positions),
    AT(NativeStep, table_row), AT(NativeStep, token_index), AT(NativeStep, block_table),
    AT(NativeStep, block_table_stride), AT(NativeStep, slots), AT(NativeStep, cos), AT(NativeStep, sin),
    AT(NativeStep, cos_local), AT(NativeStep, sin_local), AT(NativeStep, token_ids), AT(NativeStep, rope_by_position),
    AT(NativeStep, state_read), AT(NativeStep, state_write), AT(NativeStep, state_copy_token),
    AT(NativeStep, state_copy_slot), AT(NativeStep, state_copies),

    SIZE(NativeTokenMask), AT(NativeTokenMask, bitmask), AT(NativeTokenMask, logits_row),
    AT(NativeTokenMask, num_mask_rows), AT(NativeTokenMask, num_words), AT(NativeTokenMask, ready),
    AT(NativeTokenMask, timeout_ns), AT(NativeTokenMask, ready_value), AT(NativeTokenMask, isa),
    AT(NativeTokenMask, applied), AT(NativeTokenMask, unused), AT(NativeTokenMask, wait_ns),
    AT(NativeTokenMask, mask_ns),

    SIZE(NativeLogits), AT(NativeLogits, head), AT(NativeLogits, rows), AT(NativeLogits, num_rows),
    AT(NativeLogits, logits), AT(NativeLogits, mask),

    SIZE(ShmAllReduce), AT(ShmAllReduce, base), AT(ShmAllReduce, capacity), AT(ShmAllReduce, seq),
    AT(ShmAllReduce, timeout_ns), AT(ShmAllReduce, rank), AT(ShmAllReduce, world), AT(ShmAllReduce, error),
    AT(ShmAllReduce, unused),

    MAX_GROUPS, F32_PANELS, ISA_COUNT, KV_KERNEL_COUNT, MAX_PARTS,
};

/* Writes up to `capacity` entries of the layout into `out`; returns how many there are. */
int64_t kvserve_abi_layout(int64_t *out, int64_t capacity) {
    int64_t n = (int64_t)(sizeof(LAYOUT) / sizeof(LAYOUT[0]));
    for (int64_t i = 0; i < n && i < capacity; i++) out[i] = LAYOUT[i];
    return n;
}
