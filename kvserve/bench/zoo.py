"""A zoo of random-weight GGUF models shaped like the ones people run, for benchmarks and tests.

`zoo:<shape>-<type>` (for example `zoo:llama-1b-q4_k_m`) names a model: a GGUF of the shape's
architecture and sizes with random weights, the default model's tokenizer (its vocabulary padded
with unused tokens up to the shape's vocabulary size), quantized to `<type>` by llama.cpp's own
`llama-quantize` (built once from llama-cpp-python's sdist, see `kvserve.bench.llama_build`).
Speed does not depend on the weights' values, so a random model decodes at the speed of a trained
one of its shape and type. Files are cached under <cache root>/zoo and built on first use:

    kvserve bench compare --model zoo:llama-1b-q4_k_m --references llama.cpp
    kvserve bench zoo llama-1b-q4_k_m qwen-0.5b-q4_k_m      # build ahead of time
    kvserve bench zoo --list

The `tiny-*` shapes are for tests: the `gguf` package writes them in the types it quantizes itself
(`PYTHON_TYPES`) without llama.cpp.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvserve.bench.model_info import ModelShapes
from kvserve.paths import cache_root

ZOO_PREFIX = "zoo:"
_FORMAT_VERSION = 2  # bump when the written source files change, so stale caches are rebuilt


class ZooError(ValueError):
    """A zoo name that does not resolve, or a zoo model that cannot be built."""


@dataclass(frozen=True)
class ZooShape(ModelShapes):
    """The sizes of one model family member, as its config.json states them, and its GGUF architecture."""

    architecture: str = "llama"
    tied_embeddings: bool = True
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    context_length: int = 8192
    rms_norm_eps: float = 1e-5
    sliding_window: int = 0  # Gemma-2: every other layer
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    # Mixture of experts (qwen3moe): every layer's MLP is `num_experts` experts of width
    # `expert_width`, `experts_per_token` of them per token (`intermediate_size` then unused).
    num_experts: int = 0
    experts_per_token: int = 0
    expert_width: int = 0
    note: str = ""

    def linear_shapes(self) -> list[tuple[str, int, int, int]]:
        """As `ModelShapes`, the MLP being the experts a token reads (and the router) for an MoE."""
        shapes = super().linear_shapes()
        if not self.num_experts:
            return shapes
        dense = [row for row in shapes if row[0] not in ("gate_up_proj", "down_proj")]
        picked = self.experts_per_token * self.num_layers
        return dense + [("router", self.hidden_size, self.num_experts, self.num_layers),
                        ("expert_gate_up_proj", self.hidden_size, 2 * self.expert_width, picked),
                        ("expert_down_proj", self.expert_width, self.hidden_size, picked)]

    def num_parameters(self) -> int:
        """Matrix weights (the LM head's counted as the embedding's when tied; every expert)."""
        unread = (self.num_experts - self.experts_per_token) * self.num_layers * 3 * self.hidden_size * self.expert_width
        return self.matmul_params + unread + (0 if self.tied_embeddings else self.vocab_size * self.hidden_size)


# The shipped tokenizer has 49,152 tokens; shapes with fewer (Mistral's 32,000) keep 49,152.
_SHIPPED_VOCAB = 49152

SHAPES: dict[str, ZooShape] = {
    "llama-1b": ZooShape(2048, 8192, 16, 32, 8, 64, 128256, architecture="llama", rope_theta=500000.0, note="Llama-3.2-1B"),
    "llama-3b": ZooShape(3072, 8192, 28, 24, 8, 128, 128256, architecture="llama", rope_theta=500000.0, note="Llama-3.2-3B"),
    "qwen-0.5b": ZooShape(896, 4864, 24, 14, 2, 64, 151936, architecture="qwen2", qkv_bias=True, rope_theta=1000000.0,
                          rms_norm_eps=1e-6, note="Qwen2.5-0.5B"),
    "qwen-1.5b": ZooShape(1536, 8960, 28, 12, 2, 128, 151936, architecture="qwen2", qkv_bias=True, rope_theta=1000000.0,
                          rms_norm_eps=1e-6, note="Qwen2.5-1.5B"),
    "gemma-2b": ZooShape(2304, 9216, 26, 8, 4, 256, 256000, architecture="gemma2", rms_norm_eps=1e-6, sliding_window=4096,
                         attn_softcap=50.0, final_softcap=30.0, note="Gemma-2-2B"),
    "mistral-7b": ZooShape(4096, 14336, 32, 32, 8, 128, _SHIPPED_VOCAB, architecture="llama", tied_embeddings=False,
                           rope_theta=1000000.0, note="Mistral-7B (vocabulary 49,152 instead of 32,000)"),
    # Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of width 768,
    # top 8) on 24 layers instead of 48: 15.6B parameters, 1.7B read per token.
    "qwen3moe-15b-a2b": ZooShape(2048, 6144, 24, 32, 4, 128, 151936, architecture="qwen3moe", tied_embeddings=False,
                                 rope_theta=1000000.0, rms_norm_eps=1e-6, num_experts=128, experts_per_token=8,
                                 expert_width=768, note="Qwen3-30B-A3B's layers, 24 of them"),
    # The same layer scaled down for quick runs: 0.95B parameters, 0.26B read per token.
    "qwen3moe-1b": ZooShape(1024, 3072, 12, 16, 4, 64, 151936, architecture="qwen3moe", tied_embeddings=False,
                            rope_theta=1000000.0, rms_norm_eps=1e-6, num_experts=32, experts_per_token=4,
                            expert_width=512, note="Qwen3-MoE layer scaled down, 12 layers of 32 experts"),
    # Small shapes for tests (written by the gguf package, no llama.cpp needed).
    "tiny-llama": ZooShape(256, 512, 2, 4, 2, 64, _SHIPPED_VOCAB, architecture="llama", note="test shape"),
    "tiny-qwen": ZooShape(256, 512, 2, 4, 2, 64, _SHIPPED_VOCAB, architecture="qwen2", qkv_bias=True, note="test shape"),
    "tiny-qwen3moe": ZooShape(256, 512, 2, 4, 2, 64, _SHIPPED_VOCAB, architecture="qwen3moe", num_experts=8,
                              experts_per_token=2, expert_width=128, note="test shape"),
}

# Zoo type name -> llama-quantize's type argument. "f16" is the unquantized source itself.
QUANT_TYPES = {"q4_k_m": "Q4_K_M", "q4_k_s": "Q4_K_S", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_k_m": "Q5_K_M",
               "q5_0": "Q5_0", "q5_1": "Q5_1", "q3_k_m": "Q3_K_M", "q2_k": "Q2_K", "q6_k": "Q6_K", "q8_0": "Q8_0",
               "iq4_xs": "IQ4_XS", "iq4_nl": "IQ4_NL", "f16": "F16"}
# The types the issue benchmarks on; `kvserve bench zoo --all` builds these for every full shape.
STANDARD_TYPES = ("q4_k_m", "q4_0", "q8_0", "q6_k", "iq4_xs")
# Types the gguf package quantizes itself (every matrix in that type): no llama-quantize needed.
PYTHON_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "f16")


@dataclass(frozen=True)
class ZooModel:
    """A parsed zoo name: the shape and the quantization type."""

    shape_name: str
    type_name: str

    @property
    def shape(self) -> ZooShape:
        return SHAPES[self.shape_name]

    @property
    def name(self) -> str:
        return f"{self.shape_name}-{self.type_name}"


def is_zoo_name(model: str | None) -> bool:
    return isinstance(model, str) and model.startswith(ZOO_PREFIX)


def parse_zoo_name(name: str) -> ZooModel:
    """`zoo:llama-1b-q4_k_m` (the prefix is optional) -> ZooModel("llama-1b", "q4_k_m")."""
    bare = name.removeprefix(ZOO_PREFIX).lower()
    shape_name, _, type_name = bare.rpartition("-")
    if shape_name not in SHAPES:
        raise ZooError(f"unknown zoo model {name!r}: shapes are {', '.join(SHAPES)}; "
                       f"name one as zoo:<shape>-<type>, e.g. zoo:llama-1b-q4_k_m")
    if type_name not in QUANT_TYPES:
        raise ZooError(f"unknown quantization type {type_name!r} in {name!r}: types are {', '.join(QUANT_TYPES)}")
    return ZooModel(shape_name, type_name)


def zoo_dir() -> str:
    return os.path.join(cache_root(), "zoo")


def zoo_path(model: ZooModel) -> str:
    return os.path.join(zoo_dir(), f"{model.shape_name}.v{_FORMAT_VERSION}.{model.type_name}.gguf")


def resolve_zoo_model(name: str, build: bool = True, quantizer: str | None = None) -> str:
    """The path of zoo model `name`, building it (and llama-quantize) first when it is not cached
    and `build`; ZooError when it is missing and may not be built, or cannot be built.
    `quantizer` "gguf" writes the type with the gguf package instead (PYTHON_TYPES only; the
    default for the tiny test shapes in those types)."""
    model = parse_zoo_name(name)
    path = zoo_path(model)
    if os.path.isfile(path):
        return path
    if quantizer is None and model.shape_name.startswith("tiny-") and model.type_name in PYTHON_TYPES:
        quantizer = "gguf"
    if not build:
        raise ZooError(f"zoo model {model.name} is not built yet (kvserve bench zoo {model.name} builds it)")
    return build_zoo_model(model, quantizer=quantizer)


def build_zoo_model(model: ZooModel, quantizer: str | None = None, seed: int = 0) -> str:
    """Write (or reuse) the F16 source of the model's shape, quantize it to the model's type and
    return the cached path. Shapes whose type the gguf package quantizes may pass quantizer="gguf"."""
    target = zoo_path(model)
    os.makedirs(zoo_dir(), exist_ok=True)
    if quantizer == "gguf":
        if model.type_name not in PYTHON_TYPES:
            raise ZooError(f"the gguf package does not quantize {model.type_name}; "
                           f"it writes {', '.join(PYTHON_TYPES)} (llama-quantize writes the rest)")
        write_random_gguf(model.shape, target, model.type_name, seed=seed)
        return target
    if quantizer not in (None, "llama-quantize"):
        raise ZooError(f"unknown quantizer {quantizer!r} (llama-quantize or gguf)")
    source = zoo_path(dataclasses.replace(model, type_name="f16"))
    if not os.path.isfile(source):
        write_random_gguf(model.shape, source, "f16", seed=seed)
    if model.type_name != "f16":
        quantize_with_llama_cpp(source, target, QUANT_TYPES[model.type_name])
    return target


def quantize_with_llama_cpp(source: str, target: str, llama_type: str) -> None:
    """`llama-quantize source target llama_type` (building llama-quantize if needed), atomically."""
    import subprocess

    from kvserve.bench.llama_build import LlamaBuildError, build_tools, find_tool

    tool = find_tool("llama-quantize")
    if tool is None:
        try:
            tool = build_tools(["llama-quantize"])["llama-quantize"]
        except LlamaBuildError as error:
            raise ZooError(f"cannot build llama-quantize for the zoo: {error}") from error
    staged = target + ".partial"
    completed = subprocess.run([tool, source, staged, llama_type, str(os.cpu_count() or 1)],
                               capture_output=True, text=True)
    if completed.returncode != 0:
        if os.path.exists(staged):
            os.remove(staged)
        tail = (completed.stderr or completed.stdout).strip().splitlines()[-3:]
        raise ZooError(f"llama-quantize {llama_type} failed (exit {completed.returncode}): {' | '.join(tail)}")
    os.replace(staged, target)


# ---- writing the source GGUF ---------------------------------------------------------------

def _tensor_specs(shape: ZooShape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF tensor name, numpy shape: rows first) of every tensor, as llama.cpp's converter names them."""
    hidden, q_rows, kv_rows = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    yield "token_embd.weight", (shape.vocab_size, hidden)
    yield "output_norm.weight", (hidden,)
    if not shape.tied_embeddings:
        yield "output.weight", (shape.vocab_size, hidden)
    norms = ["attn_norm", "ffn_norm"]
    if shape.architecture == "gemma2":
        norms += ["post_attention_norm", "post_ffw_norm"]
    for layer in range(shape.num_layers):
        prefix = f"blk.{layer}."
        for norm in norms:
            yield prefix + norm + ".weight", (hidden,)
        if shape.architecture == "qwen3moe":  # Q/K norms per head
            yield prefix + "attn_q_norm.weight", (shape.head_dim,)
            yield prefix + "attn_k_norm.weight", (shape.head_dim,)
        yield prefix + "attn_q.weight", (q_rows, hidden)
        yield prefix + "attn_k.weight", (kv_rows, hidden)
        yield prefix + "attn_v.weight", (kv_rows, hidden)
        if shape.qkv_bias:
            yield prefix + "attn_q.bias", (q_rows,)
            yield prefix + "attn_k.bias", (kv_rows,)
            yield prefix + "attn_v.bias", (kv_rows,)
        yield prefix + "attn_output.weight", (hidden, q_rows)
        if shape.num_experts:
            # The router, then each projection's experts stacked in one 3-D tensor, as llama.cpp's converter writes them.
            yield prefix + "ffn_gate_inp.weight", (shape.num_experts, hidden)
            yield prefix + "ffn_gate_exps.weight", (shape.num_experts, shape.expert_width, hidden)
            yield prefix + "ffn_up_exps.weight", (shape.num_experts, shape.expert_width, hidden)
            yield prefix + "ffn_down_exps.weight", (shape.num_experts, hidden, shape.expert_width)
            continue
        yield prefix + "ffn_gate.weight", (shape.intermediate_size, hidden)
        yield prefix + "ffn_up.weight", (shape.intermediate_size, hidden)
        yield prefix + "ffn_down.weight", (hidden, shape.intermediate_size)


