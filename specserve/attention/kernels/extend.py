"""Extend / verify attention: the new tokens of each request (ragged, `qo_indptr`) attend
to the request's prefix and to the new tokens a mask allows among themselves.

One kernel, two mask modes (a constexpr): causal (EXTEND: prefill, chunked prefill) or
a tree (VERIFY: `tree_mask[b, i, j]`, node i sees node j iff j is i or an ancestor).

Grouped-query: the rows of a query block are (token, q head) pairs of one kv head, row
r = token * GROUP + head_in_group, so a K/V block is loaded once for all heads of the
group — a verify step of n tokens then reads the prefix once per kv head, like decode.
The keys can be split (grid axis 2) as in decode, so a few long requests still fill the
GPU; `merge_splits` reduces the splits a request used (a request whose keys fit one split
has its output written by that split, and nothing to merge). A causal request uses no more
splits than its keys per new token allow (KEYS_PER_NEW_TOKEN): a prompt's own row blocks
fill the GPU, and splitting them only adds a merge. Each
program walks its split in two runs: prefix keys (slots from `req_to_token`, no mask to
compute) and then new keys (slots from `out_slots`, through the mask).

On Hopper both kernels are launched with programmatic dependent launch (pdl.py): the extend
kernel reads the batch's metadata while the previous kernel (RoPE + the KV write) finishes,
and the merge starts while the extend kernel's last programs run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.kernels.online_softmax import (
    LOG2_E, attend_block, check_layout, dot_precision, load_kv_block, merge_splits, nonempty_splits, split_range,
    store_split)
from specserve.pdl import uses_pdl

# launch configuration: BLOCK_M query rows (token x head) and BLOCK_N keys per step; heads of
# 128 dims take 32 keys a step. Swept on an H200 (BLOCK_M 64/128, BLOCK_N 32-128, 4/8 warps,
# 2-4 stages; prompts of 16-2000 tokens, with and without a 1500-2000-token prefix): these
# were the best or within 3% for heads of 64 and 128 dims (1.5B, 1000 tokens: 34 us against
# 36 us with 64 keys and 3 stages).
CONFIG = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
WIDE_HEAD_BLOCK_N = 32   # BLOCK_N for head_dim >= 128

# A causal request splits its keys only into splits of at least this many keys per new token.
# Splits shorten a long prefix's walk for a few new tokens (16 tokens after 2000: 17 us with 4
# splits, 31 us with one), but a prompt's own tokens fill the GPU with row blocks: a
# 1000-token prompt ran 37 us with 2 splits (their merge included) and 27 us with one.
KEYS_PER_NEW_TOKEN = tl.constexpr(4)


def num_row_blocks(tokens_per_req: int, group: int, block_m: int = CONFIG["BLOCK_M"]) -> int:
    """Query blocks per request along grid axis 0 (rows are tokens x heads of the group)."""
    return triton.cdiv(max(tokens_per_req, 1) * group, block_m)


@triton.jit
def _attend_keys(q, m_i, l_i, acc, k_buffer, v_buffer, slot_ptr, lo, hi, kv_head, stride_slot, stride_kv_head,
                 dims, dim_ok, qk_scale, token, row_ok, tree_rows,
                 MASK: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Attend to the keys with index [lo, hi) of a run of slots (`slot_ptr[index]`).
    MASK 0: every row sees every key (the prefix); 1: causal, row sees index <= token;
    2: tree, row sees index iff tree_rows[row][index] (tree_rows: (BLOCK_M,) pointers)."""
    for start in range(lo, hi, BLOCK_N):
        index = start + tl.arange(0, BLOCK_N)
        key_ok = index < hi
        slots = tl.load(slot_ptr + index, mask=key_ok, other=0).to(tl.int64)
        k, v = load_kv_block(k_buffer, v_buffer, slots, kv_head, stride_slot, stride_kv_head, dims,
                             key_ok, dim_ok, q.dtype)
        if MASK == 0:
            visible = key_ok[None, :]
        elif MASK == 1:
            visible = key_ok[None, :] & (index[None, :] <= token[:, None])
        else:
            visible = tl.load(tree_rows[:, None] + index[None, :], mask=row_ok[:, None] & key_ok[None, :],
                              other=0) != 0
        m_i, l_i, acc = attend_block(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION)
    return m_i, l_i, acc


# Integer arguments that vary with how prompts happen to be batched (tree size, split count,
# row blocks) are not specialised on (Triton compiles a variant per value that is 1 or a
# multiple of 16): a new variant is a compile of ~0.5 s in the middle of serving.
@triton.jit(do_not_specialize=["stride_tree_b", "stride_tree_i", "stride_ot", "stride_oh", "stride_os",
                               "stride_lt", "stride_lh", "stride_ft", "stride_fh", "row_blocks"])
