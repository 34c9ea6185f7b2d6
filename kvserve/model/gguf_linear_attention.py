"""Qwen3-Next / Qwen3.5 (Gated DeltaNet hybrids) from GGUF: their metadata as config.json
fields, and their linear-attention tensors as the Hugging Face parts `GatedDeltaNet` loads,
undoing what llama.cpp's convert_hf_to_gguf.py does to them:

- Qwen3-Next's `in_proj_qkvz` (rows grouped by key head) is written as `attn_qkv` ([q | k | v],
  value heads in HF order) and `attn_gate` (z); `in_proj_ba` as `ssm_ba`, unchanged;
- Qwen3.5 keeps `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a` apart (`attn_qkv`,
  `attn_gate`, `ssm_beta`, `ssm_alpha`) but, with fewer key than value heads, reorders the value
  heads from grouped by key head (k0v0, k0v1, k1v0, ...) to tiled (k0v0, k1v0, k0v1, ...): in
  those rows, in A_log / dt_bias, in the convolution's value channels and in `out_proj`'s columns;
- A_log is stored as A = -exp(A_log) (`ssm_a`), dt_bias as `ssm_dt.bias`, the convolution weight
  squeezed to [channels, width]; the (1 + w) norms as 1 + w (undone in `gguf_loader`).
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from kvserve.model.errors import ModelConfigError

GATED_DELTANET_ARCHS = ("qwen3next", "qwen35", "qwen35moe")
# Archs whose converter tiles the value heads (Qwen3-Next's keeps them grouped).
_TILED_VALUE_HEADS = ("qwen35", "qwen35moe")
_SSM_KEYS = ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")


@dataclasses.dataclass(frozen=True)
class _Sizes:
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    tiled: bool

    def value_order(self, width: int) -> np.ndarray:
        """For each value-head row of HF's grouped order (`width` rows per head), its row in the file."""
        per_key = self.value_heads // self.key_heads
        rows = np.arange(self.value_heads * width)
        if not self.tiled:
            return rows
        return rows.reshape(per_key, self.key_heads, width).transpose(1, 0, 2).reshape(-1)


def ssm_metadata(reader: Any, arch: str) -> dict[str, int]:
    """The file's `{arch}.ssm.*` sizes (shared by the Gated DeltaNet and Mamba-2 hybrids), or a
    one-line error naming the missing keys."""
    values = {key: reader.get(f"{arch}.ssm.{key}") for key in _SSM_KEYS}
    missing = [f"{arch}.ssm.{key}" for key, value in values.items() if value is None]
    if missing:
        raise ModelConfigError(f"GGUF {arch} file lacks the state-layer metadata {', '.join(missing)}")
    return {key: int(value) for key, value in values.items()}


