"""How a model is described to the one-call native decoder (csrc/decoder/fused_decoder.c).

`ModelDescription` walks a model once and fills the C structs of kvserve/native/abi.py that
`NativeDecoder` hands to every call: one `NativeLayer` a layer (its projections, norms, MoE block
or state mixer), the `NativeModel` (shapes, flags, the embedding) and the LM head. It holds every
tensor and struct it points at, so that none is freed under the call, and raises `NativeDeclined`
for what the call does not cover (see native_decoder.py's docstring for the list).
"""
from __future__ import annotations

import ctypes
import logging

import torch

from kvserve.model import quantized
from kvserve.model.linear_attention.gated_deltanet import GatedDeltaNet
from kvserve.model.linear_attention.mamba2_mixer import Mamba2Mixer
from kvserve.model.moe import SparseMoeBlock
from kvserve.model.stored_parts import StoredParts
from kvserve.model.stored_weight import StoredWeight
from kvserve.native import cpu_kernels, dispatch
from kvserve.native.abi import (DTYPE_CODES, F32_PANELS, MAX_PARTS, NativeDeltaNet, NativeLayer, NativeLinear,
                                NativeMamba, NativeModel, NativeMoe)
from kvserve.native.isa import ISA_CODES

logger = logging.getLogger(__name__)

MAX_CONV_WIDTH = 16  # a Gated DeltaNet convolution's widest kernel (MAX_CONV_WIDTH in fused_decoder.c)


class NativeDeclined(Exception):
    """The model has a feature the native decoder does not cover (the message says which)."""



def _check_layers_covered(config) -> None:
    """Raise NativeDeclined for layers the one-call decoder does not implement."""
    if config.shared_expert_size:
        raise NativeDeclined("Granite's shared expert beside its routed ones (the per-op path runs them)")
    if config.sandwich_norms and config.residual_multiplier != 1.0:
        raise NativeDeclined("sandwich norms with a residual multiplier")
    if config.clip_qkv is not None:
        raise NativeDeclined("clipped Q/K/V")


def _check_state_layers_covered(model) -> None:
    """Raise NativeDeclined for recurrent-state layers the one-call decoder does not implement
    (it runs Gated DeltaNet layers, on one rank, in decode steps)."""
    for layer in model.layers:
        if not layer.is_state_layer:
            continue
        if not isinstance(layer.mixer, (GatedDeltaNet, Mamba2Mixer)):
            raise NativeDeclined(f"recurrent-state layers of {type(layer.mixer).__name__}")
        if isinstance(layer.mixer, GatedDeltaNet) and layer.mixer.conv_width > MAX_CONV_WIDTH:
            raise NativeDeclined(f"a Gated DeltaNet convolution of width {layer.mixer.conv_width}")
    if all(layer.is_state_layer for layer in model.layers):
        raise NativeDeclined("no attention layer")
    if model.has_state_layers and model.norm.weight.dtype != torch.float32:
        # the per-op state mixers round their outputs to the model's dtype; no test derives a
        # bound for the native call's float32 activations there yet
        raise NativeDeclined(f"recurrent-state layers in {model.norm.weight.dtype}")


