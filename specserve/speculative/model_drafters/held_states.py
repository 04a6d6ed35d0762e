"""The target's states an EAGLE head has not read yet, per request (EagleDrafter's).

A request's states arrive after every forward that caches its tokens: a prefill's every
token, a verify step's accepted nodes, a plain step's one token. They wait here until the
head reads them (a drafting step's catch-up, a probe's, or a feed of the batch once enough
is held), each request's as one run of positions.

Plain steps hand over one state per request every step, and the adaptive policy runs
thousands of them where drafting does not pay. Split into per-request pieces as they came,
they cost ~340 us of host time a step at 64 requests (a 2-core CPU; the 0.5B's plain step
there is host-bound, ~1.5 ms). So a plain step's states wait whole, in a journal (a list
append and a count per request, in C), and are split per request only when a request of
the journal is read: its rows are sorted by (request, step) with one gather, and each
request gets one slice.
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from specserve.kv.pool import host_to_device_async


@dataclass
class HeldStates:
    """One request's target states not fed yet, positions first .. first + count - 1, as the
    steps handed them over (appending copies nothing)."""
    first: int
    count: int
    parts: list[torch.Tensor]

    def joined(self) -> torch.Tensor:
        if len(self.parts) > 1:
            self.parts = [torch.cat(self.parts)]
        return self.parts[0]


@dataclass
class PlainStepStates:
    """A plain step's states, one row per request: rids[i] at position starts[i]."""
    rids: list[str]
    starts: list[int]
    states: torch.Tensor


class HeldTargetStates:
    """Per request, the target's states of positions first .. first + len - 1 not fed yet
    (and the last fed one, which a chain re-feeds when nothing new came)."""

    def __init__(self):
        self._states: dict[str, HeldStates] = {}
        self._journal: list[PlainStepStates] = []
        self._journaled: Counter[str] = Counter()   # rows of each request in the journal
        self._released_at: dict[str, int] = {}      # journal steps before a request's release: not its own
        self.held_rows = 0     # states held, all requests together
        self.row_bytes = 0     # bytes of one (set by the first states held)

    @property
    def held_bytes(self) -> int:
        return self.held_rows * self.row_bytes

    def append_plain_step(self, rids: list[str], starts: list[int], states: torch.Tensor) -> None:
        """A plain step's states: states[i] of request rids[i] at position starts[i]."""
        self._note_row_bytes(states)
        self._journal.append(PlainStepStates(rids, starts, states))
        self._journaled.update(rids)
        self.held_rows += len(rids)

    def append(self, rid: str, start: int, states: torch.Tensor) -> None:
        """States of positions start .. start + len - 1 (replacing those held from start on)."""
        self._settle(rid)
        self._append(rid, start, states)

    def count(self, rid: str) -> int:
        """States held for the request (0 if none)."""
        self._settle(rid)
        held = self._states.get(rid)
        return 0 if held is None else held.count

    def end(self, rid: str) -> int:
        """The position after the last state held for the request (0 if none)."""
        self._settle(rid)
        held = self._states.get(rid)
        return 0 if held is None else held.first + held.count

    def rows(self, rid: str, start: int, end: int) -> torch.Tensor | None:
        """States of positions start .. end - 1, or None if some are missing."""
        self._settle(rid)
        held = self._states.get(rid)
        if held is None or start < held.first or end > held.first + held.count:
            return None
        return held.joined()[start - held.first:end - held.first]

    def drop_before(self, rid: str, position: int) -> None:
        self._settle(rid)
        held = self._states[rid]
        if position > held.first:
            held.parts = [held.joined()[position - held.first:]]
            held.count -= position - held.first
            self.held_rows -= position - held.first
            held.first = position

    def release(self, rid: str) -> None:
        journaled = self._journaled.pop(rid, 0)
        if journaled:    # its journal rows are skipped when the journal is split
            self._released_at[rid] = len(self._journal)
            self.held_rows -= journaled
            if not self._journaled:   # no request's rows are left in it
                self._journal, self._released_at = [], {}
        held = self._states.pop(rid, None)
        if held is not None:
            self.held_rows -= held.count

    def _note_row_bytes(self, states: torch.Tensor) -> None:
        if not self.row_bytes:
            self.row_bytes = states[0].numel() * states.element_size()

    def _append(self, rid: str, start: int, states: torch.Tensor) -> None:
        self._note_row_bytes(states)
        held = self._states.get(rid)
        if held is None or not held.first <= start <= held.first + held.count:
            self.held_rows += len(states) - (0 if held is None else held.count)
            self._states[rid] = HeldStates(start, len(states), [states])
            return
        if start < held.first + held.count:   # positions from start on are replaced
            held.parts = [held.joined()[:start - held.first]]
            self.held_rows -= held.count - (start - held.first)
            held.count = start - held.first
        held.parts.append(states)
        held.count += len(states)
        self.held_rows += len(states)

    def _settle(self, rid: str) -> None:
        """Splits the journal per request, if the request has rows in it."""
        if rid in self._journaled:
            self._split_journal()

    def _split_journal(self) -> None:
        journal, released_at = self._journal, self._released_at
        self.held_rows -= sum(self._journaled.values())   # _append counts them again
        self._journal, self._released_at = [], {}
        self._journaled.clear()
        rids = list(itertools.chain.from_iterable(step.rids for step in journal))
        codes = {rid: code for code, rid in enumerate(dict.fromkeys(rids))}   # in order of first appearance
        code = np.fromiter(map(codes.__getitem__, rids), dtype=np.int64, count=len(rids))
        step_of = np.repeat(np.arange(len(journal)), [len(step.rids) for step in journal])
        starts = np.fromiter(itertools.chain.from_iterable(step.starts for step in journal), dtype=np.int64,
                             count=len(rids))
        order = np.lexsort((step_of, code))              # by request, then in the order the steps came
        states = torch.cat([step.states for step in journal])
        states = states.index_select(0, host_to_device_async(torch.from_numpy(order), states.device))
        code, step_of, starts = code[order], step_of[order], starts[order]
        bounds = np.flatnonzero(np.diff(code)) + 1
        for rid, begin, end in zip(codes, np.concatenate([[0], bounds]).tolist(),
                                   np.concatenate([bounds, [len(code)]]).tolist()):
            begin += int(np.searchsorted(step_of[begin:end], released_at.get(rid, 0)))   # before its release: not its
            if begin == end:
                continue
            if starts[end - 1] - starts[begin] == end - begin - 1:   # one run of positions, as plain steps make
                self._append(rid, int(starts[begin]), states[begin:end])
            else:
                for row in range(begin, end):
                    self._append(rid, int(starts[row]), states[row:row + 1])
