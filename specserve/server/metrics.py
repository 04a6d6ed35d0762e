"""Server-side metrics: per-request timing measured in the HTTP layer from chunk arrival
times, totals kept as plain counters, and engine load read at scrape time.

Everything here runs on the event loop; the engine's load (queue lengths, free KV slots, the
speculative counters its steps keep) is only read, never locked (`engine.load()`), so a scrape
cannot slow the step loop. The speculative counters count every step as it commits, so they
move while long requests run; they follow vLLM's names (`spec_decode_num_draft_tokens`, ...),
from which the acceptance rate is accepted / draft tokens.
"""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "specserve:"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


# the engine's speculative counters (engine.load()) -> (metric name, help)
SPEC_COUNTERS = {
    "spec_verify_steps": ("spec_verify_steps", "Decode steps of requests of a speculative engine, each request's "
                                               "counted (plain steps included)."),
    "spec_accepted_tokens": ("spec_accepted_tokens", "Tokens those steps committed, bonus tokens included."),
    "spec_drafts": ("spec_decode_num_drafts", "Request steps that verified a draft."),
    "spec_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
    "spec_accepted_draft_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted (bonus tokens not "
                                                                      "included): acceptance rate = this / drafted."),
}


class ServerMetrics:
    def __init__(self, load: Callable[[], dict], model_name: str):
        self.load = load                # the engine's load, as the server reports it
        self.model_name = model_name
        self.requests_by_reason: dict[str, int] = {}
        self.prompt_tokens = 0
        self.cached_tokens = 0          # prompt tokens served from the prefix cache
        self.generation_tokens = 0
        self.preemptions = 0
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between output tokens.", labels,
                             buckets=_ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency.", labels,
                             buckets=_E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.registry.register(_TotalsCollector(self))

    def track(self, prompt_tokens: int) -> "RequestTimer":
        return RequestTimer(self, prompt_tokens)

    def count_failure(self, reason: str = "error") -> None:
        self.requests_by_reason[reason] = self.requests_by_reason.get(reason, 0) + 1

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """One request's timing: TTFT at its first chunk, inter-token latency per later token
    (a chunk of k tokens, e.g. an accepted draft, spreads its gap over the k tokens)."""

    __slots__ = ("metrics", "prompt_tokens", "start", "last", "tokens", "done")

    def __init__(self, metrics: ServerMetrics, prompt_tokens: int):
        self.metrics = metrics
        self.prompt_tokens = prompt_tokens
        self.start = self.last = time.perf_counter()
        self.tokens = 0
        self.done = False

    def on_chunk(self, num_new_tokens: int) -> None:
        if num_new_tokens <= 0:
            return
        now = time.perf_counter()
        self.metrics.generation_tokens += num_new_tokens
        if self.tokens == 0:
            self.metrics.ttft.observe(now - self.start)
        else:
            gap = (now - self.last) / num_new_tokens
            for _ in range(num_new_tokens):
                self.metrics.itl.observe(gap)
        self.tokens += num_new_tokens
        self.last = now

    def finish(self, meta: dict) -> None:
        """At the last output; `meta` is the engine's meta_info."""
        if self.done:
            return
        self.done = True
        metrics = self.metrics
        metrics.prompt_tokens += self.prompt_tokens
        metrics.cached_tokens += meta.get("cached_tokens", 0)
        metrics.generation_tokens += max(0, meta.get("completion_tokens", 0) - self.tokens)
        reason = (meta.get("finish_reason") or {}).get("type", "unknown")
        metrics.requests_by_reason[reason] = metrics.requests_by_reason.get(reason, 0) + 1
        metrics.e2e.observe(time.perf_counter() - self.start)
        metrics.preemptions += meta.get("preemptions", 0)

    def discard(self) -> None:
        """The engine refused the request: it never ran, so it counts nowhere."""
        self.done = True

    def fail(self, reason: str = "error") -> None:
        if not self.done:
            self.done = True
            self.metrics.prompt_tokens += self.prompt_tokens
            self.metrics.count_failure(reason)


class _TotalsCollector:
    """Counters and gauges computed at scrape time from plain totals and the engine's state."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        m, labels = self.metrics, [self.metrics.model_name]
        requests = CounterMetricFamily(PREFIX + "num_requests", "Finished requests by finish reason.",
                                       labels=["model_name", "finish_reason"])
        for reason, count in sorted(m.requests_by_reason.items()):
            requests.add_metric(labels + [reason], count)
        yield requests
        load = m.load()
        for name, help_text, value in (
                ("prompt_tokens", "Prompt tokens processed.", m.prompt_tokens),
                ("cached_tokens", "Prompt tokens served from the prefix cache.", m.cached_tokens),
                ("generation_tokens", "Output tokens generated.", m.generation_tokens),
                ("num_preemptions", "Preemptions of finished requests (cache dropped, recomputed later).",
                 m.preemptions),
                *((name, help_text, load.get(key, 0)) for key, (name, help_text) in SPEC_COUNTERS.items())):
            counter = CounterMetricFamily(PREFIX + name, help_text, labels=["model_name"])
            counter.add_metric(labels, value)
            yield counter
        for name, help_text, value in (
                ("num_running_reqs", "Requests running in the engine.", load["num_running"]),
                ("num_queue_reqs", "Requests waiting in the engine's queue.", load["num_waiting"]),
                ("token_usage", "Fraction of KV cache slots held by running requests.", load["kv_usage"]),
                ("kv_free_slots", "Free KV cache slots (cached prefixes no request holds included).",
                 load["kv_free_slots"]),
                ("kv_cached_slots", "KV cache slots held by the prefix cache.", load["kv_cached_slots"]),
                ("cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens.", m.cache_hit_rate),
                ("spec_accept_length", "Mean tokens committed per decode step of a speculative engine.",
                 spec_accept_length(load)),
                ("spec_accept_rate", "Accepted / drafted tokens.", spec_accept_rate(load))):
            gauge = GaugeMetricFamily(PREFIX + name, help_text, labels=["model_name"])
            gauge.add_metric(labels, value)
            yield gauge


def spec_accept_length(load: dict) -> float:
    steps = load.get("spec_verify_steps", 0)
    return load.get("spec_accepted_tokens", 0) / steps if steps else 0.0


def spec_accept_rate(load: dict) -> float:
    drafted = load.get("spec_draft_tokens", 0)
    return load.get("spec_accepted_draft_tokens", 0) / drafted if drafted else 0.0
