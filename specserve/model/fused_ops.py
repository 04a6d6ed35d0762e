"""Triton kernels that fuse the decoder's small ops on a GPU.

A decode step of a small model is bound by kernel count, not bytes: unfused, every layer
runs ~60 tiny kernels (RMSNorm in fp32 pieces, rotate-half RoPE, two index_puts, SiLU
and a multiply), ~1.2 us each even inside a CUDA graph. These kernels do the same
arithmetic, with the same roundings as the torch code in layers.py, in one pass each:

  add_rmsnorm:    residual += x (optional); out = weight * rmsnorm(residual)
  rope_and_store: rotate q in place; rotate k and write k, v into their KV-pool slots
  silu_mul:       silu(gate) * up from the fused gate_up projection
  eagle3_input:   an EAGLE-3 head's [norm(embed(token)), norm(features)], one kernel for four

layers.py uses them for CUDA tensors; CPU runs keep the torch code (tested equal under
TRITON_INTERPRET=1). On Hopper they are launched with programmatic dependent launch
(pdl.py's protocol): a multi-row (verify, small-batch) layer chains them with cuBLAS
GEMMs and the attention kernels, and each starts while its predecessor finishes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.pdl import uses_pdl


def _pdl_launch(device: torch.device) -> dict:
    """The launch arguments of a kernel that keeps pdl.py's protocol (USE_PDL, launch_pdl)."""
    pdl = uses_pdl(device)
    return {"USE_PDL": pdl, **({"launch_pdl": True} if pdl else {})}


@triton.jit
def _add_rmsnorm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, n_cols, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # the next kernel may start
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)  # a parameter: no kernel of the chain writes it
    if USE_PDL:  # x and the residual are earlier kernels' outputs
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # the residual add rounds to the model dtype first, as `residual + x` does in torch
        x = x + tl.load(residual_ptr + row * n_cols + cols, mask=mask, other=0.0)
        tl.store(residual_ptr + row * n_cols + cols, x, mask=mask)
    tl.store(out_ptr + row * n_cols + cols, _rmsnorm(x, weight, n_cols, eps), mask=mask)


@triton.jit
def _rmsnorm(x, weight, n_cols, eps):
    """weight * rmsnorm(x) in x's dtype, rounding as layers.rms_norm does (masked lanes: 0)."""
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    normed = (x32 * inv_rms).to(x.dtype)
    return (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)


def add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: (rows, hidden) contiguous. With `residual`, it becomes residual + x in place and
    the norm is taken of it."""
    rows, hidden = x.shape
    out = torch.empty_like(x)
    _add_rmsnorm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, hidden, eps,
                                 HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
                                 **_pdl_launch(x.device))
    return out


@triton.jit
def _eagle3_input_kernel(tokens_ptr, embed_ptr, embed_norm_ptr, features_ptr, features_stride, hidden_norm_ptr,
                         out_ptr, n_cols, embed_eps, hidden_eps, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # the next kernel may start
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    embed_weight = tl.load(embed_norm_ptr + cols, mask=mask, other=0.0)   # parameters: no kernel writes them
    hidden_weight = tl.load(hidden_norm_ptr + cols, mask=mask, other=0.0)
    if USE_PDL:  # the tokens (the last draft) and the features are earlier kernels' outputs
        tl.extra.cuda.gdc_wait()
    token = tl.load(tokens_ptr + row).to(tl.int64)
    embed = tl.load(embed_ptr + token * n_cols + cols, mask=mask, other=0.0)
    features = tl.load(features_ptr + row * features_stride + cols, mask=mask, other=0.0)
    out_row = out_ptr + row * 2 * n_cols
    tl.store(out_row + cols, _rmsnorm(embed, embed_weight, n_cols, embed_eps), mask=mask)
    tl.store(out_row + n_cols + cols, _rmsnorm(features, hidden_weight, n_cols, hidden_eps), mask=mask)


def eagle3_input(tokens: torch.Tensor, embed: torch.Tensor, embed_norm: torch.Tensor, embed_eps: float,
                 features: torch.Tensor, hidden_norm: torch.Tensor, hidden_eps: float) -> torch.Tensor:
    """An EAGLE-3 head layer's input, (rows, 2 * hidden): [embed_norm * rmsnorm(embed[tokens]),
    hidden_norm * rmsnorm(features)], what the embedding, the two norms and their concatenation
    compute in four kernels. tokens (rows,); embed (vocab, hidden) contiguous; features (rows,
    hidden) with contiguous rows, of embed's dtype."""
    rows, hidden = features.shape
    out = torch.empty((rows, 2 * hidden), dtype=features.dtype, device=features.device)
    _eagle3_input_kernel[(rows,)](tokens, embed, embed_norm, features, features.stride(0), hidden_norm, out, hidden,
                                  embed_eps, hidden_eps, BLOCK=triton.next_power_of_2(hidden), **_pdl_launch(out.device))
    return out


