"""kvserve: an LLM inference and serving engine with a paged KV cache.

`LLM` and `SamplingParams` are the offline API; `LLM` is imported lazily so
that `kvserve.kv_cache` and `kvserve.scheduler` stay importable without torch.
"""
from kvserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from kvserve.engine.llm import LLM
        return LLM
    raise AttributeError(name)
