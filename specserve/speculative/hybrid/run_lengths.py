"""RunLengths: how many steps in a row the fused hybrid's requests draft from one source, a
moving average over the engine's runs of each source, so that a switch's one-off cost is
spread over the run it starts (step_prices.py).

A switch costs once per run, not once per step: the head's first step after trie steps
restarts its chain (a catch-up forward and a read: on an H100, 1.5B, batch 1, ~5 ms where a
chained step takes ~2). Weighed against one step, that cost kept requests on the head's chain
where the trie's drafts would have paid over the run they started: on code edits at batch 1,
whose trie runs last ~10 steps, the hybrid made 4.5x plain where NGRAM alone made 6.6x, a third
of its time in detours of 3-5 head steps that committed 3.6 tokens each against the trie
steps' 12.2.

A run is counted when it ends: its request switched sources or finished (a run cut by its
request's end is shorter than the source would have kept it: counted as it was, the estimate
leans to short runs, which keeps switches dear).
"""
from __future__ import annotations

RUN_EMA = 0.25   # a few runs move it: a workload's runs differ from another's


class RunLengths:
    def __init__(self):
        self._current: dict[str, tuple[str, int]] = {}   # rid -> (source, steps so far)
        self._mean: dict[str, float] = {}                # source -> moving average of its ended runs

    def step(self, rid: str, source: str) -> None:
        """A step of request `rid` drafted from `source`."""
        current = self._current.get(rid)
        if current is not None and current[0] == source:
            self._current[rid] = (source, current[1] + 1)
            return
        if current is not None:
            self._ended(*current)
        self._current[rid] = (source, 1)

    def mean(self, source: str) -> float | None:
        """Steps a run of `source` lasts, over the engine's recent runs; None before one ended."""
        return self._mean.get(source)

    def release(self, rid: str) -> None:
        current = self._current.pop(rid, None)
        if current is not None:
            self._ended(*current)

    def _ended(self, source: str, steps: int) -> None:
        mean = self._mean.get(source)
        self._mean[source] = steps if mean is None else mean + RUN_EMA * (steps - mean)
