"""LoopMailboxes: hand items from the engine's thread to asyncio queues, waking each event
loop once per step instead of once per item.

`loop.call_soon_threadsafe` writes to the loop's self-pipe on every call: a system call on
the step loop's thread, and a wake-up, a read and a pass of the loop on the serving thread.
A step that streams a token to each of 64 requests made 64 of each. Through a mailbox the
step's items wait in one deque per loop, and after the step the engine wakes each loop that
has mail once; one callback there moves them all, in the order they were posted (so each
request's chunks keep their order).
"""
from __future__ import annotations

import asyncio
import collections
import threading
from typing import Any


class LoopMailbox:
    """The mail of one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: collections.deque[tuple[asyncio.Queue, Any]] = collections.deque()
        self._scheduled = False

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        """From the engine's thread: `queue.put_nowait(item)` on the loop at the next `wake`."""
        self._items.append((queue, item))   # deque appends and pops are atomic

    def wake(self) -> None:
        """Schedules the delivery of what was posted, unless one is already scheduled."""
        if self._items and not self._scheduled:
            self._scheduled = True
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:   # the loop is closed: nobody is left to read the items
                self._items.clear()

    def _deliver(self) -> None:
        # cleared before draining: an item posted during the drain is either drained here or
        # delivered by the next wake, never left behind
        self._scheduled = False
        items = self._items
        while items:
            queue, item = items.popleft()
            queue.put_nowait(item)


class LoopMailboxes:
    """One mailbox per event loop that has streams open on the engine."""

    def __init__(self):
        self._lock = threading.Lock()
        self._boxes: tuple[LoopMailbox, ...] = ()   # replaced whole, so the engine thread reads it unlocked

    def of(self, loop: asyncio.AbstractEventLoop) -> LoopMailbox:
        with self._lock:
            for box in self._boxes:
                if box.loop is loop:
                    return box
            box = LoopMailbox(loop)
            # closed loops (a finished asyncio.run) have nothing left to read their mail
            self._boxes = tuple(b for b in self._boxes if not b.loop.is_closed()) + (box,)
            return box

    def wake_all(self) -> None:
        """From the engine's thread, after a step (or anything else that posted)."""
        for box in self._boxes:
            box.wake()
