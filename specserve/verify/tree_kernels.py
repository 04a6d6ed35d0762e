"""Triton kernels for the device side of a verify step: the draft trees' derived tensors and
greedy verification with its KV-table commit, one launch each instead of ~25 and ~25 small
torch kernels (issue 10: inside a CUDA graph each costs ~2 us, mostly launch gaps).

  build_trees:   DraftTrees.build's parents, depth, ancestor mask, first child, next sibling
  verify_commit: commit_path(verify_greedy(...))'s table writes and outcome, from the
                 target's argmax tokens

One program per request; a tree (n <= MAX_NODES) fits in registers as (n, n) tiles, where
a node's ancestor set is one int64 bit mask. The torch code (tree.py, rules.py,
tree_step.py) stays the reference and runs on CPUs; these kernels compute the same values
bit for bit (tests/test_tree_kernels.py, Triton's interpreter). Imported on first CUDA use:
CPU-only installs never import Triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_NODES = 32   # bit masks of 63 would fit; (n, n) register tiles stay small up to here


def _block(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


@triton.jit
def _build_trees_kernel(parents_ptr, parents_s0, parents_s1, num_nodes_ptr, num_nodes_s0,
                        parents_out, depth_out, mask_out, first_child_out, next_sibling_out, n,
                        BLOCK: tl.constexpr, ROUNDS: tl.constexpr):
    tree = tl.program_id(0).to(tl.int64)
    node = tl.arange(0, BLOCK)
    row = node[:, None]     # (BLOCK, 1): node i
    col = node[None, :]     # (1, BLOCK): node j
    real = node < n
    count = tl.load(num_nodes_ptr + tree * num_nodes_s0)
    is_child = (node > 0) & (node < count)
    parent = tl.load(parents_ptr + tree * parents_s0 + node * parents_s1, mask=is_child, other=-1).to(tl.int64)
    parent = tl.where(is_child, parent, -1)

    # Pointer doubling on bit masks: after round r, `ancestors` holds i's ancestors within
    # distance 2**r - 1 and `jump` is i's 2**r-th ancestor (the root and padding: itself).
    # A gather from a register vector is a one-hot row sum (exactly one hit per row).
    ancestors = tl.full([BLOCK], 1, tl.int64) << node.to(tl.int64)
    jump = tl.where(is_child, parent, node.to(tl.int64))
    for _ in tl.static_range(ROUNDS):
        hit = jump[:, None] == col
        ancestors = ancestors | tl.sum(tl.where(hit, ancestors[None, :], 0), axis=1)
        jump = tl.sum(tl.where(hit, jump[None, :], 0), axis=1)
    in_mask = ((ancestors[:, None] >> col.to(tl.int64)) & 1) != 0            # (i, j): j is i or an ancestor
    depth = tl.sum(in_mask.to(tl.int64), axis=1) - 1

    # children of i (columns j); i's later siblings (columns j > i)
    child_of = is_child[None, :] & (parent[None, :] == row)
    first_child = tl.min(tl.where(child_of, col, BLOCK), axis=1)
    sibling = (is_child[:, None] & is_child[None, :] & (parent[:, None] == parent[None, :]) & (col > row))
    next_sibling = tl.min(tl.where(sibling, col, BLOCK), axis=1)

    out = tree * n + node
    tl.store(parents_out + out, parent, mask=real)
    tl.store(depth_out + out, depth, mask=real)
    tl.store(first_child_out + out, tl.where(first_child == BLOCK, -1, first_child).to(tl.int64), mask=real)
    tl.store(next_sibling_out + out, tl.where(next_sibling == BLOCK, -1, next_sibling).to(tl.int64), mask=real)
    tl.store(mask_out + tree * n * n + row * n + col, in_mask.to(tl.uint8), mask=(row < n) & (col < n))


def build_trees(parents: torch.Tensor, num_nodes: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """parents (bs, n), num_nodes (bs,), any integer dtype and strides, n <= MAX_NODES.
    Returns DraftTrees.build's (parents, depth, ancestor_mask, first_child, next_sibling)."""
    bs, n = parents.shape
    block = _block(n)
    new = lambda: torch.empty((bs, n), dtype=torch.int64, device=parents.device)
    parents_out, depth, first_child, next_sibling = new(), new(), new(), new()
    mask = torch.empty((bs, n, n), dtype=torch.bool, device=parents.device)
    _build_trees_kernel[(bs,)](parents, parents.stride(0), parents.stride(1), num_nodes, num_nodes.stride(0),
                               parents_out, depth, mask.view(torch.uint8), first_child, next_sibling, n,
                               BLOCK=block, ROUNDS=block.bit_length() - 1, num_warps=1)
    return parents_out, depth, mask, first_child, next_sibling


