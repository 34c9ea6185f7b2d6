"""GGUF files: architecture metadata as a config.json-like dict, and tensors
dequantized and renamed to Hugging Face names (llama.cpp's Q/K row permutation undone).
"""
from __future__ import annotations

import dataclasses
import logging
import re
import struct
from collections.abc import Callable, Collection, Iterator
from typing import Any

import numpy as np

from kvserve.model.errors import ModelConfigError, UnsupportedArchitectureError
from kvserve.model.gguf_file import GGUFFile, open_gguf
from kvserve.model.gguf_linear_attention import (GATED_DELTANET_ARCHS, add_gated_deltanet_config,
                                                 linear_attention_parts)
from kvserve.model.gguf_mamba import MAMBA_ARCHS, add_mamba_hybrid_config, mamba_hybrid_parts

logger = logging.getLogger(__name__)

# GGUF general.architecture -> HF architecture
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",
    "qwen35": "Qwen3_5ForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM",
    "granitehybrid": "GraniteMoeHybridForCausalLM",
}
# llama.cpp writes Mixtral as "llama" with experts.
_LLAMA_WITH_EXPERTS = "MixtralForCausalLM"
# Whether llama.cpp renormalizes the top-k gate weights, where the file does not say
# (`expert_weights_norm`): Qwen3-MoE and Mixtral do, OLMoE does not.
_NORM_TOPK_DEFAULT = {"qwen3moe": True, "llama": True, "olmoe": False, "qwen3next": True, "qwen35moe": True}

# llama.cpp interleaves the two rotary halves of Q and K rows; HF keeps them split.
_PERMUTED_ARCHS = ("llama", "mistral")
# llama.cpp's default sliding-window pattern of gpt-oss where the file gives none: every
# `n`th layer full, the others sliding (layers 0, 2, 4, ... slide, as in gpt-oss's config).
_SWA_PATTERN_DEFAULT = {"gpt-oss": 2}

_METADATA_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}

_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate_inp": "mlp.gate",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Experts stacked in one 3-D tensor [experts, rows, columns] -> each expert's projection.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _field_value(reader: GGUFFile, key: str) -> Any:
    return reader.get(key)


