"""Which part of the model one tensor-parallel rank holds: `ModelShard`.

Megatron's split of a decoder layer, by Hugging Face parameter name:
  column-parallel (rows split): q_proj / k_proj / v_proj (whole heads), gate_proj / up_proj
  row-parallel (columns split): o_proj, down_proj; their partial outputs are summed by one
    all-reduce after attention and one after the MLP (see llama.DecoderLayer)
  vocabulary-parallel: embed_tokens and lm_head rows, padded to a multiple of tp_size
  replicated: the norms (q/k norms act per head_dim, so they are whole on every rank)

KV heads: with at least tp_size of them each rank holds num_kv_heads / tp_size; with fewer,
each KV head is replicated on tp_size / num_kv_heads ranks (SGLang's and vLLM's rule), the one
its query heads read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.errors import ArgumentError
from specserve.model.config import ModelConfig

_QUERY, _KV, _MLP_IN, _VOCAB = "query", "kv", "mlp_in", "vocab"
# HF name fragment -> (what its split dimension counts, dimension: 0 rows, 1 columns)
_SPLITS = {
    "self_attn.q_proj.": (_QUERY, 0), "self_attn.k_proj.": (_KV, 0), "self_attn.v_proj.": (_KV, 0),
    "self_attn.o_proj.": (_QUERY, 1),
    "mlp.gate_proj.": (_MLP_IN, 0), "mlp.up_proj.": (_MLP_IN, 0), "mlp.down_proj.": (_MLP_IN, 1),
    "embed_tokens.": (_VOCAB, 0), "lm_head.": (_VOCAB, 0),
}


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """An ArgumentError naming tp_size when the model's heads or MLP cannot be split that way."""
    if config.num_heads % tp_size:
        raise ArgumentError(f"tp_size={tp_size} must divide the model's {config.num_heads} attention heads "
                            f"(num_attention_heads); try a tp_size among {_divisors(config.num_heads)}")
    kv = config.num_kv_heads
    if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
        raise ArgumentError(f"tp_size={tp_size} and the model's {kv} KV heads (num_key_value_heads): one must "
                            "divide the other (fewer KV heads than ranks are replicated)")
    if config.intermediate_size % tp_size:
        raise ArgumentError(f"tp_size={tp_size} must divide the model's intermediate_size "
                            f"{config.intermediate_size}")


@dataclass(frozen=True)
class ModelShard:
    rank: int
    size: int                 # tp_size
    head_dim: int
    num_heads: int            # query heads of this rank
    num_kv_heads: int         # KV heads of this rank
    kv_head_start: int        # the first of them among the model's KV heads
    intermediate_size: int    # MLP columns of this rank
    vocab_start: int          # first vocabulary row of this rank
    vocab_per_rank: int       # rows of this rank's embedding and lm_head, padding included
    vocab_size: int           # the model's vocabulary

    @classmethod
    def whole(cls, config: ModelConfig) -> ModelShard:
        return cls.for_rank(config, 0, 1)

    @classmethod
    def for_rank(cls, config: ModelConfig, rank: int, size: int) -> ModelShard:
        check_tensor_parallel(config, size)
        num_heads = config.num_heads // size
        if config.num_kv_heads >= size:
            num_kv_heads = config.num_kv_heads // size
            kv_head_start = rank * num_kv_heads
        else:  # replicated: the KV head of this rank's query heads
            num_kv_heads, kv_head_start = 1, rank * config.num_kv_heads // size
        vocab_per_rank = -(-config.vocab_size // size)
        return cls(rank, size, config.head_dim, num_heads, num_kv_heads, kv_head_start,
                   config.intermediate_size // size, rank * vocab_per_rank, vocab_per_rank, config.vocab_size)

    def select(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `name` (Hugging Face naming), a copy when
        split so that the full tensor can be freed; vocabulary shards past the vocabulary are
        zero rows (their logits are dropped after the gather)."""
        if self.size == 1:
            return tensor
        split = next((value for part, value in _SPLITS.items() if part in name), None)
        if split is None:
            return tensor
        kind, dim = split
        start, length = self._range(kind)
        if dim == 1:
            return tensor[:, start:start + length].clone()
        part = tensor[start:start + length]
        if part.shape[0] < length:  # the last vocabulary shard
            padding = tensor.new_zeros((length - part.shape[0], *tensor.shape[1:]))
            return torch.cat([part, padding])
        return part.clone()

    def _range(self, kind: str) -> tuple[int, int]:
        """(first row, rows) of this rank along a split dimension counting `kind`."""
        if kind == _QUERY:
            return self.rank * self.num_heads * self.head_dim, self.num_heads * self.head_dim
        if kind == _KV:
            return self.kv_head_start * self.head_dim, self.num_kv_heads * self.head_dim
        if kind == _MLP_IN:
            return self.rank * self.intermediate_size, self.intermediate_size
        return self.vocab_start, self.vocab_per_rank

    def shape(self, name: str, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape `select` gives a tensor of `full_shape` (computed on the meta device)."""
        return tuple(self.select(name, torch.empty(full_shape, device="meta")).shape)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
