"""A tiny random-weight hybrid model with the test-only recurrent layer kind
(`kvserve.model.toy_recurrent`), its independent reference forward, and an
EngineCore that runs it (no checkpoint: the runner builds the model in memory).

The reference runs each sequence whole: the toy layers token by token
(`ToyRecurrentMixer.reference`), the attention layers as one causal (windowed)
softmax over the sequence, with no KV cache, paging, chunking or state slots.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from kvserve.engine.core import EngineCore
from kvserve.model.config import ModelConfig
from kvserve.model.decoder import DecoderModel
from kvserve.model.kernels import ModelKernels
from kvserve.model.layers import apply_rotary
from kvserve.worker import model_runner

VOCAB_SIZE = 128
WINDOW = 8
# full + sliding + state: three KV-cache groups.
HYBRID_LAYERS = ["toy_recurrent", "full", "toy_recurrent", "sliding"]


def toy_model_config(layer_types: list[str] = HYBRID_LAYERS, max_model_len: int = 512) -> ModelConfig:
    return ModelConfig(path="", is_gguf=False, architecture="ToyRecurrentTestModel", model_type="llama",
                       family="llama", num_layers=len(layer_types), hidden_size=32, intermediate_size=64,
                       num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=VOCAB_SIZE,
                       max_position_embeddings=max_model_len, max_model_len=max_model_len,
                       layer_types=list(layer_types), sliding_window=WINDOW if "sliding" in layer_types else None)


@torch.no_grad()
def build_toy_model(config: ModelConfig, seed: int = 0) -> DecoderModel:
    """Random weights, large enough that greedy tokens vary and logits are well apart."""
    generator = torch.Generator().manual_seed(seed)
    model = DecoderModel(config)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * noise)
        elif name.endswith("decay_logit"):
            param.copy_(noise)
        elif name.endswith("conv_weight"):
            param.copy_(0.5 * noise)
        else:
            param.copy_(0.3 * noise)
    model.use_kernels(ModelKernels.torch_only())
    return model.eval()


@torch.inference_mode()
def reference_logits(model: DecoderModel, token_ids: list[int]) -> torch.Tensor:
    """[L, vocab] float32 logits of one whole sequence (see the module docstring)."""
    positions = torch.arange(len(token_ids))
    hidden = model.embed(torch.tensor(token_ids))
    cos_sin = model.rotary_global.cos_sin(positions, hidden.dtype, len(token_ids))
    for layer in model.layers:
        x = layer.input_layernorm(hidden)
        if layer.is_state_layer:
            mixed = layer.mixer.reference(x)
        else:
            mixed = _attention_reference(layer.self_attn, x, cos_sin)
        hidden = hidden + mixed
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.compute_logits(model.norm(hidden))


def _attention_reference(attn, x: torch.Tensor, cos_sin) -> torch.Tensor:
    length = len(x)
    q, k, v = attn.qkv_proj(x).split(attn.qkv_proj.shard_sizes, dim=-1)
    q = apply_rotary(q.reshape(length, attn.num_heads, attn.head_dim), *cos_sin)
    k = apply_rotary(k.reshape(length, attn.num_kv_heads, attn.head_dim), *cos_sin)
    v = v.reshape(length, attn.num_kv_heads, attn.head_dim)
    repeat = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    lag = torch.arange(length)[:, None] - torch.arange(length)[None, :]
    allowed = (lag >= 0) & ((lag < attn.sliding_window) if attn.sliding_window else True)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=allowed, scale=attn.params.scale)
    return attn.o_proj(out.transpose(0, 1).reshape(length, -1))


def make_toy_engine(monkeypatch, executor_class, layer_types: list[str] = HYBRID_LAYERS, *, seed: int = 0,
                    num_blocks_memory: str | int = 1 << 20, block_size: int = 4, max_num_seqs: int = 8,
                    max_num_batched_tokens: int = 256, enable_prefix_caching: bool = True,
                    async_scheduling: bool = True, max_model_len: int = 512,
                    speculative_config=None) -> EngineCore:
    """An EngineCore over the toy model (built in memory by the runner instead of loaded)."""
    config = toy_model_config(layer_types, max_model_len)
    monkeypatch.setattr(model_runner, "load_model", lambda model_config, **kwargs: build_toy_model(model_config, seed))
    engine_config = EngineConfig(
        config,
        CacheConfig(block_size=block_size, kv_cache_memory_bytes=int(num_blocks_memory),
                    enable_prefix_caching=enable_prefix_caching),
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len, async_scheduling=async_scheduling,
                        speculative_config=speculative_config),
        ParallelConfig(), device="cpu")
    return EngineCore(engine_config, executor_class=executor_class)


class ToyReference:
    """The reference forward behind the interface `helpers.greedy_check` calls
    (`model(ids).logits`), for teacher-forced greedy checks."""

    def __init__(self, model: DecoderModel) -> None:
        self.model = model

    def __call__(self, input_ids: torch.Tensor):
        return _Logits(reference_logits(self.model, input_ids[0].tolist())[None])


class _Logits:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


def state_group_hit_blocks(core: EngineCore) -> list[int]:
    """Snapshots restored by prefix hits, per state group of the engine's KV cache."""
    from kvserve.kv_cache.single_type_manager import StateManager
    return [m.num_hit_blocks for m in core.scheduler.kv_cache_manager.coordinator.single_type_managers
            if isinstance(m, StateManager)]
