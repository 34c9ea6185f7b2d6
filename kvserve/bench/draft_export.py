"""A draft model cut from the target itself, for `kvserve bench spec --draft-layers N`.

No shipped model shares SmolLM2's tokenizer, so the bench drafts with the
target's own GGUF cut to N of its layers: the first N - 2 and the last two.
On SmolLM2-135M (30 layers) the last two matter most: greedy acceptance on the
copy/quote chats with k=3 was ~97% keeping 28 (dropping layers 26-27), ~60%
keeping the first 28, and near 0 at 22 or fewer whichever layers were kept
(first, evenly spaced, or first + last). Embedding, final norm and head are kept,
so vocabulary and tokenizer are the target's. Tensors are copied as stored
(quantized ones stay quantized) and the layers renumbered 0..N-1.
"""
from __future__ import annotations

import os
import re
import tempfile

from kvserve.bench.gguf_export import _copy_metadata

_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")


def kept_layers(num_layers: int, num_kept: int) -> list[int]:
    """The target layers a draft of `num_kept` layers keeps: the first num_kept - 2 and the last two."""
    if not 2 <= num_kept <= num_layers:
        raise ValueError(f"a draft keeps 2 to {num_layers} layers of this model, not {num_kept}")
    return list(range(num_kept - 2)) + [num_layers - 2, num_layers - 1]


def write_truncated_gguf(source: str, num_kept: int, target_dir: str | None = None) -> str:
    """Writes `source` cut to `num_kept` layers as a GGUF under `target_dir` (default: a new
    temporary directory, left for the caller to remove); returns its path."""
    import gguf

    if not source.endswith(".gguf"):
        raise ValueError(f"a draft cut from the target needs a .gguf target, got {source!r}")
    reader = gguf.GGUFReader(source)
    architecture = reader.fields["general.architecture"].contents()
    count_key = f"{architecture}.block_count"
    layers = kept_layers(int(reader.fields[count_key].contents()), num_kept)
    renumbered = {old: new for new, old in enumerate(layers)}
    target_dir = target_dir or tempfile.mkdtemp(prefix="kvserve-draft-")
    os.makedirs(target_dir, exist_ok=True)
    stem = os.path.basename(source).removesuffix(".gguf")
    target = os.path.join(target_dir, f"{stem}.draft{num_kept}.gguf")
    writer = gguf.GGUFWriter(target, architecture)
    _copy_metadata(reader, writer, None, replaced={count_key: num_kept})
    for tensor in reader.tensors:
        name = tensor.name
        match = _LAYER_TENSOR.match(name)
        if match:
            layer = int(match.group(1))
            if layer not in renumbered:
                continue
            name = f"blk.{renumbered[layer]}.{match.group(2)}"
        writer.add_tensor(name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
