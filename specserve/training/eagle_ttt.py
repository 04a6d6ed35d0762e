"""EAGLE-3's training-time test: k draft steps unrolled over whole conversations at once.

At serving time a draft chain rooted after token t runs step 0 on (token t+1, the target's
state at t), then step j on (its own draft token, step j-1's output). Training runs every
root t of a padded batch (B, T) in parallel: step j at row t reads token t+1+j (the
target's own token, which is the draft token whenever the chain is still alive), the
previous step's output at row t as its feature, sits at RoPE position t+j, and predicts
token t+2+j. Its query sees step 0's keys causally (the draft KV cache of the accepted
prefix) and the keys of steps 1..j at its own row (its own chain), exactly the keys the
chain's node would see at serving time.

What that costs, and what it does not need to:
- Step 0 runs at every row: its keys are every later query's prefix. A later step at row t
  feeds only row t's own later steps, so steps 1.. run only at the rows some step learns
  from (`learning_rows`: the answer and the few rows before it), not over prompts and padding.
- The attention of step j is not one masked attention over (j + 1) * T keys (whose masked
  blocks cost as much as the rest): the chain's j keys are scored row by row, and their
  softmax mass joins step 0's causal attention (a fused kernel, no mask) as one extra
  "sink" key whose score is the chain's log-sum-exp (see `_ChainAttention`). The result
  is the same softmax over the same keys.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specserve.speculative.heads.eagle_head import EagleHead

# every batch has a shape of its own: cuDNN's attention builds an execution plan per new
# shape on the host (forward and backward), the flash and memory-efficient kernels do not
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# extra head dims of the sink attention: two carry the sink's score (bf16 high and low
# parts), one its value; 8 keep the head dim a multiple of 8 for the fused kernels
SINK_DIMS = 8


@dataclass
class ConversationBatch:
    """Conversations padded to one length; the target's states of every token."""
    tokens: torch.Tensor           # (B, T) int64, 0 past each length
    lengths: torch.Tensor          # (B,) tokens of each conversation
    prompt_lens: torch.Tensor      # (B,) the answer starts at this index
    target_states: torch.Tensor | None  # (B, T, feature_size): what the head's first step reads
    # (B, T) bool: the tokens a draft step predicts (eagle_batches.learned_tokens); None:
    # every token after each answer's first, the answer running from prompt_lens to the end
    learned: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def shifted_tokens(self, offset: int) -> torch.Tensor:
        """tokens[:, t + offset] at column t, 0 past the end."""
        return F.pad(self.tokens[:, offset:], (0, offset))

    def predicts_answer(self, step: int) -> torch.Tensor:
        """(B, T) bool: row t at `step` predicts token t+2+step, an answer token after the
        first (the first comes from prefill: drafting starts after it)."""
        if self.learned is not None:
            return F.pad(self.learned[:, 2 + step:], (0, 2 + step))
        predicted = torch.arange(self.shape[1], device=self.tokens.device) + 2 + step
        return (predicted > self.prompt_lens.unsqueeze(1)) & (predicted < self.lengths.unsqueeze(1))

    def learns_from(self, steps: int) -> torch.Tensor:
        """(B, T) bool: rows at which some step < `steps` predicts an answer token."""
        return functools.reduce(operator.or_, (self.predicts_answer(step) for step in range(steps)))

    def learning_rows(self, steps: int) -> torch.Tensor:
        """(num_rows,) flat rows b * T + t of `learns_from`, ascending."""
        return self.learns_from(steps).flatten().nonzero().squeeze(1)


