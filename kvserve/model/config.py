"""ModelConfig: the architecture of a decoder model, read from a Hugging Face
directory (config.json) or a GGUF file's metadata.

Reading a config needs no torch: `dtype` is kept as a name ("float32").
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from kvserve.model.errors import ModelConfigError, ModelFilesNotFoundError, UnsupportedArchitectureError

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# "auto": GGUF weights of a type the native kernels take stay quantized (CPU); "none": dequantized.
QUANTIZATION_MODES = ("auto", "none")

# HF architecture name -> family switch set ("llama" covers Llama 2/3, SmolLM2).
ARCHITECTURE_FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
}

# config.json files without "architectures" (e.g. a bare config) still name a model_type.
_ARCHITECTURE_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                               "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                               "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                               "olmoe": "OlmoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
                               "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                               "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                               "granitemoehybrid": "GraniteMoeHybridForCausalLM"}

_MULTIMODAL_TEXT_ARCHITECTURES = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
                                  "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
                                  "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}

# Hybrids of Gated DeltaNet layers and gated full-attention layers (Qwen3-Next, Qwen3.5): (1 + w)
# RMSNorms, per-head Q/K norms, a sigmoid gate on the attention output, partial RoPE.
GATED_DELTANET_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


# Families whose Q/K norm spans the whole projection (all heads) instead of each head.
_PROJECTION_QK_NORM_FAMILIES = ("olmoe",)

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one kind of layer: base, scaling type and its parameters."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    partial_rotary_factor: float = 1.0
    truncate: bool = True  # YaRN: round the correction range to whole dimensions (gpt-oss: not)

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None, default_theta: float) -> "RopeConfig":
        params = dict(params or {})
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in ROPE_TYPES:
            raise ModelConfigError(f"unsupported RoPE scaling type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        known = {k: params[k] for k in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
            "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
            "partial_rotary_factor", "truncate") if params.get(k) is not None}
        return cls(theta=float(params.get("rope_theta", default_theta)), rope_type=rope_type, **known)


@dataclass(frozen=True)
class MambaConfig:
    """The Mamba-2 layers of a hybrid model: `num_heads` heads of `head_dim` channels, a state
    of `state_size` per channel, B/C shared by `n_groups` groups of heads, a depthwise causal
    conv of `conv_kernel` taps, and the clamp of the softplus time step."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False
    dt_min: float = 0.0
    dt_max: float = float("inf")


