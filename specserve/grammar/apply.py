"""Applying grammar bitmasks to logits on the device, without a host sync.

The torch code below serves CPU and GPU alike (unpacking the bits is a few elementwise
kernels). On a GPU, xgrammar's `apply_token_bitmask_inplace` kernel can take its place
behind this same function (logits (bs, n, V), bitmask (bs, n, words) already on the device).
"""
from __future__ import annotations

import torch

def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits (..., V) float; bitmask (..., words) int32 on the same device, bit j of word w
    allowing token 32 * w + j. Returns new logits with the forbidden tokens at -inf."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).to(torch.bool).flatten(-2)[..., :vocab]
    return logits.masked_fill(~allowed, float("-inf"))
