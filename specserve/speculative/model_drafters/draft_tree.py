"""EAGLE-2's dynamic draft tree, on the device with no host sync (eagerly, or inside one CUDA
graph per batch bucket like a chain: chain_graphs.py).

From the state at the last fed row (draft_chain.fed_rows_batch), per request:
- step 0: the top-k draft tokens become the frontier, scored by their log-probability;
- step j (1 .. S-1): the k frontier nodes are fed (one DECODE row each, at row last + j) and
  each offers its top-k children, scored by cumulative log-probability; all k * k join the
  candidates and the k best become the next frontier;
- the num_nodes - 1 best candidates of all (k + (S-1) k^2) form the tree under the root.
A child never scores above its parent (log-probabilities are <= 0), and ties go to the
shallower node, so the best candidates include every chosen node's parent, and listing
them best first puts parents before children: a valid tree, whose first m nodes are a tree
too (the adaptive draft length and max_new_tokens cut proposals that way).

Each frontier node attends to the request's cached rows and its own ancestors: a request
owns k table rows in the drafter's pool ("beams": request row r has beams r*k .. r*k + k-1,
all holding the cached rows), beam b holds frontier node b's ancestors at rows last + 1 ..,
and when the frontier is chosen anew each beam takes over its new node's parent's rows.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from specserve.attention.base import ForwardBatch, ForwardMode
from specserve.kv.pool import KVPool
from specserve.speculative.model_drafters.draft_chain import ChainInputs, ChainModel, ChainRow, FedSpan, fed_rows_batch


def run_tree(model: ChainModel, pool: KVPool, inputs: ChainInputs, plan: Callable[[ForwardBatch], None],
             topk: int, num_steps: int, num_nodes: int, first_features: torch.Tensor | None = None,
             host_rows: Sequence[ChainRow | FedSpan] | None = None) -> torch.Tensor:
    """(bs, 2 * (num_nodes - 1)) int64: the chosen drafts' target tokens, best first, then
    their parents as node numbers of the tree (0: the root, draft i: i + 1). inputs.slots
    hold (num_steps - 1) * topk draft-step slots per request, step after step."""
    bs, n, k = inputs.batch_size, inputs.rows_per_req, topk
    device = inputs.tokens.device
    host_prefix = [row.prefix_len for row in host_rows] if host_rows is not None else [0] * bs
    host_last = [row.prefix_len + row.num_fed - 1 for row in host_rows] if host_rows is not None else [0] * bs
    batch = fed_rows_batch(inputs, pool, host_prefix, rows_per_req=k)
    plan(batch)
    state = model.forward(batch, first_features)
    last = inputs.prefix_lens + inputs.num_fed - 1                   # (bs,) the last fed row
    scores, tokens = _top_children(model, state, k)                 # (bs, k)
    candidates = _Candidates(tokens, scores, torch.full((bs, k), -1, dtype=torch.long, device=device))
    frontier = torch.arange(k, device=device).expand(bs, k)         # candidate numbers of the frontier
    beams = inputs.req_rows.unsqueeze(1) * k + torch.arange(k, device=device)   # (bs, k) table rows
    features = state.repeat_interleave(k, dim=0)                    # (bs * k, ...) the frontier's parents' states
    for step in range(1, num_steps):
        row = (last + step).repeat_interleave(k)                    # (bs * k,)
        slots = inputs.slots[:, n + (step - 1) * k:n + step * k].reshape(-1)
        batch = ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=candidates.tokens.gather(1, frontier).reshape(-1), positions=row,
            out_slots=slots.contiguous(), req_rows=beams.reshape(-1), prefix_lens=row,
            extend_lens=torch.ones(bs * k, dtype=torch.long, device=device),
            prefix_lens_host=[r + step for r in host_last for _ in range(k)], extend_lens_host=[1] * (bs * k),
            kv_pool=pool, logits_indices=torch.arange(bs * k, device=device))
        plan(batch)
        state = model.forward(batch, features)
        pool.req_to_token[beams.reshape(-1), row] = slots.to(pool.req_to_token.dtype)   # an ancestor from now on
        child_scores, child_tokens = _top_children(model, state, k)                    # (bs * k, k)
        child_scores = child_scores.view(bs, k, k) + candidates.scores.gather(1, frontier).unsqueeze(2)
        first = candidates.count
        candidates.add(child_tokens.view(bs, k * k), child_scores.view(bs, k * k),
                       frontier.unsqueeze(2).expand(bs, k, k).reshape(bs, k * k))
        best = child_scores.view(bs, k * k).topk(k, dim=1).indices                    # (bs, k)
        parent_beam = best // k
        frontier = first + best
        features = state.view(bs, k, -1).gather(1, parent_beam.unsqueeze(2).expand(bs, k, state.shape[-1]))
        features = features.reshape(bs * k, -1)
        _inherit_ancestors(pool, beams, parent_beam, last, step)
    return candidates.best_tree(num_nodes - 1)


def _top_children(model: ChainModel, state: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, k) log-probabilities and target ids of each row's k likeliest drafts."""
    scores, ids = torch.log_softmax(model.draft_logits(state).float(), dim=-1).topk(k, dim=-1)
    return scores, ids if model.draft_vocab is None else model.draft_vocab[ids]


def _inherit_ancestors(pool: KVPool, beams: torch.Tensor, parent_beam: torch.Tensor, last: torch.Tensor,
                       step: int) -> None:
    """Beam b takes over the table rows last + 1 .. last + step of beam parent_beam[b]."""
    bs, k = beams.shape
    columns = (last.unsqueeze(1) + 1 + torch.arange(step, device=last.device)).unsqueeze(1).expand(bs, k, step)
    sources = beams.gather(1, parent_beam).unsqueeze(2).expand(bs, k, step)
    block = pool.req_to_token[sources, columns].clone()
    pool.req_to_token[beams.unsqueeze(2).expand(bs, k, step), columns] = block


class _Candidates:
    """Every node drafted so far, per request: token, cumulative score, parent candidate (-1: the root), depth."""

    def __init__(self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor):
        self.tokens, self.scores, self.parents = tokens, scores, parents
        self.depth = torch.ones_like(parents)

    @property
    def count(self) -> int:
        return self.tokens.shape[1]

    def add(self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor) -> None:
        depth = self.depth.gather(1, parents) + 1
        self.tokens = torch.cat([self.tokens, tokens], dim=1)
        self.scores = torch.cat([self.scores, scores], dim=1)
        self.parents = torch.cat([self.parents, parents], dim=1)
        self.depth = torch.cat([self.depth, depth], dim=1)

    def best_tree(self, size: int) -> torch.Tensor:
        """The `size` best candidates (score, then shallower first): tokens, then parents as tree node numbers."""
        by_depth = self.depth.sort(dim=1, stable=True).indices
        by_score = self.scores.gather(1, by_depth).sort(dim=1, descending=True, stable=True).indices
        chosen = by_depth.gather(1, by_score)[:, :size]                              # (bs, size)
        node = torch.full_like(self.tokens, -1).scatter_(
            1, chosen, torch.arange(1, size + 1, device=chosen.device).expand_as(chosen))
        parents = self.parents.gather(1, chosen)
        parent_node = torch.where(parents < 0, 0, node.gather(1, parents.clamp(min=0)).clamp(min=0))
        return torch.cat([self.tokens.gather(1, chosen), parent_node], dim=1)
