"""The ABI between Python and the native library, declared once on this side: every
export's ctypes signature (`SIGNATURES`) and a mirror of every struct the calls share
(the `Native*` classes, csrc/include/kvserve.h's layout), with the codes the calls
take for dtypes.

A mismatch here is memory corruption, not an error: `declare` gives every export its
signature when the library loads.
"""
from __future__ import annotations

import ctypes

import torch

from kvserve.native import isa

_i64, _i32, _f32, _ptr, _int = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_u64 = ctypes.c_uint64

# Element types of activations and plain weights (csrc/include/bf16.h); the KV cache may
# also hold float16, read and written with float32 math.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
KV_DTYPE_CODES = {**DTYPE_CODES, torch.float16: 2}
# NativeLinear.w_dtype of float32 weights held in csrc/linear/f32_gemm.c's panels.
F32_PANELS = 2
# Block tables one step may carry (MAX_GROUPS in csrc/decoder/fused_decoder.c).
MAX_GROUPS = 8
# GGUF tensors one NativeLinear may stack (q, k, v: model/stored_parts.py).
MAX_PARTS = 3


class NativeLinear(ctypes.Structure):
    """One projection: block-quantized (qs, d, m), a plain/panel weight `w`, or GGUF blocks as
    stored (`num_parts` tensors stacked by rows)."""
    _fields_ = [("qs", _ptr), ("d", _ptr), ("m", _ptr), ("w", _ptr), ("bias", _ptr), ("out", _i64), ("in_", _i64),
                ("bits", _i32), ("act_bits", _i32), ("isa", _i32), ("w_dtype", _i32), ("panel_isa", _i32),
                ("zero_min", _i32), ("num_parts", _i32), ("part_type", _i32 * MAX_PARTS),
                ("part_blocks", _ptr * MAX_PARTS), ("part_end", _i64 * MAX_PARTS)]


class NativeMoe(ctypes.Structure):
    """A mixture-of-experts MLP: the float32 router, each expert's gate/up and down (arrays of
    `num_experts`), the optional shared expert (`shared_down.out` 0: none) and its gate row."""
    _fields_ = [("router", NativeLinear), ("gate_up", ctypes.POINTER(NativeLinear)),
                ("down", ctypes.POINTER(NativeLinear)), ("shared_gate_up", NativeLinear),
                ("shared_down", NativeLinear), ("shared_gate", NativeLinear), ("num_experts", _i64),
                ("top_k", _i64), ("renormalize", _i32), ("softmax_after_topk", _i32), ("swiglu", _i32),
                ("swiglu_limit", _f32), ("swiglu_alpha", _f32), ("split", _i32)]


class NativeDeltaNet(ctypes.Structure):
    """One Gated DeltaNet mixer: its projections, convolution, decay and norm weights, state slots."""
    _fields_ = [("qkvz", NativeLinear), ("ba", NativeLinear), ("out", NativeLinear), ("conv_weight", _ptr),
                ("dt_bias", _ptr), ("neg_a", _ptr), ("norm", _ptr), ("conv_states", _ptr), ("delta_states", _ptr),
                ("isa", _i32), ("unused", _i32)]


class NativeMamba(ctypes.Structure):
    """One Mamba-2 mixer: its projections, convolution, SSM parameters and norm, state slots."""
    _fields_ = [("in_", NativeLinear), ("out", NativeLinear), ("conv_weight", _ptr), ("conv_bias", _ptr),
                ("dt_bias", _ptr), ("a", _ptr), ("d", _ptr), ("norm", _ptr), ("conv_states", _ptr),
                ("ssm_states", _ptr), ("dt_min", _f32), ("dt_max", _f32), ("isa", _i32), ("unused", _i32)]


