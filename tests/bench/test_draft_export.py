"""The draft cut from the target itself (kvserve/bench/draft_export.py, `bench spec
--draft-layers`): the kept layers' weights exactly, renumbered; everything else as stored."""
from __future__ import annotations

import pytest
import torch
import transformers

from kvserve.bench.draft_export import kept_layers, write_truncated_gguf
from kvserve.bench.spec import _draft_config
from kvserve.native.config import QUANT_ACT_BITS_ENV
from kvserve.model.config import ModelConfig
from kvserve.model.loader import load_model
from helpers.tiny_models import tiny_llama_config
from worker.engine_helpers import greedy_params, make_engine, run_checked

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QType  # noqa: E402
from helpers.gguf_writer import write_gguf  # noqa: E402

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A four-layer tiny Llama stored as Q8_0."""
    config = tiny_llama_config(vocab_size=256)
    config.num_hidden_layers = NUM_LAYERS
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("source") / "tiny-q8_0.gguf")
    write_gguf(transformers.LlamaForCausalLM(config).eval(), path, QType.Q8_0)
    return path


def _weights(path: str) -> dict[str, torch.Tensor]:
    return load_model(ModelConfig.from_path(path, dtype="float32", quantization="none")).state_dict()


def test_kept_layers_are_the_first_ones_and_the_last_two():
    assert kept_layers(30, 26) == list(range(24)) + [28, 29]
    assert kept_layers(4, 4) == [0, 1, 2, 3]
    for bad in (1, 5):
        with pytest.raises(ValueError, match="keeps 2 to 4 layers"):
            kept_layers(4, bad)


def test_truncated_draft_holds_the_kept_layers_renumbered(source, tmp_path):
    path = write_truncated_gguf(source, 3, str(tmp_path))
    assert ModelConfig.from_path(path).num_layers == 3
    ours, draft = _weights(source), _weights(path)
    renamed = {}
    for name, tensor in ours.items():
        parts = name.split(".")
        layer = next((int(p) for p in parts if p.isdigit()), None)
        if layer is None:
            renamed[name] = tensor
        elif layer in (0, 2, 3):
            renamed[name.replace(f".{layer}.", f".{[0, 2, 3].index(layer)}.", 1)] = tensor
    assert renamed.keys() == draft.keys()
    for name, tensor in draft.items():
        assert torch.equal(tensor, renamed[name]), name
    reader, written = gguf.GGUFReader(source), gguf.GGUFReader(path)
    assert {t.tensor_type for t in written.tensors if len(t.shape) > 1} == {QType.Q8_0}
    fields = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    written_fields = {name: f.contents() for name, f in written.fields.items() if not name.startswith("GGUF.")}
    assert written_fields.pop("llama.block_count") == 3
    fields.pop("llama.block_count")
    assert written_fields == fields


def test_full_depth_draft_is_accepted_every_time(source, tmp_path, monkeypatch):
    """Kept whole, the cut draft is the target: greedy drafts all accepted, outputs unchanged.

    Activations are held at 16 bits: there a row's logits do not depend on how many rows its
    step has, while the 8-bit default computes one-row steps with their own kernel, so draft
    and target steps of different row counts can round a near tie differently."""
    monkeypatch.setenv(QUANT_ACT_BITS_ENV, "16")
    config = _draft_config('{"num_speculative_tokens": 3, "min_acceptance_rate": 0.0}', source, NUM_LAYERS,
                           str(tmp_path))
    assert config["method"] == "draft_model" and config["num_speculative_tokens"] == 3
    prompts = [[5, 9, 13, 40, 41, 7, 7, 3], [100, 3, 200, 5]]
    expected, _ = run_checked(make_engine(source), prompts, greedy_params(20))
    got, stats = run_checked(make_engine(source, speculative_config=config), prompts, greedy_params(20))
    assert got == expected
    spec = stats.spec_decoding_stats
    assert spec.num_drafts > 5 and spec.num_accepted_tokens == spec.num_draft_tokens
