"""Few-row linear layers on a GPU: y = x @ W^T (+ bias) for 1..FEW_ROWS rows of x, optionally
with the decoder's pre-norm in front (input = rmsnorm(residual + x) * w) and, behind,
SiLU(gate) * up (the fused gate_up projection) or RoPE + the KV-pool write (the fused qkv
projection), so a layer of a small step is 4 GEMVs and the attention kernel.

A decode step of up to 16 requests, or a verify step of a small draft tree, is a chain of
matrix products whose weights must each stream once at full memory bandwidth, whatever the
row count. cuBLAS gets close on large matrices but not on the small ones of a 1.5B model
(H200, one row, weights read from HBM: o_proj 4.7 MB in 6.5 us, down_proj 27.5 MB in 11.9
us; the one-row GEMV: 3.3 us and 8.9 us), and with more rows it adds a separate norm, SiLU
or RoPE kernel per projection, each a launch with its own ramp-up inside the graph. The
kernels (gemv_kernels.py) read each weight tile once for all rows; one row keeps the
one-row kernel that batch-1 decoding has always used.

Tile configs are chosen per (weight shape, fusions, row bucket) by timing a few
candidates, cuBLAS included (gemv_tuning.py), the first time a shape is seen (in the
warm-up runs before the engine captures its graphs), so the fastest path wins on every
GPU and model.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
import triton

from specserve.model.gemv_kernels import AddNorm, RopeStore, TileConfig, gemv  # noqa: F401  (the kernels' API)
from specserve.model.gemv_tuning import candidate_times, unfused

logger = logging.getLogger(__name__)

ENABLED = True  # False: few-row matmuls go to cuBLAS like any other (the A/B of bench.decode_profile)
FEW_ROWS = 16   # the most rows that take these kernels (the largest bucket of CANDIDATES); 1: batch-1 steps only


def row_bucket(rows: int) -> int:
    """The row count whose tuned config `rows` rows use: rows padded to a power of two."""
    if not 1 <= rows <= FEW_ROWS:
        raise ValueError(f"rows={rows}: the few-row matmul takes 1..{FEW_ROWS} rows")
    return triton.next_power_of_2(rows)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    silu_mul: bool = False, add_norm: AddNorm | None = None, rope: RopeStore | None = None,
                    input_rows: torch.Tensor | None = None):
    """x @ W^T (+ bias) (then silu_mul or rope) for 1..FEW_ROWS CUDA rows by the fastest
    measured path; with add_norm the input is normalised first and (output, residual + x)
    is returned. input_rows (L,): only these rows of x (and of the residual) are computed,
    L <= FEW_ROWS (x may have any number of rows)."""
    rows = x.shape[0] if input_rows is None else input_rows.shape[0]
    config = best_config(tuple(weight.shape), weight.dtype, bias is not None, silu_mul, add_norm is not None,
                         rope.heads if rope is not None else None, row_bucket(rows), weight.device)
    if input_rows is not None and (config is None or rows == 1):  # the one-row kernel and cuBLAS read x as given
        x = x[input_rows]
        add_norm = AddNorm(add_norm.residual[input_rows], add_norm.weight, add_norm.eps) if add_norm else None
        input_rows = None
    if config is None:
        return unfused(x, weight, bias, silu_mul, add_norm, rope)
    return gemv(x, weight, bias, silu_mul, config, add_norm, rope, input_rows)


@functools.lru_cache(maxsize=None)
def best_config(shape: tuple[int, int], dtype: torch.dtype, has_bias: bool, silu_mul: bool, add_norm: bool,
                rope_heads: tuple[int, int, int] | None, rows: int, device: torch.device) -> TileConfig | None:
    """The fastest GEMV tile config for this weight shape and row bucket, or None when cuBLAS
    (with the unfused kernels) is faster."""
    times = candidate_times(shape, dtype, has_bias, silu_mul, add_norm, device, rope_heads, rows)
    logger.info("%d-row matmul %s%s%s%s: %s", rows, shape, " + add_norm" if add_norm else "",
                " + silu_mul" if silu_mul else "", " + rope" if rope_heads else "",
                ", ".join(f"{'cublas' if k is None else k.label} {v:.1f} us" for k, v in times.items()))
    return min(times, key=times.get)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool,
              add_norm: AddNorm | None = None, rope: RopeStore | None = None):
    """The unfused torch computation gemv replaces, for any number of rows (same return convention)."""
    from specserve.model.rope import rotate_half
    residual_out = None
    if add_norm is not None:
        residual_out = add_norm.residual + x
        x32 = residual_out.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + add_norm.eps)).to(x.dtype)
        x = add_norm.weight * normed
    y = F.linear(x, weight, bias)
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if rope is not None:
        num_q, num_kv, head_dim = rope.heads
        q, k, v = y.view(-1, num_q + 2 * num_kv, head_dim).split([num_q, num_kv, num_kv], dim=1)
        cos, sin = rope.cos[rope.positions].unsqueeze(1), rope.sin[rope.positions].unsqueeze(1)
        rope.k_buffer[rope.slots] = rotate_half(k, cos, sin)
        rope.v_buffer[rope.slots] = v
        y = rotate_half(q, cos, sin).reshape(x.shape[0], -1)
    return y if add_norm is None else (y, residual_out)
