"""One decoder-only transformer with per-family switches (ModelConfig decides):
Llama / Mistral / Qwen2 (QKV bias) / Qwen3 (Q/K norm) / Gemma-2 / Gemma-3
(sandwich norms, (1+w) RMSNorm, GeGLU, embedding scaling, soft-capping,
interleaved sliding-window layers, Gemma-3's local RoPE base), the
mixtures of experts Qwen3-MoE / Mixtral / OLMoE (Q/K norm over the whole
projection), whose sparse layers run a `moe.SparseMoeBlock` as their MLP, and
Granite 4's hybrids (a shared expert, scaled residual branches, NoPE attention).
Layers whose type is a recurrent-state kind (`state_layers.STATE_LAYER_KINDS`:
Mamba-2 "mamba" layers, ...) run that mixer in place of self-attention, over a
`StateSpec` KV group."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.kv_cache.interface import (CircularBufferSpec, FullAttentionSpec, KVCacheConfig, KVCacheSpec,
                                        SlidingWindowSpec, StateSpec)
from kvserve.native import cpu_kernels
from kvserve.model import native_decoder, quantized, stored_parts, workspace
from kvserve.model.stored_parts import StoredParts
from kvserve.model.attention import AttentionBackend, AttentionMetadata, AttentionParams, StateMetadata, is_windowed
from kvserve.model.config import ModelConfig
from kvserve.model.errors import ModelConfigError
from kvserve.model.state_layers import STATE_LAYER_KINDS
from kvserve.model import toy_recurrent  # noqa: F401 - registers the test-only "toy_recurrent" layer type
from kvserve.model.linear_attention import gated_deltanet  # noqa: F401 - registers "linear_attention" layers
from kvserve.sample.structured.grammar_mask import HeadMask
from kvserve.model.kernels import AttentionShape, ModelKernels
from kvserve.model.moe import SparseMoeBlock
from kvserve.model.linear_attention import mamba2_mixer  # noqa: F401 - registers the "mamba" layer type
from kvserve.model.state_layers import StateMixer
from kvserve.model.layers import RMSNorm, RotaryEmbedding, activation, apply_rotary
from kvserve.model.native_decoder import NativeDecoder
from kvserve.model.parallel import (ColumnParallelLinear, PackableLinearMixin, ParallelLMHead, RowParallelLinear,
                                    TPContext, VocabParallelEmbedding, cpu_weight_packing_supported,
                                    kv_heads_per_rank)


class SelfAttention(nn.Module):
    """Fused QKV projection, optional Q/K norms, RoPE, paged attention, output projection."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPContext) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_heads // tp.size
        # Fewer KV heads than ranks: each rank keeps a replica of the one its queries use.
        self.num_kv_heads, kv_replicas = kv_heads_per_rank(config.num_kv_heads, tp)
        q_size, kv_size = config.num_heads * self.head_dim, config.num_kv_heads * self.head_dim
        # Qwen3-Next: each head's query rows are followed by as many rows of its output gate.
        self.output_gate = config.attn_output_gate
        q_rows = 2 * q_size if self.output_gate else q_size
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q_rows, kv_size, kv_size], config.attention_bias,
                                             tp, shard_names=["q", "k", "v"], replicas=[1, kv_replicas, kv_replicas])
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, config.o_proj_bias, tp)
        self.q_norm = self.k_norm = None
        self.qk_norm_per_head = config.qk_norm_per_head
        if config.qk_norm:
            if not config.qk_norm_per_head and tp.size > 1:
                raise ValueError(f"{config.architecture}: its Q/K norm spans all heads, which tensor "
                                 "parallelism does not support yet")
            q_width, k_width = (self.head_dim, self.head_dim) if config.qk_norm_per_head else (q_size, kv_size)
            self.q_norm = RMSNorm(q_width, config.rms_norm_eps, config.norm_adds_one)
            self.k_norm = RMSNorm(k_width, config.rms_norm_eps, config.norm_adds_one)
        self.clip_qkv = config.clip_qkv
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding" else None
        self.sinks = None
        self.tp_rank, self.total_heads = tp.rank, config.num_heads
        if config.attention_sinks:
            # One logit per query head: a rank keeps those of its own heads.
            self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.use_rope = config.use_rope
        self.params = AttentionParams(scale=config.attention_scale, softcap=config.attn_logit_softcapping,
                                      sliding_window=self.sliding_window, sinks=self.sinks)
        # Set by `DecoderModel.use_kernels` (the runner's choice).
        self.backend: AttentionBackend = ModelKernels.torch_only().attention
        self.native_rotary = False

    def load_weight(self, param_kind: str, tensor: torch.Tensor, shard: str | None) -> None:
        """The checkpoint's `sinks` [all query heads]: this rank's heads' part."""
        if param_kind != "sinks" or self.sinks is None:
            raise ValueError(f"attention has no parameter {param_kind!r}")
        if tensor.shape != (self.total_heads,):
            raise ValueError(f"shape mismatch for sinks: model ({self.total_heads},), checkpoint {tuple(tensor.shape)}")
        first = self.tp_rank * self.num_heads
        self.sinks.data.copy_(tensor[first:first + self.num_heads])

    def forward(self, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                metadata: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        num_tokens, num_drafts = hidden.shape[0], metadata.num_draft_tokens
        q, k, v = self._qkv(hidden, num_drafts)
        gate = None
        if self.output_gate:
            q_and_gate = q.reshape(num_tokens, self.num_heads, 2 * self.head_dim)
            q, gate = q_and_gate[..., :self.head_dim].contiguous(), q_and_gate[..., self.head_dim:]
        if self.q_norm is not None and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q = apply_rotary(q, *cos_sin, native=self.native_rotary)
            k = apply_rotary(k, *cos_sin, native=self.native_rotary)
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.params)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(num_tokens, -1), num_drafts, role="o_proj")

    def _qkv(self, hidden: torch.Tensor, num_drafts: int) -> tuple[torch.Tensor, ...]:
        """The Q, K and V projections [T, size] each; a many-token step of float32 rows over parts
        held as stored gets each part apart, in reused buffers (model/workspace.py), not sliced
        from one concatenated copy."""
        weight = getattr(self.qkv_proj, "quant_weight", None)  # a wrapper module (tests) may hold none
        if (isinstance(weight, StoredParts) and [p.out_features for p in weight.parts] == self.qkv_proj.shard_sizes
                and workspace.reusable(hidden)):
            return tuple(stored_parts.part_outputs(hidden, weight, self.qkv_proj.bias, num_drafts, ("q", "k", "v")))
        return self.qkv_proj(hidden, num_drafts).split(self.qkv_proj.shard_sizes, dim=-1)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused in one projection."""

    def __init__(self, config: ModelConfig, tp: TPContext, intermediate_size: int | None = None,
                 expert: bool = False) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        bias = expert and config.expert_bias
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size], bias, tp,
                                                 shard_names=["gate", "up"])
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias, tp)
        self.act = activation(config.hidden_act)
        # gpt-oss's experts: (up + 1) * g * sigmoid(alpha g), g and up clamped at the limit.
        self.swiglu_limit = config.swiglu_limit if expert else None
        self.swiglu_alpha = config.swiglu_alpha
        self.is_silu = config.hidden_act in ("silu", "swish") and self.swiglu_limit is None
        self.native = False  # the fused SiLU-gated product kernel (`DecoderModel.use_kernels`)

    def forward(self, x: torch.Tensor, num_draft_rows: int = 0, role: str | None = None) -> torch.Tensor:
        """`num_draft_rows` of x's rows are speculative drafts (see `quantized.linear`); `role`:
        the down projection's reused output buffer of many-token steps (`RowParallelLinear.forward`)."""
        return self.down_proj(self._gated(x, num_draft_rows), num_draft_rows, role)

    def partial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the output, not all-reduced and without the down
        projection's bias (an expert of a `SparseMoeBlock`, which reduces once for all)."""
        bias = self.down_proj.bias if self.down_proj.tp.rank == 0 else None  # added once, on one rank
        return self.down_proj._matmul(self._gated(x, 0), bias)

    def _gated(self, x: torch.Tensor, num_draft_rows: int) -> torch.Tensor:
        """act(gate(x)) * up(x): the down projection's input."""
        weight = getattr(self.gate_up_proj, "quant_weight", None)
        if (self.native and self.is_silu and isinstance(weight, StoredParts)
                and [p.out_features for p in weight.parts] == self.gate_up_proj.shard_sizes
                and workspace.reusable(x)):
            # A many-token step: gate and up apart (no concatenated copy) in reused buffers, the
            # product written over gate (no third buffer of the step's widest size).
            gate, up = stored_parts.part_outputs(x, weight, self.gate_up_proj.bias, num_draft_rows, ("gate", "up"))
            return cpu_kernels.silu_mul_parts(gate, up, gate)
        gate_up = self.gate_up_proj(x, num_draft_rows)
        if self.native and gate_up.dim() == 2 and gate_up.is_contiguous() and cpu_kernels.takes(gate_up):
            if self.is_silu:
                return cpu_kernels.silu_mul(gate_up)
            if self.swiglu_limit is not None:
                return cpu_kernels.swiglu_clamped(gate_up, self.swiglu_limit, self.swiglu_alpha)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.swiglu_limit is not None:
            gate, up = gate.clamp(max=self.swiglu_limit), up.clamp(-self.swiglu_limit, self.swiglu_limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))
        return self.act(gate) * up


