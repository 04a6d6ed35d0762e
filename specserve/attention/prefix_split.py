"""One prompt chunk's attention in two calls merged by their log-sum-exps: the chunk's
prefix with no mask, the chunk itself causally.

Why: cuDNN's SDPA kernel ran a causal 8192-token chunk with no prefix 1.8x faster than
flash attention (0.89 against 1.61 ms, H200, bf16, Qwen2.5-7B heads), but took a prefix only
as a lower-right mask tensor, and then ran slower than flash; split, neither call needs a
mask. Off (KERNEL None) until whole prompts are timed with it on a GPU
(`lab.prefill_cost --prefix-split cudnn`, beside `lab.extend_attention_sweep`'s split rows).
"""
from __future__ import annotations

import torch

KERNEL: str | None = None   # "cudnn", "flash" or "math": last_queries_causal attends in two with it
KERNELS = ("cudnn", "flash", "math")


def attend_in_two(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, kernel: str) -> torch.Tensor:
    """q (1, heads, q_len, dim), the last q_len of k's and v's (1, kv heads, k_len, dim)
    positions, causal among themselves."""
    prefix = k.shape[2] - q.shape[2]
    out, lse = _attend(q, k[:, :, prefix:], v[:, :, prefix:], True, scale, kernel)
    if prefix == 0:
        return out
    prefix_out, prefix_lse = _attend(q, k[:, :, :prefix], v[:, :, :prefix], False, scale, kernel)
    top = torch.maximum(lse, prefix_lse)
    weight, prefix_weight = (lse - top).exp().unsqueeze(-1), (prefix_lse - top).exp().unsqueeze(-1)
    return ((out * weight + prefix_out * prefix_weight) / (weight + prefix_weight)).to(q.dtype)


def _attend(q, k, v, causal: bool, scale: float, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention, its log-sum-exp per query as float32)."""
    group = q.shape[1] // k.shape[1]
    if kernel == "flash":   # takes grouped K/V as they are
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse.float()
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    if kernel == "cudnn":
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                      scale=scale)[:2]
        return out, lse.float().reshape(out.shape[:3])
    scores = q.float() @ k.float().transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    lse = scores.logsumexp(-1)
    return ((scores - lse.unsqueeze(-1)).exp() @ v.float()).to(q.dtype), lse