def unroll(head: EagleHead, batch: ConversationBatch, steps: int, rows: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Runs `steps` draft steps; returns each step's output (its logits are head.logits of it):
    (len(rows), hidden) at the flat rows `rows` (b * T + t, ascending; the later steps run
    only there), or (B, T, hidden) at every row when rows is None."""
    b, t = batch.shape
    positions = torch.arange(t, device=batch.tokens.device).repeat(b)
    attend = TrainingTimeTestAttention(b, t, rows)
    features = head.project(batch.target_states.reshape(b * t, -1))
    features = head.step(batch.shifted_tokens(1).reshape(-1), features, positions, attend)
    if rows is not None:
        features, positions = features.index_select(0, rows), positions.index_select(0, rows)
    outputs = [features]
    for step in range(1, steps):
        tokens = batch.shifted_tokens(1 + step).reshape(-1)
        tokens = tokens if rows is None else tokens.index_select(0, rows)
        features = head.step(tokens, features, positions + step, attend)
        outputs.append(features)
    return [output.view(b, t, -1) for output in outputs] if rows is None else outputs


class TrainingTimeTestAttention:
    """The attention callable of one unrolled batch: the first call (step 0) attends
    causally at every row of the (B, T) batch; later calls attend at the flat `rows`."""

    def __init__(self, batch_size: int, seq_len: int, rows: torch.Tensor | None = None):
        self.batch_size, self.seq_len, self.rows = batch_size, seq_len, rows
        self.chain: _ChainAttention | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.chain is not None:
            return self.chain(q, k, v)
        b, t = self.batch_size, self.seq_len
        num_heads, head_dim = q.shape[1], q.shape[2]
        as_heads = lambda x: x.view(b, t, x.shape[1], head_dim).transpose(1, 2)  # noqa: E731  (B, heads, T, head_dim)
        keys, values = as_heads(k), as_heads(v)
        group = num_heads // k.shape[1]
        # k/v heads repeated: every SDPA kernel takes them so, whatever the torch version
        out = _causal_attention(as_heads(q), keys.repeat_interleave(group, dim=1),
                                values.repeat_interleave(group, dim=1))
        rows = self.rows if self.rows is not None else torch.arange(b * t, device=q.device)
        self.chain = _ChainAttention(keys, values, rows, group)
        return out.transpose(1, 2).reshape(b * t, num_heads, head_dim)


class _ChainAttention:
    """Step j >= 1 at n flat rows: softmax attention over step 0's keys at rows <= t of the
    same conversation (the prefix, P) and the row's own chain keys of steps 1..j (C).

    With s the scaled scores, softmax over P u C gives
        out = (sum_P e^s v + sum_C e^s v) / (Z_P + Z_C),   Z_X = sum_X e^s.
    C has j keys per row: its scores, lse_C = log Z_C and out_C = sum_C softmax(s) v are
    computed row by row. P is a causal attention over the padded batch, with one more key
    in front (the sink) that every query sees, scored lse_C (through an extra query dim)
    and valued e_D (an extra value dim). That attention returns
        (sum_P e^s v, Z_C) / (Z_P + Z_C)
    in its first D dims and dim D, so out = first D dims + dim D * out_C."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, group: int):
        b, kv_heads, t, head_dim = keys.shape
        self.batch_size, self.seq_len, self.group = b, t, group
        # each row's place in the (B, 1 + T) layout of the sink attention: after its conversation's sink
        self.slots = rows + rows // t + 1
        sink_key = keys.new_zeros(head_dim + SINK_DIMS)
        sink_key[head_dim:head_dim + 2] = 1            # meets the query's two score dims
        sink_value = keys.new_zeros(head_dim + SINK_DIMS)
        sink_value[head_dim] = 1

        def with_sink(x: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
            x = torch.cat([sink.expand(b, kv_heads, 1, -1), F.pad(x, (0, SINK_DIMS))], dim=2)
            return x.repeat_interleave(group, dim=1)    # (B, heads, 1 + T, head_dim + SINK_DIMS)
        self.prefix_keys, self.prefix_values = with_sink(keys, sink_key), with_sink(values, sink_value)
        self.chain_keys: list[torch.Tensor] = []       # per step: (n, kv_heads, head_dim)
        self.chain_values: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.chain_keys.append(k)
        self.chain_values.append(v)
        n, num_heads, d = q.shape
        scale = d ** -0.5
        with torch.autocast(q.device.type, enabled=False):   # the row-wise scores in fp32, as a fused kernel keeps them
            queries = q.float().view(n, -1, self.group, d)                  # (n, kv_heads, group, d)
            keys = torch.stack(self.chain_keys, dim=2).float()              # (n, kv_heads, j, d)
            values = torch.stack(self.chain_values, dim=2).float()
            scores = torch.einsum("nkgd,nkjd->nkgj", queries, keys) * scale
            chain_lse = scores.logsumexp(-1).reshape(n, num_heads)
            chain_out = torch.einsum("nkgj,nkjd->nkgd", scores.softmax(-1), values).reshape(n, num_heads, d)
        out = self._prefix_with_sink(q, chain_lse)
        return (out[..., :d].float() + out[..., d:d + 1].float() * chain_out).to(q.dtype)

    def _prefix_with_sink(self, q: torch.Tensor, sink_scores: torch.Tensor) -> torch.Tensor:
        """(n, heads, D + SINK_DIMS): causal attention over step 0's keys plus the sink."""
        b, t = self.batch_size, self.seq_len
        n, num_heads, d = q.shape
        scale = d ** -0.5
        # the sink's score through the query: hi + lo carries it to fp32 precision in bf16
        wanted = sink_scores.float() / scale
        high = wanted.to(q.dtype)
        low = (wanted - high.float()).to(q.dtype)
        rows = torch.cat([q, high.unsqueeze(-1), low.unsqueeze(-1), q.new_zeros(n, num_heads, SINK_DIMS - 2)], -1)
        # every other place (each conversation's first, rows not asked for) is a zero query: its output is dropped
        queries = q.new_zeros(b * (1 + t), num_heads, d + SINK_DIMS).index_copy(0, self.slots, rows)
        queries = queries.view(b, 1 + t, num_heads, -1).transpose(1, 2)
        out = _causal_attention(queries, self.prefix_keys.to(q.dtype), self.prefix_values.to(q.dtype), scale)
        return out.transpose(1, 2).reshape(b * (1 + t), num_heads, -1).index_select(0, self.slots)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
