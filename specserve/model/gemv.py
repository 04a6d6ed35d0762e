"""A Triton GEMV for one-row linear layers on a GPU: y = x @ W^T (+ bias), optionally with
the decoder's pre-norm in front (input = rmsnorm(residual + x) * w) and, behind, SiLU(gate)
* up (the fused gate_up projection) or RoPE + the KV-pool write (the fused qkv
projection), so a batch-1 layer is 4 GEMVs and the attention kernel.

At batch 1 a decode step is a chain of matrix-vector products that must each stream a
weight matrix once at full memory bandwidth. cuBLAS gets close on large matrices but not
on the small ones of a 1.5B model (H200, weights read from HBM: o_proj 4.7 MB in 6.5 us,
down_proj 27.5 MB in 11.9 us; this kernel: 3.3 us and 8.9 us). Each program owns BLOCK_N
output lanes and walks K in BLOCK_K chunks with a (BLOCK_N, BLOCK_K) fp32 partial sum
reduced once at the end, so the loop body is loads and FMAs only. The pre-norm costs no
pass of its own: rmsnorm(s) * w . W_row = rsqrt(mean(s^2) + eps) * ((w * s) . W_row), so
the loop accumulates (w * s) . W_row and s^2 together and scales at the end. A lane that
needs two rows (gate and up; dims d and d + head_dim / 2 of a head for RoPE) keeps two sums.

Tile sizes are chosen per weight shape by timing a few candidates, cuBLAS included,
inside a CUDA graph the first time a shape is seen (before the engine captures its own
graphs), so the fastest path wins on every GPU and model.

One row only: 2-32 rows (a verify step, a small batch) take rows_linear.py, which keeps
the weight-streaming property on tensor cores. Generalising this FMA kernel to several
rows (a partial sum per row) was measured four times and lost to cuBLAS on every matrix of
a 1.5B but o_proj, and at one row it made the plain step 15% slower.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specserve.pdl import uses_pdl

logger = logging.getLogger(__name__)

ENABLED = True  # False: one-row matmuls go to cuBLAS like any other (the A/B of lab.decode_profile)

# (BLOCK_N, BLOCK_K, num_warps, num_stages): small row blocks, long K chunks and deeper
# pipelining keep more loads in flight; which wins depends on the shape and the GPU
CANDIDATES = ((4, 1024, 4, 3), (4, 256, 4, 3), (2, 1024, 4, 3), (4, 2048, 8, 3), (2, 1024, 4, 5), (4, 256, 4, 5),
              (8, 256, 8, 5), (4, 2048, 8, 4), (4, 512, 8, 5), (1, 512, 4, 4), (1, 1024, 4, 4), (2, 256, 2, 4),
              (2, 512, 2, 6), (4, 128, 2, 8), (1, 256, 1, 6))


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
    lanes = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    lane_ok = lanes < N_OUT
    rows = lanes
    if ROPE:
        rows = (lanes // HALF) * (2 * HALF) + lanes % HALF
    second_rows = rows + (HALF if ROPE else N_OUT)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    w_second = w_ptr + second_rows.to(tl.int64)[:, None] * K
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
    x_pre, squares_pre = _gemv_input(x_ptr, res_ptr, norm_w_ptr, pre, pre_ok, ADD_NORM)
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
        x, chunk_squares = _gemv_input(x_ptr, res_ptr, norm_w_ptr, k + cols, k_mask, ADD_NORM)
        squares += chunk_squares
        acc += tl.load(w_rows + k + cols[None, :], mask=mask, other=0.0).to(tl.float32) * x[None, :]
        if SILU_MUL or ROPE:
            acc_second += tl.load(w_second + k + cols[None, :], mask=mask, other=0.0).to(tl.float32) * x[None, :]
    y += tl.sum(acc, axis=1)
    y_second += tl.sum(acc_second, axis=1)
    if ADD_NORM:
        if pid == 0:  # not inside the loop above: a branch there would keep it from being pipelined
            for k in range(0, K, BLOCK_K):
                k_mask = (k + cols) < K
                summed = tl.load(x_ptr + k + cols, mask=k_mask, other=0.0) + tl.load(res_ptr + k + cols, mask=k_mask)
                tl.store(res_out_ptr + k + cols, summed, mask=k_mask)  # rounds like torch's residual + x
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
        _rope_epilogue(y, y_second, lanes, lane_ok, out_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr,
                       k_buf_ptr, v_buf_ptr, num_q_heads, num_kv_heads, HALF)
    else:
        if SILU_MUL:
            y = (y / (1.0 + tl.exp(-y))).to(out_ptr.dtype.element_ty).to(tl.float32) * y_second
        tl.store(out_ptr + lanes, y.to(out_ptr.dtype.element_ty), mask=lane_ok)


@triton.jit
def _gemv_input(x_ptr, res_ptr, norm_w_ptr, cols, col_ok, ADD_NORM: tl.constexpr):
    """The input columns `cols` in fp32, and their squares for the norm (0 without ADD_NORM).
    With ADD_NORM, one pass: rmsnorm's scale is a scalar, so the caller applies it to the
    dot products at the end (no serial norm loop before the weights start streaming)."""
    raw = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
    x = raw.to(tl.float32)
    squares = tl.zeros(cols.shape, dtype=tl.float32)
    if ADD_NORM:
        summed = (raw + tl.load(res_ptr + cols, mask=col_ok, other=0.0)).to(tl.float32)  # rounds like torch's add
        squares = summed * summed
        x = tl.load(norm_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) * summed
    return x, squares


@triton.jit
def _rope_epilogue(first, second, lanes, lane_ok, q_ptr, cos_ptr, sin_ptr, positions_ptr, slots_ptr,
                   k_buf_ptr, v_buf_ptr, num_q_heads, num_kv_heads, HALF: tl.constexpr):
    """Lane (head h, dim d) holds qkv[h, d] and qkv[h, d + HALF]: rotate q and k heads as
    fused_ops.rope_and_store does, then write q heads to q_ptr, k and v heads to the pool."""
    head = lanes // HALF
    dim = lanes % HALF
    position = tl.load(positions_ptr).to(tl.int64)
    cos = tl.load(cos_ptr + position * HALF + dim)
    sin = tl.load(sin_ptr + position * HALF + dim)
    is_q = head < num_q_heads
    is_v = head >= num_q_heads + num_kv_heads
    is_k = ~is_q & ~is_v
    rotated_first = tl.where(is_v, first, first * cos - second * sin)
    rotated_second = tl.where(is_v, second, second * cos + first * sin)
    q_dest = q_ptr + head * (2 * HALF) + dim
    tl.store(q_dest, rotated_first.to(q_ptr.dtype.element_ty), mask=lane_ok & is_q)
    tl.store(q_dest + HALF, rotated_second.to(q_ptr.dtype.element_ty), mask=lane_ok & is_q)
    kv_head = tl.where(is_v, head - num_q_heads - num_kv_heads, head - num_q_heads)
    slot = tl.load(slots_ptr).to(tl.int64)
    offset = (slot * num_kv_heads + kv_head) * (2 * HALF) + dim
    tl.store(k_buf_ptr + offset, rotated_first.to(k_buf_ptr.dtype.element_ty), mask=lane_ok & is_k)
    tl.store(k_buf_ptr + offset + HALF, rotated_second.to(k_buf_ptr.dtype.element_ty), mask=lane_ok & is_k)
    tl.store(v_buf_ptr + offset, rotated_first.to(v_buf_ptr.dtype.element_ty), mask=lane_ok & is_v)
    tl.store(v_buf_ptr + offset + HALF, rotated_second.to(v_buf_ptr.dtype.element_ty), mask=lane_ok & is_v)


@dataclass(frozen=True)
class AddNorm:
    """A GEMV input given as rmsnorm(residual + x) * weight, the pre-norm of a decoder block."""
    residual: torch.Tensor
    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class RopeStore:
    """The qkv GEMV's epilogue: of the q, k and v heads it computes, q and k are rotated
    (rotate-half RoPE at the token's position) and q is returned, k and v go into the
    token's KV-pool slot, as fused_ops.rope_and_store does after an unfused matmul."""
    cos: torch.Tensor        # (max_positions, head_dim / 2) fp32
    sin: torch.Tensor
    positions: torch.Tensor  # (1,)
    slots: torch.Tensor      # (1,)
    k_buffer: torch.Tensor   # (pool slots, num_kv_heads, head_dim)
    v_buffer: torch.Tensor
    num_q_heads: int

    @property
    def heads(self) -> tuple[int, int, int]:
        """(num_q_heads, num_kv_heads, head_dim): what the tile timing depends on."""
        return self.num_q_heads, self.k_buffer.shape[1], self.k_buffer.shape[2]


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
         config: tuple[int, int, int, int] = CANDIDATES[0], add_norm: AddNorm | None = None,
         rope: RopeStore | None = None):
    """x: (1, K), weight: (N, K) contiguous; returns (1, N), (1, N / 2) with silu_mul, or
    q (1, num_q_heads * head_dim) with rope. With add_norm, returns (output, residual + x)."""
    n, k = weight.shape
    lanes = n // 2 if silu_mul or rope is not None else n
    block_n, block_k, warps, stages = config
    width = rope.num_q_heads * rope.heads[2] if rope is not None else lanes
    out = torch.empty((1, width), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if add_norm is not None else None
    norm = add_norm or AddNorm(x, x, 0.0)  # unused pointers when there is no norm
    pdl = uses_pdl(x.device)
    r = rope or RopeStore(x, x, x, x, x, x, 0)  # likewise
    _gemv_kernel[(triton.cdiv(lanes, block_n),)](
        x, weight, bias if bias is not None else weight, out, lanes, k,
        norm.residual, norm.weight, residual_out if residual_out is not None else out, norm.eps,
        r.cos, r.sin, r.positions, r.slots, r.k_buffer, r.v_buffer, r.num_q_heads, r.heads[1] if rope else 0,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, ADD_NORM=add_norm is not None, ROPE=rope is not None,
        HALF=r.heads[2] // 2 if rope else 1, BLOCK_N=block_n, BLOCK_K=min(block_k, triton.next_power_of_2(k)),
        PREFETCH_K=prefetch_columns(k, block_n * (2 if silu_mul or rope is not None else 1), warps),
        USE_PDL=pdl, num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}))
    return out if add_norm is None else (out, residual_out)


