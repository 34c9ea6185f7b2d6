"""The Mamba-2 mixer layer of hybrid models (Granite 4): input projection, the conv1d + SSM
kernels (`mamba2`) over each request's state slot, the gated RMSNorm and the output projection.

State: the layer's cache entry is (conv states [slots, K-1, conv_dim], SSM states [slots, H,
P, N]), float32 whatever the model's dtype (a long recurrence accumulates in it). The step's
`StateMetadata` says which slot each request starts from (`read_slot`, -1: zeros) and after
which of its tokens the state is written where (`write_req`, `write_after`, `write_slot`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.native import cpu_kernels, dispatch
from kvserve.model.config import ModelConfig
from kvserve.model.linear_attention import mamba2
from kvserve.model.parallel import ColumnParallelLinear, RowParallelLinear, TPContext
from kvserve.model.state_layers import StateMixer, read_states, register_state_layer


class GatedRMSNorm(nn.Module):
    """weight * groupwise-RMSNorm(y * silu(gate)), in float32, over `num_groups` equal groups."""

    def __init__(self, size: int, num_groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.num_groups = num_groups
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        gated = y.float() * F.silu(gate.float())
        groups = gated.reshape(len(gated), self.num_groups, -1)
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed.reshape(gated.shape)).to(gate.dtype)


class DepthwiseConv(nn.Module):
    """The conv1d's parameters as the checkpoint holds them: weight [conv_dim, 1, K], bias."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(channels), requires_grad=False) if bias else None


