"""The device side of a model drafter's chain: K draft tokens per request, one forward after
another, with no host sync, so the same function runs eagerly and inside one CUDA graph per
batch bucket (chain_graphs.py). A draft model (STANDALONE) and an EAGLE head both draft this
way; `ChainModel` is what differs between them.

Per request, the chain starts with up to n rows fed in one VERIFY-mode forward (a chain
mask; `num_fed` of them are real, the rest are padding whose outputs nobody reads and whose
writes go to the padding slot), and the drafter's state at the last fed row gives draft 1:
- STANDALONE: n = 2, the last two tokens t[L-2], t[L-1] (L tokens so far). Feeding t[L-2]
  again makes every request start alike: after a verify step that accepted every draft,
  the last draft is the one token the draft model never saw; otherwise its slot is
  rewritten with the same K/V.
- EAGLE: n = K + 1, the rows whose target states the last verify step brought (1 .. K + 1).
- EAGLE's fused step (fused_step.py): the same n = K + 1 rows, fed on the device right
  after the verification that decided how many of them are real (the accept length).
Draft step j (1 <= j < K) then feeds draft j at row last + j (one DECODE forward) and gives
draft j + 1. Row = position for a draft model; an EAGLE row r reads the token at r + 1, so
its drafts sit one position further (`ChainModel.token_offset`).

A draft is the argmax, or a sample of q = softmax(logits / T) keyed by the request's seed
and the draft's position (SALT_DRAFT: independent of the verifier's numbers); rows with
T = 0 take the argmax (q one-hot). Sampling chains keep q of draft j over the target
vocabulary in probs[:, j-1]: the distribution node j-1's child was drawn from,
verify_sampling's `draft_probs` layout.

Padding requests (a graph bucket larger than the batch) have table row `scratch_row`,
prefix 0, one fed row and the padding slot: their writes land in slot PADDING_SLOT.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from specserve.attention.base import ForwardBatch, ForwardMode
from specserve.kv.pool import PADDING_SLOT, KVPool
from specserve.verify.filters import apply_sampling_filters
from specserve.verify.random import SALT_DRAFT, exponential_race


class ChainModel(Protocol):
    token_offset: int                  # a row's position + this = the position of the token it reads
    draft_vocab: torch.Tensor | None   # (draft vocab,) target ids of the draft logits; None: the same ids

    def forward(self, batch: ForwardBatch, features: torch.Tensor | None) -> torch.Tensor:
        """The drafter's state at the rows batch.logits_indices, after the batch's tokens
        (features: EAGLE's input per token row; None for a draft model)."""

    def draft_logits(self, state: torch.Tensor) -> torch.Tensor:
        """(bs, draft vocab) from forward's state."""


@dataclass
class ChainInputs:
    """Views into one packed int64 buffer (host, pinned for graphs, or device)."""
    packed: torch.Tensor
    tokens: torch.Tensor        # (bs, n) tokens of the fed rows, 0 for padding
    num_fed: torch.Tensor       # (bs,) real fed rows, >= 1
    slots: torch.Tensor         # (bs, n + d) slots of the fed rows (padding: PADDING_SLOT), then of the draft steps' d rows
    req_rows: torch.Tensor      # (bs,) rows of the drafter pool's req_to_token
    prefix_lens: torch.Tensor   # (bs,) the first fed row = rows already cached
    seeds: torch.Tensor         # (bs,)
    temperatures: torch.Tensor  # (bs,) float64 (a view of int64 storage); 0: argmax drafts

    @classmethod
    def allocate(cls, bs: int, n: int, draft_slots: int, device, pin: bool = False) -> "ChainInputs":
        """n fed rows and draft_slots draft-step slots per request (K - 1 for a chain of K)."""
        size = bs * (2 * n + draft_slots) + 5 * bs
        return cls.view(torch.zeros(size, dtype=torch.long, device=device, pin_memory=pin), bs, n, draft_slots)

    @classmethod
    def view(cls, packed: torch.Tensor, bs: int, n: int, draft_slots: int) -> "ChainInputs":
        parts = packed.split([n * bs, bs, (n + draft_slots) * bs, bs, bs, bs, bs])
        return cls(packed, parts[0].view(bs, n), parts[1], parts[2].view(bs, n + draft_slots), parts[3], parts[4],
                   parts[5], parts[6].view(torch.float64))

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def rows_per_req(self) -> int:
        return self.tokens.shape[1]

    @property
    def draft_slots(self) -> int:
        return self.slots.shape[1] - self.tokens.shape[1]

    def fill(self, rows: "list[ChainRow]", scratch_row: int) -> None:
        """Writes `rows` into a host buffer through numpy views; later rows become padding."""
        n, count = self.rows_per_req, len(rows)
        tokens, num_fed, slots, req_rows, prefix, seeds, temperatures = (t.numpy() for t in (
            self.tokens, self.num_fed, self.slots, self.req_rows, self.prefix_lens, self.seeds, self.temperatures))
        tokens.fill(0)
        num_fed.fill(1)
        slots.fill(PADDING_SLOT)
        req_rows.fill(scratch_row)
        prefix.fill(0)
        seeds.fill(0)
        temperatures.fill(0.0)
        for i, row in enumerate(rows):
            fed = len(row.tokens)
            tokens[i, :fed] = row.tokens
            slots[i, :fed] = row.slots[:fed]
            slots[i, n:] = row.slots[fed:]
        if count:
            num_fed[:count] = [len(row.tokens) for row in rows]
            req_rows[:count] = [row.req_row for row in rows]
            prefix[:count] = [row.prefix_len for row in rows]
            seeds[:count] = [row.seed for row in rows]
            temperatures[:count] = [row.temperature for row in rows]


@dataclass
class ChainRow:
    """One request's chain, on the host."""
    tokens: list[int]       # the fed rows' tokens (1 .. n)
    slots: list[int]        # the fed rows' slots, then the draft steps'
    req_row: int
    prefix_len: int         # the first fed row
    seed: int
    temperature: float

    @property
    def num_fed(self) -> int:
        return len(self.tokens)


@dataclass
class FedSpan:
    """Where a request's fed rows lie, on the host: all eager planning needs (a fused step
    knows its accept lengths, hence its fed rows, only on the device: see fused_step.py)."""
    prefix_len: int
    num_fed: int


def run_chain(model: ChainModel, pool: KVPool, inputs: ChainInputs, plan: Callable[[ForwardBatch], None],
              probs_out: torch.Tensor | None = None, first_features: torch.Tensor | None = None,
              host_rows: Sequence[ChainRow | FedSpan] | None = None) -> torch.Tensor:
    """The chain's drafts (bs, K) int64 target ids. probs_out: (>= bs, >= K, V) float32
    whose [:, j - 1] gets q of draft j (sampling chains), or None for argmax drafts.
    first_features: EAGLE's target states of the fed rows (bs * n, features). host_rows:
    the fed rows on the host, for eager planning (a graph plans for the longest context
    instead). Draft step j writes its row to slots[:, n + j - 1]."""
    bs, n, num_steps = inputs.batch_size, inputs.rows_per_req, inputs.draft_slots + 1
    device = inputs.tokens.device
    host_prefix = [row.prefix_len for row in host_rows] if host_rows is not None else [0] * bs
    host_last = [row.prefix_len + row.num_fed - 1 for row in host_rows] if host_rows is not None else [0] * bs
    plan_and = lambda batch, features: (plan(batch), model.forward(batch, features))[1]  # noqa: E731
    state = plan_and(fed_rows_batch(inputs, pool, host_prefix), first_features)
    last = inputs.prefix_lens + inputs.num_fed - 1                  # the last fed row
    # the draft steps' rows and slots, one (bs,) line per step, made at once: each small
    # kernel costs ~2 us of a CUDA graph's time, and these would be several per step
    rows = last + constant_range(1, num_steps, device).unsqueeze(1)  # (K - 1, bs)
    step_slots = inputs.slots[:, n:].t().contiguous()
    drafts = []
    for step in range(1, num_steps + 1):
        probs = None if probs_out is None else probs_out[:bs, step - 1]
        position = None if probs is None else last + (step + model.token_offset)   # where draft `step` goes
        drafts.append(pick(model, state, inputs, position, probs))
        if step == num_steps:
            break
        row = rows[step - 1]
        batch = ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=drafts[-1], positions=row, out_slots=step_slots[step - 1],
            req_rows=inputs.req_rows, prefix_lens=row, extend_lens=constant_full(bs, 1, device),
            prefix_lens_host=[r + step for r in host_last], extend_lens_host=[1] * bs,
            kv_pool=pool, logits_indices=constant_range(0, bs, device))
        state = plan_and(batch, state)
    return torch.stack(drafts, dim=1)


