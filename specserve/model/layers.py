"""Building blocks of the decoder: RMSNorm, the gated MLP, and the dispatch of one-row
matmuls to gemv.py (rotary embeddings are in rope.py)."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from specserve.model.rope import RotaryEmbedding  # noqa: F401  (re-exported: the runner and tests import it from here)


def fused():
    """The Triton kernels, imported on first GPU use: CPU-only installs never import Triton."""
    from specserve.model import fused_ops
    return fused_ops


def gemv_ops():
    """The one-row GEMV kernels (gemv.py), imported on first GPU use like `fused`."""
    from specserve.model import gemv
    return gemv


def rows_ops():
    """The few-row linear kernels (rows_linear.py), imported on first GPU use like `fused`."""
    from specserve.model import rows_linear
    return rows_linear


def takes_one_row_kernels(x: torch.Tensor) -> bool:
    """One row on a GPU (a batch-1 decode step) goes through gemv.py's kernels."""
    return x.is_cuda and x.shape[0] == 1 and gemv_ops().ENABLED


def takes_row_kernels(x: torch.Tensor) -> bool:
    """1 to rows_linear.MAX_ROWS rows on a GPU (a decode or verify step of a small batch)
    go through the weight-streaming kernels with the pre-norm and epilogues fused in."""
    if not x.is_cuda:
        return False
    if x.shape[0] == 1:
        return gemv_ops().ENABLED
    return 1 < x.shape[0] <= rows_ops().MAX_ROWS and rows_ops().ENABLED


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
                 add_norm=None, rope=None):
    """x @ W^T (+ bias) (then SiLU * up, or RoPE + the KV write) for the rows of a step that
    takes_row_kernels: one row by gemv.py, more by rows_linear.py, each the fastest path
    measured for its shape. With add_norm (gemv.AddNorm), returns (output, residual + x)."""
    if x.shape[0] == 1:
        return gemv_ops().one_row_linear(x, weight, bias, silu_mul, add_norm, rope)
    return rows_ops().rows_linear(x, weight, bias, silu_mul, add_norm, rope)


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x); a few CUDA rows take the fastest measured weight-streaming kernel."""
    if takes_row_kernels(x):
        return fused_linear(x, layer.weight, layer.bias)
    return layer(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) in torch ops (differentiable): normalised in fp32 like the
    reference implementations, then cast back."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() == 2:
            return fused().add_rmsnorm(x.contiguous(), self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); on a GPU one kernel, updating residual in place."""
        if x.is_cuda:
            return fused().add_rmsnorm(x.contiguous(), self.weight, self.eps, residual=residual), residual
        residual = residual + x
        return self(residual), residual


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
