"""HostPhases: where a step's host time goes, by phase, and how long the host waited for the GPU.

A plain decode step on the overlap schedule costs its GPU time only while the host's work
between reading one step and launching the one after next fits inside it. Where it does
not (a 0.5B at concurrency 64 on an H200: ~1.7 ms a step), every microsecond of host work
is step time, and the NGRAM configuration's plain steps cost 17-22% more than a plain
engine's with no CPU replay able to say where: a loaded 2-core CPU is not the GPU
machine's host. This measures it there, in the timed runs themselves.

The phases of a step come from the core's step events (engine/step_events.py), each the
time between two of them: `schedule` (the scheduler's pick), `launch` (the pipeline's
choice, the drafts and the forward launched; `launch_cpu`: this thread's CPU time in it,
less than its wall time where it waited for the GIL or the device), `read` (the outcome:
the wait for the device, the sampler's work; in a prefill, first the plain step it kept,
read and committed while the prefill runs), `commit` (KV, tokens, the drafter and the
policy shown them, a step launched ahead), `after` (the rest of the step: the statistics)
and `step` (the whole). Timed besides, as the
device's or the drafter's own calls: the time blocked on a step's outcome (`InFlight.wait`:
the GPU is behind the host), every CUDA event wait (`event_sync`), CUDA's graph launch
(`graph_launch`) and an n-gram drafter's wait for its writer thread's indexing (`drain`).
Totals are kept per kind of step.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch

from specserve.engine.step_events import StepListener
from specserve.runner.model_runner import InFlight


class HostPhases(StepListener):
    def __init__(self, core):
        self.core = core
        self._restore = []
        self._step: defaultdict[str, float] = defaultdict(float)      # the step in progress
        self.totals: dict[str, defaultdict[str, float]] = {}            # kind -> phase -> seconds
        self.steps: defaultdict[str, int] = defaultdict(int)
        self._kind = None
        self._began = self._last = self._cpu = 0.0
        writer = getattr(getattr(core, "drafter", None), "writer", None)
        if writer is not None:
            self._wrap(writer, "drain", "drain", writer.drain)
        self._wrap(InFlight, "wait", "gpu_wait", InFlight.wait)
        if torch.cuda.is_available():
            self._wrap(torch.cuda.Event, "synchronize", "event_sync", torch.cuda.Event.synchronize)
            self._wrap(torch.cuda.CUDAGraph, "replay", "graph_launch", torch.cuda.CUDAGraph.replay)
        core.events.add(self)

    def _wrap(self, owner, name: str, phase: str, method) -> None:
        spent = self._step

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - start
        # put back as found: a class's method, or an instance's own attribute; an attribute
        # the instance did not have is deleted again
        own = isinstance(owner, type) or name in vars(owner)
        setattr(owner, name, timed)
        self._restore.append((owner, name, method if own else None))

    # --- the step events ---
    def step_began(self) -> None:
        self._kind = None
        self._began = self._last = time.perf_counter()

    def _phase(self, phase: str) -> None:
        """The phase that ends now, begun at the event before."""
        now = time.perf_counter()
        self._step[phase] += now - self._last
        self._last = now

    def step_scheduled(self, batch) -> None:
        self._phase("schedule")
        self._cpu = time.thread_time()

    def step_launched(self, kind, nodes, from_ahead) -> None:
        self._phase("launch")
        self._step["launch_cpu"] += time.thread_time() - self._cpu
        self._kind = kind

    def step_read(self) -> None:
        self._phase("read")

    def step_committed(self, outputs) -> None:
        self._phase("commit")

    def step_ended(self) -> None:
        self._phase("after")
        self.end_step(self._kind, self._last - self._began)   # the phases' own clock: they sum to the step

    def end_step(self, kind: str | None, seconds: float) -> None:
        """The step just run was of `kind` (None: nothing ran) and took `seconds` of wall time."""
        if kind is not None:
            totals = self.totals.setdefault(kind, defaultdict(float))
            for phase, spent in self._step.items():
                totals[phase] += spent
            totals["step"] += seconds
            self.steps[kind] += 1
        self._step.clear()

    def reset(self) -> None:
        self.totals.clear()
        self.steps.clear()
        self._step.clear()

    def summary(self) -> dict:
        """Microseconds per step, by kind and phase; `host` is the step's wall time less its
        wait for the GPU (what the host did while the GPU ran, or idled)."""
        out = {}
        for kind, totals in self.totals.items():
            steps = self.steps[kind]
            per_step = {phase: round(spent * 1e6 / steps, 1) for phase, spent in sorted(totals.items())}
            per_step["host"] = round((totals["step"] - totals.get("gpu_wait", 0.0)) * 1e6 / steps, 1)
            out[kind] = per_step
        return out

    def close(self) -> None:
        if self in self.core.events.listeners:
            self.core.events.remove(self)
        for owner, name, method in reversed(self._restore):
            if method is None:
                delattr(owner, name)
            else:
                setattr(owner, name, method)
        self._restore.clear()
