"""Workloads of fixed sizes, for comparing engines at model sizes served with random weights
(`--load-format dummy`), where the text means nothing and only the lengths do:

  random-N    N-token prompts, the run's output length, at every concurrency: decode throughput
              (output tok/s) at that input length
  prefill-N   one N-token prompt at a time, one token out: time to first token; the cell's
              tok_s is prefill throughput (prompt tokens per second of time to first token)
  context-N   N-token prompts at every concurrency, the run's output length or N/16 tokens if
              more: decode speed with that much context; the cell's tok_s is the decode rate of a
              full batch (concurrency over the median gap between two tokens of a request while
              every request of the wave is decoding), the prefill left out

N is a token count, or thousands with k (2k = 2048); a prompt of 32k is cut to leave room
for its output (and 64 tokens) in a 32768-token context. The prompts are random token ids below the
tokenizer's base vocabulary (no special tokens), the same for every engine (a fixed seed).
"""
from __future__ import annotations

import random
import re
import statistics
from dataclasses import dataclass

_NAME = re.compile(r"^(random|prefill|context)-(\d+)(k?)$")
# ids below this are left out: byte and control tokens of some vocabularies
_FIRST_ID = 100
# a long prompt leaves this much more than its output free: engines differ on whether prompt and
# output may fill the context exactly
_CONTEXT_MARGIN = 64
# a context-N request gives at least N/16 tokens: a wave of 8 N-token prompts takes ~8N / 20k
# seconds to prefill on an H200 at 7B, and its first request, decoding ~100 tokens a second meanwhile,
# must not end before the last one starts, or no stretch of the wave decodes as a full batch
_CONTEXT_OUTPUT_DIVISOR = 16


@dataclass(frozen=True)
class SizeWorkload:
    name: str
    kind: str
    prompt_len: int
    output_len: int   # tokens each request generates

    def context_needed(self) -> int:
        """Tokens a request of this workload holds in an engine, prompt, output and margin."""
        return self.prompt_len + self.output_len + _CONTEXT_MARGIN

    def concurrencies(self, concurrencies: list[int]) -> list[int]:
        return [1] if self.kind == "prefill" else concurrencies

    def prompts(self, count: int, vocab_size: int, seed: int) -> list[list[int]]:
        rng = random.Random(f"{self.name}-{seed}")
        return [[rng.randrange(_FIRST_ID, vocab_size) for _ in range(self.prompt_len)] for _ in range(count)]

    def rate(self, latency_ms: float, full_batch_tok_s: float | None) -> float | None:
        """What the cell's tok_s says for this kind (None: the output throughput as measured).
        prefill: latency_ms is the mean of one-token requests, which is their time to first token
        (a whole-request latency, not the first streamed text: random weights often answer with
        tokens whose text is empty). context: the decode rate while every request of the wave was
        decoding (full_batch_rate)."""
        if self.kind == "prefill":
            return self.prompt_len * 1000 / latency_ms if latency_ms > 0 else None
        if self.kind == "context":
            return full_batch_tok_s
        return None


def full_batch_gaps(arrivals: list[list[float]], concurrency: int) -> list[float]:
    """The gaps between a request's consecutive tokens (arrival times, one list per request) that
    ended while `concurrency` requests were decoding: past their first token, not past their last.
    A wave's requests reach their first tokens one prefill after another; the gaps before the last
    of them, and after the first request ends, are not a full batch's decode."""
    spans = [(times[0], times[-1]) for times in arrivals if times]
    gaps = []
    for times in arrivals:
        for before, at in zip(times, times[1:]):
            if sum(first <= at <= last for first, last in spans) >= concurrency:
                gaps.append(at - before)
    return gaps


def full_batch_rate(gaps_ms: list[float], concurrency: int) -> float | None:
    """Tokens per second of `concurrency` requests decoding with these gaps (the median's)."""
    return concurrency * 1000 / statistics.median(gaps_ms) if gaps_ms else None


def parse(name: str, output_len: int, context_length: int = 32768) -> SizeWorkload | None:
    """The size workload a name says (None for any other name) for a run of `output_len` tokens
    out; the prompt is cut to leave room for the workload's output within `context_length`."""
    match = _NAME.match(name)
    if match is None:
        return None
    kind, count, thousands = match.groups()
    length = int(count) * (1024 if thousands else 1)
    if length <= 0:
        raise ValueError(f"workload {name}: the prompt length must be positive")
    if kind == "prefill":
        output_len = 1
    elif kind == "context":   # long enough that a wave's first request still decodes when its last starts
        output_len = max(output_len, length // _CONTEXT_OUTPUT_DIVISOR)
    room = context_length - output_len - _CONTEXT_MARGIN
    if room <= 0:
        raise ValueError(f"workload {name}: a context of {context_length} tokens leaves no room for the output")
    return SizeWorkload(name, kind, min(length, room), output_len)
