"""Which path a few-row matmul takes on this GPU: the GEMV tile configs of gemv_kernels.py,
timed per (weight shape, fusions, row bucket) against cuBLAS with the unfused norm / SiLU /
RoPE kernels (`unfused`), inside a CUDA graph, with weights read from HBM as in a step.

The candidates differ per row bucket (1, 2, 4, 8, 16 rows: M is padded up to its bucket):
an FMA config keeps ROWS * BLOCK_N * BLOCK_K / threads <= 32 fp32 partial sums per thread
and per sum (a lane with SiLU * up or RoPE keeps two), so more rows get narrower tiles;
dot configs compute 16 rows whatever the bucket (compiled once for all of them). None of
the few-row configs spills registers on sm_90 at the 1.5B's shapes (ptxas 12.9 through
Triton 3.9, compiled on a CPU host: 39-174 registers, 9-40 KB of shared memory for the
pipelined tiles).
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F

from specserve.model.gemv_kernels import AddNorm, RopeStore, TileConfig, gemv

logger = logging.getLogger(__name__)

_T = TileConfig
# one row: small row blocks, long K chunks and deeper pipelining keep more loads in flight;
# which wins depends on the shape and the GPU
ONE_ROW = (_T(4, 1024, 4, 3), _T(4, 256, 4, 3), _T(2, 1024, 4, 3), _T(4, 2048, 8, 3), _T(2, 1024, 4, 5),
           _T(4, 256, 4, 5), _T(8, 256, 8, 5), _T(4, 2048, 8, 4), _T(4, 512, 8, 5), _T(1, 512, 4, 4),
           _T(1, 1024, 4, 4), _T(2, 256, 2, 4), _T(2, 512, 2, 6), _T(4, 128, 2, 8), _T(1, 256, 1, 6))
# rows padded to 16 through tl.dot: fewer programs per matrix (BLOCK_N >= 16), but a
# tensor-core product into a (16, BLOCK_N) accumulator, so a tile's size is not bound by registers
DOT = (_T(16, 64, 4, 4, True), _T(32, 64, 4, 4, True), _T(16, 128, 8, 3, True))
CANDIDATES: dict[int, tuple[TileConfig, ...]] = {
    1: ONE_ROW,
    2: (_T(8, 256, 4, 4), _T(4, 512, 4, 4), _T(16, 128, 4, 4)) + DOT,
    4: (_T(4, 256, 4, 4), _T(8, 128, 4, 4), _T(8, 256, 8, 4)) + DOT,
    8: (_T(4, 128, 4, 4), _T(4, 256, 8, 4), _T(2, 128, 4, 6)) + DOT,
    16: (_T(4, 128, 8, 4), _T(2, 128, 4, 4), _T(8, 64, 8, 4)) + DOT,
}
AGREEMENT = 0.03  # a config whose output strays further (relative to the largest value) is miscompiled


def candidate_times(shape: tuple[int, int], dtype: torch.dtype, has_bias: bool, silu_mul: bool, add_norm: bool,
                    device: torch.device, rope_heads: tuple[int, int, int] | None = None,
                    rows: int = 1) -> dict[TileConfig | None, float]:
    """GPU microseconds per call of cuBLAS + the unfused kernels (key None) and of each GEMV
    config of the `rows` bucket, for `rows` rows. A config whose output disagrees with the
    unfused path's is left out (logged): a tile the compiler gets wrong must never be picked.

    Timed over enough weight copies to overflow the L2 cache: in a decode step every
    weight comes from HBM, and a small matrix re-read from L2 would look several times
    faster than it is (H200: o_proj 2.6 us from L2, ~6 us from HBM)."""
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    copies = max(2, min(32, -(-3 * l2_bytes // (shape[0] * shape[1] * torch.finfo(dtype).bits // 8))))
    weights = [torch.randn(shape, dtype=dtype, device=device) for _ in range(copies)]
    bias = torch.randn(shape[0], dtype=dtype, device=device) if has_bias else None
    x = torch.randn((rows, shape[1]), dtype=dtype, device=device)
    norm = AddNorm(torch.randn_like(x), torch.randn(shape[1], dtype=dtype, device=device), 1e-6) if add_norm else None
    rope = _timing_rope(rope_heads, dtype, device, rows) if rope_heads else None
    expected_rope = dataclasses.replace(rope, k_buffer=rope.k_buffer.clone(), v_buffer=rope.v_buffer.clone()) \
        if rope else None
    expected = _outputs(lambda: unfused(x, weights[0], bias, silu_mul, norm, expected_rope), expected_rope)
    times = {None: graph_time_us([lambda w=w: unfused(x, w, bias, silu_mul, norm, rope) for w in weights])}
    for config in CANDIDATES[rows]:
        try:
            if not agrees(_outputs(lambda: gemv(x, weights[0], bias, silu_mul, config, norm, rope), rope), expected):
                logger.warning("gemv config %s gives wrong results on %s (%d rows): left out",
                               config.label, shape, rows)
                continue
            times[config] = graph_time_us([lambda w=w: gemv(x, w, bias, silu_mul, config, norm, rope)
                                           for w in weights])
        except Exception as error:  # e.g. a tile that needs more shared memory than this GPU has
            logger.warning("gemv config %s failed on %s (%d rows): %s", config.label, shape, rows, error)
    return times


def _outputs(call, rope: RopeStore | None) -> list[torch.Tensor]:
    """What call() produces: its output (and residual), and with rope the KV pool it writes
    (zeroed first, so that a kernel that skips the write cannot pass on earlier calls' writes)."""
    if rope is not None:
        rope.k_buffer.zero_()
        rope.v_buffer.zero_()
    result = call()
    outputs = list(result) if isinstance(result, tuple) else [result]
    return outputs + ([rope.k_buffer, rope.v_buffer] if rope is not None else [])


def agrees(got: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    """Whether a GEMV's outputs match the unfused path's up to rounding: every element within
    AGREEMENT of the largest expected magnitude."""
    for value, reference in zip(got, expected, strict=True):
        scale = reference.float().abs().max().item()
        if not (value.float() - reference.float()).abs().max().item() <= AGREEMENT * scale + 1e-6:  # NaN fails
            return False
    return True


def _timing_rope(heads: tuple[int, int, int], dtype: torch.dtype, device: torch.device, rows: int) -> RopeStore:
    """A small stand-in cache, with a distinct position and slot per row, for timing the RoPE epilogue."""
    num_q, num_kv, head_dim = heads
    table = torch.rand((rows + 1, head_dim // 2), dtype=torch.float32, device=device)
    positions = torch.arange(1, rows + 1, dtype=torch.int64, device=device)
    pool = torch.zeros((rows + 1, num_kv, head_dim), dtype=dtype, device=device)
    return RopeStore(table, table, positions, positions.clone(), pool, pool.clone(), num_q)


def unfused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool,
            add_norm: AddNorm | None, rope: RopeStore | None = None):
    """gemv's result through the other GPU kernels: add+RMSNorm, cuBLAS, silu_mul or
    rope_and_store (for shapes where cuBLAS wins, and as the baseline the GEMV is timed
    against)."""
    from specserve.model import fused_ops
    residual = None
    if add_norm is not None:
        residual = add_norm.residual.clone()  # add_rmsnorm updates it in place; the input stays
        x = fused_ops.add_rmsnorm(x.contiguous(), add_norm.weight, add_norm.eps, residual=residual)
    y = F.linear(x, weight, bias)
    y = fused_ops.silu_mul(y) if silu_mul else y
    if rope is not None:
        num_q, num_kv, head_dim = rope.heads
        q, k, v = y.view(-1, num_q + 2 * num_kv, head_dim).split([num_q, num_kv, num_kv], dim=1)
        fused_ops.rope_and_store(q, k, v, rope.cos, rope.sin, rope.positions, rope.slots, rope.k_buffer, rope.v_buffer)
        y = q.reshape(x.shape[0], -1)
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
