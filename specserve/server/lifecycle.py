"""How the server ends: ServingServer is uvicorn's Server, plus

- a bounded drain: on SIGTERM or Ctrl-C uvicorn stops accepting connections and waits for the
  open ones; requests still running after `--graceful-shutdown-timeout` end with an error
  (drain.py), and a second Ctrl-C ends them at once (a third stops waiting for their
  connections, as uvicorn's second Ctrl-C does);
- an exit once the engine has stopped (its process died, say): the server answers 503 for
  ENGINE_STOPPED_EXIT_DELAY_S (health checks and in-flight clients learn it), then exits with
  ENGINE_STOPPED_EXIT_CODE, so that a supervisor restarts it.
"""
from __future__ import annotations

import asyncio
import logging
import math
import signal
import time

import uvicorn

logger = logging.getLogger("specserve")
ENGINE_STOPPED_EXIT_CODE = 1
ENGINE_STOPPED_EXIT_DELAY_S = 5.0
# after the graceful-shutdown timeout's cut, how long uvicorn still waits for a connection (a
# client that reads nothing) before it cancels the connection's task
STUCK_CONNECTION_S = 10.0


def stuck_connection_timeout(graceful_shutdown_timeout: float | None) -> float | None:
    """uvicorn's own graceful-shutdown timeout: a backstop after ours."""
    if graceful_shutdown_timeout is None or not math.isfinite(graceful_shutdown_timeout):
        return None
    return graceful_shutdown_timeout + STUCK_CONNECTION_S


class ServingServer(uvicorn.Server):
    """uvicorn's Server, plus the drain at shutdown, the second Ctrl-C and the exit once the
    engine has stopped (the module docstring)."""

    def __init__(self, config, state, graceful_shutdown_timeout: float | None):
        super().__init__(config)
        self.state = state
        self.graceful_shutdown_timeout = graceful_shutdown_timeout
        self.engine_stopped_at: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cut_requested = False
        self.interrupted = False   # a Ctrl-C came: the process ends as interrupted (exit status 130)

    async def on_tick(self, counter: int) -> bool:
        """Every 0.1 s on the event loop (uvicorn's main loop)."""
        self._loop = self._loop or asyncio.get_running_loop()
        if self.state.engine_stopped and not self.should_exit:
            now = time.monotonic()
            if self.engine_stopped_at is None:
                self.engine_stopped_at = now
                logger.error("the engine stopped (%s): answering 503 for %.0f s, then exiting with code %d so that "
                             "a supervisor can restart the server", self.state.engine.fatal_error,
                             ENGINE_STOPPED_EXIT_DELAY_S, ENGINE_STOPPED_EXIT_CODE)
            elif now - self.engine_stopped_at >= ENGINE_STOPPED_EXIT_DELAY_S:
                self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        self.state.drain.begin(self.graceful_shutdown_timeout)
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """A signal handler (the main thread, between two bytecodes of the event loop's)."""
        self.interrupted = self.interrupted or sig == signal.SIGINT
        if self.should_exit and sig == signal.SIGINT and not self._cut_requested and self._loop is not None:
            self._cut_requested = True   # the second Ctrl-C: end the running requests now, cleanly
            self._loop.call_soon_threadsafe(self.state.drain.cut, "the server is shutting down (interrupted)")
            return
        super().handle_exit(sig, frame)
