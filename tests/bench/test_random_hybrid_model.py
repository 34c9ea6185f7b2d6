"""`python3 -m kvserve.bench.random_model --hybrid`: the Qwen3.5-shaped hybrid the prefix
benchmark of recurrent-state groups runs on (docs/benchmarks.md)."""
import pytest


@pytest.mark.slow
def test_random_hybrid_model_has_state_and_attention_layers(tmp_path):
    from kvserve.bench.random_model import main
    from kvserve.model.config import ModelConfig

    assert main(["--output-dir", str(tmp_path / "m"), "--num-layers", "4", "--hybrid"]) == 0
    config = ModelConfig.from_path(str(tmp_path / "m"))
    assert config.architecture == "Qwen3_5ForCausalLM"
    assert config.layer_types == ["linear_attention"] * 3 + ["full"]
    assert (tmp_path / "m" / "tokenizer.json").exists()
