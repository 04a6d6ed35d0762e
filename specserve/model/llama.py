"""One decoder for Llama, Qwen2 and Qwen3: the differences are flags of ModelConfig
(qkv bias for Qwen2, q/k RMSNorm for Qwen3, tied embeddings, rope scaling).

With a tensor-parallel group the same modules hold one rank's shard (model/parallel/sharding.py):
its heads, MLP columns and vocabulary rows; the layer all-reduces after attention and after
the MLP, and the logits' vocabulary shards are gathered on rank 0."""
from __future__ import annotations

import torch
from torch import nn

from specserve.attention.base import AttentionBackend, ForwardBatch
from specserve.model.config import ModelConfig
from specserve.model.layers import (GatedMLP, RMSNorm, fused, fused_linear, gemv_ops, linear, takes_one_row_kernels,
                                    takes_row_kernels)
from specserve.model.parallel.parallel_state import TensorParallelGroup
from specserve.model.parallel.sharding import ModelShard
from specserve.model.parallel.vocab_parallel import VocabParallelEmbedding
from specserve.model.rope import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, shard: ModelShard | None = None):
        super().__init__()
        shard = shard or ModelShard.whole(config)
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend,
                rope: RotaryEmbedding) -> torch.Tensor:
        return self.attend(linear(self.qkv_proj, x), batch, backend, rope)

    def attend(self, qkv: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend,
               rope: RotaryEmbedding) -> torch.Tensor:
        """Everything after the qkv projection: q/k norms, RoPE, the KV write, attention, o_proj."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)      # (num_tokens, num_heads, head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)   # (num_tokens, num_kv_heads, head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if q.is_cuda and self.fuses_rope:  # one kernel: rotate q, k; write k, v to the cache
            pool = batch.kv_pool
            fused().rope_and_store(q, k, v, rope.cos, rope.sin, batch.positions, batch.out_slots,
                                   pool.k_buffers[self.layer], pool.v_buffers[self.layer])
            return self.attend_stored(q, batch, backend)
        q, k = rope(batch.positions, q, k)
        out = backend.forward(q, k, v, self.layer, batch)
        return linear(self.o_proj, out.reshape(-1, self.q_size))

    @property
    def fuses_rope(self) -> bool:
        """RoPE and the KV write can run as one kernel (or a GEMV's epilogue) on a GPU:
        head_dim a power of two, and no q/k norm between the projection and RoPE."""
        return self.q_norm is None and self.head_dim & (self.head_dim - 1) == 0

    def attend_stored(self, q: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """Attention and o_proj for rotated q, the token's k and v already in the KV pool. q may
        be a row-strided view of the qkv projection: the attention kernels take its strides
        (no copy kernel per layer)."""
        q = q.reshape(-1, self.num_heads, self.head_dim)  # (num_tokens, num_heads, head_dim), no copy
        out = backend.forward(q, None, None, self.layer, batch)
        return linear(self.o_proj, out.reshape(-1, self.q_size))

    def rope_store(self, batch: ForwardBatch, rope: RotaryEmbedding):
        """The qkv GEMV epilogue's arguments for this layer (see gemv.RopeStore)."""
        pool = batch.kv_pool
        return gemv_ops().RopeStore(rope.cos, rope.sin, batch.positions, batch.out_slots,
                                    pool.k_buffers[self.layer], pool.v_buffers[self.layer], self.num_heads)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, shard: ModelShard | None = None,
                 tp: TensorParallelGroup | None = None):
        super().__init__()
        shard = shard or ModelShard.whole(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, shard.intermediate_size)
        self.tp = tp

    def _sum_over_ranks(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel output (o_proj's, down_proj's) summed over the ranks' shards."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def forward(self, x, residual, batch, backend, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual-stream form: returns (mlp output, residual); the caller adds them."""
        if takes_row_kernels(x):
            return self._forward_fused(x, residual, batch, backend, rope)
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self._sum_over_ranks(self.self_attn(h, batch, backend, rope))
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self._sum_over_ranks(self.mlp(h)), residual

    def _forward_fused(self, x, residual, batch, backend, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode or verify step of a few rows on a GPU: each pre-norm runs inside the
        linear that consumes it, and gate, up and SiLU * up are one kernel (a layer is a
        chain of ~5 kernels)."""
        if residual is None:  # the first layer: residual 0 + x is exactly x
            residual = torch.zeros_like(x)
        gemv, attn, mlp, norm = gemv_ops(), self.self_attn, self.mlp, self.input_layernorm
        pre_norm = gemv.AddNorm(residual, norm.weight, norm.eps)
        qkv_weight, qkv_bias = attn.qkv_proj.weight, attn.qkv_proj.bias
        if attn.fuses_rope:  # RoPE and the KV write in the qkv kernel's epilogue
            q, residual = fused_linear(x, qkv_weight, qkv_bias, add_norm=pre_norm, rope=attn.rope_store(batch, rope))
            h = attn.attend_stored(q, batch, backend)
        else:
            qkv, residual = fused_linear(x, qkv_weight, qkv_bias, add_norm=pre_norm)
            h = attn.attend(qkv, batch, backend, rope)
        h = self._sum_over_ranks(h)
        norm = self.post_attention_layernorm
        act, residual = fused_linear(h, mlp.gate_up_proj.weight, silu_mul=True,
                                     add_norm=gemv.AddNorm(residual, norm.weight, norm.eps))
        return self._sum_over_ranks(linear(mlp.down_proj, act)), residual


class DecoderLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, tp: TensorParallelGroup | None = None):
        """tp: the tensor-parallel group this model is one rank's shard of (None: the whole model)."""
        super().__init__()
        self.config, self.tp = config, tp
        self.shard = shard = ModelShard.whole(config) if tp is None else ModelShard.for_rank(config, tp.rank, tp.size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if tp is None else \
            VocabParallelEmbedding(shard.vocab_start, shard.vocab_per_rank, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, shard, tp) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        self.lm_head = None if config.tie_word_embeddings else \
            nn.Linear(config.hidden_size, shard.vocab_per_rank, bias=False)

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor | None:
        """Returns fp32 logits (num_logits, vocab) for the rows in batch.logits_indices, and
        fills batch.hidden_capture's states when the batch carries one. A tensor-parallel
        rank other than 0 returns None (the logits are gathered on rank 0)."""
        logits = self._local_logits(batch, backend)
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.config.vocab_size)

    def _local_logits(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """The logits of this rank's vocabulary rows (all of them without tensor parallelism)."""
        capture = batch.hidden_capture
        if capture is not None:
            capture.check(len(self.layers))
        x, residual = self.embed_tokens(batch.input_ids), None
        for index, layer in enumerate(self.layers):
            x, residual = layer(x, residual, batch, backend, self.rope)
            if capture is not None and index in capture.layers:
                capture.keep(index, residual + x)  # a new tensor: the next layer updates residual in place
        if capture is not None and capture.final:
            capture.keep_final(self.norm(residual + x))
        if takes_one_row_kernels(x) and batch.logits_indices.numel() == 1:  # the final norm inside the lm_head GEMV
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            final_norm = gemv_ops().AddNorm(residual, self.norm.weight, self.norm.eps)
            return gemv_ops().one_row_linear(x, weight, add_norm=final_norm)[0].float()
        x = self.norm((residual + x)[batch.logits_indices])
        if self.lm_head is not None:  # untied, or a CPU layer sharing the tied weight (cpu_linear.py)
            return self.lm_head(x).float()
        return torch.matmul(x, self.embed_tokens.weight.t()).float()

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copies HF-named weights in, fusing q/k/v and gate/up; every parameter must be set."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in state_dict.items():
            target, offset = _fused_target(name, self.config, self.shard)
            target = target.removeprefix("model.")
            if target not in params:
                if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                    continue  # recomputed, or the same tensor as the embedding
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            param = params[target]
            param[offset:offset + tensor.shape[0]].copy_(tensor)
            loaded.add(target)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}...")


def _fused_target(name: str, config: ModelConfig, shard: ModelShard | None = None) -> tuple[str, int]:
    """Maps an HF weight name to (our parameter name, row offset inside a fused matrix);
    with a shard, the weights are the shard's (ModelShard.select) and so are the offsets."""
    shard = shard or ModelShard.whole(config)
    q_rows = shard.num_heads * config.head_dim
    kv_rows = shard.num_kv_heads * config.head_dim
    fused_rows = {
        "self_attn.q_proj.": ("self_attn.qkv_proj.", 0),
        "self_attn.k_proj.": ("self_attn.qkv_proj.", q_rows),
        "self_attn.v_proj.": ("self_attn.qkv_proj.", q_rows + kv_rows),
        "mlp.gate_proj.": ("mlp.gate_up_proj.", 0),
        "mlp.up_proj.": ("mlp.gate_up_proj.", shard.intermediate_size),
    }
    for part, (replacement, offset) in fused_rows.items():
        if part in name:
            return name.replace(part, replacement), offset
    return name, 0
