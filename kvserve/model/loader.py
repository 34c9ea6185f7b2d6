"""Weight loading: safetensors (single or sharded) and GGUF, into a DecoderModel.

Checkpoint tensors arrive under their Hugging Face names; `_route` sends each
to the module that owns it (fused QKV and gate/up parts go to their slice) and
that module keeps its tensor-parallel shard.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import re
from collections.abc import Callable, Iterator

import numpy as np
import torch

from kvserve.native.config import KernelConfig
from kvserve.model.config import ModelConfig, ModelFilesNotFoundError
from kvserve.model import repack_cache, stored_weight
from kvserve.model.decoder import DecoderModel
from kvserve.model.gguf_file import release_gguf_mappings
from kvserve.model.kernels import choose_model_kernels
from kvserve.model.linear_attention.gated_deltanet import split_checkpoint_tensor
from kvserve.model.parallel import (ColumnParallelLinear, QuantizedWeightMixin, RowParallelLinear,
                                    VocabParallelEmbedding)
from kvserve.model.quantized import QuantizedWeight, gemm_dtype, kernel_isa, keeps_quantized, stored_types
from kvserve.model.stored_parts import StoredParts
from kvserve.model.stored_weight import StoredWeight

logger = logging.getLogger(__name__)

# Other families' names of the same modules: Mixtral's MoE block and expert projections.
_RENAMES = ((re.compile(r"\.block_sparse_moe\."), ".mlp."),
            (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
            (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
            (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."),
            (re.compile(r"\.mlp\.router\."), ".mlp.gate."))
# A layer's experts stacked in one tensor: transformers 5's in-memory layout, gate_up [E, 2I, hidden]
# (gate rows, then up rows) and down [E, hidden, I]; gpt-oss's checkpoints, gate_up [E, hidden, 2I]
# (gate and up columns interleaved), down [E, I, hidden], and their biases [E, 2I] / [E, hidden].
_STACKED_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)(_bias)?$")

# Granite's checkpoint names (IBM's layout): experts stacked as `input_linear` [E, 2I, hidden]
# (gate rows, then up rows) and `output_linear` [E, hidden, I], the router's `router.layer`, and
# the shared expert's fused `input_linear` [2S, hidden] / `output_linear`. Renamed before the
# stacked experts are cut apart.
_GRANITE_NAMES = ((re.compile(r"\.block_sparse_moe\.input_linear\.weight$"), ".block_sparse_moe.experts.gate_up_proj"),
                  (re.compile(r"\.block_sparse_moe\.output_linear\.weight$"), ".block_sparse_moe.experts.down_proj"),
                  (re.compile(r"\.block_sparse_moe\.router\.layer\."), ".block_sparse_moe.router."),
                  (re.compile(r"\.shared_mlp\.output_linear\."), ".shared_mlp.down_proj."))
# Gated DeltaNet's input projections as parts (`gated_deltanet.split_checkpoint_tensor`, the GGUF loader).
_LINEAR_ATTENTION_PART = re.compile(r"\.in_proj_[qkvzba]\.weight$")
_SHARED_GATE_UP = re.compile(r"(.*\.shared_mlp)\.input_linear\.(weight|bias)$")

_FUSED_PARTS = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
                # Gated DeltaNet (`gated_deltanet.split_checkpoint_tensor` makes these parts)
                **{f"in_proj_{part}": ("in_proj_qkvz", part) for part in "qkvz"},
                **{f"in_proj_{part}": ("in_proj_ba", part) for part in "ba"}}


def load_model(model_config: ModelConfig, device: torch.device | str = "cpu", tp_rank: int = 0, tp_size: int = 1,
               tp_group=None, kernel_config: KernelConfig | None = None,
               kv_cache_dtype: torch.dtype | None = None) -> DecoderModel:
    """Build the model for `model_config`, load its weights (this rank's shard), cast to its dtype,
    and set the kernels it runs with from `kernel_config` (default: every kernel allowed; the
    engine passes the one `EngineConfig` read from the environment) for a KV cache of
    `kv_cache_dtype` (None: the model's dtype)."""
    kernel_config = kernel_config or KernelConfig()
    model = DecoderModel(model_config, tp_rank, tp_size, tp_group)
    # With tensor parallelism each rank reads only its slice of the sharded tensors.
    select = shard_selector(model) if tp_size > 1 else None
    cache_file, cached = None, None
    if model_config.is_gguf:
        from kvserve.model.gguf_loader import iter_gguf_tensors
        quantize = keeps_quantized(model_config, device, kernel_config)
        stored = stored_types(kernel_config) if quantize else frozenset()
        if quantize and kernel_config.repack_cache:
            cache_file = repack_cache.cache_path(model_config.path, tp_rank, tp_size, stored_types=stored)
            cached = repack_cache.load(cache_file)
        copies = _stored_copies(model_config, select, stored, kernel_config, tp_rank, tp_size)
        tensors = ((name, array if isinstance(array, (QuantizedWeight, StoredWeight))
                    else torch.from_numpy(np.ascontiguousarray(array)))
                   for name, array in iter_gguf_tensors(model_config.path, model_config.num_heads,
                                                        model_config.num_kv_heads, select=select,
                                                        keep_quantized=_is_matrix_weight if quantize else None,
                                                        skip=_held_in(cached), stored_types=stored,
                                                        stored_copies=copies))
    else:
        tensors = iter_safetensors(model_config.path, select)
    load_weights(model, tensors, preloaded=cached)
    _finish_quantized(model, kernel_config, log=tp_rank == 0, cache_file=None if cached else cache_file)
    if model_config.is_gguf:
        _populate_stored_views(model, model_config.path, kernel_config.expert_huge_folios)
        release_gguf_mappings()
    rotaries = [r for r in (model.rotary_global, model.rotary_local) if r is not None]
    inv_freqs = [r.inv_freq for r in rotaries]
    model.to(device=device, dtype=model_config.torch_dtype)
    # RoPE frequencies stay float32 whatever the weight dtype.
    for rotary, inv_freq in zip(rotaries, inv_freqs):
        rotary.inv_freq = inv_freq.to(device)
    model.use_kernels(choose_model_kernels(kernel_config, device, model_config.torch_dtype, model.attention_shape,
                                           kv_cache_dtype))
    return model.eval()


def _is_matrix_weight(name: str) -> bool:
    """Checkpoint tensors that may stay quantized: the projections, embeddings and LM head."""
    return name.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight")) or _LINEAR_ATTENTION_PART.search(
        name) is not None


def _stored_copies(model_config: ModelConfig, select, stored: frozenset[str], kernel_config: KernelConfig,
                   tp_rank: int, tp_size: int) -> dict[str, StoredWeight] | None:
    """The stored tensors whose layout is not the file's (gguf_loader.iter_stored_copies), from
    the repack cache: written there first (one tensor at a time) where it does not hold them yet.
    None where nothing is stored or the cache is off or cannot be written (the loader then makes
    each copy in memory)."""
    if not stored or not kernel_config.repack_cache:
        return None
    from kvserve.model.gguf_loader import iter_stored_copies
    path = repack_cache.cache_path(model_config.path, tp_rank, tp_size, kind="stored", stored_types=stored)
    copies = repack_cache.load_stored(path)
    if copies is not None:
        return copies
    made = iter_stored_copies(model_config.path, model_config.num_heads, model_config.num_kv_heads, select,
                              _is_matrix_weight, stored)
    try:
        count = repack_cache.save_stored(path, made, model_config.path)
    except OSError as error:
        logger.warning("could not cache the re-laid-out weights at %s (%s): every start makes them", path, error)
        return None
    if count and tp_rank == 0:
        logger.info("%d weights re-laid out (Q/K rows un-permuted, column slices) cached at %s", count, path)
    return repack_cache.load_stored(path)


def _populate_stored_views(model: DecoderModel, path: str, expert_huge_folios: bool = False) -> None:
    """Map the pages of the GGUF file that weights are views of now (see gguf_file.populate), but
    for a mixture of experts' experts: they fault in when a token first picks them (as in the
    repack cache), so an expert no token picks is never resident. The 2 MiB windows between
    experts come in first as huge folios; with `expert_huge_folios`, the experts' windows are
    advised the same, to be read whole when first picked."""
    from kvserve.model.gguf_file import open_gguf
    parts = sorted((part.blocks.data_ptr(), part.nbytes(), ".experts." in name) for name, part in _stored_parts(model))
    spans = [(address, nbytes) for address, nbytes, expert in parts if not expert]
    if spans:
        open_gguf(path).populate(spans, huge_runs=_runs(parts, experts=False))
    if expert_huge_folios:
        open_gguf(path).advise_huge(_runs(parts, experts=True))


def _runs(parts: list[tuple[int, int, bool]], experts: bool) -> list[tuple[int, int]]:
    """(address, length) of each run of the weights `parts` ((address, nbytes, is an expert) in
    ascending address) that are experts (`experts`) or not, unbroken by one of the other kind:
    a huge folio read within a run of non-experts pages in no expert, and the reverse."""
    runs: list[tuple[int, int]] = []
    start = end = None
    for address, nbytes, expert in parts + [(0, 0, not experts)]:
        if expert != experts:
            if start is not None:
                runs.append((start, end - start))
            start = end = None
        elif start is None:
            start, end = address, address + nbytes
        else:
            end = max(end, address + nbytes)
    return runs


def _stored_parts(model: DecoderModel) -> Iterator[tuple[str, StoredWeight]]:
    """(module name, StoredWeight) of every stored weight the model's modules hold (fused ones part by part)."""
    for name, module in model.named_modules():
        weight = getattr(module, "quant_weight", None)
        if isinstance(weight, StoredWeight):
            yield name, weight
        elif isinstance(weight, StoredParts):
            yield from ((name, part) for part in weight.parts)


def _held_in(cached: dict[str, QuantizedWeight] | None) -> Callable[[str], bool] | None:
    """For checkpoint names: whether the repacked-weight cache already holds that weight."""
    if not cached:
        return None

    def held(name: str) -> bool:
        target = _route(name)
        return target is not None and target[1] == "weight" and target[0] in cached
    return held


def _finish_quantized(model: DecoderModel, kernel_config: KernelConfig, log: bool, cache_file: str | None) -> None:
    """Stack the quantized parts each module received (and, given `cache_file`, save the repacked
    ones there and hold them as views of its mapping) and stamp the kernel path, activation rounding
    and dense-GEMM choice on them; the tied LM head shares the embedding's quantized table. Logs
    what is held."""
    isa = kernel_isa(kernel_config)
    dense = gemm_dtype(kernel_config)
    modules = [(name, module) for name, module in model.named_modules() if isinstance(module, QuantizedWeightMixin)]
    for _, module in modules:
        module.finish_quantized()
    if cache_file is not None:
        _hold_from_cache(modules, cache_file, model.config.path)
    stored: dict[str, int] = {}
    repacked: dict[str, int] = {}
    native_gemm: set[str] = set()  # stored types whose many-row steps run csrc/linear/gguf_gemm.c
    for _, module in modules:
        weight = module.quant_weight
        if isinstance(weight, QuantizedWeight):
            module.quant_weight = dataclasses.replace(weight, isa=isa, act_bits=kernel_config.quant_act_bits,
                                                      gemm_rows=kernel_config.quant_gemm_rows, gemm_dtype=dense,
                                                      panel_rows=kernel_config.quant_panel_rows)
            repacked[weight.source_type] = repacked.get(weight.source_type, 0) + 1
        elif weight is not None:
            choices = dict(isa=isa, gemm_rows=kernel_config.quant_gemm_rows, gemm_dtype=dense)
            module.quant_weight = weight.replace_parts(**choices) if isinstance(weight, StoredParts) \
                else dataclasses.replace(weight, **choices)
            for part in module.quant_weight.parts if isinstance(weight, StoredParts) else [module.quant_weight]:
                stored[part.type_name] = stored.get(part.type_name, 0) + 1
                if stored_weight.has_native_gemm(part):
                    native_gemm.add(part.type_name)
    if model.config.tie_word_embeddings and model.embed_tokens.quant_weight is not None:
        model.lm_head.quant_weight = model.embed_tokens.quant_weight
        model.lm_head.register_parameter("weight", None)
    if (stored or repacked) and log:
        dense_steps = (f"steps of {kernel_config.quant_gemm_rows}+ rows: dense {str(dense).removeprefix('torch.')} GEMM"
                       if kernel_config.quant_gemm_rows else "no dense GEMM")
        if native_gemm:
            dense_steps += f" (native int8 GEMM at any size for {', '.join(sorted(native_gemm))})"
        counts = [f"as stored: {_counts(stored)}"] if stored else []
        counts += [f"repacked: {_counts(repacked)}"] if repacked else []
        logger.info("weights held quantized (%s) on the %s kernel path; %s", "; ".join(counts), isa, dense_steps)


def _counts(by_type: dict[str, int]) -> str:
    return ", ".join(f"{count} x {name}" for name, count in sorted(by_type.items()))


def _hold_from_cache(modules: list[tuple[str, QuantizedWeightMixin]], cache_file: str, source: str) -> None:
    """Save the modules' repacked weights to `cache_file` and swap each for its view of the file's
    mapping (the private copies go); on a write error keep the copies and say so."""
    weights = {name: module.quant_weight for name, module in modules if isinstance(module.quant_weight, QuantizedWeight)}
    if not weights:
        return
    try:
        repack_cache.save(cache_file, weights, source)
    except OSError as error:
        logger.warning("could not cache the repacked weights at %s (%s): every start repacks them", cache_file, error)
        return
    mapped = repack_cache.load(cache_file)
    for name, module in modules:
        if mapped is not None and name in mapped:
            module.quant_weight = mapped[name]
    logger.info("repacked weights cached at %s", cache_file)


def safetensors_files(path: str) -> list[str]:
    """The checkpoint's files: those named by model.safetensors.index.json, or every *.safetensors."""
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        with open(index_file) as f:
            weight_map = json.load(f)["weight_map"]
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    missing = [f for f in files if not os.path.isfile(f)]
    if not files or missing:
        raise ModelFilesNotFoundError(f"no safetensors weights in {path!r}" + (f" (missing {missing[0]})" if missing else ""))
    return files


def iter_safetensors(path: str, select: Callable[[str], TensorSlice | None] | None = None,
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every checkpoint tensor; `select(name)` -> (dim, first, count)
    reads only that slice (a tensor-parallel rank's shard)."""
    from safetensors import safe_open
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                part = select(name) if select is not None else None
                if part is None:
                    yield name, f.get_tensor(name)
                    continue
                dim, first, count = part
                lazy = f.get_slice(name)
                yield name, lazy[first:first + count] if dim == 0 else lazy[:, first:first + count]


# (dim, first index, count): the part of a checkpoint tensor one tensor-parallel rank keeps.
TensorSlice = tuple[int, int, int]


def shard_selector(model: DecoderModel) -> Callable[[str], TensorSlice | None]:
    """For a checkpoint tensor name, the slice of it that `model` (one rank) keeps, or
    None when it keeps the whole tensor (norms, replicated biases) or ignores it."""
    modules = dict(model.named_modules())

    def select(name: str) -> TensorSlice | None:
        target = _route(name)
        if target is None:
            return None
        module_name, param_kind, shard = target
        module = modules.get(module_name)
        if isinstance(module, ColumnParallelLinear):
            return (0, *module.shard_rows(shard))
        if isinstance(module, RowParallelLinear) and param_kind == "weight":
            return (1, *module.shard_columns())
        if isinstance(module, VocabParallelEmbedding):
            return (0, *module.shard_rows())
        return None

    return select


def load_weights(model: DecoderModel, tensors: Iterator[tuple[str, torch.Tensor]],
                 preloaded: dict[str, QuantizedWeight] | None = None) -> None:
    """Copy every checkpoint tensor into its place (`preloaded`: module name -> quantized weight
    already repacked, from the cache); complain about missing ones."""
    loaded: set[str] = set()
    modules = dict(model.named_modules())
    for module_name, weight in (preloaded or {}).items():
        module = modules[module_name]
        module.quant_weight = weight
        module.register_parameter("weight", None)
        loaded.update(f"{module_name}.weight" + (f":{part}" if part else "") for part in module._part_names())
    if "linear_attention" in model.config.layer_types:
        tensors = (part for name, tensor in tensors for part in split_checkpoint_tensor(name, tensor, model.config))
    if model.config.family == "granitemoehybrid":
        tensors = _granite_tensors(tensors, shared_is_mlp=not model.config.shared_expert_size)
    for name, tensor in _split_stacked_experts(tensors, interleaved=model.config.family == "gpt_oss"):
        if name == "rope_freq_factors":
            model.rotary_global.set_freq_factors(tensor)
            continue
        target = _route(name)
        if target is None:
            logger.debug("ignoring checkpoint tensor %s", name)
            continue
        module_name, param_kind, shard = target
        module = modules.get(module_name)
        if module is None:
            logger.debug("ignoring checkpoint tensor %s (no module %s)", name, module_name)
            continue
        if module_name == "lm_head" and model.config.tie_word_embeddings:
            continue
        if isinstance(tensor, (QuantizedWeight, StoredWeight)):
            module.load_quantized(tensor, shard)
        else:
            _load_into(module, param_kind, tensor.float(), shard)
        loaded.add(f"{module_name}.{param_kind}" + (f":{shard}" if shard else ""))
    _check_complete(model, loaded)


def _split_stacked_experts(tensors: Iterator[tuple[str, torch.Tensor]],
                           interleaved: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass tensors through, with stacked expert tensors (`_STACKED_EXPERTS`) cut into
    each expert's gate, up and down projections under their per-expert names;
    `interleaved`: gpt-oss's layout (see `_STACKED_EXPERTS`)."""
    for name, tensor in tensors:
        match = _STACKED_EXPERTS.fullmatch(name)
        is_bias = match is not None and match.group(3) is not None
        if match is None or isinstance(tensor, (QuantizedWeight, StoredWeight)) or tensor.dim() != (2 if is_bias else 3):
            yield name, tensor
            continue
        prefix, kind = match.group(1), match.group(2)
        param = "bias" if is_bias else "weight"
        for expert, part in enumerate(tensor.unbind(0)):
            if interleaved and not is_bias:
                part = part.t()  # gpt-oss stores x @ W: [in, out]
            if kind == "down_proj":
                yield f"{prefix}.{expert}.down_proj.{param}", part
                continue
            gate, up = (part[0::2], part[1::2]) if interleaved else part.chunk(2, dim=0)
            yield f"{prefix}.{expert}.gate_proj.{param}", gate
            yield f"{prefix}.{expert}.up_proj.{param}", up


def _granite_tensors(tensors: Iterator[tuple[str, torch.Tensor]],
                     shared_is_mlp: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Granite's tensors under the names `_route` knows (`_GRANITE_NAMES`), the shared expert's
    fused gate/up cut in two; `shared_is_mlp`: a model without routed experts, whose shared
    MLP is the layer's MLP."""
    shared = ".mlp." if shared_is_mlp else ".shared_mlp."
    for name, tensor in tensors:
        for pattern, replacement in _GRANITE_NAMES:
            name = pattern.sub(replacement, name)
        match = _SHARED_GATE_UP.fullmatch(name)
        if match is None or isinstance(tensor, (QuantizedWeight, StoredWeight)):
            yield name.replace(".shared_mlp.", shared), tensor
            continue
        gate, up = tensor.chunk(2, dim=0)
        module = match.group(1).replace(".shared_mlp", shared.rstrip("."))
        yield f"{module}.gate_proj.{match.group(2)}", gate
        yield f"{module}.up_proj.{match.group(2)}", up


def _route(name: str) -> tuple[str, str, str | None] | None:
    """HF tensor name -> (module name, 'weight'|'bias', fused shard or None)."""
    name = re.sub(r"^model\.", "", name)
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    if name.startswith("language_model."):
        name = name.removeprefix("language_model.").removeprefix("model.")
    if "rotary_emb" in name:
        return None
    module_name, _, param_kind = name.rpartition(".")
    parent, _, leaf = module_name.rpartition(".")
    if leaf in _FUSED_PARTS:
        fused, shard = _FUSED_PARTS[leaf]
        return f"{parent}.{fused}", param_kind, shard
    return module_name, param_kind, None


def _load_into(module: torch.nn.Module, param_kind: str, tensor: torch.Tensor, shard: str | None) -> None:
    if hasattr(module, "load_weight"):
        module.load_weight(param_kind, tensor, shard)
        return
    param = getattr(module, param_kind)
    if param.shape != tensor.shape:
        raise ValueError(f"shape mismatch for {param_kind}: model {tuple(param.shape)}, checkpoint {tuple(tensor.shape)}")
    param.data.copy_(tensor)


def _check_complete(model: DecoderModel, loaded: set[str]) -> None:
    expected = []
    for layer_idx in range(model.config.num_layers):
        prefix = f"layers.{layer_idx}"
        layer = model.layers[layer_idx]
        if layer.is_state_layer:
            expected += layer.mixer.checkpoint_weight_names(f"{prefix}.{layer.mixer_name}")
        else:
            expected += [f"{prefix}.self_attn.qkv_proj.weight:{s}" for s in "qkv"]
            expected.append(f"{prefix}.self_attn.o_proj.weight")
        if layer.shared_mlp is not None:
            expected += [f"{prefix}.shared_mlp.{name}" for name in ("down_proj.weight", "gate_up_proj.weight:gate",
                                                                  "gate_up_proj.weight:up")]
        if model.config.sparse_layers[layer_idx]:
            expected.append(f"{prefix}.mlp.gate.weight")
            mlps = [f"{prefix}.mlp.experts.{e}" for e in range(model.config.num_experts)]
            if model.config.shared_expert_intermediate_size:
                expected.append(f"{prefix}.mlp.shared_expert_gate.weight")
                mlps.append(f"{prefix}.mlp.shared_expert")
        else:
            mlps = [f"{prefix}.mlp"]
        for mlp in mlps:
            expected += [f"{mlp}.down_proj.weight", f"{mlp}.gate_up_proj.weight:gate", f"{mlp}.gate_up_proj.weight:up"]
    expected += ["embed_tokens.weight", "norm.weight"]
    if not model.config.tie_word_embeddings:
        expected.append("lm_head.weight")
    missing = [name for name in expected if name not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
