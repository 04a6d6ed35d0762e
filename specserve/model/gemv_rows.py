"""The GEMV of gemv.py for 2..16 rows on a GPU: y = x @ W^T (+ bias) with the same fused
pre-norm, SiLU * up and RoPE + KV-write epilogues, each row with its own norm scale,
position and KV slot. A verify step of a batch-1 request with an 8- or 16-node draft tree,
or a decode step of 2..16 requests, is such a step.

Those rows stream the same weights as one row does, so they should cost about what a
one-row step costs; cuBLAS's small-M GEMMs with separate norm, RoPE/KV-store and SiLU
kernels cost ~2.3x (H100, 1.5B, 8-16 rows). Here each program owns BLOCK_N output lanes
and reads each weight tile once for all rows: a (BLOCK_M, BLOCK_K) tile of inputs, the
rows padded to a power of two, meets a (BLOCK_N, BLOCK_K) weight tile either as a
tensor-core dot (BLOCK_M padded to 16, the smallest tl.dot) or as fp32 FMAs into a
(BLOCK_M, BLOCK_N, BLOCK_K) partial sum reduced once at the end (few rows, small BLOCK_N:
more programs in flight for small matrices). The pre-norm's scale is per row and applied
at the end, as in gemv.py.

Configs are timed per (weight shape, epilogue, row block) against cuBLAS + the unfused
kernels with gemv.candidate_times, the first time a shape is seen: in the warm-up runs
that precede every CUDA graph capture (runner/cuda_graph.py), never inside one.
"""
from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from specserve.model import gemv as one_row
from specserve.model.gemv import AddNorm, RopeStore, _unfused, candidate_times, rope_epilogue
from specserve.pdl import uses_pdl

logger = logging.getLogger(__name__)

ENABLED = True  # False: 2..16-row matmuls go to cuBLAS + the unfused kernels (the A/B of bench.step_cost)
MAX_ROWS = 16
DOT_ROWS = 16   # tl.dot's smallest tile: a dot config pads any row count to 16

# (use_dot, BLOCK_N, BLOCK_K, num_warps, num_stages). FMA configs keep BLOCK_M * BLOCK_N *
# BLOCK_K / threads at <= 64 fp32 partial sums per thread for their row block (FMA_CANDIDATES);
# dot configs hold only a (16, BLOCK_N) accumulator, so wider weight tiles fit.
DOT_CANDIDATES = ((True, 16, 256, 4, 4), (True, 16, 128, 4, 6), (True, 32, 128, 4, 4), (True, 16, 512, 4, 3),
                  (True, 32, 256, 4, 3), (True, 64, 128, 4, 4))
FMA_CANDIDATES = {2: ((False, 4, 512, 4, 3), (False, 2, 512, 4, 4), (False, 8, 256, 4, 4)),
                  4: ((False, 2, 512, 4, 3), (False, 4, 256, 4, 4), (False, 1, 512, 2, 4)),
                  8: ((False, 1, 512, 4, 4), (False, 2, 256, 4, 4), (False, 2, 128, 2, 6)),
                  16: ((False, 1, 256, 4, 4),)}


