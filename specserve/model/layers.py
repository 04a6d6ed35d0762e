"""Building blocks of the decoder: RMSNorm, rotary embeddings (incl. Llama-3 scaling), MLP."""
from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F


def fused():
    """The Triton kernels, imported on first GPU use: CPU-only installs never import Triton."""
    from specserve.model import fused_ops
    return fused_ops


def gemv_ops():
    """The one-row GEMV kernels (gemv.py), imported on first GPU use like `fused`."""
    from specserve.model import gemv
    return gemv


def takes_one_row_kernels(x: torch.Tensor) -> bool:
    """One row on a GPU (a batch-1 decode step) goes through gemv.py's kernels."""
    return x.is_cuda and x.shape[0] == 1 and gemv_ops().ENABLED


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x); one CUDA row takes the fastest measured GEMV."""
    if takes_one_row_kernels(x):
        return gemv_ops().one_row_linear(x, layer.weight, layer.bias)
    return layer(x)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2:
            return fused().add_rmsnorm(x.contiguous(), self.weight, self.eps)
        # normalise in fp32 like the reference implementations, then cast back
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); on a GPU one kernel, updating residual in place."""
        if x.is_cuda:
            return fused().add_rmsnorm(x.contiguous(), self.weight, self.eps, residual=residual), residual
        residual = residual + x
        return self(residual), residual


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


class GatedMLP(nn.Module):
    """SwiGLU with gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda:
            return self.down_proj(fused().silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
