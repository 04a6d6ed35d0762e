"""The GEMV of gemv.py for 2..16 rows on a GPU: y = x @ W^T (+ bias) with the same fused
pre-norm, SiLU * up and RoPE + KV-write epilogues, each row with its own norm scale,
position and KV slot. A verify step of a batch-1 request with an 8- or 16-node draft tree,
or a decode step of 2..16 requests, is such a step.

Those rows stream the same weights as one row does, so they should cost about what a
one-row step costs; cuBLAS's small-M GEMMs with separate norm, RoPE/KV-store and SiLU
kernels cost ~2.3x (H100, 1.5B, 8-16 rows). Each program owns BLOCK_N output lanes and
reads each weight tile once for all rows, combining a (BLOCK_M, BLOCK_K) input tile (rows
padded to a power of two) with a (BLOCK_N, BLOCK_K) weight tile in one of three ways:

  fma:  fp32 FMAs into (BLOCK_M, BLOCK_N, BLOCK_K) partial sums reduced once at the end,
        like gemv.py (few rows: no padding to 16, small BLOCK_N, many programs);
  dot:  a tensor-core dot with the rows as the MMA's M side, padded to 16 (tl.dot's
        smallest). An earlier kernel of only this kind lost to cuBLAS on qkv/gate_up/down
        (BENCHMARKS.md, H100 session 2): it runs Ampere-style 16-row mma tiles;
  wdot: the weight as the M side (BLOCK_N >= 64 lanes) and the rows as N = 16, the layout
        cuBLAS's small-M kernels use (nvjet 256x8) and one Hopper's wgmma can take.

and optionally split-K (SPLIT_K programs per lane block, for the narrow matrices, o_proj,
down_proj, qkv, whose lane blocks alone leave most SMs idle): each program adds its partial
sums (and its rows' partial sums of squares) into an fp32 workspace with atomics, and the
last of a block's programs (a per-block counter) takes the totals, resets the workspace to
zero for the next call, and runs the epilogue. The workspace is allocated once per device,
outside any CUDA graph, and shared by every split-K call: calls on one stream never overlap
in it (a PDL successor touches it only after gdc_wait), so split-K kernels must not run on
two streams at once.

Configs are timed per (weight shape, epilogue, row block) against cuBLAS + the unfused
kernels with gemv.candidate_times, which also drops a config whose output disagrees with
the unfused path's; timing happens the first time a shape is seen, in the warm-up runs that
precede every CUDA graph capture (runner/cuda_graph.py), never inside one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.model.gemv import AddNorm, RopeStore, lane_rows, rope_epilogue
from specserve.pdl import uses_pdl

MAX_ROWS = 16
DOT_ROWS = 16   # tl.dot's smallest tile: the dot configs pad any row count to 16
MODES = {"fma": 0, "dot": 1, "wdot": 2}
WORKSPACE_FLOATS = 1 << 20   # split-K partial sums, 4 MiB per device
WORKSPACE_COUNTERS = 4096    # one per lane block

# (mode, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages). FMA configs keep BLOCK_M * BLOCK_N *
# BLOCK_K / threads at <= 64 fp32 partial sums per thread for their row block, and BLOCK_N
# near BLOCK_M: every program re-reads all rows' inputs from L2, M / BLOCK_N times the bytes
# of its weights.
FMA_CANDIDATES = {2: (("fma", 4, 512, 1, 4, 3), ("fma", 2, 512, 1, 4, 4), ("fma", 8, 256, 1, 4, 4)),
                  4: (("fma", 4, 256, 1, 4, 4), ("fma", 8, 128, 1, 4, 4), ("fma", 4, 512, 1, 8, 3)),
                  8: (("fma", 8, 128, 1, 4, 4), ("fma", 4, 256, 1, 4, 4), ("fma", 8, 256, 1, 8, 3)),
                  16: (("fma", 8, 128, 1, 8, 4),)}
DOT_CANDIDATES = (("dot", 16, 256, 1, 4, 4), ("dot", 32, 128, 1, 4, 4), ("dot", 64, 128, 1, 4, 4),
                  ("dot", 16, 256, 4, 4, 4),
                  ("wdot", 64, 128, 1, 4, 4), ("wdot", 128, 128, 1, 4, 3), ("wdot", 64, 128, 4, 4, 4),
                  ("wdot", 64, 128, 8, 4, 6), ("wdot", 64, 256, 8, 4, 3), ("wdot", 128, 64, 4, 4, 4))


def row_block(rows: int) -> int:
    """The padded row count an FMA config is compiled for (and the tuning key): 2, 4, 8 or 16."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows={rows}: the multi-row GEMV takes 1..{MAX_ROWS} rows")
    return max(2, triton.next_power_of_2(rows))


