"""FailureIsolation: runs the engine's steps so that a step that raises because of one
request fails that request alone.

A step runs many requests together, so when it raises, the culprit is unknown. The
requests of the failed step become suspects and run one per step (the scheduler's
`focus`) until each has run a step alone: one whose solo step raises again is failed, the
others go on with their cache intact (a failed step commits nothing: the core frees the
slots it had allocated, and `trim_kv` drops slots committed ahead of their tokens by a
failure halfway through a commit). Meanwhile nobody else runs; suspects are few and each
is one step, so the pause is short. A failure that does not come back (a transient one)
costs nobody anything.
"""
from __future__ import annotations

import collections
import logging
import time

from specserve.engine.core import EngineCore
from specserve.engine.output import OutputTracker
from specserve.errors import EngineFatalError
from specserve.request.req import Req

logger = logging.getLogger("specserve")


class FailureIsolation:
    def __init__(self, core: EngineCore, tracker: OutputTracker):
        self.core, self.tracker = core, tracker
        self.suspects: collections.deque[Req] = collections.deque()

    def step(self) -> None:
        """Runs one step (a suspect's alone, while there are any) and publishes its outputs."""
        scheduler = self.core.scheduler
        suspect = self._next_suspect()
        scheduler.focus = [suspect] if suspect is not None else None
        self.core.last_batch_reqs = []
        start = time.perf_counter()
        try:
            outputs = self.core.step()
        except EngineFatalError:
            raise   # no request is to blame and no later step can run: the engine stops
        except Exception as error:
            self._after_failure(error, alone=suspect is not None)
            return
        finally:
            scheduler.focus = None
        if suspect is None:   # a lone suspect's step says nothing about the usual step time
            scheduler.record_step_time(time.perf_counter() - start)
        self.tracker.publish(outputs)

    def _next_suspect(self) -> Req | None:
        while self.suspects:
            req = self.suspects.popleft()
            if not req.finished:
                return req
        return None

    def _after_failure(self, error: Exception, alone: bool) -> None:
        batch = list(self.core.last_batch_reqs)
        if not batch:   # it failed before it had a batch: no narrower set of requests to blame
            batch = list(self.core.requests.values())
        live = []
        for req in batch:
            if req.finished:      # its commit ran before the failure
                self.tracker.publish_final(req)
            else:
                self.core.scheduler.trim_kv(req)
                live.append(req)
        if alone or len(live) <= 1:
            logger.error("a step failed; failing request(s) %s: %s: %s",
                         [r.rid for r in live], type(error).__name__, error, exc_info=error)
            self.tracker.fail(live, error)
            return
        logger.warning("a step of %d requests failed (%s: %s); running them one at a time to find the cause",
                       len(live), type(error).__name__, error)
        self.suspects.extend(live)
