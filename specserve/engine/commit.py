"""Committing a step's outcome: the KV slots of each request's accepted nodes, the end
checks of its committed tokens, and their text.

The host work of a decode step that does not have to happen before the next step is
launched waits for it: detokenizing (two tokenizer calls per token, ~3 ms per drafting step
at 64 requests of 5-6 tokens each on a CPU; ~0.2-0.3 ms per plain step at 64 on an H200's
host) runs while the GPU computes the next step (`DeferredText`), for drafting steps and
for plain steps on the overlap schedule alike. A request's text is then one step behind its tokens while it runs;
a request that finishes, or is aborted, has all of it. Only requests without stop strings
defer: a stop string is found in the text, and where a request ends must not change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve.engine.scheduler import Scheduler
from specserve.request.req import Req
from specserve.sampling.sampler import SampledStep

if TYPE_CHECKING:
    from specserve.engine.step_output import StepOutput


@dataclass
class StepOutcome:
    """What a verify step decided, as the commit reads it (the sampler's SampledStep with
    the accepted nodes as an array: the KV commit is a few array operations, not a loop)."""
    tokens: list[list[int]]            # per request: committed tokens, accepted drafts then the bonus
    accepted: np.ndarray               # (bs, n) accepted node indices in path order, -1 after
    accept_lens: np.ndarray            # (bs,) accepted nodes, root included = committed tokens
    table_written: bool                # the device wrote the accepted slots into req_to_token (any decode step does)
    hidden: torch.Tensor | None = None   # (bs, n, features) when the runner keeps them
    logprobs: list[list[float]] | None = None                     # as SampledStep's
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None

    @classmethod
    def from_sampled(cls, sampled: SampledStep, n: int, table_written: bool,
                     hidden: torch.Tensor | None = None) -> StepOutcome:
        """From the sampler's per-request lists (the sampling path, fused drafters)."""
        accepted = np.full((len(sampled.accepted_nodes), n), -1, dtype=np.int64)
        for row, nodes in enumerate(sampled.accepted_nodes):
            accepted[row, :len(nodes)] = nodes
        lens = np.array([len(nodes) for nodes in sampled.accepted_nodes], dtype=np.int64)
        return cls(sampled.tokens, accepted, lens, table_written, hidden, sampled.logprobs, sampled.top_logprobs)

    def hidden_rows(self, n: int) -> list[list[int]]:
        """Per request: the rows of its accepted nodes in `hidden` flattened to (bs * n,
        features), n the proposal's width (a graph's outcome may be wider)."""
        return [[i * n + node for node in row[:k]]
                for i, (row, k) in enumerate(zip(self.accepted.tolist(), self.accept_lens.tolist()))]


def unfinished(outputs: list["StepOutput"]) -> tuple[list[Req], list[list[int]]]:
    """The requests a step left running and what each committed in it (what the drafter and
    the policy are shown: a finished request's state is gone already)."""
    live = [out for out in outputs if not out.finished]
    return [out.req for out in live], [out.new_token_ids for out in live]


def commit_accepted_kv(scheduler: Scheduler, reqs: list[Req], outcome: StepOutcome, node_slots: np.ndarray,
                       num_nodes: np.ndarray) -> None:
    """Each request keeps the KV slots of its accepted nodes (in path order); the other
    real nodes' slots go back to the allocator. node_slots: (bs, n) the step's slots
    (padding nodes: anything); the outcome's paths may be wider (a CUDA graph's tier). Runs before the token commits, which may finish a request
    and release its slots."""
    kept, rejected = split_slots(outcome, node_slots, num_nodes)
    if rejected:
        scheduler.free_slots(rejected)
    scheduler.append_kv(reqs, kept, write_table=not outcome.table_written)


def split_slots(outcome: StepOutcome, node_slots: np.ndarray,
                num_nodes: np.ndarray) -> tuple[list[list[int]], list[int]]:
    """(each request's kept slots in path order, the rejected real nodes' slots), in a few
    array operations whatever the batch size."""
    bs, n = node_slots.shape
    # a graph's outcome is as wide as its tier, which may exceed the proposal (padding: -1)
    paths = outcome.accepted[:, :n]
    rows, nodes = np.arange(bs)[:, None], np.maximum(paths, 0)   # -1 -> the root: accepted anyway
    kept = node_slots[rows, nodes]
    accepted = np.zeros((bs, n), dtype=bool)
    accepted[rows, nodes] = True
    rejected = node_slots[(np.arange(n) < num_nodes[:, None]) & ~accepted]
    return [row[:k] for row, k in zip(kept.tolist(), outcome.accept_lens.tolist())], rejected.tolist()


class DeferredText:
    """Committed tokens whose detokenizing waits for the next step's GPU time (see the
    module docstring). Tokens of a request go to its detokenizer in commit order."""

    def __init__(self):
        self._pending: dict[str, tuple[Req, list[int]]] = {}

    def defer(self, req: Req, tokens: list[int]) -> None:
        entry = self._pending.get(req.rid)
        if entry is None:
            self._pending[req.rid] = (req, list(tokens))
        else:
            entry[1].extend(tokens)

    def run(self) -> None:
        """Detokenizes everything deferred."""
        pending, self._pending = self._pending, {}
        for req, tokens in pending.values():
            req.detokenizer.add_many(tokens)

    def drain(self, req: Req) -> None:
        """The request's deferred tokens now (before it finishes, or its text is read)."""
        entry = self._pending.pop(req.rid, None)
        if entry is not None:
            req.detokenizer.add_many(entry[1])


def can_defer_text(req: Req) -> bool:
    """Only a request without stop strings: its end never depends on its text."""
    return not req.params.stop


def ends_within(req: Req, tokens: list[int]) -> bool:
    """Whether committing `tokens` may end the request (a stop token, or its length);
    stop strings are not checked (see can_defer_text)."""
    return len(req.output_ids) + len(tokens) >= req.max_new_tokens or not req.stop_ids.isdisjoint(tokens)


def finish_reason(req: Req, token: int, text: DeferredText | None) -> dict | None:
    """Whether `token`, just appended to the request's output, ends it. text: where its
    detokenizing is deferred to (None: detokenized now)."""
    if token in req.stop_ids and len(req.output_ids) > req.params.min_new_tokens:
        if text is not None:
            text.drain(req)
        # as in SGLang and vLLM, the matched stop token's text is trimmed unless no_stop_trim
        if req.params.no_stop_trim:
            req.detokenizer.add(token)
        return {"type": "stop", "matched": token}
    if text is not None:
        text.defer(req, [token])
    else:
        stop_string = req.detokenizer.add(token)
        if stop_string is not None:
            return {"type": "stop", "matched": stop_string}
    if len(req.output_ids) >= req.max_new_tokens:
        if req.length_cap_message is not None:
            return {"type": "length", "length": len(req.output_ids), "message": req.length_cap_message}
        return {"type": "length", "length": len(req.output_ids)}
    return None
