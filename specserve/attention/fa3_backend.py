"""FlashAttention-3 for prompts, the kernel SGLang serves with on Hopper (`--attention-backend
fa3`), from the sgl_kernel module of the sglang-kernel package (`pip install specserve[fa3]`).

A step's prompts and chunks, any number of them, are one varlen call per layer over the
token-granular KV pool: each request's keys are found through a page table of pages of one
token, built once a forward from its `req_to_token` row (the prefix) and the step's out_slots
(the new tokens, whose table entries may not be written yet). Decode and verify steps and
every CUDA graph stay on the decode backend (attention/hybrid.py): the kernel takes no
tree mask, and its graph metadata is not built here.

Why: at long prompts attention is most of a prefill, and Hopper's FA3 kernels run it well
past FlashAttention-2's (torch's SDPA) and our Triton kernel's rate (docs/bench); a team moving
from SGLang has the package already.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specserve.attention.base import AttentionBackend, ForwardBatch, ForwardMode


def load_kernel(dtype: torch.dtype = torch.bfloat16) -> tuple[Callable | None, str]:
    """(sgl_kernel's flash_attn_with_kvcache, "") where it runs here for a model in `dtype`,
    else (None, why not)."""
    if not torch.cuda.is_available():
        return None, "FA3 needs a CUDA GPU"
    if dtype not in (torch.bfloat16, torch.float16):
        return None, f"FA3 attends in bfloat16 and float16, the model runs in {dtype}"
    major, _ = torch.cuda.get_device_capability()
    if major not in (8, 9):
        return None, f"FA3 runs on compute capability 8.x and 9.x, this GPU is {major}.x"
    try:
        from sgl_kernel.flash_attn import flash_attn_with_kvcache
    except Exception as error:   # not installed, or built for another torch: an ImportError or an OSError
        return None, f"sgl_kernel's FA3 does not load ({type(error).__name__}: {error}); pip install specserve[fa3]"
    return flash_attn_with_kvcache, ""


@dataclass
class FA3Metadata:
    page_table: torch.Tensor      # (bs, max_kv) int32: slot of each request's key at each position
    cache_seqlens: torch.Tensor   # (bs,) int32: keys of each request, its new tokens included
    cu_seqlens_q: torch.Tensor    # (bs + 1,) int32: request b's new tokens are rows [cu[b], cu[b+1])
    max_seqlen_q: int


class FA3Backend(AttentionBackend):
    name = "fa3"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, kernel: Callable | None = None):
        """kernel: flash_attn_with_kvcache's signature (load_kernel's; tests pass a reference)."""
        super().__init__(num_heads, num_kv_heads, head_dim)
        if kernel is None:
            kernel, why = load_kernel()
            if kernel is None:
                raise RuntimeError(why)
        self.kernel = kernel

    def plan(self, batch: ForwardBatch) -> None:
        if batch.mode is not ForwardMode.EXTEND:
            raise ValueError(f"the fa3 backend attends prompts; a {batch.mode.value} step belongs to the decode backend")
        batch.attn_metadata = plan_pages(batch)

    def forward(self, q, k, v, layer, batch: ForwardBatch) -> torch.Tensor:
        pool = batch.kv_pool
        if k is not None:   # None: the model's fused RoPE kernel has stored k and v already
            pool.store(layer, batch.out_slots, k, v)
        meta: FA3Metadata = batch.attn_metadata
        k_cache, v_cache = (buffer.unsqueeze(1) for buffer in (pool.k_buffers[layer], pool.v_buffers[layer]))
        return self.kernel(q.contiguous(), k_cache, v_cache, page_table=meta.page_table,
                           cache_seqlens=meta.cache_seqlens, cu_seqlens_q=meta.cu_seqlens_q,
                           max_seqlen_q=meta.max_seqlen_q, softmax_scale=self.scale, causal=True)


def plan_pages(batch: ForwardBatch) -> FA3Metadata:
    device, bs = batch.input_ids.device, batch.batch_size
    max_kv = max(p + e for p, e in zip(batch.prefix_lens_host, batch.extend_lens_host))
    page_table = batch.kv_pool.req_to_token[batch.req_rows, :max_kv].clone()
    # the new tokens' slots over their positions: request b's i-th new token is at prefix_b + i
    owner = torch.repeat_interleave(torch.arange(bs, device=device), batch.extend_lens, output_size=batch.num_tokens)
    cu_seqlens_q = torch.zeros(bs + 1, dtype=torch.int32, device=device)
    cu_seqlens_q[1:] = torch.cumsum(batch.extend_lens, 0)
    position = batch.prefix_lens[owner] + torch.arange(batch.num_tokens, device=device) - cu_seqlens_q[owner]
    page_table[owner, position] = batch.out_slots.to(torch.int32)
    return FA3Metadata(page_table=page_table, cache_seqlens=(batch.prefix_lens + batch.extend_lens).to(torch.int32),
                       cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max(batch.extend_lens_host))
