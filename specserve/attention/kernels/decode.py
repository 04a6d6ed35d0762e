"""Decode attention: one new token per request, split over the keys (flash-decoding).

Program (request, kv_head, split) loads the query rows of every q head that shares the
kv head (grouped-query: the K/V block is read once for the whole group, and the group is
padded to 16 rows so it can go through tl.dot), walks the split's keys and writes a
partial result. The last split of a (request, kv_head) to finish merges the group's
splits itself: each split counts itself in an atomic counter after its stores, and the
one that brings the count to the number of non-empty splits reads them all back, writes
the output and zeroes the counter for the next launch. That saves a merge kernel per layer
(~2 us at batch 1, where a decode step is a chain of small kernels). The keys of request
b are its prefix (`req_to_token[req_rows[b], :prefix_lens[b]]`) followed by its own new
slot `out_slots[b]`. With one split the program writes the final output directly.

TREE mode runs a verify step's draft trees through the same kernel, one program row per
tree node, the rows laid out request after request (ragged: request b has its own node
count, `qo_indptr[b + 1] - qo_indptr[b]`). Row r belongs to request `row_owner[r]` and is
its node i = r - qo_indptr[b]: it sees the request's prefix and those of the request's new
slots `out_slots[qo_indptr[b]:qo_indptr[b + 1]]` that `tree_mask[b, i]` allows (itself and
its ancestors). A row of no request (`row_owner` -1: padding after the last request) reads
no key and writes zeros. At small batches this beats the extend kernel and its merge
kernel by 2-3x (H200, 1.5B heads, batch 1, 9 nodes, 300-3000 keys: 195-408 us a step for 28
layers against 463-822), since a node's few keys need no tl.dot over a 64-row block and the
splits are merged in-kernel; a whole batch-1 verify step of 8 nodes took 1.75 ms of GPU time
instead of 2.30 (step_cost, random 1.5B weights).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.kernels.online_softmax import (
    LOG2_E, MERGE_CHUNK, attend_block, check_layout, dot_precision, finish_split, load_kv_block, split_program,
    split_range, store_split)
from specserve.pdl import uses_pdl

# launch configuration; BLOCK_N keys per step
CONFIG = dict(BLOCK_N=128, num_stages=2)
# 8 warps per program up to this batch size, 4 above (H200, 1.5B heads, 512-8192 keys:
# 8 warps are 0.5-1.4 us faster per launch at batch 1, 0.4-0.6 at 4, slower from 8 on)
MANY_WARPS_MAX_BATCH = 4


@triton.jit
def _key_slots(pos, prefix_len, table_row_ptr, new_slot):
    """Slot of each key position: the prefix from the request's `req_to_token` row, then
    the new token's slot at position prefix_len (past it: slot 0, masked by the caller)."""
    in_prefix = pos < prefix_len
    from_table = tl.load(table_row_ptr + pos, mask=in_prefix, other=0).to(tl.int64)
    return tl.where(in_prefix, from_table, tl.where(pos == prefix_len, new_slot, 0))


@triton.jit
def tree_key_slots(pos, key_ok, prefix_len, table_row_ptr, new_slots_ptr, tree_n):
    """The KV slot of each key position of a request's tree step: the prefix from its
    `req_to_token` row, then its tree_n new slots (its node count); and, for the tree mask,
    whether each is a prefix key, its index among the new keys, and whether it is one."""
    in_prefix = pos < prefix_len
    new_index = pos - prefix_len
    is_new = key_ok & (new_index >= 0) & (new_index < tree_n)
    from_table = tl.load(table_row_ptr + pos, mask=key_ok & in_prefix, other=0).to(tl.int64)
    from_new = tl.load(new_slots_ptr + new_index, mask=is_new, other=0).to(tl.int64)
    return tl.where(in_prefix, from_table, from_new), in_prefix, new_index, is_new


