"""A Triton matmul for a few rows (2..MAX_ROWS) with the decoder's ops fused around it, the
multi-row sibling of gemv.py: y = x @ W^T (+ bias), with the pre-norm in front
(input = rmsnorm(residual + x) * w) and SiLU(gate) * up or RoPE + the KV-pool write behind.

A verify step of a small draft tree (or a decode step of a small batch) is a handful of
rows: still a stream of every weight matrix once, like a one-row decode step, but cuBLAS's
small-M kernels reach only 30-70% of the bandwidth on a 1.5B model's shapes (H100: o_proj
~1 TB/s, gate_up 2.3 TB/s) and the unfused norm, RoPE and SiLU kernels with the gaps
between them cost as much again (bench.step_cost --kernels: a batch-1 verify step of 4-16
nodes took 1.9x a plain step's GPU time). Here each program owns BLOCK_N output lanes for
all rows: it streams its (BLOCK_N, K) weight slice once and multiplies it with the rows on
the tensor cores (tl.dot wants >= 16 rows, so the rows are padded to BLOCK_M = 16).

The pre-norm costs no pass of its own, as in gemv.py: per row, rmsnorm(s) * w . W_row =
rsqrt(mean(s^2) + eps) * ((w * s) . W_row), so the loop feeds (w * s) to the dot and sums
s^2 beside it, and each row is scaled at the end.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.model.gemv import AddNorm, RopeStore, gemv_input, rope_epilogue

MAX_ROWS = 16
BLOCK_M = 16  # the rows' tile: tl.dot's smallest

# (BLOCK_N, BLOCK_K, num_warps, num_stages): narrow lane blocks keep enough programs to fill
# the GPU on 1.5k-wide outputs; deep pipelines keep enough weight bytes in flight per program
CANDIDATES = ((16, 256, 4, 4), (16, 128, 4, 6), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (16, 512, 4, 3),
              (64, 64, 4, 6))


@triton.jit
def _rows_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N_OUT, K, res_ptr, norm_w_ptr, res_out_ptr, eps,
                 cos_ptr, sin_ptr, positions_ptr, slots_ptr, k_buf_ptr, v_buf_ptr, num_q_heads, num_kv_heads,
                 HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, ADD_NORM: tl.constexpr, ROPE: tl.constexpr,
                 HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    # Lanes and their weight rows as in gemv.py's kernel: two rows per lane with SILU_MUL
    # (gate, up) and ROPE (dims d and d + HALF of a head). x, residual: (M, K) contiguous.
    pid = tl.program_id(0)
    if USE_PDL:  # the next kernel may start (and fetch its own weights) as SMs free up
        tl.extra.cuda.gdc_launch_dependents()
    lanes = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    lane_ok = lanes < N_OUT
    w_rows = lanes
    if ROPE:
        w_rows = (lanes // HALF) * (2 * HALF) + lanes % HALF
    second_rows = w_rows + (HALF if ROPE else N_OUT)
    w_first = w_ptr + w_rows.to(tl.int64)[:, None] * K
    w_second = w_ptr + second_rows.to(tl.int64)[:, None] * K
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x_rows = rows.to(tl.int64)[:, None] * K
    cols = tl.arange(0, BLOCK_K)
    two = SILU_MUL or ROPE
    # the first weight chunk does not depend on the previous kernel: fetch it while that one ends
    w_mask = lane_ok[:, None] & (cols < K)[None, :]
    w_chunk = tl.load(w_first + cols[None, :], mask=w_mask, other=0.0)
    w_chunk_second = w_chunk
    if two:
        w_chunk_second = tl.load(w_second + cols[None, :], mask=w_mask, other=0.0)
    if USE_PDL:  # x and the residual are the previous kernels' outputs
        tl.extra.cuda.gdc_wait()
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc, acc_second, squares = _chunk_product(x_ptr, res_ptr, norm_w_ptr, x_rows, row_ok, cols, K, w_chunk,
                                              w_chunk_second, zeros, zeros, ADD_NORM, two, DOT_PRECISION)
    for k in range(BLOCK_K, K, BLOCK_K):
        w_mask = lane_ok[:, None] & ((k + cols) < K)[None, :]
        w_chunk = tl.load(w_first + (k + cols)[None, :], mask=w_mask, other=0.0)
        if two:
            w_chunk_second = tl.load(w_second + (k + cols)[None, :], mask=w_mask, other=0.0)
        acc, acc_second, chunk_squares = _chunk_product(x_ptr, res_ptr, norm_w_ptr, x_rows, row_ok, k + cols, K,
                                                        w_chunk, w_chunk_second, acc, acc_second, ADD_NORM, two,
                                                        DOT_PRECISION)
        squares += chunk_squares
    if ADD_NORM:
        if pid == 0:  # residual + x for the next layer, once
            for k in range(0, K, BLOCK_K):
                offsets = x_rows + (k + cols)[None, :]
                mask = row_ok[:, None] & ((k + cols) < K)[None, :]
                summed = tl.load(x_ptr + offsets, mask=mask, other=0.0) + tl.load(res_ptr + offsets, mask=mask)
                tl.store(res_out_ptr + offsets, summed, mask=mask)  # rounds like torch's residual + x
        inv_rms = tl.rsqrt(squares / K + eps)[:, None]
        acc *= inv_rms
        acc_second *= inv_rms
    if HAS_BIAS:
        acc += tl.load(bias_ptr + w_rows, mask=lane_ok, other=0.0).to(tl.float32)[None, :]
        if ROPE:
            acc_second += tl.load(bias_ptr + second_rows, mask=lane_ok, other=0.0).to(tl.float32)[None, :]
    # round to the model dtype first, as the unfused matmul does before SiLU * up or RoPE
    y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    y_second = acc_second.to(out_ptr.dtype.element_ty).to(tl.float32)
    if ROPE:
        rope_epilogue(y, y_second, rows, row_ok, lanes, lane_ok, out_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr,
                      k_buf_ptr, v_buf_ptr, num_q_heads, num_kv_heads, HALF)
    else:
        if SILU_MUL:
            y = (y / (1.0 + tl.exp(-y))).to(out_ptr.dtype.element_ty).to(tl.float32) * y_second
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * N_OUT + lanes[None, :]
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & lane_ok[None, :])


@triton.jit
def _chunk_product(x_ptr, res_ptr, norm_w_ptr, x_rows, row_ok, cols, K, w_chunk, w_chunk_second, acc, acc_second,
                   ADD_NORM: tl.constexpr, TWO: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add the rows' input columns `cols` times the weight chunk(s) to the accumulators;
    returns them and each row's sum of squares over the chunk (for the pre-norm)."""
    col_ok = cols < K
    x, squares = gemv_input(x_ptr, res_ptr, norm_w_ptr, x_rows + cols[None, :], row_ok[:, None] & col_ok[None, :],
                            cols[None, :], col_ok[None, :], ADD_NORM)
    x = x.to(w_chunk.dtype)
    acc = tl.dot(x, tl.trans(w_chunk), acc, input_precision=DOT_PRECISION)
    if TWO:
        acc_second = tl.dot(x, tl.trans(w_chunk_second), acc_second, input_precision=DOT_PRECISION)
    return acc, acc_second, tl.sum(squares, axis=1)