def prefetch_columns(k: int, rows: int, warps: int) -> int:
    """Weight columns a program loads before waiting for the previous kernel: all of K when
    its `rows` rows fit in ~64 values per thread (the rest streams through the K loop)."""
    fits = 64 * 32 * warps // rows
    return max(16, min(triton.next_power_of_2(k), 1 << (fits.bit_length() - 1)))



def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool,
              add_norm: AddNorm | None = None, rope: RopeStore | None = None):
    """The unfused torch computation the GEMV (or rows_linear's kernel) replaces, for x of
    any row count (same return convention; with rope, row r goes to slot rope.slots[r])."""
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
        count = x.shape[0]
        q, k, v = y.view(count, num_q + 2 * num_kv, head_dim).split([num_q, num_kv, num_kv], dim=1)
        positions, slots = rope.positions[:count], rope.slots[:count]
        cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
        rope.k_buffer[slots] = rotate_half(k, cos, sin)
        rope.v_buffer[slots] = v
        y = rotate_half(q, cos, sin).reshape(count, -1)
    return y if add_norm is None else (y, residual_out)


def one_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   silu_mul: bool = False, add_norm: AddNorm | None = None, rope: RopeStore | None = None):
    """x @ W^T (+ bias) (then silu_mul or rope) for one CUDA row, by the fastest measured
    path; with add_norm the input is normalised first and (output, residual + x) is returned."""
    config = best_config(tuple(weight.shape), weight.dtype, bias is not None, silu_mul, add_norm is not None,
                         rope.heads if rope is not None else None, weight.device)
    if config is None:
        return unfused(x, weight, bias, silu_mul, add_norm, rope)
    return gemv(x, weight, bias, silu_mul, config, add_norm, rope)


