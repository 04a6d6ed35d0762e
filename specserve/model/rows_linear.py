"""A linear layer for the 2-32 rows of a verify step or a small decode batch, streaming each
weight once like the one-row GEMV (gemv.py), with the same fused prologue and epilogues:
the decoder's pre-norm in front, SiLU(gate) * up or RoPE + the KV-pool write behind.

Why not cuBLAS: a GEMM library tiles for reuse, and at 2-16 rows there is nothing to reuse;
its small-M kernels launch few programs on the small matrices of a 1-8B model (H200, 1.5B,
4 rows: qkv 10.6 us and o_proj 6.2 us, where one row's GEMV takes 4.4 and 2.5), and the
unfused add-RMSNorm, RoPE-and-store and SiLU kernels around it cost a batch-1 verify
step ~0.18 ms of a plain step's 1.25. Earlier few-row kernels lost because each program
walked all of K for 2-16 output lanes: too few programs on the small matrices, and the
input rows re-read once per lane block.

The layout here (y^T = W x^T, the weights as the wide operand of a tensor-core dot):
- each program owns BLOCK_N output lanes and one of SPLIT slices of K; its weight tile
  (BLOCK_N, BLOCK_K) meets the rows (ROWS padded to 16 or 32, BLOCK_K) in one `tl.dot`, so a
  weight byte is loaded once whatever the row count, and SPLIT raises the program count
  on short, wide matrices (down_proj: 1536 lanes, K 8960) without shrinking the tile;
- the slices of a lane block meet in a float32 workspace: each adds its partial sums
  atomically, and the last to arrive (a per-block counter) runs the epilogue and zeroes
  the workspace and counter for the next call (no clearing kernel, graph-safe);
- the pre-norm's rsqrt scale multiplies the dot products at the end, as in gemv.py: the
  input is (w * s) with s = residual + x, unscaled. Either every program computes it tile
  by tile in its loop, accumulating each row's sum of squares beside it (no pass of its
  own), or a small kernel first writes it once with each row's scale, and the loop only
  loads it ("prenormed"). The loop's own norm work costs more than the extra kernel on the
  large matrices: H200, 8 rows, gate_up + norm 21.4 us against 16.6 us for the same
  matrix bare (1.5B), 82-88 against 70 (7B shape); the tuner times both;
- with PDL a program lets the next kernel launch only after its loop. Let go at its
  start (as the one-row GEMV does), the next kernel's programs took SM slots while this
  one still had programs to place, and timings in isolation stopped predicting the step:
  the prenormed choices the tuner made slowed a 1.5B batch-8 decode step from 1.63 to
  1.80 ms; with the late trigger the same choices gave 1.49 ms, a batch-1 4-node verify
  1.64 -> 1.49 ms (lab.step_cost, docs/bench/h200_2026-12-04c/).

Tile configs and cuBLAS are timed per (weight shape, epilogue, padded row count) the
first time they are seen (before the engine captures its graphs), so the faster path
is taken per shape, as for one row.
"""
from __future__ import annotations

import functools
import logging
import os

import torch
import triton
import triton.language as tl

from specserve.model.gemv import AddNorm, RopeStore, graph_time_us, timing_inputs, unfused
from specserve.pdl import uses_pdl

logger = logging.getLogger(__name__)

# Above 32 rows cuBLAS's tiles win on every matrix of a 1.5B (H200: a batch-8 verify of 64
# nodes took 0.1 ms longer through these kernels), so larger steps keep the unfused path.
MAX_ROWS = 32
# On by default; SPECSERVE_ROW_KERNELS=0 sends 2-32 rows to cuBLAS and the separate norm / RoPE /
# SiLU kernels. A split-K race once made them compute wrong rows on a GPU (a warp read a row's sum
# of squares after another had zeroed it), which halved NGRAM's accepted drafts at concurrency;
# tests/test_rows_linear_ptx.py checks the barrier in the compiled PTX, and
# lab/row_kernel_identity.py compares greedy outputs with them and without on a GPU.
ENABLED = os.environ.get("SPECSERVE_ROW_KERNELS", "1") == "1"

