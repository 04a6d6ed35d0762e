"""The Triton attention backend: split-K decode, and one extend kernel for EXTEND (causal)
and VERIFY (tree mask), over the token-granular KV pool. A VERIFY batch of few tree nodes
goes through the decode kernel instead, one query row per node (its TREE mode): at small
batches that is 2-3x faster than the extend kernel and its merge. A larger one whose trees
fit a program's query rows goes through tree_groups.py, a program per request and kv head
that reads the request's keys once for all its nodes.

Ragged VERIFY (`ForwardBatch.ragged`): request b has its own node count extend_lens[b]
(1..n, n = tree_mask.shape[-1]), the nodes request after request, and the tokens past
their sum are padding of no request, whose output is zero (the next layer writes their K/V
to slot 0, which other rows load masked: it must stay finite). Decode rows find their
request through a per-row owner array (`row_owners`, -1 for padding); the extend kernel
gets a bs x row_blocks(n) grid (a request's blocks past its nodes read nothing) and the
output of the padding tokens, which no program writes, is zeroed first. A uniform VERIFY
batch (n nodes every request) is the ragged one without padding.

Metadata (`TritonMetadata`, built once per forward, shared by every layer): per request
its `req_to_token` row, prefix length and first new token (`qo_indptr`); the kernels
read prefix slots straight from `req_to_token` and new slots from `batch.out_slots`, so
no kv_indices array is built. The split count (how many programs share one request's
keys) is chosen from the grid size and the longest context, and the per-split scratch
buffers are allocated once per forward; the extend kernel lets a causal request use fewer
(extend.py's KEYS_PER_NEW_TOKEN).

CUDA graphs: `init_cuda_graph_state` allocates static copies of that metadata for the
largest graph, and `plan_for_capture` / `plan_for_replay` fill them in place. In graph
mode the grid depends only on the batch size (row blocks from `max_tokens_per_req`, for
VERIFY from the tree size n; splits from `kv_pool.max_context`), and for a ragged VERIFY
batch on (bs, num_tokens, n); kernels skip splits and row blocks a batch leaves empty, and
everything a ragged graph needs per replay (request offsets, row owners) is computed on
the device from its extend_lens.

Padding convention for a graph batch of bs rows where only the first ones are real: a
padded request has prefix_len 0, extend_len = the graph's tokens per request
(1 for DECODE), all its out_slots = PADDING_SLOT (0), any valid req row (0), and for
VERIFY a tree_mask whose diagonal is True (e.g. the identity). It then attends only to
slot 0, reads no `req_to_token` entry, and its (finite, meaningless) output is dropped.
A ragged graph batch pads with tokens instead (see above); its requests are all real, or
padded as above with one node (extend_len 1).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

from specserve.attention.base import AttentionBackend, ForwardBatch, ForwardMode
from specserve.attention.kernels.decode import decode_attention, row_owners
from specserve.attention.kernels.extend import (extend_attention, num_row_blocks, ragged_block_table,
                                                ragged_blocks_bound)
from specserve.attention.kernels.online_softmax import MAX_SPLITS
from specserve.attention.kernels.tree_groups import MAX_GROUP_ROWS, group_rows, tree_group_attention
from specserve.kv.pool import KVPool


@dataclass
class TritonMetadata:
    mode: ForwardMode
    req_rows: torch.Tensor              # (bs,) int32, rows of req_to_token
    prefix_lens: torch.Tensor           # (bs,) int32
    qo_indptr: torch.Tensor             # (bs + 1,) int32, request b's new tokens are [qo_indptr[b], qo_indptr[b+1])
    tree_mask: torch.Tensor | None      # (bs, n, n) uint8, VERIFY only
    row_blocks: int                     # extend grid: query blocks per request
    partial_out: torch.Tensor | None    # (num_tokens, num_heads, splits, head_dim) fp32; None = one split
    partial_lse: torch.Tensor | None    # (num_tokens, num_heads, splits) fp32
    split_counters: torch.Tensor | None  # (>= bs * num_kv_heads,) int32 zeros: DECODE's in-kernel merge
    split_counts: torch.Tensor | None = None  # (>= num_tokens,) int32 scratch: EXTEND/VERIFY splits used per token
    block_table: tuple[torch.Tensor, torch.Tensor] | None = None  # ragged EXTEND: (request, row block) per program
    tree_rows: bool = False  # VERIFY through the decode kernel, a row per tree node (split_counters per node)
    row_owner: torch.Tensor | None = None  # tree_rows: (num_tokens,) int32, each row's request, -1 for padding
    zero_out: bool = False   # ragged VERIFY past its requests' tokens: padding tokens' output is zeroed
    tree_groups: bool = False  # VERIFY through tree_groups.py, a program per request (split_counters per request)


@dataclass
class _GraphBuffers:
    """Static metadata read by captured graphs, sized for the largest one."""
    max_bs: int
    max_tokens_per_req: int
    max_context: int
    req_rows: torch.Tensor      # (max_bs,) int32
    prefix_lens: torch.Tensor   # (max_bs,) int32
    qo_indptr: torch.Tensor     # (max_bs + 1,) int32
    tree_mask: torch.Tensor     # (max_bs, max_tokens_per_req, max_tokens_per_req) uint8
    partial_out: torch.Tensor   # flat fp32, viewed per batch size
    partial_lse: torch.Tensor   # flat fp32
    split_counters: torch.Tensor  # (max_bs * num_kv_heads,) int32, zero between launches
    split_counts: torch.Tensor    # (max_bs * max_tokens_per_req,) int32
    row_owner: torch.Tensor       # (VERIFY rows the decode kernel may take,) int32


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True
    # a split reads at least this many keys: fewer would cost more in merging than it gains
    min_keys_per_split = 128
    # grid size to aim for when splitting; None = 4 programs per SM on CUDA, 8 elsewhere
    target_programs: int | None = None
    # DECODE is merged by its last split, 8 splits at a time: past ~32 splits the merge costs
    # more than the splitting gains (H200, batch 1, 8000 keys: 16 us with 32 splits, 20 with 63)
    max_decode_splits = 32
    # VERIFY batches of up to this many tokens (tree nodes, ragged padding included) run as decode rows; measured
    # on an H200 at batch 1 (9-17 nodes: 2-3x faster than extend + merge) and batch 8 (step_cost)
    max_tree_rows = 64
    # larger VERIFY batches whose trees fit one program's query rows (nodes x group, padded) run through
    # tree_groups.py, which reads a request's keys once for all its nodes (0: the extend kernel instead;
    # SPECSERVE_TREE_GROUPS=0 turns it off). H100, 1.5B, batch 64 (lab.step_cost): a 4-node verify step
    # 3.75 -> 3.34 ms of GPU time, the fused EAGLE-3 step 4.22 -> 3.80 ms
    max_group_rows = MAX_GROUP_ROWS if os.environ.get("SPECSERVE_TREE_GROUPS", "1") == "1" else 0

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__(num_heads, num_kv_heads, head_dim)
        assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        self.group = num_heads // num_kv_heads
        self._graph: _GraphBuffers | None = None

    # --- eager ---
    def plan(self, batch: ForwardBatch) -> None:
        device, bs, num_tokens = batch.input_ids.device, batch.batch_size, batch.num_tokens
        _check_ragged(batch)
        qo_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
        qo_indptr[1:] = torch.cumsum(batch.extend_lens, 0)
        tree_mask = None
        if batch.mode is ForwardMode.VERIFY and batch.tree_mask is not None:
            tree_mask = batch.tree_mask.to(torch.uint8).contiguous()
        max_kv = max((p + e for p, e in zip(batch.prefix_lens_host, batch.extend_lens_host)), default=0)
        tree_rows = self._tree_rows(batch)
        tree_groups = self._tree_groups(batch, tree_rows)
        row_blocks, splits = self._grid(batch.mode, bs, max(batch.extend_lens_host, default=0), max_kv, device,
                                        tree_rows=num_tokens if tree_rows else 0, tree_groups=tree_groups)
        padded = batch.ragged and sum(batch.extend_lens_host) < num_tokens
        partial_out = partial_lse = split_counters = split_counts = None
        if splits > 1:
            if batch.mode is ForwardMode.DECODE or tree_rows or tree_groups:
                split_counters = torch.zeros(num_tokens * self.num_kv_heads, dtype=torch.int32, device=device)
            else:  # padding tokens keep a count of 1: the merge leaves them alone
                split_counts = (torch.ones if padded else torch.empty)(num_tokens, dtype=torch.int32, device=device)
            partial_out = torch.empty((num_tokens, self.num_heads, splits, self.head_dim),
                                      dtype=torch.float32, device=device)
            partial_lse = torch.empty((num_tokens, self.num_heads, splits), dtype=torch.float32, device=device)
        batch.attn_metadata = TritonMetadata(
            mode=batch.mode, req_rows=batch.req_rows.to(torch.int32), prefix_lens=batch.prefix_lens.to(torch.int32),
            qo_indptr=qo_indptr, tree_mask=tree_mask, row_blocks=row_blocks,
            partial_out=partial_out, partial_lse=partial_lse,
            split_counters=split_counters, split_counts=split_counts, tree_rows=tree_rows,
            row_owner=row_owners(qo_indptr, num_tokens) if tree_rows else None,
            zero_out=padded and not tree_rows, tree_groups=tree_groups)

    def _tree_rows(self, batch: ForwardBatch) -> bool:
        """Whether this VERIFY batch goes through the decode kernel's TREE mode: a tree mask,
        few rows in all, and ragged or the same n nodes for every request."""
        if batch.mode is not ForwardMode.VERIFY or batch.tree_mask is None:
            return False
        return _ragged_or_uniform(batch) and batch.num_tokens <= self.max_tree_rows

    def _tree_groups(self, batch: ForwardBatch, tree_rows: bool) -> bool:
        """Whether this VERIFY batch, too large for decode rows, goes through tree_groups.py: a
        request's nodes times the q heads of a kv head fit one program's query rows."""
        if tree_rows or batch.mode is not ForwardMode.VERIFY or batch.tree_mask is None:
            return False
        rows = group_rows(batch.tree_mask.shape[-1], self.group)
        return _ragged_or_uniform(batch) and rows <= self.max_group_rows

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                batch: ForwardBatch) -> torch.Tensor:
        pool = batch.kv_pool
        if k is not None:  # None: the model's fused RoPE kernel has stored k and v already
            pool.store(layer, batch.out_slots, k, v)
        meta: TritonMetadata = batch.attn_metadata
        if q.stride(-1) != 1:
            q = q.contiguous()
        # (num_tokens, num_heads, head_dim); tokens of no request are written by no program
        out = (torch.zeros if meta.zero_out else torch.empty)(q.shape, dtype=q.dtype, device=q.device)
        buffers = (pool.k_buffers[layer], pool.v_buffers[layer], pool.req_to_token, meta.req_rows, meta.prefix_lens)
        if meta.tree_groups:
            tree_group_attention(q, *buffers, batch.out_slots, meta.qo_indptr, meta.tree_mask, out, self.scale,
                                 partial_out=meta.partial_out, partial_lse=meta.partial_lse,
                                 split_counters=meta.split_counters)
        elif meta.mode is ForwardMode.DECODE or meta.tree_rows:
            decode_attention(q, *buffers, batch.out_slots, out, self.scale, partial_out=meta.partial_out,
                             partial_lse=meta.partial_lse, split_counters=meta.split_counters,
                             tree_mask=meta.tree_mask if meta.tree_rows else None, row_owner=meta.row_owner,
                             qo_indptr=meta.qo_indptr)
        else:
            extend_attention(q, *buffers, meta.qo_indptr, batch.out_slots, out, self.scale, meta.row_blocks,
                             tree_mask=meta.tree_mask, partial_out=meta.partial_out, partial_lse=meta.partial_lse,
                             split_counts=meta.split_counts, block_table=meta.block_table)
        return out

    # --- prefill CUDA graphs ---
    supports_prefill_graph = True

    def plan_ragged_extend(self, batch: ForwardBatch) -> None:
        """The grid is fixed by the token and request counts (padding included) and the
        pool's longest context; the programs each request gets come from a block table
        computed on the device, so one captured graph serves every prompt mix that fits.
        Tokens of no request (padding) keep a split count of 1: the merge leaves them alone."""
        device, bs, num_tokens = batch.input_ids.device, batch.batch_size, batch.num_tokens
        qo_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
        qo_indptr[1:] = torch.cumsum(batch.extend_lens, 0)
        programs = ragged_blocks_bound(num_tokens, bs, self.group)
        splits = self._splits(programs, batch.kv_pool.max_context, MAX_SPLITS, device)
        partial_out = partial_lse = split_counts = None
        if splits > 1:
            split_counts = torch.ones(num_tokens, dtype=torch.int32, device=device)
            partial_out = torch.empty((num_tokens, self.num_heads, splits, self.head_dim), dtype=torch.float32,
                                      device=device)
            partial_lse = torch.empty((num_tokens, self.num_heads, splits), dtype=torch.float32, device=device)
        batch.attn_metadata = TritonMetadata(
            mode=ForwardMode.EXTEND, req_rows=batch.req_rows.to(torch.int32),
            prefix_lens=batch.prefix_lens.to(torch.int32), qo_indptr=qo_indptr, tree_mask=None, row_blocks=0,
            partial_out=partial_out, partial_lse=partial_lse, split_counters=None, split_counts=split_counts,
            block_table=ragged_block_table(qo_indptr, self.group, programs))

    # --- CUDA graphs ---
    def init_cuda_graph_state(self, max_bs: int, max_tokens_per_req: int, kv_pool: KVPool) -> None:
        """Static buffers for graphs of up to max_bs requests with up to max_tokens_per_req
        new tokens each (1 for DECODE, n for VERIFY) and up to kv_pool.max_context keys;
        ragged VERIFY graphs of up to max_bs * max_tokens_per_req tokens (padding included)."""
        device, n = kv_pool.device, max_tokens_per_req
        partial_rows = 0  # largest (partial tokens) * num_heads * splits over the graphs this state serves
        for bs in range(1, max_bs + 1):
            _, splits = self._grid(ForwardMode.DECODE, bs, 1, kv_pool.max_context, device)
            partial_rows = max(partial_rows, bs * self.num_heads * splits if splits > 1 else 0)
            for tree_n in range(1, n + 1):  # EXTEND, and VERIFY through the extend kernel: bs * tree_n partial tokens
                _, splits = self._grid(ForwardMode.VERIFY, bs, tree_n, kv_pool.max_context, device)
                partial_rows = max(partial_rows, bs * tree_n * self.num_heads * splits if splits > 1 else 0)
            # VERIFY through tree_groups.py: bs * n partial tokens, split as bs requests
            _, splits = self._grid(ForwardMode.VERIFY, bs, n, kv_pool.max_context, device, tree_groups=True)
            partial_rows = max(partial_rows, bs * n * self.num_heads * splits if splits > 1 else 0)
        tree_rows = min(max_bs * n, self.max_tree_rows) if n > 1 else 0
        for rows in range(1, tree_rows + 1):  # VERIFY graphs of any tree size up to n run as decode rows
            _, splits = self._grid(ForwardMode.VERIFY, 1, rows, kv_pool.max_context, device, tree_rows=rows)
            if splits > 1:
                partial_rows = max(partial_rows, rows * self.num_heads * splits)
        int32 = dict(dtype=torch.int32, device=device)
        self._graph = _GraphBuffers(
            max_bs=max_bs, max_tokens_per_req=n, max_context=kv_pool.max_context,
            req_rows=torch.zeros(max_bs, **int32), prefix_lens=torch.zeros(max_bs, **int32),
            qo_indptr=torch.zeros(max_bs + 1, **int32),
            tree_mask=torch.zeros((max_bs, n, n), dtype=torch.uint8, device=device),
            partial_out=torch.zeros(partial_rows * self.head_dim, dtype=torch.float32, device=device),
            partial_lse=torch.zeros(partial_rows, dtype=torch.float32, device=device),
            split_counters=torch.zeros(max(max_bs, tree_rows) * self.num_kv_heads, **int32),
            split_counts=torch.zeros(max_bs * n, **int32), row_owner=torch.zeros(tree_rows, **int32))

    def plan_for_capture(self, batch: ForwardBatch) -> None:
        self._plan_static(batch)

    def plan_for_replay(self, batch: ForwardBatch) -> None:
        self._plan_static(batch)

    def _plan_static(self, batch: ForwardBatch) -> None:
        """Fill the static buffers in place; the views handed out depend only on the batch
        size, the mode and for VERIFY the token count and tree size, so they are the same at
        capture and at every replay. Reads no host list but extend_lens_host's length."""
        g = self._graph
        assert g is not None, "init_cuda_graph_state must run before graph planning"
        _check_ragged(batch)
        bs, num_tokens = batch.batch_size, batch.num_tokens
        assert bs <= g.max_bs and num_tokens <= (g.max_bs if batch.ragged else bs) * g.max_tokens_per_req, \
            "batch larger than the graph state"
        g.req_rows[:bs].copy_(batch.req_rows)
        g.prefix_lens[:bs].copy_(batch.prefix_lens)
        qo_indptr = g.qo_indptr[:bs + 1]
        if batch.mode is not ForwardMode.DECODE:  # the decode kernel reads no qo_indptr (a scan less per step)
            qo_indptr[1:].copy_(torch.cumsum(batch.extend_lens, 0))
        tree_mask, tokens_per_req = None, g.max_tokens_per_req
        if batch.mode is ForwardMode.VERIFY and batch.tree_mask is not None:
            tokens_per_req = n = batch.tree_mask.shape[-1]
            assert n <= g.max_tokens_per_req, "tree larger than the graph state"
            tree_mask = g.tree_mask[:bs, :n, :n]
            tree_mask.copy_(batch.tree_mask)
        tree_rows = self._tree_rows(batch)
        tree_groups = self._tree_groups(batch, tree_rows)
        row_blocks, splits = self._grid(batch.mode, bs, tokens_per_req, g.max_context, g.req_rows.device,
                                        tree_rows=num_tokens if tree_rows else 0, tree_groups=tree_groups)
        row_owner = None
        if tree_rows:
            row_owner = row_owners(qo_indptr, num_tokens, out=g.row_owner[:num_tokens])
        partial_out = partial_lse = None
        if splits > 1:
            # the extend kernel keeps partials of request tokens only: a ragged batch's are its first bs * n at most
            tokens = num_tokens if tree_rows else min(num_tokens, bs * tokens_per_req)
            rows = tokens * self.num_heads * splits
            partial_out = g.partial_out[:rows * self.head_dim].view(tokens, self.num_heads, splits, self.head_dim)
            partial_lse = g.partial_lse[:rows].view(tokens, self.num_heads, splits)
            if batch.ragged and not (tree_rows or tree_groups):  # padding tokens the merge visits: a count of 1
                g.split_counts[:tokens].fill_(1)
        batch.attn_metadata = TritonMetadata(
            mode=batch.mode, req_rows=g.req_rows[:bs], prefix_lens=g.prefix_lens[:bs],
            qo_indptr=qo_indptr, tree_mask=tree_mask, row_blocks=row_blocks,
            partial_out=partial_out, partial_lse=partial_lse, split_counters=g.split_counters,
            split_counts=g.split_counts, tree_rows=tree_rows, row_owner=row_owner,
            zero_out=batch.ragged and not tree_rows, tree_groups=tree_groups)

    # --- grid ---
    def _grid(self, mode: ForwardMode, bs: int, tokens_per_req: int, max_kv_len: int,
              device: torch.device, tree_rows: int = 0, tree_groups: bool = False) -> tuple[int, int]:
        """(row blocks per request, kv splits): split a request's keys only as far as
        needed to give the GPU about `target_programs` programs. `tree_rows`: a VERIFY batch
        through the decode kernel, its row count (one row and one merge counter per token);
        `tree_groups`: through tree_groups.py (a program and a merge counter per request)."""
        if tree_groups:
            return 1, self._tree_group_splits(bs, max_kv_len, device)
        if tree_rows:
            return 1, self._splits(tree_rows, max_kv_len, self.max_decode_splits, device)
        row_blocks = 1 if mode is ForwardMode.DECODE else num_row_blocks(tokens_per_req, self.group)
        most = self.max_decode_splits if mode is ForwardMode.DECODE else MAX_SPLITS
        return row_blocks, self._splits(bs * row_blocks, max_kv_len, most, device)

    def _tree_group_splits(self, bs: int, max_kv_len: int, device: torch.device) -> int:
        """Key splits of a VERIFY batch through tree_groups.py. Its program holds every node of a
        request for all query heads of a kv head (nodes x group rows), several decode programs'
        work, so fewer pay: about two programs per SM, rounded down, where decode's rule rounds
        four per SM up. Timed in CUDA graphs (H100, 1.5B heads, 4 nodes, 384 and 2048 keys,
        lab/tree_group_sweep.py): 16 splits at 8 requests, 4 at 32 and 2 at 64 were the fastest
        or within 1 us a layer of it. Decode's rule gives 32, 9 and 5: at 64 requests 5 splits took
        23.8 us against 2's 20.4 on 384 keys and 70.2 against 65.4 on 2048; at 32, 8 splits took
        47.1 against 4's 39.9 on 2048 keys (9 was not timed)."""
        target = (self.target_programs or _default_target_programs(device)) // 2
        return self._capped_splits(target // max(bs * self.num_kv_heads, 1), max_kv_len, self.max_decode_splits)

    def _splits(self, row_programs: int, max_kv_len: int, most: int, device: torch.device) -> int:
        """Key splits for `row_programs` query blocks per kv head: no more than fill the GPU."""
        target = self.target_programs or _default_target_programs(device)
        return self._capped_splits(triton.cdiv(target, max(row_programs * self.num_kv_heads, 1)), max_kv_len, most)

    def _capped_splits(self, splits: int, max_kv_len: int, most: int) -> int:
        """`splits`, at most `most`, none of fewer than min_keys_per_split keys, and at least one."""
        return max(min(splits, triton.cdiv(max_kv_len, self.min_keys_per_split), most), 1)


def _ragged_or_uniform(batch: ForwardBatch) -> bool:
    """A VERIFY batch whose rows the decode rows or tree groups can place: ragged, or n nodes
    for every request (an eager batch of trees of different sizes, not marked ragged, keeps
    the extend kernel)."""
    return batch.ragged or batch.num_tokens == batch.batch_size * batch.tree_mask.shape[-1]


def _check_ragged(batch: ForwardBatch) -> None:
    assert not batch.ragged or (batch.mode is ForwardMode.VERIFY and batch.tree_mask is not None), \
        "ragged batches are VERIFY batches with a tree mask"


@functools.lru_cache(maxsize=None)
def _default_target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8
