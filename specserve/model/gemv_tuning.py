"""Choosing the GEMV kernels' tile configs by measurement: each candidate config of a
kernel (gemv.py's one-row GEMV, gemv_rows.py's multi-row kernel) and cuBLAS with the
unfused norm / RoPE / SiLU kernels are timed inside a CUDA graph, weights read from HBM,
on the GPU at hand; a candidate whose output disagrees with the unfused path's is dropped.
gemv_dispatch.py calls this the first time it sees a weight shape (before graph capture)."""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from specserve.model.gemv import CANDIDATES, AddNorm, RopeStore, gemv

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def one_row_config(shape: tuple[int, int], dtype: torch.dtype, has_bias: bool, silu_mul: bool, add_norm: bool,
                rope_heads: tuple[int, int, int] | None, device: torch.device) -> tuple[int, int, int, int] | None:
    """The fastest GEMV tile config for this weight shape, or None when cuBLAS is faster."""
    times = candidate_times(shape, dtype, has_bias, silu_mul, add_norm, device, rope_heads)
    logger.info("one-row matmul %s%s%s%s: %s", shape, " + add_norm" if add_norm else "",
                " + silu_mul" if silu_mul else "", " + rope" if rope_heads else "",
                ", ".join(f"{'cublas' if k is None else k} {v:.1f} us" for k, v in times.items()))
    return min(times, key=times.get)


def candidate_times(shape: tuple[int, int], dtype: torch.dtype, has_bias: bool, silu_mul: bool, add_norm: bool,
                    device: torch.device, rope_heads: tuple[int, int, int] | None = None, rows: int = 1,
                    kernel=None, configs: tuple = CANDIDATES) -> dict:
    """GPU microseconds per call of cuBLAS (key None) and of each config of `kernel` (this
    file's `gemv` by default; gemv_rows.py times its multi-row kernel here too) for `rows`
    input rows.

    Timed over enough weight copies to overflow the L2 cache: in a decode step every
    weight comes from HBM, and a small matrix re-read from L2 would look several times
    faster than it is (H200: o_proj 2.6 us from L2, ~6 us from HBM)."""
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    copies = max(2, min(32, -(-3 * l2_bytes // (shape[0] * shape[1] * torch.finfo(dtype).bits // 8))))
    weights = [torch.randn(shape, dtype=dtype, device=device) for _ in range(copies)]
    bias = torch.randn(shape[0], dtype=dtype, device=device) if has_bias else None
    x = torch.randn((rows, shape[1]), dtype=dtype, device=device)
    norm = AddNorm(torch.randn_like(x), torch.randn(shape[1], dtype=dtype, device=device), 1e-6) if add_norm else None
    rope = timing_rope(rope_heads, dtype, device, rows) if rope_heads else None
    kernel = kernel or gemv
    expected = unfused(x, weights[0], bias, silu_mul, norm, rope)
    times = {None: graph_time_us([lambda w=w: unfused(x, w, bias, silu_mul, norm, rope) for w in weights])}
    for config in configs:
        try:
            for _ in range(2):  # twice: a call must leave nothing behind that changes the next one
                got = kernel(x, weights[0], bias, silu_mul, config, norm, rope)
            if not agrees(got, expected):
                logger.warning("gemv config %s on %s disagrees with the unfused path: not used", config, shape)
                continue
            times[config] = graph_time_us([lambda w=w: kernel(x, w, bias, silu_mul, config, norm, rope)
                                           for w in weights])
        except Exception as error:  # e.g. a tile that needs more shared memory than this GPU has
            logger.warning("gemv config %s failed on %s: %s", config, shape, error)
    return times


def agrees(got, expected) -> bool:
    """A candidate's output (the first of a tuple) matches the unfused path's up to the
    model dtype's rounding: every element within 2% of the largest one. Random inputs make
    a wrong row, lane or missing partial sum miss that by far."""
    got, expected = (t[0] if isinstance(t, tuple) else t for t in (got, expected))
    if got.shape != expected.shape:
        return False
    error = (got.float() - expected.float()).abs().max()
    return bool(error <= 0.02 * expected.float().abs().max())


def timing_rope(heads: tuple[int, int, int], dtype: torch.dtype, device: torch.device, rows: int = 1) -> RopeStore:
    """A small stand-in cache and a position and slot per row for timing the RoPE epilogue."""
    num_q, num_kv, head_dim = heads
    table = torch.rand((rows + 8, head_dim // 2), dtype=torch.float32, device=device)
    index = torch.arange(1, rows + 1, dtype=torch.int64, device=device)
    pool = torch.zeros((rows + 4, num_kv, head_dim), dtype=dtype, device=device)
    return RopeStore(table, table, index, index, pool, pool.clone(), num_q)


def unfused(x, weight, bias, silu_mul: bool, add_norm: AddNorm | None, rope: RopeStore | None = None):
    """The same result through the other GPU kernels: add+RMSNorm, cuBLAS, silu_mul or
    rope_and_store (for shapes where cuBLAS wins, and as the baseline the GEMV is timed
    against)."""
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
