"""The attention-backend interface and the per-forward batch it reads.

Every mode is the same computation: each request's new tokens attend to the request's
prefix (the tokens already in the KV cache, found through `req_to_token`) and to the new
tokens allowed by a mask among themselves:

  EXTEND (prefill, also a chunk of one): causal among the new tokens
  DECODE: one new token per request
  VERIFY: the n nodes of a draft tree; node i sees node j iff j is i or an ancestor of i

A backend stores the new K/V into their slots and attends. `plan` runs once per forward
and leaves its metadata on the batch; the CUDA-graph hooks let a backend keep that
metadata in static buffers that a captured graph reads.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from specserve.kv.pool import KVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"
    VERIFY = "verify"


@dataclass
class ForwardBatch:
    """The tensors of one model forward; the ModelRunner fills it from the scheduler's Batch."""

    mode: ForwardMode
    input_ids: torch.Tensor          # (num_tokens,) int64
    positions: torch.Tensor          # (num_tokens,) int64, rope positions
    out_slots: torch.Tensor          # (num_tokens,) int64, KV slot each new token is written to
    req_rows: torch.Tensor           # (bs,) int64, rows of kv_pool.req_to_token
    prefix_lens: torch.Tensor        # (bs,) int64, tokens of each request already in the cache
    extend_lens: torch.Tensor        # (bs,) int64, new tokens of each request in this forward
    prefix_lens_host: list[int]      # host copies: planning must not sync the device
    extend_lens_host: list[int]
    kv_pool: "KVPool"
    logits_indices: torch.Tensor     # (num_logits,) rows of the hidden states that get logits
    tree_mask: torch.Tensor | None = None   # VERIFY: (bs, n, n) bool, [b, i, j] = node i sees node j
    attn_metadata: Any = field(default=None)  # filled by AttentionBackend.plan
    planned_by: Any = None   # the backend of a HybridBackend that planned this forward (hybrid.py)
    # hidden states the model keeps besides the logits (EAGLE): a model.hidden_capture.HiddenCapture,
    # untyped here: the model's floor is above this one
    hidden_capture: Any = None
    # VERIFY only: request b has extend_lens[b] nodes (1..n, n = tree_mask.shape[-1]), request
    # after request, and the tokens past their sum are padding of no request (out_slots
    # PADDING_SLOT; their attention output is zero). A graph's extend_lens vary per replay:
    # graph planning reads the device tensors and only the length of extend_lens_host (the
    # batch size), eager planning the host lists too.
    ragged: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


class AttentionBackend:
    """Stores new K/V and attends; see the module docstring for the modes."""
    name = "?"   # as --attention-backend names it

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def plan(self, batch: ForwardBatch) -> None:
        """Build the metadata every layer reuses; store it in `batch.attn_metadata`."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                batch: ForwardBatch) -> torch.Tensor:
        """q: (num_tokens, num_heads, head_dim), its last dim contiguous (rows may be strided: a view
        of the qkv projection); k, v: (num_tokens, num_kv_heads, head_dim), or None when the caller
        already wrote them to their slots. Returns (num_tokens, num_heads, head_dim)."""
        raise NotImplementedError

    # --- CUDA-graph hooks (a backend without graph support keeps these defaults) ---
    supports_cuda_graph = False

    def init_cuda_graph_state(self, max_bs: int, max_tokens_per_req: int, kv_pool: "KVPool") -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def plan_for_capture(self, batch: ForwardBatch) -> None:
        raise NotImplementedError

    def plan_for_replay(self, batch: ForwardBatch) -> None:
        raise NotImplementedError

    supports_prefill_graph = False

    def plan_ragged_extend(self, batch: ForwardBatch) -> None:
        """EXTEND metadata from the batch's device tensors alone (a prefill CUDA graph's: any
        split of batch.num_tokens tokens over batch.batch_size requests, some of them empty)."""
        raise NotImplementedError(f"{type(self).__name__} does not support prefill CUDA graphs")

