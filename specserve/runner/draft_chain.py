"""The device side of a draft model's chain: K draft tokens per request, one forward after
another, with no host sync, so the same function runs eagerly and inside one CUDA graph per
batch bucket (draft_runner.py).

Per request, with L its token count (the root t[L-1] at position L-1) and the draft cache
holding positions 0 .. L-3 at least:
  step 1:     a VERIFY-mode forward of the chain (t[L-2], t[L-1]) at positions L-2, L-1.
              Feeding t[L-2] again makes every request start alike: after a verify step
              that accepted every draft, the last draft d_K is the one token the draft
              model never saw; otherwise its slot is rewritten with the same K/V.
              -> d1 from the logits at t[L-1]
  step j > 1: a DECODE forward of d_{j-1} at position L+j-2 -> d_j
A draft is the argmax, or a sample of q = softmax(logits / T) keyed by the request's seed
and the draft's position (SALT_DRAFT: independent of the verifier's numbers); rows with
T = 0 take the argmax (q one-hot). Sampling chains keep q of d_j in probs[:, j-1]: the
distribution node j-1's child was drawn from, verify_sampling's `draft_probs` layout.

Padding rows (a graph bucket larger than the batch) have table row `scratch_row`, prefix 0
and the padding slot: their writes land in slot PADDING_SLOT, their drafts are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from specserve.attention.base import ForwardBatch, ForwardMode
from specserve.kv.pool import PADDING_SLOT, KVPool
from specserve.sampling.filters import apply_sampling_filters
from specserve.sampling.random import SALT_DRAFT, exponential_race


@dataclass
class ChainInputs:
    """Views into one packed int64 buffer (host, pinned for graphs, or device)."""
    packed: torch.Tensor
    tokens: torch.Tensor        # (bs, 2) t[L-2], t[L-1]
    slots: torch.Tensor         # (bs, K+1) draft-pool slots of positions L-2 .. L+K-2
    req_rows: torch.Tensor      # (bs,) rows of the draft pool's req_to_token
    prefix_lens: torch.Tensor   # (bs,) L-2: positions the chain does not feed
    seeds: torch.Tensor         # (bs,)
    temperatures: torch.Tensor  # (bs,) float64 (a view of int64 storage); 0: argmax drafts

    @classmethod
    def allocate(cls, bs: int, num_steps: int, device, pin: bool = False) -> "ChainInputs":
        size = bs * (2 + num_steps + 1) + 4 * bs
        return cls.view(torch.zeros(size, dtype=torch.long, device=device, pin_memory=pin), bs, num_steps)

    @classmethod
    def view(cls, packed: torch.Tensor, bs: int, num_steps: int) -> "ChainInputs":
        parts = packed.split([2 * bs, (num_steps + 1) * bs, bs, bs, bs, bs])
        return cls(packed, parts[0].view(bs, 2), parts[1].view(bs, num_steps + 1), parts[2], parts[3], parts[4],
                   parts[5].view(torch.float64))

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_steps(self) -> int:
        return self.slots.shape[1] - 1

    def fill(self, rows: "list[ChainRow]", scratch_row: int) -> None:
        """Writes `rows` into a host buffer through numpy views; later rows become padding."""
        count = len(rows)
        views = [t.numpy() for t in (self.tokens, self.slots, self.req_rows, self.prefix_lens, self.seeds,
                                     self.temperatures)]
        tokens, slots, req_rows, prefix, seeds, temperatures = views
        tokens.fill(0)
        slots.fill(PADDING_SLOT)
        req_rows.fill(scratch_row)
        prefix.fill(0)
        seeds.fill(0)
        temperatures.fill(0.0)
        if not count:
            return
        tokens[:count] = [row.tokens for row in rows]
        slots[:count] = np.asarray([row.slots for row in rows], dtype=np.int64)
        req_rows[:count] = [row.req_row for row in rows]
        prefix[:count] = [row.prefix_len for row in rows]
        seeds[:count] = [row.seed for row in rows]
        temperatures[:count] = [row.temperature for row in rows]


@dataclass
class ChainRow:
    """One request's chain, on the host."""
    tokens: tuple[int, int]
    slots: list[int]
    req_row: int
    prefix_len: int
    seed: int
    temperature: float