@register_state_layer("mamba", "mamba")
class Mamba2Mixer(StateMixer):
    """One Mamba-2 layer: [T, hidden] -> [T, hidden] over the requests' state slots."""

    state_dtype = torch.float32  # whatever the model's dtype: the recurrence accumulates in it

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPContext) -> None:
        super().__init__()
        if tp.size > 1:
            raise ValueError(f"{config.architecture}: Mamba-2 layers under tensor parallelism are not supported yet")
        cfg = config.mamba
        self.shape = mamba2.Mamba2Shape(num_heads=cfg.num_heads, head_dim=cfg.head_dim, state_size=cfg.state_size,
                                        n_groups=cfg.n_groups, conv_kernel=cfg.conv_kernel)
        inner, conv_dim = self.shape.inner_size, self.shape.conv_dim
        # One part: the checkpoint holds gate, conv input and dt fused, and no rank splits them.
        self.in_proj = ColumnParallelLinear(config.hidden_size, [inner + conv_dim + cfg.num_heads], cfg.proj_bias, tp)
        self.conv1d = DepthwiseConv(conv_dim, cfg.conv_kernel, cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(cfg.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(cfg.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.zeros(cfg.num_heads), requires_grad=False)
        self.norm = GatedRMSNorm(inner, cfg.n_groups, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(inner, config.hidden_size, cfg.proj_bias, tp)
        self.dt_range = (cfg.dt_min, cfg.dt_max)
        self.native = False  # the C decode step (`DecoderModel.use_kernels`: the runner's choice)
        self._params: mamba2.Mamba2Params | None = None

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of one slot's (conv state, SSM state)."""
        return self.shape.state_shapes

    def params(self) -> mamba2.Mamba2Params:
        """The SSM parameters in float32, contiguous (as the kernels take them), made once:
        the weights do not change after loading."""
        if self._params is None:
            bias = self.conv1d.bias
            self._params = mamba2.Mamba2Params(
                conv_weight=self.conv1d.weight.float()[:, 0].contiguous(),
                conv_bias=None if bias is None else bias.float().contiguous(), dt_bias=self.dt_bias.float(),
                A=-torch.exp(self.A_log.float()), D=self.D.float(), dt_min=self.dt_range[0], dt_max=self.dt_range[1])
        return self._params

    def forward(self, hidden: torch.Tensor, metadata, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inner, heads = self.shape.inner_size, self.shape.num_heads
        gate, xbc, dt = self.in_proj(hidden).split([inner, self.shape.conv_dim, heads], dim=-1)
        native = self.native and hidden.device.type == "cpu" and all(t.dtype == torch.float32 for t in state)
        y = scan_requests(self.shape, self.params(), xbc, dt, metadata, state, native)
        return self.out_proj(self.norm(y, gate))


def _start_states(state: tuple[torch.Tensor, torch.Tensor], read_slot: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the slots `read_slot` [n] holds, zeros where it is -1."""
    return read_states(state[0], read_slot), read_states(state[1], read_slot)


def _native_decodes(shape: mamba2.Mamba2Shape, params: mamba2.Mamba2Params, xbc: torch.Tensor, dt: torch.Tensor,
                    read_slot: torch.Tensor, writes: list[list[tuple[int, int]]],
                    state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The C step for one-token requests (rows of xbc/dt), each reading `read_slot` and writing
    its first write's slot; its other writes (a snapshot at a block boundary) copied from there."""
    first = torch.tensor([req_writes[0][1] for req_writes in writes], device=xbc.device)
    y = cpu_kernels.mamba2_decode_step(xbc.float().contiguous(), dt.float().contiguous(), state[0], state[1],
                                       read_slot, first, params.conv_weight, params.conv_bias, params.dt_bias,
                                       params.A, params.D, (params.dt_min, params.dt_max), shape.n_groups,
                                       isa=dispatch.widest("mamba2"))
    extra = [(primary, slot) for primary, req_writes in zip(first.tolist(), writes) for _, slot in req_writes[1:]]
    if extra:
        sources = torch.tensor([source for source, _ in extra], device=xbc.device)
        slots = torch.tensor([slot for _, slot in extra], device=xbc.device)
        for cache in state:
            cache.index_copy_(0, slots, cache.index_select(0, sources))
    return y


def scan_requests(shape: mamba2.Mamba2Shape, params: mamba2.Mamba2Params, xbc: torch.Tensor, dt: torch.Tensor,
                  metadata, state: tuple[torch.Tensor, torch.Tensor], native: bool = False) -> torch.Tensor:
    """The SSM output [T, H*P] (float32) of a flat batch: one-token requests stepped together
    (with `native`, by the C step), longer ones scanned one by one; every state the metadata asks
    for written to its slot."""
    starts = metadata.query_start_loc.tolist()
    query_lens = [end - start for start, end in zip(starts, starts[1:])]
    writes: dict[int, list[tuple[int, int]]] = {}
    for req, after, slot in zip(metadata.write_req.tolist(), metadata.write_after.tolist(),
                                metadata.write_slot.tolist()):
        writes.setdefault(req, []).append((after, slot))
    read_slot = metadata.read_slot.long()
    y = torch.zeros(len(xbc), shape.inner_size, dtype=torch.float32, device=xbc.device)
    decodes = [req for req, length in enumerate(query_lens) if length == 1]
    if decodes and native and all(writes.get(req) for req in decodes):
        rows = torch.tensor([starts[req] for req in decodes], device=xbc.device)
        reads = read_slot[torch.tensor(decodes, device=xbc.device)]
        y.index_copy_(0, rows, _native_decodes(shape, params, xbc.index_select(0, rows), dt.index_select(0, rows),
                                               reads, [writes[req] for req in decodes], state))
    elif decodes:
        rows = torch.tensor([starts[req] for req in decodes], device=xbc.device)
        conv0, ssm0 = _start_states(state, read_slot[torch.tensor(decodes, device=xbc.device)])
        y_rows, conv1, ssm1 = mamba2.decode_step(shape, params, xbc.index_select(0, rows), dt.index_select(0, rows),
                                                 conv0, ssm0)
        y.index_copy_(0, rows, y_rows)
        index = [(i, slot) for i, req in enumerate(decodes) for _, slot in writes.get(req, [])]
        if index:
            picked = torch.tensor([i for i, _ in index], device=xbc.device)
            slots = torch.tensor([slot for _, slot in index], device=xbc.device)
            state[0].index_copy_(0, slots, conv1.index_select(0, picked).to(state[0].dtype))
            state[1].index_copy_(0, slots, ssm1.index_select(0, picked).to(state[1].dtype))
    for req, length in enumerate(query_lens):
        if length < 2:
            continue
        start = starts[req]
        conv0, ssm0 = _start_states(state, read_slot[req:req + 1])
        req_writes = writes.get(req, [])
        afters = sorted({after for after, _ in req_writes})
        y[start:start + length], convs, ssms = mamba2.prefill(
            shape, params, xbc[start:start + length], dt[start:start + length], conv0[0], ssm0[0], afters)
        if req_writes:
            picked = torch.tensor([afters.index(after) for after, _ in req_writes], device=xbc.device)
            slots = torch.tensor([slot for _, slot in req_writes], device=xbc.device)
            state[0].index_copy_(0, slots, convs.index_select(0, picked).to(state[0].dtype))
            state[1].index_copy_(0, slots, ssms.index_select(0, picked).to(state[1].dtype))
    return y
