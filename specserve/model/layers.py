"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, stacked projections."""

from __future__ import annotations

import math

import torch
from torch import nn

from specserve.model.arch import ModelArch, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the compute dtype, as the reference implementation does.
        normed = nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies (fp32) with linear or Llama-3 scaling applied."""
    # fp32 throughout, as the reference computes it: a float64 table would drift from it at long positions.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    mid_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid_band, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE from a cos/sin table indexed by each token's position; with a partial
    `arch.rotary_dim` (Bamba) only each head's leading dims turn and the rest pass through."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.rotary_dim = arch.rotary_dim or arch.head_dim
        self.full = self.rotary_dim == arch.head_dim  # what the fused RoPE kernels assume
        inv_freq = rope_inv_freq(self.rotary_dim, arch.rope_theta, arch.rope_scaling)
        positions = torch.arange(arch.max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        if self.full:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        d = self.rotary_dim
        return tuple(torch.cat((_rotate(x[..., :d], cos, sin), x[..., d:]), dim=-1) for x in (q, k))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class StackedLinear(nn.Linear):
    """One matmul for several checkpoint projections that read the same input (q/k/v, gate/up).

    `shards` names each checkpoint projection and its output width, in order.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = shards

    def shard_rows(self, name: str) -> slice:
        start = 0
        for shard, width in self.shards.items():
            if shard == name:
                return slice(start, start + width)
            start += width
        raise KeyError(name)