def configs_for(rows: int) -> tuple:
    """The configs timed for this many rows: the FMA ones of its row block, then the dot ones."""
    return FMA_CANDIDATES[row_block(rows)] + DOT_CANDIDATES


_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def split_k_workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partial sums, int32 counters) for split-K configs, zero between calls; created
    on first use, which must not be inside a CUDA graph capture (its memory would belong to
    the graph's pool)."""
    if device not in _workspaces:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the split-K workspace must exist before CUDA graph capture (call best_config first)")
        _workspaces[device] = (torch.zeros(WORKSPACE_FLOATS, dtype=torch.float32, device=device),
                               torch.zeros(WORKSPACE_COUNTERS, dtype=torch.int32, device=device))
    return _workspaces[device]


@triton.jit
def _rows_kernel(x_ptr, input_rows_ptr, w_ptr, bias_ptr, out_ptr, M, N_OUT, K, K_PER_SPLIT, OUT_WIDTH,
                 res_ptr, norm_w_ptr, res_out_ptr, eps, cos_ptr, sin_ptr, positions_ptr, slots_ptr,
                 k_buf_ptr, v_buf_ptr, num_q_heads, num_kv_heads, workspace_ptr, counters_ptr,
                 HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, ADD_NORM: tl.constexpr, ROPE: tl.constexpr,
                 GATHER: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, MODE: tl.constexpr, IEEE_DOT: tl.constexpr,
                 USE_PDL: tl.constexpr):
    # Lanes and weight rows as in gemv._gemv_kernel; output row m (< M) is input row m, or
    # input row input_rows[m] with GATHER (the lm_head reading only the rows that get logits).
    # Program (pid, split) covers lanes [pid * BLOCK_N, +BLOCK_N) over K [split * K_PER_SPLIT, +K_PER_SPLIT).
    pid = tl.program_id(0)
    split = tl.program_id(1)
    if USE_PDL:  # the next kernel may start (and fetch its own weights) as SMs free up
        tl.extra.cuda.gdc_launch_dependents()
    lanes, lane_ok, rows, second_rows = lane_rows(pid, N_OUT, ROPE, HALF, BLOCK_N)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    w_second = w_ptr + second_rows.to(tl.int64)[:, None] * K
    tokens = tl.arange(0, BLOCK_M)
    token_ok = tokens < M
    in_rows = tokens.to(tl.int64)
    if GATHER:
        in_rows = tl.load(input_rows_ptr + tokens, mask=token_ok, other=0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    # The first weight tile is loaded before waiting for the previous kernel (it does not
    # depend on it); the loop below starts at the second.
    first_ok = lane_ok[:, None] & (k_start + cols < k_end)[None, :]
    w_first = tl.load(w_rows + k_start + cols[None, :], mask=first_ok, other=0.0)
    w_first_second = w_first
    if SILU_MUL or ROPE:
        w_first_second = tl.load(w_second + k_start + cols[None, :], mask=first_ok, other=0.0)
    if USE_PDL:  # x and the residual are the previous kernels' outputs
        tl.extra.cuda.gdc_wait()
    x, squares = _rows_input(x_ptr, res_ptr, norm_w_ptr, in_rows, token_ok, k_start + cols, k_end, K, ADD_NORM)
    acc = _accumulate(_zero_acc(BLOCK_M, BLOCK_N, BLOCK_K, MODE), w_first, x, MODE, IEEE_DOT)
    acc_second = _zero_acc(BLOCK_M, BLOCK_N, BLOCK_K, MODE)
    if SILU_MUL or ROPE:
        acc_second = _accumulate(acc_second, w_first_second, x, MODE, IEEE_DOT)
    for k in range(k_start + BLOCK_K, k_end, BLOCK_K):
        mask = lane_ok[:, None] & ((k + cols) < k_end)[None, :]
        x, chunk_squares = _rows_input(x_ptr, res_ptr, norm_w_ptr, in_rows, token_ok, k + cols, k_end, K, ADD_NORM)
        squares += chunk_squares
        acc = _accumulate(acc, tl.load(w_rows + k + cols[None, :], mask=mask, other=0.0), x, MODE, IEEE_DOT)
        if SILU_MUL or ROPE:
            acc_second = _accumulate(acc_second, tl.load(w_second + k + cols[None, :], mask=mask, other=0.0), x,
                                     MODE, IEEE_DOT)
    y = _finish(acc, MODE)                 # (BLOCK_M, BLOCK_N) fp32
    y_second = _finish(acc_second, MODE)
    row_squares = tl.sum(squares, axis=1)  # (BLOCK_M,) over this program's K range
    ok = token_ok[:, None] & lane_ok[None, :]
    if SPLIT_K > 1:  # the block's last program carries on with the totals; the others store nothing
        y, y_second, row_squares, last = _split_k_total(y, y_second, row_squares, workspace_ptr, counters_ptr, pid,
                                                        SILU_MUL or ROPE, SPLIT_K, BLOCK_M, BLOCK_N)
        ok = ok & last
    if ADD_NORM:
        if (pid == 0) & (split == 0):  # residual + x out, once (not in the loop: a branch there keeps it from pipelining)
            for k in range(0, K, BLOCK_K):
                in_ok = token_ok[:, None] & ((k + cols) < K)[None, :]
                offsets = in_rows[:, None] * K + k + cols[None, :]
                summed = tl.load(x_ptr + offsets, mask=in_ok, other=0.0) + tl.load(res_ptr + offsets, mask=in_ok)
                tl.store(res_out_ptr + tokens[:, None] * K + k + cols[None, :], summed, mask=in_ok)
        inv_rms = tl.rsqrt(row_squares / K + eps)[:, None]  # each row's own scale
        y *= inv_rms
        y_second *= inv_rms
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=lane_ok, other=0.0).to(tl.float32)[None, :]
        if ROPE:
            y_second += tl.load(bias_ptr + second_rows, mask=lane_ok, other=0.0).to(tl.float32)[None, :]
    # round to the model dtype first, as the unfused matmul does before SiLU * up or RoPE
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    y_second = y_second.to(out_ptr.dtype.element_ty).to(tl.float32)
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
def _rows_input(x_ptr, res_ptr, norm_w_ptr, in_rows, token_ok, cols, k_end, K, ADD_NORM: tl.constexpr):
    """The (BLOCK_M, BLOCK_K) input tile at columns `cols` (those below k_end) in fp32, and
    its squares for the norm (0 without ADD_NORM): gemv._gemv_input for every row at once."""
    col_ok = cols < k_end
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
def _zero_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr):
    """fma keeps (BLOCK_M, BLOCK_N, BLOCK_K) partial sums so its loop body is loads and FMAs
    only; dot sums into (BLOCK_M, BLOCK_N), wdot into the transpose (BLOCK_N, BLOCK_M)."""
    if MODE == 0:
        return tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    elif MODE == 1:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        return tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)


