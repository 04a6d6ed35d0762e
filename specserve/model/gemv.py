"""A Triton GEMV for one-row linear layers on a GPU: y = x @ W^T (+ bias), optionally with
the decoder's pre-norm in front (input = rmsnorm(residual + x) * w) and SiLU(gate) * up
behind (the fused gate_up projection), so a batch-1 layer is ~5 kernels instead of ~10.

At batch 1 a decode step is a chain of matrix-vector products that must each stream a
weight matrix once at full memory bandwidth. cuBLAS gets close on large matrices but not
on the small ones of a 1.5B model (H200, weights read from HBM: o_proj 4.7 MB in 6.5 us,
down_proj 27.5 MB in 11.9 us; this kernel: 3.3 us and 8.9 us). Each program owns BLOCK_N
output rows and walks K in BLOCK_K chunks with a (BLOCK_N, BLOCK_K) fp32 partial sum
reduced once at the end, so the loop body is loads and FMAs only. With the pre-norm, every
program first recomputes the row's RMS from the (L2-resident) input: cheaper than a launch.

Tile sizes are chosen per weight shape by timing a few candidates, cuBLAS included,
inside a CUDA graph the first time a shape is seen (before the engine captures its own
graphs), so the fastest path wins on every GPU and model.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

ENABLED = True  # False: one-row matmuls go to cuBLAS like any other (the A/B of bench.decode_profile)

# (BLOCK_N, BLOCK_K, num_warps, num_stages): small row blocks, long K chunks and deeper
# pipelining keep more loads in flight; which wins depends on the shape and the GPU
CANDIDATES = ((4, 1024, 4, 3), (4, 256, 4, 3), (8, 512, 4, 3), (2, 2048, 8, 3), (2, 1024, 4, 3), (8, 256, 8, 3),
              (4, 2048, 8, 3), (2, 1024, 4, 5), (4, 256, 4, 5), (8, 256, 8, 5), (4, 2048, 8, 4), (4, 512, 8, 5))


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N_OUT, K, res_ptr, norm_w_ptr, res_out_ptr, eps,
                 HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, ADD_NORM: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # SILU_MUL: W holds gate rows [0, N_OUT) then up rows [N_OUT, 2 N_OUT); out = silu(gate) * up
    # ADD_NORM: the input is rmsnorm(residual + x) * norm_w; program 0 writes residual + x out
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N_OUT
    cols = tl.arange(0, BLOCK_K)
    inv_rms = 1.0
    if ADD_NORM:  # every program recomputes the norm of the (L2-resident) row: cheaper than a launch
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            k_mask = (k + cols) < K
            summed = tl.load(x_ptr + k + cols, mask=k_mask, other=0.0) + tl.load(res_ptr + k + cols, mask=k_mask, other=0.0)
            squares += summed.to(tl.float32) * summed.to(tl.float32)
            if pid == 0:
                tl.store(res_out_ptr + k + cols, summed, mask=k_mask)
        inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    up_rows = w_rows + N_OUT.to(tl.int64) * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + cols) < K
        mask = row_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + k + cols, mask=k_mask, other=0.0)
        if ADD_NORM:  # the same roundings as add_rmsnorm: sum, normalised value, then times the weight
            summed = x + tl.load(res_ptr + k + cols, mask=k_mask, other=0.0)
            normed = (summed.to(tl.float32) * inv_rms).to(summed.dtype).to(tl.float32)
            x = (tl.load(norm_w_ptr + k + cols, mask=k_mask, other=0.0).to(tl.float32) * normed).to(summed.dtype)
        x = x.to(tl.float32)[None, :]
        acc += tl.load(w_rows + k + cols[None, :], mask=mask, other=0.0).to(tl.float32) * x
        if SILU_MUL:
            acc_up += tl.load(up_rows + k + cols[None, :], mask=mask, other=0.0).to(tl.float32) * x
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    if SILU_MUL:
        # round gate and up to the model dtype first, as the unfused matmul + silu_mul does
        gate = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = tl.sum(acc_up, axis=1).to(out_ptr.dtype.element_ty).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32) * up
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


@dataclass(frozen=True)
class AddNorm:
    """A GEMV input given as rmsnorm(residual + x) * weight, the pre-norm of a decoder block."""
    residual: torch.Tensor
    weight: torch.Tensor
    eps: float


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
         config: tuple[int, int, int, int] = CANDIDATES[0], add_norm: AddNorm | None = None):
    """x: (1, K), weight: (N, K) contiguous; returns (1, N), or (1, N / 2) with silu_mul.
    With add_norm, returns (output, residual + x)."""
    n, k = weight.shape
    n_out = n // 2 if silu_mul else n
    block_n, block_k, warps, stages = config
    out = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(x) if add_norm is not None else None
    norm = add_norm or AddNorm(x, x, 0.0)  # unused pointers when there is no norm
    _gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x, weight, bias if bias is not None else weight, out, n_out, k,
        norm.residual, norm.weight, residual_out if residual_out is not None else out, norm.eps,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, ADD_NORM=add_norm is not None, BLOCK_N=block_n,
        BLOCK_K=min(block_k, triton.next_power_of_2(k)), num_warps=warps, num_stages=stages)
    return out if add_norm is None else (out, residual_out)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool,
              add_norm: AddNorm | None = None):
    """The unfused torch computation gemv replaces (same return convention)."""
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
    return y if add_norm is None else (y, residual_out)


def one_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   silu_mul: bool = False, add_norm: AddNorm | None = None):
    """x @ W^T (+ bias) (then silu_mul) for one CUDA row, by the fastest measured path;
    with add_norm the input is normalised first and (output, residual + x) is returned."""
    config = best_config(tuple(weight.shape), weight.dtype, bias is not None, silu_mul, add_norm is not None,
                         weight.device)
    if config is None:
        return _unfused(x, weight, bias, silu_mul, add_norm)
    return gemv(x, weight, bias, silu_mul, config, add_norm)


@functools.lru_cache(maxsize=None)
def best_config(shape: tuple[int, int], dtype: torch.dtype, has_bias: bool, silu_mul: bool, add_norm: bool,
                device: torch.device) -> tuple[int, int, int, int] | None:
    """The fastest GEMV tile config for this weight shape, or None when cuBLAS is faster."""
    times = candidate_times(shape, dtype, has_bias, silu_mul, add_norm, device)
    logger.info("one-row matmul %s%s%s: %s", shape, " + add_norm" if add_norm else "", " + silu_mul" if silu_mul else "",
                ", ".join(f"{'cublas' if k is None else k} {v:.1f} us" for k, v in times.items()))
    return min(times, key=times.get)


def candidate_times(shape: tuple[int, int], dtype: torch.dtype, has_bias: bool, silu_mul: bool, add_norm: bool,
                    device: torch.device) -> dict:
    """GPU microseconds per call of cuBLAS (key None) and of each GEMV config.

    Timed over enough weight copies to overflow the L2 cache: in a decode step every
    weight comes from HBM, and a small matrix re-read from L2 would look several times
    faster than it is (H200: o_proj 2.6 us from L2, ~6 us from HBM)."""
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    copies = max(2, min(32, -(-3 * l2_bytes // (shape[0] * shape[1] * torch.finfo(dtype).bits // 8))))
    weights = [torch.randn(shape, dtype=dtype, device=device) for _ in range(copies)]
    bias = torch.randn(shape[0], dtype=dtype, device=device) if has_bias else None
    x = torch.randn((1, shape[1]), dtype=dtype, device=device)
    norm = AddNorm(torch.randn_like(x), torch.randn(shape[1], dtype=dtype, device=device), 1e-6) if add_norm else None
    times = {None: graph_time_us([lambda w=w: _unfused(x, w, bias, silu_mul, norm) for w in weights])}
    for config in CANDIDATES:
        try:
            times[config] = graph_time_us([lambda w=w: gemv(x, w, bias, silu_mul, config, norm) for w in weights])
        except Exception as error:  # e.g. a tile that needs more shared memory than this GPU has
            logger.warning("gemv config %s failed on %s: %s", config, shape, error)
    return times


def _unfused(x, weight, bias, silu_mul: bool, add_norm: AddNorm | None):
    """The same result through the other GPU kernels: add+RMSNorm, cuBLAS, silu_mul (for
    shapes where cuBLAS wins, and as the baseline the GEMV is timed against)."""
    from specserve.model import fused_ops
    residual = None
    if add_norm is not None:
        residual = add_norm.residual.clone()  # add_rmsnorm updates it in place; the input stays
        x = fused_ops.add_rmsnorm(x, add_norm.weight, add_norm.eps, residual=residual)
    y = F.linear(x, weight, bias)
    y = fused_ops.silu_mul(y) if silu_mul else y
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