class DecoderLayer(nn.Module):
    """Pre-norm block; with sandwich norms (Gemma) the attention and MLP outputs are normalized too."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPContext) -> None:
        super().__init__()
        eps, plus_one = config.rms_norm_eps, config.norm_adds_one
        layer_type = config.layer_types[layer_idx]
        state_kind = STATE_LAYER_KINDS.get(layer_type)
        if state_kind is not None:
            self.mixer_name = state_kind.module_name
            setattr(self, self.mixer_name, state_kind.mixer_class(config, layer_idx, tp))
        elif layer_type in ("full", "sliding"):
            self.mixer_name = "self_attn"
            self.self_attn = SelfAttention(config, layer_idx, tp)
        else:
            raise ModelConfigError(f"unsupported layer type {layer_type!r}")
        self.is_state_layer = state_kind is not None
        self.sliding_window = None if self.is_state_layer else self.self_attn.sliding_window
        if config.sparse_layers[layer_idx]:
            shared = (GatedMLP(config, tp, config.shared_expert_intermediate_size)
                      if config.shared_expert_intermediate_size else None)
            self.mlp = SparseMoeBlock(config, tp, lambda width: GatedMLP(config, tp, width, expert=True), shared)
        else:
            self.mlp = GatedMLP(config, tp)
        # Granite: a shared expert beside the routed ones, and the residual branches scaled.
        self.shared_mlp = GatedMLP(config, tp, config.shared_expert_size) if config.shared_expert_size else None
        self.residual_multiplier = config.residual_multiplier
        self.input_layernorm = RMSNorm(config.hidden_size, eps, plus_one)
        # Llama family: the norm before the MLP. Gemma: the norm after attention.
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, plus_one)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, plus_one)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, plus_one)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin: tuple[torch.Tensor, torch.Tensor],
                metadata: AttentionMetadata, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output, residual): the layer's result is output + residual (residual None: output alone).

        Pre-norm layers hand the residual add on to the next norm, which fuses it
        (`RMSNorm.add_and_norm`); sandwich-norm layers return their sum whole."""
        if self.sandwich:
            if residual is not None:
                hidden = hidden + residual
            attn_out = self._mix(self.input_layernorm(hidden), cos_sin, metadata, kv_cache)
            hidden = hidden + self.post_attention_layernorm(attn_out)
            mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden), metadata.num_draft_tokens)
            return hidden + self.post_feedforward_layernorm(mlp_out), None
        # Many-token steps write the norms' outputs and the MLP's into reused buffers (roles of
        # model/workspace.py): each is consumed before the next request for its role (the mixer
        # reads x before the second norm overwrites it; the next layer's norm reads `out`).
        x, residual = self.input_layernorm.add_and_norm(hidden, residual, role="normed")
        mixed = self._mix(x, cos_sin, metadata, kv_cache)
        if self.residual_multiplier != 1.0:
            mixed = mixed * self.residual_multiplier
        x, residual = self.post_attention_layernorm.add_and_norm(mixed, residual, role="normed")
        out = (self.mlp(x, metadata.num_draft_tokens, role="mlp_out") if isinstance(self.mlp, GatedMLP)
               else self.mlp(x, metadata.num_draft_tokens))
        if self.shared_mlp is not None:
            out = out + self.shared_mlp(x, metadata.num_draft_tokens)
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        return out, residual

    @property
    def mixer(self) -> nn.Module:
        """The token mixer: `self_attn`, or the layer's state mixer."""
        return getattr(self, self.mixer_name)

    def _mix(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
             metadata: AttentionMetadata | StateMetadata, kv_cache) -> torch.Tensor:
        if self.is_state_layer:
            return self.mixer(x, metadata, kv_cache)
        return self.self_attn(x, cos_sin, metadata, kv_cache)


