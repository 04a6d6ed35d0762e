"""Split-K online softmax: the pieces the decode and extend kernels share.

Both kernels walk one request's keys (prefix slots from `req_to_token`, then the slots of
the new tokens) in blocks, possibly only a slice of them (a "split"), keeping a running
max `m`, sum `l` and weighted value sum `acc` per query row (flash attention). A split
writes `acc / l` and `lse = m + log2(l)`, and the last split of a group of rows to finish
(`last_to_arrive`) combines the splits of each row (`merge_head_splits`):

    out = sum_s 2^(lse_s - lse_max) * out_s / sum_s 2^(lse_s - lse_max)

Scores are kept in log2 units (scaled by softmax_scale * log2(e)) so exp2 does the work.
A row that sees no key in a split gets out 0 and lse -inf, which the merge weighs as 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
MERGE_CHUNK = 8  # splits a merge reads at once (a running max across chunks)


@triton.jit
def keys_per_split(kv_len, num_splits, min_keys, BLOCK_N: tl.constexpr):
    """Keys of each split when kv_len keys are spread over num_splits: whole blocks, at least
    min_keys; split s holds positions [s * keys, (s + 1) * keys) clipped to kv_len, so the
    last splits may be empty and the first cdiv(kv_len, keys) hold keys. A grid launched
    for the longest context a pool allows (CUDA graphs) then splits a short one no finer
    than a plan made for its own length would (min_keys: the backend's min_keys_per_split)."""
    return tl.cdiv(tl.maximum(tl.cdiv(kv_len, num_splits), min_keys), BLOCK_N) * BLOCK_N


@triton.jit
def last_to_arrive(counter, arrivals):
    """Count this program in at `counter` once its partial output is stored. True for the
    program that brings the count to `arrivals`: every other partial is then written and
    visible to it (acq_rel), so it merges them; it also puts the counter back to zero for
    the next launch (CUDA graph replays reuse the counters)."""
    tl.debug_barrier()  # every thread's stores are issued before the release below
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == arrivals - 1
    if last:
        tl.store(counter, 0)
    return last


@triton.jit
def load_kv_block(k_buffer, v_buffer, slots, kv_head, stride_slot, stride_head, dims, key_ok, dim_ok,
                  dtype: tl.constexpr):
    """K and V of a block of keys: two (BLOCK_N, BLOCK_D) tiles in the query dtype."""
    offsets = slots[:, None] * stride_slot + kv_head * stride_head + dims[None, :]
    mask = key_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_buffer + offsets, mask=mask, other=0.0).to(dtype)
    v = tl.load(v_buffer + offsets, mask=mask, other=0.0).to(dtype)
    return k, v


@triton.jit
def attend_block(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One online-softmax step. q (M, D), k and v (N, D), visible (M, N) or (1, N) bool;
    m_i, l_i (M,) and acc (M, D) fp32."""
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (M, N) fp32
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # a row that has seen no visible key yet keeps m = -inf; subtract 0 so exp2 stays 0, not NaN
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_shift)
    p = tl.math.exp2(scores - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def store_split(out_ptrs, lse_ptrs, acc, m_i, l_i, row_ok, dim_ok, STORE_LSE: tl.constexpr):
    """Write acc / l (in the out buffer's dtype) and, when there are several splits, lse."""
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    if STORE_LSE:
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit
def merge_head_splits(partial_ptrs, lse_ptrs, out_ptrs, row_ok, dim_ok, stride_ps, num_splits,
                      BLOCK_S: tl.constexpr):
    """Combine the first num_splits splits of a block of query rows (the heads of one token,
    or (token, head) rows of one kv head), every one of them written by this launch.

    partial_ptrs (R, D) / lse_ptrs (R,) point at split 0 of each row (the next split is
    stride_ps further for partial_ptrs, 1 for lse_ptrs); out_ptrs (R, D). Splits are read
    BLOCK_S at a time (all at once when num_splits <= BLOCK_S: a split-by-split loop would
    chain load latencies), with a running max across chunks, each partial alongside its
    lse. Loads bypass L1 (.cg): the partials were just written by other programs."""
    splits = tl.arange(0, BLOCK_S)
    m = tl.full(row_ok.shape, float("-inf"), tl.float32)
    total = tl.zeros(row_ok.shape, tl.float32)
    acc = tl.zeros(partial_ptrs.shape, tl.float32)
    for first in range(0, num_splits, BLOCK_S):
        split_ok = (first + splits) < num_splits
        lse = tl.load(lse_ptrs[:, None] + first + splits[None, :], mask=row_ok[:, None] & split_ok[None, :],
                      other=float("-inf"), cache_modifier=".cg")                                   # (R, S)
        m_new = tl.maximum(m, tl.max(lse, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        weights = tl.math.exp2(lse - shift[:, None])  # 0 where a row saw no key of the split
        part_ok = (row_ok[:, None] & split_ok[None, :])[:, :, None] & dim_ok[None, None, :]
        partial = tl.load(partial_ptrs[:, None, :] + (first + splits)[None, :, None] * stride_ps,
                          mask=part_ok, other=0.0, cache_modifier=".cg")                         # (R, S, D)
        alpha = tl.math.exp2(m - shift)
        total = total * alpha + tl.sum(weights, 1)
        acc = acc * alpha[:, None] + tl.sum(weights[:, :, None] * partial, 1)
        m = m_new
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 dots (the default on a GPU would be tf32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_layout(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor) -> None:
    """The kernels index the last dim with stride 1 and use K's strides for V too."""
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_buffer.stride(-1) == 1
    assert k_buffer.stride() == v_buffer.stride(), "K and V buffers must have the same layout"
    assert q.shape[1] % k_buffer.shape[1] == 0, "num_heads must be a multiple of num_kv_heads"