@triton.jit
def _tree_key_slots(pos, key_ok, prefix_len, table_row_ptr, new_slots_ptr, mask_row_ptr, tree_n):
    """(slot, visible) of each key position of one tree node: visible where the node's mask
    row says so."""
    slots, in_prefix, new_index, is_new = tree_key_slots(pos, key_ok, prefix_len, table_row_ptr, new_slots_ptr,
                                                         tree_n)
    seen = tl.load(mask_row_ptr + new_index, mask=is_new, other=0) != 0
    return slots, key_ok & (in_prefix | seen)


@triton.jit
def _decode_kernel(q_ptr, k_buffer, v_buffer, req_to_token, req_rows, prefix_lens, out_slots,
                   out_ptr, lse_ptr, final_ptr, counters, tree_mask, row_owner, qo_indptr,
                   stride_qt, stride_qh, stride_slot, stride_kv_head, stride_table,
                   stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_ft, stride_fh,
                   stride_tree_b, stride_tree_i, qk_scale,
                   HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, STORE_LSE: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, MERGE_CHUNK: tl.constexpr, TREE: tl.constexpr,
                   USE_PDL: tl.constexpr):
    # `req` is the program's query row: a request's one new token, or in TREE mode a tree node
    req, kv_head, split, num_splits = split_program()

    if USE_PDL:  # the next kernel (o_proj) may start fetching its weights
        tl.extra.cuda.gdc_launch_dependents()
    group_rows = tl.arange(0, BLOCK_H)
    row_ok = group_rows < GROUP
    heads = kv_head * GROUP + group_rows
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    # the batch's metadata was written before the step's first kernel: no need to wait for it
    if TREE:  # the row is node `req - qo_start` of request `owner`, whose tree_n new tokens start at qo_start
        owner = tl.load(row_owner + req)
        real = owner >= 0   # else padding: bookkept as one key (one split), of which it reads none
        owner = tl.maximum(owner, 0).to(tl.int64)
        qo_start = tl.load(qo_indptr + owner).to(tl.int64)
        tree_n = tl.load(qo_indptr + owner + 1) - qo_start
        prefix_len = tl.where(real, tl.load(prefix_lens + owner), 0)
        kv_len = prefix_len + tl.where(real, tree_n, 1)
        mask_row = tree_mask + owner * stride_tree_b + (req - qo_start) * stride_tree_i
    else:     # the row is request `req`'s one new token
        owner = req
        prefix_len = tl.load(prefix_lens + owner)
        kv_len = prefix_len + 1
        new_slot = tl.load(out_slots + req)
    table_row = req_to_token + tl.load(req_rows + owner).to(tl.int64) * stride_table
    if USE_PDL:  # q and the new token's K/V come from the previous kernel
        tl.extra.cuda.gdc_wait()
    q = tl.load(q_ptr + req * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)            # (BLOCK_H, BLOCK_D)
    lo, hi = split_range(kv_len, split, num_splits, BLOCK_N)
    if TREE:
        hi = tl.where(real, hi, lo)   # a padding row reads nothing (slot 0 may hold anything): output 0

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        key_ok = pos < hi
        if TREE:
            slots, visible = _tree_key_slots(pos, key_ok, prefix_len, table_row, out_slots + qo_start,
                                             mask_row, tree_n)
        else:
            slots, visible = _key_slots(pos, prefix_len, table_row, new_slot), key_ok
        k, v = load_kv_block(k_buffer, v_buffer, slots, kv_head, stride_slot, stride_kv_head, dims,
                             key_ok, dim_ok, q.dtype)
        m_i, l_i, acc = attend_block(q, k, v, visible[None, :], m_i, l_i, acc, qk_scale, DOT_PRECISION)

    final_ptrs = final_ptr + req * stride_ft + heads[:, None] * stride_fh + dims[None, :]
    lse_ptrs = lse_ptr + req * stride_lt + heads * stride_lh + split
    if STORE_LSE:
        group = kv_head * GROUP + tl.arange(0, BLOCK_G)  # the merge needs no padding for tl.dot
        finish_split(acc, m_i, l_i, row_ok, dim_ok, final_ptrs, lse_ptrs,
                     out_ptr + req * stride_ot + heads[:, None] * stride_oh + split * stride_os + dims[None, :],
                     counters + req * tl.num_programs(1) + kv_head, kv_len, lo, hi, split, num_splits,
                     out_ptr, lse_ptr, final_ptr, req, 1, group, tl.arange(0, BLOCK_G) < GROUP, dims,
                     stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_ft, stride_fh, BLOCK_N, MERGE_CHUNK)
    else:
        store_split(final_ptrs, lse_ptrs, acc, m_i, l_i, row_ok, dim_ok, False)


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_token: torch.Tensor, req_rows: torch.Tensor, prefix_lens: torch.Tensor,
                     out_slots: torch.Tensor, out: torch.Tensor, scale: float,
                     partial_out: torch.Tensor | None = None, partial_lse: torch.Tensor | None = None,
                     split_counters: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                     row_owner: torch.Tensor | None = None, qo_indptr: torch.Tensor | None = None) -> None:
    """q, out: (bs, num_heads, head_dim), token b belongs to request b; k/v_buffer: (slots,
    num_kv_heads, head_dim); req_rows, prefix_lens: (bs,) int32; out_slots: (bs,) int64.
    partial_out (bs, num_heads, splits, head_dim) and partial_lse (bs, num_heads, splits)
    fp32 give the split count, split_counters (>= bs * num_kv_heads,) int32, all zero
    (and zero again after the call), the merge's arrival counts; without them one split
    writes `out` directly.

    tree_mask (requests, n, n) uint8/bool: TREE mode (see the module docstring); q, out,
    out_slots then have a row per tree node (padding rows after them allowed), and bs above
    counts those rows, while req_rows and prefix_lens stay per request. It needs
    row_owner (>= bs,) int32, each row's request or -1 (`row_owners`), and qo_indptr
    (requests + 1,) int32, each request's first row; request b has 1..n nodes."""
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if bs == 0:
        return
    check_layout(q, k_buffer, v_buffer, out)
    split_out = partial_out is not None
    assert not split_out or (split_counters is not None and split_counters.numel() >= bs * num_kv_heads)
    if tree_mask is not None:
        assert tree_mask.stride(-1) == 1 and tree_mask.dtype in (torch.uint8, torch.int8, torch.bool)
        assert row_owner is not None and row_owner.numel() >= bs and qo_indptr is not None, "TREE mode: row owners"
    num_splits = partial_out.shape[2] if split_out else 1
    target, lse = (partial_out, partial_lse) if split_out else (out.unsqueeze(2), out)
    group = num_heads // num_kv_heads
    pdl = uses_pdl(q.device)
    tree = tree_mask if tree_mask is not None else out_slots  # a dummy pointer outside TREE mode
    _decode_kernel[(bs, num_kv_heads, num_splits)](
        q, k_buffer, v_buffer, req_to_token, req_rows, prefix_lens, out_slots, target, lse, out,
        split_counters if split_out else out_slots, tree,
        row_owner if tree_mask is not None else out_slots, qo_indptr if tree_mask is not None else out_slots,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), req_to_token.stride(0),
        target.stride(0), target.stride(1), target.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), tree.stride(0) if tree_mask is not None else 0,
        tree.stride(1) if tree_mask is not None else 0, scale * LOG2_E,
        HEAD_DIM=head_dim, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_G=triton.next_power_of_2(group), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        STORE_LSE=split_out, DOT_PRECISION=dot_precision(q.dtype), MERGE_CHUNK=MERGE_CHUNK,
        TREE=tree_mask is not None, USE_PDL=pdl, num_warps=8 if bs <= MANY_WARPS_MAX_BATCH else 4, **CONFIG,
        **({"launch_pdl": True} if pdl else {}))


def row_owners(qo_indptr: torch.Tensor, num_rows: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """(num_rows,) int32: the request of each row for request ranges qo_indptr (int32,
    (requests + 1,), starting at 0), -1 for the rows past the last request. Device ops
    only, no host sync and a fixed shape: a CUDA graph computes it for each replay's lengths."""
    rows = torch.arange(num_rows, dtype=qo_indptr.dtype, device=qo_indptr.device)
    owners = torch.searchsorted(qo_indptr[1:], rows, right=True, out_int32=True, out=out)
    return owners.masked_fill_(owners >= qo_indptr.shape[0] - 1, -1)
