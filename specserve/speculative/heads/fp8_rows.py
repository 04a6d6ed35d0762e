"""Weights stored as float8 (e4m3) with one scale per output row, read back as floats.
(quantize_matrix / dequantize_matrix do one matrix: the trainer's stored target states too.)

A kept EAGLE head must travel with the repository to a GPU machine, whose calls carry at
most 64 MiB: in float8 a 1.5B target's head is half its bf16 size. Each 2-D weight W is
stored as `name` (float8_e4m3fn, W / scale) and `name + SCALE_SUFFIX` (float32, one per
row: the row's largest magnitude over e4m3's largest finite value); vectors (norms) and
integer tensors are stored as they are. A draft head's drafts are checked by the target,
so rounding its weights can cost accept length, never correctness.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale"
_FP8_MAX = torch.finfo(FP8).max


def quantize_matrix(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(matrix / scale as float8, scale): scale (rows, 1) float32, each row's largest magnitude
    over e4m3's largest finite value."""
    values = matrix.float()
    scale = (values.abs().amax(dim=1, keepdim=True) / _FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (values / scale).to(FP8), scale


def dequantize_matrix(quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize_matrix (up to its rounding), as `dtype`."""
    return (quantized.float() * scale.float()).to(dtype)


def quantize_rows(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.dim() == 2:
            out[name], out[name + SCALE_SUFFIX] = quantize_matrix(tensor)
        else:
            out[name] = tensor
    return out


def dequantize_rows(state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The inverse of quantize_rows (up to its rounding); a state without float8 tensors comes back as it is."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in state:
            continue
        if tensor.dtype == FP8:
            scale = state.get(name + SCALE_SUFFIX)
            if scale is None:
                raise ValueError(f"float8 weight {name} has no {name + SCALE_SUFFIX}")
            out[name] = dequantize_matrix(tensor, scale, dtype)
        else:
            out[name] = tensor
    return out

