"""Where a request's time to first token goes, read off the engine's own steps.

TTFT = queue + prefill:
- queue: from arrival until the step that carries the request's first prompt chunk starts
  (the steps it waited behind: a decode step in flight, the pacer's decode turn, requests
  ahead of it in the queue);
- prefill: from that step's start to the first token, made of the steps that carry the
  request's chunks (`own`) and the steps between them that do not (`other`: decode turns
  the pacer interleaves, another request's chunk).
With prompt tokens served from the prefix cache, `own` should shrink with the uncached
tokens; if it does not, a prefill step's cost is a fixed one the cache cannot remove.

`StepTrace` listens to one engine core's step events (engine/step_events.py) and keeps a
`RequestTrace` per request id. It
also keeps every prefill step's (tokens, wall time) and fits fixed + per-token cost to
them (`prefill_cost`): where the fixed part dominates, computing fewer tokens saves little.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from specserve.engine.step_events import StepListener
from specserve.request.req import Req


@dataclass
class RequestTrace:
    arrival_s: float
    first_chunk_s: float | None = None   # start of the step that carried its first prompt chunk
    first_token_s: float | None = None
    own_steps: int = 0                   # steps that carried one of its prompt chunks
    own_s: float = 0.0                   # their wall time
    other_steps: int = 0                 # steps after its first chunk, before its first token, without its chunks
    other_s: float = 0.0
    computed_tokens: int = 0             # prompt tokens its chunks computed (those the cache lacked)

    @property
    def queue_s(self) -> float:
        return self.first_chunk_s - self.arrival_s

    @property
    def prefill_s(self) -> float:
        return self.first_token_s - self.first_chunk_s


class StepTrace(StepListener):
    """Per-request TTFT breakdown of every request an engine core runs while attached."""

    def __init__(self, core):
        self.requests: dict[str, RequestTrace] = {}
        self._open: dict[str, tuple[Req, RequestTrace]] = {}   # first chunk run, no first token yet
        self._chunks: dict[str, tuple[Req, int]] = {}          # this step's prompt chunks (request, tokens) by id
        self.prefill_steps: list[tuple[int, float]] = []          # (prompt tokens, seconds) of steps without decoding
        self._decoding = 0                                       # requests the step being scheduled decodes
        self._start = 0.0
        core.events.add(self)

    def step_began(self) -> None:
        self._chunks, self._decoding = {}, 0
        self._start = time.perf_counter()

    def step_scheduled(self, batch) -> None:
        if batch.is_extend:
            self._chunks = {req.rid: (req, length) for req, length in zip(batch.reqs, batch.extend_lens)
                            if req.first_token_time is None}   # decoding requests of a mixed step have theirs
            self._decoding = len(batch.reqs) - len(self._chunks)

    def step_ended(self) -> None:
        self._record(self._start, time.perf_counter())

    def _record(self, start: float, end: float) -> None:
        chunks, self._chunks = self._chunks, {}
        if chunks and self._decoding == 0:
            self.prefill_steps.append((sum(length for _, length in chunks.values()), end - start))
        self._decoding = 0
        for rid, (req, _) in chunks.items():
            if rid not in self.requests:
                self.requests[rid] = RequestTrace(req.arrival_time, first_chunk_s=start)
                self._open[rid] = (req, self.requests[rid])
        for rid, (req, trace) in list(self._open.items()):
            if rid in chunks:
                trace.own_steps += 1
                trace.own_s += end - start
                trace.computed_tokens += chunks[rid][1]
            else:
                trace.other_steps += 1
                trace.other_s += end - start
            if req.first_token_time is not None or req.finished:
                trace.first_token_s = req.first_token_time
                del self._open[rid]

    def summary(self, rids: list[str]) -> dict:
        """Means over the given requests (those with a first token)."""
        traces = [self.requests[rid] for rid in rids if rid in self.requests
                  and self.requests[rid].first_token_s is not None]
        if not traces:
            return {}
        mean = lambda values: statistics.mean(values)   # noqa: E731
        return {"queue_s": mean(t.queue_s for t in traces), "prefill_s": mean(t.prefill_s for t in traces),
                "own_steps": mean(t.own_steps for t in traces), "own_s": mean(t.own_s for t in traces),
                "own_step_s": sum(t.own_s for t in traces) / max(sum(t.own_steps for t in traces), 1),
                "other_steps": mean(t.other_steps for t in traces), "other_s": mean(t.other_s for t in traces),
                "computed_tokens": mean(t.computed_tokens for t in traces)}


def format_breakdown(summary: dict) -> str:
    """One line: queue + prefill (own steps x their mean wall + other steps)."""
    if not summary:
        return "no trace"
    return (f"queue {1000 * summary['queue_s']:7.1f} ms + prefill {1000 * summary['prefill_s']:7.1f} ms "
            f"(own {summary['own_steps']:.1f} steps x {1000 * summary['own_step_s']:6.1f} ms, "
            f"other {summary['other_steps']:.1f} steps {1000 * summary['other_s']:6.1f} ms; "
            f"{summary['computed_tokens']:.0f} tokens computed)")


def fit_prefill_cost(steps: list[tuple[int, float]]) -> dict:
    """Least squares seconds = fixed + per_token * tokens over prefill steps; {} with fewer
    than two distinct sizes."""
    if len({tokens for tokens, _ in steps}) < 2:
        return {}
    mean_c = sum(c for c, _ in steps) / len(steps)
    mean_t = sum(t for _, t in steps) / len(steps)
    slope = (sum((c - mean_c) * (t - mean_t) for c, t in steps) / sum((c - mean_c) ** 2 for c, _ in steps))
    return {"steps": len(steps), "fixed_s": mean_t - slope * mean_c, "per_token_s": slope,
            "mean_tokens": mean_c, "mean_s": mean_t}


def format_prefill_cost(fit: dict) -> str:
    if not fit:
        return "prefill steps: too few sizes to fit"
    return (f"prefill steps ({fit['steps']}): {1000 * fit['fixed_s']:.1f} ms fixed + "
            f"{1e6 * fit['per_token_s']:.1f} us per token (mean {fit['mean_tokens']:.0f} tokens, "
            f"{1000 * fit['mean_s']:.1f} ms)")
