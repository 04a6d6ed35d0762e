"""The reference attention backend: gather K/V by slot into a padded batch, masked SDPA.

It runs on CPU and GPU and is what the Triton kernels are checked against. Requests go
through one SDPA call per layer and group: queries are padded to the group's longest
extend, keys to its longest prefix + extend, and the mask keeps padding out. Requests are
grouped by kind (single tokens, longer extends) and by key length within a factor of two:
padded together, every short request would gather as many keys as the longest one, and a
decode step beside one 4k-token context (or a prompt chunk deep into one) would cost a
CPU seconds instead of tens of milliseconds. A ragged VERIFY batch's tokens past its
requests' (padding of no request) get a zero output. A group of one request's prompt or
chunk needs no mask tensor: it is causal aligned to the lower right, which flash attention
runs on a GPU (there, by default, every prefill step of one prompt or chunk: registry.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_flash_attention

from specserve.attention import prefix_split
from specserve.attention.base import AttentionBackend, ForwardBatch, ForwardMode

MIN_BUCKET_KEYS = 256   # requests with fewer keys share one group: padding them is cheap


@dataclass
class PaddedLayout:
    kv_slots: torch.Tensor            # (bs, max_kv) int64, slot of every key; padding -> slot 0
    query_rows: torch.Tensor | None   # (num_tokens,) flat index into (bs * max_q); None: no query padding
    mask: torch.Tensor | None         # (bs, 1, max_q, max_kv) bool, True = may attend; None: see causal
    max_q: int
    # with mask None: the queries are the last max_q of max_kv positions, causal among themselves
    # (one request's prompt or chunk: last_queries_causal, flash attention on a GPU, and on a
    # CPU its flash kernel where there is no prefix); False: attend to all
    causal: bool = False


@dataclass
class LayoutGroup:
    tokens: torch.Tensor | None       # (group_tokens,) rows of the forward's tokens; None: all of them
    layout: PaddedLayout


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"

    def plan(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = plan_groups(batch)

    def forward(self, q, k, v, layer, batch: ForwardBatch) -> torch.Tensor:
        pool = batch.kv_pool
        if k is not None:  # None: the model's fused RoPE kernel has stored k and v already
            pool.store(layer, batch.out_slots, k, v)
        groups: list[LayoutGroup] = batch.attn_metadata
        if len(groups) == 1 and groups[0].tokens is None:   # one group of every token
            return self._attend(q, layer, pool, groups[0].layout)
        out = torch.zeros_like(q)   # tokens of no group (ragged padding) stay zero
        for group in groups:
            out[group.tokens] = self._attend(q[group.tokens], layer, pool, group.layout)
        return out

    def _attend(self, q: torch.Tensor, layer: int, pool, layout: PaddedLayout) -> torch.Tensor:
        """q: (num_tokens, num_heads, head_dim) of the requests `layout` covers."""
        bs, max_q = layout.kv_slots.shape[0], layout.max_q
        # (bs, num_kv_heads, max_kv, head_dim)
        keys = gather_slots(pool.k_buffers[layer], layout.kv_slots).transpose(1, 2).to(q.dtype)
        values = gather_slots(pool.v_buffers[layer], layout.kv_slots).transpose(1, 2).to(q.dtype)
        if layout.query_rows is None:
            padded_q = q
        else:
            padded_q = q.new_zeros((bs * max_q, self.num_heads, self.head_dim))
            padded_q[layout.query_rows] = q
        padded_q = padded_q.view(bs, max_q, self.num_heads, self.head_dim).transpose(1, 2)
        gqa = self.num_heads != self.num_kv_heads
        if layout.causal:
            out = last_queries_causal(padded_q, keys, values, self.scale, gqa)
        else:
            out = F.scaled_dot_product_attention(padded_q, keys, values, attn_mask=layout.mask, scale=self.scale,
                                                 enable_gqa=gqa)
        # (bs, num_heads, max_q, head_dim) -> (num_tokens, num_heads, head_dim)
        out = out.transpose(1, 2).reshape(bs * max_q, self.num_heads, self.head_dim)
        return out if layout.query_rows is None else out[layout.query_rows]


def last_queries_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: bool) -> torch.Tensor:
    """Attention of queries that are the last of the keys' positions, causal among themselves
    (the causal mask aligned to the lower right): q (1, heads, q_len, dim), k and v (1, kv
    heads, k_len, dim). Without a prefix (q_len == k_len) SDPA's is_causal; with one, on a GPU,
    flash attention, whose causal mask is aligned so when keys outnumber queries (what torch's
    CausalBias runs; that tensor subclass itself fails under a TorchDispatchMode such as a
    FLOP counter), else a mask tensor."""
    if prefix_split.KERNEL is not None:
        return prefix_split.attend_in_two(q, k, v, scale, prefix_split.KERNEL)
    q_len, k_len = q.shape[2], k.shape[2]
    if q_len == k_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if q.is_cuda and can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, gqa)):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]
    mask = torch.ones((q_len, k_len), dtype=torch.bool, device=q.device).tril(k_len - q_len)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def gather_slots(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buffer (size, num_kv_heads, head_dim) at slots (bs, max_kv) -> (bs, max_kv, num_kv_heads, head_dim).

    One row copy per key: index_select over the buffer's rows. Advanced indexing
    (buffer[slots]) copies element by element, 4-5x slower on a CPU (4,000 keys of a 135M
    model: 0.34 against 0.08 ms per layer and buffer on one idle core, several times more
    with other processes on the cores); every prompt chunk deep into a long context and
    every decode step of long streams pays it whatever the chunk's size.
    """
    rows = buffer.view(buffer.shape[0], -1).index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *buffer.shape[1:])