class NativeLayer(ctypes.Structure):
    """One decoder layer: its projections (a dense MLP's, or `moe`), norm weights and KV-cache group."""
    _fields_ = [("qkv", NativeLinear), ("o", NativeLinear), ("gate_up", NativeLinear), ("down", NativeLinear),
                ("moe", ctypes.POINTER(NativeMoe)),
                ("input_norm", _ptr), ("post_attention_norm", _ptr), ("pre_feedforward_norm", _ptr),
                ("post_feedforward_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr),
                ("k_cache", _ptr), ("v_cache", _ptr), ("cache_head_stride", _i64), ("block_size", _i64),
                ("window", _i64), ("group", _i32), ("local_rope", _i32), ("kv_dtype", _i32), ("attention_isa", _i32),
                ("delta_net", ctypes.POINTER(NativeDeltaNet)), ("mamba", ctypes.POINTER(NativeMamba)),
                ("sinks", _ptr)]


# The all-reduce the decoder call makes under tensor parallelism: (context, float32 buffer,
# element count) -> 0, or nonzero on failure.
ALL_REDUCE_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class NativeModel(ctypes.Structure):
    """The model-wide shape and options of the decoder call."""
    _fields_ = [("num_layers", _i64), ("hidden", _i64), ("num_heads", _i64), ("num_kv_heads", _i64),
                ("head_dim", _i64), ("intermediate", _i64), ("final_norm", _ptr), ("eps", _f32), ("scale", _f32),
                ("softcap", _f32), ("adds_one", _i32), ("sandwich", _i32), ("gelu", _i32), ("panel_rows", _i32),
                ("embed", NativeLinear), ("embed_scale", _f32), ("fewer_barriers", _i32), ("reduce_buffer", _ptr),
                ("all_reduce", ALL_REDUCE_FN), ("reduce_ctx", _ptr), ("rotary_dim", _i64), ("output_gate", _i32),
                ("qk_norm_whole", _i32), ("dn_k_heads", _i64), ("dn_v_heads", _i64), ("dn_k_dim", _i64),
                ("dn_v_dim", _i64), ("dn_conv_width", _i64), ("mb_heads", _i64), ("mb_head_dim", _i64),
                ("mb_state", _i64), ("mb_groups", _i64), ("mb_conv_width", _i64), ("residual_multiplier", _f32),
                ("no_rope", _i32)]


class NativeStep(ctypes.Structure):
    """One step's tokens, positions, block tables and RoPE tables."""
    _fields_ = [("num_tokens", _i64), ("num_draft_tokens", _i64), ("positions", _ptr), ("table_row", _ptr),
                ("token_index", _ptr), ("block_table", _ptr * MAX_GROUPS), ("block_table_stride", _i64 * MAX_GROUPS),
                ("slots", _ptr * MAX_GROUPS), ("cos", _ptr), ("sin", _ptr), ("cos_local", _ptr),
                ("sin_local", _ptr), ("token_ids", _ptr), ("rope_by_position", _i64),
                ("state_read", _ptr * MAX_GROUPS), ("state_write", _ptr * MAX_GROUPS),
                ("state_copy_token", _ptr * MAX_GROUPS), ("state_copy_slot", _ptr * MAX_GROUPS),
                ("state_copies", _i64 * MAX_GROUPS)]


class NativeTokenMask(ctypes.Structure):
    """A grammar bitmask the LM head applies once the mask thread publishes it."""
    _fields_ = [("bitmask", _ptr), ("logits_row", _ptr), ("num_mask_rows", _i64), ("num_words", _i64),
                ("ready", _ptr), ("timeout_ns", _i64), ("ready_value", _i32), ("isa", _i32), ("applied", _i32),
                ("unused", _i32), ("wait_ns", _i64), ("mask_ns", _i64)]


class NativeLogits(ctypes.Structure):
    """The LM head the decoder call runs on some of its rows (and their mask)."""
    _fields_ = [("head", NativeLinear), ("rows", _ptr), ("num_rows", _i64), ("logits", _ptr),
                ("mask", ctypes.POINTER(NativeTokenMask))]


class ShmAllReduce(ctypes.Structure):
    """One rank's view of the shared-memory all-reduce segment (csrc/comm/shm_all_reduce.c)."""
    _fields_ = [("base", _ptr), ("capacity", _i64), ("seq", _i64), ("timeout_ns", _i64), ("rank", _i32),
                ("world", _i32), ("error", _i32), ("unused", _i32)]


# export -> (argument types, return type), as csrc/include/kvserve.h declares them
# (tests/native/test_abi.py checks this table against the header).
SIGNATURES = {
    "kvserve_cpuid_features": ([], _u64),
    "kvserve_xcr0": ([], _u64),
    "kvserve_request_amx_permission": ([], _int),
    "kvserve_os_enabled_features": ([_u64, _u64, _int], _u64),
    "kvserve_usable_features": ([], _u64),
    "kvserve_isa_requirement": ([_int, _int], _i64),
    "kvserve_isa_available": ([_int, _int], _int),
    "kvserve_abi_layout": ([_ptr, _i64], _i64),
    "kvserve_paged_attention": ([_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr,
                                 _i64, _i64, _i64, _i64, _i64, _i64, _f32, _f32, _ptr, _int, _int, _int, _int], _int),
    "kvserve_prefill_attention": ([_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr,
                                   _i64, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _f32, _ptr, _int, _int, _int, _int],
                                  _int),
    "kvserve_store_kv": ([_ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _int, _int], None),
    "kvserve_rms_norm": ([_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _f32, _int, _int, _int], None),
    "kvserve_silu_mul": ([_ptr, _ptr, _i64, _i64, _int, _int], None),
    "kvserve_silu_mul_parts": ([_ptr, _ptr, _ptr, _i64, _i64, _int, _int], None),
    "kvserve_swiglu_clamped": ([_ptr, _ptr, _i64, _i64, _f32, _f32, _int, _int], None),
    "kvserve_rotary": ([_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _int, _int], None),
    "kvserve_small_linear_supported": ([_int], _int),
    "kvserve_small_linear": ([_ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _int, _int], _int),
    "kvserve_quant_linear": ([_ptr, _i64, _i64, _ptr, _ptr, _ptr, _int, _i64, _i64, _ptr, _ptr, _i64, _int, _int,
                              _int, _int], _int),
    "kvserve_quant_dequantize": ([_ptr, _ptr, _ptr, _int, _i64, _i64, _ptr, _int, _int], _int),
    "kvserve_quant_embed": ([_ptr, _ptr, _ptr, _int, _i64, _i64, _ptr, _i64, _ptr], _int),
    "kvserve_decoder_forward": ([_ptr, _ptr, _ptr, _ptr, _int], _int),
    "kvserve_decoder_forward_logits": ([_ptr, _ptr, _ptr, _ptr, _ptr, _int], _int),
    "kvserve_decoder_profile_enable": ([_int], None),
    "kvserve_decoder_profile_read": ([_ptr, _int], _i64),
    "kvserve_quant_activations": ([_ptr, _i64, _i64, _i64, _int, _ptr, _ptr], None),
    "kvserve_quant_gemm": ([_ptr, _i64, _i64, _ptr, _ptr, _ptr, _int, _i64, _i64, _ptr, _ptr, _i64, _int, _int, _int],
                           _int),
    "kvserve_f32_packed_size": ([_i64, _i64], _i64),
    "kvserve_f32_pack": ([_ptr, _i64, _i64, _i64, _ptr], None),
    "kvserve_f32_gemm": ([_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i64, _int, _int], _int),
    "kvserve_bf16_round_rows": ([_ptr, _i64, _i64, _i64, _ptr], None),
    "kvserve_bf16_linear_rows": ([_ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _int, _i64, _i64], None),
    "kvserve_mamba2_decode_step": ([_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr,
                                    _f32, _f32, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _int, _int],
                                   _int),
    "kvserve_gated_delta_step": ([_ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64,
                                  _i64, _i64, _i64, _ptr, _ptr, _i64, _int], _int),
    "kvserve_apply_token_bitmask": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _int], _int),
    "kvserve_publish_mask_ready": ([_ptr, _i32], None),
    "kvserve_mask_token_range": ([_ptr, _ptr, _i64, _i64, _i64, _int], None),
    "kvserve_shm_all_reduce": ([_ptr, _ptr, _i64], _i32),
    "kvserve_quant_rows": ([_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _int, _i64, _ptr, _ptr, _i64, _int, _int, _i64, _i64],
                           None),
    "kvserve_gguf_supported": ([_int, _int], _int),
    "kvserve_gguf_row_bytes": ([_int, _i64], _i64),
    "kvserve_gguf_rows": ([_ptr, _ptr, _i64, _ptr, _int, _i64, _ptr, _ptr, _i64, _int, _i64, _i64], None),
    "kvserve_gguf_linear": ([_ptr, _i64, _i64, _ptr, _int, _i64, _ptr, _ptr, _i64, _int], _int),
    "kvserve_gguf_dequantize": ([_ptr, _int, _i64, _ptr, _i64, _ptr, _int], _int),
    "kvserve_gguf_split_runs": ([_int, _i64, _i64], _i64),
    "kvserve_gguf_split_bound": ([_int, _i64, _i64, _i64], _i64),
    "kvserve_gguf_partials": ([_ptr, _ptr, _i64, _ptr, _int, _i64, _ptr, _i64, _ptr, _i64, _i64, _int, _i64, _i64],
                              None),
    "kvserve_quant_activation_blocks": ([_ptr, _i64, _ptr, _ptr, _ptr], None),
    "kvserve_gguf_gemm_supported": ([_int, _int], _int),
    "kvserve_gguf_gemm_min_batch": ([], _int),
    "kvserve_moe_experts_workspace": ([_i64, _i64, _i64, _i64], _i64),
    "kvserve_moe_experts": ([_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _int, _f32, _f32, _ptr, _int,
                             _int, _ptr, _i64], _int),
    "kvserve_gemv_partials": ([_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64],
                              _int),
}


