"""A greedy draft in one kernel: each row's argmax over the draft logits, mapped to its target
id. Imported on first CUDA use: CPU-only installs never import Triton.

A chain of K drafts takes K argmaxes over the head's draft vocabulary (32k ids for a head
sized as SpecForge's), each followed by a gather through the draft-to-target id map. In a
CUDA graph on an H200, torch's reduction took ~10 us per draft at batch 1 (its two-pass
plan for a few long rows) and the gather ~2 us more: ~35 us of a 1.5B fused step whose head
reads its weights in ~150 us. Here one program owns a row and loads it whole (the draft
vocabularies this serves fit one block), so a draft costs one launch and one round trip to
memory. Ties go to the lowest index, as torch.argmax's do.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_VOCAB = 65536   # one block per row; larger vocabularies (a head over the target's own) keep torch's argmax


@triton.jit
def _argmax_map_kernel(logits_ptr, row_stride, vocab, map_ptr, out_ptr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    values = tl.load(logits_ptr + row * row_stride + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    best = tl.argmax(values, axis=0, tie_break_left=True)
    if HAS_MAP:
        best = tl.load(map_ptr + best)
    tl.store(out_ptr + row, best.to(tl.int64))


def fits(logits: torch.Tensor) -> bool:
    """Whether argmax_to_target serves these (rows, vocab) logits."""
    return logits.dim() == 2 and logits.shape[1] <= MAX_VOCAB and logits.stride(1) == 1


def argmax_to_target(logits: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """(rows, V) logits -> (rows,) int64: vocab[argmax] (the argmax itself for vocab None)."""
    rows, size = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    block = triton.next_power_of_2(size)
    _argmax_map_kernel[(rows,)](logits, logits.stride(0), size, vocab if vocab is not None else out, out,
                                HAS_MAP=vocab is not None, BLOCK=block, num_warps=min(32, max(4, block // 1024)))
    return out
