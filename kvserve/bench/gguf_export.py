"""A GGUF file re-stored at another precision, so llama.cpp can run the same weights
at the precision kvserve computes in.

kvserve dequantizes a quantized GGUF at load and runs it in float32 or
bfloat16; llama.cpp runs a GGUF's tensors as stored. To compare at equal
precision the bench writes a copy whose matrices hold exactly the values
kvserve computes with (the dequantized weights, rounded to bfloat16 for a
bfloat16 run); 1-D tensors (norm weights) stay float32, as llama.cpp expects.
Metadata is copied field by field, with `general.file_type` updated.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np

from kvserve.paths import cache_root

# GGUF tensor type and `general.file_type` (llama_ftype) per dtype name.
_TARGETS = {"float32": ("F32", 0), "float16": ("F16", 1), "bfloat16": ("BF16", 32)}


def exported_path(source: str, dtype: str) -> str:
    stem = os.path.basename(source).removesuffix(".gguf")
    return os.path.join(cache_root(), "gguf", f"{stem}.{_TARGETS[dtype][0]}.gguf")


def export_gguf(source: str, dtype: str, target: str | None = None) -> str:
    """Writes `source`'s tensors as `dtype` ("float32", "float16", "bfloat16") to `target`
    (default: under the kvserve cache, reused while newer than the source); returns its path."""
    import gguf

    if dtype not in _TARGETS:
        raise ValueError(f"cannot export GGUF as {dtype!r}; choose one of {', '.join(_TARGETS)}")
    target = target or exported_path(source, dtype)
    if os.path.exists(target) and os.path.getmtime(target) >= os.path.getmtime(source):
        return target
    type_name, file_type = _TARGETS[dtype]
    matrix_type = gguf.GGMLQuantizationType[type_name]
    reader = gguf.GGUFReader(source)
    architecture = reader.fields["general.architecture"].contents()
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    handle, tmp_path = tempfile.mkstemp(suffix=".gguf", dir=os.path.dirname(os.path.abspath(target)))
    os.close(handle)
    try:
        writer = gguf.GGUFWriter(tmp_path, architecture)
        _copy_metadata(reader, writer, file_type)
        for tensor in reader.tensors:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
            if values.ndim == 1:
                writer.add_tensor(tensor.name, values)
            else:
                # quantize returns float32 as is and other types as bytes; the writer reads the
                # element shape back from the byte shape.
                writer.add_tensor(tensor.name, gguf.quants.quantize(values, matrix_type), raw_dtype=matrix_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp_path, target)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
    return target


def _copy_metadata(reader, writer, file_type: int | None, replaced: dict | None = None) -> None:
    """Copy every field, with `general.file_type` set to `file_type` (kept when None) and
    the fields named in `replaced` given those values instead (their type kept)."""
    import gguf

    replaced = replaced or {}
    if file_type is not None:
        writer.add_file_type(file_type)
    for field in reader.fields.values():
        # The writer adds the GGUF.* header fields and the architecture itself.
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name == "general.file_type" and file_type is not None:
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = replaced.get(field.name, field.contents())
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
