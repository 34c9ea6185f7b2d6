"""The memory-bandwidth bound of decoding a model file, and how close each bench figure comes.

Decoding one token reads every weight of the model once (a matmul per weight), so one
sequence cannot decode faster than read bandwidth / the weight bytes read per token, and
`B` sequences decoding together (one step reads the weights once for all of them) not
faster than `B` times that. The bytes are the model file's own (a GGUF's quantized
blocks, a Hugging Face directory's safetensors in their stored dtype): what any engine
must stream from memory per step, whatever it repacks them into. The input embedding table
is not counted (a step reads one row of it per token) unless the LM head reuses it (tied
embeddings, read whole); of a mixture of experts' expert tensors, a token reads only the
experts it is routed to, so they count for (experts used / experts) of their bytes. KV-cache
reads and compute are ignored: a bound, not a prediction.

`attach` adds to a bench result the bound (`bandwidth_bound`) and, beside every output-token
rate in it, the bound for that figure's sequences and the percentage reached.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Any

# Output-token rates in the bench results (decode-bound figures; prompt rates are compute-bound).
RATE_KEYS = ("output_tokens_per_s", "output_token_throughput", "kvserve_output_tokens_per_s",
             "reference_output_tokens_per_s", "tokens_per_s")
# The keys that say how many sequences a figure decoded together.
SEQUENCES_KEYS = ("concurrency", "batch_size", "num_requests")
_EMBEDDING_NAMES = {"token_embd.weight"}
_HEAD_NAMES = {"output.weight", "lm_head.weight"}


def weight_bytes_per_token(model_path: str) -> dict[str, Any]:
    """{"bytes": weight bytes one decode step reads from `model_path` (a .gguf file or a HF
    directory of safetensors), "tensors": how many tensors count, "tied_embeddings"}."""
    if model_path.endswith(".gguf"):
        sizes, used_share = _gguf_tensor_bytes(model_path)
    else:
        sizes, used_share = _safetensors_bytes(model_path), _hf_experts_used_share(model_path)
    if not sizes:
        raise ValueError(f"{model_path}: no weight tensors found (a .gguf file or a directory of safetensors)")
    embeddings = {name for name in sizes if name in _EMBEDDING_NAMES or name.endswith("embed_tokens.weight")}
    tied = not any(name in _HEAD_NAMES or name.endswith("lm_head.weight") for name in sizes)
    counted = {name: size * (used_share if _is_expert(name) else 1.0)
               for name, size in sizes.items() if tied or name not in embeddings}
    return {"bytes": int(sum(counted.values())), "tensors": len(counted), "tied_embeddings": tied,
            "experts_used_share": used_share}


def _is_expert(name: str) -> bool:
    return "_exps." in name or ".experts." in name


def _gguf_tensor_bytes(path: str) -> tuple[dict[str, int], float]:
    from kvserve.model.gguf_file import open_gguf

    gguf = open_gguf(path)
    arch = gguf.get("general.architecture", "")
    experts, used = gguf.get(f"{arch}.expert_count", 0), gguf.get(f"{arch}.expert_used_count", 0)
    return ({tensor.name: int(tensor.data.nbytes) for tensor in gguf.tensors},
            used / experts if experts and used else 1.0)


def _hf_experts_used_share(directory: str) -> float:
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except OSError:
        return 1.0
    config = config.get("text_config", config)
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    used = config.get("num_experts_per_tok") or config.get("num_experts_per_token") or 0
    return used / experts if experts and used else 1.0


def _safetensors_bytes(directory: str) -> dict[str, int]:
    """Tensor sizes from each safetensors file's header (8-byte length, then JSON)."""
    sizes = {}
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(directory, name), "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for tensor, info in header.items():
            if tensor != "__metadata__":
                begin, end = info["data_offsets"]
                sizes[tensor] = end - begin
    return sizes


def bound(model_path: str, read_bandwidth_gb_per_s: float, bandwidth_source: str) -> dict[str, Any]:
    """The single-sequence decode bound of `model_path` at that read bandwidth."""
    weights = weight_bytes_per_token(model_path)
    return {"model": model_path, "weight_bytes_per_token": weights["bytes"],
            "tied_embeddings": weights["tied_embeddings"], "read_bandwidth_gb_per_s": read_bandwidth_gb_per_s,
            "bandwidth_source": bandwidth_source,
            "single_sequence_tokens_per_s": read_bandwidth_gb_per_s * 1e9 / weights["bytes"]}


def measured_bandwidth(roofline_json: str | None = None) -> tuple[float, str]:
    """(read bandwidth in GB/s, where it comes from): a `kvserve bench roofline` result's
    figure when given, else measured now (a 512 MiB buffer summed, median of 3)."""
    if roofline_json:
        with open(roofline_json, encoding="utf-8") as f:
            return float(json.load(f)["result"]["read_bandwidth_gb_per_s"]), roofline_json
    from kvserve.bench.roofline import measure_read_bandwidth

    return measure_read_bandwidth(512 << 20, repeats=3, device="cpu"), "measured by this run"


def attach(result: dict[str, Any], model_path: str | None, roofline_json: str | None = None) -> dict[str, Any]:
    """Add `bandwidth_bound` to `result` and, beside each rate of RATE_KEYS, `<key>_bound`
    (the bound for the figure's sequences: `bandwidth_bound_sequences`, from the nearest
    SEQUENCES_KEYS, 1 when none) and `<key>_pct_of_bound`. Without a model file, says why."""
    if not model_path:
        result["bandwidth_bound"] = {"skipped": "no model file given (--model): the bound needs its weight bytes"}
        return result
    gb_per_s, source = measured_bandwidth(roofline_json)
    result["bandwidth_bound"] = bound(model_path, gb_per_s, source)
    _annotate(result, result["bandwidth_bound"]["single_sequence_tokens_per_s"], None)
    return result


def _annotate(node: Any, per_sequence: float, sequences: int | None) -> None:
    if isinstance(node, list):
        for item in node:
            _annotate(item, per_sequence, sequences)
        return
    if not isinstance(node, dict):
        return
    own = _sequences(node)
    sequences = own if own is not None else sequences
    rates = [key for key in RATE_KEYS if isinstance(node.get(key), (int, float)) and not isinstance(node[key], bool)]
    for key in rates:
        count = sequences or 1
        node["bandwidth_bound_sequences"] = count
        node[f"{key}_bound"] = per_sequence * count
        node[f"{key}_pct_of_bound"] = 100.0 * node[key] / (per_sequence * count)
    for key, value in list(node.items()):
        if key != "bandwidth_bound" and isinstance(value, (dict, list)):
            _annotate(value, per_sequence, sequences)


def _sequences(node: dict) -> int | None:
    for holder in (node, node.get("config") if isinstance(node.get("config"), dict) else {}):
        for key in SEQUENCES_KEYS:
            value = holder.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