def _widest_mlp(layer) -> int:
    """The widest MLP input of `layer` (a dense MLP's, an expert's or the shared expert's): the
    call's buffers hold that many columns a token."""
    mlp = layer.mlp
    if not isinstance(mlp, SparseMoeBlock):
        return mlp.down_proj.shard_input
    shared = mlp.shared_expert.down_proj.shard_input if mlp.shared_expert is not None else 0
    return max(mlp.experts[0].down_proj.shard_input, shared)


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class ModelDescription:
    """`model`'s layers, final norm, embedding and LM head as the native call's structs.

    `layers` (one `NativeLayer` a layer), `model_desc` (`NativeModel`), `head` (the LM head's
    `NativeLinear`, or None where it runs outside the call), `state_mixers` (layer index -> its
    Gated DeltaNet or Mamba-2 description), and what the projections allow: `layer_bytes` (the
    weight bytes of one layer), `panel_rows` (steps of this many tokens run the panel GEMM),
    `all_panel` (every projection has a panel path or takes any step size) and `gemm_rows` (steps
    of this many tokens take the per-op dense GEMM)."""

    def __init__(self, model, max_tokens: int) -> None:
        _check_layers_covered(model.config)
        _check_state_layers_covered(model)  # before any layer is described
        self.model = model
        self._keep: list[torch.Tensor] = []
        self._structs: list = []  # the MoE descriptions the layers point at
        self.layer_bytes = 0
        self.panel_rows = 0
        self.all_panel = True
        self.gemm_rows = max_tokens + 1
        self.layers = (NativeLayer * len(model.layers))()
        self.state_mixers: dict[int, NativeDeltaNet | NativeMamba] = {}
        for i, layer in enumerate(model.layers):
            if isinstance(layer.mixer, GatedDeltaNet):
                self._describe_delta_net(self.layers[i], layer, i)
            elif isinstance(layer.mixer, Mamba2Mixer):
                self._describe_mamba(self.layers[i], layer, i)
            else:
                self._describe_layer(self.layers[i], layer)
        self.model_desc = self._describe_model(model)
        # A tensor-parallel rank holds a vocabulary shard: the full rows are looked up (and
        # the logits gathered) outside the call.
        if model.tp.size == 1:
            self._describe_embedding(self.model_desc.embed)
        self.head = self._describe_head(model.lm_head) if model.tp.size == 1 else None

    def _describe_model(self, model) -> NativeModel:
        config = model.config
        attn = next(layer.self_attn for layer in model.layers if not layer.is_state_layer)
        if model.tp.size != 1 and config.is_moe:
            raise NativeDeclined("mixture-of-experts layers under tensor parallelism (the per-op path runs them)")
        if model.tp.size != 1 and any(layer.mixer.o_proj.bias is not None or layer.mlp.down_proj.bias is not None
                                      for layer in model.layers):
            raise NativeDeclined("a bias on a row-parallel projection under tensor parallelism")
        weight = model.norm.weight
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or (
                weight.dtype == torch.bfloat16 and model.kernels.bf16_isa is None):
            raise NativeDeclined(f"{weight.dtype} on {weight.device}")
        if not cpu_kernels.supports_shape(attn.num_heads, attn.num_kv_heads, attn.head_dim):
            raise NativeDeclined(f"attention shape {attn.num_heads}/{attn.num_kv_heads}x{attn.head_dim}")
        if config.hidden_size > cpu_kernels._MAX_NORM_DIM or config.hidden_act not in (
                "silu", "swish", "gelu_pytorch_tanh", "gelu_tanh"):
            raise NativeDeclined(f"hidden size {config.hidden_size} / activation {config.hidden_act}")
        rotary_dim = model.rotary_global.inv_freq.numel() * 2
        if rotary_dim > attn.head_dim or (model.rotary_local is not None
                                          and model.rotary_local.inv_freq.numel() * 2 != rotary_dim):
            raise NativeDeclined("a rotary embedding wider than the head, or local and global ones of other widths")
        desc = NativeModel(num_layers=len(model.layers), hidden=config.hidden_size, num_heads=attn.num_heads,
                           num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, panel_rows=self.panel_rows,
                           intermediate=max(map(_widest_mlp, model.layers)), final_norm=self._norm(model.norm),
                           eps=config.rms_norm_eps, scale=attn.params.scale, softcap=attn.params.softcap or 0.0,
                           adds_one=int(config.norm_adds_one), sandwich=int(config.sandwich_norms),
                           gelu=int(config.hidden_act.startswith("gelu")), rotary_dim=rotary_dim,
                           output_gate=int(attn.output_gate), no_rope=int(not attn.use_rope),
                           residual_multiplier=config.residual_multiplier,
                           qk_norm_whole=int(attn.q_norm is not None and not attn.qk_norm_per_head))
        for mixer in (layer.mixer for layer in model.layers if layer.is_state_layer):
            if isinstance(mixer, GatedDeltaNet):
                desc.dn_k_heads, desc.dn_v_heads = mixer.num_k_heads, mixer.num_v_heads
                desc.dn_k_dim, desc.dn_v_dim, desc.dn_conv_width = mixer.head_k_dim, mixer.head_v_dim, mixer.conv_width
            else:
                shape = mixer.shape
                desc.mb_heads, desc.mb_head_dim, desc.mb_state = shape.num_heads, shape.head_dim, shape.state_size
                desc.mb_groups, desc.mb_conv_width = shape.n_groups, shape.conv_kernel
        return desc

    def _describe_layer(self, desc: NativeLayer, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        for field, module in (("qkv", attn.qkv_proj), ("o", attn.o_proj)):
            self._describe_linear(getattr(desc, field), module)
        self._describe_mlp(desc, mlp)
        desc.input_norm = self._norm(layer.input_layernorm)
        desc.post_attention_norm = self._norm(layer.post_attention_layernorm)
        if layer.sandwich:
            desc.pre_feedforward_norm = self._norm(layer.pre_feedforward_layernorm)
            desc.post_feedforward_norm = self._norm(layer.post_feedforward_layernorm)
        if attn.q_norm is not None:
            desc.q_norm, desc.k_norm = self._norm(attn.q_norm), self._norm(attn.k_norm)
        desc.window = attn.sliding_window or 0
        desc.local_rope = int(attn.sliding_window is not None and self.model.rotary_local is not None)
        if attn.sinks is not None:  # gpt-oss: float32 [this rank's query heads]
            desc.sinks = self._hold(attn.sinks.detach().float().contiguous()).data_ptr()

    def _describe_mlp(self, desc: NativeLayer, mlp) -> None:
        """A layer's MLP: dense (gate_up, down) or a mixture of experts (moe)."""
        if isinstance(mlp, SparseMoeBlock):
            desc.moe = ctypes.pointer(self._describe_moe(mlp))
        else:
            self._describe_linear(desc.gate_up, mlp.gate_up_proj)
            self._describe_linear(desc.down, mlp.down_proj)

    def _describe_moe(self, block: SparseMoeBlock) -> NativeMoe:
        """The block's router (float32), experts and shared expert for the call (held here)."""
        num_experts = len(block.experts)
        gate_up, down = (NativeLinear * num_experts)(), (NativeLinear * num_experts)()
        for i, expert in enumerate(block.experts):
            self._describe_linear(gate_up[i], expert.gate_up_proj)
            self._describe_linear(down[i], expert.down_proj)
        desc = NativeMoe(gate_up=gate_up, down=down, num_experts=num_experts, top_k=block.top_k,
                         renormalize=int(block.renormalize), softmax_after_topk=int(block.softmax_after_topk))
        gating = {(expert.swiglu_limit, expert.swiglu_alpha) for expert in block.experts}
        if len(gating) != 1:
            raise NativeDeclined("experts with different gate activations")
        limit, alpha = gating.pop()
        if limit is not None:  # gpt-oss's clamped SwiGLU (fused_ops.c's kvserve_swiglu_clamped)
            desc.swiglu, desc.swiglu_limit, desc.swiglu_alpha = 1, limit, alpha
        self._describe_float(desc.router, block.gate)
        if block.shared_expert is not None:
            self._describe_linear(desc.shared_gate_up, block.shared_expert.gate_up_proj)
            self._describe_linear(desc.shared_down, block.shared_expert.down_proj)
            self._describe_float(desc.shared_gate, block.shared_expert_gate)
        self._structs += [gate_up, down, desc]
        return desc

    def _describe_float(self, desc: NativeLinear, router) -> None:
        """A router's rows (and bias) as a plain float32 matrix: the call computes its logits in float32."""
        weight = self._hold(router.weight.detach().float().contiguous())
        bias = None if router.bias is None else self._hold(router.bias.detach().float().contiguous())
        desc.w, desc.bias, desc.w_dtype, desc.panel_isa = weight.data_ptr(), _ptr_of(bias), DTYPE_CODES[torch.float32], -1
        desc.out, desc.in_ = weight.shape

    def _describe_delta_net(self, desc: NativeLayer, layer, index: int) -> None:
        """A Gated DeltaNet layer: its mixer's weights (state slots bound per cache dict) and MLP."""
        mixer = layer.mixer
        net = self.state_mixers[index] = NativeDeltaNet()
        for field, module in (("qkvz", mixer.in_proj_qkvz), ("ba", mixer.in_proj_ba), ("out", mixer.out_proj)):
            self._describe_linear(getattr(net, field), module)
        net.conv_weight = self._hold(mixer.conv1d.weight.detach()[:, 0].float().contiguous()).data_ptr()
        net.dt_bias = self._hold(mixer.dt_bias.detach().float().contiguous()).data_ptr()
        net.neg_a = self._hold(-mixer.A_log.detach().float().exp()).data_ptr()
        net.norm = self._norm(mixer.norm)
        net.isa = ISA_CODES[dispatch.widest("gated_delta") or "portable"]
        self._describe_norms_and_mlp(desc, layer)
        desc.delta_net = ctypes.pointer(net)

    def _describe_mamba(self, desc: NativeLayer, layer, index: int) -> None:
        """A Mamba-2 layer: its mixer's weights and SSM parameters (state slots bound per cache
        dict) and MLP."""
        mixer = layer.mixer
        net = self.state_mixers[index] = NativeMamba()
        for field, module in (("in_", mixer.in_proj), ("out", mixer.out_proj)):
            self._describe_linear(getattr(net, field), module)
        params = mixer.params()
        net.conv_weight, net.dt_bias, net.a, net.d = (self._hold(t.contiguous()).data_ptr() for t in (
            params.conv_weight, params.dt_bias, params.A, params.D))
        net.conv_bias = None if params.conv_bias is None else self._hold(params.conv_bias).data_ptr()
        net.norm = self._norm(mixer.norm)
        net.dt_min, net.dt_max = params.dt_min, params.dt_max
        net.isa = ISA_CODES[dispatch.widest("mamba2") or "portable"]
        self._describe_norms_and_mlp(desc, layer)
        desc.mamba = ctypes.pointer(net)

    def _describe_norms_and_mlp(self, desc: NativeLayer, layer) -> None:
        """A state layer's pre-norm block around its mixer: its two norms and its MLP (dense or experts)."""
        self._describe_mlp(desc, layer.mlp)
        desc.input_norm = self._norm(layer.input_layernorm)
        desc.post_attention_norm = self._norm(layer.post_attention_layernorm)

    def _describe_embedding(self, desc: NativeLinear) -> None:
        """The embedding table for the call where it gives the rows exactly as
        `DecoderModel.embed` does (quantized or float32 tables of a float32 model, bfloat16
        ones unscaled); else `desc.out` stays 0 and the caller embeds the tokens."""
        model = self.model
        dtype, qw, weight = model.norm.weight.dtype, model.embed_tokens.quant_weight, model.embed_tokens.weight
        if isinstance(qw, StoredWeight):
            if dtype != torch.float32:
                return
            self._describe_stored(desc, qw)
        elif qw is not None:
            if dtype != torch.float32 or qw.bits not in (4, 8, 16) or qw.in_features % quantized.BLOCK:
                return
            desc.qs, desc.d, desc.m = (self._hold(t).data_ptr() for t in (qw.qs, qw.d, qw.m))
            desc.bits, desc.out = qw.bits, qw.out_features
        else:
            if (weight is None or weight.device.type != "cpu" or not weight.is_contiguous() or weight.dtype != dtype
                    or (dtype == torch.bfloat16 and (model.config.scales_embeddings
                                                     or model.config.embedding_multiplier != 1.0))):
                return
            desc.w, desc.w_dtype, desc.out = self._hold(weight).data_ptr(), DTYPE_CODES[dtype], \
                weight.shape[0]
        desc.in_ = model.config.hidden_size
        if model.config.scales_embeddings:  # the factor `DecoderModel.embed` multiplies by, in float32
            self.model_desc.embed_scale = float(torch.tensor(model.config.hidden_size ** 0.5, dtype=torch.float32))
        elif model.config.embedding_multiplier != 1.0:  # Granite's
            self.model_desc.embed_scale = model.config.embedding_multiplier

    def _describe_head(self, lm_head) -> NativeLinear | None:
        """The LM head for the call, or None (it then runs after it, in torch): float32 models
        only, whose torch LM head gives float32 logits too."""
        if self.model.norm.weight.dtype != torch.float32:
            return None
        desc = NativeLinear()
        state = (self.layer_bytes, self.panel_rows, self.all_panel, self.gemm_rows)
        try:
            self._describe_linear(desc, lm_head)
        except NativeDeclined as reason:
            logger.info("LM head outside the native decoder: %s", reason)
            return None
        finally:  # the head does not count in the layers' sizes and step limits
            self.layer_bytes, self.panel_rows, self.all_panel, self.gemm_rows = state
        return desc

    def _describe_linear(self, desc: NativeLinear, module) -> None:
        qw = module.quant_weight
        bias = getattr(module, "bias", None)
        if bias is not None:
            bias = self._hold(bias.detach().float().contiguous())
        desc.bias = _ptr_of(bias)
        if isinstance(qw, (StoredWeight, StoredParts)):
            self._describe_stored(desc, qw)  # its row kernel takes every step size: `_all_panel` holds
            self.gemm_rows = min(self.gemm_rows, qw.gemm_rows or self.gemm_rows)
            self.layer_bytes += qw.nbytes() // len(self.model.layers)
            return
        if qw is not None:
            if qw.bits not in (4, 8, 16) or qw.in_features % quantized.BLOCK:
                raise NativeDeclined(f"quantized weight of {qw.bits} bits")
            desc.qs, desc.d, desc.m = (self._hold(t).data_ptr() for t in (qw.qs, qw.d, qw.m))
            desc.bits, desc.act_bits = qw.bits, qw.act_bits
            desc.zero_min = int(not bool(qw.m.any()))  # Q8_0: 4 bytes a block the row kernels need not read
            desc.isa = ISA_CODES[qw.isa or quantized.kernel_isa() or "portable"]
            desc.panel_isa = ISA_CODES[quantized.panel_isa(qw)] if qw.panel_rows else -1
            self.panel_rows = max(self.panel_rows, qw.panel_rows)
            self.all_panel &= qw.panel_rows > 0
            self.gemm_rows = min(self.gemm_rows, qw.gemm_rows or self.gemm_rows)
            desc.out, desc.in_ = qw.out_features, qw.in_features
            self.layer_bytes += qw.nbytes() // len(self.model.layers)
            return
        if module.panel_weight is not None:  # float32 panels (csrc/linear/f32_gemm.c): every step size
            desc.w, desc.w_dtype, desc.isa = self._hold(module.panel_weight).data_ptr(), F32_PANELS, module.panel_isa
            desc.panel_isa = -1
            self.layer_bytes += module.panel_weight.numel() * 4 // len(self.model.layers)
            desc.out, desc.in_ = module.panel_out, module.panel_weight.shape[1]
            return
        weight = module.weight
        if weight is None or not weight.is_contiguous():
            raise NativeDeclined("a projection held only in oneDNN's packed layout")
        if weight.dtype == torch.bfloat16 and self.model.kernels.bf16_isa is not None:
            desc.w_dtype, desc.isa = DTYPE_CODES[weight.dtype], ISA_CODES[self.model.kernels.bf16_isa]
        elif weight.dtype != torch.float32:
            raise NativeDeclined(f"a projection in {weight.dtype}")
        desc.w = self._hold(weight).data_ptr()
        desc.panel_isa = -1
        self.all_panel = False
        self.layer_bytes += weight.numel() * weight.element_size() // len(self.model.layers)
        desc.out, desc.in_ = weight.shape

    def _describe_stored(self, desc: NativeLinear, weight: StoredWeight | StoredParts) -> None:
        """GGUF blocks as stored (csrc/linear/gguf_rows.c): the parts' blocks, types and row ends."""
        parts = weight.parts if isinstance(weight, StoredParts) else [weight]
        if len(parts) > MAX_PARTS:
            raise NativeDeclined(f"a projection of {len(parts)} stored parts")
        end = 0
        for i, part in enumerate(parts):
            end += part.out_features
            desc.part_blocks[i] = self._hold(part.blocks).data_ptr()
            desc.part_type[i], desc.part_end[i] = part.ggml_type, end
        desc.num_parts = len(parts)
        desc.isa = ISA_CODES[parts[0].isa or quantized.kernel_isa() or "portable"]
        desc.panel_isa = -1
        desc.out, desc.in_ = weight.out_features, weight.in_features

    def _norm(self, norm) -> int:
        if norm.weight.device.type != "cpu":
            raise NativeDeclined("weights off the CPU")
        return self._hold(norm.weight.detach().float().contiguous()).data_ptr()

    def _hold(self, tensor: torch.Tensor) -> torch.Tensor:
        self._keep.append(tensor)
        return tensor
