"""The EAGLE draft head: one decoder layer that reads the target's hidden states and the
embedding of the next token, and an lm_head over its own draft vocabulary.

One draft step, for every token row (EAGLE-3; shapes for N rows):

    feature = fc(concat(h_low, h_mid, h_high))         (N, hidden); step 0 only: later steps
                                                       feed the previous step's output back
    x       = concat(input_layernorm(embed(token)), hidden_norm(feature))        (N, 2 * hidden)
    h       = feature + o_proj(attention(q(x), k(x), v(x)))
    h       = h + mlp(post_attention_layernorm(h))     the next step's feature
    logits  = lm_head(norm(h))                         (N, draft_vocab); draft id i is target id i + d2t[i]

EAGLE-2 heads read the target's final-normed state instead of three layers: there is no fc
(SGLang's EAGLE3 head with use_aux_hidden_state=false). The embedding is the target's,
shared and frozen, so checkpoints leave it out. Parameter names follow SGLang's
LlamaForCausalLMEagle3 and SpecForge (`midlayer.self_attn.q_proj.weight`, ...), so a state
dict moves between them unchanged (eagle_checkpoint.py). Attention is a callable: the
training-time test's (eagle_ttt.py) or, later, the engine's over its draft KV cache.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.layers import RMSNorm, rms_norm
from specserve.model.rope import RotaryEmbedding
from specserve.speculative.heads.eagle_config import EagleHeadConfig

# (q (N, heads, head_dim), k (N, kv_heads, head_dim), v) -> (N, heads, head_dim)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TrainableRMSNorm(RMSNorm):
    """RMSNorm in torch ops on every device: layers.RMSNorm's GPU kernel has no backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class EagleAttention(nn.Module):
    def __init__(self, config: EagleHeadConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(2 * config.hidden_size, q_size, bias=False)
        self.k_proj = nn.Linear(2 * config.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(2 * config.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attend: Attend) -> torch.Tensor:
        q = self.q_proj(x).view(-1, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        return self.o_proj(attend(q, k, v).reshape(x.shape[0], -1))


class EagleMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagleDecoderLayer(nn.Module):
    """A Llama layer whose attention reads concat(normed embedding, normed feature)."""

    def __init__(self, config: EagleHeadConfig):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = TrainableRMSNorm(config.hidden_size, eps)
        self.hidden_norm = TrainableRMSNorm(config.hidden_size, eps)
        self.self_attn = EagleAttention(config)
        self.post_attention_layernorm = TrainableRMSNorm(config.hidden_size, eps)
        self.mlp = EagleMLP(config.hidden_size, config.intermediate_size)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                rope: RotaryEmbedding, attend: Attend) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds).to(features.dtype), self.hidden_norm(features)], dim=-1)
        h = features + self.self_attn(x, positions, rope, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleHead(nn.Module):
    def __init__(self, config: EagleHeadConfig, max_positions: int | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens: nn.Embedding | None = None  # the target's: share_embedding
        self.fc = nn.Linear(config.feature_size, config.hidden_size, bias=False) if config.has_fc else None
        self.midlayer = EagleDecoderLayer(config)
        self.norm = TrainableRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        # draft id i is target id i + d2t[i]; t2d[j]: target id j is in the draft vocabulary
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rope = RotaryEmbedding(config.head_dim, max_positions or config.max_position_embeddings,
                                    config.rope_theta, config.rope_scaling)

    def share_embedding(self, weight: torch.Tensor) -> None:
        """Uses the target's token embedding (vocab, hidden), frozen."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise ValueError(f"embedding of shape {tuple(weight.shape)} does not fit the head's {expected}")
        self.embed_tokens = nn.Embedding.from_pretrained(weight, freeze=True)

    def project(self, target_states: torch.Tensor) -> torch.Tensor:
        """(N, feature_size) target states -> (N, hidden): the first step's feature."""
        return target_states if self.fc is None else self.fc(target_states.to(self.fc.weight.dtype))

    def step(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
             attend: Attend) -> torch.Tensor:
        """One draft step for N rows: tokens (N,), features (N, hidden), positions (N,);
        returns the next features (N, hidden), whose logits() are this step's draft."""
        if self.embed_tokens is None:
            raise ValueError("the head has no token embedding: call share_embedding(target embedding) first")
        return self.midlayer(self.embed_tokens(tokens), features, positions, self.rope, attend)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, draft_vocab) over the draft vocabulary."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Makes the draft vocabulary the given target ids (draft_vocab_size of them, ascending)."""
        target_ids = target_ids.to(self.d2t.device)
        if target_ids.shape != self.d2t.shape or not bool((target_ids[1:] > target_ids[:-1]).all()):
            raise ValueError(f"draft vocabulary must be {self.d2t.numel()} ascending, distinct target ids")
        self.d2t.copy_(target_ids - torch.arange(target_ids.numel(), device=target_ids.device))
        self.t2d.zero_()
        self.t2d[target_ids] = True

    @torch.no_grad()
    def restrict_draft_vocab(self, allowed_target_ids: torch.Tensor) -> None:
        """FR-Spec: keeps only the draft tokens whose target id is allowed (lm_head rows and
        d2t shrink together; draft ids stay ascending, set_draft_vocab's form). The config
        becomes one of the smaller vocabulary, so save_head writes a consistent head."""
        vocab = self.draft_vocab()
        kept = torch.isin(vocab, allowed_target_ids.to(vocab.device)).nonzero().squeeze(1)
        if kept.numel() == 0:
            raise ValueError("none of the allowed target ids is in the head's draft vocabulary")
        weight = self.lm_head.weight
        self.lm_head = nn.Linear(weight.shape[1], kept.numel(), bias=False, device=weight.device, dtype=weight.dtype)
        self.lm_head.weight.copy_(weight[kept])
        self.config = dataclasses.replace(self.config, draft_vocab_size=kept.numel())
        self.d2t = torch.zeros_like(self.d2t[:kept.numel()])
        self.set_draft_vocab(vocab[kept])

    def draft_vocab(self) -> torch.Tensor:
        """The target ids of the draft vocabulary, in draft-id order."""
        return self.to_target_ids(torch.arange(self.d2t.numel(), device=self.d2t.device))