@dataclass
class ModelConfig:
    """Everything the decoder, the loaders and the runner need to know about a model."""

    path: str
    is_gguf: bool
    architecture: str
    model_type: str
    family: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    max_model_len: int
    dtype: str = "float32"
    quantization: str = "auto"
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    rope: RopeConfig = field(default_factory=RopeConfig)
    # Gemma-3 rotates sliding layers with their own (local) base.
    rope_local: RopeConfig | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    qk_norm: bool = False
    # OLMoE normalizes Q and K over the whole projection, the others per head.
    qk_norm_per_head: bool = True
    clip_qkv: float | None = None
    # Mixture of experts (all 0 for dense models): the router picks `num_experts_per_tok` of
    # `num_experts` experts of width `moe_intermediate_size` per token, on the layers flagged
    # in `sparse_layers` (the others run a dense MLP of `intermediate_size`).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # Renormalize the top-k softmax probabilities to sum to 1 (Mixtral always does).
    norm_topk_prob: bool = False
    sparse_layers: list[bool] = field(default_factory=list)
    # gpt-oss: a softmax over the top-k router logits (not over all experts), a router bias,
    # biased experts with a clamped SwiGLU ((up + 1) * g * sigmoid(alpha g), g and up
    # clamped at `swiglu_limit`), attention sinks and an output-projection bias.
    softmax_after_topk: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    attention_sinks: bool = False
    o_proj_bias: bool = False
    # Qwen3-Next / Qwen3.5: an always-on shared expert of this width beside the routed ones,
    # scaled by sigmoid(a one-row gate); 0: none.
    shared_expert_intermediate_size: int = 0
    # A sigmoid gate on the attention output (its rows interleaved with Q's, per head).
    attn_output_gate: bool = False
    # Gated DeltaNet layers: key/value heads and sizes, and the causal convolution's width.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    # Hybrid state-space models: the Mamba-2 layers' shape ("mamba" layer types).
    mamba: MambaConfig | None = None
    # Granite: attention layers without RoPE, a shared expert next to (or instead of) the routed
    # ones, and scalings: embeddings times `embedding_multiplier`, each layer's mixer and MLP
    # outputs times `residual_multiplier`, logits divided by `logits_scaling`, and attention
    # scores scaled by `attention_multiplier` (None: head_dim ** -0.5).
    use_rope: bool = True
    shared_expert_size: int = 0
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_multiplier: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ModelConfigError(f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ModelConfigError(
                f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {self.quantization!r}")
        if not self.layer_types:
            self.layer_types = ["full"] * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise ModelConfigError(f"{len(self.layer_types)} layer types for {self.num_layers} layers")
        if "linear_attention" in self.layer_types and not (
                self.linear_num_key_heads and self.linear_num_value_heads % self.linear_num_key_heads == 0
                and self.linear_key_head_dim and self.linear_value_head_dim and self.linear_conv_kernel_dim > 1):
            raise ModelConfigError("linear-attention layers need key/value heads (value heads a multiple of key "
                                   "heads), head sizes and a convolution width > 1")
        if "mamba" in self.layer_types and self.mamba is None:
            raise ModelConfigError("mamba layers need the Mamba-2 shape (ModelConfig.mamba)")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ModelConfigError("sliding layers need a sliding_window")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.max_model_len < 1:
            raise ModelConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not self.sparse_layers:
            self.sparse_layers = [self.num_experts > 0] * self.num_layers
        if len(self.sparse_layers) != self.num_layers:
            raise ModelConfigError(f"{len(self.sparse_layers)} sparse-layer flags for {self.num_layers} layers")
        if any(self.sparse_layers) and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError(f"num_experts_per_tok must be in 1..{self.num_experts}, "
                                   f"got {self.num_experts_per_tok}")

    # -- family switches -------------------------------------------------------------
    @property
    def is_gemma(self) -> bool:
        return self.family in ("gemma2", "gemma3")

    @property
    def norm_adds_one(self) -> bool:
        """Gemma's, Qwen3-Next's and Qwen3.5's RMSNorms scale by (1 + w)."""
        return self.is_gemma or self.family in GATED_DELTANET_FAMILIES

    @property
    def sandwich_norms(self) -> bool:
        """Gemma normalizes attention and MLP outputs too (pre and post norms)."""
        return self.is_gemma

    @property
    def scales_embeddings(self) -> bool:
        return self.is_gemma

    @property
    def is_moe(self) -> bool:
        """Whether some layer runs a mixture of experts instead of one MLP."""
        return any(self.sparse_layers)

    @property
    def attention_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def rope_for_layer(self, layer_idx: int) -> RopeConfig:
        if self.rope_local is not None and self.layer_types[layer_idx] == "sliding":
            return self.rope_local
        return self.rope

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)

    # -- construction ----------------------------------------------------------------
    @classmethod
    def from_path(cls, path: str, dtype: str = "float32", max_model_len: int | None = None,
                  quantization: str = "auto") -> "ModelConfig":
        """Read a HF model directory (config.json) or a `.gguf` file."""
        path = os.fspath(path)
        if not os.path.exists(path):
            raise ModelFilesNotFoundError(f"model path {path!r} does not exist")
        if os.path.isfile(path):
            if not path.endswith(".gguf"):
                raise ModelFilesNotFoundError(f"{path!r} is a file but not a .gguf file; pass a model directory or a GGUF file")
            from kvserve.model.gguf_loader import read_gguf_hf_config
            hf, extra = read_gguf_hf_config(path)
            return cls.from_hf_dict(hf, path=path, is_gguf=True, dtype=dtype,
                                    max_model_len=max_model_len, quantization=quantization, **extra)
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise ModelFilesNotFoundError(f"{path!r} has no config.json (is it a Hugging Face model directory?)")
        with open(config_file) as f:
            hf = json.load(f)
        gen_eos = _read_generation_eos(path)
        cfg = cls.from_hf_dict(hf, path=path, is_gguf=False, dtype=dtype, max_model_len=max_model_len)
        if gen_eos:
            cfg.eos_token_ids = list(dict.fromkeys(cfg.eos_token_ids + gen_eos))
        return cfg

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], *, path: str = "", is_gguf: bool = False, dtype: str = "float32",
                     max_model_len: int | None = None, **overrides: Any) -> "ModelConfig":
        """Build from a config.json dictionary (transformers 4.x or 5.x layout)."""
        architecture = (hf.get("architectures") or [_ARCHITECTURE_BY_MODEL_TYPE.get(hf.get("model_type"), "")])[0]
        if architecture in _MULTIMODAL_TEXT_ARCHITECTURES and "text_config" in hf:
            # Serve the language model of a multimodal checkpoint; the loader skips the vision tower.
            text = {**hf["text_config"], "architectures": [_MULTIMODAL_TEXT_ARCHITECTURES[architecture]]}
            for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
                text.setdefault(key, hf.get(key))
            hf, architecture = text, text["architectures"][0]
        family = ARCHITECTURE_FAMILIES.get(architecture)
        if family is None:
            supported = ", ".join(sorted(ARCHITECTURE_FAMILIES))
            raise UnsupportedArchitectureError(
                f"architecture {architecture or hf.get('model_type')!r} is not supported (supported: {supported})")
        num_layers = int(hf["num_hidden_layers"])
        num_heads = int(hf["num_attention_heads"])
        hidden_size = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or hidden_size // num_heads)
        max_pos = int(hf.get("max_position_embeddings") or 2048)
        if max_model_len is not None and max_model_len > max_pos:
            logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d", max_model_len, max_pos)
        rope, rope_local = _parse_rope(hf, family)
        sliding_window, layer_types = _parse_layer_types(hf, family, num_layers)
        eos = hf.get("eos_token_id")
        eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        is_gemma = family in ("gemma2", "gemma3")
        kwargs: dict[str, Any] = dict(
            path=path, is_gguf=is_gguf, architecture=architecture, model_type=hf.get("model_type", ""),
            family=family, num_layers=num_layers, hidden_size=hidden_size,
            intermediate_size=int(hf.get("intermediate_size") or 0), num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads), head_dim=head_dim,
            vocab_size=int(hf["vocab_size"]), max_position_embeddings=max_pos,
            max_model_len=int(max_model_len or max_pos), dtype=dtype, layer_types=layer_types,
            sliding_window=sliding_window, rope=rope, rope_local=rope_local,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", is_gemma)),
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or (
                "gelu_pytorch_tanh" if is_gemma else "silu"),
            attention_bias=bool(hf.get("attention_bias", family == "qwen2")),
            qk_norm=family in ("qwen3", "gemma3", "qwen3_moe", "olmoe", *GATED_DELTANET_FAMILIES),
            qk_norm_per_head=family not in _PROJECTION_QK_NORM_FAMILIES,
            clip_qkv=hf.get("clip_qkv") if family == "olmoe" else None,
            attn_logit_softcapping=hf.get("attn_logit_softcapping") if family == "gemma2" else None,
            final_logit_softcapping=hf.get("final_logit_softcapping") if is_gemma else None,
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if is_gemma else None,
            bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids, pad_token_id=hf.get("pad_token_id"),
        )
        if family == "gemma3" and hf.get("attn_logit_softcapping"):
            kwargs["attn_logit_softcapping"] = hf["attn_logit_softcapping"]
        kwargs.update(_parse_experts(hf, family, num_layers))
        if family in GATED_DELTANET_FAMILIES:
            kwargs.update(_parse_gated_deltanet(hf))
        if family == "granitemoehybrid":
            kwargs.update(_parse_granite_hybrid(hf, num_layers))
        kwargs.update(overrides)
        return cls(**kwargs)


