"""Recurrent-state token mixers (Gated DeltaNet, Mamba-2, the test-only toy): the
contract a state layer keeps with the decoder and the runner, and their registry.

A decoder layer whose `ModelConfig.layer_types` entry is a registered state layer
type runs that mixer in place of self-attention, under the module name the
registry gives (its checkpoint prefix, e.g. `linear_attn`). Its KV-cache spec is a
`StateSpec` with the shapes the mixer reports; the runner hands it a tuple of
tensors `[num_blocks, *shape]` (slot id = block id, zero-initialised) and the
`StateMetadata` of its group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.model.attention.metadata import StateMetadata


class StateMixer(nn.Module):
    """A token mixer with a fixed-size recurrent state per request.

    Subclasses take `(config: ModelConfig, layer_idx: int, tp: TPContext)`, report
    `state_shapes` (one layer's state tensors, without the slot dimension) and
    `state_dtype` (None: the model's dtype), and implement `forward`."""

    state_dtype: torch.dtype | None = None
    native: bool = False  # the mixer's C kernels allowed (`DecoderModel.use_kernels`: the runner's choice)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor, metadata: StateMetadata,
                state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] for the step's flat batch; reads each request's state
        from `metadata.read_slot` (zeros at -1) before any write, then stores the states
        `metadata` asks for (see `read_states`, `StateMetadata.write_token_index`)."""
        raise NotImplementedError

    def checkpoint_weight_names(self, prefix: str) -> list[str]:
        """The loaded names (as `loader.load_weights` records them) a checkpoint must
        supply for this mixer under module `prefix`: every parameter by default."""
        return [f"{prefix}.{name}" for name, _ in self.named_parameters()]


@dataclass(frozen=True)
class StateLayerKind:
    """How a state layer type is built: its mixer class and its module name in a layer."""

    module_name: str
    mixer_class: type[StateMixer]


STATE_LAYER_KINDS: dict[str, StateLayerKind] = {}


def register_state_layer(layer_type: str, module_name: str):
    """Class decorator: `layer_type` layers run this mixer as `layers.{i}.{module_name}`."""
    def register(mixer_class: type[StateMixer]) -> type[StateMixer]:
        STATE_LAYER_KINDS[layer_type] = StateLayerKind(module_name, mixer_class)
        return mixer_class
    return register


def read_states(cache: torch.Tensor, read_slot: torch.Tensor) -> torch.Tensor:
    """[B, *shape]: a copy of each request's state slot, zeros where `read_slot` is -1."""
    states = cache[read_slot.clamp(min=0)]
    fresh = (read_slot < 0).view(-1, *([1] * (cache.dim() - 1)))
    return torch.where(fresh, torch.zeros((), dtype=cache.dtype, device=cache.device), states)


def write_token_index(metadata: StateMetadata) -> torch.Tensor:
    """[W] flat token index after which each of the step's writes takes the state."""
    return metadata.query_start_loc[metadata.write_req] + metadata.write_after - 1
