"""Model shapes and loading helpers shared by the benchmarks (no kvserve engine needed).

The shapes come from transformers' config reader (a Hugging Face directory or
a `.gguf` file), so the roofline and the reference runners work even before
(or without) kvserve's own model code.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShapes:
    """The dimensions of a Llama-family decoder that set its matmul cost per token."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    def linear_shapes(self) -> list[tuple[str, int, int, int]]:
        """(name, in_features, out_features, how many) for every weight matmul of one token."""
        q_out = self.num_heads * self.head_dim
        kv_out = 2 * self.num_kv_heads * self.head_dim
        return [
            ("qkv_proj", self.hidden_size, q_out + kv_out, self.num_layers),
            ("o_proj", q_out, self.hidden_size, self.num_layers),
            ("gate_up_proj", self.hidden_size, 2 * self.intermediate_size, self.num_layers),
            ("down_proj", self.intermediate_size, self.hidden_size, self.num_layers),
            ("lm_head", self.hidden_size, self.vocab_size, 1),
        ]

    @property
    def matmul_params(self) -> int:
        """Weights read by one decode step (the embedding lookup reads only a row)."""
        return sum(k * n * count for _, k, n, count in self.linear_shapes())

    @property
    def flops_per_token(self) -> int:
        """Matmul FLOPs per token (2 per multiply-add); attention over the context is extra."""
        return 2 * self.matmul_params


def resolve_model_path(model: str | None) -> str:
    """kvserve's own resolution (default GGUF when None), with a clear error when missing."""
    from kvserve.engine.model_path import resolve_model_path as resolve

    return resolve(model)


def split_gguf_path(model_path: str) -> tuple[str, str | None]:
    """(directory, gguf file name or None) as transformers' from_pretrained wants them."""
    if model_path.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(model_path)), os.path.basename(model_path)
    return model_path, None


def model_shapes(model_path: str) -> ModelShapes:
    """The shapes of the model at `model_path` (HF directory or .gguf file), as kvserve reads
    them (`ModelConfig`: every architecture it loads, GGUF included)."""
    from kvserve.model.config import ModelConfig

    config = ModelConfig.from_path(model_path)
    return ModelShapes(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
    )