@functools.lru_cache(maxsize=None)
def best_config(shape: tuple[int, int], dtype: torch.dtype, has_bias: bool, silu_mul: bool, add_norm: bool,
                rope_heads: tuple[int, int, int] | None, device: torch.device) -> tuple[int, int, int, int] | None:
    """The fastest GEMV tile config for this weight shape, or None when cuBLAS is faster."""
    times = candidate_times(shape, dtype, has_bias, silu_mul, add_norm, device, rope_heads)
    logger.info("one-row matmul %s%s%s%s: %s", shape, " + add_norm" if add_norm else "",
                " + silu_mul" if silu_mul else "", " + rope" if rope_heads else "",
                ", ".join(f"{'cublas' if k is None else k} {v:.1f} us" for k, v in times.items()))
    return min(times, key=times.get)


def candidate_times(shape: tuple[int, int], dtype: torch.dtype, has_bias: bool, silu_mul: bool, add_norm: bool,
                    device: torch.device, rope_heads: tuple[int, int, int] | None = None) -> dict:
    """GPU microseconds per call of cuBLAS (key None) and of each GEMV config."""
    weights, bias, x, norm, rope = timing_inputs(shape, dtype, has_bias, add_norm, device, rope_heads, rows=1)
    times = {None: graph_time_us([lambda w=w: unfused(x, w, bias, silu_mul, norm, rope) for w in weights])}
    for config in CANDIDATES:
        try:
            times[config] = graph_time_us([lambda w=w: gemv(x, w, bias, silu_mul, config, norm, rope)
                                           for w in weights])
        except Exception as error:  # e.g. a tile that needs more shared memory than this GPU has
            logger.warning("gemv config %s failed on %s: %s", config, shape, error)
    return times


