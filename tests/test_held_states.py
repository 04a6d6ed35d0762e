"""HeldTargetStates: plain steps' states kept whole in a journal read back exactly as if
each request's row had been appended on its own, whatever came between (requests joining
and ending, verify steps replacing rows, feeds, preemption and resumption)."""
from __future__ import annotations

import random

import torch

from specserve.speculative.model_drafters.held_states import HeldTargetStates

FEATURES = 3


def row_states(generator: torch.Generator, count: int) -> torch.Tensor:
    return torch.randn(count, FEATURES, generator=generator)


class Twins:
    """The same history handed to two stores: plain steps journaled in one, appended per request in the other."""

    def __init__(self):
        self.journaled, self.direct = HeldTargetStates(), HeldTargetStates()

    def plain_step(self, rids: list[str], starts: list[int], states: torch.Tensor) -> None:
        self.journaled.append_plain_step(list(rids), list(starts), states)
        for i, (rid, start) in enumerate(zip(rids, starts)):
            self.direct.append(rid, start, states[i:i + 1])

    def __getattr__(self, name):   # append, drop_before, release: to both
        return lambda *args: (getattr(self.journaled, name)(*args), getattr(self.direct, name)(*args))[1]

    def check(self, rids: list[str], lengths: dict[str, int]) -> None:
        assert self.journaled.held_rows == self.direct.held_rows
        for rid in rids:
            assert self.journaled.count(rid) == self.direct.count(rid)
            for start in (0, max(lengths[rid] - 5, 0)):
                a, b = self.journaled.rows(rid, start, lengths[rid]), self.direct.rows(rid, start, lengths[rid])
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
        assert self.journaled.held_rows == self.direct.held_rows


def test_journaled_plain_steps_read_back_as_appended_rows():
    rng, generator = random.Random(0), torch.Generator().manual_seed(0)
    twins, lengths, running, next_id = Twins(), {}, [], 0
    for step in range(400):
        if len(running) < 6 and rng.random() < 0.3:                 # a prefill
            rid, next_id = f"r{next_id}", next_id + 1
            lengths[rid] = rng.randrange(1, 20)
            twins.append(rid, 0, row_states(generator, lengths[rid]))
            running.append(rid)
        if running and rng.random() < 0.05:                           # a request ends
            twins.release(running.pop(rng.randrange(len(running))))
        if running and rng.random() < 0.03:                           # preempted, then its prefill again
            rid = rng.choice(running)
            twins.release(rid)
            twins.append(rid, 0, row_states(generator, lengths[rid]))
        if not running:
            continue
        kind = rng.random()
        if kind < 0.1:                                                # a verify step: accepted rows, some replaced
            rid = rng.choice(running)
            accepted = rng.randrange(1, 4)
            twins.append(rid, lengths[rid] - 1, row_states(generator, accepted))
            lengths[rid] += accepted - 1
        elif kind < 0.15:                                             # a feed or a chain: rows read, the last kept
            rid = rng.choice(running)
            if twins.direct.count(rid):
                twins.rows(rid, lengths[rid] - 1, lengths[rid])
                twins.drop_before(rid, lengths[rid] - 1)
        else:                                                          # a plain step of the running requests
            order = rng.sample(running, len(running))
            twins.plain_step(order, [lengths[rid] for rid in order], row_states(generator, len(order)))
            for rid in order:
                lengths[rid] += 1
        if step % 7 == 0:
            twins.check(running, lengths)
    twins.check(running, lengths)
    for rid in running:
        twins.release(rid)
    assert twins.journaled.held_rows == 0 and not twins.journaled._journal and not twins.journaled._states


def test_a_plain_step_splits_nothing_until_read():
    store = HeldTargetStates()
    store.append("a", 0, torch.zeros(4, FEATURES))
    for position in range(4, 10):
        store.append_plain_step(["a", "b"], [position, position + 10], torch.full((2, FEATURES), float(position)))
    assert store.held_rows == 4 + 12 and len(store._journal) == 6 and store._states["a"].count == 4
    assert store.count("b") == 6 and not store._journal               # read: split at once, for every request
    assert store.rows("a", 3, 10)[1:, 0].tolist() == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    assert store.rows("b", 14, 20)[:, 0].tolist() == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