def gemm_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
              config: tuple[int, int, int, int] = CANDIDATES[0], add_norm: AddNorm | None = None,
              rope: RopeStore | None = None):
    """x: (M, K) contiguous, M <= MAX_ROWS; weight: (N, K) contiguous. Returns (M, N), (M, N / 2)
    with silu_mul, or q (M, num_q_heads * head_dim) with rope (rope.positions and rope.slots
    hold M entries); with add_norm, (output, residual + x) as gemv.gemv."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and x.stride(-1) == 1 and x.stride(0) == k, "x: at most MAX_ROWS contiguous rows"
    lanes = n // 2 if silu_mul or rope is not None else n
    block_n, block_k, warps, stages = config
    width = rope.num_q_heads * rope.heads[2] if rope is not None else lanes
    out = torch.empty((m, width), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if add_norm is not None else None
    norm = add_norm or AddNorm(x, x, 0.0)  # unused pointers when there is no norm
    # No PDL: its programs would launch early and wait on SMs while the previous kernel (the
    # extend attention and its merge, which do not release dependents early) still runs; on
    # an H100 that slowed the attention more than the early start saved.
    pdl = False
    r = rope or RopeStore(x, x, x, x, x, x, 0)  # likewise
    _rows_kernel[(triton.cdiv(lanes, block_n),)](
        x, weight, bias if bias is not None else weight, out, m, lanes, k,
        norm.residual, norm.weight, residual_out if residual_out is not None else out, norm.eps,
        r.cos, r.sin, r.positions, r.slots, r.k_buffer, r.v_buffer, r.num_q_heads, r.heads[1] if rope else 0,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, ADD_NORM=add_norm is not None, ROPE=rope is not None,
        HALF=r.heads[2] // 2 if rope else 1, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=min(block_k, max(16, triton.next_power_of_2(k))),
        DOT_PRECISION="ieee" if weight.dtype == torch.float32 else "tf32", USE_PDL=pdl, num_warps=warps, num_stages=stages,
        **({"launch_pdl": True} if pdl else {}))
    return out if add_norm is None else (out, residual_out)