def fed_rows_batch(inputs: ChainInputs, pool: KVPool, host_prefix: list[int], rows_per_req: int = 1) -> ForwardBatch:
    """The VERIFY-mode forward of the fed rows, the state taken at each request's last one.
    rows_per_req: table rows a request owns (a tree's beams); the fed rows use the first.
    The mask is the chain's, padding rows included: a real row has only real rows before
    it, so it sees what a mask of real rows alone gives it; a padding row's output is never
    read, and what it writes (its own K/V) does not depend on the mask."""
    bs, n = inputs.batch_size, inputs.rows_per_req
    device = inputs.tokens.device
    return ForwardBatch(
        mode=ForwardMode.VERIFY, input_ids=inputs.tokens.reshape(-1),
        positions=(inputs.prefix_lens.unsqueeze(1) + constant_range(0, n, device)).reshape(-1),
        out_slots=inputs.slots[:, :n].reshape(-1),
        req_rows=inputs.req_rows * rows_per_req if rows_per_req != 1 else inputs.req_rows,
        prefix_lens=inputs.prefix_lens, extend_lens=constant_full(bs, n, device), prefix_lens_host=host_prefix,
        extend_lens_host=[n] * bs, kv_pool=pool,
        logits_indices=inputs.num_fed + constant_range(-1, n * bs - 1, device, n),
        tree_mask=chain_mask(n, device).expand(bs, n, n))


