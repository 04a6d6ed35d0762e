"""Whole copies, on rank 0, of the target's vocabulary-parallel weights a drafter borrows.

A model drafter runs once, on rank 0, with whole weights (a draft model, an EAGLE head, an
MTP layer: small next to the target, and sharding them would put a collective in every
draft step, each a round trip for a few microseconds of work). An EAGLE head or an MTP layer
whose checkpoint leaves out the token embedding (or the lm_head) borrows the target's, which
with tp_size > 1 is split by vocabulary rows across the ranks. Rank 0 gathers the rows
into a whole copy once, at start-up: one extra (vocab, hidden) tensor on rank 0 per
borrowed weight, instead of an all-reduce per head forward through the vocabulary-parallel
path (which would also need every rank to run the head).

`VocabularyCopies` is allocated before the target's runner sizes its KV cache (so the copy
counts against rank 0's memory like the head's own weights) and filled once the runner
exists: rank 0 announces each part (a `GatherVocabulary` step header) and the workers send
their shards (`send_vocabulary_shard`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specserve.model.config import ModelConfig
from specserve.model.parallel.parallel_state import TensorParallelGroup
from specserve.model.parallel.sharding import ModelShard

EMBEDDING, LM_HEAD = "embedding", "lm_head"


@dataclass(frozen=True)
class GatherVocabulary:
    """A step header: every rank sends its rows of the target's `part` to rank 0."""
    part: str   # EMBEDDING or LM_HEAD (the embedding's rows when the model ties them)


def vocabulary_shard(model: nn.Module, part: str) -> torch.Tensor:
    """This rank's (vocab_per_rank, hidden) rows of the sharded target's `part`."""
    if part == LM_HEAD and model.lm_head is not None:
        return model.lm_head.weight
    return model.embed_tokens.weight


def send_vocabulary_shard(group: TensorParallelGroup, model: nn.Module, header: GatherVocabulary) -> None:
    """A worker's side of VocabularyCopies.gather."""
    group.gather_rows_into(vocabulary_shard(model, header.part), None)


class VocabularyCopies:
    def __init__(self, config: ModelConfig, parts: list[str], tp_size: int, device: torch.device,
                 dtype: torch.dtype):
        """Allocates rank 0's whole (vocab, hidden) copy of each part (padded to tp_size shards)."""
        shard = ModelShard.for_rank(config, 0, tp_size)
        self.vocab_size = config.vocab_size
        self._padded = {part: torch.empty((shard.vocab_per_rank * tp_size, config.hidden_size), dtype=dtype,
                                          device=device) for part in parts}

    def gather(self, group: TensorParallelGroup, model: nn.Module) -> None:
        """Fills every copy from the ranks' shards (rank 0's sharded model: `model`)."""
        for part, full in self._padded.items():
            group.workers.send_step(GatherVocabulary(part))
            group.gather_rows_into(vocabulary_shard(model, part), full)

    def __getitem__(self, part: str) -> torch.Tensor:
        """(vocab, hidden): the padding rows of the last shard cut off."""
        return self._padded[part][:self.vocab_size]
