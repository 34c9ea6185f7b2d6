"""Sharded loading: each rank reads only its slice of the checkpoint (safetensors
`get_slice`, GGUF rows before dequantizing) and ends up with exactly the weights
it would keep after reading the whole checkpoint. No process group is needed to
build and load one rank's model, so tp_size 4 (KV heads replicated) runs here too.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tp_helpers import save_tiny_model
from kvserve.model.config import ModelConfig
from kvserve.model.decoder import DecoderModel
from kvserve.model.loader import iter_safetensors, load_model, load_weights, shard_selector

gguf = pytest.importorskip("gguf")
from helpers.gguf_writer import write_gguf  # noqa: E402


def _write_gguf(hf_dir: str, path: str) -> str:
    """The tiny Llama as llama.cpp lays it out: Q/K rows permuted per head, matrices Q8_0."""
    import transformers
    write_gguf(transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32), path,
               gguf.GGMLQuantizationType.Q8_0)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_loading")
    hf_dir = save_tiny_model("llama_gqa", root / "hf")
    return {"safetensors": hf_dir, "gguf": _write_gguf(hf_dir, str(root / "tiny.gguf"))}


def _full_read_shard(config: ModelConfig, rank: int, tp_size: int) -> DecoderModel:
    """The rank's model from whole checkpoint tensors, sliced by the layers themselves."""
    model = DecoderModel(config, rank, tp_size)
    if config.is_gguf:
        from kvserve.model.gguf_loader import iter_gguf_tensors
        tensors = ((name, torch.from_numpy(np.ascontiguousarray(array)))
                   for name, array in iter_gguf_tensors(config.path, config.num_heads, config.num_kv_heads))
    else:
        tensors = iter_safetensors(config.path)
    load_weights(model, tensors)
    return model


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_each_rank_reads_only_its_shard(checkpoints, source, tp_size):
    config = ModelConfig.from_path(checkpoints[source], quantization="none")
    for rank in range(tp_size):
        sharded = load_model(config, tp_rank=rank, tp_size=tp_size).state_dict()
        expected = _full_read_shard(config, rank, tp_size).state_dict()
        assert sharded.keys() == expected.keys()
        for name, tensor in expected.items():
            torch.testing.assert_close(sharded[name], tensor, rtol=0, atol=0, msg=name)
    # KV heads: 2 over 4 ranks means one head per rank, each head on two ranks.
    model = DecoderModel(config, 0, tp_size)
    assert model.layers[0].self_attn.num_kv_heads == max(1, config.num_kv_heads // tp_size)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_each_rank_holds_its_shard_quantized(checkpoints, tp_size):
    """With quantization auto each rank holds (as stored, or repacked) only its rows / its
    block-aligned columns of the Q8_0 matrices: they dequantize to exactly the float shard the rank would keep
    (column shards narrower than a block are dequantized instead)."""
    from kvserve.model import quantized
    if quantized.kernel_isa() is None:
        pytest.skip("no native kernels")
    plain_config = ModelConfig.from_path(checkpoints["gguf"], quantization="none")
    config = ModelConfig.from_path(checkpoints["gguf"])
    for rank in range(tp_size):
        held = load_model(config, tp_rank=rank, tp_size=tp_size)
        expected = dict(_full_read_shard(plain_config, rank, tp_size).named_modules())
        count = 0
        for name, module in held.named_modules():
            if name == "lm_head" or not hasattr(module, "quant_weight"):
                continue
            if module.quant_weight is None:  # a column shard that cuts blocks: dequantized instead
                torch.testing.assert_close(module.weight, expected[name].weight, rtol=0, atol=0, msg=name)
                continue
            count += 1
            assert module.weight is None
            torch.testing.assert_close(module.quant_weight.dequantize(), expected[name].weight,
                                       rtol=0, atol=0, msg=name)
        assert count >= (4 if tp_size == 2 else 3) * config.num_layers


def test_sharded_safetensors_reads_a_fraction_of_the_bytes(checkpoints):
    config = ModelConfig.from_path(checkpoints["safetensors"])
    whole = sum(t.numel() for _, t in iter_safetensors(config.path))
    select = shard_selector(DecoderModel(config, 1, 2))
    shard = sum(t.numel() for _, t in iter_safetensors(config.path, select))
    # Everything but the norms is split in two.
    assert shard < 0.51 * whole
