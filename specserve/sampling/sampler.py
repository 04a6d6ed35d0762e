"""Sampler: logits of every draft-tree node -> the tokens each request commits this step.

Plain decoding is the root-only case. Order of logit processing, per node: penalties
(counting the node's draft ancestors), min_new_tokens (stop tokens masked while too few
tokens exist), then temperature / top-k / top-p / min-p inside verification. Everything
runs on the device; the only host sync is one copy of the results at the end.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.grammar.apply import apply_grammar_bitmask
from specserve.grammar.tree_masks import grammar_bitmask
from specserve.request.req import Req
from specserve.sampling.columns import SamplingColumns
from specserve.sampling.plain_graphs import PlainSamplingGraphs
from specserve.verify.rules import (SAMPLING_RULES, apply_penalties_to_tree, plain_step_tokens, verify_greedy,
                                    verify_sampling)
from specserve.verify.tree import DraftTrees


@dataclass
class SampledStep:
    tokens: list[list[int]]                 # per request: committed tokens (accepted drafts, then the bonus)
    accepted_nodes: list[list[int]]         # per request: accepted node indices, root first
    logprobs: list[list[float]] | None      # per request, per committed token (raw model logprobs)
    top_logprobs: list[list[list[tuple[int, float]]]] | None

    @classmethod
    def plain(cls, tokens: list[int]) -> "SampledStep":
        """A decode step without drafts or logprobs: one token per request, from the root."""
        return cls(tokens=[[t] for t in tokens], accepted_nodes=[[0]] * len(tokens), logprobs=None, top_logprobs=None)


@dataclass
class PreparedSampling:
    penalties: tuple | None                              # apply_penalties_to_tree's tensors
    early_stops: tuple[torch.Tensor, torch.Tensor] | None
    sampling: dict | None                                # verify_sampling's tensors; None = all greedy
    device_trees: DraftTrees | None                      # None: plain greedy decode, no tree needed


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, sampling_rule: str = "coupled"):
        if sampling_rule not in SAMPLING_RULES:
            raise ValueError(f"sampling_rule must be one of {SAMPLING_RULES}, got {sampling_rule!r}")
        self.vocab_size = vocab_size
        self.device = device
        # how sampled drafts are verified (verify_sampling's rule): "coupled" gives a seeded
        # request the same tokens as plain decoding; "rejection" is kept for comparisons
        self.sampling_rule = sampling_rule
        self.plain_graphs: PlainSamplingGraphs | None = None   # sampled plain steps over decode graphs' logits

    def graph_plain_steps(self, static_logits: list[torch.Tensor]) -> None:
        """Samples plain steps whose logits are a decode graph's (static_logits: each bucket's
        (bucket, vocab) buffer) through CUDA graphs of their own (plain_graphs.py)."""
        self.plain_graphs = PlainSamplingGraphs(static_logits, self.vocab_size)

    @staticmethod
    def argmax_is_enough(reqs: list[Req]) -> bool:
        """Whether the next decode steps of these requests need nothing but the argmax
        (greedy, no penalties, no logprobs, no min_new_tokens still holding stops back, no
        grammar: a grammar's mask applies before the argmax, so its steps take the sampler's path)."""
        return all(r.params.greedy and not r.params.has_penalties and not r.return_logprob
                   and r.params.min_new_tokens <= len(r.output_ids) and r.grammar is None for r in reqs)

    @staticmethod
    def masked_argmax_is_enough(reqs: list[Req]) -> bool:
        """Whether their plain decode steps need nothing but the argmax under each request's
        grammar mask, if any (the overlap schedule's steps: engine/overlap.py)."""
        return all(r.params.greedy and not r.params.has_penalties and not r.return_logprob
                   and r.params.min_new_tokens <= len(r.output_ids) for r in reqs)

    @staticmethod
    def samples_on_device(reqs: list[Req]) -> bool:
        """Whether their plain decode steps sample from the step's logits alone: the filters and
        a seed (no penalties, logprobs, min_new_tokens still holding stops back, or grammar), so
        that a step's tokens can root the next one on the device (sample_plain; the overlap
        schedule's sampled steps: engine/overlap.py)."""
        return all(not r.params.has_penalties and not r.return_logprob
                   and r.params.min_new_tokens <= len(r.output_ids) and r.grammar is None for r in reqs)

    def sample_plain(self, logits: torch.Tensor, reqs: list[Req], positions: list[int]) -> torch.Tensor:
        """A plain decode step's tokens (bs,), on the device, queued without a host sync (the
        tensors it needs go through pinned memory): logits (bs, vocab) at each request's last
        token, whose positions (the tokens in each KV cache) key the random numbers. The tokens
        `sample` commits for the same step: the same filters, the same rule, the same numbers.
        For requests that samples_on_device."""
        graphs = self.plain_graphs
        if graphs is not None and graphs.covers(logits):
            values = self._sampling_values(reqs, positions)
            return graphs.sample(logits, values, *self._filters_used(reqs))
        return plain_step_tokens(logits, **self._sampling_tensors(reqs, positions))

    def first_tokens(self, logits: torch.Tensor, reqs: list[Req]) -> SampledStep:
        """A prefill's first tokens (logits (bs, 1, vocab)). Where each request needs only the
        argmax under its grammar (masked_argmax_is_enough), they are that argmax, read once.
        A first token strays from its grammar more often than not (a JSON answer's opening,
        where the model would write a code fence: on an H200, 26 of 29 prefills of schema
        extraction at 64 had a request stray, each a second read of the device, ~2 ms more a
        prefill than without grammars), so grammars' masks are filled here, while the device
        still runs the prefill, and applied before the read. Otherwise the sampler's full path."""
        enough, constrained = self.masked_argmax_is_enough(reqs), any(r.grammar is not None for r in reqs)
        if enough and not constrained:
            return SampledStep.plain(logits[:, 0].argmax(-1).tolist())
        trees = DraftTrees.root_only(torch.tensor([r.last_token for r in reqs]))
        if not enough:
            return self.sample(logits, trees, reqs, self.prepare(trees, reqs))
        logits = apply_grammar_bitmask(logits, self._grammar_bitmask(trees, reqs))
        return SampledStep.plain(logits[:, 0].argmax(-1).tolist())

    def prepare(self, trees: DraftTrees, reqs: list[Req], draft_probs: torch.Tensor | None = None) -> "PreparedSampling":
        """Builds the per-request tensors and moves the (host) trees to the device. Called
        before the forward is launched: a host to device copy issued after it would wait
        for the forward to finish. draft_probs: (bs, n, V) on the device, the distribution
        the drafts were sampled from (TreeProposal.draft_probs), or None."""
        if trees.tokens.shape[1] == 1 and self.argmax_is_enough(reqs):
            return PreparedSampling(None, None, None, device_trees=None)
        penalties = self._penalty_tensors(reqs) if any(r.params.has_penalties for r in reqs) else None
        early_stops = self._early_stop_masks(trees, reqs)
        sampling = None if all(r.params.greedy for r in reqs) else {**self._sampling_tensors(reqs),
                                                                     **self._rule(reqs, draft_probs)}
        return PreparedSampling(penalties, early_stops, sampling, device_trees=trees.to(self.device))

    def sample(self, logits: torch.Tensor, trees: DraftTrees, reqs: list[Req],
               prepared: "PreparedSampling | None" = None) -> SampledStep:
        """logits: (bs, n, vocab) fp32, the target's logits at each tree node; trees: on the
        host (a grammar's masks are walked from them)."""
        prepared = prepared or self.prepare(trees, reqs)
        if prepared.device_trees is None:  # greedy decode without extras: the argmax is all there is
            return SampledStep.plain(logits[:, 0].argmax(-1).tolist())
        host_trees, trees = trees, prepared.device_trees
        raw_logits = logits
        if prepared.penalties is not None:
            logits = apply_penalties_to_tree(logits, trees, *prepared.penalties)
        if prepared.early_stops is not None:
            too_early, stop_mask = prepared.early_stops
            logits = logits.masked_fill(too_early.unsqueeze(-1) & stop_mask.unsqueeze(1), float("-inf"))
        if any(r.grammar is not None for r in reqs):
            logits = apply_grammar_bitmask(logits, self._grammar_bitmask(host_trees, reqs))
        result = verify_greedy(trees, logits) if prepared.sampling is None else verify_sampling(
            trees, logits, **prepared.sampling)
        # the one host sync of the step
        packed = _packed(result).cpu()
        n = trees.tokens.shape[1]
        lens = packed[:, 0].tolist()
        accepted = [row[:k] for row, k in zip(packed[:, 1:1 + n].tolist(), lens)]
        tokens = [row[:k] for row, k in zip(packed[:, 1 + n:].tolist(), lens)]
        logprobs = top = None
        if any(r.return_logprob for r in reqs):
            logprobs, top = self._logprobs(raw_logits, result, reqs, lens)
        return SampledStep(tokens=tokens, accepted_nodes=accepted, logprobs=logprobs, top_logprobs=top)

    def verify_on_device(self, logits: torch.Tensor, prepared: "PreparedSampling") -> torch.Tensor:
        """A step's verification, on the device and without a host sync, for requests that
        samples_on_device (no penalties, early stops, grammar or logprobs: nothing the host
        adds after the forward): what `sample` commits, packed as tree_step.commit_path's
        outcome (bs, 1 + 2n): accept length, accepted nodes, committed tokens."""
        trees = prepared.device_trees
        if prepared.sampling is None:
            return _packed(verify_greedy(trees, logits))
        return _packed(verify_sampling(trees, logits, **prepared.sampling))

    def _penalty_tensors(self, reqs) -> tuple:
        bs, vocab = len(reqs), self.vocab_size
        counts = torch.zeros((bs, vocab), dtype=torch.long, device=self.device)
        prompt_mask = torch.zeros((bs, vocab), dtype=torch.bool, device=self.device)
        for i, req in enumerate(reqs):
            if req.output_ids:
                ids = torch.tensor(req.output_ids, device=self.device)
                counts[i].index_add_(0, ids, torch.ones_like(ids))
            prompt_mask[i, torch.tensor(req.prompt_ids, device=self.device)] = True
        param = lambda name: torch.tensor([getattr(r.params, name) for r in reqs], dtype=torch.float32, device=self.device)
        return counts, prompt_mask, param("repetition_penalty"), param("frequency_penalty"), param("presence_penalty")

    def _early_stop_masks(self, trees, reqs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """min_new_tokens: a node whose next token would be output number < min_new_tokens
        may not pick a stop token. Returns (too_early (bs, n), stop_mask (bs, vocab))."""
        if not any(r.params.min_new_tokens > len(r.output_ids) for r in reqs):
            return None
        bs = len(reqs)
        produced = torch.tensor([len(r.output_ids) for r in reqs], device=self.device)
        minimum = torch.tensor([r.params.min_new_tokens for r in reqs], device=self.device)
        too_early = (produced.unsqueeze(1) + trees.depth.to(self.device)) < minimum.unsqueeze(1)
        stop_mask = torch.zeros((bs, self.vocab_size), dtype=torch.bool, device=self.device)
        for i, req in enumerate(reqs):
            # a grammar decides where its output may end: it allows a stop token only there
            ids = [t for t in req.stop_ids if t < self.vocab_size] if req.grammar is None else []
            if ids:
                stop_mask[i, ids] = True
        return too_early, stop_mask

    def _grammar_bitmask(self, trees: DraftTrees, reqs: list[Req]) -> torch.Tensor:
        """The grammar's mask of every node (grammar/tree_masks.py), walked on the host once
        the forward is launched (the matchers' work overlaps the device's: `trees` are the
        host's, so nothing waits for the forward) and sent from pinned memory."""
        host = lambda t: t.numpy()
        pinned = torch.device(self.device).type == "cuda"
        mask = grammar_bitmask(reqs, host(trees.tokens), host(trees.parents), host(trees.num_nodes), self.vocab_size,
                               pinned=pinned)
        return mask.to(self.device, non_blocking=True)

    def _sampling_values(self, reqs: list[Req], positions: list[int] | None = None) -> dict[str, list]:
        """verify_sampling's per-request columns, on the host. positions: the roots' (default:
        each request's last token's); random numbers are keyed by position."""
        return {
            "temperatures": [0.0 if r.params.greedy else r.params.temperature for r in reqs],
            "top_ks": [r.params.top_k if r.params.top_k > 0 else self.vocab_size for r in reqs],
            "top_ps": [r.params.top_p for r in reqs],
            "min_ps": [r.params.min_p for r in reqs],
            "seeds": [r.seed for r in reqs],
            "positions": positions if positions is not None else [r.num_tokens - 1 for r in reqs],
        }

    @staticmethod
    def _filters_used(reqs: list[Req]) -> tuple[bool, bool]:
        """(need_top_k_top_p, need_min_p): the full-vocabulary sort of top-k / top-p is the
        costly part, skipped when no request uses it."""
        return any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in reqs), any(r.params.min_p > 0 for r in reqs)

    def _sampling_tensors(self, reqs: list[Req], positions: list[int] | None = None) -> dict:
        """The filters' and the race's arguments (a verify step adds its rule: `_rule`).
        positions: the roots' (default: each request's last token's)."""
        pinned = torch.device(self.device).type == "cuda"
        # one copy, through pinned memory: a pageable copy may wait for a step in flight
        host = SamplingColumns.allocate(len(reqs), "cpu", pin=pinned)
        host.fill(self._sampling_values(reqs, positions))
        columns = host.to(self.device).columns()
        need_top_k_top_p, need_min_p = self._filters_used(reqs)
        top_ks = [r.params.top_k for r in reqs if not r.params.greedy]   # greedy rows ignore the filters
        return {
            **columns,
            "need_top_k_top_p": need_top_k_top_p,
            "need_min_p": need_min_p,
            # when every sampled row has a top-k, rank only that many tokens instead of sorting
            "max_top_k": max(top_ks) if top_ks and all(0 < k < self.vocab_size for k in top_ks) else None,
        }

    def _rule(self, reqs: list[Req], draft_probs: torch.Tensor | None) -> dict:
        """Sampled drafts (with their q) are verified by residual rejection, which accepts them
        with min(1, p/q), unless a request set a seed: the coupled rule then gives it plain
        decoding's tokens (it stays exact for sampled drafts, it only accepts them less)."""
        seeded = any(r.params.seed is not None for r in reqs)
        if draft_probs is not None and (self.sampling_rule == "rejection" or not seeded):
            return {"rule": "rejection", "draft_probs": draft_probs}
        return {"rule": self.sampling_rule}

    def _logprobs(self, raw_logits, result, reqs, lens):
        """Logprobs of the committed tokens under the raw target distribution at their parent node."""
        bs, n = result.accepted_nodes.shape
        parent_nodes = result.accepted_nodes.clamp(min=0)                      # (bs, n)
        node_logits = torch.gather(raw_logits, 1, parent_nodes.unsqueeze(-1).expand(-1, -1, raw_logits.shape[-1]))
        logprobs = torch.log_softmax(node_logits, dim=-1)                      # (bs, n, vocab)
        chosen = torch.gather(logprobs, 2, result.committed_tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        k = max(r.top_logprobs_num for r in reqs)
        chosen_host = chosen.cpu().tolist()
        values = [row[:m] for row, m in zip(chosen_host, lens)]
        if k <= 0:
            return values, None
        top_values, top_ids = logprobs.topk(k, dim=-1)
        top_values, top_ids = top_values.cpu().tolist(), top_ids.cpu().tolist()
        top = [[list(zip(top_ids[b][j][:reqs[b].top_logprobs_num], top_values[b][j][:reqs[b].top_logprobs_num]))
                for j in range(lens[b])] for b in range(bs)]
        return values, top


def _packed(result) -> torch.Tensor:
    """A VerifyResult as one (bs, 1 + 2n) tensor: accept lengths, accepted nodes, committed tokens."""
    return torch.cat([result.accept_lens.unsqueeze(1), result.accepted_nodes, result.committed_tokens], 1)