def add_gated_deltanet_config(reader: Any, arch: str, hf: dict[str, Any]) -> None:
    """The config.json fields of Qwen3-Next / Qwen3.5 that their GGUF keys hold: the linear
    attention's sizes (ssm.*), which layers are linear (`attention.recurrent_layers`, else every
    `full_attention_interval`th full), and the rotated share of each head (rope.dimension_count)."""
    ssm = ssm_metadata(reader, arch)
    if ssm["inner_size"] % ssm["time_step_rank"]:
        raise ModelConfigError(f"GGUF {arch}: ssm.inner_size {ssm['inner_size']} is not a multiple of "
                               f"ssm.time_step_rank {ssm['time_step_rank']}")
    hf.update(linear_conv_kernel_dim=ssm["conv_kernel"], linear_key_head_dim=ssm["state_size"],
              linear_num_key_heads=ssm["group_count"], linear_num_value_heads=ssm["time_step_rank"],
              linear_value_head_dim=ssm["inner_size"] // ssm["time_step_rank"])
    # block_count counts the multi-token prediction layers (`nextn`) after the model's own; not loaded.
    layers = int(hf["num_hidden_layers"]) - int(reader.get(f"{arch}.nextn_predict_layers") or 0)
    hf["num_hidden_layers"] = layers
    recurrent = reader.get(f"{arch}.attention.recurrent_layers")
    interval = reader.get(f"{arch}.full_attention_interval")
    if recurrent is not None:
        if len(recurrent) < layers:
            raise ModelConfigError(f"GGUF {arch}: attention.recurrent_layers has {len(recurrent)} flags for {layers} layers")
        linear = [bool(flag) for flag in recurrent[:layers]]
    elif interval is not None:
        linear = [(i + 1) % int(interval) != 0 for i in range(layers)]
    else:
        raise ModelConfigError(f"GGUF {arch} file lacks {arch}.attention.recurrent_layers and "
                               f"{arch}.full_attention_interval: which layers are linear is unknown")
    hf["layer_types"] = ["linear_attention" if flag else "full_attention" for flag in linear]
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    rotated = reader.get(f"{arch}.rope.dimension_count")
    hf["partial_rotary_factor"] = int(rotated) / head_dim if rotated else 0.25
    if math.isclose(hf["partial_rotary_factor"], 0.0):
        raise ModelConfigError(f"GGUF {arch}: rope.dimension_count is 0")


def _sizes(reader: Any, arch: str) -> _Sizes:
    ssm = ssm_metadata(reader, arch)
    return _Sizes(key_heads=ssm["group_count"], value_heads=ssm["time_step_rank"], key_dim=ssm["state_size"],
                  value_dim=ssm["inner_size"] // ssm["time_step_rank"], tiled=arch in _TILED_VALUE_HEADS)


def _rows(tensor: Any, name: str, order: np.ndarray) -> tuple[Any, str]:
    """The tensor's rows in `order` (a copy; quantized rows move whole), under the HF `name`."""
    data = np.asarray(tensor.data)[order]
    return dataclasses.replace(tensor, name=name, shape=(*tensor.shape[:-1], len(order)), data=data), name


def _columns(tensor: Any, name: str, order: np.ndarray, dequantize: Callable[[Any], np.ndarray]) -> tuple[Any, str]:
    """The matrix with its columns in `order`, as float32 (quantized blocks span columns)."""
    from gguf import GGMLQuantizationType
    data = np.ascontiguousarray(dequantize(tensor)[:, order])
    return dataclasses.replace(tensor, name=name, tensor_type=GGMLQuantizationType.F32, data=data), name


def linear_attention_parts(reader: Any, arch: str, tensor: Any,
                           dequantize: Callable[[Any], np.ndarray]) -> list[tuple[Any, str]] | None:
    """(tensor, HF name) of each part of a linear-attention tensor, in HF's layout (see the
    module's docstring), or None where the tensor is not one; `dequantize` makes a GGUF tensor
    float32 (for a reordering of columns)."""
    match = re.fullmatch(r"blk\.(\d+)\.(attn_qkv|attn_gate|ssm_\w+?)(?:\.(weight|bias))?", tensor.name)
    if match is None:
        return None
    prefix = f"model.layers.{match.group(1)}.linear_attn"
    kind = match.group(2)
    sizes = _sizes(reader, arch)
    key_rows = sizes.key_heads * sizes.key_dim
    per_key = sizes.value_heads // sizes.key_heads
    if kind == "attn_qkv":
        values = 2 * key_rows + sizes.value_order(sizes.value_dim)
        return [_rows(tensor, f"{prefix}.in_proj_q.weight", np.arange(key_rows)),
                _rows(tensor, f"{prefix}.in_proj_k.weight", key_rows + np.arange(key_rows)),
                _rows(tensor, f"{prefix}.in_proj_v.weight", values)]
    if kind == "attn_gate":
        return [_rows(tensor, f"{prefix}.in_proj_z.weight", sizes.value_order(sizes.value_dim))]
    if kind in ("ssm_beta", "ssm_alpha"):
        return [_rows(tensor, f"{prefix}.in_proj_{kind[4]}.weight", sizes.value_order(1))]
    if kind == "ssm_ba":  # [b, a] of each key head's value heads, as in HF
        grouped = np.arange(sizes.value_heads * 2).reshape(sizes.key_heads, 2, per_key)
        return [_rows(tensor, f"{prefix}.in_proj_b.weight", grouped[:, 0].reshape(-1)),
                _rows(tensor, f"{prefix}.in_proj_a.weight", grouped[:, 1].reshape(-1))]
    if kind == "ssm_a":
        part, name = _rows(tensor, f"{prefix}.A_log", sizes.value_order(1))
        # A = -exp(A_log): its log taken in float64, so that exp of the float32 A_log is A within an ulp or two.
        a_log = np.log(-np.asarray(part.data, dtype=np.float64)).astype(np.float32)
        return [(dataclasses.replace(part, data=a_log), name)]
    if kind == "ssm_dt":
        return [_rows(tensor, f"{prefix}.dt_bias", sizes.value_order(1))]
    if kind == "ssm_conv1d":
        order = np.concatenate([np.arange(2 * key_rows), 2 * key_rows + sizes.value_order(sizes.value_dim)])
        part, name = _rows(tensor, f"{prefix}.conv1d.weight", order)
        width, channels = part.shape  # squeezed: the module's weight is [channels, 1, width]
        return [(dataclasses.replace(part, shape=(width, 1, channels)), name)]
    if kind == "ssm_norm":
        return [(tensor, f"{prefix}.norm.weight")]
    if kind == "ssm_out":
        name = f"{prefix}.out_proj.weight"
        if not sizes.tiled or per_key == 1:
            return [(tensor, name)]
        return [_columns(tensor, name, sizes.value_order(sizes.value_dim), dequantize)]
    return None