@functools.lru_cache(maxsize=None)
def constant_range(start: int, end: int, device: torch.device, step: int = 1) -> torch.Tensor:
    """torch.arange(start, end, step) (int64), made once per device: never written."""
    return torch.arange(start, end, step, device=device)


@functools.lru_cache(maxsize=None)
def constant_full(size: int, value: int, device: torch.device) -> torch.Tensor:
    """torch.full((size,), value) (int64), made once per device: never written."""
    return torch.full((size,), value, dtype=torch.long, device=device)


@functools.lru_cache(maxsize=None)
def chain_mask(n: int, device: torch.device) -> torch.Tensor:
    """(1, n, n) bool, [0, i, j] = j <= i: node i sees itself and every node before it."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril().unsqueeze(0)


def pick(model: ChainModel, state: torch.Tensor, inputs: ChainInputs, position: torch.Tensor | None,
          probs_out: torch.Tensor | None) -> torch.Tensor:
    """One draft per row (a target id): the argmax (of the logits as they come: a float32
    copy would change no maximum), or a sample of q written to probs_out (bs, V) at
    `position` (bs,)."""
    logits = model.draft_logits(state)
    vocab = model.draft_vocab
    if probs_out is None:
        if logits.is_cuda:
            from specserve.speculative.model_drafters import draft_argmax   # lazily: Triton on GPU machines only
            if draft_argmax.fits(logits):
                return draft_argmax.argmax_to_target(logits, vocab)
        ids = logits.argmax(dim=-1)
    else:
        q = draft_distribution(logits.float(), inputs.temperatures)
        if vocab is None:
            probs_out.copy_(q)
        else:
            probs_out.zero_().scatter_(1, vocab.expand(len(q), -1), q)
        ids = exponential_race(q, inputs.seeds, position, SALT_DRAFT)
    return ids if vocab is None else vocab[ids]


def draft_distribution(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """q = softmax(logits / T), one-hot at the argmax where T = 0. The target's top-k / top-p
    are left out: verification is exact for any q, and they would cost a sort over the
    vocabulary per draft (the filter parameters are not read with need_* False)."""
    unused = temperatures
    return apply_sampling_filters(logits, temperatures, unused, unused, unused,
                                  need_top_k_top_p=False, need_min_p=False)


class DecoderChainModel:
    """A draft model (DecoderLM) as a ChainModel: its state is the logits."""
    token_offset = 0
    draft_vocab = None

    def __init__(self, model, backend):
        self.model, self.backend = model, backend

    def forward(self, batch: ForwardBatch, features: torch.Tensor | None) -> torch.Tensor:
        return self.model(batch, self.backend)

    def draft_logits(self, state: torch.Tensor) -> torch.Tensor:
        return state
