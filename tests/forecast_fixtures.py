"""Forecast tables and step outcomes for the tests of runner/forecast_step.py and its kernel:
no engine, no Triton (the kernel's tests run under Triton's interpreter, imported first)."""
from __future__ import annotations

import numpy as np

from specserve.runner.forecast_step import Picked, empty_table, pick, set_entry


def random_case(seed: int, bs: int, rows: int, candidates: int, n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """A forecast table for trees of `rows` nodes (most entries filled, next trees of up to n
    nodes) and an outcome of theirs in commit_path's (bs, 1 + 2m) layout, over a vocabulary
    of three tokens, so that some outcomes find their entry and some do not."""
    rng = np.random.default_rng(seed)
    table = empty_table(bs, rows, candidates, n)
    for b in range(bs):
        for j in range(rows):
            for c in range(candidates):
                if rng.random() < 0.7:
                    count = int(rng.integers(0, n))
                    parents = [int(rng.integers(0, i + 1)) for i in range(count)]   # a tree: each before its children
                    set_entry(table, b, j, c, int(rng.integers(0, 3)), rng.integers(10, 99, count).tolist(), parents,
                              int(rng.integers(0, 6)))
    accept_lens = rng.integers(1, min(m, rows) + 1, bs)
    accepted, committed = np.full((bs, m), -1), np.full((bs, m), -1)
    for b, length in enumerate(accept_lens):   # the root, then nodes of N's tree (< rows) in order
        accepted[b, :length] = [0] + sorted(rng.choice(np.arange(1, rows), length - 1, replace=False).tolist())
        committed[b, :length] = rng.integers(0, 3, length)
    return table, np.concatenate([accept_lens[:, None], accepted, committed], axis=1)


def picked_by_host(table: np.ndarray, outcome: np.ndarray, nodes: int | None = None) -> Picked:
    """What the host picks from `table` for that outcome (a step of `nodes` nodes a request)."""
    m = (outcome.shape[1] - 1) // 2
    return pick(table, outcome[:, 0], outcome[:, 1:1 + m], [row[:k].tolist() for row, k in
                                                             zip(outcome[:, 1 + m:], outcome[:, 0])], nodes)
