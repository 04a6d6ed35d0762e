"""An EAGLE head's draft step for serving: the head's weights run through the target's
fused building blocks.

EagleHead's modules are its training form: RMSNorm in torch ops (~6 kernels each, four per
step), q/k/v and gate/up as separate projections, RoPE in torch ops, differentiable. That
form served every draft step: ~60 kernels for one decoder layer whose weights take ~50 us
to read on an H200, and a chain of 3 steps took ~0.85 ms of GPU time (1.5B, session 9).
Here the same weights (shared, not copied: q/k/v and gate/up become views of one fused
weight each) go through what the target's layers use: one qkv projection with RoPE and
the KV write in one kernel, gate/up with SiLU * up fused and, for the few rows of a draft
step, the weight-streaming kernels (layers.fused_linear) with the post-attention norm and
its residual add inside gate/up's; the input's embedding, two norms and concatenation are
one kernel. On a CPU the blocks fall back to the same torch ops as the training form.

    features -> x = concat(input_layernorm(embed(token)), hidden_norm(features))
             -> h = features + o_proj(attention(rope(qkv_proj(x))))
             -> h + down(silu(gate(post_norm(h))) * up(post_norm(h)))
"""
from __future__ import annotations

import torch
from torch import nn

from specserve.attention.base import AttentionBackend, ForwardBatch
from specserve.model.layers import GatedMLP, RMSNorm, fused, fused_linear, gemv_ops, linear, takes_row_kernels
from specserve.speculative.heads.eagle_head import EagleDecoderLayer, EagleHead, TrainableRMSNorm


def _serving_norm(norm: TrainableRMSNorm) -> RMSNorm:
    """The fused-kernel RMSNorm over the same weight parameter."""
    serving = RMSNorm(norm.weight.shape[0], norm.eps)
    serving.weight = norm.weight
    return serving


def _fuse_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One projection whose rows are the given ones', in order; each given projection's weight
    becomes a view of the fused weight, so the training form and this share one copy."""
    weight = torch.cat([layer.weight.detach() for layer in linears])
    with torch.device("meta"):
        fused_linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    fused_linear.weight = nn.Parameter(weight, requires_grad=False)
    start = 0
    for layer in linears:
        rows = layer.weight.shape[0]
        layer.weight = nn.Parameter(weight[start:start + rows], requires_grad=False)
        start += rows
    return fused_linear


class ServingEagleLayer(nn.Module):
    """EagleDecoderLayer's forward for a draft step of the engine (no backward)."""

    def __init__(self, layer: EagleDecoderLayer):
        super().__init__()
        attn = layer.self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.input_layernorm = _serving_norm(layer.input_layernorm)
        self.hidden_norm = _serving_norm(layer.hidden_norm)
        self.post_attention_layernorm = _serving_norm(layer.post_attention_layernorm)
        self.qkv_proj = _fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        mlp = layer.mlp
        with torch.device("meta"):
            self.mlp = GatedMLP(mlp.gate_proj.in_features, mlp.gate_proj.out_features)
        self.mlp.gate_up_proj = _fuse_linears([mlp.gate_proj, mlp.up_proj])
        self.mlp.down_proj = mlp.down_proj
        # RoPE and the KV write as one kernel needs a power-of-two head_dim (as the target's Attention)
        self.fuses_rope = self.head_dim & (self.head_dim - 1) == 0

    def forward(self, tokens: torch.Tensor, embedding: nn.Embedding, features: torch.Tensor, batch: ForwardBatch,
                backend: AttentionBackend, rope) -> torch.Tensor:
        x = self._input(tokens, embedding, features)
        attended = self._attend(linear(self.qkv_proj, x), batch, backend, rope)
        norm = self.post_attention_layernorm
        if takes_row_kernels(attended):   # the residual add and its norm inside gate_up's kernel, as the target's
            act, h = fused_linear(attended, self.mlp.gate_up_proj.weight, silu_mul=True,
                                  add_norm=gemv_ops().AddNorm(features, norm.weight, norm.eps))
            return h + linear(self.mlp.down_proj, act)
        h = features + attended
        return h + self.mlp(norm(h))

    def _input(self, tokens: torch.Tensor, embedding: nn.Embedding, features: torch.Tensor) -> torch.Tensor:
        """x = [input_layernorm(embed(tokens)), hidden_norm(features)]: on a GPU one kernel
        (embedding, two norms and their concatenation: four launches a draft step otherwise)."""
        weight = embedding.weight
        if features.is_cuda and features.dim() == 2 and features.stride(1) == 1 and weight.dtype == features.dtype:
            first, second = self.input_layernorm, self.hidden_norm
            return fused().eagle3_input(tokens.contiguous(), weight, first.weight, first.eps, features, second.weight,
                                        second.eps)
        embeds = embedding(tokens)
        return torch.cat([self.input_layernorm(embeds).to(features.dtype), self.hidden_norm(features)], dim=-1)

    def _attend(self, qkv: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend, rope) -> torch.Tensor:
        """RoPE, the K/V write to layer 0 of the batch's (the head's) pool, attention, o_proj."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if q.is_cuda and self.fuses_rope:
            pool = batch.kv_pool
            fused().rope_and_store(q, k, v, rope.cos, rope.sin, batch.positions, batch.out_slots,
                                   pool.k_buffers[0], pool.v_buffers[0])
            out = backend.forward(q, None, None, 0, batch)
        else:
            q, k = rope(batch.positions, q, k)
            out = backend.forward(q, k, v, 0, batch)
        return linear(self.o_proj, out.reshape(-1, self.q_size))


class ServingEagleHead:
    """A loaded head's draft step and logits in serving form (`step`, `logits`); the head
    keeps its training form (EagleHead.step) over the same weights."""

    def __init__(self, head: EagleHead):
        if head.embed_tokens is None:
            raise ValueError("the head has no token embedding: call share_embedding(target embedding) first")
        self.head = head
        self.layer = ServingEagleLayer(head.midlayer)
        self.norm = _serving_norm(head.norm)

    def step(self, batch: ForwardBatch, backend: AttentionBackend, features: torch.Tensor) -> torch.Tensor:
        """One draft step for the batch's token rows (features (N, hidden)); returns the next
        features (N, hidden), whose logits() are this step's draft."""
        return self.layer(batch.input_ids, self.head.embed_tokens, features, batch, backend, self.head.rope)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, draft_vocab)."""
        return linear(self.head.lm_head, self.norm(hidden))
