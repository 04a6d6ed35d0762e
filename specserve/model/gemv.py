"""A Triton GEMV for one-row linear layers on a GPU: y = x @ W^T (+ bias), optionally
followed by SiLU(gate) * up for the fused gate_up projection.

At batch 1 a decode step is a chain of matrix-vector products that must each stream a
weight matrix once at full memory bandwidth. cuBLAS reaches that on large matrices but
not on the small ones of a 1.5B model (H200, one row: o_proj 4.7 MB in 6.0 us = 0.8 TB/s,
down_proj 27.5 MB at 2.9 TB/s; this kernel: 2.6 us and 5.9 us). Each program owns
BLOCK_N output rows and walks K in BLOCK_K chunks with a (BLOCK_N, BLOCK_K) fp32 partial
sum reduced once at the end, so the loop body is loads and FMAs only.

Tile sizes are chosen per weight shape by timing a few candidates, cuBLAS included,
inside a CUDA graph the first time a shape is seen (before the engine captures its own
graphs), so the fastest path wins on every GPU and model.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

# (BLOCK_N, BLOCK_K, num_warps): small row blocks and long K chunks keep many loads in flight
CANDIDATES = ((4, 1024, 4), (4, 256, 4), (8, 512, 4), (2, 2048, 8), (2, 1024, 4), (4, 512, 4), (8, 256, 8),
              (1, 2048, 4), (16, 256, 8), (4, 2048, 8), (1, 4096, 8))


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N_OUT, K,
                 HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # SILU_MUL: W holds gate rows [0, N_OUT) then up rows [N_OUT, 2 N_OUT); out = silu(gate) * up
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N_OUT
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    up_rows = w_rows + N_OUT.to(tl.int64) * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + cols) < K
        mask = row_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + k + cols, mask=k_mask, other=0.0).to(tl.float32)[None, :]
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


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
         config: tuple[int, int, int] = CANDIDATES[0]) -> torch.Tensor:
    """x: (1, K), weight: (N, K) contiguous; returns (1, N), or (1, N / 2) with silu_mul."""
    n, k = weight.shape
    n_out = n // 2 if silu_mul else n
    block_n, block_k, warps = config
    out = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x, weight, bias if bias is not None else weight, out, n_out, k, HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul, BLOCK_N=block_n, BLOCK_K=min(block_k, triton.next_power_of_2(k)), num_warps=warps)
    return out


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool) -> torch.Tensor:
    """The unfused torch computation gemv replaces."""
    y = F.linear(x, weight, bias)
    if not silu_mul:
        return y
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def one_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   silu_mul: bool = False) -> torch.Tensor:
    """x @ W^T (+ bias) (then silu_mul) for one CUDA row, by the fastest measured path."""
    config = best_config(tuple(weight.shape), weight.dtype, bias is not None, silu_mul, weight.device)
    if config is None:
        return reference(x, weight, bias, silu_mul)
    return gemv(x, weight, bias, silu_mul, config)


@functools.lru_cache(maxsize=None)
def best_config(shape: tuple[int, int], dtype: torch.dtype, has_bias: bool, silu_mul: bool,
                device: torch.device) -> tuple[int, int, int] | None:
    """The fastest GEMV tile config for this weight shape, or None when cuBLAS is faster."""
    times = candidate_times(shape, dtype, has_bias, silu_mul, device)
    logger.info("one-row matmul %s%s: %s", shape, " + silu_mul" if silu_mul else "",
                ", ".join(f"{'cublas' if k is None else k} {v:.1f} us" for k, v in times.items()))
    return min(times, key=times.get)


def candidate_times(shape: tuple[int, int], dtype: torch.dtype, has_bias: bool, silu_mul: bool,
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
    times = {None: graph_time_us([lambda w=w: reference(x, w, bias, silu_mul) for w in weights])}
    for config in CANDIDATES:
        times[config] = graph_time_us([lambda w=w: gemv(x, w, bias, silu_mul, config) for w in weights])
    return times


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
