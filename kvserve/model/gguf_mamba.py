"""Granite 4 hybrids (llama.cpp's `granitehybrid`, GraniteMoeHybridForCausalLM) from GGUF: their
metadata as config.json fields, and their Mamba-2 and shared-expert tensors under the Hugging
Face names the loader knows, undoing what llama.cpp's convert_hf_to_gguf.py does to them:

- A_log is stored as A = -exp(A_log) (`ssm_a`) and D (`ssm_d`), both as [heads, 1]; dt_bias as
  `ssm_dt.bias`; the convolution weight squeezed to [channels, width]; the gated norm's weight
  as [groups, inner / groups];
- the shared expert's fused `input_linear` is cut into `ffn_gate_shexp` / `ffn_up_shexp` (with
  routed experts; without them it is the layer's `ffn_gate` / `ffn_up`);
- Granite's multipliers become `attention.scale`, `embedding_scale`, `residual_scale`,
  `logit_scale`; the attention layers are those with KV heads (`attention.head_count_kv`, one
  count per layer) or, where every count is 0 (the converter reads transformers 5's layer
  names as all Mamba), those whose `attn_q` the file holds.

The converter writes no RoPE for hybrids (`rope.scaling.finetuned` false): their attention is
NoPE, where llama.cpp's per-head interleave of Q and K rows (applied to both alike) leaves every
q.k unchanged, so it is not undone.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection
from typing import Any

import numpy as np

from kvserve.model.errors import ModelConfigError
from kvserve.model.gguf_linear_attention import ssm_metadata

MAMBA_ARCHS = ("granitehybrid",)
# Granite's config.json multipliers and their GGUF keys.
_MULTIPLIERS = {"attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
                "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}
_SHARED_EXPERT = {"ffn_gate_shexp": "gate_proj", "ffn_up_shexp": "up_proj", "ffn_down_shexp": "down_proj"}


def _attention_layers(reader: Any, arch: str, layers: int, names: Collection[str]) -> list[bool]:
    counts = reader.get(f"{arch}.attention.head_count_kv")
    counts = counts if isinstance(counts, list) else [counts or 0] * layers
    if len(counts) != layers:
        raise ModelConfigError(f"GGUF {arch}: attention.head_count_kv has {len(counts)} counts for {layers} layers")
    if any(counts):
        return [int(count) > 0 for count in counts]
    return [f"blk.{i}.attn_q.weight" in names for i in range(layers)]


def _kv_heads(reader: Any, arch: str, hf: dict[str, Any], attention: list[bool]) -> int:
    """The attention layers' KV heads: the file's count, else the rows of the first `attn_k` per head."""
    counts = reader.get(f"{arch}.attention.head_count_kv")
    counts = counts if isinstance(counts, list) else [counts or 0]
    if any(counts):
        return max(int(count) for count in counts)
    head_dim = int(hf["hidden_size"]) // int(hf["num_attention_heads"])
    first = attention.index(True)
    keys = next(t for t in reader.tensors if t.name == f"blk.{first}.attn_k.weight")
    return int(keys.shape[-1]) // head_dim


def add_mamba_hybrid_config(reader: Any, arch: str, hf: dict[str, Any], names: Collection[str]) -> None:
    """The config.json fields of a Granite 4 hybrid that its GGUF keys hold (see the module's
    docstring), in the names `config._parse_granite_hybrid` reads; `names`: the file's tensors."""
    ssm = ssm_metadata(reader, arch)
    hidden, layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
    if ssm["inner_size"] % hidden or ssm["inner_size"] % ssm["time_step_rank"]:
        raise ModelConfigError(f"GGUF {arch}: ssm.inner_size {ssm['inner_size']} is not a multiple of the hidden "
                               f"size {hidden} and of ssm.time_step_rank {ssm['time_step_rank']}")
    if reader.get(f"{arch}.rope.scaling.finetuned"):
        raise ModelConfigError(f"GGUF {arch} with RoPE attention (rope.scaling.finetuned) is not supported")
    attention = _attention_layers(reader, arch, layers, names)
    hf["layer_types"] = ["attention" if flag else "mamba" for flag in attention]
    if any(attention):
        hf["num_key_value_heads"] = _kv_heads(reader, arch, hf, attention)
    else:
        hf.pop("num_key_value_heads", None)
    first_mamba = attention.index(False) if not all(attention) else 0
    hf.update(mamba_n_heads=ssm["time_step_rank"], mamba_d_head=ssm["inner_size"] // ssm["time_step_rank"],
              mamba_expand=ssm["inner_size"] // hidden, mamba_d_state=ssm["state_size"],
              mamba_n_groups=ssm["group_count"], mamba_d_conv=ssm["conv_kernel"],
              mamba_conv_bias=f"blk.{first_mamba}.ssm_conv1d.bias" in names,
              mamba_proj_bias=f"blk.{first_mamba}.ssm_in.bias" in names,
              position_embedding_type="nope", num_local_experts=int(hf.get("num_experts") or 0),
              # Without routed experts the shared MLP is the layer's (`ffn_gate` / `ffn_up` / `ffn_down`).
              shared_intermediate_size=int(hf.pop("shared_expert_intermediate_size", 0) or hf.get("intermediate_size") or 0))
    for key, hf_key in _MULTIPLIERS.items():
        value = reader.get(f"{arch}.{key}")
        if value is not None:
            hf[hf_key] = float(value)


def _renamed(tensor: Any, name: str, shape: tuple[int, ...], data: Any) -> tuple[Any, str]:
    return dataclasses.replace(tensor, name=name, shape=shape, data=data), name


def mamba_hybrid_parts(tensor: Any) -> list[tuple[Any, str]] | None:
    """(tensor, HF name) of a Mamba-2 or shared-expert tensor in HF's layout (see the module's
    docstring), or None where the tensor is neither."""
    match = re.fullmatch(r"blk\.(\d+)\.(ssm_\w+?|ffn_\w+_shexp)(?:\.(weight|bias))?", tensor.name)
    if match is None:
        return None
    layer, kind, suffix = match.group(1), match.group(2), match.group(3) or "weight"
    prefix = f"model.layers.{layer}.mamba"
    data = np.asarray(tensor.data)
    if kind in _SHARED_EXPERT:
        return [(tensor, f"model.layers.{layer}.shared_mlp.{_SHARED_EXPERT[kind]}.{suffix}")]
    if kind == "ssm_in":
        return [(tensor, f"{prefix}.in_proj.{suffix}")]
    if kind == "ssm_out":
        return [(tensor, f"{prefix}.out_proj.{suffix}")]
    if kind == "ssm_dt":
        return [(tensor, f"{prefix}.dt_bias")]
    if kind == "ssm_d":
        return [_renamed(tensor, f"{prefix}.D", (data.size,), data.reshape(-1))]
    if kind == "ssm_a":
        # A = -exp(A_log): its log taken in float64, so that exp of the float32 A_log is A within an ulp or two.
        a_log = np.log(-np.asarray(data, dtype=np.float64)).astype(np.float32).reshape(-1)
        return [_renamed(tensor, f"{prefix}.A_log", (a_log.size,), a_log)]
    if kind == "ssm_norm":
        return [_renamed(tensor, f"{prefix}.norm.weight", (data.size,), data.reshape(-1))]
    if kind == "ssm_conv1d" and suffix == "weight":
        width, channels = tensor.shape  # squeezed: the module's weight is [channels, 1, width]
        return [_renamed(tensor, f"{prefix}.conv1d.weight", (width, 1, channels), data)]
    if kind == "ssm_conv1d":
        return [(tensor, f"{prefix}.conv1d.bias")]
    return None