class DecoderModel(nn.Module):
    """The whole model: embeddings, decoder layers, final norm, LM head.

    KV-cache layer names are `model.layers.{i}.self_attn.attn`. Call
    `bind_kv_cache_config` once the KV-cache layout is known so each layer
    reads the metadata of its own group.
    """

    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1, tp_group=None) -> None:
        super().__init__()
        self.config = config
        tp = TPContext(tp_rank, tp_size, tp_group)
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_adds_one)
        tied = self.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, tied_to=tied)
        max_pos = config.max_position_embeddings
        self.rotary_global = RotaryEmbedding(config.head_dim, config.rope, max_pos)
        self.rotary_local = (RotaryEmbedding(config.head_dim, config.rope_local, max_pos)
                             if config.rope_local is not None else None)
        self.layer_names = [f"model.layers.{i}.{layer.mixer_name}." + ("state" if layer.is_state_layer else "attn")
                            for i, layer in enumerate(self.layers)]
        self.layer_group_ids: list[int] | None = None
        self.kernels = ModelKernels.torch_only()
        # The one-call path for small steps: False until the first forward builds it
        # (`kernels.native_decoder`), None where it is off or does not cover the model.
        self._native: NativeDecoder | None | bool = None
        self._native_paused = False

    # -- KV cache -------------------------------------------------------------------
    def kv_cache_specs(self, block_size: int, kv_dtype=None, sliding_window_kv: str = "sliding") -> dict[str, KVCacheSpec]:
        """Layer name -> KV spec (full, sliding window, or circular buffer for windowed layers;
        a `StateSpec` with the mixer's state shapes for recurrent layers)."""
        if sliding_window_kv not in ("sliding", "circular"):
            raise ValueError(f"sliding_window_kv must be 'sliding' or 'circular', got {sliding_window_kv!r}")
        dtype = kv_dtype if kv_dtype is not None else self.config.torch_dtype
        specs: dict[str, KVCacheSpec] = {}
        for name, layer in zip(self.layer_names, self.layers):
            if layer.is_state_layer:
                mixer = layer.mixer
                specs[name] = StateSpec(block_size=block_size, shapes=tuple(tuple(s) for s in mixer.state_shapes),
                                        dtype=mixer.state_dtype or self.config.torch_dtype)
                continue
            num_kv_heads = layer.self_attn.num_kv_heads
            window = layer.self_attn.sliding_window
            common = dict(block_size=block_size, num_kv_heads=num_kv_heads, head_size=self.config.head_dim,
                          dtype=dtype)
            if window is None:
                specs[name] = FullAttentionSpec(**common)
            elif sliding_window_kv == "circular":
                specs[name] = CircularBufferSpec(**common, sliding_window=window)
            else:
                specs[name] = SlidingWindowSpec(**common, sliding_window=window)
        return specs

    def prefix_kv_layer_names(self, prefix: str) -> None:
        """Rename the KV-cache layers `prefix + name` (a draft model next to its target)."""
        self.layer_names = [prefix + name for name in self.layer_names]

    def bind_kv_cache_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Record which KV-cache group each layer belongs to."""
        group_of = {name: g for g, group in enumerate(kv_cache_config.kv_cache_groups) for name in group.layer_names}
        missing = [name for name in self.layer_names if name not in group_of]
        if missing:
            raise ValueError(f"KV-cache config has no group for layers {missing[:3]}")
        self.layer_group_ids = [group_of[name] for name in self.layer_names]

    def _group_ids(self, metadata_by_group: list[AttentionMetadata]) -> list[int]:
        if self.layer_group_ids is not None:
            return self.layer_group_ids
        if len(metadata_by_group) == 1:
            return [0] * len(self.layers)
        # Unbound hybrid model: match each layer to the group whose spec has its kind.
        kinds = [_layer_kind(md.spec) for md in metadata_by_group]
        return [kinds.index("state" if layer.is_state_layer else "sliding" if layer.sliding_window is not None
                            else "full") for layer in self.layers]

    @property
    def attention_shape(self) -> AttentionShape:
        """This rank's attention heads and head size (of its first attention layer; a model of
        state layers only reports the configured shape)."""
        attn = next((layer.self_attn for layer in self.layers if not layer.is_state_layer), None)
        if attn is None:
            config = self.config
            return AttentionShape(config.num_heads // self.tp.size, max(config.num_kv_heads // self.tp.size, 1),
                                  config.head_dim)
        return AttentionShape(attn.num_heads, attn.num_kv_heads, attn.head_dim)

    def use_kernels(self, kernels: ModelKernels) -> None:
        """Run with `kernels` (chosen once per runner, `kvserve.model.kernels.choose_model_kernels`)."""
        self.kernels = kernels
        self._native = False if kernels.native_decoder else None
        for module in self.modules():
            if isinstance(module, SelfAttention):
                module.backend, module.native_rotary = kernels.attention, kernels.native_ops
            elif isinstance(module, (RMSNorm, GatedMLP, StateMixer)):
                module.native = kernels.native_ops
        for module in self.modules():  # after the experts' own choices above
            if isinstance(module, SparseMoeBlock):
                module.use_stored_experts(kernels.native_ops)

    def pack_linear_weights(self, keep_plain: bool | None = None, panels: bool | None = None) -> bool:
        """Hold every linear weight (and the LM head) pre-packed for the CPU matmul. Returns
        False, changing nothing, off CPU or for a dtype that cannot be packed here. Call after
        loading.

        With `panels` (default: where the model's kernels have the float32 panel matmul,
        `ModelKernels.f32_gemm_isa`) float32 weights are held only in its panel layout, which
        the per-op path and the native decoder both run from. Otherwise oneDNN packs them
        (see `PackableLinearMixin`) and the plain weights are dropped unless `keep_plain`
        (default: the model's kernel choice: kept for the small-batch kernel and for the
        native decoder, which read the plain layout)."""
        weight = self.norm.weight
        if panels is None:
            panels = self.kernels.f32_gemm_isa is not None
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            panels = False
        if not panels and (weight.device.type != "cpu" or not cpu_weight_packing_supported(weight.dtype)):
            return False
        if keep_plain is None:
            keep_plain = self.kernels.small_batch_matmul or self.kernels.native_decoder
        isa = quantized.ISA_CODES[self.kernels.f32_gemm_isa or native_decoder.f32_gemm_isa() or "portable"] if panels else -1
        for module in self.modules():
            if isinstance(module, PackableLinearMixin) and module.packed_weight is None \
                    and module.panel_weight is None and module.quant_weight is None:
                if panels:
                    module.pack_panels(isa)
                else:
                    module.pack_weight(keep_plain=keep_plain)
        return True

    # -- forward --------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata_by_group: list[AttentionMetadata], kv_caches: dict[str, torch.Tensor]) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for a flat batch of T tokens.

        Small steps on the CPU run every layer in one native call where the model and
        the step qualify (`NativeDecoder`); the others take the per-op path. Where the
        metadata's `num_draft_tokens` of the tokens are speculative drafts, every matmul
        takes the kernel of the step without them (see `quantized.linear`)."""
        return self._forward(input_ids, positions, attn_metadata_by_group, kv_caches, None)[0]

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       attn_metadata_by_group: list[AttentionMetadata], kv_caches: dict[str, torch.Tensor],
                       logits_rows: torch.Tensor, head_mask: HeadMask | None = None) -> torch.Tensor:
        """`compute_logits(forward(...)[logits_rows])`: float32 logits [len(logits_rows), vocab]
        of some of the step's tokens. Where the native call runs the step it runs the LM
        head too, for those rows only, inside its parallel region, and applies `head_mask`
        there when given (setting `head_mask.applied`; never under final soft-capping,
        which would turn its -inf into a finite value). Each of the metadata's
        `num_draft_tokens` drafts has a logits row (see `forward`)."""
        if self.config.final_logit_softcapping:
            head_mask = None
        hidden, logits = self._forward(input_ids, positions, attn_metadata_by_group, kv_caches, logits_rows, head_mask)
        if logits is None:
            logits = self.lm_head.logits(hidden[logits_rows], attn_metadata_by_group[0].num_draft_tokens)
        return self._finish_logits(logits)

    def pause_native_decoder(self, paused: bool) -> None:
        """While `paused`, every step takes the per-op path; the native decoder is kept (A/B
        measurements of one against the other in one process, `kvserve bench host`)."""
        self._native_paused = paused

    @property
    def native_decoder(self) -> NativeDecoder | None:
        """The native decoder small steps run through, once a step has built it; else None."""
        return self._native if isinstance(self._native, NativeDecoder) else None

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn_metadata_by_group: list[AttentionMetadata], kv_caches: dict[str, torch.Tensor],
                 logits_rows: torch.Tensor | None, head_mask: HeadMask | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states after the final norm, the LM head's raw logits of `logits_rows` where
        the native call computed them, else None)."""
        group_ids = self._group_ids(attn_metadata_by_group)
        if self._native is False:
            self._native = NativeDecoder.for_model(self)
        if self._native is not None and not self._native_paused:
            out = self._native.forward(input_ids, positions, attn_metadata_by_group, kv_caches, group_ids,
                                       logits_rows, attn_metadata_by_group[0].num_draft_tokens, head_mask)
            if out is not None:
                return out
        hidden = self.embed(input_ids)
        num_positions = max((md.max_seq_len for md in attn_metadata_by_group if isinstance(md, AttentionMetadata)),
                            default=1)
        global_cos_sin = self.rotary_global.cos_sin(positions, hidden.dtype, num_positions)
        local_cos_sin = (self.rotary_local.cos_sin(positions, hidden.dtype, num_positions)
                         if self.rotary_local is not None else global_cos_sin)
        residual = None
        for layer, name, group_id in zip(self.layers, self.layer_names, group_ids):
            cos_sin = local_cos_sin if layer.sliding_window is not None else global_cos_sin
            hidden, residual = layer(hidden, residual, cos_sin, attn_metadata_by_group[group_id], kv_caches[name])
        return self.norm.add_and_norm(hidden, residual)[0], None

    @property
    def has_state_layers(self) -> bool:
        return any(layer.is_state_layer for layer in self.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings [T, hidden] in the model's dtype, scaled where the family
        scales them (Gemma)."""
        hidden = self.embed_tokens(input_ids).to(self.norm.weight.dtype)
        if self.config.scales_embeddings:
            hidden = hidden * torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden.dtype)
        if self.config.embedding_multiplier != 1.0:
            hidden = hidden * self.config.embedding_multiplier
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] (final soft-capping applied)."""
        return self._finish_logits(self.lm_head.logits(hidden))

    def compute_logits_on_driver(self, hidden: torch.Tensor, num_draft_tokens: int = 0) -> torch.Tensor | None:
        """Like `compute_logits`, but the logits are gathered on tensor-parallel rank 0
        only (every rank must call it); None on the other ranks. `num_draft_tokens` of the
        rows are speculative drafts' (see `forward`)."""
        logits = self.lm_head.logits_on_driver(hidden, num_draft_tokens)
        return None if logits is None else self._finish_logits(logits)

    def _finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _layer_kind(spec: KVCacheSpec | None) -> str:
    if isinstance(spec, StateSpec):
        return "state"
    return "sliding" if spec is not None and is_windowed(spec) else "full"
