"""safetensors loading: sharded checkpoints with an index, half-precision files
cast to the requested dtype, tied embeddings, missing weights."""
from __future__ import annotations

import os

import pytest
import torch
import transformers

from kvserve.model.config import ModelConfig, ModelFilesNotFoundError
from kvserve.model.loader import load_model
from paged_kv_helper import VOCAB, PagedRunner, run_greedy, tiny_hf_config


def _save(tmp_path, family: str, dtype: torch.dtype, **save_kwargs):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(family), attn_implementation="eager")
    model.to(dtype).save_pretrained(str(tmp_path), **save_kwargs)
    return str(tmp_path)


@pytest.mark.parametrize("family,file_dtype", [("llama", torch.bfloat16), ("qwen2", torch.float16)])
def test_sharded_half_precision_checkpoint_loads_as_float32(tmp_path, family, file_dtype):
    path = _save(tmp_path, family, file_dtype, max_shard_size="50KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    ours = load_model(ModelConfig.from_path(path, dtype="float32"))
    assert ours.embed_tokens.weight.dtype == torch.float32
    ids = torch.randint(3, VOCAB, (17,), generator=torch.Generator().manual_seed(1)).tolist()
    _, logits = run_greedy(PagedRunner(ours), {"r": ids}, 1, chunk=64)
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0, -1]
    assert (logits["r"][0] - expected).abs().max() < 1e-4
    if ours.config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.embed_tokens.weight


def test_missing_weights_are_reported(tmp_path):
    tiny_hf_config("llama").save_pretrained(str(tmp_path))
    config = ModelConfig.from_path(str(tmp_path))
    with pytest.raises(ModelFilesNotFoundError, match="safetensors"):
        load_model(config)