def _extend_kernel(q_ptr, k_buffer, v_buffer, req_to_token, req_rows, prefix_lens, qo_indptr, out_slots,
                   tree_mask, out_ptr, lse_ptr, final_ptr, split_counts, block_reqs, block_rows,
                   stride_qt, stride_qh, stride_slot, stride_kv_head, stride_table,
                   stride_tree_b, stride_tree_i,
                   stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_ft, stride_fh,
                   row_blocks, qk_scale,
                   HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, TREE_MASK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   STORE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_TABLE: tl.constexpr,
                   USE_PDL: tl.constexpr):
    if USE_PDL:  # the next kernel (the merge, or o_proj) may start
        tl.extra.cuda.gdc_launch_dependents()
    # the block table and the batch's metadata were written before the step's first kernel: no need to wait
    if BLOCK_TABLE:  # ragged: program i is the row block block_rows[i] of request block_reqs[i]
        req = tl.load(block_reqs + tl.program_id(0))
        row_block = tl.load(block_rows + tl.program_id(0))
    else:            # every request gets row_blocks programs
        req = tl.program_id(0) // row_blocks
        row_block = tl.program_id(0) % row_blocks
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    qo_start = tl.load(qo_indptr + req).to(tl.int64)
    extend_len = tl.load(qo_indptr + req + 1) - qo_start
    prefix_len = tl.load(prefix_lens + req)
    table_row = req_to_token + tl.load(req_rows + req).to(tl.int64) * stride_table

    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    token = rows // GROUP                                                     # index among the new tokens
    heads = kv_head * GROUP + rows % GROUP
    row_ok = token < extend_len
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    if USE_PDL:  # q and the new tokens' K/V come from the previous kernel
        tl.extra.cuda.gdc_wait()
    q_rows = (qo_start + token) * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    if not TREE_MASK:  # causal: only as many splits as the prefix is long against the new tokens
        most = (prefix_len + extend_len) // (KEYS_PER_NEW_TOKEN * tl.maximum(extend_len, 1))
        num_splits = tl.maximum(tl.minimum(num_splits, most), 1)
    # this split's key positions (none past the request's split count), then the part this block of rows may see
    lo, hi = split_range(prefix_len + extend_len, split, num_splits, BLOCK_N)
    if not TREE_MASK:  # causal: no row of the block sees past its last token
        hi = tl.minimum(hi, prefix_len + tl.minimum((row_block * BLOCK_M + BLOCK_M - 1) // GROUP, extend_len - 1) + 1)
    hi = tl.where(row_block * BLOCK_M < extend_len * GROUP, hi, lo)  # a block of padding rows reads nothing

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    tree_rows = tree_mask + req * stride_tree_b + token * stride_tree_i
    # prefix keys, seen by every row, with no mask to compute
    m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, k_buffer, v_buffer, table_row, lo, tl.minimum(hi, prefix_len),
                                 kv_head, stride_slot, stride_kv_head, dims, dim_ok, qk_scale, token, row_ok,
                                 tree_rows, 0, BLOCK_N, DOT_PRECISION)
    # new keys, indexed among the new tokens, through the causal or tree mask
    m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, k_buffer, v_buffer, out_slots + qo_start,
                                 tl.maximum(lo, prefix_len) - prefix_len, hi - prefix_len,
                                 kv_head, stride_slot, stride_kv_head, dims, dim_ok, qk_scale, token, row_ok,
                                 tree_rows, 2 if TREE_MASK else 1, BLOCK_N, DOT_PRECISION)

    out_rows = (qo_start + token) * stride_ot + heads * stride_oh + split * stride_os
    lse_ptrs = lse_ptr + (qo_start + token) * stride_lt + heads * stride_lh + split
    if STORE_LSE:
        # Graphs launch splits for the longest context a pool allows; a request uses only
        # the first `splits` of them, and the merge reads no more (its count per token).
        splits = nonempty_splits(tl.maximum(prefix_len + extend_len, 1), num_splits, BLOCK_N)  # 0: an empty request
        if split == 0:
            tl.store(split_counts + qo_start + token, splits, mask=row_ok)
        if splits == 1:  # one split holds every key: it writes the output, nothing to merge
            if split == 0:
                final_rows = (qo_start + token) * stride_ft + heads * stride_fh
                store_split(final_ptr + final_rows[:, None] + dims[None, :], lse_ptrs, acc, m_i, l_i, row_ok, dim_ok,
                            False)
        elif split < splits:  # also when this row block sees none of the split's keys (lse -inf)
            store_split(out_ptr + out_rows[:, None] + dims[None, :], lse_ptrs, acc, m_i, l_i, row_ok, dim_ok, True)
    else:
        store_split(out_ptr + out_rows[:, None] + dims[None, :], lse_ptrs, acc, m_i, l_i, row_ok, dim_ok, False)


def extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     req_to_token: torch.Tensor, req_rows: torch.Tensor, prefix_lens: torch.Tensor,
                     qo_indptr: torch.Tensor, out_slots: torch.Tensor, out: torch.Tensor, scale: float,
                     row_blocks: int, tree_mask: torch.Tensor | None = None,
                     partial_out: torch.Tensor | None = None, partial_lse: torch.Tensor | None = None,
                     split_counts: torch.Tensor | None = None,
                     block_table: tuple[torch.Tensor, torch.Tensor] | None = None, config: dict | None = None) -> None:
    """q, out: (num_tokens, num_heads, head_dim), request b's tokens are
    qo_indptr[b]:qo_indptr[b+1] (int32, (bs+1,)); req_rows, prefix_lens: (bs,) int32;
    out_slots: (num_tokens,) int64; row_blocks: `num_row_blocks` of the longest request
    (or more: extra blocks do nothing). tree_mask (bs, n, n) uint8/bool selects the tree
    mode, else causal. partial_out/partial_lse as in `decode_attention`, with split_counts
    (>= num_tokens,) int32 scratch: how many splits each token's request uses. They may
    have fewer rows than q when the tokens past them belong to no request (a ragged VERIFY
    batch's padding: no program writes them, the merge visits only partial_out's rows).
    block_table: (request, row block) int32 pairs, one program each (`ragged_block_table`),
    replacing the bs x row_blocks grid: prompts of different lengths launch only the blocks
    they fill (row_blocks is then ignored). config: the launch configuration, CONFIG's keys
    (BLOCK_N included); row_blocks and a block table must count its BLOCK_M."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    bs = req_rows.shape[0]
    if num_tokens == 0 or bs == 0:
        return
    check_layout(q, k_buffer, v_buffer, out)
    split_out = partial_out is not None
    assert not split_out or (split_counts is not None and split_counts.numel() >= num_tokens)
    num_splits = partial_out.shape[2] if split_out else 1
    target, lse = (partial_out, partial_lse) if split_out else (out.unsqueeze(2), out)
    tree = tree_mask if tree_mask is not None else qo_indptr  # a dummy pointer in causal mode
    if tree_mask is not None:
        assert tree_mask.stride(-1) == 1 and tree_mask.dtype in (torch.uint8, torch.int8, torch.bool)
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_reqs, block_rows = block_table if block_table is not None else (qo_indptr, qo_indptr)  # dummies
    programs = block_reqs.shape[0] if block_table is not None else bs * row_blocks
    pdl = uses_pdl(q.device)
    config = config or dict(CONFIG, BLOCK_N=WIDE_HEAD_BLOCK_N if head_dim >= 128 else CONFIG["BLOCK_N"])
    _extend_kernel[(programs, num_kv_heads, num_splits)](
        q, k_buffer, v_buffer, req_to_token, req_rows, prefix_lens, qo_indptr, out_slots, tree, target, lse, out,
        split_counts if split_out else qo_indptr, block_reqs, block_rows,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), req_to_token.stride(0),
        tree.stride(0) if tree_mask is not None else 0, tree.stride(1) if tree_mask is not None else 0,
        target.stride(0), target.stride(1), target.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        row_blocks, scale * LOG2_E,
        HEAD_DIM=head_dim, GROUP=group, TREE_MASK=tree_mask is not None, BLOCK_M=config["BLOCK_M"],
        BLOCK_N=config["BLOCK_N"], BLOCK_D=block_d,
        STORE_LSE=split_out, DOT_PRECISION=dot_precision(q.dtype),
        BLOCK_TABLE=block_table is not None, USE_PDL=pdl, num_warps=config["num_warps"],
        num_stages=config["num_stages"], **({"launch_pdl": True} if pdl else {}))
    if split_out:
        merge_splits(partial_out, partial_lse, out, split_counts)


def ragged_block_table(qo_indptr: torch.Tensor, group: int, num_programs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, row block) of each of `num_programs` programs for requests whose new tokens
    are qo_indptr's ranges: request b gets cdiv(tokens_b * group, BLOCK_M) blocks, request
    after request; programs past the last block get a block past their request's rows
    (they read and write nothing). Device ops only, no host sync: a CUDA graph computes it
    for whatever lengths each replay brings. Blocks needed: at most
    `ragged_blocks_bound(tokens, bs, group)`."""
    lens = (qo_indptr[1:] - qo_indptr[:-1]).long()
    blocks = (lens * group + CONFIG["BLOCK_M"] - 1) // CONFIG["BLOCK_M"]
    ends = torch.cumsum(blocks, 0)
    program = torch.arange(num_programs, device=qo_indptr.device)
    reqs = torch.searchsorted(ends, program, right=True).clamp_(max=lens.shape[0] - 1)
    starts = ends - blocks
    return reqs.to(torch.int32), (program - starts[reqs]).to(torch.int32)


def ragged_blocks_bound(num_tokens: int, bs: int, group: int) -> int:
    """The most row blocks `num_tokens` new tokens split over bs requests can need."""
    return triton.cdiv(num_tokens * group, CONFIG["BLOCK_M"]) + bs