def _random_values(rng: np.random.Generator, name: str, dims: tuple[int, ...]) -> np.ndarray:
    """Norm weights 1 (as llama.cpp stores them, Gemma's 1 + w included), biases small normals,
    matrices normals of scale 1/sqrt(fan-in) so that activations keep their size through the layers."""
    if len(dims) == 1 and name.endswith("norm.weight"):
        return np.ones(dims, np.float32)
    if len(dims) == 1:
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float32)
    scale = np.float32(1.0 / np.sqrt(dims[-1]))
    return rng.standard_normal(dims, dtype=np.float32) * scale


def _encode(values: np.ndarray, type_name: str, name: str = ""):
    """(array to write, GGML type) for a tensor: 1-D tensors and an MoE router stay float32 as
    llama.cpp's converter writes them (llama-quantize leaves them so too)."""
    import gguf
    from gguf import GGMLQuantizationType as QType

    if values.ndim == 1 or name.endswith("ffn_gate_inp.weight"):
        return values, QType.F32
    if type_name == "f16":
        return values.astype(np.float16), QType.F16
    qtype = QType[type_name.upper()]
    return gguf.quants.quantize(values, qtype), qtype


def write_random_gguf(shape: ZooShape, path: str, type_name: str = "f16", seed: int = 0) -> str:
    """Write a random-weight GGUF of `shape` with every matrix stored as `type_name` (f16 or one of
    PYTHON_TYPES) and the default model's tokenizer, tensor by tensor (a 7B model never sits in
    memory whole). The file appears atomically at `path`."""
    import gguf

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, staged = tempfile.mkstemp(suffix=".partial", dir=directory)
    os.close(handle)
    try:
        writer = gguf.GGUFWriter(staged, shape.architecture)
        _write_metadata(writer, shape, type_name)
        specs = list(_tensor_specs(shape))
        for name, dims in specs:  # declare every tensor first (sizes from a one-row sample)
            sample, qtype = _encode(np.zeros(dims if len(dims) == 1 else (1, dims[-1]), np.float32), type_name, name)
            nbytes = sample.nbytes * (1 if len(dims) == 1 else int(np.prod(dims[:-1])))
            byte_shape = dims if len(dims) == 1 else (*dims[:-1], sample.shape[-1])
            writer.add_tensor_info(name, byte_shape, sample.dtype, nbytes, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rng = np.random.default_rng(seed)
        for name, dims in specs:
            writer.write_tensor_data(_encode(_random_values(rng, name, dims), type_name, name)[0])
        writer.close()
        os.chmod(staged, 0o644)
        os.replace(staged, path)
    finally:
        if os.path.exists(staged):
            os.remove(staged)
    return path


_LLAMA_FILE_TYPES = {"f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9}


def _write_metadata(writer, shape: ZooShape, type_name: str) -> None:
    writer.add_name(f"kvserve zoo {shape.note or shape.architecture} (random weights)")
    writer.add_file_type(_LLAMA_FILE_TYPES[type_name])
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_vocab_size(shape.vocab_size)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.attn_softcap:
        writer.add_attn_logit_softcapping(shape.attn_softcap)
    if shape.final_softcap:
        writer.add_final_logit_softcapping(shape.final_softcap)
    if shape.num_experts:
        writer.add_expert_count(shape.num_experts)
        writer.add_expert_used_count(shape.experts_per_token)
        writer.add_expert_feed_forward_length(shape.expert_width)
    _write_tokenizer(writer, shape.vocab_size)
    writer.add_quantization_version(2)


def _write_tokenizer(writer, vocab_size: int) -> None:
    """The default model's tokenizer, its vocabulary padded to `vocab_size` with normal tokens that
    no merge produces (as special tokens, tens of thousands of them would slow tokenizer loading
    far beyond a real vocabulary's)."""
    from kvserve.engine.model_path import default_model_path
    from kvserve.model.gguf_file import GGUFFile

    shipped = GGUFFile(default_model_path())
    tokens = shipped.get("tokenizer.ggml.tokens")
    token_types = list(shipped.get("tokenizer.ggml.token_type"))
    if vocab_size < len(tokens):
        raise ZooError(f"vocabulary {vocab_size} is smaller than the shipped tokenizer's {len(tokens)}")
    normal = int(__import__("gguf").TokenType.NORMAL)
    padding = vocab_size - len(tokens)
    writer.add_tokenizer_model(shipped.get("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(shipped.get("tokenizer.ggml.pre"))
    writer.add_token_list(tokens + [f"[zoo-pad-{i}]" for i in range(padding)])
    writer.add_token_types(token_types + [normal] * padding)
    writer.add_token_merges(shipped.get("tokenizer.ggml.merges"))
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("unknown_token_id", writer.add_unk_token_id), ("padding_token_id", writer.add_pad_token_id)):
        value = shipped.get(f"tokenizer.ggml.{key}")
        if value is not None:
            add(int(value))
    writer.add_add_bos_token(bool(shipped.get("tokenizer.ggml.add_bos_token", False)))
    writer.add_add_space_prefix(bool(shipped.get("tokenizer.ggml.add_space_prefix", False)))
    template = shipped.get("tokenizer.chat_template")
    if template:
        writer.add_chat_template(template)


# ---- listing and building from the command line --------------------------------------------

def zoo_listing() -> list[dict]:
    """Every shape with its sizes and which of its types are cached."""
    rows = []
    for shape_name, shape in SHAPES.items():
        cached = [t for t in QUANT_TYPES if os.path.isfile(zoo_path(ZooModel(shape_name, t)))]
        rows.append({"shape": shape_name, "like": shape.note, "architecture": shape.architecture,
                     "parameters": shape.num_parameters(), "cached": cached})
    return rows


def build_many(names: list[str], all_standard: bool = False) -> dict:
    """Build the named zoo models (and, with all_standard, every full shape in STANDARD_TYPES);
    returns {name: path}."""
    wanted = list(names)
    if all_standard:
        wanted += [f"{s}-{t}" for s in SHAPES if not s.startswith("tiny-") for t in STANDARD_TYPES]
    if not wanted:
        return {"models": zoo_listing()}
    built = {}
    for name in dict.fromkeys(wanted):
        model = parse_zoo_name(name)
        path = resolve_zoo_model(model.name)
        built[model.name] = {"path": path, "bytes": os.path.getsize(path)}
    return {"built": built}
