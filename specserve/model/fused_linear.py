"""Routing of a few-row linear layer on a GPU to the fused Triton kernels, by measurement.

One row (a batch-1 decode step) goes to gemv.py's GEMV, 2..MAX_ROWS rows (a small draft
tree, a small batch) to gemm_rows.py; both may take the decoder's pre-norm, SiLU * up or
RoPE + KV write along. For each weight shape and row class (1, or up to MAX_ROWS) the tile
config is chosen by timing a few candidates, cuBLAS with the unfused kernels included,
inside a CUDA graph the first time the shape is seen (before the engine captures its own
graphs), so the fastest path wins on every GPU and model.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from specserve.model import gemm_rows, gemv
from specserve.model.gemv import AddNorm, RopeStore

logger = logging.getLogger(__name__)

ENABLED = True  # False: every matmul goes to cuBLAS (the A/B of bench.decode_profile)
MAX_ROWS = gemm_rows.MAX_ROWS


def takes_fused_kernels(x: torch.Tensor) -> bool:
    """A CUDA input of 1..MAX_ROWS rows goes through the fused kernels."""
    return x.is_cuda and 1 <= x.shape[0] <= MAX_ROWS and ENABLED


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 silu_mul: bool = False, add_norm: AddNorm | None = None, rope: RopeStore | None = None):
    """x @ W^T (+ bias) (then silu_mul or rope) for 1..MAX_ROWS CUDA rows, by the fastest
    measured path; with add_norm the input is normalised first and (output, residual + x)
    is returned."""
    rows = 1 if x.shape[0] == 1 else MAX_ROWS
    config = best_config(rows, tuple(weight.shape), weight.dtype, bias is not None, silu_mul, add_norm is not None,
                         rope.heads if rope is not None else None, weight.device)
    if config is None:
        return unfused(x, weight, bias, silu_mul, add_norm, rope)
    kernel = gemv.gemv if x.shape[0] == 1 else gemm_rows.gemm_rows
    return kernel(x, weight, bias, silu_mul, config, add_norm, rope)


@functools.lru_cache(maxsize=None)
def best_config(rows: int, shape: tuple[int, int], dtype: torch.dtype, has_bias: bool, silu_mul: bool,
                add_norm: bool, rope_heads: tuple[int, int, int] | None,
                device: torch.device) -> tuple[int, int, int, int] | None:
    """The fastest tile config for this weight shape and row class, or None when cuBLAS is faster."""
    times = candidate_times(rows, shape, dtype, has_bias, silu_mul, add_norm, device, rope_heads)
    logger.info("%d-row matmul %s%s%s%s: %s", rows, shape, " + add_norm" if add_norm else "",
                " + silu_mul" if silu_mul else "", " + rope" if rope_heads else "",
                ", ".join(f"{'cublas' if k is None else k} {v:.1f} us" for k, v in times.items()))
    return min(times, key=times.get)


def candidate_times(rows: int, shape: tuple[int, int], dtype: torch.dtype, has_bias: bool, silu_mul: bool,
                    add_norm: bool, device: torch.device, rope_heads: tuple[int, int, int] | None = None) -> dict:
    """GPU microseconds per call of cuBLAS (key None) and of each tile config, for `rows` rows.

    Timed over enough weight copies to overflow the L2 cache: in a decode step every
    weight comes from HBM, and a small matrix re-read from L2 would look several times
    faster than it is (H200: o_proj 2.6 us from L2, ~6 us from HBM)."""
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    copies = max(2, min(32, -(-3 * l2_bytes // (shape[0] * shape[1] * torch.finfo(dtype).bits // 8))))
    weights = [torch.randn(shape, dtype=dtype, device=device) for _ in range(copies)]
    bias = torch.randn(shape[0], dtype=dtype, device=device) if has_bias else None
    x = torch.randn((rows, shape[1]), dtype=dtype, device=device)
    norm = AddNorm(torch.randn_like(x), torch.randn(shape[1], dtype=dtype, device=device), 1e-6) if add_norm else None
    rope = _timing_rope(rows, rope_heads, dtype, device) if rope_heads else None
    times = {None: graph_time_us([lambda w=w: unfused(x, w, bias, silu_mul, norm, rope) for w in weights])}
    kernel, candidates = (gemv.gemv, gemv.CANDIDATES) if rows == 1 else (gemm_rows.gemm_rows, gemm_rows.CANDIDATES)
    for config in candidates:
        try:
            times[config] = graph_time_us([lambda w=w: kernel(x, w, bias, silu_mul, config, norm, rope)
                                           for w in weights])
        except Exception as error:  # e.g. a tile that needs more shared memory than this GPU has
            logger.warning("%d-row config %s failed on %s: %s", rows, config, shape, error)
    return times


def _timing_rope(rows: int, heads: tuple[int, int, int], dtype: torch.dtype, device: torch.device) -> RopeStore:
    """A small stand-in cache, positions and slots for timing the RoPE epilogue."""
    num_q, num_kv, head_dim = heads
    table = torch.rand((8 + rows, head_dim // 2), dtype=torch.float32, device=device)
    index = torch.arange(1, rows + 1, dtype=torch.int64, device=device)
    pool = torch.zeros((rows + 4, num_kv, head_dim), dtype=dtype, device=device)
    return RopeStore(table, table, index, index, pool, pool.clone(), num_q)


def unfused(x, weight, bias, silu_mul: bool, add_norm: AddNorm | None, rope: RopeStore | None = None):
    """The same result through the other GPU kernels: add+RMSNorm, cuBLAS, silu_mul or
    rope_and_store (for shapes where cuBLAS wins, and as the baseline the fused kernels
    are timed against)."""
    from specserve.model import fused_ops
    residual = None
    if add_norm is not None:
        residual = add_norm.residual.clone()  # add_rmsnorm updates it in place; the input stays
        x = fused_ops.add_rmsnorm(x, add_norm.weight, add_norm.eps, residual=residual)
    y = F.linear(x, weight, bias)
    y = fused_ops.silu_mul(y) if silu_mul else y
    if rope is not None:
        num_q, num_kv, head_dim = rope.heads
        q, k, v = y.view(len(y), num_q + 2 * num_kv, head_dim).split([num_q, num_kv, num_kv], dim=1)
        fused_ops.rope_and_store(q, k, v, rope.cos, rope.sin, rope.positions, rope.slots, rope.k_buffer, rope.v_buffer)
        y = q.reshape(len(y), -1)
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
