"""The vocabulary-parallel embedding: each rank holds the rows of its vocabulary range.

(The column- and row-parallel linears need no class of their own: they are plain nn.Linear
layers of the shard's shape, so the CPU's packed matmuls (cpu_linear.py) and the GPU's
one-row GEMVs apply to them unchanged; the decoder layer adds the all-reduce after o_proj
and after down_proj, and the model gathers the lm_head's vocabulary shards.)
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from specserve.model.parallel.parallel_state import TensorParallelGroup


class VocabParallelEmbedding(nn.Module):
    """Looks up the tokens of this rank's range, zero rows for the others; the all-reduce sums
    the one non-zero row per token into the full embedding on every rank (exact: x + 0)."""

    def __init__(self, vocab_start: int, rows: int, hidden_size: int, group: TensorParallelGroup):
        super().__init__()
        self.vocab_start, self.rows = vocab_start, rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)   # (num_tokens, hidden)
        return self.group.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))
