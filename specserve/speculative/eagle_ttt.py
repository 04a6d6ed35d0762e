"""EAGLE-3's training-time test: k draft steps unrolled over whole conversations at once.

At serving time a draft chain rooted after token t runs step 0 on (token t+1, the target's
state at t), then step j on (its own draft token, step j-1's output). Training runs every
root t of a padded batch (B, T) in parallel: step j at row t reads token t+1+j (the
target's own token, which is the draft token whenever the chain is still alive), the
previous step's output at row t as its feature, sits at RoPE position t+j, and predicts
token t+2+j. Its query sees step 0's keys causally (the draft KV cache of the accepted
prefix) and the keys of steps 1..j at its own row (its own chain), exactly the keys the
chain's node would see at serving time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.speculative.eagle_head import EagleHead


@dataclass
class ConversationBatch:
    """Conversations padded to one length; the target's states of every token."""
    tokens: torch.Tensor           # (B, T) int64, 0 past each length
    lengths: torch.Tensor          # (B,) tokens of each conversation
    prompt_lens: torch.Tensor      # (B,) the answer starts at this index
    target_states: torch.Tensor    # (B, T, feature_size): what the head's first step reads

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def shifted_tokens(self, offset: int) -> torch.Tensor:
        """tokens[:, t + offset] at column t, 0 past the end."""
        return F.pad(self.tokens[:, offset:], (0, offset))

    def predicts_answer(self, step: int) -> torch.Tensor:
        """(B, T) bool: row t at `step` predicts token t+2+step, an answer token after the
        first (the first comes from prefill: drafting starts after it)."""
        predicted = torch.arange(self.shape[1], device=self.tokens.device) + 2 + step
        return (predicted > self.prompt_lens.unsqueeze(1)) & (predicted < self.lengths.unsqueeze(1))


class TrainingTimeTestAttention:
    """The attention callable of one unrolled batch; keeps each step's keys and values."""

    def __init__(self, batch_size: int, seq_len: int):
        self.batch_size, self.seq_len = batch_size, seq_len
        self.keys: list[torch.Tensor] = []     # per step: (B, heads, T, head_dim)
        self.values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t = self.batch_size, self.seq_len
        num_heads, head_dim = q.shape[1], q.shape[2]
        group = num_heads // k.shape[1]
        # (B, heads, T, head_dim); k/v heads repeated so the fused SDPA kernels take the mask
        as_heads = lambda x: x.view(b, t, x.shape[1], head_dim).transpose(1, 2)  # noqa: E731
        self.keys.append(as_heads(k).repeat_interleave(group, dim=1))
        self.values.append(as_heads(v).repeat_interleave(group, dim=1))
        queries = as_heads(q)
        if len(self.keys) == 1:
            out = F.scaled_dot_product_attention(queries, self.keys[0], self.values[0], is_causal=True)
        else:
            out = F.scaled_dot_product_attention(queries, torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2),
                                                 attn_mask=self._mask(len(self.keys), q.device))
        return out.transpose(1, 2).reshape(b * t, num_heads, head_dim)

    def _mask(self, steps: int, device: torch.device) -> torch.Tensor:
        """(T, steps * T): causal over step 0's keys, the diagonal of every later step."""
        t = self.seq_len
        causal = torch.ones((t, t), dtype=torch.bool, device=device).tril()
        diagonal = torch.eye(t, dtype=torch.bool, device=device)
        return torch.cat([causal] + [diagonal] * (steps - 1), dim=1)


def unroll(head: EagleHead, batch: ConversationBatch, steps: int) -> list[torch.Tensor]:
    """Runs `steps` draft steps at every row; returns each step's output (B, T, hidden)
    (its logits are head.logits of it)."""
    b, t = batch.shape
    attend = TrainingTimeTestAttention(b, t)
    features = head.project(batch.target_states.reshape(b * t, -1))
    rows = torch.arange(t, device=batch.tokens.device).repeat(b)
    outputs = []
    for step in range(steps):
        features = head.step(batch.shifted_tokens(1 + step).reshape(-1), features, rows + step, attend)
        outputs.append(features.view(b, t, -1))
    return outputs