def read_gguf_hf_config(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return (config.json-like dict, ModelConfig overrides) from a GGUF file's metadata."""
    try:
        reader = open_gguf(path)
    except (OSError, ValueError, struct.error) as exc:
        raise ModelConfigError(f"{path!r} is not a readable GGUF file: {exc}") from exc
    arch = _field_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})")
    hf: dict[str, Any] = {"architectures": [GGUF_ARCHITECTURES[arch]], "model_type": arch}
    for key, hf_key in _METADATA_KEYS.items():
        value = _field_value(reader, f"{arch}.{key}")
        if value is not None:
            hf[hf_key] = value
    names = {t.name for t in reader.tensors}
    overrides: dict[str, Any] = {}
    if hf.get("num_experts"):
        if arch == "llama":
            hf["architectures"] = [_LLAMA_WITH_EXPERTS]
        norm = _field_value(reader, f"{arch}.expert_weights_norm")
        hf["norm_topk_prob"] = bool(_NORM_TOPK_DEFAULT.get(arch, True) if norm is None else norm)
        # A layer is sparse where the file has its router.
        overrides["sparse_layers"] = [f"blk.{i}.ffn_gate_inp.weight" in names
                                      for i in range(int(hf["num_hidden_layers"]))]
    if "vocab_size" not in hf:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        hf["vocab_size"] = tokens.count if tokens is not None else 0
    _add_rope_scaling(reader, arch, hf)
    if arch == "gpt-oss":
        _add_gpt_oss(reader, hf)
    if arch == "gemma3":
        hf.setdefault("rope_local_base_freq", 10000.0)
        hf["query_pre_attn_scalar"] = hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    if arch in GATED_DELTANET_ARCHS:
        add_gated_deltanet_config(reader, arch, hf)
    if arch in MAMBA_ARCHS:
        add_mamba_hybrid_config(reader, arch, hf, names)
    if arch == "gemma2":
        hf["query_pre_attn_scalar"] = hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    hf["tie_word_embeddings"] = "output.weight" not in names
    hf["attention_bias"] = "blk.0.attn_q.bias" in names
    eos = _field_value(reader, "tokenizer.ggml.eos_token_id")
    eot = _field_value(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = [int(e) for e in (eos, eot) if e is not None]
    if arch == "gpt-oss":
        eos_ids += _harmony_stop_ids(reader)
    overrides.update(eos_token_ids=list(dict.fromkeys(eos_ids)),
                     bos_token_id=_field_value(reader, "tokenizer.ggml.bos_token_id"))
    return hf, overrides


def _add_gpt_oss(reader: GGUFFile, hf: dict[str, Any]) -> None:
    """gpt-oss's config.json fields that its GGUF keys name otherwise or leave to llama.cpp's
    defaults: the expert count, and which layers slide (`attention.sliding_window_pattern`,
    a period or one flag per layer; llama.cpp's default period 2)."""
    hf["num_local_experts"] = hf.get("num_experts")
    layers = int(hf["num_hidden_layers"])
    pattern = _field_value(reader, "gpt-oss.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        sliding = [bool(flag) for flag in pattern]
    else:
        period = int(pattern) if pattern is not None else _SWA_PATTERN_DEFAULT["gpt-oss"]
        sliding = [period == 0 or i % period < period - 1 for i in range(layers)]
    if len(sliding) != layers:
        raise ModelConfigError(f"gpt-oss.attention.sliding_window_pattern has {len(sliding)} flags for {layers} layers")
    hf["layer_types"] = ["sliding_attention" if flag else "full_attention" for flag in sliding]
    if hf.get("rope_scaling", {}).get("rope_type") == "yarn":
        # gpt-oss was trained with YaRN's correction range unrounded (its config's truncate: false).
        hf["rope_scaling"]["truncate"] = False


# The tokens that end a gpt-oss reply, as its generation_config.json lists them (and llama.cpp
# treats them as end of generation): the file's EOS is <|return|> alone.
_HARMONY_STOP_TOKENS = ("<|return|>", "<|endoftext|>", "<|call|>")


def _harmony_stop_ids(reader: GGUFFile) -> list[int]:
    tokens = reader.get("tokenizer.ggml.tokens") or []
    ids = {token: index for index, token in enumerate(tokens) if token in _HARMONY_STOP_TOKENS}
    return [ids[token] for token in _HARMONY_STOP_TOKENS if token in ids]


def _add_rope_scaling(reader: Any, arch: str, hf: dict[str, Any]) -> None:
    scaling_type = _field_value(reader, f"{arch}.rope.scaling.type")
    factor = _field_value(reader, f"{arch}.rope.scaling.factor")
    if scaling_type in ("linear", "yarn") and factor:
        hf["rope_scaling"] = {"rope_type": scaling_type, "factor": float(factor)}
        original = _field_value(reader, f"{arch}.rope.scaling.original_context_length")
        if original:
            hf["rope_scaling"]["original_max_position_embeddings"] = int(original)
        for key in ("beta_fast", "beta_slow"):
            value = _field_value(reader, f"{arch}.rope.scaling.yarn_{key}")
            if value is not None:
                hf["rope_scaling"][key] = float(value)
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        # Llama-3 scaling stored as per-frequency divisors: applied by the loader.
        hf["rope_freq_factors_in_file"] = True


# Gemma's sandwich norms: llama.cpp's ffn_norm is the pre-MLP norm there.
_GEMMA_BLOCK_TENSORS = {**_BLOCK_TENSORS, "ffn_norm": "pre_feedforward_layernorm"}


def gguf_hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """Map a GGUF tensor name ("blk.3.attn_q.weight") to its HF name, or None if unused."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    block_tensors = _GEMMA_BLOCK_TENSORS if arch in ("gemma2", "gemma3") else _BLOCK_TENSORS
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if match and match.group(2) == "attn_sinks":  # a parameter of the attention, not a module's weight
        return f"model.layers.{match.group(1)}.{block_tensors['attn_sinks']}"
    if match and match.group(2) in block_tensors:
        return f"model.layers.{match.group(1)}.{block_tensors[match.group(2)]}.{suffix}"
    return None


def _named_tensors(reader: GGUFFile, arch: str) -> Iterator[tuple[Any, str | None]]:
    """(tensor, HF name or None) for every tensor of the file; a stack of experts comes as
    one view per expert (a 2-D weight, or a 1-D bias of gpt-oss's 2-D bias stacks), named as
    that expert's projection."""
    for tensor in reader.tensors:
        parts = _state_layer_parts(reader, arch, tensor)
        if parts is not None:
            yield from parts
            continue
        stem, _, suffix = tensor.name.rpartition(".")
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
        dims = 2 if suffix == "bias" else 3
        if match is None or match.group(2) not in _EXPERT_TENSORS or len(tensor.shape) != dims:
            yield tensor, gguf_hf_name(tensor.name, arch)
            continue
        prefix = f"model.layers.{match.group(1)}.mlp.experts"
        for expert in range(int(tensor.shape[-1])):
            name = f"{prefix}.{expert}.{_EXPERT_TENSORS[match.group(2)]}.{suffix}"
            yield dataclasses.replace(tensor, name=name, shape=tensor.shape[:-1], data=tensor.data[expert]), name


def _state_layer_parts(reader: GGUFFile, arch: str, tensor: Any) -> list[tuple[Any, str]] | None:
    """(tensor, HF name) of each part of a hybrid's linear-attention or Mamba-2 tensor, or None."""
    if arch in GATED_DELTANET_ARCHS:
        return linear_attention_parts(reader, arch, tensor, dequantize_tensor)
    if arch in MAMBA_ARCHS:
        return mamba_hybrid_parts(tensor)
    return None


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's per-head (2, d/2) -> (d/2, 2) row interleave of Q/K."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
            .swapaxes(1, 2).reshape(weight.shape))


def dequantize_tensor(tensor: Any, rows: tuple[int, int] | None = None) -> np.ndarray:
    """A GGUF tensor as float32, shaped like the PyTorch weight (rows first).

    `rows` = (first, count) dequantizes only those rows (a tensor-parallel shard):
    quantized blocks never span rows, so the other rows are not even read.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    qtype = tensor.tensor_type
    shape = tuple(int(d) for d in reversed(tensor.shape))
    raw = tensor.data
    if rows is not None:
        first, count = rows
        raw = raw[first:first + count]
        shape = (count, *shape[1:])
    if qtype == GGMLQuantizationType.F32:
        data = np.array(raw, dtype=np.float32)
    elif qtype == GGMLQuantizationType.F16:
        data = np.asarray(raw, dtype=np.float16).astype(np.float32)
    else:
        # A plain ndarray view: the numpy.memmap subclass makes each block slice slow.
        data = dequantize(np.asarray(raw), qtype).astype(np.float32, copy=False)
    return data.reshape(shape)


def iter_gguf_tensors(path: str, num_heads: int, num_kv_heads: int,
                      select: Callable[[str], tuple[int, int, int] | None] | None = None,
                      keep_quantized: Callable[[str], bool] | None = None,
                      skip: Callable[[str], bool] | None = None,
                      stored_types: Collection[str] = (),
                      stored_copies: dict[str, Any] | None = None,
                      ) -> Iterator[tuple[str, Any]]:
    """Yield (HF name, float32 array) for every model tensor of the file.

    `select(hf_name)` may return (dim, first, count): then only that slice of
    the tensor is yielded (a tensor-parallel rank's shard). Row slices are
    cut before dequantizing; column slices after. Where `keep_quantized(hf_name)`
    the tensor may come quantized instead, not dequantized: as a `StoredWeight`
    where its type is one of `stored_types` (the GGUF type names the stored-block
    kernels run; see `stored_tensor`, and `stored_copies`, the tensors whose layout
    differs from the file's, already made, by HF name), else as a repacked
    `QuantizedWeight` where the native kernels take its type (and a column slice
    falls on block boundaries). Tensors for which `skip(hf_name)` holds are not read at all.
    """
    reader = open_gguf(path)
    arch = _field_value(reader, "general.architecture")
    # llama.cpp stores Gemma's and Qwen3-Next's / Qwen3.5's (1 + w) norms as 1 + w (not the
    # gated norm of the linear attention, a plain w): our RMSNorm adds the 1 itself.
    norm_minus_one = arch in ("gemma2", "gemma3", *GATED_DELTANET_ARCHS)
    for tensor, name in _named_tensors(reader, arch):
        if tensor.name == "rope_freqs.weight":
            yield "rope_freq_factors", dequantize_tensor(tensor)
            continue
        if name is None:
            logger.debug("skipping GGUF tensor %s", tensor.name)
            continue
        if skip is not None and skip(name):
            continue
        full_rows = int(tensor.shape[-1])
        part = select(name) if select is not None else None
        quantized = keep_quantized is not None and keep_quantized(name)
        if quantized and tensor.tensor_type.name in stored_types:
            weight = (stored_copies or {}).get(name)
            weight = weight if weight is not None else stored_tensor(tensor, name, arch, part, num_heads, num_kv_heads)
            if weight is not None:
                yield name, weight
                continue
        array = _quantized_part(tensor, part) if quantized else None
        if array is None and part is not None and part[0] == 0:
            array = dequantize_tensor(tensor, rows=(part[1], part[2]))
        elif array is None:
            array = dequantize_tensor(tensor)
            if part is not None:
                array = array[:, part[1]:part[1] + part[2]]
        # A row shard holds whole heads, so the per-head un-permutation applies to it alone.
        heads = _permuted_heads(arch, name, num_heads, num_kv_heads)
        if heads:
            array = _unpermute(array, heads, full_rows)
        if norm_minus_one and "norm" in name and not name.endswith("linear_attn.norm.weight"):
            array = array - 1.0
        yield name, array


def iter_stored_copies(path: str, num_heads: int, num_kv_heads: int,
                       select: Callable[[str], tuple[int, int, int] | None] | None,
                       keep_quantized: Callable[[str], bool], stored_types: Collection[str],
                       ) -> Iterator[tuple[str, Any]]:
    """(HF name, StoredWeight) of every tensor `iter_gguf_tensors` would hold as stored but not
    as a view of the file (see `stored_tensor`), made one at a time: the repack cache writes
    each before the next is made."""
    reader = open_gguf(path)
    arch = _field_value(reader, "general.architecture")
    for tensor, name in _named_tensors(reader, arch):
        if name is None or tensor.tensor_type.name not in stored_types or not keep_quantized(name):
            continue
        part = select(name) if select is not None else None
        if _permuted_heads(arch, name, num_heads, num_kv_heads) or (part is not None and part[0] == 1):
            weight = stored_tensor(tensor, name, arch, part, num_heads, num_kv_heads)
            if weight is not None:
                yield name, weight
            del weight  # not held while the next is made


def stored_tensor(tensor: Any, name: str, arch: str, part: tuple[int, int, int] | None,
                  num_heads: int, num_kv_heads: int) -> Any:
    """The tensor (or its `part`) as a `StoredWeight` of the file's own blocks: a view of the
    file's mapping, rows sliced included, except where kvserve's layout differs from the
    file's: Q/K rows of llama-family files un-permuted, a column slice (each row's blocks
    cut); those are copies. None where a column slice cuts through blocks or the tensor
    is not a matrix."""
    from kvserve.model.stored_weight import from_gguf_blocks
    blocks = _raw_part(tensor, part)
    if blocks is None:
        return None
    weight = from_gguf_blocks(tensor.tensor_type.name, *blocks)
    heads = _permuted_heads(arch, name, num_heads, num_kv_heads)
    return _unpermute(weight, heads, int(tensor.shape[-1])) if heads else weight


def _raw_part(tensor: Any, part: tuple[int, int, int] | None) -> tuple[np.ndarray, int] | None:
    """(raw blocks [rows, bytes per row], columns) of a matrix or of its `part` (rows: a view of
    the file; columns: a copy), or None where the tensor is no matrix or the columns cut blocks."""
    if len(tensor.shape) != 2:
        return None
    raw = np.asarray(tensor.data)
    if part is None:
        return raw, int(tensor.shape[0])
    if part[0] == 0:
        return raw[part[1]:part[1] + part[2]], int(tensor.shape[0])
    columns = _block_columns(tensor.tensor_type, raw, part[1], part[2])
    return None if columns is None else (columns, part[2])


def _block_columns(tensor_type: Any, raw: np.ndarray, first: int, count: int) -> np.ndarray | None:
    """Columns first..first+count of every row of raw blocks (a copy), or None off block boundaries."""
    from gguf import GGML_QUANT_SIZES
    block_cols, block_bytes = GGML_QUANT_SIZES[tensor_type]
    if first % block_cols or count % block_cols:
        return None
    return np.ascontiguousarray(raw[:, first // block_cols * block_bytes:(first + count) // block_cols * block_bytes])


def _permuted_heads(arch: str, name: str, num_heads: int, num_kv_heads: int) -> int:
    """The heads whose rows llama.cpp interleaved in this tensor (0: none)."""
    if arch not in _PERMUTED_ARCHS:
        return 0
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return num_heads
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return num_kv_heads
    return 0


def _quantized_part(tensor: Any, part: tuple[int, int, int] | None) -> Any:
    """The tensor (or its `part`) repacked for the quantized kernel, or None where the
    kernel does not take its type or the slice cuts through blocks."""
    from kvserve.model import quantized
    type_name = tensor.tensor_type.name
    blocks = _raw_part(tensor, part) if type_name in quantized.SUPPORTED_GGUF_TYPES else None
    return None if blocks is None else quantized.from_gguf_blocks(type_name, *blocks)


def _unpermute(array: Any, heads: int, full_rows: int) -> Any:
    """`_unpermute_rows` for a float array, a `QuantizedWeight` or a `StoredWeight` (whose rows move whole)."""
    rows = array.shape[0]
    if isinstance(array, np.ndarray):
        return _unpermute_rows(array, heads * rows // full_rows)
    import torch
    order = _unpermute_rows(np.arange(rows, dtype=np.int64), heads * rows // full_rows)
    return array.rows(torch.from_numpy(np.ascontiguousarray(order)))
