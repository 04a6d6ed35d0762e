"""Split-K online softmax: the pieces the decode and extend kernels share.

Both kernels walk one request's keys (prefix slots from `req_to_token`, then the slots of
the new tokens) in blocks, possibly only a slice of them (a "split"), keeping a running
max `m`, sum `l` and weighted value sum `acc` per query row (flash attention). A split
writes `acc / l` and `lse = m + log2(l)`; `merge_splits` combines the splits of a row:

    out = sum_s 2^(lse_s - lse_max) * out_s / sum_s 2^(lse_s - lse_max)

Scores are kept in log2 units (scaled by softmax_scale * log2(e)) so exp2 does the work.
A row that sees no key in a split gets out 0 and lse -inf, which the merge weighs as 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.pdl import uses_pdl

LOG2_E = 1.4426950408889634
MAX_SPLITS = 64
MERGE_CHUNK = 8  # splits a merge reads at once (a running max across chunks)


@triton.jit
def split_program():
    """(row, kv_head, split, num_splits) of a split-K program over a (rows, kv_heads, splits) grid."""
    return tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2), tl.num_programs(2)


@triton.jit
def split_range(kv_len, split, num_splits, BLOCK_N: tl.constexpr):
    """Key positions [lo, hi) of one split; splits are whole blocks, and the last ones may
    be empty (lo >= hi) so that the grid can be fixed while lengths vary."""
    per_split = _keys_per_split(kv_len, num_splits, BLOCK_N)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, kv_len)
    return lo, hi


@triton.jit
def nonempty_splits(kv_len, num_splits, BLOCK_N: tl.constexpr):
    """How many splits of split_range hold keys (the first ones); kv_len >= 1."""
    return tl.cdiv(kv_len, _keys_per_split(kv_len, num_splits, BLOCK_N))


@triton.jit
def _keys_per_split(kv_len, num_splits, BLOCK_N: tl.constexpr):
    return tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N


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
def finish_split(acc, m_i, l_i, row_ok, dim_ok, final_ptrs, lse_ptrs, split_ptrs, counter, kv_len, lo, hi,
                 split, num_splits, out_ptr, lse_ptr, final_ptr, first_token, num_tokens, group_heads, group_ok, dims,
                 stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_ft, stride_fh,
                 BLOCK_N: tl.constexpr, MERGE_CHUNK: tl.constexpr):
    """A split's rows done (acc, m_i, l_i): a context of one split writes the output, else the
    split stores its partial (split_ptrs, lse_ptrs) and counts itself in `counter`; the last
    split to arrive merges tokens first_token .. first_token + num_tokens - 1 (their heads
    `group_heads`, of which `group_ok` are real) and zeroes the counter for the next launch."""
    splits = nonempty_splits(kv_len, num_splits, BLOCK_N)
    if splits == 1:  # a context of one block: its one split writes the output
        if split == 0:
            store_split(final_ptrs, lse_ptrs, acc, m_i, l_i, row_ok, dim_ok, False)
    elif lo < hi:
        store_split(split_ptrs, lse_ptrs, acc, m_i, l_i, row_ok, dim_ok, True)
        tl.debug_barrier()  # every thread's stores are issued before the release below
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == splits - 1:
            for token in range(first_token, first_token + num_tokens):
                merge_head_splits(out_ptr + token * stride_ot + group_heads[:, None] * stride_oh + dims[None, :],
                                  lse_ptr + token * stride_lt + group_heads * stride_lh,
                                  final_ptr + token * stride_ft + group_heads[:, None] * stride_fh + dims[None, :],
                                  group_ok, dim_ok, stride_os, splits, MERGE_CHUNK, False)
            tl.store(counter, 0)


@triton.jit
def merge_head_splits(partial_ptrs, lse_ptrs, out_ptrs, head_ok, dim_ok, stride_ps, num_splits,
                      BLOCK_S: tl.constexpr, MAY_BE_EMPTY: tl.constexpr):
    """Combine the first num_splits splits of a block of heads of one token.

    partial_ptrs (H, D) / lse_ptrs (H,) point at split 0 of each head (the next split is
    stride_ps further for partial_ptrs, 1 for lse_ptrs); out_ptrs (H, D). Splits are read
    BLOCK_S at a time (all at once when num_splits <= BLOCK_S: a split-by-split loop would
    chain load latencies), with a running max across chunks. Loads bypass L1 (.cg): the
    decode kernel merges partials that other programs of the same launch just wrote.
    MAY_BE_EMPTY: some of the splits saw no key (lse -inf, partial never written); else
    the partials are loaded alongside the lse instead of after it."""
    splits = tl.arange(0, BLOCK_S)
    m = tl.full(head_ok.shape, float("-inf"), tl.float32)
    total = tl.zeros(head_ok.shape, tl.float32)
    acc = tl.zeros(partial_ptrs.shape, tl.float32)
    for first in range(0, num_splits, BLOCK_S):
        split_ok = (first + splits) < num_splits
        lse = tl.load(lse_ptrs[:, None] + first + splits[None, :], mask=head_ok[:, None] & split_ok[None, :],
                      other=float("-inf"), cache_modifier=".cg")                                   # (H, S)
        m_new = tl.maximum(m, tl.max(lse, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        weights = tl.math.exp2(lse - shift[:, None])  # 0 for empty splits
        part_ok = (head_ok[:, None] & split_ok[None, :])[:, :, None] & dim_ok[None, None, :]
        if MAY_BE_EMPTY:  # an empty split's partial output may be stale memory (NaN): never load it
            part_ok = part_ok & (lse > float("-inf"))[:, :, None]
        partial = tl.load(partial_ptrs[:, None, :] + (first + splits)[None, :, None] * stride_ps,
                          mask=part_ok, other=0.0, cache_modifier=".cg")                         # (H, S, D)
        alpha = tl.math.exp2(m - shift)
        total = total * alpha + tl.sum(weights, 1)
        acc = acc * alpha[:, None] + tl.sum(weights[:, :, None] * partial, 1)
        m = m_new
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])


@triton.jit(do_not_specialize=["stride_pt", "stride_ph", "stride_lt", "stride_lh"])  # see extend.py
def _merge_splits_kernel(partial_ptr, lse_ptr, out_ptr, split_counts,
                         stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
                         num_heads, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # the next kernel may start; everything this one reads comes from the previous one
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    num_splits = tl.load(split_counts + token)
    if num_splits > 1:  # one split wrote the output itself
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        merge_head_splits(partial_ptr + token * stride_pt + heads[:, None] * stride_ph + dims[None, :],
                          lse_ptr + token * stride_lt + heads * stride_lh,
                          out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                          heads < num_heads, dims < HEAD_DIM, stride_ps, num_splits, BLOCK_S, True)


def merge_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor,
                 split_counts: torch.Tensor) -> None:
    """partial_out (num_tokens, num_heads, num_splits, head_dim) fp32, partial_lse
    (num_tokens, num_heads, num_splits) fp32 -> out (num_tokens, num_heads, head_dim), merging
    the first split_counts[t] splits of token t (int32; 1: out already holds the result)."""
    num_tokens, num_heads, num_splits, head_dim = partial_out.shape
    if num_tokens == 0:
        return
    assert num_splits <= MAX_SPLITS
    assert partial_out.stride(-1) == 1 and partial_lse.stride(-1) == 1 and out.stride(-1) == 1
    # one compiled variant whatever the split count: MERGE_CHUNK splits at a time
    block_h = max(min(triton.next_power_of_2(num_heads), MAX_SPLITS // MERGE_CHUNK), 1)  # (H, S, D) tile <= 64 x D
    pdl = uses_pdl(out.device)
    _merge_splits_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        partial_out, partial_lse, out, split_counts,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1), out.stride(0), out.stride(1),
        num_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_S=MERGE_CHUNK,
        BLOCK_D=triton.next_power_of_2(head_dim), USE_PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 dots (the default on a GPU would be tf32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_layout(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor) -> None:
    """The kernels index the last dim with stride 1 and use K's strides for V too."""
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_buffer.stride(-1) == 1
    assert k_buffer.stride() == v_buffer.stride(), "K and V buffers must have the same layout"
    assert q.shape[1] % k_buffer.shape[1] == 0, "num_heads must be a multiple of num_kv_heads"
