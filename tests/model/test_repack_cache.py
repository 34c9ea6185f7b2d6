"""The repacked-weight cache (model/repack_cache.py): weights saved once per GGUF file and mapped on
later loads give the very same model; changed or foreign files are not used."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvserve.model import quantized, repack_cache
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from kvserve.native.config import KernelConfig
from paged_kv_helper import VOCAB, PagedRunner, load_hf, run_teacher_forced, save_tiny_model

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QType  # noqa: E402
from helpers.gguf_writer import write_gguf  # noqa: E402

pytestmark = pytest.mark.skipif(quantized.kernel_isa() is None, reason="needs the native quantized kernels")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    directory = tmp_path / "repacked"
    monkeypatch.setattr(repack_cache, "cache_dir", lambda: str(directory))
    return directory


def _same(a: quantized.QuantizedWeight, b: quantized.QuantizedWeight) -> bool:
    return (a.bits, a.in_features, a.source_type) == (b.bits, b.in_features, b.source_type) and all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in ((a.qs, b.qs), (a.d, b.d), (a.m, b.m)))


def test_saved_weights_load_back_bit_for_bit(cache_dir, tmp_path):
    rng = np.random.default_rng(0)
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    weights = {}
    for name, type_name, rows in (("four", "Q4_K", 3), ("eight", "Q8_0", 5), ("sixteen", "Q6_K", 2)):
        block_bytes = {"Q4_K": 144, "Q8_0": 34 * 8, "Q6_K": 210}[type_name]
        raw = rng.integers(0, 256, (rows, block_bytes), dtype=np.uint8)
        weights[name] = quantized.from_gguf_blocks(type_name, raw, 256)
    path = repack_cache.cache_path(str(source))
    repack_cache.save(path, weights, str(source))
    loaded = repack_cache.load(path)
    assert set(loaded) == set(weights) and {w.bits for w in loaded.values()} == {4, 8, 16}
    assert all(_same(weights[name], loaded[name]) for name in weights)


def test_other_versions_garbage_and_truncated_files_are_ignored(cache_dir, tmp_path, monkeypatch):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    path = repack_cache.cache_path(str(source))
    weight = quantized.from_gguf_blocks("Q8_0", np.zeros((1, 34), np.uint8), 32)
    repack_cache.save(path, {"w": weight}, str(source))
    monkeypatch.setattr(repack_cache, "LAYOUT_VERSION", repack_cache.LAYOUT_VERSION + 1)
    assert repack_cache.load(path) is None
    with open(path, "wb") as f:
        f.write(b"not a cache file")
    assert repack_cache.load(path) is None
    monkeypatch.setattr(repack_cache, "LAYOUT_VERSION", repack_cache.LAYOUT_VERSION - 1)
    repack_cache.save(path, {"w": weight}, str(source))
    os.truncate(path, os.path.getsize(path) - 8)  # the header promises bytes the file lacks
    assert repack_cache.load(path) is None


def test_entries_of_changed_or_deleted_files_are_evicted(cache_dir, tmp_path):
    weight = quantized.from_gguf_blocks("Q8_0", np.zeros((1, 34), np.uint8), 32)
    kept, changed, deleted = (tmp_path / f"{n}.gguf" for n in ("kept", "changed", "deleted"))
    paths = {}
    for source in (kept, changed, deleted):
        source.write_bytes(b"GGUF")
        paths[source] = repack_cache.cache_path(str(source))
        repack_cache.save(paths[source], {"w": weight}, str(source))
    changed.write_bytes(b"GGUF but longer")
    deleted.unlink()
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    repack_cache.save(repack_cache.cache_path(str(other)), {"w": weight}, str(other))
    assert os.path.exists(paths[kept])
    assert not os.path.exists(paths[changed]) and not os.path.exists(paths[deleted])
    assert repack_cache.cache_path(str(changed)) != paths[changed]  # a changed file has a new key


@pytest.mark.parametrize("family,qtype", [("qwen2", QType.Q4_0), ("llama", QType.Q8_0)])
def test_second_load_maps_the_cache_and_computes_the_same_logits(cache_dir, tmp_path, monkeypatch, family, qtype):
    hf = load_hf(save_tiny_model(family, tmp_path / "hf"))
    path = str(tmp_path / "tiny.gguf")
    write_gguf(hf, path, qtype)
    config = ModelConfig.from_path(path)
    generator = torch.Generator().manual_seed(0)
    sequences = {f"r{i}": torch.randint(3, VOCAB, (n,), generator=generator).tolist() for i, n in enumerate([9, 14])}
    prompt_lens = {"r0": 5, "r1": 8}

    def logits(model):
        return run_teacher_forced(PagedRunner(model), sequences, prompt_lens, chunk=4)

    # int16 activations: the types are repacked for the older kernel (the stored-block kernels take
    # int8 only; test_stored_loading.py covers their cache).
    repacked = KernelConfig(quant_act_bits=16)
    uncached = logits(load_model(config, kernel_config=KernelConfig(quant_act_bits=16, repack_cache=False)))
    assert not cache_dir.exists()
    first = load_model(config, kernel_config=repacked)  # repacks, saves, then holds the mapped copy
    assert [n for n in os.listdir(cache_dir) if n.endswith(".kvq")]
    first_logits = logits(first)

    def no_repacking(*args, **kwargs):
        raise AssertionError("the cached load read GGUF blocks")
    monkeypatch.setattr(quantized, "from_gguf_blocks", no_repacking)
    second = load_model(config, kernel_config=repacked)
    qkv = second.layers[0].self_attn.qkv_proj
    assert qkv.quant_weight is not None and qkv.weight is None
    assert _same(qkv.quant_weight, first.layers[0].self_attn.qkv_proj.quant_weight)
    if family == "qwen2":  # the biases are not cached: they come from the file
        assert qkv.bias is not None and torch.equal(qkv.bias, first.layers[0].self_attn.qkv_proj.bias)
    # Same weight bytes, same kernels: the very same logits.
    second_logits = logits(second)
    for req_id in sequences:
        assert torch.equal(first_logits[req_id], uncached[req_id])
        assert torch.equal(second_logits[req_id], uncached[req_id])


def _present_pages(tensor: torch.Tensor) -> list[bool]:
    """Whether each page under `tensor` is mapped into this process now (/proc/self/pagemap bit 63)."""
    import mmap
    page = mmap.PAGESIZE
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    first, last = start // page, (end - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), dtype="<u8")
    return [bool(entry >> np.uint64(63)) for entry in entries]


def test_experts_are_paged_in_only_when_read(cache_dir, tmp_path):
    """A mapped cache populates every weight but a mixture of experts' experts at load; an expert's
    pages come in when it is first read, and an expert never read stays out. Experts of 256 KiB
    (64 pages): a fault maps the neighbouring pages already cached within its aligned 16-page
    window too (Linux's fault-around, populating included), so only each expert's pages past its
    first and last 16 are checked."""
    if not os.access("/proc/self/pagemap", os.R_OK):
        pytest.skip("/proc/self/pagemap is not readable here")
    rng = np.random.default_rng(1)
    source = tmp_path / "moe.gguf"
    source.write_bytes(b"GGUF")

    def q8_weight(rows: int):
        return quantized.from_gguf_blocks("Q8_0", rng.integers(0, 256, (rows, 34 * 32), dtype=np.uint8), 1024)

    names = ["layers.0.self_attn.qkv_proj"] + [f"layers.0.mlp.experts.{e}.gate_up_proj" for e in range(4)]
    path = repack_cache.cache_path(str(source))
    repack_cache.save(path, {name: q8_weight(256) for name in names}, str(source))
    loaded = repack_cache.load(path)
    assert all(_present_pages(loaded[names[0]].qs)), "a dense weight is populated at load"
    for name in names[1:]:
        assert not any(_present_pages(loaded[name].qs)[16:-16]), f"{name} paged in before any read"
    assert int(loaded[names[2]].qs.sum()) >= 0  # read expert 1 whole
    assert all(_present_pages(loaded[names[2]].qs))
    assert not any(_present_pages(loaded[names[4]].qs)[16:-16]), "an expert never read was paged in"
