"""Building blocks: RMSNorm, rotary embeddings (with the scaling types the
supported families use) and the gated MLP activation."""
from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.native import cpu_kernels
from kvserve.model import workspace
from kvserve.model.config import RopeConfig

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; Gemma's variant scales by (1 + w).

    With `native` set (the runner's kernel choice, see `kvserve.model.kernels`)
    the CPU kernel does it in one pass (`cpu_kernels.rms_norm`); `add_and_norm`
    also folds in the residual add before it."""

    native: bool = False

    def __init__(self, size: int, eps: float, adds_one: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.adds_one = adds_one
        self.weight = nn.Parameter(torch.zeros(size) if adds_one else torch.ones(size), requires_grad=False)
        self._weight32: tuple[tuple, torch.Tensor] | None = None  # (weight's identity, float32 copy)

    def forward(self, x: torch.Tensor, role: str | None = None) -> torch.Tensor:
        """`role`: a many-token step on the native kernel writes the result into that role's
        reused buffer (model/workspace.py), dead by the next request for the role."""
        if self.native and cpu_kernels.takes(x) and x.dtype == self.weight.dtype:
            return cpu_kernels.rms_norm(x, self._float_weight(), self.eps, self.adds_one,
                                        out=workspace.scratch_for(x, role, x.shape[-1]))
        return self._torch_norm(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                     role: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); the sum is written into `residual` in place.
        With no residual yet: (norm(x), x). `role`: as `forward`'s."""
        if residual is None:
            return self(x, role), x
        if (self.native and cpu_kernels.takes(x, residual) and x.dtype == residual.dtype == self.weight.dtype
                and residual.is_contiguous() and x.shape == residual.shape):
            return cpu_kernels.rms_norm(x, self._float_weight(), self.eps, self.adds_one, residual,
                                        out=workspace.scratch_for(x, role, x.shape[-1])), residual
        residual = residual + x
        return self._torch_norm(residual), residual

    def _float_weight(self) -> torch.Tensor:
        identity = (self.weight.data_ptr(), self.weight._version, self.weight.device)
        if self._weight32 is None or self._weight32[0] != identity:
            self._weight32 = (identity, self.weight.detach().float().contiguous())
        return self._weight32[1]

    def _torch_norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.adds_one:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


def activation(name: str):
    """The gate activation of a gated MLP, by its HF name."""
    if name in ("silu", "swish"):
        return F.silu
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"unsupported activation {name!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig, max_pos: int) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings or max_pos
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, rope: RopeConfig, max_pos: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    original = rope.original_max_position_embeddings or max_pos
    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def rope_inv_freq(head_dim: int, rope: RopeConfig, max_pos: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale ("attention factor") of one RoPE config; with
    a partial rotary factor (Qwen3-Next) only the first int(head_dim * factor) dimensions of
    each head rotate, so the frequencies are those of a head of that size."""
    head_dim = int(head_dim * rope.partial_rotary_factor)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, rope, max_pos)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope, max_pos)
    elif rope.rope_type == "dynamic":
        # Dynamic NTK only rescales past the trained length; within it this is exact.
        logger.warning("dynamic RoPE scaling: positions beyond %d use unscaled frequencies", max_pos)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Rotates the two halves of each head (HF layout) by position-dependent angles."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_pos: int) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(head_dim, rope, max_pos)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # float32 cos and sin of positions 0..N-1 ([2, N, head_dim]) for the frequencies
        # `_table_freq`, grown on demand: a step gathers its rows (one op) instead of
        # computing them (about eight).
        self._table: torch.Tensor | None = None
        self._table_freq: torch.Tensor | None = None

    def set_freq_factors(self, factors: torch.Tensor) -> None:
        """llama.cpp's per-frequency divisors (GGUF `rope_freqs`), e.g. Llama-3 scaling."""
        self.inv_freq = self.inv_freq / factors.to(self.inv_freq)

    def table(self, num_positions: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """float32 [2, N, head_dim], contiguous: cos (0) and sin (1) of positions 0..N-1,
        N >= `num_positions`."""
        table, inv_freq = self._table, self.inv_freq
        if (table is None or self._table_freq is not inv_freq or table.shape[1] < num_positions
                or table.device != torch.device(device)):
            table = self._table = self._build_table(inv_freq, max(num_positions, 256), device)
            self._table_freq = inv_freq
        return table

    def cos_sin_rows(self, positions: torch.Tensor, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin [T, head_dim] (contiguous) of `positions` [T] int64, all below
        `num_positions`."""
        table = self.table(num_positions, positions.device)
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def _build_table(self, inv_freq: torch.Tensor, num_positions: int, device: torch.device) -> torch.Tensor:
        size = 1 << (num_positions - 1).bit_length()  # doubling: a long sequence rebuilds it log(n) times
        freqs = torch.arange(size, dtype=torch.float32, device=device)[:, None] * inv_freq.float().to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return torch.stack((emb.cos() * self.attention_factor, emb.sin() * self.attention_factor))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                num_positions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, head_dim] of `dtype` for `positions` [T] (all below `num_positions`
        when given: it spares a look at their maximum)."""
        positions = positions.long()
        if num_positions is None:
            num_positions = int(positions.max()) + 1 if positions.numel() else 1
        cos, sin = self.cos_sin_rows(positions, num_positions)
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, native: bool = False) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, rotary_dim]. With `native` (the runner's kernel
    choice) the CPU kernel rotates x in place. A rotary_dim below head_dim (partial RoPE)
    rotates the first rotary_dim dimensions and passes the rest through."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    if native and cpu_kernels.takes(x, cos, sin) and x.dtype == cos.dtype == sin.dtype and cos.is_contiguous() \
            and sin.is_contiguous():
        return cpu_kernels.rotary_(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