def run_chain(model, backend, pool: KVPool, inputs: ChainInputs, plan: Callable[[ForwardBatch], None],
              probs_out: torch.Tensor | None = None, prefix_lens_host: list[int] | None = None) -> torch.Tensor:
    """The chain's drafts (bs, K) int64. probs_out: (>= bs, K+1, V) float32 filled with q
    (sampling chains), or None for argmax drafts. prefix_lens_host: for eager planning (a
    graph plans for the longest context instead)."""
    bs, num_steps = inputs.batch_size, inputs.num_steps
    device = inputs.tokens.device
    host_prefix = prefix_lens_host if prefix_lens_host is not None else [0] * bs
    drafts = []
    logits = _forward(model, backend, plan, _first_step(inputs, pool, host_prefix))
    for step in range(1, num_steps + 1):
        position = inputs.prefix_lens + step + 1       # where d_step goes: L + step - 1
        token = _pick(logits, inputs, position, None if probs_out is None else probs_out[:bs, step - 1])
        drafts.append(token)
        if step == num_steps:
            break
        batch = ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=token, positions=position,
            out_slots=inputs.slots[:, step + 1].contiguous(), req_rows=inputs.req_rows, prefix_lens=position,
            extend_lens=torch.ones(bs, dtype=torch.long, device=device),
            prefix_lens_host=[p + step + 1 for p in host_prefix], extend_lens_host=[1] * bs, kv_pool=pool,
            logits_indices=torch.arange(bs, device=device))
        logits = _forward(model, backend, plan, batch)
    return torch.stack(drafts, dim=1)


def _forward(model, backend, plan: Callable[[ForwardBatch], None], batch: ForwardBatch) -> torch.Tensor:
    plan(batch)
    return model(batch, backend)


def _first_step(inputs: ChainInputs, pool: KVPool, host_prefix: list[int]) -> ForwardBatch:
    """The VERIFY-mode forward of (t[L-2], t[L-1]); logits at t[L-1] only."""
    bs = inputs.batch_size
    device = inputs.tokens.device
    two = torch.arange(2, device=device)
    return ForwardBatch(
        mode=ForwardMode.VERIFY, input_ids=inputs.tokens.reshape(-1),
        positions=(inputs.prefix_lens.unsqueeze(1) + two).reshape(-1),
        out_slots=inputs.slots[:, :2].reshape(-1), req_rows=inputs.req_rows, prefix_lens=inputs.prefix_lens,
        extend_lens=torch.full((bs,), 2, dtype=torch.long, device=device), prefix_lens_host=host_prefix,
        extend_lens_host=[2] * bs, kv_pool=pool, logits_indices=torch.arange(bs, device=device) * 2 + 1,
        tree_mask=(two.view(1, 2, 1) >= two.view(1, 1, 2)).expand(bs, 2, 2))


def _pick(logits: torch.Tensor, inputs: ChainInputs, position: torch.Tensor,
          probs_out: torch.Tensor | None) -> torch.Tensor:
    """One draft per row: the argmax, or a sample of q written to probs_out (bs, V)."""
    if probs_out is None:
        return logits.argmax(dim=-1)
    q = draft_distribution(logits, inputs.temperatures)
    probs_out.copy_(q)
    return exponential_race(q, inputs.seeds, position, SALT_DRAFT)


def draft_distribution(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """q = softmax(logits / T), one-hot at the argmax where T = 0. The target's top-k / top-p
    are left out: verification is exact for any q, and they would cost a sort over the
    vocabulary per draft (the filter parameters are not read with need_* False)."""
    unused = temperatures
    return apply_sampling_filters(logits, temperatures, unused, unused, unused,
                                  need_top_k_top_p=False, need_min_p=False)