def timing_inputs(shape: tuple[int, int], dtype: torch.dtype, has_bias: bool, add_norm: bool, device: torch.device,
                  rope_heads: tuple[int, int, int] | None, rows: int):
    """Random weights, bias, input rows, pre-norm and RoPE stand-ins to time a linear with.

    Enough weight copies to overflow the L2 cache: in a decode step every weight comes from
    HBM, and a small matrix re-read from L2 would look several times faster than it is
    (H200: o_proj 2.6 us from L2, ~6 us from HBM)."""
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    copies = max(2, min(32, -(-3 * l2_bytes // (shape[0] * shape[1] * torch.finfo(dtype).bits // 8))))
    weights = [torch.randn(shape, dtype=dtype, device=device) for _ in range(copies)]
    bias = torch.randn(shape[0], dtype=dtype, device=device) if has_bias else None
    x = torch.randn((rows, shape[1]), dtype=dtype, device=device)
    norm = AddNorm(torch.randn_like(x), torch.randn(shape[1], dtype=dtype, device=device), 1e-6) if add_norm else None
    rope = _timing_rope(rope_heads, rows, dtype, device) if rope_heads else None
    return weights, bias, x, norm, rope


def _timing_rope(heads: tuple[int, int, int], rows: int, dtype: torch.dtype, device: torch.device) -> RopeStore:
    """Stand-in cos/sin tables, positions and pool slots for timing the RoPE epilogue."""
    num_q, num_kv, head_dim = heads
    table = torch.rand((rows + 8, head_dim // 2), dtype=torch.float32, device=device)
    index = torch.arange(1, rows + 1, dtype=torch.int64, device=device)
    pool = torch.zeros((rows + 4, num_kv, head_dim), dtype=dtype, device=device)
    return RopeStore(table, table, index, index, pool, pool.clone(), num_q)


def unfused(x, weight, bias, silu_mul: bool, add_norm: AddNorm | None, rope: RopeStore | None = None):
    """The same result through the other GPU kernels: add+RMSNorm, cuBLAS, silu_mul or
    rope_and_store, for any row count (for shapes where cuBLAS wins, and as the baseline
    the GEMV and rows_linear's kernel are timed against)."""
    from specserve.model import fused_ops
    residual = None
    if add_norm is not None:
        residual = add_norm.residual.clone()  # add_rmsnorm updates it in place; the input stays
        x = fused_ops.add_rmsnorm(x, add_norm.weight, add_norm.eps, residual=residual)
    y = F.linear(x, weight, bias)
    y = fused_ops.silu_mul(y) if silu_mul else y
    if rope is not None:
        num_q, num_kv, head_dim = rope.heads
        count = x.shape[0]
        q, k, v = y.view(count, num_q + 2 * num_kv, head_dim).split([num_q, num_kv, num_kv], dim=1)
        fused_ops.rope_and_store(q, k, v, rope.cos, rope.sin, rope.positions[:count], rope.slots[:count],
                                 rope.k_buffer, rope.v_buffer)
        y = q.reshape(count, -1)
    return y if add_norm is None else (y, residual)


def graph_time_us(calls: list, rounds: int = 3) -> float:
    """Microseconds per call on the GPU, launch cost excluded: the calls are captured in
    one CUDA graph and replayed `rounds` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls[0]()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (rounds * len(calls))