def plan_groups(batch: ForwardBatch) -> list[LayoutGroup]:
    """A padded layout per group of requests of the same kind and key-length bucket; the
    tokens past the requests' (a ragged batch's padding) are in no group; where
    prompts_alone, each prompt or chunk of more than one token is a group of its own."""
    lens, prefixes = batch.extend_lens_host, batch.prefix_lens_host
    own_groups = prompts_alone(batch)
    groups: dict[tuple[bool, int], list[int]] = {}
    for i, (prefix, length) in enumerate(zip(prefixes, lens)):
        # keys padded to at most twice a request's own
        bucket = max(prefix + length - 1, MIN_BUCKET_KEYS).bit_length()
        groups.setdefault((False, -1 - i) if own_groups and length > 1 else (length == 1, bucket), []).append(i)
    if len(groups) == 1 and sum(lens) == batch.num_tokens:
        return [LayoutGroup(None, build_padded_layout(batch))]
    starts = [0]
    for length in lens[:-1]:
        starts.append(starts[-1] + length)
    return [_group(batch, reqs, starts) for reqs in groups.values()]



def prompts_alone(batch: ForwardBatch) -> bool:
    """An EXTEND batch on a GPU: a prompt alone is attended causally with no mask tensor, by
    flash attention; padded beside another, its mask would send SDPA to a kernel that takes
    one (not flash), at worst the math backend, whose (requests, heads, queries, keys) scores
    do not fit at 32k-token contexts. A CPU pads them together: fewer calls."""
    return batch.input_ids.is_cuda and batch.mode is ForwardMode.EXTEND


def _group(batch: ForwardBatch, reqs: list[int], starts: list[int]) -> LayoutGroup:
    device = batch.input_ids.device
    lens = batch.extend_lens_host
    tokens = torch.tensor([t for i in reqs for t in range(starts[i], starts[i] + lens[i])], device=device)
    index = torch.tensor(reqs, device=device)
    part = dataclasses.replace(
        batch, input_ids=batch.input_ids[tokens], positions=batch.positions[tokens], out_slots=batch.out_slots[tokens],
        req_rows=batch.req_rows[index], prefix_lens=batch.prefix_lens[index], extend_lens=batch.extend_lens[index],
        prefix_lens_host=[batch.prefix_lens_host[i] for i in reqs], extend_lens_host=[lens[i] for i in reqs],
        tree_mask=None if batch.tree_mask is None else batch.tree_mask[index], attn_metadata=None)
    return LayoutGroup(tokens, build_padded_layout(part))


