"""Req (one request's whole state) and Batch (the requests of one step).

The KV invariant of a running request: the cache holds every token but the last one
(`kv_len == len(all_ids) - 1`); the next forward feeds the last token (and, when
speculating, the draft tree rooted at it).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from specserve.request.detokenizer import IncrementalDetokenizer
from specserve.request.forecast_record import ForecastRecord
from specserve.request.sampling_params import SamplingParams


class ReqState(enum.Enum):
    WAITING = "waiting"      # queued, or preempted and waiting to recompute its cache
    RUNNING = "running"      # has a req_to_token row and (part of) its cache
    FINISHED = "finished"


class SpecStats:
    """A request's verify steps: how many, the tokens they committed (bonus included) and how
    many steps committed each count. Plain steps, where every request commits one token, are
    most steps and are not recorded one by one (at 64 requests a loop over the batch every
    step cost ~20-30 us of host time): every token of the request's output that no recorded
    step committed was a plain step's, but the first, which its prefill committed (a
    preempted request's prefill recomputes the cache and commits nothing). Drafting steps
    are recorded (`record_step`). A drafter with several sources of drafts counts here the
    proposals each made for the request (`draft_sources`: source -> proposals)."""

    __slots__ = ("_output", "_steps", "_tokens", "_histogram", "_plain", "_accounted", "draft_sources")

    def __init__(self, output: list[int]):
        self._output = output            # the request's output_ids (the same list, as it grows)
        self._steps = self._tokens = 0   # recorded steps and what they committed
        self._histogram: dict[int, int] = {}
        self._plain = 0                  # plain steps before the last recorded step
        # output tokens counted by then: the prefill's first, and each recorded step's (cut or not)
        self._accounted = 1
        self.draft_sources: dict[str, int] = {}

    @staticmethod
    def record_step(reqs: list["Req"], tokens: list[list[int]]) -> None:
        """One verify step of a batch, before its commit: request i committed tokens[i] (a
        stop may cut them short: the counts keep what the step accepted). One call per step,
        not a method call per request."""
        for req, committed in zip(reqs, tokens):
            stats, count = req.spec, len(committed)
            stats._settle_plain()
            stats._steps += 1
            stats._tokens += count
            stats._accounted += count
            histogram = stats._histogram
            histogram[count] = histogram.get(count, 0) + 1

    def _settle_plain(self) -> None:
        self._plain += self._unaccounted()
        self._accounted = len(self._output)

    def _unaccounted(self) -> int:
        """Plain steps since the last recorded step (none after a step a stop cut)."""
        return max(0, len(self._output) - self._accounted)

    @property
    def verify_steps(self) -> int:
        return self._steps + self._plain + self._unaccounted()

    @property
    def accepted_tokens(self) -> int:
        """Committed tokens, bonus included (a step a stop cut counts what it accepted)."""
        return self._tokens + self._plain + self._unaccounted()

    @property
    def accept_length_histogram(self) -> dict[int, int]:
        histogram = dict(self._histogram)
        plain = self._plain + self._unaccounted()
        if plain:
            histogram[1] = histogram.get(1, 0) + plain
        return histogram

    @property
    def accept_length(self) -> float:
        steps = self.verify_steps
        return self.accepted_tokens / steps if steps else 0.0


@dataclass
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    seed: int                                  # params.seed, or drawn at arrival: keys the random numbers
    stop_ids: frozenset[int]                   # eos (unless ignore_eos) and stop_token_ids
    max_new_tokens: int                        # params.max_new_tokens capped by the context length and KV cache
    # why max_new_tokens is below what was asked, when the KV cache capped it (the finish reason says so)
    length_cap_message: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # structured output, advanced with every committed token: a grammar.matcher.RequestGrammar
    # (the fields of other floors' types are untyped here: every floor imports this one)
    grammar: Any = None
    arrival_time: float = field(default_factory=time.perf_counter)
    # filled by the scheduler
    state: ReqState = ReqState.WAITING
    output_ids: list[int] = field(default_factory=list)
    row: int | None = None                     # row of req_to_token while RUNNING
    kv_slots: list[int] = field(default_factory=list)   # slots of cached tokens, by position
    cached_len: int = 0                        # leading kv_slots held by the prefix cache (kv/ledger.py)
    cache_node: Any = None                     # the prefix cache's node whose lock keeps them (kv.radix_cache.TreeNode)
    cached_tokens: int = 0                     # prompt tokens served from the prefix cache at admission
    preemptions: int = 0
    forecast: ForecastRecord = field(default_factory=ForecastRecord)   # NGRAM forecast steps' hits
    # filled at commit
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: dict | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    spec: SpecStats = field(init=False)   # reads output_ids (__post_init__)

    def __post_init__(self):
        self.spec = SpecStats(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        """The newest token (a decode step's input; a draft tree's root)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def kv_len(self) -> int:
        return len(self.kv_slots)

    @property
    def prefill_target(self) -> int:
        """How far the cache must be filled before decoding: the whole prompt for a new request
        (its last logits give the first token), all but the last token for a resumed one."""
        return self.num_tokens - 1 if self.output_ids else self.num_tokens

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED


@dataclass
class Batch:
    """The requests of one step. EXTEND: `extend_lens[i]` prompt tokens of reqs[i] from its
    kv_len on; `samples[i]` says whether the chunk ends the prompt (its logits give the first
    token). DECODE/VERIFY: one draft tree per request (root only without speculation)."""

    reqs: list[Req]
    is_extend: bool
    extend_lens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.reqs)


def same_requests(a: list[Req], b: list[Req]) -> bool:
    """Whether two batches are the very same requests in the same order (a step launched
    ahead for one batch serves only that batch)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