@triton.jit
def _verify_commit_kernel(target_ptr, target_s0, target_s1, tokens_ptr, tokens_s0, tokens_s1,
                          parents_ptr, parents_s0, parents_s1, depth_ptr, depth_s0, depth_s1,
                          mask_ptr, mask_s0, mask_s1, mask_s2, slots_ptr, slots_s0, slots_s1,
                          req_rows_ptr, req_rows_s0, prefix_ptr, prefix_s0, table_ptr, table_s0,
                          outcome_ptr, n, BLOCK: tl.constexpr):
    tree = tl.program_id(0).to(tl.int64)
    node = tl.arange(0, BLOCK)
    row = node[:, None]
    col = node[None, :]
    real = node < n
    parent = tl.load(parents_ptr + tree * parents_s0 + node * parents_s1, mask=real, other=-1)
    is_child = parent >= 0
    token = tl.load(tokens_ptr + tree * tokens_s0 + node * tokens_s1, mask=real, other=0)
    target_at_parent = tl.load(target_ptr + tree * target_s0 + parent * target_s1, mask=is_child, other=0)
    matches = is_child & (token == target_at_parent)
    # accepted: a matching child with no lower-index matching sibling (the root: always)
    earlier_match = matches[None, :] & (parent[None, :] == parent[:, None]) & (col < row)    # (i, j)
    accepted = (matches & (tl.max(earlier_match.to(tl.int32), axis=1) == 0)) | (node == 0)
    # on the path: every node of i's ancestor mask accepted (padding sees only itself)
    ancestor = tl.load(mask_ptr + tree * mask_s0 + row * mask_s1 + col * mask_s2,
                       mask=(row < n) & (col < n), other=0) != 0
    blocked = ancestor & ~accepted[None, :]
    on_path = real & (tl.max(blocked.to(tl.int32), axis=1) == 0)
    accept_len = tl.sum(on_path.to(tl.int64), axis=0)

    # the path has one node per depth 0..k-1: node_at[d] is the one at depth d (-1 past k)
    depth = tl.load(depth_ptr + tree * depth_s0 + node * depth_s1, mask=real, other=-1)
    path_node = on_path[None, :] & (depth[None, :] == row)
    node_at = tl.max(tl.where(path_node, col, -1), axis=1).to(tl.int64)
    next_on_path = on_path[None, :] & (depth[None, :] == row + 1)
    next_node = tl.max(tl.where(next_on_path, col, -1), axis=1).to(tl.int64)
    last = tl.max(tl.where(on_path & (depth == accept_len - 1), node, -1), axis=0)
    bonus = tl.load(target_ptr + tree * target_s0 + last * target_s1)
    before_last = node < accept_len - 1
    next_token = tl.load(tokens_ptr + tree * tokens_s0 + next_node * tokens_s1, mask=before_last, other=-1)
    committed = tl.where(before_last, next_token, tl.where(node == accept_len - 1, bonus, -1))

    outcome = outcome_ptr + tree * (1 + 2 * n)
    tl.store(outcome, accept_len)
    tl.store(outcome + 1 + node, node_at, mask=real)
    tl.store(outcome + 1 + n + node, committed.to(tl.int64), mask=real)

    # req_to_token[row, prefix + d] = slot of the path's node at depth d, d < k. commit_path
    # also sends the other n - k writes to the scratch row; nothing reads them (a padding
    # request has prefix 0: its attention reads no table entry), so they are left out.
    on_path_depth = node < accept_len
    slot = tl.load(slots_ptr + tree * slots_s0 + node_at * slots_s1, mask=on_path_depth)
    table_row = tl.load(req_rows_ptr + tree * req_rows_s0).to(tl.int64)
    prefix = tl.load(prefix_ptr + tree * prefix_s0).to(tl.int64)
    tl.store(table_ptr + table_row * table_s0 + prefix + node, slot.to(table_ptr.dtype.element_ty),
             mask=on_path_depth)


def verify_commit(target: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                  ancestor_mask: torch.Tensor, out_slots: torch.Tensor, req_rows: torch.Tensor,
                  prefix_lens: torch.Tensor, req_to_token: torch.Tensor) -> torch.Tensor:
    """target (bs, n): the target's token after each node (the logits' argmax); the tree
    fields as DraftTrees holds them (parents normalised); out_slots (bs, n), req_rows and
    prefix_lens (bs,) as TreeStepInputs. Writes the accepted path's slots into req_to_token
    (its last dim contiguous) and returns commit_path's (bs, 1 + 2n) int64 outcome."""
    bs, n = target.shape
    outcome = torch.empty((bs, 1 + 2 * n), dtype=torch.int64, device=target.device)
    mask = ancestor_mask.view(torch.uint8)
    _verify_commit_kernel[(bs,)](target, *target.stride(), tokens, *tokens.stride(), parents, *parents.stride(),
                                 depth, *depth.stride(), mask, *mask.stride(), out_slots, *out_slots.stride(),
                                 req_rows, req_rows.stride(0), prefix_lens, prefix_lens.stride(0),
                                 req_to_token, req_to_token.stride(0), outcome, n, BLOCK=_block(n), num_warps=1)
    return outcome