def build_padded_layout(batch: ForwardBatch) -> PaddedLayout:
    device = batch.input_ids.device
    prefix, extend = batch.prefix_lens, batch.extend_lens
    bs = batch.batch_size
    max_q = max(batch.extend_lens_host)
    max_kv = max(p + e for p, e in zip(batch.prefix_lens_host, batch.extend_lens_host))
    extend_starts = torch.cumsum(extend, 0) - extend                     # (bs,) first token of each request
    key_pos = torch.arange(max_kv, device=device).unsqueeze(0)           # (1, max_kv)
    prefix_part = key_pos < prefix.unsqueeze(1)                           # (bs, max_kv)
    new_index = key_pos - prefix.unsqueeze(1)                             # index among the new tokens
    new_part = (new_index >= 0) & (new_index < extend.unsqueeze(1))
    table = batch.kv_pool.req_to_token[batch.req_rows, :max_kv].long() if max_kv <= batch.kv_pool.max_context \
        else batch.kv_pool.req_to_token[batch.req_rows].long()
    prefix_slots = torch.gather(table, 1, key_pos.clamp(max=table.shape[1] - 1).expand(bs, -1))
    new_token = (extend_starts.unsqueeze(1) + new_index).clamp(0, max(batch.num_tokens - 1, 0))
    new_slots = batch.out_slots[new_token]
    kv_slots = torch.where(prefix_part, prefix_slots, torch.where(new_part, new_slots, torch.zeros_like(new_slots)))

    query_pos = torch.arange(max_q, device=device)
    token_req = torch.repeat_interleave(torch.arange(bs, device=device), extend, output_size=batch.num_tokens)
    token_offset = torch.arange(batch.num_tokens, device=device) - extend_starts[token_req]
    query_rows = token_req * max_q + token_offset
    # decode steps of equal-length requests need neither query padding nor a mask
    uniform_queries = all(e == max_q for e in batch.extend_lens_host)
    unmasked = max_q == 1 and all(p + 1 == max_kv for p in batch.prefix_lens_host)
    causal = not unmasked and bs == 1 and batch.mode is ForwardMode.EXTEND
    mask = None if unmasked or causal else _mask(batch, query_pos, prefix_part, new_part, new_index, extend)
    return PaddedLayout(kv_slots=kv_slots, query_rows=None if uniform_queries else query_rows,
                        mask=mask, max_q=max_q, causal=causal)


def _mask(batch: ForwardBatch, query_pos, prefix_part, new_part, new_index, extend) -> torch.Tensor:
    """(bs, 1, max_q, max_kv) bool: a query may attend the prefix, and among the new tokens
    causally or as the draft tree's ancestor mask says. Not built for a prompt alone
    (last_queries_causal masks it its own way): 8k queries over 40k keys would make 0.3 GB
    of it, and more while it is made."""
    bs, max_q, max_kv = new_index.shape[0], query_pos.shape[0], new_index.shape[1]
    qi = query_pos.view(1, max_q, 1)
    kj = new_index.unsqueeze(1)                                           # (bs, 1, max_kv)
    if batch.mode is ForwardMode.VERIFY and batch.tree_mask is not None:
        n = batch.tree_mask.shape[-1]
        tree = batch.tree_mask[:, :max_q, :]                               # (bs, max_q, n)
        among_new = torch.gather(tree, 2, kj.clamp(0, n - 1).expand(bs, max_q, max_kv))
    else:
        among_new = kj <= qi
    mask = prefix_part.unsqueeze(1) | (new_part.unsqueeze(1) & among_new)
    # padded query rows must see one key or softmax gives NaN; their output is dropped
    padded_query = query_pos.view(1, max_q) >= extend.view(bs, 1)
    mask[:, :, 0] |= padded_query
    return mask.unsqueeze(1)
