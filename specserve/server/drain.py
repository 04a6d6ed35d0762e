"""Ending in-flight requests cleanly when the server shuts down.

On SIGTERM (or a first Ctrl-C) uvicorn stops accepting connections and waits for the open
ones to finish. A chat without `max_tokens` may run for minutes, so that wait is bounded:
once `--graceful-shutdown-timeout` has passed (or at a second Ctrl-C) `Drain.cut` ends every
request still waiting on the engine. Each wait on the engine runs inside a `cuttable()`
scope; a cut cancels the waits (which aborts their engine requests and frees their KV
slots) and turns them into a 503 APIError, which a stream sends as an error event followed
by `data: [DONE]` and a non-streaming request as its JSON error. Nothing is cut mid-write,
so every client gets a complete HTTP response.
"""
from __future__ import annotations

import asyncio
import logging
import math

from specserve.server.protocol import APIError

logger = logging.getLogger("specserve")


class Drain:
    def __init__(self):
        self._waits: set[_CuttableWait] = set()   # the waits on the engine under way now
        self.cut_message: str | None = None        # set once requests are cut

    def cuttable(self) -> "_CuttableWait":
        """`async with drain.cuttable(): await <the engine>`; raises a 503 APIError if cut."""
        return _CuttableWait(self)

    def begin(self, timeout_s: float | None) -> None:
        """The server starts shutting down: cut what is still running after `timeout_s` (never
        when None or infinite). Called on the event loop."""
        if timeout_s is not None and math.isfinite(timeout_s):
            asyncio.get_running_loop().call_later(
                timeout_s, self.cut, f"the server is shutting down: the request was still running after the "
                                     f"{timeout_s:g} s graceful-shutdown timeout")

    def cut(self, message: str = "the server is shutting down: the request was cut short") -> None:
        """Ends every wait on the engine now, and any that starts later, with `message`."""
        if self.cut_message is not None:
            return
        self.cut_message = message
        if self._waits:
            logger.warning("ending %d in-flight request wait(s): %s", len(self._waits), message)
        for wait in self._waits:
            wait.cut = True
            wait.task.cancel()

    def error(self) -> APIError:
        return APIError(self.cut_message or "the server is shutting down", 503, type="server_error")


class _CuttableWait:
    """A cancel scope around one wait (asyncio.timeout's idea, at a third of its cost a
    chunk): a cut cancels the task, and the cancellation, which can only land on an await
    inside the scope, leaves it as the drain's APIError. Only the wait itself is inside,
    never a write to the client, so a cut cannot land mid-write."""

    __slots__ = ("drain", "task", "cut")

    def __init__(self, drain: Drain):
        self.drain = drain
        self.cut = False

    async def __aenter__(self) -> None:
        if self.drain.cut_message is not None:
            raise self.drain.error()
        self.task = asyncio.current_task()
        self.drain._waits.add(self)

    async def __aexit__(self, exc_type, exc, traceback) -> bool:
        self.drain._waits.discard(self)
        if self.cut and exc_type is asyncio.CancelledError:
            uncancel = getattr(self.task, "uncancel", None)   # Python 3.11+: count the cancellation as handled
            if uncancel is None or uncancel() == 0:          # not also cancelled by someone else
                raise self.drain.error() from None
        return False
