"""The GGUF re-stored at another precision (kvserve/bench/gguf_export.py): the same
weights kvserve computes with, the same metadata, llama.cpp's tensor types."""
from __future__ import annotations

import os

import pytest
import torch

from kvserve.bench.gguf_export import export_gguf
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from model.paged_kv_helper import load_hf, save_tiny_model

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QType  # noqa: E402
from helpers.gguf_writer import write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    directory = tmp_path_factory.mktemp("q4")
    path = str(directory / "tiny-q4_1.gguf")
    write_gguf(load_hf(save_tiny_model("llama", directory)), path, QType.Q4_1)
    return path


def _weights(path: str, dtype: str) -> dict[str, torch.Tensor]:
    return load_model(ModelConfig.from_path(path, dtype=dtype, quantization="none")).state_dict()


@pytest.mark.parametrize("dtype, matrix_type", [("float32", QType.F32), ("bfloat16", QType.BF16)])
def test_export_holds_the_weights_kvserve_computes_with(q4_gguf, tmp_path, dtype, matrix_type):
    target = export_gguf(q4_gguf, dtype, str(tmp_path / f"tiny-{dtype}.gguf"))
    ours, exported = _weights(q4_gguf, dtype), _weights(target, dtype)
    assert ours.keys() == exported.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, exported[name]), name
    source, written = gguf.GGUFReader(q4_gguf), gguf.GGUFReader(target)
    for tensor in written.tensors:
        assert tensor.tensor_type == (QType.F32 if len(tensor.shape) == 1 else matrix_type), tensor.name
    assert [t.name for t in written.tensors] == [t.name for t in source.tensors]
    fields = {name: f.contents() for name, f in source.fields.items() if not name.startswith("GGUF.")}
    written_fields = {name: f.contents() for name, f in written.fields.items() if not name.startswith("GGUF.")}
    assert written_fields.pop("general.file_type") == {"float32": 0, "bfloat16": 32}[dtype]
    fields.pop("general.file_type", None)
    assert written_fields == fields


def test_export_is_reused_while_newer_than_its_source(q4_gguf, tmp_path):
    target = str(tmp_path / "tiny-f32.gguf")
    export_gguf(q4_gguf, "float32", target)
    os.utime(target, (1e9 + 10**8, 2e9))  # newer than the source
    export_gguf(q4_gguf, "float32", target)
    assert os.path.getmtime(target) == 2e9
    os.utime(target, (0, 0))  # older: written again
    export_gguf(q4_gguf, "float32", target)
    assert os.path.getmtime(target) > 0


def test_export_rejects_an_unknown_precision(q4_gguf, tmp_path):
    with pytest.raises(ValueError, match="float8"):
        export_gguf(q4_gguf, "float8", str(tmp_path / "x.gguf"))