def row_block(rows: int) -> int:
    """The padded row count an FMA config is compiled for (and the tuning key): 2, 4, 8 or 16."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows={rows}: the multi-row GEMV takes 1..{MAX_ROWS} rows")
    return max(2, triton.next_power_of_2(rows))


def configs_for(rows: int) -> tuple:
    """The configs timed for this many rows: the FMA ones of its row block, then the dot ones."""
    return FMA_CANDIDATES[row_block(rows)] + DOT_CANDIDATES


@triton.jit
def _rows_kernel(x_ptr, input_rows_ptr, w_ptr, bias_ptr, out_ptr, M, N_OUT, K, OUT_WIDTH,
                 res_ptr, norm_w_ptr, res_out_ptr, eps, cos_ptr, sin_ptr, positions_ptr, slots_ptr,
                 k_buf_ptr, v_buf_ptr, num_q_heads, num_kv_heads,
                 HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, ADD_NORM: tl.constexpr, ROPE: tl.constexpr,
                 GATHER: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, IEEE_DOT: tl.constexpr, USE_PDL: tl.constexpr):
    # Lanes and weight rows as in gemv._gemv_kernel; output row m (< M) is input row m, or
    # input row input_rows[m] with GATHER (the lm_head reading only the rows that get logits).
    pid = tl.program_id(0)
    if USE_PDL:  # the next kernel may start (and fetch its own weights) as SMs free up
        tl.extra.cuda.gdc_launch_dependents()
    lanes = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    lane_ok = lanes < N_OUT
    rows = lanes
    if ROPE:
        rows = (lanes // HALF) * (2 * HALF) + lanes % HALF
    second_rows = rows + (HALF if ROPE else N_OUT)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    w_second = w_ptr + second_rows.to(tl.int64)[:, None] * K
    tokens = tl.arange(0, BLOCK_M)
    token_ok = tokens < M
    in_rows = tokens.to(tl.int64)
    if GATHER:
        in_rows = tl.load(input_rows_ptr + tokens, mask=token_ok, other=0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    # The first weight tile is loaded before waiting for the previous kernel (it does not
    # depend on it); the loop below starts at the second.
    first_ok = lane_ok[:, None] & (cols < K)[None, :]
    w_first = tl.load(w_rows + cols[None, :], mask=first_ok, other=0.0)
    w_first_second = w_first
    if SILU_MUL or ROPE:
        w_first_second = tl.load(w_second + cols[None, :], mask=first_ok, other=0.0)
    if USE_PDL:  # x and the residual are the previous kernels' outputs
        tl.extra.cuda.gdc_wait()
    x, squares = _rows_input(x_ptr, res_ptr, norm_w_ptr, in_rows, token_ok, cols, K, ADD_NORM)
    acc = _accumulate(_zero_acc(BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT), w_first, x, USE_DOT, IEEE_DOT)
    acc_second = _zero_acc(BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT)
    if SILU_MUL or ROPE:
        acc_second = _accumulate(acc_second, w_first_second, x, USE_DOT, IEEE_DOT)
    for k in range(BLOCK_K, K, BLOCK_K):
        k_ok = (k + cols) < K
        mask = lane_ok[:, None] & k_ok[None, :]
        x, chunk_squares = _rows_input(x_ptr, res_ptr, norm_w_ptr, in_rows, token_ok, k + cols, K, ADD_NORM)
        squares += chunk_squares
        acc = _accumulate(acc, tl.load(w_rows + k + cols[None, :], mask=mask, other=0.0), x, USE_DOT, IEEE_DOT)
        if SILU_MUL or ROPE:
            acc_second = _accumulate(acc_second, tl.load(w_second + k + cols[None, :], mask=mask, other=0.0), x,
                                     USE_DOT, IEEE_DOT)
    y = _finish(acc, USE_DOT)             # (BLOCK_M, BLOCK_N) fp32
    y_second = _finish(acc_second, USE_DOT)
    if ADD_NORM:
        if pid == 0:  # residual + x out, once (not inside the loop: a branch there would keep it from being pipelined)
            for k in range(0, K, BLOCK_K):
                ok = token_ok[:, None] & ((k + cols) < K)[None, :]
                offsets = in_rows[:, None] * K + k + cols[None, :]
                summed = tl.load(x_ptr + offsets, mask=ok, other=0.0) + tl.load(res_ptr + offsets, mask=ok)
                tl.store(res_out_ptr + tokens[:, None] * K + k + cols[None, :], summed, mask=ok)
        inv_rms = tl.rsqrt(tl.sum(squares, axis=1) / K + eps)[:, None]  # each row's own scale
        y *= inv_rms
        y_second *= inv_rms
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=lane_ok, other=0.0).to(tl.float32)[None, :]
        if ROPE:
            y_second += tl.load(bias_ptr + second_rows, mask=lane_ok, other=0.0).to(tl.float32)[None, :]
    # round to the model dtype first, as the unfused matmul does before SiLU * up or RoPE
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    y_second = y_second.to(out_ptr.dtype.element_ty).to(tl.float32)
    ok = token_ok[:, None] & lane_ok[None, :]
    out_rows = out_ptr + tokens.to(tl.int64)[:, None] * OUT_WIDTH
    if ROPE:
        positions = tl.load(positions_ptr + tokens, mask=token_ok, other=0).to(tl.int64)[:, None]
        slots = tl.load(slots_ptr + tokens, mask=token_ok, other=0).to(tl.int64)[:, None]
        rope_epilogue(y, y_second, lanes[None, :], ok, out_rows, positions, slots, cos_ptr, sin_ptr,
                      k_buf_ptr, v_buf_ptr, num_q_heads, num_kv_heads, HALF)
    else:
        if SILU_MUL:
            y = (y / (1.0 + tl.exp(-y))).to(out_ptr.dtype.element_ty).to(tl.float32) * y_second
        tl.store(out_rows + lanes[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rows_input(x_ptr, res_ptr, norm_w_ptr, in_rows, token_ok, cols, K, ADD_NORM: tl.constexpr):
    """The (BLOCK_M, BLOCK_K) input tile at columns `cols` in fp32, and its squares for the
    norm (0 without ADD_NORM): gemv._gemv_input for every row at once."""
    col_ok = cols < K
    ok = token_ok[:, None] & col_ok[None, :]
    offsets = in_rows[:, None] * K + cols[None, :]
    raw = tl.load(x_ptr + offsets, mask=ok, other=0.0)
    x = raw.to(tl.float32)
    squares = tl.zeros(x.shape, dtype=tl.float32)
    if ADD_NORM:
        summed = (raw + tl.load(res_ptr + offsets, mask=ok, other=0.0)).to(tl.float32)  # rounds like torch's add
        squares = summed * summed
        x = tl.load(norm_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :] * summed
    return x, squares


@triton.jit
def _zero_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr):
    """A dot config sums into (BLOCK_M, BLOCK_N); an FMA config keeps (BLOCK_M, BLOCK_N,
    BLOCK_K) partial sums so its loop body is loads and FMAs only."""
    if USE_DOT:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        return tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)


@triton.jit
def _accumulate(acc, w, x, USE_DOT: tl.constexpr, IEEE_DOT: tl.constexpr):
    """acc += x (BLOCK_M, BLOCK_K) times w (BLOCK_N, BLOCK_K)^T, by the config's method. The
    dot takes x in the weight's dtype (bf16 in, fp32 sums: the rounding cuBLAS's bf16 GEMM
    applies to its input); an fp32 model asks for IEEE fp32 instead of TF32."""
    if USE_DOT:
        if IEEE_DOT:
            return tl.dot(x.to(w.dtype), tl.trans(w), acc, input_precision="ieee")
        else:
            return tl.dot(x.to(w.dtype), tl.trans(w), acc)
    else:
        return acc + w.to(tl.float32)[None, :, :] * x[:, None, :]


@triton.jit
def _finish(acc, USE_DOT: tl.constexpr):
    if USE_DOT:
        return acc
    else:
        return tl.sum(acc, axis=2)


def gemm_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
              config: tuple = DOT_CANDIDATES[0], add_norm: AddNorm | None = None, rope: RopeStore | None = None,
              input_rows: torch.Tensor | None = None):
    """gemv.gemv for M rows: x (rows, K) contiguous, weight (N, K) contiguous; returns
    (M, N), (M, N / 2) with silu_mul, or q (M, num_q_heads * head_dim) with rope (one
    position and slot per row); with add_norm, (output, residual + x). input_rows (M,): the
    rows of x (and of the residual) to compute, M <= 16 (default: all of them)."""
    x = x.contiguous()
    m = x.shape[0] if input_rows is None else input_rows.shape[0]
    n, k = weight.shape
    lanes = n // 2 if silu_mul or rope is not None else n
    use_dot, block_n, block_k, warps, stages = config
    width = rope.num_q_heads * rope.heads[2] if rope is not None else lanes
    out = torch.empty((m, width), dtype=x.dtype, device=x.device)
    residual_out = torch.empty((m, k), dtype=x.dtype, device=x.device) if add_norm is not None else None
    norm = add_norm or AddNorm(x, x, 0.0)  # unused pointers when there is no norm
    r = rope or RopeStore(x, x, x, x, x, x, 0)  # likewise
    pdl = uses_pdl(x.device)
    _rows_kernel[(triton.cdiv(lanes, block_n),)](
        x, input_rows if input_rows is not None else x, weight, bias if bias is not None else weight, out,
        m, lanes, k, width, norm.residual.contiguous(), norm.weight,
        residual_out if residual_out is not None else out, norm.eps,
        r.cos, r.sin, r.positions, r.slots, r.k_buffer, r.v_buffer, r.num_q_heads, r.heads[1] if rope else 0,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, ADD_NORM=add_norm is not None, ROPE=rope is not None,
        GATHER=input_rows is not None, HALF=r.heads[2] // 2 if rope else 1,
        BLOCK_M=DOT_ROWS if use_dot else row_block(m), BLOCK_N=block_n,
        BLOCK_K=max(16, min(block_k, triton.next_power_of_2(k))), USE_DOT=use_dot,
        IEEE_DOT=weight.dtype == torch.float32, USE_PDL=pdl, num_warps=warps, num_stages=stages,
        **({"launch_pdl": True} if pdl else {}))
    return out if add_norm is None else (out, residual_out)


def takes_rows(rows: int) -> bool:
    """Whether a CUDA matmul of `rows` rows goes through the GEMV kernels (gemv.py for one
    row, this file for 2..16), each with its own switch for A/B runs."""
    return one_row.ENABLED if rows == 1 else ENABLED and 2 <= rows <= MAX_ROWS


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
                add_norm: AddNorm | None = None, rope: RopeStore | None = None,
                input_rows: torch.Tensor | None = None):
    """x @ W^T (+ bias) (then silu_mul or rope) for 1..16 CUDA rows by the fastest measured
    path: gemv.py's kernel for one row, gemm_rows, or cuBLAS + the unfused kernels. With
    add_norm the input is normalised first and (output, residual + x) is returned."""
    if x.shape[0] == 1:  # input_rows can only be [0]
        return one_row.one_row_linear(x, weight, bias, silu_mul, add_norm, rope)
    rows = x.shape[0] if input_rows is None else input_rows.shape[0]
    config = best_config(tuple(weight.shape), weight.dtype, bias is not None, silu_mul, add_norm is not None,
                         rope.heads if rope is not None else None, row_block(rows), weight.device)
    if config is None:
        if input_rows is not None:
            x = x[input_rows]
            if add_norm is not None:
                add_norm = AddNorm(add_norm.residual[input_rows], add_norm.weight, add_norm.eps)
        return _unfused(x, weight, bias, silu_mul, add_norm, rope)
    return gemm_rows(x, weight, bias, silu_mul, config, add_norm, rope, input_rows)


@functools.lru_cache(maxsize=None)
def best_config(shape: tuple[int, int], dtype: torch.dtype, has_bias: bool, silu_mul: bool, add_norm: bool,
                rope_heads: tuple[int, int, int] | None, rows: int, device: torch.device) -> tuple | None:
    """The fastest config for `rows` rows (a row block: every row count it pads to is timed
    at its largest) of this weight shape, or None when cuBLAS + the unfused kernels win."""
    times = candidate_times(shape, dtype, has_bias, silu_mul, add_norm, device, rope_heads, rows=rows,
                            kernel=gemm_rows, configs=configs_for(rows))
    logger.info("%d-row matmul %s%s%s%s: %s", rows, shape, " + add_norm" if add_norm else "",
                " + silu_mul" if silu_mul else "", " + rope" if rope_heads else "",
                ", ".join(f"{'cublas' if k is None else k} {v:.1f} us" for k, v in times.items()))
    return min(times, key=times.get)
