"""Step events: what a profiler hears of each engine step, without touching the core's parts.

EngineCore.step and the step pipelines call `StepEvents`, which passes each event to the
listeners added to `core.events`; with none an event is a loop over an empty list. A step
is "prefill", "plain" (a decode step of one node a request) or "draft" (a decode step with
draft nodes); it is known once the step is launched.

    began -> scheduled(batch) -> launched(kind, nodes, from_ahead) -> read -> committed(outputs) -> ended

A step with nothing to run sends `began` and `ended` only; one that raises sends `ended`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from specserve.engine.step_output import StepOutput
    from specserve.request.req import Batch

StepKind = Literal["prefill", "plain", "draft"]


class StepListener:
    """A profiler of engine steps: every event a no-op here, so a listener overrides only
    what it needs."""

    def step_began(self) -> None:
        """EngineCore.step was called; it schedules next."""

    def step_scheduled(self, batch: Batch) -> None:
        """The step's batch (also a drafting step launched ahead that a new batch retires)."""

    def step_launched(self, kind: StepKind, nodes: int, from_ahead: bool) -> None:
        """The step's drafts and forward are on the device: `nodes` per request (1 unless it
        drafts); `from_ahead`: it was launched before the step before it was done."""

    def step_read(self) -> None:
        """Its outcome is on the host: the step's one wait for the device is over."""

    def step_committed(self, outputs: list[StepOutput]) -> None:
        """Its tokens committed to their requests."""

    def step_ended(self) -> None:
        """EngineCore.step returns or raises."""


class StepEvents:
    """The core's listeners, and each event sent to all of them in the order they were added."""

    def __init__(self) -> None:
        self.listeners: list[StepListener] = []

    def add(self, listener: StepListener) -> None:
        self.listeners.append(listener)

    def remove(self, listener: StepListener) -> None:
        self.listeners.remove(listener)

    def began(self) -> None:
        for listener in self.listeners:
            listener.step_began()

    def scheduled(self, batch: Batch) -> None:
        for listener in self.listeners:
            listener.step_scheduled(batch)

    def launched(self, kind: StepKind, nodes: int = 1, from_ahead: bool = False) -> None:
        for listener in self.listeners:
            listener.step_launched(kind, nodes, from_ahead)

    def read(self) -> None:
        for listener in self.listeners:
            listener.step_read()

    def committed(self, outputs: list[StepOutput]) -> None:
        for listener in self.listeners:
            listener.step_committed(outputs)

    def ended(self) -> None:
        for listener in self.listeners:
            listener.step_ended()
