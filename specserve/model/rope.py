"""Rotary position embeddings: the cos/sin tables (with HF `rope_scaling`: linear and
Llama-3) and rotate-half RoPE. Its own module so that gemv.py's reference can use
rotate_half without importing layers.py, which imports gemv.py."""
from __future__ import annotations

import math

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embeddings with a cos/sin table for every position up to max_positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        inv_freq = scale_inverse_frequencies(inv_freq, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)  # (max_positions, head_dim / 2)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (num_tokens, heads, head_dim), k: (num_tokens, kv_heads, head_dim)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return rotate_half(q, cos, sin), rotate_half(k, cos, sin)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x (..., head_dim) by cos, sin (..., head_dim / 2), in fp32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def scale_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """Applies HF `rope_scaling`: None/default, linear, or llama3 (long-context Llama 3.1+)."""
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed down by `factor`, short ones kept, the band between blended
        smooth = (old_context / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        middle = (wavelen <= old_context / low) & (wavelen >= old_context / high)
        return torch.where(middle, blended, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")