@triton.jit
def _accumulate(acc, w, x, MODE: tl.constexpr, IEEE_DOT: tl.constexpr):
    """acc += x (BLOCK_M, BLOCK_K) times w (BLOCK_N, BLOCK_K)^T (wdot: its transpose). The
    dots take x in the weight's dtype (bf16 in, fp32 sums: the rounding cuBLAS's bf16 GEMM
    applies to its input); an fp32 model asks for IEEE fp32 instead of TF32."""
    if MODE == 0:
        return acc + w.to(tl.float32)[None, :, :] * x[:, None, :]
    elif MODE == 1:
        return _dot(x.to(w.dtype), tl.trans(w), acc, IEEE_DOT)
    else:
        return _dot(w, tl.trans(x.to(w.dtype)), acc, IEEE_DOT)


@triton.jit
def _dot(a, b, acc, IEEE_DOT: tl.constexpr):
    if IEEE_DOT:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _finish(acc, MODE: tl.constexpr):
    """The (BLOCK_M, BLOCK_N) sums of _accumulate's accumulator."""
    if MODE == 0:
        return tl.sum(acc, axis=2)
    elif MODE == 1:
        return acc
    else:
        return tl.trans(acc)


@triton.jit
def _split_k_total(y, y_second, row_squares, workspace_ptr, counters_ptr, block, TWO: tl.constexpr,
                   SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Adds this program's partial sums into lane block `block`'s workspace tile; the
    block's last program (the counter says SPLIT_K - 1 came before it) gets the totals back
    and leaves tile and counter at zero for the next call. Returns (y, y_second,
    row_squares, last) with `last` a (BLOCK_M, BLOCK_N) mask, true only in that program.
    Atomics are done in L2, so the last program reads every partial sum the others added
    before their counter increments (acq_rel, after a barrier: all of a program's threads
    have added)."""
    tile = workspace_ptr + block.to(tl.int64) * (2 * BLOCK_M * BLOCK_N + BLOCK_M)
    cells = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    squares_cells = tl.arange(0, BLOCK_M)
    tl.atomic_add(tile + cells, y)
    if TWO:
        tl.atomic_add(tile + BLOCK_M * BLOCK_N + cells, y_second)
    tl.atomic_add(tile + 2 * BLOCK_M * BLOCK_N + squares_cells, row_squares)
    tl.debug_barrier()
    before = tl.atomic_add(counters_ptr + block, 1)
    tl.debug_barrier()
    last = (tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32) + before) == SPLIT_K - 1
    last_rows = (tl.zeros((BLOCK_M,), dtype=tl.int32) + before) == SPLIT_K - 1
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # read in L2 (adding 0: masked-off lanes return garbage, zeroed), then reset
    y = tl.where(last, tl.atomic_add(tile + cells, zeros, mask=last), 0.0)
    tl.store(tile + cells, zeros, mask=last)
    if TWO:
        y_second = tl.where(last, tl.atomic_add(tile + BLOCK_M * BLOCK_N + cells, zeros, mask=last), 0.0)
        tl.store(tile + BLOCK_M * BLOCK_N + cells, zeros, mask=last)
    no_squares = tl.zeros_like(row_squares)
    row_squares = tl.where(last_rows, tl.atomic_add(tile + 2 * BLOCK_M * BLOCK_N + squares_cells, no_squares,
                                                    mask=last_rows), 1.0)
    tl.store(tile + 2 * BLOCK_M * BLOCK_N + squares_cells, no_squares, mask=last_rows)
    tl.store(counters_ptr + block, 0, mask=before == SPLIT_K - 1)
    return y, y_second, row_squares, last


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
    mode, block_n, block_k, split_k, warps, stages = config
    block_m = row_block(m) if mode == "fma" else DOT_ROWS
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    blocks = triton.cdiv(lanes, block_n)
    workspace, counters = split_k_workspace(x.device)
    if split_k > 1 and (blocks > len(counters) or blocks * (2 * block_m * block_n + block_m) > len(workspace)):
        raise ValueError(f"config {config}: {blocks} lane blocks of {block_n} outgrow the split-K workspace")
    width = rope.num_q_heads * rope.heads[2] if rope is not None else lanes
    out = torch.empty((m, width), dtype=x.dtype, device=x.device)
    residual_out = torch.empty((m, k), dtype=x.dtype, device=x.device) if add_norm is not None else None
    norm = add_norm or AddNorm(x, x, 0.0)  # unused pointers when there is no norm
    r = rope or RopeStore(x, x, x, x, x, x, 0)  # likewise
    pdl = uses_pdl(x.device)
    _rows_kernel[(blocks, split_k)](
        x, input_rows if input_rows is not None else x, weight, bias if bias is not None else weight, out,
        m, lanes, k, k_per_split, width, norm.residual.contiguous(), norm.weight,
        residual_out if residual_out is not None else out, norm.eps,
        r.cos, r.sin, r.positions, r.slots, r.k_buffer, r.v_buffer, r.num_q_heads, r.heads[1] if rope else 0,
        workspace, counters,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, ADD_NORM=add_norm is not None, ROPE=rope is not None,
        GATHER=input_rows is not None, HALF=r.heads[2] // 2 if rope else 1, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split_k, MODE=MODES[mode], IEEE_DOT=weight.dtype == torch.float32, USE_PDL=pdl,
        num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}))
    return out if add_norm is None else (out, residual_out)