@triton.jit
def _rotate_heads(src, dest, heads, half, head_ok, cos, sin, HALF: tl.constexpr):
    """Rotate-half RoPE of a (heads, HEAD_DIM) tile: src and dest point at each head's start."""
    x1 = tl.load(src[:, None] + half[None, :], mask=head_ok[:, None], other=0.0)
    x2 = tl.load(src[:, None] + HALF + half[None, :], mask=head_ok[:, None], other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(dest[:, None] + half[None, :], (x1f * cos[None, :] - x2f * sin[None, :]).to(dest.dtype.element_ty),
             mask=head_ok[:, None])
    tl.store(dest[:, None] + HALF + half[None, :], (x2f * cos[None, :] + x1f * sin[None, :]).to(dest.dtype.element_ty),
             mask=head_ok[:, None])


# One program per token, every head of it as one tile: a program per (token, head) moved 64-128
# values each and a 1000-token prefill's launch took 20 us a layer on an H200 (3 us this way).
@triton.jit
def _rope_and_store_kernel(q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, cos_ptr, sin_ptr, positions_ptr,
                           slots_ptr, k_buf_ptr, v_buf_ptr, num_q_heads, num_kv_heads,
                           HALF: tl.constexpr, HEAD_DIM: tl.constexpr, Q_HEADS: tl.constexpr,
                           KV_HEADS: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # the next kernel may start
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    half = tl.arange(0, HALF)
    # positions and slots are the batch's metadata, cos and sin constant tables: no need to wait for them
    position = tl.load(positions_ptr + token).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + position * HALF + half)
    sin = tl.load(sin_ptr + position * HALF + half)
    if USE_PDL:  # q, k, v come from the projection just before
        tl.extra.cuda.gdc_wait()
    q_heads = tl.arange(0, Q_HEADS)
    q_rows = q_ptr + token * q_stride + q_heads * HEAD_DIM
    _rotate_heads(q_rows, q_rows, q_heads, half, q_heads < num_q_heads, cos, sin, HALF)
    kv_heads = tl.arange(0, KV_HEADS)
    kv_ok = kv_heads < num_kv_heads
    dest = (slot * num_kv_heads + kv_heads) * HEAD_DIM
    _rotate_heads(k_ptr + token * k_stride + kv_heads * HEAD_DIM, k_buf_ptr + dest, kv_heads, half, kv_ok,
                  cos, sin, HALF)
    dims = tl.arange(0, HEAD_DIM)
    value = tl.load(v_ptr + token * v_stride + kv_heads[:, None] * HEAD_DIM + dims[None, :], mask=kv_ok[:, None])
    tl.store(v_buf_ptr + dest[:, None] + dims[None, :], value.to(v_buf_ptr.dtype.element_ty), mask=kv_ok[:, None])


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> None:
    """q: (tokens, heads, head_dim), rotated in place; k, v: (tokens, kv_heads, head_dim),
    k rotated on its way into k_buffer[slots], v copied into v_buffer[slots]. q, k, v may be
    row-strided views of the qkv projection (their last two dims contiguous)."""
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    _rope_and_store_kernel[(tokens,)](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), cos, sin, positions, slots, k_buffer, v_buffer,
        num_q_heads, num_kv_heads, HALF=head_dim // 2, HEAD_DIM=head_dim,
        Q_HEADS=triton.next_power_of_2(num_q_heads), KV_HEADS=triton.next_power_of_2(num_kv_heads),
        **_pdl_launch(q.device))


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # the next kernel may start; gate_up is the previous one's output
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    activated = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)   # silu rounds to the dtype, then the product
    tl.store(out_ptr + row * width + cols, (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (rows, 2 * width) -> silu(gate) * up, (rows, width)."""
    rows, double = gate_up.shape
    width = double // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, width, BLOCK=block, **_pdl_launch(gate_up.device))
    return out