# The exports of the probe built alone (csrc/cpu/features.c, `build.load_probe`).
PROBE_EXPORTS = ("kvserve_cpuid_features", "kvserve_xcr0", "kvserve_request_amx_permission",
                 "kvserve_os_enabled_features", "kvserve_usable_features", "kvserve_isa_requirement",
                 "kvserve_isa_available")

# The structs csrc/cpu/abi_layout.c reports, in its order, and the constants after them.
LAYOUT_STRUCTS = (NativeLinear, NativeMoe, NativeDeltaNet, NativeMamba, NativeLayer, NativeModel, NativeStep,
                  NativeTokenMask,
                  NativeLogits, ShmAllReduce)
LAYOUT_CONSTANTS = {"MAX_GROUPS": MAX_GROUPS, "F32_PANELS": F32_PANELS, "ISA_COUNT": len(isa.ISAS),
                    "KV_KERNEL_COUNT": len(isa.KERNELS), "MAX_PARTS": MAX_PARTS}


class AbiMismatchError(RuntimeError):
    """The library's struct layout or constants differ from this module's mirrors."""


def expected_layout() -> list[tuple[str, int]]:
    """(what, value) in csrc/cpu/abi_layout.c's order, as ctypes lays the mirrors out."""
    entries = []
    for struct in LAYOUT_STRUCTS:
        entries.append((f"sizeof({struct.__name__})", ctypes.sizeof(struct)))
        entries += [(f"offsetof({struct.__name__}, {name})", getattr(struct, name).offset)
                    for name, *_ in struct._fields_]
    return entries + list(LAYOUT_CONSTANTS.items())


def check_layout(lib: ctypes.CDLL) -> None:
    """Raises `AbiMismatchError` unless the library reports the layout `expected_layout` gives."""
    expected = expected_layout()
    capacity = len(expected) + 64
    reported = (ctypes.c_int64 * capacity)()
    count = lib.kvserve_abi_layout(reported, capacity)
    wrong = [f"{what}: C {reported[i]}, Python {value}" for i, (what, value) in enumerate(expected)
             if i < count and reported[i] != value]
    if count != len(expected) or wrong:
        raise AbiMismatchError(f"the native library's ABI differs from kvserve/native/abi.py ({count} layout entries, "
                               f"{len(expected)} expected): {'; '.join(wrong[:5]) or 'a struct gained or lost a field'}")


def declare(lib: ctypes.CDLL) -> None:
    """Gives every export of `lib` its signature (AttributeError where one is missing)."""
    for name, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