# (BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages): at 16 rows (a verify step at batch 1)
# (wide lane blocks keep the input's re-reads small; split K restores the program count)
CANDIDATES = ((64, 64, 1, 4, 4), (64, 128, 1, 4, 3), (64, 64, 2, 4, 4), (64, 64, 4, 4, 4), (64, 64, 8, 4, 3),
              (64, 32, 16, 4, 2), (128, 64, 1, 4, 3), (128, 64, 4, 4, 3), (128, 64, 8, 4, 3), (128, 32, 8, 4, 3),
              (32, 64, 8, 4, 4), (64, 128, 4, 4, 3))
# fewer at 32 rows (each row count compiles its own kernels; the accumulators grow)
WIDE_CANDIDATES = ((64, 64, 4, 4, 4), (128, 64, 4, 8, 3), (64, 64, 8, 4, 3), (64, 128, 1, 4, 3))
# a workspace holds (lane blocks, 2, BLOCK_N, MAX_ROWS) floats: split only where that stays small
MAX_SPLIT_LANES = 32768


@triton.jit
def _rows_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, R, N_OUT, K, out_stride,
                 res_ptr, norm_w_ptr, res_out_ptr, eps,
                 cos_ptr, sin_ptr, positions_ptr, slots_ptr, k_buf_ptr, v_buf_ptr, num_q_heads, num_kv_heads,
                 ws_ptr, squares_ptr, count_ptr, scale_ptr,
                 HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, ADD_NORM: tl.constexpr, ROPE: tl.constexpr,
                 ROW_SCALE: tl.constexpr,
                 HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                 SPLIT: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    # x: (R, K) rows; W: (N, K). A lane reads two weight rows with SILU_MUL (gate row, up row
    # N_OUT further) and with ROPE (dims d and d + HALF of one head), one row otherwise.
    # ROW_SCALE: x is prenormed, scale_ptr holds each row's rsqrt factor.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    TWO: tl.constexpr = SILU_MUL or ROPE
    lanes = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    lane_ok = lanes < N_OUT
    w_index = lanes
    if ROPE:
        w_index = (lanes // HALF) * (2 * HALF) + lanes % HALF
    second_index = w_index + (HALF if ROPE else N_OUT)
    w_rows = w_ptr + w_index.to(tl.int64)[:, None] * K
    w_second = w_ptr + second_index.to(tl.int64)[:, None] * K
    rows = tl.arange(0, ROWS)
    row_ok = rows < R
    slice_len = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
    k_lo = pid_k * slice_len
    k_hi = tl.minimum(K, k_lo + slice_len)
    cols = tl.arange(0, BLOCK_K)
    # the slice's first weight tile is loaded before waiting for the previous kernel: weights
    # do not depend on it, so with PDL they stream in while it finishes
    first_ok = lane_ok[:, None] & ((k_lo + cols) < k_hi)[None, :]
    w = tl.load(w_rows + k_lo + cols[None, :], mask=first_ok, other=0.0)
    w2 = w
    if TWO:
        w2 = tl.load(w_second + k_lo + cols[None, :], mask=first_ok, other=0.0)
    if USE_PDL:  # x and the residual are the previous kernels' outputs
        tl.extra.cuda.gdc_wait()
    x, squares = _rows_input(x_ptr, res_ptr, norm_w_ptr, rows, row_ok, k_lo + cols, (k_lo + cols) < k_hi, K,
                             ADD_NORM)
    x = x.to(w_ptr.dtype.element_ty)
    acc = tl.dot(w, tl.trans(x), input_precision=PRECISION)
    acc_second = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    if TWO:
        acc_second = tl.dot(w2, tl.trans(x), input_precision=PRECISION)
    for k in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        k_ok = (k + cols) < k_hi
        w_mask = lane_ok[:, None] & k_ok[None, :]
        x, chunk_squares = _rows_input(x_ptr, res_ptr, norm_w_ptr, rows, row_ok, k + cols, k_ok, K, ADD_NORM)
        squares += chunk_squares
        x = x.to(w_ptr.dtype.element_ty)
        w = tl.load(w_rows + k + cols[None, :], mask=w_mask, other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        if TWO:
            w2 = tl.load(w_second + k + cols[None, :], mask=w_mask, other=0.0)
            acc_second = tl.dot(w2, tl.trans(x), acc_second, input_precision=PRECISION)
    if USE_PDL:  # the next kernel may launch now, not earlier (see the module docstring)
        tl.extra.cuda.gdc_launch_dependents()
    if ADD_NORM:
        if pid_n == 0:  # residual + x written out once, by the first lane block's slices
            for k in range(k_lo, k_hi, BLOCK_K):
                k_ok = (k + cols) < k_hi
                offsets = rows[:, None] * K + (k + cols)[None, :]
                mask = row_ok[:, None] & k_ok[None, :]
                summed = tl.load(x_ptr + offsets, mask=mask, other=0.0) + tl.load(res_ptr + offsets, mask=mask)
                tl.store(res_out_ptr + offsets, summed, mask=mask)  # rounds like torch's residual + x
    if SPLIT == 1:
        _rows_epilogue(acc, acc_second, squares, lanes, lane_ok, w_index, second_index, rows, row_ok, K, eps,
                       bias_ptr, out_ptr, out_stride, cos_ptr, sin_ptr, positions_ptr, slots_ptr, k_buf_ptr,
                       v_buf_ptr, num_q_heads, num_kv_heads, scale_ptr, HAS_BIAS, SILU_MUL, ADD_NORM, ROPE,
                       ROW_SCALE, HALF)
    else:
        # the slices of this lane block meet in the workspace; the last one finishes the block
        block = ws_ptr + pid_n * (2 * BLOCK_N * ROWS)
        tile = tl.arange(0, BLOCK_N)[:, None] * ROWS + rows[None, :]
        tl.atomic_add(block + tile, acc, sem="relaxed")
        if TWO:
            tl.atomic_add(block + BLOCK_N * ROWS + tile, acc_second, sem="relaxed")
        if ADD_NORM:  # from lane 0 of the tile: a row sum held in (BLOCK_N, ROWS) form has one owner
            first_lane = (tl.arange(0, BLOCK_N) == 0)[:, None] & row_ok[None, :]
            spread = tl.where(first_lane, squares[None, :], 0.0)
            at = squares_ptr + pid_n * ROWS + rows[None, :] + tl.zeros((BLOCK_N, 1), dtype=tl.int32)
            tl.atomic_add(at, spread, mask=first_lane, sem="relaxed")
        tl.debug_barrier()  # every thread's partial sums are added before the block counts in
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            acc = tl.load(block + tile, cache_modifier=".cg")
            if TWO:
                acc_second = tl.load(block + BLOCK_N * ROWS + tile, cache_modifier=".cg")
            if ADD_NORM:
                squares = tl.load(squares_ptr + pid_n * ROWS + rows, cache_modifier=".cg")
            # Every thread reads before any thread zeroes: a value may be held by several threads
            # (each row's sum of squares is loaded by every warp, and only one warp's store is
            # kept), and a warp that zeroed it first left the others reading 0, so their lanes
            # of that row were scaled by 1 / sqrt(eps) (sm_90 PTX: no barrier between the two).
            tl.debug_barrier()
            tl.store(block + tile, tl.zeros((BLOCK_N, ROWS), dtype=tl.float32))
            if TWO:
                tl.store(block + BLOCK_N * ROWS + tile, tl.zeros((BLOCK_N, ROWS), dtype=tl.float32))
            if ADD_NORM:
                tl.store(squares_ptr + pid_n * ROWS + rows, tl.zeros((ROWS,), dtype=tl.float32))
            tl.store(count_ptr + pid_n, 0)
            _rows_epilogue(acc, acc_second, squares, lanes, lane_ok, w_index, second_index, rows, row_ok, K, eps,
                           bias_ptr, out_ptr, out_stride, cos_ptr, sin_ptr, positions_ptr, slots_ptr, k_buf_ptr,
                           v_buf_ptr, num_q_heads, num_kv_heads, scale_ptr, HAS_BIAS, SILU_MUL, ADD_NORM, ROPE,
                           ROW_SCALE, HALF)


@triton.jit
def _rows_input(x_ptr, res_ptr, norm_w_ptr, rows, row_ok, cols, col_ok, K, ADD_NORM: tl.constexpr):
    """The input tile (ROWS, BLOCK_K) in fp32, and each row's sum of squares over it for the
    norm (0 without ADD_NORM): with ADD_NORM, norm_w * (residual + x), unscaled."""
    offsets = rows[:, None] * K + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    raw = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    x = raw.to(tl.float32)
    squares = tl.zeros(rows.shape, dtype=tl.float32)
    if ADD_NORM:
        summed = (raw + tl.load(res_ptr + offsets, mask=mask, other=0.0)).to(tl.float32)  # rounds like torch's add
        squares = tl.sum(summed * summed, axis=1)
        x = tl.load(norm_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :] * summed
    return x, squares


@triton.jit
def _rows_epilogue(acc, acc_second, squares, lanes, lane_ok, w_index, second_index, rows, row_ok, K, eps,
                   bias_ptr, out_ptr, out_stride, cos_ptr, sin_ptr, positions_ptr, slots_ptr, k_buf_ptr,
                   v_buf_ptr, num_q_heads, num_kv_heads, scale_ptr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                   ADD_NORM: tl.constexpr, ROPE: tl.constexpr, ROW_SCALE: tl.constexpr, HALF: tl.constexpr):
    """acc: (BLOCK_N, ROWS) dot products, lane by row. Norm scale, bias, rounding to the
    model dtype (as the unfused matmul rounds before SiLU * up or RoPE), then the output."""
    y, y_second = acc, acc_second
    if ADD_NORM or ROW_SCALE:
        if ADD_NORM:
            inv_rms = tl.rsqrt(squares / K + eps)
        else:
            inv_rms = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
        y *= inv_rms[None, :]
        y_second *= inv_rms[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + w_index, mask=lane_ok, other=0.0).to(tl.float32)[:, None]
        if ROPE:
            y_second += tl.load(bias_ptr + second_index, mask=lane_ok, other=0.0).to(tl.float32)[:, None]
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    y_second = y_second.to(out_ptr.dtype.element_ty).to(tl.float32)
    ok = lane_ok[:, None] & row_ok[None, :]
    if ROPE:
        _rows_rope(y, y_second, lanes, rows, row_ok, ok, out_ptr, out_stride, cos_ptr, sin_ptr, positions_ptr, slots_ptr,
                   k_buf_ptr, v_buf_ptr, num_q_heads, num_kv_heads, HALF)
    else:
        if SILU_MUL:
            y = (y / (1.0 + tl.exp(-y))).to(out_ptr.dtype.element_ty).to(tl.float32) * y_second
        tl.store(out_ptr + rows[None, :] * out_stride + lanes[:, None], y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rows_rope(first, second, lanes, rows, row_ok, ok, q_ptr, q_stride, cos_ptr, sin_ptr, positions_ptr, slots_ptr,
               k_buf_ptr, v_buf_ptr, num_q_heads, num_kv_heads, HALF: tl.constexpr):
    """Lane (head h, dim d) of row r holds qkv[r, h, d] and qkv[r, h, d + HALF]: rotate q and
    k heads at row r's position, write q heads to q_ptr and k, v heads to row r's pool slot."""
    head = (lanes // HALF)[:, None]
    dim = (lanes % HALF)[:, None]
    position = tl.load(positions_ptr + rows, mask=row_ok, other=0).to(tl.int64)[None, :]
    cos = tl.load(cos_ptr + position * HALF + dim, mask=ok, other=0.0)
    sin = tl.load(sin_ptr + position * HALF + dim, mask=ok, other=0.0)
    is_q = head < num_q_heads
    is_v = head >= num_q_heads + num_kv_heads
    is_k = ~is_q & ~is_v
    rotated_first = tl.where(is_v, first, first * cos - second * sin)
    rotated_second = tl.where(is_v, second, second * cos + first * sin)
    q_dest = q_ptr + rows[None, :] * q_stride + head * (2 * HALF) + dim
    tl.store(q_dest, rotated_first.to(q_ptr.dtype.element_ty), mask=ok & is_q)
    tl.store(q_dest + HALF, rotated_second.to(q_ptr.dtype.element_ty), mask=ok & is_q)
    kv_head = tl.where(is_v, head - num_q_heads - num_kv_heads, head - num_q_heads)
    slot = tl.load(slots_ptr + rows, mask=row_ok, other=0).to(tl.int64)[None, :]
    offset = (slot * num_kv_heads + kv_head) * (2 * HALF) + dim
    tl.store(k_buf_ptr + offset, rotated_first.to(k_buf_ptr.dtype.element_ty), mask=ok & is_k)
    tl.store(k_buf_ptr + offset + HALF, rotated_second.to(k_buf_ptr.dtype.element_ty), mask=ok & is_k)
    tl.store(v_buf_ptr + offset, rotated_first.to(v_buf_ptr.dtype.element_ty), mask=ok & is_v)
    tl.store(v_buf_ptr + offset + HALF, rotated_second.to(v_buf_ptr.dtype.element_ty), mask=ok & is_v)


@triton.jit
def _prenorm_kernel(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, normed_ptr, scale_ptr, K, eps,
                    BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """One row: residual + x (rounded as torch adds) written out; norm_w * (residual + x),
    unscaled, in the model dtype as the fused loop rounds it; and the row's rsqrt factor."""
    row = tl.program_id(0).to(tl.int64)
    if USE_PDL:  # the linear behind may start streaming its weights; x is the previous kernel's
        tl.extra.cuda.gdc_launch_dependents()
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    norm_w = tl.load(norm_w_ptr + cols, mask=ok, other=0.0).to(tl.float32)   # a parameter
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    summed = tl.load(x_ptr + row * K + cols, mask=ok, other=0.0) + tl.load(res_ptr + row * K + cols, mask=ok,
                                                                          other=0.0)
    tl.store(res_out_ptr + row * K + cols, summed, mask=ok)
    summed = summed.to(tl.float32)
    tl.store(normed_ptr + row * K + cols, (norm_w * summed).to(normed_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row, tl.rsqrt(tl.sum(summed * summed, axis=0) / K + eps))


def prenorm(x: torch.Tensor, add_norm: AddNorm, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(norm_w * (residual + x) in `dtype`, residual + x, each row's rsqrt factor (float32))."""
    count, k = x.shape
    normed = torch.empty((count, k), dtype=dtype, device=x.device)
    residual_out = torch.empty_like(x)
    scale = torch.empty(count, dtype=torch.float32, device=x.device)
    pdl = uses_pdl(x.device)
    _prenorm_kernel[(count,)](x, add_norm.residual, add_norm.weight, residual_out, normed, scale, k, add_norm.eps,
                              BLOCK=triton.next_power_of_2(k), USE_PDL=pdl, **({"launch_pdl": True} if pdl else {}))
    return normed, residual_out, scale


def padded_rows(rows: int) -> int:
    """The rows a kernel instance computes: tl.dot's smallest width, 16, or a power of two."""
    return max(16, triton.next_power_of_2(rows))


@functools.lru_cache(maxsize=None)
def _workspace(device: torch.device, lane_blocks: int, block_n: int) -> tuple[torch.Tensor, ...]:
    """Partial sums, sums of squares and arrival counts of split lane blocks; zero between
    calls (the last slice of each block clears its part). Sized for MAX_ROWS so any row count
    shares it; calls on one stream run one after another, so kernels may share it."""
    sums = torch.zeros(lane_blocks * 2 * block_n * MAX_ROWS, dtype=torch.float32, device=device)
    squares = torch.zeros(lane_blocks * MAX_ROWS, dtype=torch.float32, device=device)
    counts = torch.zeros(lane_blocks, dtype=torch.int32, device=device)
    return sums, squares, counts


def rows_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
              config: tuple[int, int, int, int, int] = CANDIDATES[0], add_norm: AddNorm | None = None,
              rope: RopeStore | None = None, prenormed: bool = False):
    """x: (R, K) contiguous, R <= MAX_ROWS; weight: (N, K) contiguous. Returns (R, N),
    (R, N / 2) with silu_mul, or q (R, num_q_heads * head_dim) with rope (k and v go to the
    pool slots rope.slots[:R]). With add_norm, returns (output, residual + x), the norm's
    input made by the loop or, `prenormed`, by a kernel of its own first."""
    count, k = x.shape
    if count > MAX_ROWS:
        raise ValueError(f"rows_gemm takes at most {MAX_ROWS} rows, got {count}")
    n = weight.shape[0]
    lanes = n // 2 if silu_mul or rope is not None else n
    block_n, block_k, split, warps, stages = config
    width = rope.num_q_heads * rope.heads[2] if rope is not None else lanes
    out = torch.empty((count, width), dtype=x.dtype, device=x.device)
    scale = None
    if add_norm is not None and prenormed:
        normed, residual_out, scale = prenorm(x, add_norm, weight.dtype)
        x, add_norm = normed, None
    else:
        residual_out = torch.empty_like(x) if add_norm is not None else None
    norm = add_norm or AddNorm(x, x, 0.0)  # unused pointers when there is no norm
    r = rope or RopeStore(x, x, x, x, x, x, 0)  # likewise
    lane_blocks = triton.cdiv(lanes, block_n)
    sums, squares, counts = _workspace(x.device, lane_blocks, block_n) if split > 1 else (x, x, x)
    pdl = uses_pdl(x.device)
    _rows_kernel[(lane_blocks, split)](
        x, weight, bias if bias is not None else weight, out, count, lanes, k, width,
        norm.residual, norm.weight, residual_out if residual_out is not None else out, norm.eps,
        r.cos, r.sin, r.positions, r.slots, r.k_buffer, r.v_buffer, r.num_q_heads, r.heads[1] if rope else 0,
        sums, squares, counts, scale if scale is not None else sums,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, ADD_NORM=add_norm is not None, ROPE=rope is not None,
        ROW_SCALE=scale is not None,
        HALF=r.heads[2] // 2 if rope else 1, BLOCK_N=block_n, BLOCK_K=min(block_k, max(16, triton.next_power_of_2(k))),
        ROWS=padded_rows(count), SPLIT=split, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        USE_PDL=pdl, num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}))
    return out if residual_out is None else (out, residual_out)


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
                add_norm: AddNorm | None = None, rope: RopeStore | None = None):
    """x @ W^T (+ bias) (then silu_mul or rope) for 2-MAX_ROWS CUDA rows, by the fastest
    measured path; with add_norm the input is normalised first and (output, residual + x)
    is returned."""
    choice = best_config(tuple(weight.shape), weight.dtype, bias is not None, silu_mul, add_norm is not None,
                         rope.heads if rope is not None else None, padded_rows(x.shape[0]), weight.device)
    if choice is None:
        return unfused(x, weight, bias, silu_mul, add_norm, rope)
    config, prenormed = choice
    return rows_gemm(x, weight, bias, silu_mul, config, add_norm, rope, prenormed)


@functools.lru_cache(maxsize=None)
def best_config(shape: tuple[int, int], dtype: torch.dtype, has_bias: bool, silu_mul: bool, add_norm: bool,
                rope_heads: tuple[int, int, int] | None, rows: int, device: torch.device):
    """The fastest (tile config, prenormed) for this weight shape and padded row count, or
    None when cuBLAS and the separate kernels are faster."""
    times = candidate_times(shape, dtype, has_bias, silu_mul, add_norm, device, rope_heads, rows)
    logger.info("%d-row matmul %s%s%s%s: %s", rows, shape, " + add_norm" if add_norm else "",
                " + silu_mul" if silu_mul else "", " + rope" if rope_heads else "",
                ", ".join(f"{'cublas' if c is None else c} {t:.1f} us" for c, t in times.items()))
    return min(times, key=times.get)


def candidates_for(lanes: int, rows: int) -> list[tuple[int, int, int, int, int]]:
    """The configs worth timing for a matrix of `lanes` output lanes at `rows` padded rows
    (split K only where the workspace stays small and there are few lane blocks to spread)."""
    return [c for c in (CANDIDATES if rows <= 16 else WIDE_CANDIDATES)
            if c[2] == 1 or (lanes <= MAX_SPLIT_LANES and lanes // c[0] < 1024)]


def candidate_times(shape: tuple[int, int], dtype: torch.dtype, has_bias: bool, silu_mul: bool, add_norm: bool,
                    device: torch.device, rope_heads: tuple[int, int, int] | None = None, rows: int = 16) -> dict:
    """GPU microseconds per call of the unfused path (key None) and each (config, prenormed),
    at `rows` rows, with the weights read from HBM (gemv.timing_inputs). Without a norm,
    prenormed is False only."""
    weights, bias, x, norm, rope = timing_inputs(shape, dtype, has_bias, add_norm, device, rope_heads, rows)
    times = {None: graph_time_us([lambda w=w: unfused(x, w, bias, silu_mul, norm, rope) for w in weights])}
    lanes = shape[0] // 2 if silu_mul or rope_heads else shape[0]
    for config in candidates_for(lanes, rows):
        for prenormed in (False, True) if add_norm else (False,):
            try:
                times[config, prenormed] = graph_time_us(
                    [lambda w=w: rows_gemm(x, w, bias, silu_mul, config, norm, rope, prenormed) for w in weights])
            except Exception as error:  # e.g. a tile that needs more shared memory than this GPU has
                logger.warning("rows config %s failed on %s: %s", config, shape, error)
    return times
