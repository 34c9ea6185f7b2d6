"""The Gated DeltaNet token mixer of Qwen3-Next and Qwen3.5 over a flat batch of requests,
each reading and writing its fixed-size state through a state KV-cache group.

Per token: one projection gives q, k, v (key heads Hk of size Dk, value heads Hv of Dv) and
the output gate z, another the write strength b and the decay input a per value head;
q, k, v pass through the short causal convolution (SiLU); q and k are L2-normalized and q
scaled by Dk^-1/2; each key head serves Hv / Hk consecutive value heads; beta = sigmoid(b),
g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule (`gated_delta`) gives each
value head's output, which an RMSNorm gated by SiLU(z) normalizes before the output projection.

State of a request, per layer (`StateSpec.shapes`): the convolution's last inputs
[K - 1, 2 Hk Dk + Hv Dv] and the delta rule's state [Hv, Dk, Dv], both float32 whatever the
model's dtype: a state sums the whole sequence, and rounding it to 16 bits every token would
compound. The step's `StateMetadata` says which slot each request starts from (-1: zeros)
and after which of its tokens to store the state into which slot.

Weights are held in one layout for both families: `in_proj_qkvz` rows [q | k | v | z] (value
heads in order) and `in_proj_ba` rows [b | a]; the loader reorders Qwen3-Next's rows, grouped
by key head, into it (`split_checkpoint_tensor`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.config import ModelConfig
from kvserve.model.linear_attention.causal_conv import causal_conv1d, state_after
from kvserve.model.linear_attention.gated_delta import gated_delta_chunked, gated_delta_step
from kvserve.model.attention.metadata import StateMetadata
from kvserve.model.parallel import ColumnParallelLinear, RowParallelLinear, TPContext
from kvserve.native import cpu_kernels, dispatch
from kvserve.model.state_layers import StateMixer, read_states, register_state_layer

STATE_DTYPE = torch.float32
_L2_EPS = 1e-6  # inside the square root, as Qwen3-Next's reference


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head (weight w, not 1 + w), times SiLU of the gate z, in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


@register_state_layer("linear_attention", "linear_attn")
class GatedDeltaNet(StateMixer):
    """One Gated DeltaNet layer (see the module docstring)."""

    state_dtype = STATE_DTYPE

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPContext) -> None:
        super().__init__()
        if tp.size > 1:
            raise ValueError(f"{config.architecture}: Gated DeltaNet layers under tensor parallelism are not "
                             "supported yet")
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.conv_width = config.linear_conv_kernel_dim
        key_dim, value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.split_sizes = [key_dim, key_dim, value_dim, value_dim]
        self.conv_dim = 2 * key_dim + value_dim
        self.in_proj_qkvz = ColumnParallelLinear(config.hidden_size, self.split_sizes, False, tp,
                                                 shard_names=["q", "k", "v", "z"])
        self.in_proj_ba = ColumnParallelLinear(config.hidden_size, [self.num_v_heads] * 2, False, tp,
                                               shard_names=["b", "a"])
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(self.conv_dim, 1, self.conv_width), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_dim, config.hidden_size, False, tp)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """One request's state tensors: the convolution's inputs and the delta rule's state."""
        return (self.conv_width - 1, self.conv_dim), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def checkpoint_weight_names(self, prefix: str) -> list[str]:
        """The fused projections' parts, then the rest."""
        return ([f"{prefix}.in_proj_qkvz.weight:{part}" for part in "qkvz"]
                + [f"{prefix}.in_proj_ba.weight:{part}" for part in "ba"]
                + [f"{prefix}.{name}" for name in ("conv1d.weight", "dt_bias", "A_log", "norm.weight",
                                                    "out_proj.weight")])

    def forward(self, hidden: torch.Tensor, metadata: StateMetadata,
                state_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """hidden [T, hidden] of the step's requests (`metadata`: a `StateMetadata`) -> [T, hidden];
        `state_cache`: the layer's (conv, recurrent) slots [num_blocks, *shape], read at
        `read_slot` and written at `write_slot` as the metadata says."""
        conv_cache, delta_cache = state_cache
        starts = metadata.query_start_loc.tolist()
        read = metadata.read_slot
        q, k, v, z = self.in_proj_qkvz(hidden).split(self.split_sizes, dim=-1)
        b, a = self.in_proj_ba(hidden).split(self.num_v_heads, dim=-1)
        mixed, padded = causal_conv1d(torch.cat((q, k, v), dim=-1), self.conv1d.weight[:, 0],
                                      read_states(conv_cache, read), starts)
        q, k, v = self._heads(mixed)
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out, delta_states = self._delta_rule(q, k, v, g, beta, delta_cache, metadata, starts)
        self._write_states(metadata, padded, delta_states, conv_cache, delta_cache, starts)
        out = self.norm(out.to(hidden.dtype), z.reshape(-1, self.num_v_heads, self.head_v_dim))
        return self.out_proj(out.reshape(hidden.shape[0], -1))

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolved q, k [T, Hk, Dk] and v [T, Hv, Dv] in float32: q, k L2-normalized (q
        also scaled by Dk^-1/2)."""
        tokens = mixed.shape[0]
        q, k, v = mixed.float().split(self.split_sizes[:3], dim=-1)
        q = q.reshape(tokens, self.num_k_heads, self.head_k_dim)
        k = k.reshape(tokens, self.num_k_heads, self.head_k_dim)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + _L2_EPS) * self.head_k_dim ** -0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + _L2_EPS)
        return q, k, v.reshape(tokens, self.num_v_heads, self.head_v_dim)

    def _per_value_head(self, x: torch.Tensor) -> torch.Tensor:
        """q or k [T, Hk, Dk] repeated to [T, Hv, Dk]: each key head serves Hv / Hk value heads."""
        group = self.num_v_heads // self.num_k_heads
        return x.repeat_interleave(group, dim=1) if group > 1 else x

    def _delta_rule(self, q, k, v, g, beta, delta_cache: torch.Tensor, metadata: StateMetadata,
                    starts: list[int]) -> tuple[torch.Tensor, dict[tuple[int, int], torch.Tensor | int]]:
        """Outputs [T, Hv, Dv] float32 and the states the metadata writes, by (request, count):
        one-token requests in one batched recurrent step (the C kernel under native ops, which
        writes the state into the request's first write slot itself: its entry is that slot),
        longer ones in chunks."""
        writes: dict[int, list[tuple[int, int]]] = {}
        for req, after, slot in zip(*(t.tolist() for t in (metadata.write_req, metadata.write_after,
                                                           metadata.write_slot))):
            writes.setdefault(req, []).append((after, slot))
        out = torch.empty(q.shape[0], self.num_v_heads, self.head_v_dim, dtype=torch.float32, device=q.device)
        snapshots: dict[tuple[int, int], torch.Tensor | int] = {}
        lens = [starts[r + 1] - starts[r] for r in range(len(starts) - 1)]
        single = [r for r, n in enumerate(lens) if n == 1]
        if single:
            rows = torch.tensor([starts[r] for r in single], device=q.device)
            read = metadata.read_slot[single]
            if self._native_step(delta_cache):
                first = [writes[r][0][1] for r in single]
                out[rows] = cpu_kernels.gated_delta_step(q[rows], k[rows], v[rows], g[rows], beta[rows], delta_cache,
                                                         read, torch.tensor(first), dispatch.widest("gated_delta"))
                snapshots.update({(r, 1): slot for r, slot in zip(single, first)})
            else:
                step_out, step_states = gated_delta_step(
                    self._per_value_head(q[rows]), self._per_value_head(k[rows]), v[rows], g[rows], beta[rows],
                    read_states(delta_cache, read))
                out[rows] = step_out
                snapshots.update({(r, 1): step_states[i] for i, r in enumerate(single)})
        for r, n in enumerate(lens):
            if n <= 1:
                continue
            counts = [after for after, _ in writes.get(r, [])]
            rows = slice(starts[r], starts[r + 1])
            out[rows], kept = gated_delta_chunked(
                self._per_value_head(q[rows]), self._per_value_head(k[rows]), v[rows], g[rows], beta[rows],
                read_states(delta_cache, metadata.read_slot[r:r + 1])[0], counts)
            snapshots.update({(r, count): state for count, state in zip(counts, kept)})
        return out, snapshots

    def _native_step(self, delta_cache: torch.Tensor) -> bool:
        return (self.native and delta_cache.device.type == "cpu" and delta_cache.dtype == torch.float32
                and delta_cache.is_contiguous() and cpu_kernels.load_library() is not None)

    def _write_states(self, metadata, padded: torch.Tensor, delta_states: dict[tuple[int, int], torch.Tensor | int],
                      conv_cache: torch.Tensor, delta_cache: torch.Tensor, starts: list[int]) -> None:
        """Every write of the metadata: the conv inputs, and the delta-rule state (a slot number
        in `delta_states`: already in the cache there, copied unless that is the target)."""
        writes = zip(metadata.write_req.tolist(), metadata.write_after.tolist(), metadata.write_slot.tolist())
        for req, after, slot in writes:
            conv_cache[slot] = state_after(padded, starts, req, after, self.conv_width)
            state = delta_states[(req, after)]
            if isinstance(state, int):
                if state != slot:
                    delta_cache[slot] = delta_cache[state]
            else:
                delta_cache[slot] = state


def split_checkpoint_tensor(name: str, tensor: torch.Tensor, config: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint's Gated DeltaNet projection as the parts `GatedDeltaNet` loads (names ending
    in .in_proj_{q,k,v,z,b,a}.weight); any other tensor as it is. Qwen3-Next groups
    `in_proj_qkvz`'s rows by key head ([q, k, v, z] of each, v and z for its value heads) and
    `in_proj_ba`'s likewise ([b, a]); Qwen3.5 stores [q | k | v] in `in_proj_qkv`, and z, b, a
    apart."""
    prefix, _, leaf = name.rpartition(".in_proj_")
    if not prefix or leaf not in ("qkvz.weight", "ba.weight", "qkv.weight"):
        return [(name, tensor)]
    heads, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    group = config.linear_num_value_heads // heads
    if leaf == "qkv.weight":
        parts = dict(zip("qkv", tensor.split([heads * dk, heads * dk, heads * group * dv])))
    elif leaf == "qkvz.weight":
        grouped = tensor.reshape(heads, 2 * dk + 2 * group * dv, -1)
        pieces = grouped.split([dk, dk, group * dv, group * dv], dim=1)
        parts = {kind: piece.reshape(-1, tensor.shape[-1]) for kind, piece in zip("qkvz", pieces)}
    else:
        pieces = tensor.reshape(heads, 2 * group, -1).split(group, dim=1)
        parts = {kind: piece.reshape(-1, tensor.shape[-1]) for kind, piece in zip("ba", pieces)}
    return [(f"{prefix}.in_proj_{kind}.weight", part) for kind, part in parts.items()]
