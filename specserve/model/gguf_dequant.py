"""GGUF tensors dequantized with torch, on the device the weights are bound for.

gguf-py's dequantizers are numpy on one core: a 1.5B Q4_K_M file took 44 s on a 2-core VM
and 114 s on an H200 machine's host (beside the EAGLE trainer's tokenizer
pool), the larger part of an engine's start and of train_eagle's time budget. The same
block formats as torch ops run on the GPU in a fraction of a second, and on a CPU with
torch's threads. The arithmetic is gguf-py's, step for step in float32 (no fused
multiply-adds), so the weights are bit-identical to its output (tests/test_gguf_dequant.py
compares every tensor of the models in use). Formats without a torch version here go
through gguf-py (`None` from `dequantize`).

A GGUF tensor's raw data is (rows, bytes per row) of blocks; `shape` is the PyTorch shape
(GGUF lists dimensions fastest-first).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256   # elements of a K-quant super-block


def _half(raw: torch.Tensor) -> torch.Tensor:
    """(n, 2) bytes as (n, 1) float32 from little-endian float16."""
    return raw.contiguous().view(torch.float16).float()


def _shifted(raw: torch.Tensor, shifts: list[int], group: int) -> torch.Tensor:
    """Each group of `group` bytes shifted right by every value of `shifts`, the shifts'
    copies laid one after the other: (n, g * group) -> (n, g, len(shifts), group)."""
    by = torch.tensor(shifts, dtype=torch.uint8, device=raw.device).reshape(1, 1, -1, 1)
    return raw.reshape(raw.shape[0], -1, 1, group) >> by


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Low nibbles of a group of bytes, then their high nibbles: (n, bytes) -> (n, 2 * bytes)."""
    return (_shifted(qs, [0, 4], group) & 0x0F).reshape(qs.shape[0], -1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """A little-endian uint32 of 4 bytes as its 32 bits, lowest first: (n, 4) -> (n, 32)."""
    return (_shifted(qh, list(range(8)), 1).reshape(qh.shape[0], 4, 8) & 1).reshape(qh.shape[0], 32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d, qs = _half(b[:, :2]), b[:, 2:]
    return d * (_nibbles(qs, 16).to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m, qs = _half(b[:, :2]), _half(b[:, 2:4]), b[:, 4:]
    return d * _nibbles(qs, 16).float() + m


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d, qh, qs = _half(b[:, :2]), b[:, 2:6], b[:, 6:]
    q = (_nibbles(qs, 16) | (_bits32(qh) << 4)).to(torch.int8) - 16
    return d * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m, qh, qs = _half(b[:, :2]), _half(b[:, 2:4]), b[:, 4:8], b[:, 8:]
    return d * (_nibbles(qs, 16) | (_bits32(qh) << 4)).float() + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _half(b[:, :2])


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes packing eight 6-bit scales and eight 6-bit mins per super-block."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """d * scale * q - dmin * min over eight sub-blocks of 32 (Q4_K, Q5_K)."""
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_half(b[:, :2]) * sc).reshape(n, -1, 1)
    dm = (_half(b[:, 2:4]) * mn).reshape(n, -1, 1)
    return (d * q.reshape(n, -1, 32).float() - dm).reshape(n, QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_affine(b, _nibbles(b[:, 16:], 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qh, qs = b[:, 16:48], b[:, 48:]
    high = (_shifted(qh, list(range(8)), 32) & 1).reshape(n, -1)
    return _k_affine(b, _nibbles(qs, 32) | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], b[:, 208:]
    d = (_half(d) * scales.contiguous().view(torch.int8).float()).reshape(n, QK_K // 16, 1)
    low = _nibbles(ql, 64).reshape(n, -1, 32)
    high = (_shifted(qh, [0, 2, 4, 6], 32) & 0x03).reshape(n, -1, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, QK_K // 16, -1).float()
    return (d * q).reshape(n, QK_K)


# GGML type name -> its block dequantizer (block and byte sizes: gguf's GGML_QUANT_SIZES)
_BLOCK_FORMATS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
_PLAIN_FORMATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...],
               device: str | torch.device) -> torch.Tensor | None:
    """float32 `shape` on `device` from a GGUF tensor's raw data, or None for a format
    this module lacks. The raw bytes (a read-only memory map) are copied once, to the device."""
    if type_name in _PLAIN_FORMATS:
        flat = torch.from_numpy(np.array(raw).reshape(-1).view(np.uint8)).to(device)
        return flat.view(_PLAIN_FORMATS[type_name]).float().reshape(shape)
    if type_name not in _BLOCK_FORMATS:
        return None
    _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    blocks = torch.from_numpy(np.array(raw).reshape(-1, type_size)).to(device)
    return _BLOCK_FORMATS[type_name](blocks).reshape(shape)