def _parse_rope(hf: dict[str, Any], family: str) -> tuple[RopeConfig, RopeConfig | None]:
    """transformers 5 keeps RoPE in `rope_parameters` (per layer type for Gemma-3);
    4.x used `rope_theta` + `rope_scaling` (+ `rope_local_base_freq`, and Qwen3-Next's
    top-level `partial_rotary_factor`, a quarter where absent, as transformers defaults it)."""
    theta = float(hf.get("rope_theta", 10000.0))
    params = hf.get("rope_parameters")
    if params is None:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", theta)
        if hf.get("partial_rotary_factor") is not None:
            params.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    if family in GATED_DELTANET_FAMILIES and isinstance(params, dict):
        params = {"partial_rotary_factor": 0.25, **params}
    if isinstance(params, dict) and "full_attention" in params:
        rope = RopeConfig.from_hf(params["full_attention"], theta)
        local = params.get("sliding_attention")
        return rope, RopeConfig.from_hf(local, 10000.0) if local else None
    rope = RopeConfig.from_hf(params, theta)
    if family == "gemma3":
        local_theta = float(hf.get("rope_local_base_freq", 10000.0))
        return rope, RopeConfig(theta=local_theta)
    return rope, None


def _parse_experts(hf: dict[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a config.json (none for dense families)."""
    if family == "gpt_oss":
        return dict(num_experts=int(hf["num_local_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=int(hf["intermediate_size"]), sparse_layers=[True] * num_layers,
                    softmax_after_topk=True, router_bias=True, expert_bias=True,
                    swiglu_limit=float(hf.get("swiglu_limit", 7.0)), swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                    attention_sinks=True, o_proj_bias=True)
    if family == "qwen3_5_moe":  # every layer sparse, with a shared expert, renormalized top-k
        return dict(num_experts=int(hf["num_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=int(hf["moe_intermediate_size"]), sparse_layers=[True] * num_layers,
                    norm_topk_prob=True,
                    shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0))
    if family not in ("qwen3_moe", "mixtral", "olmoe", "qwen3_next"):
        return {}
    num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    shared = {}
    if family == "qwen3_next" and num_experts:
        shared = dict(shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0))
    if family in ("qwen3_moe", "qwen3_next"):
        step = int(hf.get("decoder_sparse_step") or 1)
        dense = set(hf.get("mlp_only_layers") or [])
        sparse = [i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)]
        width = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
    else:
        sparse, width = [num_experts > 0] * num_layers, int(hf["intermediate_size"])
    return dict(num_experts=num_experts, num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
                moe_intermediate_size=width, sparse_layers=sparse,
                norm_topk_prob=family == "mixtral" or bool(hf.get("norm_topk_prob", False)), **shared)


def _parse_gated_deltanet(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's / Qwen3.5's Gated DeltaNet sizes, and their gated attention."""
    return dict(attn_output_gate=True, linear_num_key_heads=int(hf["linear_num_key_heads"]),
                linear_num_value_heads=int(hf["linear_num_value_heads"]),
                linear_key_head_dim=int(hf["linear_key_head_dim"]),
                linear_value_head_dim=int(hf["linear_value_head_dim"]),
                linear_conv_kernel_dim=int(hf["linear_conv_kernel_dim"]))


def _json_float(value: Any) -> float:
    """A float of config.json, where transformers 5 writes infinities as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def _parse_granite_hybrid(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Granite 4 hybrids (GraniteMoeHybridForCausalLM): Mamba-2 and attention layers (named
    "mamba" / "attention" in IBM's checkpoints, "linear_attention" / "full_attention" as
    transformers 5 saves them), routed experts with a shared one, and Granite's scalings."""
    names = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * num_layers
    kinds = {"mamba": "mamba", "linear_attention": "mamba", "attention": "full", "full_attention": "full"}
    if len(names) != num_layers or any(name not in kinds for name in names):
        raise ModelConfigError(f"unsupported Granite hybrid layer types {sorted(set(names))}")
    hidden = int(hf["hidden_size"])
    heads = int(hf.get("mamba_n_heads") or 128)
    inner = int(hf.get("mamba_expand") or 2) * hidden
    head_dim = hf.get("mamba_d_head") or "auto"
    head_dim = inner // heads if head_dim == "auto" else int(head_dim)
    if head_dim * heads != inner:
        raise ModelConfigError(f"mamba heads {heads} x {head_dim} do not make mamba_expand * hidden_size = {inner}")
    dt_min, dt_max = hf.get("time_step_limit") or (0.0, float("inf"))
    mamba = MambaConfig(num_heads=heads, head_dim=head_dim, state_size=int(hf.get("mamba_d_state") or 256),
                        n_groups=int(hf.get("mamba_n_groups") or 1), conv_kernel=int(hf.get("mamba_d_conv") or 4),
                        conv_bias=bool(hf.get("mamba_conv_bias", True)), proj_bias=bool(hf.get("mamba_proj_bias", False)),
                        dt_min=_json_float(dt_min), dt_max=_json_float(dt_max))
    num_experts = int(hf.get("num_local_experts") or 0)
    shared = int(hf.get("shared_intermediate_size") or 0)
    return dict(
        layer_types=[kinds[name] for name in names], mamba=mamba, use_rope=hf.get("position_embedding_type") == "rope",
        num_experts=num_experts, num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0) if num_experts else 0,
        moe_intermediate_size=int(hf["intermediate_size"]), sparse_layers=[num_experts > 0] * num_layers,
        softmax_after_topk=True,
        # With no routed experts the shared MLP is the layer's MLP.
        shared_expert_size=shared if num_experts else 0, intermediate_size=int(hf["intermediate_size"]) if num_experts
        else shared, embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
        logits_scaling=float(hf.get("logits_scaling", 1.0)),
        attention_multiplier=float(hf.get("attention_multiplier", 1.0)))


def _parse_layer_types(hf: dict[str, Any], family: str, num_layers: int) -> tuple[int | None, list[str]]:
    if family == "granitemoehybrid":
        return None, ["full"] * num_layers  # `_parse_granite_hybrid` reads them
    window = hf.get("sliding_window")
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        if not hf.get("use_sliding_window", False):
            window = None
    layer_types = hf.get("layer_types")
    if layer_types:
        names = {"sliding_attention": "sliding", "full_attention": "full", "linear_attention": "linear_attention"}
        if any(t not in names for t in layer_types):
            raise ModelConfigError(f"unsupported layer types {sorted(set(layer_types) - set(names))}")
        kinds = [names[t] for t in layer_types]
    elif family in GATED_DELTANET_FAMILIES:
        interval = int(hf.get("full_attention_interval") or 4)
        kinds = ["full" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    elif window and family == "gemma2":
        kinds = ["sliding" if i % 2 == 0 else "full" for i in range(num_layers)]
    elif window and family == "gemma3":
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        kinds = ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers)]
    elif window and family in ("qwen2", "qwen3", "qwen3_moe"):
        first_full = int(hf.get("max_window_layers", num_layers))
        kinds = ["sliding" if i >= first_full else "full" for i in range(num_layers)]
    elif window:
        kinds = ["sliding"] * num_layers
    else:
        kinds = ["full"] * num_layers
    if "sliding" not in kinds:
        window = None
    return (int(window) if window else None), kinds


def _read_generation_eos(path: str) -> list[int]:
    gen_file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen_file):
        return []
    with open(gen_file) as f:
        eos = json.load(f).get("eos_token_id")
    return [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
