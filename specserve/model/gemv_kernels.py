"""The Triton kernels behind gemv.py: y = x @ W^T (+ bias) for 1..16 rows of x, with the
decoder's pre-norm fused in front and SiLU * up or RoPE + the KV-pool write fused behind.

One row (`_gemv_kernel`): each program owns BLOCK_N output lanes and walks K in BLOCK_K
chunks with a (BLOCK_N, BLOCK_K) fp32 partial sum reduced once at the end, so the loop body
is loads and FMAs only. The pre-norm costs no pass of its own: rmsnorm(s) * w . W_row =
rsqrt(mean(s^2) + eps) * ((w * s) . W_row), so the loop accumulates (w * s) . W_row and
s^2 together and scales at the end. A lane that needs two weight rows (gate and up; dims d
and d + head_dim / 2 of a head for RoPE) keeps two sums.

A few rows (`_rows_kernel`, 2..16: a decode step of a few requests, a small verify tree):
the same, but each weight tile is loaded once and meets every row, so M rows stream the
weights once, as one row does. A tile meets the rows either as fp32 FMAs into a (ROWS,
BLOCK_N, BLOCK_K) partial sum (ROWS: M padded to a power of two) or as a tensor-core
tl.dot with the rows padded to 16 (its smallest tile); each row has its own norm scale,
position and KV slot.

Both launch with programmatic dependent launch (pdl.py) where the GPU has it: they load
their first weight columns before waiting for the previous kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from specserve.pdl import uses_pdl

DOT_ROWS = 16  # tl.dot's smallest tile side: a dot config computes 16 rows, those past M masked


class TileConfig(NamedTuple):
    """BLOCK_N output lanes per program, BLOCK_K weight columns per loop step, warps and
    pipeline stages; dot: (few rows only) the rows meet a weight tile in tl.dot, padded to
    16 rows, instead of fp32 FMAs."""
    block_n: int
    block_k: int
    warps: int
    stages: int
    dot: bool = False

    @property
    def label(self) -> str:
        return f"{'dot' if self.dot else ''}{self.block_n}x{self.block_k}w{self.warps}s{self.stages}"


@dataclass(frozen=True)
class AddNorm:
    """A GEMV input given as rmsnorm(residual + x) * weight, the pre-norm of a decoder block."""
    residual: torch.Tensor   # (rows, K), like x
    weight: torch.Tensor     # (K,)
    eps: float


@dataclass(frozen=True)
class RopeStore:
    """The qkv GEMV's epilogue: of the q, k and v heads it computes, q and k are rotated
    (rotate-half RoPE at each row's position) and q is returned, k and v go into each row's
    KV-pool slot, as fused_ops.rope_and_store does after an unfused matmul."""
    cos: torch.Tensor        # (max_positions, head_dim / 2) fp32
    sin: torch.Tensor
    positions: torch.Tensor  # (rows,) contiguous
    slots: torch.Tensor      # (rows,) contiguous
    k_buffer: torch.Tensor   # (pool slots, num_kv_heads, head_dim)
    v_buffer: torch.Tensor
    num_q_heads: int

    @property
    def heads(self) -> tuple[int, int, int]:
        """(num_q_heads, num_kv_heads, head_dim): what the tile timing depends on."""
        return self.num_q_heads, self.k_buffer.shape[1], self.k_buffer.shape[2]


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N_OUT, K, res_ptr, norm_w_ptr, res_out_ptr, eps,
                 cos_ptr, sin_ptr, positions_ptr, slots_ptr, k_buf_ptr, v_buf_ptr, num_q_heads, num_kv_heads,
                 HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, ADD_NORM: tl.constexpr, ROPE: tl.constexpr,
                 HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH_K: tl.constexpr,
                 USE_PDL: tl.constexpr):
    # N_OUT output lanes; a lane reads two weight rows with SILU_MUL (gate row, up row
    # N_OUT further) and with ROPE (dims d and d + HALF of one head), one row otherwise.
    # ADD_NORM: the input is rmsnorm(residual + x) * norm_w; program 0 writes residual + x out.
    pid = tl.program_id(0)
    if USE_PDL:  # the next kernel may start (and fetch its own weights) as SMs free up
        tl.extra.cuda.gdc_launch_dependents()
    lanes, lane_ok, rows, second_rows, w_rows, w_second = _lanes(w_ptr, pid, N_OUT, K, ROPE, HALF, BLOCK_N)
    # The first PREFETCH_K weight columns are loaded before waiting for the previous kernel:
    # they do not depend on it, so with PDL they stream in while it finishes.
    pre = tl.arange(0, PREFETCH_K)
    pre_ok = pre < K
    w_pre = tl.load(w_rows + pre[None, :], mask=lane_ok[:, None] & pre_ok[None, :], other=0.0)
    w_pre_second = w_pre
    if SILU_MUL or ROPE:
        w_pre_second = tl.load(w_second + pre[None, :], mask=lane_ok[:, None] & pre_ok[None, :], other=0.0)
    if USE_PDL:  # x and the residual are the previous kernels' outputs
        tl.extra.cuda.gdc_wait()
    x_pre, squares_pre = _gemv_input(x_ptr, res_ptr, norm_w_ptr, pre, pre_ok, pre, pre_ok, ADD_NORM)
    y = tl.sum(w_pre.to(tl.float32) * x_pre[None, :], axis=1)
    y_second = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if SILU_MUL or ROPE:
        y_second = tl.sum(w_pre_second.to(tl.float32) * x_pre[None, :], axis=1)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_second = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k in range(PREFETCH_K, K, BLOCK_K):
        k_mask = (k + cols) < K
        mask = lane_ok[:, None] & k_mask[None, :]
        x, chunk_squares = _gemv_input(x_ptr, res_ptr, norm_w_ptr, k + cols, k_mask, k + cols, k_mask, ADD_NORM)
        squares += chunk_squares
        acc += tl.load(w_rows + k + cols[None, :], mask=mask, other=0.0).to(tl.float32) * x[None, :]
        if SILU_MUL or ROPE:
            acc_second += tl.load(w_second + k + cols[None, :], mask=mask, other=0.0).to(tl.float32) * x[None, :]
    y += tl.sum(acc, axis=1)
    y_second += tl.sum(acc_second, axis=1)
    if ADD_NORM:
        if pid == 0:  # not inside the loop above: a branch there would keep it from being pipelined
            _store_residual(x_ptr, res_ptr, res_out_ptr, 0, 0, True, K, BLOCK_K)
        inv_rms = tl.rsqrt((tl.sum(squares_pre, axis=0) + tl.sum(squares, axis=0)) / K + eps)
        y *= inv_rms
        y_second *= inv_rms
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=lane_ok, other=0.0).to(tl.float32)
        if ROPE:
            y_second += tl.load(bias_ptr + second_rows, mask=lane_ok, other=0.0).to(tl.float32)
    # round to the model dtype first, as the unfused matmul does before SiLU * up or RoPE
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    y_second = y_second.to(out_ptr.dtype.element_ty).to(tl.float32)
    if ROPE:
        _rope_epilogue(y, y_second, lanes, lane_ok, out_ptr, positions_ptr, slots_ptr, cos_ptr, sin_ptr,
                       k_buf_ptr, v_buf_ptr, num_q_heads, num_kv_heads, HALF)
    else:
        _store_output(y, y_second, out_ptr + lanes, lane_ok, SILU_MUL)


@triton.jit
def _rows_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N_OUT, K, res_ptr, norm_w_ptr, res_out_ptr, eps,
                 cos_ptr, sin_ptr, positions_ptr, slots_ptr, k_buf_ptr, v_buf_ptr, num_q_heads, num_kv_heads,
                 input_rows_ptr, M, OUT_WIDTH,
                 HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, ADD_NORM: tl.constexpr, ROPE: tl.constexpr,
                 HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                 GATHER: tl.constexpr, ROWS: tl.constexpr, DOT: tl.constexpr, IEEE_DOT: tl.constexpr,
                 STAGES: tl.constexpr):
    # _gemv_kernel for M <= ROWS rows of x (row stride K): output row m is input row m, or
    # input row input_rows[m] with GATHER (the lm_head reading only the rows that get logits).
    # The first weight tile is the one loaded before the wait; the loop starts at the second.
    pid = tl.program_id(0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    lanes, lane_ok, rows, second_rows, w_rows, w_second = _lanes(w_ptr, pid, N_OUT, K, ROPE, HALF, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    first_ok = lane_ok[:, None] & (cols < K)[None, :]
    w_first = tl.load(w_rows + cols[None, :], mask=first_ok, other=0.0)
    w_first_second = w_first
    if SILU_MUL or ROPE:
        w_first_second = tl.load(w_second + cols[None, :], mask=first_ok, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    tokens = tl.arange(0, ROWS)
    token_ok = tokens < M
    in_rows = tokens.to(tl.int64)
    if GATHER:
        in_rows = tl.load(input_rows_ptr + tokens, mask=token_ok, other=0).to(tl.int64)
    x_rows = in_rows[:, None] * K   # (ROWS, 1) offsets of the input rows
    first_cols_ok = cols < K
    x, squares = _gemv_input(x_ptr, res_ptr, norm_w_ptr, x_rows + cols[None, :],
                             token_ok[:, None] & first_cols_ok[None, :], cols, first_cols_ok, ADD_NORM)
    acc = _accumulate(_zero_sums(ROWS, BLOCK_N, BLOCK_K, DOT), w_first, x, DOT, IEEE_DOT)
    acc_second = _zero_sums(ROWS, BLOCK_N, BLOCK_K, DOT)
    if SILU_MUL or ROPE:
        acc_second = _accumulate(acc_second, w_first_second, x, DOT, IEEE_DOT)
    for k in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):  # loads pipelined, STAGES - 1 tiles ahead
        col_ok = (k + cols) < K
        mask = lane_ok[:, None] & col_ok[None, :]
        x, chunk_squares = _gemv_input(x_ptr, res_ptr, norm_w_ptr, x_rows + k + cols[None, :],
                                       token_ok[:, None] & col_ok[None, :], k + cols, col_ok, ADD_NORM)
        if ADD_NORM:  # (without it the sum is dead, but a loop-carried (ROWS, BLOCK_K) may keep its registers)
            squares += chunk_squares
        acc = _accumulate(acc, tl.load(w_rows + k + cols[None, :], mask=mask, other=0.0), x, DOT, IEEE_DOT)
        if SILU_MUL or ROPE:
            acc_second = _accumulate(acc_second, tl.load(w_second + k + cols[None, :], mask=mask, other=0.0), x,
                                     DOT, IEEE_DOT)
    y = _row_sums(acc, DOT)   # (ROWS, BLOCK_N) fp32
    y_second = _row_sums(acc_second, DOT)
    out_rows = tokens.to(tl.int64)[:, None]
    if ADD_NORM:
        if pid == 0:
            _store_residual(x_ptr, res_ptr, res_out_ptr, x_rows, out_rows * K, token_ok[:, None], K, BLOCK_K)
        inv_rms = tl.rsqrt(tl.sum(squares, axis=1) / K + eps)[:, None]   # each row its own scale
        y *= inv_rms
        y_second *= inv_rms
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=lane_ok, other=0.0).to(tl.float32)[None, :]
        if ROPE:
            y_second += tl.load(bias_ptr + second_rows, mask=lane_ok, other=0.0).to(tl.float32)[None, :]
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    y_second = y_second.to(out_ptr.dtype.element_ty).to(tl.float32)
    ok = token_ok[:, None] & lane_ok[None, :]
    if ROPE:  # rows past M read row M - 1's position and slot; their stores are masked
        valid_rows = tl.minimum(out_rows, M - 1)
        _rope_epilogue(y, y_second, lanes[None, :], ok, out_ptr + out_rows * OUT_WIDTH, positions_ptr + valid_rows,
                       slots_ptr + valid_rows, cos_ptr, sin_ptr, k_buf_ptr, v_buf_ptr, num_q_heads, num_kv_heads, HALF)
    else:
        _store_output(y, y_second, out_ptr + out_rows * OUT_WIDTH + lanes[None, :], ok, SILU_MUL)


@triton.jit
def _lanes(w_ptr, pid, N_OUT, K, ROPE: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output lanes, which are valid, their weight rows (first and second:
    the up row N_OUT further, or with ROPE dim d + HALF of the same head) and row pointers."""
    lanes = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    lane_ok = lanes < N_OUT
    rows = lanes
    if ROPE:
        rows = (lanes // HALF) * (2 * HALF) + lanes % HALF
    second_rows = rows + (HALF if ROPE else N_OUT)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    w_second = w_ptr + second_rows.to(tl.int64)[:, None] * K
    return lanes, lane_ok, rows, second_rows, w_rows, w_second


@triton.jit
def _gemv_input(x_ptr, res_ptr, norm_w_ptr, offsets, ok, cols, col_ok, ADD_NORM: tl.constexpr):
    """The input at `offsets` of x (and of the residual: same layout) in fp32, and its squares
    for the norm (0 without ADD_NORM); `cols` are their columns (the norm weight's index).
    With ADD_NORM, one pass: rmsnorm's scale is a scalar per row, so the caller applies it to
    the dot products at the end (no serial norm loop before the weights start streaming)."""
    raw = tl.load(x_ptr + offsets, mask=ok, other=0.0)
    x = raw.to(tl.float32)
    squares = tl.zeros(offsets.shape, dtype=tl.float32)
    if ADD_NORM:
        summed = (raw + tl.load(res_ptr + offsets, mask=ok, other=0.0)).to(tl.float32)  # rounds like torch's add
        squares = summed * summed
        x = tl.load(norm_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) * summed
    return x, squares


@triton.jit
def _store_residual(x_ptr, res_ptr, res_out_ptr, in_offsets, out_offsets, row_ok, K, BLOCK_K: tl.constexpr):
    """residual + x, rounded like torch's add, written out (in_offsets / out_offsets: where
    the rows start in x / in the output, 0 for one row)."""
    cols = tl.arange(0, BLOCK_K)
    for k in range(0, K, BLOCK_K):
        ok = ((k + cols) < K) & row_ok
        summed = tl.load(x_ptr + in_offsets + k + cols, mask=ok, other=0.0) + tl.load(res_ptr + in_offsets + k + cols,
                                                                                       mask=ok)
        tl.store(res_out_ptr + out_offsets + k + cols, summed, mask=ok)


@triton.jit
def _zero_sums(ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """A dot config sums into (ROWS, BLOCK_N); an FMA config keeps (ROWS, BLOCK_N, BLOCK_K)
    partial sums, reduced once after the loop, so its loop body is loads and FMAs only."""
    if DOT:
        return tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    else:
        return tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)


@triton.jit
def _accumulate(acc, w, x, DOT: tl.constexpr, IEEE_DOT: tl.constexpr):
    """acc += x (ROWS, BLOCK_K) times w (BLOCK_N, BLOCK_K)^T. The dot takes x in the weight's
    dtype (bf16 in, fp32 sums: the rounding cuBLAS's bf16 GEMM applies to its input); an
    fp32 model asks for IEEE fp32 instead of TF32."""
    if DOT:
        if IEEE_DOT:
            return tl.dot(x.to(w.dtype), tl.trans(w), acc, input_precision="ieee")
        else:
            return tl.dot(x.to(w.dtype), tl.trans(w), acc)
    else:
        return acc + w.to(tl.float32)[None, :, :] * x[:, None, :]


@triton.jit
def _row_sums(acc, DOT: tl.constexpr):
    if DOT:
        return acc
    else:
        return tl.sum(acc, axis=2)


@triton.jit
def _store_output(y, y_second, dest, ok, SILU_MUL: tl.constexpr):
    """y, or SiLU(y) * y_second (SiLU rounded to the dtype first, as fused_ops.silu_mul does)."""
    if SILU_MUL:
        y = (y / (1.0 + tl.exp(-y))).to(dest.dtype.element_ty).to(tl.float32) * y_second
    tl.store(dest, y.to(dest.dtype.element_ty), mask=ok)


@triton.jit
def _rope_epilogue(first, second, lanes, ok, q_rows, position_ptrs, slot_ptrs, cos_ptr, sin_ptr,
                   k_buf_ptr, v_buf_ptr, num_q_heads, num_kv_heads, HALF: tl.constexpr):
    """Lane (head h, dim d) holds qkv[h, d] and qkv[h, d + HALF]: rotate q and k heads as
    fused_ops.rope_and_store does, then write q heads at q_rows (where each row's q starts),
    k and v heads to the pool. One row: scalar pointers; rows: (ROWS, 1) pointers to each
    row's q, position and slot."""
    head = lanes // HALF
    dim = lanes % HALF
    position = tl.load(position_ptrs).to(tl.int64)
    cos = tl.load(cos_ptr + position * HALF + dim)
    sin = tl.load(sin_ptr + position * HALF + dim)
    is_q = head < num_q_heads
    is_v = head >= num_q_heads + num_kv_heads
    is_k = ~is_q & ~is_v
    rotated_first = tl.where(is_v, first, first * cos - second * sin)
    rotated_second = tl.where(is_v, second, second * cos + first * sin)
    q_dest = q_rows + head * (2 * HALF) + dim
    tl.store(q_dest, rotated_first.to(q_rows.dtype.element_ty), mask=ok & is_q)
    tl.store(q_dest + HALF, rotated_second.to(q_rows.dtype.element_ty), mask=ok & is_q)
    kv_head = tl.where(is_v, head - num_q_heads - num_kv_heads, head - num_q_heads)
    slot = tl.load(slot_ptrs).to(tl.int64)
    offset = (slot * num_kv_heads + kv_head) * (2 * HALF) + dim
    tl.store(k_buf_ptr + offset, rotated_first.to(k_buf_ptr.dtype.element_ty), mask=ok & is_k)
    tl.store(k_buf_ptr + offset + HALF, rotated_second.to(k_buf_ptr.dtype.element_ty), mask=ok & is_k)
    tl.store(v_buf_ptr + offset, rotated_first.to(v_buf_ptr.dtype.element_ty), mask=ok & is_v)
    tl.store(v_buf_ptr + offset + HALF, rotated_second.to(v_buf_ptr.dtype.element_ty), mask=ok & is_v)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool, config: TileConfig,
         add_norm: AddNorm | None = None, rope: RopeStore | None = None, input_rows: torch.Tensor | None = None):
    """x: (M, K) with 1 <= M <= 16 rows, weight: (N, K) contiguous; returns (M, N), (M, N / 2)
    with silu_mul, or q (M, num_q_heads * head_dim) with rope (a position and slot per row).
    With add_norm, returns (output, residual + x). input_rows (L,): compute only these rows
    of x (and of the residual), output row i being input row input_rows[i]. One row without
    input_rows takes the one-row kernel; anything else the rows kernel."""
    rows = x.shape[0] if input_rows is None else input_rows.shape[0]
    one_row = rows == 1 and input_rows is None
    n, k = weight.shape
    two_sums = silu_mul or rope is not None
    lanes = n // 2 if two_sums else n
    width = rope.num_q_heads * rope.heads[2] if rope is not None else lanes
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    residual_out = torch.empty((rows, k), dtype=x.dtype, device=x.device) if add_norm is not None else None
    norm = add_norm or AddNorm(x, x, 0.0)  # unused pointers when there is no norm
    r = rope or RopeStore(x, x, x, x, x, x, 0)  # likewise
    pdl = uses_pdl(x.device)
    # the rows kernel reads x and the residual with row stride K
    x, residual = (x, norm.residual) if one_row else (x.contiguous(), norm.residual.contiguous())
    args = (x, weight, bias if bias is not None else weight, out, lanes, k, residual, norm.weight,
            residual_out if residual_out is not None else out, norm.eps,
            r.cos, r.sin, r.positions, r.slots, r.k_buffer, r.v_buffer, r.num_q_heads, r.heads[1] if rope else 0)
    flags = dict(HAS_BIAS=bias is not None, SILU_MUL=silu_mul, ADD_NORM=add_norm is not None, ROPE=rope is not None,
                 HALF=r.heads[2] // 2 if rope else 1, BLOCK_N=config.block_n, USE_PDL=pdl,
                 num_warps=config.warps, num_stages=config.stages, **({"launch_pdl": True} if pdl else {}))
    grid = (triton.cdiv(lanes, config.block_n),)
    if one_row:
        _gemv_kernel[grid](*args, BLOCK_K=min(config.block_k, triton.next_power_of_2(k)),
                           PREFETCH_K=prefetch_columns(k, config.block_n * (2 if two_sums else 1), config.warps),
                           **flags)
    else:
        _rows_kernel[grid](*args, input_rows if input_rows is not None else x, rows, width,
                           BLOCK_K=max(16, min(config.block_k, triton.next_power_of_2(k))),
                           GATHER=input_rows is not None, ROWS=kernel_rows(rows, config), DOT=config.dot,
                           IEEE_DOT=weight.dtype == torch.float32, STAGES=config.stages, **flags)
    return out if add_norm is None else (out, residual_out)


def kernel_rows(rows: int, config: TileConfig) -> int:
    """The row count the rows kernel is compiled for: 16 for a dot, else M padded to a power of two."""
    return DOT_ROWS if config.dot else max(2, triton.next_power_of_2(rows))


def prefetch_columns(k: int, rows: int, warps: int) -> int:
    """Weight columns the one-row kernel loads before waiting for the previous kernel: all of
    K when its `rows` weight rows fit in ~64 values per thread (the rest streams through the
    K loop)."""
    fits = 64 * 32 * warps // rows
    return max(16, min(triton.next_power_of_2(k), 1 << (fits.bit_length() - 1)))
