"""Verify attention with a request's whole draft tree in one program: its keys read once.

A verify step of b requests with n nodes each asks, per node, for attention over the
request's prefix and the node's ancestors among the new tokens. The decode kernel's TREE
mode runs a program per node, so each node reads the whole prefix again; the extend kernel
tiles 64 query rows per program, most of them padding for a draft of 4 nodes, and merges
its splits in a kernel of its own. At 64 requests x 4 nodes (H100, 1.5B, random weights,
`lab.step_cost`) the extend kernel and its merge took 1.27 ms of a 4.3 ms fused EAGLE-3
step, where a plain step's decode attention over the same keys took 0.48.

Here program (request, kv_head, split) loads the query rows of every node and every q
head of the kv head's group (node i, head g is row i * GROUP + g, padded to a power of two
of at least 16 rows for tl.dot), walks the split's keys once and masks per row: the prefix
is visible to every node, new key j to node i where `tree_mask[b, i, j]` says so. The last
split of a (request, kv_head) to finish merges the splits of all its nodes (an arrival
counter, as the decode kernel does). Ragged: request b has `qo_indptr[b + 1] - qo_indptr[b]`
nodes (<= n); rows past them load nothing, and tokens past the last request are written
by no program (the caller zeroes them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.kernels.decode import CONFIG, tree_key_slots
from specserve.attention.kernels.online_softmax import (
    LOG2_E, MERGE_CHUNK, attend_block, check_layout, dot_precision, finish_split, load_kv_block, split_program,
    split_range, store_split)
from specserve.pdl import uses_pdl

# query rows a program may hold (nodes x group, padded): past it the extend kernel is used
MAX_GROUP_ROWS = 64


def group_rows(nodes: int, group: int) -> int:
    """The padded query rows of a program for trees of `nodes` nodes and `group` q heads per kv head."""
    return max(16, triton.next_power_of_2(nodes * group))


@triton.jit
def _tree_group_kernel(q_ptr, k_buffer, v_buffer, req_to_token, req_rows, prefix_lens, out_slots, qo_indptr,
                       tree_mask, out_ptr, lse_ptr, final_ptr, counters,
                       stride_qt, stride_qh, stride_slot, stride_kv_head, stride_table,
                       stride_tree_b, stride_tree_i, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                       stride_ft, stride_fh, qk_scale,
                       HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, STORE_LSE: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, MERGE_CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    req, kv_head, split, num_splits = split_program()
    if USE_PDL:  # the next kernel (o_proj) may start fetching its weights
        tl.extra.cuda.gdc_launch_dependents()
    qo_start = tl.load(qo_indptr + req).to(tl.int64)
    tree_n = tl.load(qo_indptr + req + 1) - qo_start
    prefix_len = tl.load(prefix_lens + req)
    kv_len = prefix_len + tree_n
    table_row = req_to_token + tl.load(req_rows + req).to(tl.int64) * stride_table

    rows = tl.arange(0, BLOCK_R)
    node = rows // GROUP
    row_ok = node < tree_n
    heads = kv_head * GROUP + rows % GROUP
    tokens = qo_start + node
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    mask_rows = tree_mask + req * stride_tree_b + node * stride_tree_i
    if USE_PDL:  # q and the new tokens' K/V come from the previous kernel
        tl.extra.cuda.gdc_wait()
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)            # (BLOCK_R, BLOCK_D)
    lo, hi = split_range(kv_len, split, num_splits, BLOCK_N)

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        key_ok = pos < hi
        slots, in_prefix, new_index, is_new = tree_key_slots(pos, key_ok, prefix_len, table_row,
                                                             out_slots + qo_start, tree_n)
        k, v = load_kv_block(k_buffer, v_buffer, slots, kv_head, stride_slot, stride_kv_head, dims,
                             key_ok, dim_ok, q.dtype)
        seen = tl.load(mask_rows[:, None] + new_index[None, :], mask=row_ok[:, None] & is_new[None, :], other=0) != 0
        visible = (key_ok & in_prefix)[None, :] | seen                       # (BLOCK_R, BLOCK_N)
        m_i, l_i, acc = attend_block(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION)

    final_ptrs = final_ptr + tokens[:, None] * stride_ft + heads[:, None] * stride_fh + dims[None, :]
    lse_ptrs = lse_ptr + tokens * stride_lt + heads * stride_lh + split
    if STORE_LSE:  # the last split merges every node's heads, a node at a time
        group = kv_head * GROUP + tl.arange(0, BLOCK_G)
        finish_split(acc, m_i, l_i, row_ok, dim_ok, final_ptrs, lse_ptrs,
                     out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + split * stride_os
                     + dims[None, :], counters + req * tl.num_programs(1) + kv_head, kv_len, lo, hi, split,
                     num_splits, out_ptr, lse_ptr, final_ptr, qo_start, tree_n, group, tl.arange(0, BLOCK_G) < GROUP,
                     dims, stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_ft, stride_fh, BLOCK_N,
                     MERGE_CHUNK)
    else:
        store_split(final_ptrs, lse_ptrs, acc, m_i, l_i, row_ok, dim_ok, False)


def tree_group_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         req_to_token: torch.Tensor, req_rows: torch.Tensor, prefix_lens: torch.Tensor,
                         out_slots: torch.Tensor, qo_indptr: torch.Tensor, tree_mask: torch.Tensor,
                         out: torch.Tensor, scale: float, partial_out: torch.Tensor | None = None,
                         partial_lse: torch.Tensor | None = None, split_counters: torch.Tensor | None = None,
                         launch: dict | None = None) -> None:
    """q, out, out_slots: a row per tree node, request after request (qo_indptr (requests + 1,)
    int32; rows past the last request are left alone); tree_mask (requests, n, n) uint8/bool,
    each request's nodes 0 .. tree_n - 1 (tree_n <= n); req_rows, prefix_lens (requests,)
    int32; k/v_buffer (slots, num_kv_heads, head_dim). partial_out (rows, num_heads, splits,
    head_dim) and partial_lse (rows, num_heads, splits) fp32 give the split count, and
    split_counters (>= requests * num_kv_heads,) int32, all zero (and zero again after the
    call), the merge's arrival counts; without them one split writes `out` directly. launch:
    BLOCK_N, num_warps or num_stages instead of the defaults (lab/tree_group_sweep.py)."""
    requests, n = tree_mask.shape[0], tree_mask.shape[-1]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_buffer.shape[1]
    if requests == 0:
        return
    check_layout(q, k_buffer, v_buffer, out)
    assert tree_mask.stride(-1) == 1 and tree_mask.dtype in (torch.uint8, torch.int8, torch.bool)
    group = num_heads // num_kv_heads
    block_r = group_rows(n, group)
    assert block_r <= MAX_GROUP_ROWS, f"{n} nodes x {group} heads exceed {MAX_GROUP_ROWS} rows a program"
    split_out = partial_out is not None
    assert not split_out or (split_counters is not None and split_counters.numel() >= requests * num_kv_heads)
    num_splits = partial_out.shape[2] if split_out else 1
    target, lse = (partial_out, partial_lse) if split_out else (out.unsqueeze(2), out)
    pdl = uses_pdl(q.device)
    launch = {"BLOCK_N": CONFIG["BLOCK_N"], "num_warps": 4, "num_stages": CONFIG["num_stages"], **(launch or {})}
    _tree_group_kernel[(requests, num_kv_heads, num_splits)](
        q, k_buffer, v_buffer, req_to_token, req_rows, prefix_lens, out_slots, qo_indptr, tree_mask,
        target, lse, out, split_counters if split_out else out_slots,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), req_to_token.stride(0),
        tree_mask.stride(0), tree_mask.stride(1), target.stride(0), target.stride(1), target.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), scale * LOG2_E,
        HEAD_DIM=head_dim, GROUP=group, BLOCK_R=block_r, BLOCK_G=triton.next_power_of_2(group),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), STORE_LSE=split_out,
        DOT_PRECISION=dot_precision(q.dtype), MERGE_CHUNK=MERGE_CHUNK, USE_PDL=pdl, **launch,
        **({"launch_pdl": True} if pdl else {}))
